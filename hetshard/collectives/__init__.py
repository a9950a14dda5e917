"""Collectives between submeshes, in one process or across processes: transfers of
activations and cotangents, weighted gradient sums across pipelines."""

from hetshard.collectives.moves import (
    deliver,
    empty,
    here,
    home_device,
    idle_processes,
    processes,
    put,
    replicated,
    takes_part,
    transfer,
)
from hetshard.collectives.sync import congruent, sum_across, sum_across_collective

__all__ = ["congruent", "deliver", "empty", "here", "home_device", "idle_processes",
           "processes", "put", "replicated", "sum_across", "sum_across_collective",
           "takes_part", "transfer"]
