"""Attention kernels: the pure-JAX reference, the Pallas flash kernel, cuDNN's fused
attention, ring attention, and which of them runs a call (``select``).

Exports load on first use (PEP 562): ``hetshard.kernels.select`` is read without JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "attention_reference": "hetshard.kernels.reference",
    "check_attention_args": "hetshard.kernels.reference",
    "context_parallel_attention": "hetshard.kernels.ring_attention",
    "dot_product_attention": "hetshard.kernels.dot_product",
    "flash_attention": "hetshard.kernels.flash_attention",
    "flash_attention_positions": "hetshard.kernels.flash_attention",
    "ring_attention": "hetshard.kernels.ring_attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hetshard.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
