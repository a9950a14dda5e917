"""Neural-network entry points that hetshard's rewrite passes know how to find.

Model code calls :func:`attention` for every attention op. It traces to a ``jit``
equation named ``hetshard_attention`` (or ``hetshard_attention_causal``) whose operands
are ``q, k, v[, segment_ids], scale``, so the attention rewrite pass
(``hetshard.rewrite.attention``) can find each call in a jaxpr and swap its body (XLA
reference, Pallas flash kernel, ring attention) without pattern matching.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from hetshard.kernels.reference import attention_reference, check_attention_args

ATTENTION_NAME = "hetshard_attention"
CAUSAL_ATTENTION_NAME = "hetshard_attention_causal"


def _reference(q, k, v, segment_ids, scale, causal):
    return attention_reference(q, k, v, causal=causal, segment_ids=segment_ids,
                               sm_scale=scale)


@jax.jit
def hetshard_attention(q, k, v, segment_ids, scale):
    return _reference(q, k, v, segment_ids, scale, False)


@jax.jit
def hetshard_attention_causal(q, k, v, segment_ids, scale):
    return _reference(q, k, v, segment_ids, scale, True)


def attention(q, k, v, *, causal: bool, segment_ids=None, sm_scale: float | None = None):
    """Multi-head / grouped-query attention, layout [batch, seq, heads, head_dim].

    Args:
      q: [batch, seq_q, heads, head_dim].
      k, v: [batch, seq_kv, kv_heads, head_dim] with kv_heads dividing heads.
      causal: mask future keys.
      segment_ids: optional int32 [batch, seq]: tokens attend within their segment.
      sm_scale: logit scale, default 1/sqrt(head_dim).

    Returns:
      [batch, seq_q, heads, head_dim], q's dtype.

    Raises:
      SpecError: shapes, dtypes or segment ids that do not fit together.
    """
    check_attention_args(q, k, v, segment_ids, where="hetshard.nn.attention")
    scale = jnp.float32(1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale)
    fn = hetshard_attention_causal if causal else hetshard_attention
    return fn(q, k, v, segment_ids, scale)
