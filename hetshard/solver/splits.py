"""Per-layer cost tables and contiguous layer splits for pipeline stages.

``LayerTables`` prices every layer once per (GPU type, tensor degree, micro-batch size,
remat, data ways, context degree) and keeps prefix sums of time and memory, so the time
and memory of any stage ``[a, b)`` are two subtractions. The splits place the layers on
a pipeline's stages (each stage with its own table: stages may differ in GPU type and
layout) minimising the slowest stage (``split_layers``, ``split_layers_mixed`` with a
remat per stage) or listing every split's (sum, max) Pareto front (``pareto_splits``),
all with every stage's memory under its 1F1B in-flight count within capacity.

A stage's remat option is a table (one remat for all its layers) or a
:class:`PartialRemat`: full recomputation of the stage's first ``k`` layers and none
after, ``k`` the fewest that fit (Megatron-LM's ``--recompute-num-layers``). Its choice
is then ``("full", k)`` where a table's is its remat's name (``remat_choice`` reads
both).
"""

from __future__ import annotations

import bisect
import itertools
from typing import NamedTuple

import numpy as np

from hetshard._plan import stage_dtype
from hetshard.cluster.spec import Cluster, Group
from hetshard.cost.calibration import Calibration
from hetshard.cost.comm import topology
from hetshard.cost.profile import ModelProfile
from hetshard.cost.stage import planned_placement, stage_cost
from hetshard.offload import split_key
from hetshard.solver.options import PlannerOptions, ep_ways, fsdp_ways, planned_gpu_dtypes


class LayerTables:
    """Per-layer costs for (gpu type, tp, mbs, remat), computed once per layer kind."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, cal: Calibration,
                 attention: str, shard_optimizer: bool = False, tp_overlap: bool = False,
                 gpu_dtypes: tuple = (), state_sharding: str = "none",
                 global_batch: int | None = None, ep_options: tuple[int, ...] = (1,)):
        self.profile, self.cluster, self.cal, self.attention = profile, cluster, cal, attention
        # The step's samples: a stage that streams its optimizer state from host memory
        # pays that once a step, spread here over the most micro-batches a step can have
        # (one pipeline): the splits compare times per micro-batch (None: not spread)
        self.global_batch = global_batch
        self.shard_optimizer = shard_optimizer  # ZeRO-1 over the r data ways
        # FSDP over some of the r data ways (``options.fsdp_ways``; "none": ZeRO-1 at most)
        self.state_sharding = state_sharding
        self.tp_overlap = tp_overlap  # collective matmuls (Plan.tp_overlap)
        self.gpu_dtypes = gpu_dtypes  # compute dtypes per GPU type (Plan.gpu_dtypes)
        # expert-parallel degrees a stage holding a mixture-of-experts layer may take
        # (``options.ep_ways`` picks one per data ways)
        self.ep_options = ep_options
        self._cache: dict = {}

    @classmethod
    def for_search(cls, profile: ModelProfile, cluster: Cluster, cal: Calibration,
                   opts: PlannerOptions, global_batch: int | None = None) -> LayerTables:
        """The tables a search under ``opts`` prices stages with (its attention, ZeRO-1
        unless the options rule it out, collective matmuls, compute dtypes per GPU) for
        a step of ``global_batch`` samples."""
        return cls(profile, cluster, cal, opts.attention, opts.distributed_optimizer is not False,
                   opts.tp_overlap, planned_gpu_dtypes(profile, cluster, opts),
                   opts.state_sharding, global_batch, opts.ep_options)

    def get(self, group: Group, tp: int, mbs: int, remat: str, r: int, cp: int = 1):
        key = (group.name, tp, mbs, remat, r, cp)
        if key in self._cache:
            return self._cache[key]
        ids = list(self.cluster.group_device_ids(group.name))
        tp_topo = topology(self.cluster, ids[:tp]) if tp > 1 else None
        cp_topo = topology(self.cluster, ids[:tp * cp:tp]) if cp > 1 else None
        f = fsdp_ways(self.state_sharding, r, tp, cp, group.gpus_per_node)
        e = self.ep_of(group, r, tp, cp)
        experts = dict(ep=e, ep_topo=topology(self.cluster, ids[:e * tp * cp:tp * cp]),
                       expert_counts=planned_placement(self.profile, e)) if e > 1 else {}
        # a sharded stage gathers each layer from its group's f ranks; the distributed
        # optimizer splits the optimizer state over the groups too
        sharded = dict(fsdp=True, dp=f, dp_topo=topology(self.cluster, ids[:f * tp * cp:
                                                                         tp * cp]),
                       optimizer_ways=f * (r // f if self.shard_optimizer else 1)) \
            if f > 1 else dict(dp=r)
        per_kind: dict = {}
        rows = []
        remat, offload = split_key(remat)  # (a memory option: remat@offload)
        for i, layer in enumerate(self.profile.layers):
            k = layer.kind
            if k not in per_kind:
                c = stage_cost(self.profile, i, i + 1, group.gpu, tp=tp, cp=cp,
                               **sharded, shard_optimizer=self.shard_optimizer,
                               mbs=mbs, remat=remat, attention=self.attention,
                               cal=self.cal, tp_topo=tp_topo, cp_topo=cp_topo,
                               tp_overlap=self.tp_overlap,
                               dtype=self.dtype_of(group.gpu), offload=offload,
                               host_link_gbs=group.host_link, **experts)
                # The layer's optimizer state through the host link, and the experts
                # brought to an uneven placement, once a step
                spread = (c.host_stream_s + c.brought_s) / max(
                    1, self.global_batch // (mbs * r)) if self.global_batch else 0.0
                per_kind[k] = (c.fwd_s + c.bwd_s + spread, c.memory_static_bytes,
                               c.memory_per_microbatch_bytes, c.memory_working_bytes)
            rows.append(per_kind[k])
        a = np.array(rows)
        out = (np.concatenate([[0.0], np.cumsum(a[:, 0])]),
               np.concatenate([[0.0], np.cumsum(a[:, 1])]),
               np.concatenate([[0.0], np.cumsum(a[:, 2])]), a[:, 3])
        self._cache[key] = out
        return out

    def ep_of(self, group: Group, r: int, tp: int, cp: int) -> int:
        """The expert-parallel degree of a stage of ``r`` data ways on ``group``
        (``options.ep_ways``)."""
        f = fsdp_ways(self.state_sharding, r, tp, cp, group.gpus_per_node)
        return ep_ways(self.profile, self.ep_options, r, tp, cp, group.gpus_per_node, f)

    def dtype_of(self, gpu) -> str:
        """The compute dtype of stages on ``gpu`` (a DeviceType)."""
        return stage_dtype(gpu.name, self.profile.dtype, self.gpu_dtypes)

    def peak_of(self, gpu) -> float:
        """``gpu``'s peak FLOP/s in the dtype its stages compute in."""
        return gpu.peak_flops(self.dtype_of(gpu))


