"""Phase 3 of the inter-op search: micro-batch counts per pipeline ("family") so that
the slowest finishes first (greedy where every family takes equal micro-batches, else
CP-SAT), and a closed-form relaxation that ranks many combinations cheaply."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from ortools.sat.python import cp_model

if TYPE_CHECKING:
    from hetshard.solver.families import Family


def assign_batch(families: list[Family], global_batch: int):
    """Micro-batch counts per family minimising the slowest family's time: greedy (exact)
    when every family takes the same samples per micro-batch, else CP-SAT."""
    units = {f.samples_per_microbatch for f in families}
    if len(units) == 1:
        return assign_equal_units(families, global_batch, units.pop())
    m = cp_model.CpModel()
    hi = global_batch
    # Integer time units relative to the problem (1e-9 of the slowest bound), so tiny
    # and huge models are resolved equally finely.
    worst = max(f.fill_s + (hi - 1) * f.bottleneck_s for f in families)
    scale = 1e9 / max(worst, 1e-30)
    ms = [m.NewIntVar(1, hi, f"m{i}") for i in range(len(families))]
    m.Add(sum(mv * f.samples_per_microbatch for mv, f in zip(ms, families, strict=True))
          == global_batch)
    top = int(max(f.fill_s + (hi - 1) * f.bottleneck_s for f in families) * scale) + 1
    t = m.NewIntVar(0, top, "t")
    for mv, f in zip(ms, families, strict=True):
        m.Add(t >= int(f.fill_s * scale) + (mv - 1) * max(1, int(f.bottleneck_s * scale)))
    m.Minimize(t)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 5.0
    solver.parameters.num_workers = 1
    st = solver.Solve(m)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return [solver.Value(v) for v in ms], solver.Value(t) / scale


def relaxed_time(families, global_batch: int) -> float:
    """The step estimate of ``assign_batch`` with fractional micro-batch counts (each at
    least 1): a lower bound on it, in closed form. Family f with m micro-batches takes
    fill_f + (m - 1) bottleneck_f; at time T it fits 1 + (T - fill_f) / bottleneck_f."""
    floor = max(f.fill_s for f in families)
    rate = sum(f.samples_per_microbatch / f.bottleneck_s for f in families)
    base = sum(f.samples_per_microbatch * (1 - f.fill_s / f.bottleneck_s) for f in families)
    return max(floor, (global_batch - base) / rate)


def assign_equal_units(families: list[Family], global_batch: int, unit: int):
    """Every family has ``unit`` samples per micro-batch: give each one micro-batch, then
    each further one to the family that would finish it soonest. Exact for minimising the
    maximum of times increasing in the count (an exchange argument)."""
    if global_batch % unit or global_batch // unit < len(families):
        return None
    counts = [1] * len(families)
    heap = [(f.fill_s + f.bottleneck_s, k) for k, f in enumerate(families)]
    heapq.heapify(heap)
    for _ in range(global_batch // unit - len(families)):
        _, k = heapq.heappop(heap)
        counts[k] += 1
        f = families[k]
        heapq.heappush(heap, (f.fill_s + counts[k] * f.bottleneck_s, k))
    t = max(f.fill_s + (c - 1) * f.bottleneck_s for f, c in zip(families, counts, strict=True))
    return counts, t
