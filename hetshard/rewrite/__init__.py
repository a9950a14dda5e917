"""Rewrite passes over traced jaxprs."""

from hetshard.ir.attention_patterns import count_attention
from hetshard.rewrite.attention import IMPLEMENTATIONS, swap_attention

__all__ = ["IMPLEMENTATIONS", "count_attention", "swap_attention"]
