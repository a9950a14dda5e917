"""Collectives between submeshes, in one process or across processes: transfers of
activations and cotangents, weighted gradient sums across pipelines."""

from hetshard.collectives.sync import congruent, sum_across, sum_across_collective
from hetshard.collectives.transfer import empty, here, processes, takes_part, transfer

__all__ = ["congruent", "empty", "here", "processes", "sum_across", "sum_across_collective",
           "takes_part", "transfer"]