class PartialRemat:
    """The option "full remat of the first k layers, none after", from the two tables
    (kept as lists too: its searches read single entries, where lists beat arrays)."""

    __slots__ = ("none", "full", "_ctn", "_ctf", "_cs", "_can", "_caf", "_workn", "_workf",
                 "_fronts")

    def __init__(self, none, full):
        self.none, self.full = none, full
        self._fronts: dict = {}
        self._ctn, self._cs, self._can, self._workn = (list(map(float, x)) for x in none)
        self._ctf, _, self._caf, self._workf = (list(map(float, x)) for x in full)

    def memory(self, a: int, b: int, k: int, inflight: int) -> float:
        mid = a + k
        work = max(max(self._workf[a:mid], default=0.0), max(self._workn[mid:b], default=0.0))
        can, caf = self._can, self._caf
        return (self._cs[b] - self._cs[a] + inflight * (caf[mid] - caf[a] + can[b] - can[mid])
                + work)

    def time(self, a: int, b: int, k: int) -> float:
        ctn, ctf = self._ctn, self._ctf
        return ctf[a + k] - ctf[a] + ctn[b] - ctn[a + k]

    def fewest(self, a: int, b: int, inflight: int, cap: float, k: int = 0) -> int | None:
        """The fewest recomputed layers (at least ``k``) for which ``[a, b)`` fits."""
        while k <= b - a:
            if self.memory(a, b, k, inflight) <= cap:
                return k
            k += 1
        return None

    def front(self, start: int, inflight: int, cap: float):
        """(times, ks) of the stages starting at ``start``, per end from ``start + 1``
        on, as far as any k fits (see ``_reach_partial``); listed once per start."""
        key = (start, inflight, cap)
        if key not in self._fronts:
            times, ks, end, k = [], [], start, 0
            while end < len(self._ctn) - 1:
                end += 1
                k = self.fewest(start, end, inflight, cap, k)
                if k is None:
                    break
                times.append(self.time(start, end, k))
                ks.append(k)
            self._fronts[key] = times, ks
        return self._fronts[key]


def plain(row: list) -> dict:
    """remat -> table of a stage's options, the partial remat left out."""
    return {remat: t for remat, t in row if not isinstance(t, PartialRemat)}


