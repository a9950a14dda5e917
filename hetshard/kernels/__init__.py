"""Attention kernels: the pure-JAX reference, the Pallas flash kernel, cuDNN's fused
attention, ring attention (which of them runs a call: ``hetshard.kernel_choice``)."""

from hetshard.kernels.dot_product import dot_product_attention
from hetshard.kernels.flash_attention import (
    FlashTuning,
    flash_attention,
    flash_attention_positions,
)
from hetshard.kernels.reference import attention_reference, check_attention_args
from hetshard.kernels.ring_attention import context_parallel_attention, ring_attention

__all__ = ["FlashTuning", "attention_reference", "check_attention_args",
           "context_parallel_attention", "dot_product_attention", "flash_attention",
           "flash_attention_positions", "ring_attention"]
