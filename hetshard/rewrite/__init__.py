"""Rewrite passes over traced jaxprs."""

from hetshard.rewrite.attention import IMPLEMENTATIONS, count_attention, swap_attention

__all__ = ["IMPLEMENTATIONS", "count_attention", "swap_attention"]
