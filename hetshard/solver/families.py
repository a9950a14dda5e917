"""Phases 1-2 of the inter-op search: pipeline families over GPU groups and their best
layer splits (see ``inter_op``'s module docstring), and a family set with its
micro-batch counts as a Plan."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np

from hetshard._plan import Context, Pipeline, Plan, Stage
from hetshard.cluster.spec import Cluster, Group
from hetshard.cost.comm import p2p_time
from hetshard.cost.profile import ModelProfile
from hetshard.offload import split_key
from hetshard.sim.schedule import best_warmup, capped_warmup, steady_period, warmup_rooms
from hetshard.solver.options import (
    PlannerOptions,
    data_axes,
    ep_ways,
    fsdp_ways,
    planned_gpu_dtypes,
)
from hetshard.solver.splits import (
    LayerTables,
    choice_parts,
    pareto_splits,
    plain,
    remat_choice,
    split_layers,
    split_layers_mixed,
    stage_fits,
    stage_memory,
    with_partial,
)


@dataclasses.dataclass(frozen=True)
class Family:
    groups: tuple[str, ...]
    r: int
    tp: int
    mbs: int
    remat: str | tuple[str, int]
    bounds: tuple[tuple[int, int], ...]  # layer range per stage
    stage_groups: tuple[str, ...]
    fill_s: float  # sum of stage times (one micro-batch through the pipeline)
    bottleneck_s: float
    cp: int = 1
    # per stage when they differ (else ``remat``); a choice is a remat's name or
    # (remat, k): the stage's first k layers recomputed (``splits.remat_choice``)
    stage_remats: tuple = ()
    warmup: tuple[int, ...] = ()  # extra 1F1B warm-up forwards per stage (empty: none)

    @property
    def kind(self) -> int:
        """0: one remat for all stages, 1: a remat per stage, 2: some stage recomputing
        only its first layers (ranked apart: see ``plan``)."""
        if _has_partial(self.stage_remats or (self.remat,)):
            return 2
        return 1 if self.stage_remats else 0

    def remat_of(self, stage: int) -> tuple[str, int | None]:
        """(remat, remat_layers) of a stage."""
        return remat_choice(self.stage_remats[stage] if self.stage_remats else self.remat)

    @property
    def stage_devices(self) -> int:
        return self.r * self.cp * self.tp

    @property
    def samples_per_microbatch(self) -> int:
        return self.mbs * self.r


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def family_configs(groups: tuple[Group, ...], tables: LayerTables, profile: ModelProfile,
                   opts: PlannerOptions, heads: int, deadline: float):
    """Best splits for every (R, cp, tp, mbs) of a family spanning ``groups``, with one
    remat for all its stages or one per stage."""
    out = []
    n_layers = profile.num_layers
    gcd = math.gcd(*[g.num_devices for g in groups])
    cps = [c for c in opts.cp_options if c == 1 or (profile.seq_len >= opts.context_min_seq
                                                     and profile.seq_len % c == 0)]
    for r, cp, tp in itertools.product(divisors(gcd), cps, opts.tp_options):
        if heads % tp or any(tp > g.gpus_per_node for g in groups):
            continue
        if any(g.num_devices % (r * tp * cp) for g in groups):
            continue
        ks = [g.num_devices // (r * tp * cp) for g in groups]
        if sum(ks) > n_layers or (opts.max_stages is not None and sum(ks) > opts.max_stages):
            continue
        exhaustive = math.comb(n_layers - 1, sum(ks) - 1) <= opts.search.exhaustive_splits
        for mbs in opts.mbs_options:
            if time.perf_counter() > deadline:
                return out
            caps = [g.gpu.memory_bytes * (1 - opts.memory_margin)
                    for g, k in zip(groups, ks, strict=True) for _ in range(k)]
            names = [g.name for g, k in zip(groups, ks, strict=True) for _ in range(k)]
            # Offload to host memory is searched where memory binds: where the fastest
            # option without it cannot place the layers, or one of its stages could take
            # a layer more but for memory (elsewhere it cannot make a plan faster).
            keys = _offload_where_bound(groups, ks, tables, tp, mbs, r, cp, opts, n_layers,
                                        caps)
            options = []
            for g, k in zip(groups, ks, strict=True):
                row = [(remat, tables.get(g, tp, mbs, remat, r, cp)) for remat in keys]
                options += [row] * k
            # A remat that prices every stage exactly like an earlier one adds no plan.
            keep = [j for j in range(len(options[0])) if not any(
                all(_same(options[s][j][1], options[s][i][1]) for s in range(len(options)))
                for i in range(j))]
            options = [[row[j] for j in keep] for row in options]
            # With the full remat of a stage's first k layers only (k as few as fit) too,
            # where every split is listed: those splits are added where a stage takes it,
            # as their own kind. (Bisecting them on large instances cost mix3-x256 its
            # search budget for no gain: there the layout descent brings partial remat.)
            rows: dict = {}  # one per GPU type: its searches are remembered
            partial = [rows.setdefault(tuple(id(t) for _, t in row), with_partial(row))
                       for row in options]
            if len(partial[0]) == len(options[0]) or not exhaustive:
                partial = None
            # The options without offload to host memory, searched on their own too:
            # offload's estimate (its host copies spread over the micro-batches) must
            # not take a stage's choice from a layout the simulation prices faster.
            bare = [[(k, t) for k, t in row if not split_key(k)[1]] for row in options]
            apart = [bare] if 0 < len(bare[0]) < len(options[0]) else []
            if exhaustive:
                # Every split, each stage with its fastest remat that fits: the Pareto
                # set of (sum, max) covers every per-family and per-stage remat choice.
                splits = pareto_splits(options, n_layers, caps)
                splits += [sp for rows_ in apart for sp in pareto_splits(rows_, n_layers, caps)
                           if sp not in splits]
                if partial is not None:
                    splits += [sp for sp in pareto_splits(partial, n_layers, caps)
                               if _has_partial(sp[2])]
            else:
                # Bottleneck splits: one remat for all stages, and one per stage where
                # memory, not time, stops a stage of the fastest remat's split.
                # (Offload to host memory comes in through the per-stage split: a stage
                # takes it where it needs it.)
                splits = []
                for remat, _ in options[0]:
                    if split_key(remat)[1]:
                        continue
                    res = split_layers([plain(row)[remat] for row in options], n_layers, caps)
                    if res is not None:
                        splits.append((*res, [remat] * len(options)))
                if _memory_bound(options, splits, n_layers, caps):
                    best = min((max(t) for _, t, _ in splits), default=None)
                    for rows_ in [options, *apart]:
                        res = split_layers_mixed(rows_, n_layers, caps, best)
                        if res is not None and len(set(res[2])) > 1 and res not in splits:
                            splits.append(res)
            for bounds, times, remats in splits:
                mixed = tuple(remats) if len(set(remats)) > 1 else ()
                fill, bottleneck, warmup = pipeline_estimate(
                    tables, names, r * cp * tp, mbs * r, bounds, times, opts.schedule,
                    _activation_room(partial or options, bounds, remats, caps))
                out.append(Family(tuple(g.name for g in groups), r, tp, mbs, remats[0],
                                  tuple(bounds), tuple(names), fill, bottleneck, cp, mixed,
                                  warmup))
    return out


def _offload_where_bound(groups, ks, tables: LayerTables, tp: int, mbs: int, r: int,
                         cp: int, opts: PlannerOptions, n_layers: int, caps) -> tuple:
    """The options' memory options (``PlannerOptions.memory_options``) for a family's
    configuration, without those that offload to host memory where memory does not bind
    (``_memory_bound`` of the options without)."""
    keys = opts.memory_options
    bare_keys = tuple(k for k in keys if not split_key(k)[1])
    if len(bare_keys) == len(keys) or not bare_keys:
        return keys
    bare = [[(k, tables.get(g, tp, mbs, k, r, cp)) for k in bare_keys]
            for g, n in zip(groups, ks, strict=True) for _ in range(n)]
    fastest = bare_keys[0]
    res = split_layers([plain(row)[fastest] for row in bare], n_layers, caps)
    splits = [] if res is None else [(*res, [fastest] * len(bare))]
    return keys if _memory_bound(bare, splits, n_layers, caps) else bare_keys


def pipeline_estimate(tables: LayerTables, stage_groups, stage_devices: int, samples: int,
                      bounds, times, schedule: str, memory=None
                      ) -> tuple[float, float, tuple[int, ...]]:
    """(fill, period, extra warm-up) of a pipeline: one micro-batch's time through all
    stages and back, transfers included, the steady-state time per micro-batch, and the
    1F1B warm-up forwards to add per stage. Under 1F1B the period is the schedule's
    maximum cycle mean (``sim.schedule.steady_period``: the slowest stage, or a loop through
    slow transfers with too few micro-batches in flight); with ``memory`` (per stage:
    bytes free for activations, bytes per micro-batch in flight) the extra warm-up that
    minimises it as memory allows (``sim.schedule.best_warmup``). Transfers are priced like the
    simulator's (``p2p_time``)."""
    cluster, profile = tables.cluster, tables.profile
    p = len(times)
    starts: dict[str, int] = {}
    devices = []
    for g in stage_groups:
        first = cluster.group_device_ids(g).start + starts.get(g, 0)
        starts[g] = starts.get(g, 0) + stage_devices
        devices.append(range(first, first + stage_devices))
    links = [p2p_time(profile.layers[bounds[s][1] - 1].boundary_bytes_per_sample * samples,
                      cluster, devices[s], devices[s + 1], tables.cal) for s in range(p - 1)]
    fill = float(sum(times) + 2 * sum(links))
    if schedule == "gpipe":  # (ZB-H1 is estimated as 1F1B, which bounds it from above)
        return fill, float(max(times)), ()
    if memory is None:
        return fill, steady_period(times, links), ()
    period, extra = best_warmup(times, links, warmup_rooms(memory, p))
    return fill, period, extra


