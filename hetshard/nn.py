"""Neural-network entry points that hetshard's rewrite passes know how to find.

Model code calls :func:`attention` for every attention op. It traces to a
``jit`` equation named ``hetshard_attention`` whose static parameters record the
masking, so the attention rewrite pass can find each call in a jaxpr and swap
its body (XLA reference, Pallas flash kernel, ring attention) without pattern
matching softmax graphs.
"""

from __future__ import annotations

import functools

import jax

from hetshard.kernels.reference import attention_reference, check_attention_args

ATTENTION_NAME = "hetshard_attention"


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale"))
def hetshard_attention(q, k, v, segment_ids, *, causal: bool, sm_scale: float | None):
    return attention_reference(q, k, v, causal=causal, segment_ids=segment_ids,
                               sm_scale=sm_scale)


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
    return hetshard_attention(q, k, v, segment_ids, causal=causal, sm_scale=sm_scale)
