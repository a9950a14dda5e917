"""One GPU: what host offload really costs (issue 55), against what hetshard prices.

1. **Host link.** A device array copied to the GPU's pinned host memory and back
   (``jax.device_put`` to a ``pinned_host`` sharding, then to ``device``), 64 MB and
   512 MB, best of 5 each way: GB/s per direction, and its share of the catalog's
   ``host_link_gbs`` for this GPU type (what ``Efficiency.host_link_eff``, 0.8 by
   assumption, stands for).
2. **An offloaded step.** A zoo GPT (``--model``) under ``@hetshard.jit`` on this one GPU
   with a pinned single-stage plan, three ways: no offload, ``optimizer``, and
   ``selective`` remat with ``optimizer+activations``. For each: the step time (best of
   ``--steps`` dispatched back to back, after a warm-up), the device's peak memory
   (``memory_stats()["peak_bytes_in_use"]``, reset is not possible: the runs go from the
   smallest expected peak up), the memory kind the optimizer state ends in, and the
   simulator's price of the same plan (step time, peak memory).

Without a GPU it writes that nothing was measured; ``--tiny`` runs a small model and
small copies on CPU (memory kinds exist there, copies are memcpy) to check the script:
its numbers mean nothing.

Usage: python experiments/offload_gpu.py [--tiny] [--model gpt-1.3b] [--steps 5]
Writes experiments/results/offload_gpu.json (--tiny: offload_gpu_tiny.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def host_link(sizes_mb) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from hetshard.cluster.catalog import device_type_for_kind
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh([device], ("x",))
    on_device = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
    on_host = on_device.with_memory_kind("pinned_host")
    rows = []
    for mb in sizes_mb:
        x = jax.device_put(jnp.ones((mb * 2 ** 20 // 4,), jnp.float32), on_device)
        best = {"to_host": float("inf"), "to_device": float("inf")}
        for _ in range(5):
            t = time.perf_counter()
            h = jax.device_put(x, on_host).block_until_ready()
            best["to_host"] = min(best["to_host"], time.perf_counter() - t)
            t = time.perf_counter()
            jax.device_put(h, on_device).block_until_ready()
            best["to_device"] = min(best["to_device"], time.perf_counter() - t)
        nbytes = x.size * 4
        try:
            catalog = device_type_for_kind(device.device_kind).host_link_gbs
        except Exception:  # a device the catalog does not know (CPU under --tiny)
            catalog = None
        row = {"mb": mb, "memory_kind": h.sharding.memory_kind}
        for way, s in best.items():
            row[f"{way}_gbs"] = nbytes / s / 1e9
            row[f"{way}_share_of_catalog"] = nbytes / s / 1e9 / catalog if catalog else None
        rows.append(row)
    return rows


def offloaded_steps(model_name: str, seq: int, batch: int, steps: int) -> list[dict]:
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import hetshard
    import hetshard_models as models
    from hetshard.cluster import Cluster
    from hetshard.sim import simulate
    from hetshard.solver.uniform import parse_fix, uniform_plan
    from hetshard_models import data, losses
    from hetshard_models import profile as profile_model

    cluster = Cluster.from_jax_devices(jax.devices()[:1])
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    prof = profile_model(model_name, seq, dtype)
    rng = np.random.default_rng(0)
    cfg = models.resolve(model_name)
    batches = [data.text_batch(rng, batch, seq, cfg.vocab) for _ in range(2)]
    rows = []
    for fix in ("dp=1,tp=1,pp=1", "dp=1,tp=1,pp=1,offload=optimizer",
                "dp=1,tp=1,pp=1,remat=selective,offload=optimizer+activations"):
        plan = uniform_plan(model_name, prof, cluster, global_batch=batch, seq_len=seq,
                            fix=parse_fix(fix))
        priced = simulate(plan, prof, cluster)
        model = models.build(model_name, rngs=0)
        opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

        @hetshard.jit(cluster=cluster, plan=plan, quiet=True)
        def step(model, optimizer, batch):
            loss, grads = hetshard.value_and_grad(losses.text_loss)(model, batch)
            optimizer.update(model, grads)
            return loss
        jax.block_until_ready(step(model, opt, batches[0]))
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            for i in range(steps):
                loss = step(model, opt, batches[i % 2])
            jax.block_until_ready(loss)
            best = min(best, (time.perf_counter() - t) / steps)
        stats = jax.devices()[0].memory_stats() or {}
        rows.append({"fix": fix, "step_s": best, "priced_step_s": priced.step_time_s,
                     "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                     "priced_peak_bytes": priced.peak_memory_bytes,
                     "priced_host_bytes": priced.host_memory_per_node,
                     "optimizer_memory_kinds": sorted({x.sharding.memory_kind for x in
                                                       jax.tree.leaves(nnx.state(
                                                           opt.opt_state))}),
                     "loss": float(loss)})
        del model, opt, step
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(HERE))
    import jax
    out = os.path.join(HERE, "results", "offload_gpu_tiny.json" if args.tiny else
                       "offload_gpu.json") if args.out is None else args.out
    backend = jax.default_backend()
    result = {"gpu": jax.devices()[0].device_kind, "backend": backend, "jax": jax.__version__,
              "tiny": args.tiny}
    if backend != "gpu" and not args.tiny:
        result["measured"] = False
        result["why"] = "no GPU: nothing measured (--tiny checks the script on CPU)"
    else:
        if args.tiny:
            args.model, args.seq, args.batch, args.steps = "gpt-tiny", 16, 4, 2
        result["host_link"] = host_link([4] if args.tiny else [64, 512])
        result["steps"] = offloaded_steps(args.model, args.seq, args.batch, args.steps)
        result["measured"] = backend == "gpu"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
