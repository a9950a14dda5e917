"""Multi-process costs on loopback (2 processes x 4 fake CPU devices, gloo).

Measures, for activation-sized arrays (256 KiB .. 16 MiB float32) split over 4 devices:
* in-process ``jax.device_put`` from one 4-device submesh to another (one process);
* across processes (4 devices of process 0 to 4 of process 1), the two ways JAX offers:
  ``hetshard.collectives.transfer`` (a ``ppermute`` inside ``jax.shard_map`` over the two
  submeshes stacked into one mesh: what the runtime uses) and JAX's cross-host
  ``jax.device_put`` (``jax_cross_host_transfer_socket_address``); each timed on the
  receiver, with a host barrier between repetitions;
and step times of the same ``hetshard.jit`` plans (gpt-tiny, batch 8) in one process with
8 devices vs 2 processes x 4 devices: a data-parallel plan over all 8 devices, and a
2-stage pipeline (4 micro-batches, 1F1B) with one stage per process.

Usage: python experiments/multihost_bench.py   (writes results/multihost_bench.json)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")
SIZES_KIB = (256, 1024, 4096, 16384)
REPEATS = 10


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def worker(mode: str) -> None:
    """Runs inside a process (one of two under launch, or alone with 8 devices)."""
    if mode == "xhost_transfer":  # must precede the backend's start
        import jax
        ports = os.environ["HETSHARD_BENCH_XPORTS"].split(",")
        rank = int(os.environ["HETSHARD_PROCESS_ID"])
        jax.config.update("jax_cross_host_transfer_socket_address",
                          f"127.0.0.1:{ports[rank]}")
    import hetshard.distributed as hd
    hd.init_distributed()
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import hetshard
    import hetshard_models as models
    from hetshard.solver.uniform import parse_fix, uniform_plan
    from hetshard_models import data, losses
    from hetshard_models import profile as profile_model
    out = {}
    devs = jax.devices()
    if mode in ("transfer", "xhost_transfer"):
        from jax._src import distributed as jd

        from hetshard.collectives import transfer
        rank = jax.process_index()
        src = Mesh(np.array([d for d in devs if d.process_index == 0]), ("d",))
        dst = Mesh(np.array([d for d in devs if d.process_index == 1]), ("d",))
        for kib in SIZES_KIB:
            n = kib * 256
            s_sh, d_sh = NamedSharding(src, P("d")), NamedSharding(dst, P("d"))
            aval = jax.ShapeDtypeStruct((n,), np.float32)
            x = (jax.device_put(np.ones(n, np.float32), s_sh) if rank == 0 else
                 jax.make_array_from_single_device_arrays((n,), s_sh, [], dtype=np.float32))

            def once(x=x, s_sh=s_sh, d_sh=d_sh, aval=aval):
                if mode == "xhost_transfer":
                    y = jax.device_put(x, d_sh)
                else:
                    y = transfer([x] if rank == 0 else None, [aval], [s_sh], [d_sh])
                    y = None if y is None else y[0]
                if y is not None:
                    y.block_until_ready()
            times = []
            for k in range(REPEATS + 1):
                jd.global_state.client.wait_at_barrier(f"{mode}-{kib}-{k}", 60_000)
                t = time.perf_counter()
                once()
                times.append(time.perf_counter() - t)
            if rank == 1:
                out[f"{kib}"] = _median(times[1:])
        if rank == 1:
            print("RESULT " + json.dumps(out), flush=True)
        return
    elif mode == "local_transfer":
        a = Mesh(np.array(devs[:4]), ("d",))
        b = Mesh(np.array(devs[4:]), ("d",))
        for kib in SIZES_KIB:
            n = kib * 256
            x = jax.device_put(np.ones((4, n // 4), np.float32), NamedSharding(a, P("d")))
            dst = NamedSharding(b, P("d"))
            jax.device_put(x, dst).block_until_ready()
            times = []
            for _ in range(REPEATS):
                t = time.perf_counter()
                jax.device_put(x, dst).block_until_ready()
                times.append(time.perf_counter() - t)
            out[f"{kib}"] = _median(times)
    else:  # step / pp_step
        from hetshard._plan import Pipeline, Plan, Stage
        cluster = hetshard.Cluster.from_jax_devices()
        if mode == "step":
            prof = profile_model("gpt-tiny", 16, "float32")
            plan = uniform_plan("gpt-tiny", prof, cluster, global_batch=8, seq_len=16,
                                fix=parse_fix("dp=8,tp=1,pp=1"))
        else:
            gpu = cluster.groups[0].gpu.name
            plan = Plan("gpt-tiny", cluster.to_dict(), 8, 16, (Pipeline((
                Stage(0, 2, (0, 1, 2, 3), gpu, (("data", 4),)),
                Stage(2, 4, (4, 5, 6, 7), gpu, (("data", 4),))), 8, 1, 2),))
        model = models.build("gpt-tiny", rngs=0)
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        @hetshard.jit(cluster=cluster, plan=plan)
        def step(model, optimizer, batch):
            loss, grads = hetshard.value_and_grad(losses.text_loss)(model, batch)
            optimizer.update(model, grads)
            return loss
        batch = data.text_batch(np.random.default_rng(0), 8, 16, 256)
        float(step(model, opt, batch))
        times = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            float(step(model, opt, batch))
            times.append(time.perf_counter() - t)
        out["step_s"] = _median(times)
        out["loss_after"] = float(step(model, opt, batch))
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def _run(cmd, env):
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    found = [line for line in res.stdout.splitlines() if "RESULT " in line]
    if res.returncode or not found:
        raise SystemExit(f"{cmd} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return json.loads(found[0].split("RESULT ", 1)[1])


def main() -> int:
    from hetshard.distributed import free_port
    os.makedirs(RESULTS, exist_ok=True)
    me = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    one = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    launch = [sys.executable, "-m", "hetshard", "launch", "--nprocs", "2",
              "--devices-per-proc", "4", "--", sys.executable, me, "--worker"]
    local = _run([sys.executable, me, "--worker", "local_transfer"], one)
    collective = _run(launch + ["transfer"], env)
    xhost = _run(launch + ["xhost_transfer"],
                 dict(env, HETSHARD_BENCH_XPORTS=f"{free_port()},{free_port()}"))
    steps = {}
    for mode in ("step", "pp_step"):
        steps[mode] = (_run([sys.executable, me, "--worker", mode], one),
                       _run(launch + [mode], env))
    rows = []
    for kib in SIZES_KIB:
        nbytes, key = kib * 1024, str(kib)
        rows.append({"bytes": nbytes,
                     "in_process_device_put_s": local[key],
                     "in_process_gbs": nbytes / local[key] / 1e9,
                     "cross_process_collective_s": collective[key],
                     "cross_process_collective_gbs": nbytes / collective[key] / 1e9,
                     "cross_process_device_put_s": xhost[key],
                     "cross_process_device_put_gbs": nbytes / xhost[key] / 1e9})
    (dp1, dp2), (pp1, pp2) = steps["step"], steps["pp_step"]
    result = {"transfers": rows,
              "latency_in_process_s": local[str(SIZES_KIB[0])],
              "latency_cross_process_collective_s": collective[str(SIZES_KIB[0])],
              "latency_cross_process_device_put_s": xhost[str(SIZES_KIB[0])],
              "runtime_uses": "collective (hetshard.collectives.transfer): see its docstring",
              "dp_step_one_process_s": dp1["step_s"],
              "dp_step_two_processes_s": dp2["step_s"],
              "dp_step_ratio": dp2["step_s"] / dp1["step_s"],
              "pp_step_one_process_s": pp1["step_s"],
              "pp_step_two_processes_s": pp2["step_s"],
              "pp_step_ratio": pp2["step_s"] / pp1["step_s"],
              "pp_loss_one_process": pp1["loss_after"],
              "pp_loss_two_processes": pp2["loss_after"]}
    path = os.path.join(RESULTS, "multihost_bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    for r in rows:
        print(f"{r['bytes'] / 1024:>8.0f} KiB  in-process device_put "
              f"{r['in_process_device_put_s'] * 1e3:7.2f} ms   across processes: collective "
              f"{r['cross_process_collective_s'] * 1e3:7.2f} ms "
              f"({r['cross_process_collective_gbs']:.2f} GB/s), cross-host device_put "
              f"{r['cross_process_device_put_s'] * 1e3:7.2f} ms "
              f"({r['cross_process_device_put_gbs']:.2f} GB/s)")
    for name, (a, b) in (("data-parallel", steps["step"]), ("2-stage pipeline", steps["pp_step"])):
        print(f"{name} step: one process {a['step_s'] * 1e3:.1f} ms, two processes "
              f"{b['step_s'] * 1e3:.1f} ms (ratio {b['step_s'] / a['step_s']:.2f}; "
              f"losses {a['loss_after']:.6f} / {b['loss_after']:.6f})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        sys.exit(main())
