"""A user's own masked attention, as written and as hetshard runs it: compiled memory.

Four ways users write causal and packed attention (``jnp.tril`` under ``jnp.where``;
``nnx.dot_product_attention`` under ``nnx.make_causal_mask``; the same combined with a
segment mask from ``nnx.make_attention_mask``; ``jax.nn.dot_product_attention(...,
is_causal=True)``) are compiled as written and after ``hetshard.rewrite.swap_attention``
reads their masks and swaps in the flash kernel (interpret mode on CPU: its lowering
keeps the kernel's blockwise buffers). Reported: compiled temporary bytes of a jitted
forward + backward (``jax.grad`` of the summed output), batch 1, 8 heads, head_dim 64,
float32, sequence lengths 1k..8k. Only compilation happens, so this runs on CPU.

Usage: python experiments/user_attention.py
Writes experiments/results/user_attention.json.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hetshard.rewrite import count_attention, swap_attention

SEQS = (1024, 2048, 4096, 8192)
B, H, D = 1, 8, 64


def _einsum(q, k, v, mask):
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def tril(q, k, v, seg):
    s = q.shape[1]
    return _einsum(q, k, v, jnp.tril(jnp.ones((s, s), bool)))


def flax_causal(q, k, v, seg):
    return nnx.dot_product_attention(q, k, v, mask=nnx.make_causal_mask(seg))


def flax_packed(q, k, v, seg):
    mask = nnx.combine_masks(nnx.make_causal_mask(seg),
                             nnx.make_attention_mask(seg, seg, jnp.equal))
    return nnx.dot_product_attention(q, k, v, mask=mask)


def jax_nn_causal(q, k, v, seg):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


FORMS = {"tril": tril, "flax_causal": flax_causal, "flax_packed": flax_packed,
         "jax_nn_causal": jax_nn_causal}


def temp_bytes(loss, s: int) -> int:
    x = jax.ShapeDtypeStruct((B, s, H, D), jnp.float32)
    seg = jax.ShapeDtypeStruct((B, s), jnp.int32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, seg).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main() -> int:
    t0 = time.time()
    rows = []
    for name, form in FORMS.items():
        def loss(q, k, v, seg, form=form):
            return jnp.sum(form(q, k, v, seg))
        small = [jnp.ones((B, 128, H, D))] * 3 + [jnp.ones((B, 128), jnp.int32)]
        found = count_attention(loss, *small)
        swapped = swap_attention(loss, "flash", block_q=128, block_k=128)
        for s in SEQS:
            written, run = temp_bytes(loss, s), temp_bytes(swapped, s)
            rows.append({"form": name, "seq": s, "recognised": found == 1,
                         "written_temp_bytes": written, "swapped_temp_bytes": run,
                         "ratio": written / max(run, 1)})
            print(f"{name:14s} S={s:5d}  as written {written / 2**20:9.1f} MiB  "
                  f"swapped {run / 2**20:7.1f} MiB  x{written / max(run, 1):.1f}", flush=True)
    out = {"batch": B, "heads": H, "head_dim": D, "rows": rows,
           "wall_time_s": time.time() - t0}
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(here, exist_ok=True)
    with open(os.path.join(here, "user_attention.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
