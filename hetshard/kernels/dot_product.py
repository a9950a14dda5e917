"""cuDNN's fused flash attention through ``jax.nn.dot_product_attention``.

Same layout and arguments as ``attention_reference`` ([batch, seq, heads, head_dim];
grouped-query k and v). ``implementation="cudnn"`` is the GPU kernel
(``hetshard.kernel_choice`` says where it runs); ``"xla"`` is JAX's own XLA lowering of
the same call, which the CPU tests use to check what this wrapper passes. Its
backward is cuDNN's (``jax.nn.dot_product_attention``'s custom VJP).
"""

from __future__ import annotations

import math

import jax

from hetshard.errors import SpecError
from hetshard.kernel_choice import Pattern
from hetshard.kernels.reference import check_attention_args


def dot_product_attention(q, k, v, *, causal: bool = False, segment_ids=None,
                          sm_scale: float | None = None, implementation: str = "cudnn"):
    """Attention of ``q`` over ``k``, ``v`` by ``jax.nn.dot_product_attention``; the
    patterns it cannot compute exactly (segment ids; causal with q and k of different
    lengths: jax.nn aligns the starts, hetshard the ends) are refused with a
    :class:`SpecError`."""
    where = "dot_product_attention"
    check_attention_args(q, k, v, segment_ids, where=where)
    if implementation not in ("cudnn", "xla"):
        raise SpecError("implementation", implementation, "cudnn or xla", where=where)
    pattern = Pattern.of(q, k, segment_ids, causal)
    if pattern.segments:
        raise SpecError("segment_ids", "given", "None (packed rows run on the flash kernel)",
                        where=where)
    if pattern.causal and not pattern.same_length:
        raise SpecError("causal", True, f"False when seq_q ({q.shape[1]}) != seq_kv "
                        f"({k.shape[1]})", where=where)
    if sm_scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    else:
        try:
            scale = float(sm_scale)
        except (TypeError, jax.errors.ConcretizationTypeError):
            # A traced scale (jax.nn takes a Python float): folded into q.
            q, scale = (q * sm_scale).astype(q.dtype), 1.0
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=bool(causal),
                                        implementation=implementation)