def with_partial(row: list) -> list:
    """A stage's options [(remat, table)] plus the partial remat where both "none" and
    "full" are among them."""
    tables = plain(row)
    if "none" in tables and "full" in tables:
        return row + [("full", PartialRemat(tables["none"], tables["full"]))]
    return row


def remat_choice(choice) -> tuple[str, int | None]:
    """(remat, remat_layers) of a stage's choice: a memory option's key (all layers;
    ``hetshard.offload.option_key``) or ``(remat, k)``, k layers recomputed."""
    return (choice, None) if isinstance(choice, str) else (choice[0], choice[1])


def stage_memory(choice) -> dict:
    """A stage's ``remat``, ``remat_layers`` and ``offload`` fields from its choice."""
    key, k = remat_choice(choice)
    remat, offload = split_key(key)
    return {"remat": remat, "remat_layers": k, "offload": offload}


def _choice(remat: str, table, a: int, b: int, k: int | None):
    """A stage's choice; a partial remat of all or none of its layers is plain."""
    if not isinstance(table, PartialRemat):
        return remat
    return "none" if k == 0 else "full" if k == b - a else ("full", k)


class Fit(NamedTuple):
    """A stage's time under an option that fits, and the layers a partial remat
    recomputes to fit (None: a plain option)."""

    time_s: float
    recomputed: int | None


def option_cost(table, a: int, b: int, inflight: int, cap: float) -> Fit | None:
    """Stage ``[a, b)`` with the option's fastest way to fit, or None when it does not
    fit."""
    if isinstance(table, PartialRemat):
        times, ks = table.front(a, inflight, cap)
        return Fit(times[b - a - 1], ks[b - a - 1]) if b - a <= len(times) else None
    return Fit(table[0][b] - table[0][a], None) if stage_fits(table, a, b, inflight, cap) \
        else None


def _fastest(row, a: int, b: int, inflight: int, cap: float):
    """(time, choice) of the fastest of a stage's options (remat, table) that fits
    ``[a, b)``, or None."""
    best = None
    for remat, table in row:
        fit = option_cost(table, a, b, inflight, cap)
        if fit is not None and (best is None or fit.time_s < best[0]):
            best = (fit.time_s, _choice(remat, table, a, b, fit.recomputed))
    return best


def option_parts(table, a: int, b: int, k: int | None):
    """(time, static bytes, bytes per micro-batch in flight, working bytes) of
    ``[a, b)`` under the option (``k`` for a partial remat)."""
    if isinstance(table, PartialRemat):
        static = table.memory(a, b, k, 0)  # with the working set, without activations
        per_mb = table.memory(a, b, k, 1) - static
        _, cs, _, _ = table.none
        return table.time(a, b, k), cs[b] - cs[a], per_mb, static - (cs[b] - cs[a])
    ct, cs, ca, work = table
    return ct[b] - ct[a], cs[b] - cs[a], ca[b] - ca[a], work[a:b].max()


def choice_parts(row, choice, a: int, b: int):
    """``option_parts`` of the option in ``row`` ([(remat, option)]) that made
    ``choice``."""
    remat, k = remat_choice(choice)
    if k is not None:
        table = next(t for _, t in row if isinstance(t, PartialRemat))
        return option_parts(table, a, b, k)
    return option_parts(plain(row)[remat], a, b, None)


def _reach_partial(table: PartialRemat, start: int, limit: int, t_max: float,
                   inflight: int, cap: float):
    """``_reach`` of a partial remat: (end, k) with k the fewest recomputed layers that
    fit. A longer stage needs at least as many (memory grows with the end for every k),
    so k only moves up as the end does, and the time with it: each stage start's (time,
    k) per end is listed once and searched by time (the bisections over the bottleneck
    ask the same starts again and again)."""
    times, ks = table.front(start, inflight, cap)
    i = min(bisect.bisect_right(times, t_max), limit - start)
    return (start + i, ks[i - 1]) if i > 0 else None


def _reach(table, start: int, limit: int, t_max: float, inflight: int, cap: float,
           memo: dict | None = None):
    """The furthest end <= ``limit`` of a stage starting at layer ``start`` with time
    <= ``t_max`` and memory <= ``cap`` (both grow with the end), or None. The memory's
    furthest end does not depend on ``t_max``: ``memo`` (a dict kept through one
    bisection) remembers it and the time prefix as a list, so that the bisection's
    repeated calls only search the time."""
    key = (id(table), start, inflight, cap)
    got = None if memo is None else memo.get(key)
    if got is None:
        ct, cs, ca, work = table
        end, peak, fits = start, -np.inf, start
        n = len(ct) - 1
        while end < n:
            peak = max(peak, work[end])
            end += 1
            if cs[end] - cs[start] + inflight * (ca[end] - ca[start]) + peak > cap:
                break
            fits = end
        got = (fits, ct.tolist() if memo is not None else ct)
        if memo is not None:
            memo[key] = got
    fits, ct = got
    lo, hi = start, min(fits, limit)  # the answer is in [lo, hi]; lo means none
    base = ct[start]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ct[mid] - base <= t_max:
            lo = mid
        else:
            hi = mid - 1
    return lo if lo > start else None


