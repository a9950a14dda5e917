"""Multi-process costs on loopback (2 processes x 4 fake CPU devices, gloo).

Measures, for activation-sized arrays (256 KiB .. 16 MiB float32):
* in-process ``jax.device_put`` from one submesh to another (one process, 8 devices);
* cross-process transfer by a ``ppermute`` inside ``jax.shard_map`` over a mesh spanning
  one device of each process (the collective path a cross-process pipeline stage
  transfer would take);
and the step time of the same data-parallel ``hetshard.jit`` plan (gpt-tiny, batch 8)
on 8 devices in one process vs 2 processes x 4 devices.

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
    import hetshard.distributed as hd
    hd.init_distributed()
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import hetshard
    import models
    from hetshard.cost.profile import profile_model
    from hetshard.solver.uniform import parse_fix, uniform_plan
    from models import data
    out = {}
    devs = jax.devices()
    if mode == "transfer":
        pair = Mesh(np.array([devs[0], devs[len(devs) // 2]]), ("pair",))
        shift = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "pair", [(0, 1), (1, 0)]),
                                      mesh=pair, in_specs=P("pair"), out_specs=P("pair")))
        for kib in SIZES_KIB:
            n = kib * 256  # float32 elements
            x = jax.device_put(np.ones((2, n), np.float32), NamedSharding(pair, P("pair")))
            shift(x).block_until_ready()
            times = []
            for _ in range(REPEATS):
                t = time.perf_counter()
                shift(x).block_until_ready()
                times.append(time.perf_counter() - t)
            out[f"{kib}"] = _median(times)
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
    else:  # step
        cluster = hetshard.Cluster.from_jax_devices()
        prof = profile_model("gpt-tiny", 16, "float32")
        plan = uniform_plan("gpt-tiny", prof, cluster, global_batch=8, seq_len=16,
                            fix=parse_fix("dp=8,tp=1,pp=1"), dtype="float32")
        model = models.build("gpt-tiny", rngs=0)
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        def loss_fn(model, batch):
            logits = model(batch["tokens"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["targets"]).mean()

        @hetshard.jit(cluster=cluster, plan=plan)
        def step(model, optimizer, batch):
            loss, grads = hetshard.value_and_grad(loss_fn)(model, batch)
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
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def _run(cmd, env):
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    found = [line for line in res.stdout.splitlines() if "RESULT " in line]
    if res.returncode or not found:
        raise SystemExit(f"{cmd} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return json.loads(found[0].split("RESULT ", 1)[1])


def main() -> int:
    os.makedirs(RESULTS, exist_ok=True)
    me = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    one = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    launch = [sys.executable, "-m", "hetshard", "launch", "--nprocs", "2",
              "--devices-per-proc", "4", "--", sys.executable, me, "--worker"]
    local = _run([sys.executable, me, "--worker", "local_transfer"], one)
    remote = _run(launch + ["transfer"], env)
    step_one = _run([sys.executable, me, "--worker", "step"], one)
    step_two = _run(launch + ["step"], env)
    rows = []
    for kib in SIZES_KIB:
        nbytes = kib * 1024
        rows.append({"bytes": nbytes,
                     "in_process_device_put_s": local[str(kib)],
                     "in_process_gbs": nbytes / local[str(kib)] / 1e9,
                     # the ppermute moves one buffer each way between the two processes
                     "cross_process_ppermute_s": remote[str(kib)],
                     "cross_process_gbs": nbytes / remote[str(kib)] / 1e9})
    result = {"transfers": rows,
              "latency_in_process_s": local[str(SIZES_KIB[0])],
              "latency_cross_process_s": remote[str(SIZES_KIB[0])],
              "dp_step_one_process_s": step_one["step_s"],
              "dp_step_two_processes_s": step_two["step_s"],
              "dp_step_ratio": step_two["step_s"] / step_one["step_s"],
              "note": "2-process pipeline step not measured: cross-process stage transfers "
                      "are not implemented yet (issue 7)"}
    path = os.path.join(RESULTS, "multihost_bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    for r in rows:
        local_ms = r["in_process_device_put_s"] * 1e3
        print(f"{r['bytes'] / 1024:>8.0f} KiB  device_put {local_ms:8.2f} ms"
              f" ({r['in_process_gbs']:.2f} GB/s)   ppermute across processes "
              f"{r['cross_process_ppermute_s'] * 1e3:8.2f} ms ({r['cross_process_gbs']:.2f} GB/s)")
    print(f"data-parallel step: one process {step_one['step_s'] * 1e3:.1f} ms, two processes "
          f"{step_two['step_s'] * 1e3:.1f} ms (ratio {result['dp_step_ratio']:.2f})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        sys.exit(main())
