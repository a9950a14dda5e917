"""Attention memory (and, on a GPU, speed): the Pallas flash kernel vs the XLA reference.

Memory: compiled temporary bytes (``compiled.memory_analysis().temp_size_in_bytes``) of a
jitted forward + backward (``jax.grad`` of the summed output) for sequence lengths
1k..16k, batch 1, 8 heads, head_dim 64, float32, causal. Only compilation happens, so
this runs on CPU too (the kernel in interpret mode, whose lowering keeps the same
blockwise buffers). Target (issue 6): flash grows linearly in S, and at S=8192 uses at
most 1/8 of the reference's temporary memory.

Speed (only where a GPU is present; this project must not need one): forward + backward
time vs ``jax.experimental.pallas.ops.gpu.attention.mha`` and the reference, S=1k..16k,
head_dim 64 and 128, causal and not. Without a GPU the speed section records that it
was not measured.

Usage: python experiments/attention_bench.py
Writes experiments/results/attention_bench.json and attention_bench.png.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from hetshard.kernels import attention_reference, flash_attention  # noqa: E402

SEQS = (1024, 2048, 4096, 8192, 16384)
B, H, D = 1, 8, 64


def temp_bytes(fn, s: int) -> int:
    q = jax.ShapeDtypeStruct((B, s, H, D), jnp.float32)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))
    compiled = grad.lower(q, q, q).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main() -> int:
    out_dir = os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for s in SEQS:
        t0 = time.perf_counter()
        ref = temp_bytes(lambda q, k, v: attention_reference(q, k, v, causal=True), s)
        fl = temp_bytes(lambda q, k, v: flash_attention(q, k, v, causal=True), s)
        rows.append({"seq": s, "reference_temp_bytes": ref, "flash_temp_bytes": fl,
                     "ratio": fl / ref, "compile_s": time.perf_counter() - t0})
        print(f"S={s:>6}: reference {ref / 2**20:>10.1f} MiB  flash {fl / 2**20:>8.1f} MiB  "
              f"ratio {fl / ref:.4f}", flush=True)
    growth = [rows[i + 1]["flash_temp_bytes"] / rows[i]["flash_temp_bytes"]
              for i in range(len(rows) - 1)]
    at8k = next(r for r in rows if r["seq"] == 8192)
    summary = {"flash_growth_per_doubling": growth,
               "ratio_at_8192": at8k["ratio"], "target_ratio_at_8192": 1 / 8,
               "meets_memory_target": at8k["ratio"] <= 1 / 8 and max(growth) <= 2.2}
    speed = {"measured": False, "backend": jax.default_backend(),
             "note": "no GPU on this machine: speed vs jax.experimental.pallas.ops.gpu."
                     "attention.mha not measured"}
    if jax.default_backend() == "gpu":
        speed = {"measured": True, "note": "see rows", "rows": gpu_speed()}
    with open(os.path.join(out_dir, "attention_bench.json"), "w") as f:
        json.dump({"shape": {"batch": B, "heads": H, "head_dim": D, "dtype": "float32",
                             "causal": True},
                   "memory": rows, "summary": summary, "speed": speed,
                   "backend": jax.default_backend()}, f, indent=2)
    print(json.dumps(summary, indent=2))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(SEQS, [r["reference_temp_bytes"] / 2**20 for r in rows], "o-", label="XLA reference")
    ax.plot(SEQS, [r["flash_temp_bytes"] / 2**20 for r in rows], "o-", label="Pallas flash")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("compiled temporary memory, fwd+bwd (MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "attention_bench.png"), dpi=100)
    return 0


def _summed(fn, q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32))


def gpu_speed():  # pragma: no cover - needs a GPU
    from jax.experimental.pallas.ops.gpu import attention as pallas_ops
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for s in SEQS:
                key = jax.random.key(0)
                q = jax.random.normal(key, (B, s, H, d), jnp.bfloat16)
                fns = {"hetshard_flash": functools.partial(flash_attention, causal=causal),
                       "pallas_mha": functools.partial(pallas_ops.mha, segment_ids=None,
                                                       causal=causal),
                       "reference": functools.partial(attention_reference, causal=causal)}
                row = {"seq": s, "head_dim": d, "causal": causal}
                for name, fn in fns.items():
                    g = jax.jit(jax.grad(functools.partial(_summed, fn), argnums=(1, 2, 3)))
                    try:
                        jax.block_until_ready(g(q, q, q))
                        t = time.perf_counter()
                        for _ in range(5):
                            jax.block_until_ready(g(q, q, q))
                        row[f"{name}_ms"] = (time.perf_counter() - t) / 5 * 1e3
                    except Exception as e:  # out of memory for the reference at 16k
                        row[f"{name}_ms"] = None
                        row[f"{name}_error"] = type(e).__name__
                rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
