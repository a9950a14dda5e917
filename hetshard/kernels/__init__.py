"""Attention kernels: the pure-JAX reference, the Pallas flash kernel, ring attention."""

from hetshard.kernels.flash_attention import flash_attention, flash_attention_positions
from hetshard.kernels.reference import attention_reference, check_attention_args
from hetshard.kernels.ring_attention import context_parallel_attention, ring_attention

__all__ = ["attention_reference", "check_attention_args", "context_parallel_attention",
           "flash_attention", "flash_attention_positions", "ring_attention"]