def _has_partial(choices) -> bool:
    return any(remat_choice(c)[1] is not None for c in choices)


def _activation_room(options, bounds, remats, caps):
    """Per stage: (bytes left for activations in flight, bytes per micro-batch)."""
    out = []
    for s, (a, b) in enumerate(bounds):
        _, static, per_mb, work = choice_parts(options[s], remats[s], a, b)
        out.append((caps[s] - static - work, per_mb))
    return out


def _same(a, b) -> bool:
    return a is b or all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _memory_bound(options, splits, n_layers: int, caps) -> bool:
    """Whether remat per stage could beat the uniform splits: the fastest option's split
    is missing or one of its stages could not take one more layer for lack of memory."""
    fastest = options[0][0][0]
    found = next((b for b, _, r in splits if r[0] == fastest), None)
    if found is None:
        return True
    p = len(options)
    return any(b < n_layers and not stage_fits(plain(options[s])[fastest], a, b + 1, p - s,
                                               caps[s])
               for s, (a, b) in enumerate(found))


def build_plan(model: str, profile: ModelProfile, cluster: Cluster, families, counts,
               global_batch: int, seq_len: int, opts: PlannerOptions) -> Plan:
    pipes = []
    for f, mcount in zip(families, counts, strict=True):
        next_free = {g: iter(range(cluster.group_device_ids(g).start,
                                   cluster.group_device_ids(g).stop, f.stage_devices))
                     for g in f.groups}
        stages = []
        for (a, b), g in zip(f.bounds, f.stage_groups, strict=True):
            first = next(next_free[g])
            devices = tuple(range(first, first + f.stage_devices))
            per_node = cluster.group(g).gpus_per_node
            ways = fsdp_ways(opts.state_sharding, f.r, f.tp, f.cp, per_node)
            holds = any(layer.experts for layer in profile.layers[a:b])
            ep = ep_ways(profile, opts.ep_options, f.r, f.tp, f.cp, per_node, ways) \
                if holds else 1
            mesh = data_axes(f.r, ways, ep) + ((("context", f.cp),) if f.cp > 1 else ()) + \
                (("tensor", f.tp),)
            stages.append(Stage(a, b, devices, cluster.group(g).gpu.name, mesh,
                                **stage_memory(f.stage_remats[len(stages)] if f.stage_remats
                                               else f.remat)))
        pipes.append(Pipeline(tuple(stages), mcount * f.samples_per_microbatch, f.mbs, mcount,
                              opts.schedule, extra_warmup=capped_warmup(f.warmup, mcount)))
    cp = max(f.cp for f in families)
    # Stages are single-type, so equal chunks balance a stage's context axis; the kernels
    # also take uneven chunks (context_parallel_attention) for mixed-speed devices.
    context = Context(cp, (seq_len // cp,) * cp if cp > 1 else (), True)
    return Plan(model=model, cluster=cluster, global_batch=global_batch,
                seq_len=seq_len, pipelines=tuple(pipes), context=context,
                dtype=profile.dtype, distributed_optimizer=opts.distributed_optimizer is not False,
                attention=opts.attention, split_blocks=profile.split_blocks,
                tp_overlap=opts.tp_overlap, fingerprint=profile.fingerprint,
                gpu_dtypes=planned_gpu_dtypes(profile, cluster, opts))


def _orders(fam: tuple[int, ...], groups: tuple[Group, ...], peak,
            orders: tuple[str, ...]) -> list[tuple[int, ...]]:
    """The distinct stage orders of a family over ``groups[i] for i in fam`` (indices
    sorted fastest first). Under 1F1B the first stage keeps the most micro-batches in
    flight (p of them) and the last stage one: a fast GPU short of memory does best late
    ("fastest-last"), and more generally the GPUs with the most memory per FLOP go first
    ("memory-first"; ties keep the speed order)."""
    found = []
    for order in orders:
        if order == "fastest-first":
            seq = fam
        elif order == "fastest-last":
            seq = fam[::-1]
        else:
            seq = tuple(sorted(fam, key=lambda i: -groups[i].gpu.memory_bytes /
                               peak(groups[i].gpu)))
        if seq not in found:
            found.append(seq)
    return found


def assignments(groups: tuple[Group, ...], peak, orders: tuple[str, ...] = ("fastest-first",)):
    """Every way to split the groups (sorted fastest first) into families or leave idle,
    each family in each of its stage ``orders``; ``peak(gpu)``: its FLOP/s."""
    names = list(range(len(groups)))

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            yield [[first]] + part
            for i in range(len(part)):
                yield part[:i] + [[first] + part[i]] + part[i + 1:]
    for used_mask in range(1, 2 ** len(names)):
        used = [i for i in names if used_mask >> i & 1]
        for part in partitions(used):
            yield from (list(combo) for combo in itertools.product(
                *(_orders(tuple(sorted(fam)), groups, peak, orders) for fam in part)))


def prune(cands: list[Family], n: int) -> list[Family]:
    """The ``n`` best with one remat for all stages, the best with a remat per stage and
    the best recomputing only some layers of a stage, each among the families that
    offload to host memory and among those that do not (so neither crowds the other
    out). A family offloading is left out where the same layout without offload is as
    fast (its estimate spreads the per-step host copies: the simulator prices them)."""
    bare = {_layout(f): f.bottleneck_s for f in cands if not offloads(f)}
    cands = [f for f in cands if not offloads(f) or
             bare.get(_layout(f), float("inf")) > f.bottleneck_s]
    kept = [f for kind, size in ((0, n), (1, 1), (2, 1)) for off in (False, True)
            for f in [f for f in cands if f.kind == kind and offloads(f) == off][:size]]
    return sorted(kept, key=lambda f: f.bottleneck_s / f.samples_per_microbatch)


def offloads(f: Family) -> bool:
    """Whether some stage of ``f`` offloads to host memory."""
    return any(split_key(remat_choice(c)[0])[1] for c in (f.stage_remats or (f.remat,)))


def _layout(f: Family) -> tuple:
    return (f.groups, f.r, f.tp, f.mbs, f.cp, f.bounds, f.stage_groups)
