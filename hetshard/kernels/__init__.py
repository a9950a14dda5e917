"""Attention kernels: the pure-JAX reference (and, beside it, the Pallas kernels)."""

from hetshard.kernels.reference import attention_reference, check_attention_args

__all__ = ["attention_reference", "check_attention_args"]