def _min_bottleneck(pack, hi: float):
    """The result of ``pack`` (t_max -> (result, its bottleneck) or None; feasible for
    every t_max from the optimum up) at the smallest t_max, to 1e-9 relative, or None
    when even ``hi`` is infeasible. Bisection that snaps its upper end to the bottleneck
    each feasible pack reaches (an achievable value, often the optimum itself), and stops
    as soon as just below it is infeasible."""
    got = pack(hi)
    if got is None:
        return None
    lo, hi = 0.0, got[1]
    while hi - lo > 1e-9 * hi:
        below = pack(hi * (1 - 1e-9))
        if below is None:
            break
        got, hi = below, below[1]
        mid = (lo + hi) / 2
        found = pack(mid)
        if found is None:
            lo = mid
        else:
            got, hi = found, found[1]
    return got[0]


def split_layers(stages, n_layers: int, caps):
    """Minimum bottleneck split: (bounds, stage times) or None if nothing fits
    (``split_layers_mixed`` with one table per stage)."""
    got = split_layers_mixed([[("none", st)] for st in stages], n_layers, caps)
    return None if got is None else got[:2]


class _Reach(NamedTuple):
    end: int
    time_s: float
    choice: object


def _stage_reach(row, start: int, limit: int, t_max: float, inflight: int, cap: float,
                 memo: dict | None) -> _Reach | None:
    """Among a stage's options (remat, table), the one reaching furthest from ``start``
    (end <= ``limit``) within ``t_max`` and memory, the fastest of those; None when none
    fits a layer. Every end up to it fits too (time and memory grow with the end for
    every option)."""
    best = None  # (end, -time, choice)
    for remat, table in row:
        if isinstance(table, PartialRemat):
            found = _reach_partial(table, start, limit, t_max, inflight, cap)
            if found is None:
                continue
            reach, k = found
            t = table.time(start, reach, k)
        else:
            reach, k = _reach(table, start, limit, t_max, inflight, cap, memo), None
            if reach is None:
                continue
            t = table[0][reach] - table[0][start]
        if best is None or (reach, -t) > best[:2]:
            best = (reach, -t, _choice(remat, table, start, reach, k))
    return None if best is None else _Reach(best[0], -best[1], best[2])


def _inflight(p: int, s: int, ahead: int) -> int:
    """Micro-batches stage ``s`` of ``p`` keeps in flight under 1F1B with ``ahead``
    extra warm-up forwards on every stage but the last."""
    return p - s + (ahead if s < p - 1 else 0)


def _pack_mixed(t_max: float, options, n_layers: int, caps, memo: dict | None = None,
                ahead: int = 0):
    """Greedy contiguous packing of the layers into the stages with every stage time
    <= ``t_max`` and memory <= its cap, each stage with the option (remat, table)
    reaching furthest (the fastest of those). Returns
    (bounds, [(choice, time)]) or None. The greedy can miss a packing where a later
    stage cannot take a layer an earlier one could (less memory, more micro-batches in
    flight, another GPU type): ``_pack_exact`` finds those."""
    p = len(options)
    bounds, picked, start = [], [], 0
    for s, row in enumerate(options):
        got = _stage_reach(row, start, n_layers - (p - s - 1), t_max, _inflight(p, s, ahead),
                           caps[s], memo)
        if got is None or (s == p - 1 and got.end != n_layers):
            return None
        bounds.append((start, got.end))
        picked.append((got.choice, got.time_s))
        start = got.end
    return bounds, picked


