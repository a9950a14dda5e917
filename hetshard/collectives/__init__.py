"""Collectives between submeshes: weighted gradient sums across pipelines."""

from hetshard.collectives.sync import congruent, sum_across, sum_across_collective

__all__ = ["congruent", "sum_across", "sum_across_collective"]
