"""Pure-JAX multi-head attention: the reference every kernel is tested against.

Layout is [batch, seq, heads, head_dim] throughout (``q_bshd``). Grouped-query
attention: ``k``/``v`` carry ``kv_heads`` heads, and ``kv_heads`` must divide
the query heads; query head ``h`` reads kv head ``h // (heads // kv_heads)``
(the LLaMA-2 convention).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from hetshard.errors import SpecError

# Finite stand-in for -inf: keeps fully masked rows NaN-free (their output is 0).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_attention_args(q, k, v, segment_ids, *, where: str = "attention") -> None:
    """Raises :class:`SpecError` naming the argument when shapes or dtypes disagree."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise SpecError(f"{name}.shape", getattr(x, "shape", None),
                            "a 4-d array [batch, seq, heads, head_dim]", where=where)
    b, sq, h, d = q.shape
    if k.shape != v.shape:
        raise SpecError("v.shape", v.shape, f"the shape of k, {k.shape}", where=where)
    if k.shape[0] != b or k.shape[3] != d:
        raise SpecError("k.shape", k.shape,
                        f"[{b}, seq_kv, kv_heads, {d}] (batch and head_dim of q)", where=where)
    kvh = k.shape[2]
    if h % kvh:
        raise SpecError("k.shape[2]", kvh,
                        f"a number of kv heads dividing the {h} query heads", where=where)
    if not (q.dtype == k.dtype == v.dtype):
        raise SpecError("dtype", (q.dtype, k.dtype, v.dtype),
                        "q, k and v of one dtype", where=where)
    if segment_ids is not None:
        if sq != k.shape[1]:
            raise SpecError("segment_ids", "given",
                            f"None when seq_q ({sq}) != seq_kv ({k.shape[1]})", where=where)
        if getattr(segment_ids, "shape", None) != (b, sq):
            raise SpecError("segment_ids.shape", getattr(segment_ids, "shape", None),
                            f"({b}, {sq}) = [batch, seq]", where=where)
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise SpecError("segment_ids.dtype", segment_ids.dtype, "an integer dtype",
                            where=where)


def attention_mask(seq_q: int, seq_kv: int, *, causal: bool, segment_ids=None):
    """Boolean [batch or 1, seq_q, seq_kv] mask, True where a query may attend.

    Causal masking aligns the ends of q and kv (query i sees keys up to
    ``i + seq_kv - seq_q``), which is plain causal masking when the lengths match.
    """
    mask = jnp.ones((1, seq_q, seq_kv), dtype=bool)
    if causal:
        qi = jnp.arange(seq_q)[:, None] + (seq_kv - seq_q)
        ki = jnp.arange(seq_kv)[None, :]
        mask = mask & (ki <= qi)[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def attention_reference(q, k, v, *, causal: bool = False, segment_ids=None,
                        sm_scale: float | None = None, return_lse: bool = False):
    """Softmax attention computed with plain XLA ops (O(S^2) memory).

    Args:
      q: [batch, seq_q, heads, head_dim].
      k, v: [batch, seq_kv, kv_heads, head_dim]; kv_heads divides heads.
      causal: mask keys after each query.
      segment_ids: optional int [batch, seq] shared by q and kv; tokens attend
        only within their segment (packed sequences).
      sm_scale: logit scale, default ``1/sqrt(head_dim)``.
      return_lse: also return the log-sum-exp of the logits, [batch, heads, seq_q]
        (float32), used to merge partial attention results.

    Returns:
      [batch, seq_q, heads, head_dim] in q's dtype (and the lse if asked).
      A query with no visible key gets zeros (and lse = MASK_VALUE).
    """
    check_attention_args(q, k, v, segment_ids, where="attention_reference")
    b, sq, h, d = q.shape
    skv, kvh = k.shape[1], k.shape[2]
    group = h // kvh
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    q5 = q.reshape(b, sq, kvh, group, d)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q5, k,
                        preferred_element_type=jnp.float32) * scale
    mask = attention_mask(sq, skv, causal=causal, segment_ids=segment_ids)
    # The mask as an additive bias (an add keeps nothing for its backward), and a query
    # with no visible key zeroed on the output: the backward keeps one [seq_q, seq_kv]
    # tensor per head, the probabilities (``_softmax``), as a fused kernel would.
    logits = logits + jnp.where(mask, 0.0, MASK_VALUE)[:, None, None]
    visible = jnp.any(mask, axis=-1)[:, :, None, None, None].astype(jnp.float32)
    if return_lse:
        lse = jax.nn.logsumexp(logits, axis=-1)
        probs = jnp.exp(logits - lse[..., None])
    else:
        probs = _softmax(logits)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32) * visible
    out = out.reshape(b, sq, h, d).astype(q.dtype)
    if return_lse:
        return out, lse.reshape(b, h, sq)
    return out


@jax.custom_vjp
def _softmax(x):
    """Softmax over the last axis whose derivative reads only its output."""
    return jax.nn.softmax(x, axis=-1)


def _softmax_fwd(x):
    y = _softmax(x)
    return y, y


def _softmax_bwd(y, g):
    return (y * (g - (g * y).sum(-1, keepdims=True)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)
