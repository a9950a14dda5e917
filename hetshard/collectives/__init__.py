"""Collectives between submeshes, in one process or across processes: transfers of
activations and cotangents, weighted gradient sums across pipelines."""

from hetshard.collectives.moves import (
    empty,
    here,
    processes,
    put,
    replicated,
    takes_part,
    transfer,
)
from hetshard.collectives.sync import congruent, sum_across, sum_across_collective

__all__ = ["congruent", "empty", "here", "processes", "put", "replicated", "sum_across",
           "sum_across_collective", "takes_part", "transfer"]