def _pack_exact(t_max: float, options, n_layers: int, caps, memo: dict | None = None,
                ahead: int = 0):
    """``_pack_mixed``'s answer by dynamic programming from the last stage back: the
    starts from which stages s.. can pack the remaining layers are those whose stage s
    reaches one of stage s+1's (each stage fits every end up to its reach). Exact;
    O(stages x layers) reaches (``split_layers_mixed`` runs it as a check on small
    instances)."""
    p = len(options)
    feasible = [False] * (n_layers + 1)
    feasible[n_layers] = True
    ends: list[dict[int, int]] = [{} for _ in range(p)]
    for s in reversed(range(p)):
        last, below = -1, [-1] * (n_layers + 1)  # the largest feasible end <= x
        for x in range(n_layers + 1):
            if feasible[x]:
                last = x
            below[x] = last
        now = [False] * (n_layers + 1)
        limit = n_layers - (p - s - 1)
        for a in range(s, limit):
            got = _stage_reach(options[s], a, limit, t_max, _inflight(p, s, ahead), caps[s],
                               memo)
            if got is not None and below[got.end] > a:
                now[a] = True
                ends[s][a] = below[got.end]
        feasible = now
    if not feasible[0]:
        return None
    bounds, picked, start = [], [], 0
    for s, row in enumerate(options):
        end = ends[s][start]
        t, choice = _fastest(row, start, end, _inflight(p, s, ahead), caps[s])
        bounds.append((start, end))
        picked.append((choice, t))
        start = end
    return bounds, picked


EXACT_CHECK = 100  # stages x layers up to which split_layers_mixed is exact (see there)


def split_layers_mixed(options, n_layers: int, caps, hi: float | None = None,
                       ahead: int = 0):
    """Minimum bottleneck split with a remat per stage: (bounds, times, choices) or None
    (choices: see the module docstring). ``hi``: a bottleneck known to be reachable (the
    best one-remat split's), where the search starts. ``ahead``: memory kept for that
    many extra warm-up forwards on every stage but the last (room to hide slow
    transfers). Exact (to 1e-6 relative) on instances of at most ``EXACT_CHECK`` stages
    x layers; above, the greedy's split (see ``_pack_mixed``)."""
    if len(options) > n_layers:
        return None
    if hi is None:
        hi = max(_table(tab)[0][-1] for row in options for _, tab in row)
    memo: dict = {}

    def packer(how):
        def pack(t_max):
            got = how(t_max, options, n_layers, caps, memo, ahead)
            if got is None:
                return None
            bounds, picked = got
            times = [t for _, t in picked]
            return (bounds, times, [c for c, _ in picked]), max(times)
        return pack
    # The greedy's bisection first; then, on instances of at most EXACT_CHECK stages x
    # layers (the check costs a reach per stage and start: on large ones it would
    # multiply the search's time), one exact check just below its bottleneck (the greedy
    # is feasible wherever it packs, so a better split exists only if that check finds
    # one), and the exact bisection from there when it does.
    found = _min_bottleneck(packer(_pack_mixed), hi * 1.0001)
    if len(options) * n_layers > EXACT_CHECK:
        return found
    if found is None:
        return _min_bottleneck(packer(_pack_exact), hi * 1.0001)
    below = max(found[1]) * (1 - 1e-6)
    if _pack_exact(below, options, n_layers, caps, memo, ahead) is None:
        return found
    return _min_bottleneck(packer(_pack_exact), below)


def _table(option):
    """The slowest plain table of an option (a partial remat's full one)."""
    return option.full if isinstance(option, PartialRemat) else option


def stage_fits(stage, a: int, b: int, inflight: int, cap: float) -> bool:
    ct, cs, ca, work = stage
    return cs[b] - cs[a] + inflight * (ca[b] - ca[a]) + work[a:b].max() <= cap


def pareto_splits(options, n_layers: int, caps):
    """Every contiguous split that fits, each stage with the fastest of its (remat, table)
    options that fits, reduced to the Pareto set of (sum, max) stage time: for any
    micro-batch count the best split (fill + (m - 1) * max) is among them. Returns
    (bounds, times, choices) per point."""
    p = len(options)
    points = []
    best: dict = {}  # (stage, a, b) -> its fastest (time, choice) that fits, or None

    def stage_best(s: int, a: int, b: int):
        key = (s, a, b)
        if key not in best:
            best[key] = _fastest(options[s], a, b, p - s, caps[s])
        return best[key]

    for cuts in itertools.combinations(range(1, n_layers), p - 1):
        bounds = list(zip((0,) + cuts, cuts + (n_layers,), strict=True))
        times, remats = [], []
        for s, (a, b) in enumerate(bounds):
            got = stage_best(s, a, b)
            if got is None:
                break
            t, choice = got
            times.append(t)
            remats.append(choice)
        else:
            points.append((sum(times), max(times), bounds, times, remats))
    points.sort(key=lambda t: (t[0], t[1]))
    front, best_max = [], float("inf")
    for _total, mx, bounds, times, remats in points:
        if mx < best_max - 1e-15:
            front.append((bounds, times, remats))
            best_max = mx
    return front
