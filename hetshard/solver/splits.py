"""Per-layer cost tables and contiguous layer splits for pipeline stages.

``LayerTables`` prices every layer once per (GPU type, tensor degree, micro-batch size,
remat, data ways, context degree) and keeps prefix sums of time and memory, so the time
and memory of any stage ``[a, b)`` are two subtractions. The splits place the layers on
a pipeline's stages (each stage with its own table: stages may differ in GPU type and
layout) minimising the slowest stage (``split_layers``, ``split_layers_mixed`` with a
remat per stage) or listing every split's (sum, max) Pareto front (``pareto_splits``),
all with every stage's memory under its 1F1B in-flight count within capacity.
"""

from __future__ import annotations

import itertools

import numpy as np

from hetshard.cluster.spec import Cluster, Group
from hetshard.cost.calibration import Calibration
from hetshard.cost.comm import topology
from hetshard.cost.profile import ModelProfile
from hetshard.cost.stage import stage_cost


class LayerTables:
    """Per-layer costs for (gpu type, tp, mbs, remat), computed once per layer kind."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, cal: Calibration,
                 attention: str, shard_optimizer: bool = False):
        self.profile, self.cluster, self.cal, self.attention = profile, cluster, cal, attention
        self.shard_optimizer = shard_optimizer  # ZeRO-1 over the r data ways
        self._cache: dict = {}

    def get(self, group: Group, tp: int, mbs: int, remat: str, r: int, cp: int = 1):
        key = (group.name, tp, mbs, remat, r, cp)
        if key in self._cache:
            return self._cache[key]
        ids = list(self.cluster.group_device_ids(group.name))
        tp_topo = topology(self.cluster, ids[:tp]) if tp > 1 else None
        cp_topo = topology(self.cluster, ids[:tp * cp:tp]) if cp > 1 else None
        per_kind: dict = {}
        rows = []
        for i, layer in enumerate(self.profile.layers):
            k = layer.kind
            if k not in per_kind:
                per_kind[k] = stage_cost(self.profile, i, i + 1, group.gpu, tp=tp, cp=cp,
                                         dp=r, shard_optimizer=self.shard_optimizer,
                                         mbs=mbs, remat=remat, attention=self.attention,
                                         cal=self.cal, tp_topo=tp_topo, cp_topo=cp_topo)
            c = per_kind[k]
            rows.append((c.fwd_s + c.bwd_s, c.memory_static_bytes,
                         c.memory_per_microbatch_bytes, c.memory_working_bytes))
        a = np.array(rows)
        out = (np.concatenate([[0.0], np.cumsum(a[:, 0])]),
               np.concatenate([[0.0], np.cumsum(a[:, 1])]),
               np.concatenate([[0.0], np.cumsum(a[:, 2])]), a[:, 3])
        self._cache[key] = out
        return out


def _reach(table, start: int, limit: int, t_max: float, inflight: int, cap: float):
    """The furthest end <= ``limit`` of a stage starting at layer ``start`` with time
    <= ``t_max`` and memory <= ``cap`` (both grow with the end), or None. A plain loop:
    stages usually end after a few layers, where it beats whole-array arithmetic."""
    ct, cs, ca, work = table
    end, best, peak = start, None, -np.inf
    while end < limit:
        peak = max(peak, work[end])
        end += 1
        mem = cs[end] - cs[start] + inflight * (ca[end] - ca[start]) + peak
        if ct[end] - ct[start] > t_max or mem > cap:
            break
        best = end
    return best


def _pack(t_max: float, stages, n_layers: int, caps):
    """Greedy contiguous packing of the layers into ``stages`` (tables per stage) with every
    stage time <= t_max and memory <= cap; returns the bounds or None."""
    p = len(stages)
    bounds, start = [], 0
    for s, table in enumerate(stages):
        best = _reach(table, start, n_layers - (p - s - 1), t_max, p - s, caps[s])
        if best is None or (s == p - 1 and best != n_layers):
            return None
        bounds.append((start, best))
        start = best
    return bounds


def split_layers(stages, n_layers: int, caps):
    """Minimum bottleneck split: (bounds, stage times) or None if nothing fits."""
    if len(stages) > n_layers:
        return None
    total = max(st[0][-1] for st in stages)
    lo, hi = 0.0, total * 1.0001
    if _pack(hi, stages, n_layers, caps) is None:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        if _pack(mid, stages, n_layers, caps) is None:
            lo = mid
        else:
            hi = mid
    bounds = _pack(hi, stages, n_layers, caps)
    times = [st[0][b] - st[0][a] for st, (a, b) in zip(stages, bounds, strict=True)]
    return bounds, times


def _pack_mixed(t_max: float, options, n_layers: int, caps):
    """``_pack`` where each stage picks its remat: among the options (remat, table) the
    one reaching furthest within ``t_max`` and memory (the fastest of those). Reach is
    monotone in the start for every option, so the greedy stays exact for the
    bottleneck. Returns (bounds, remats) or None."""
    p = len(options)
    bounds, remats, start = [], [], 0
    for s, row in enumerate(options):
        best = None  # (end, -time, remat)
        for remat, table in row:
            reach = _reach(table, start, n_layers - (p - s - 1), t_max, p - s, caps[s])
            if reach is None:
                continue
            key = (reach, -(table[0][reach] - table[0][start]))
            if best is None or key > best[:2]:
                best = (*key, remat)
        if best is None or (s == p - 1 and best[0] != n_layers):
            return None
        bounds.append((start, best[0]))
        remats.append(best[2])
        start = best[0]
    return bounds, remats


def split_layers_mixed(options, n_layers: int, caps, hi: float | None = None):
    """Minimum bottleneck split with a remat per stage: (bounds, times, remats) or None.
    ``hi``: a bottleneck known to be reachable (the best one-remat split's), which
    narrows the search to 1e-4 of it."""
    if len(options) > n_layers:
        return None
    total = max(tab[0][-1] for row in options for _, tab in row)
    iterations = 40
    if hi is None:
        lo, hi = 0.0, total * 1.0001
    else:
        lo, hi, iterations = 0.0, hi * 1.0001, 14
    if _pack_mixed(hi, options, n_layers, caps) is None:
        return None
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if _pack_mixed(mid, options, n_layers, caps) is None:
            lo = mid
        else:
            hi = mid
    bounds, remats = _pack_mixed(hi, options, n_layers, caps)
    tables = [dict(row)[r] for row, r in zip(options, remats, strict=True)]
    times = [tab[0][b] - tab[0][a] for tab, (a, b) in zip(tables, bounds, strict=True)]
    return bounds, times, remats


def stage_fits(stage, a: int, b: int, inflight: int, cap: float) -> bool:
    ct, cs, ca, work = stage
    return cs[b] - cs[a] + inflight * (ca[b] - ca[a]) + work[a:b].max() <= cap


def pareto_splits(options, n_layers: int, caps):
    """Every contiguous split that fits, each stage with the fastest of its (remat, table)
    options that fits, reduced to the Pareto set of (sum, max) stage time: for any
    micro-batch count the best split (fill + (m - 1) * max) is among them. Returns
    (bounds, times, remats) per point."""
    p = len(options)
    points = []
    for cuts in itertools.combinations(range(1, n_layers), p - 1):
        bounds = list(zip((0,) + cuts, cuts + (n_layers,), strict=True))
        times, remats = [], []
        for s, (row, (a, b)) in enumerate(zip(options, bounds, strict=True)):
            fitting = [(tab[0][b] - tab[0][a], remat) for remat, tab in row
                       if stage_fits(tab, a, b, p - s, caps[s])]
            if not fitting:
                break
            t, remat = min(fitting, key=lambda x: x[0])
            times.append(t)
            remats.append(remat)
        else:
            points.append((sum(times), max(times), bounds, times, remats))
    points.sort(key=lambda t: (t[0], t[1]))
    front, best_max = [], float("inf")
    for _total, mx, bounds, times, remats in points:
        if mx < best_max - 1e-15:
            front.append((bounds, times, remats))
            best_max = mx
    return front
