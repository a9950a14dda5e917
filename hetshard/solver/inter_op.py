"""Inter-op planning: pipelines, single-type stages, uneven layer and batch splits.

Search space. A plan is a set of pipelines ("families"). A family spans an ordered
subset of the cluster's GPU groups and uses each of them whole. Its stage order is one of
``STAGE_ORDERS``: fastest first, fastest last, or the most memory per FLOP first (under
1F1B the first stage keeps the most micro-batches in flight, so a fast GPU short of
memory can do best late, taking more layers without recomputing them). Group
g contributes ``k_g`` consecutive stages of ``R x tp`` devices (``R`` data ways inside
every stage of the family, ``tp`` tensor ways), so ``R * tp * k_g = n_g``. Groups may be
left idle. Every family has its own micro-batch count; all share the micro-batch size.
Remat is chosen per family (one for every stage) and also per stage: a fast GPU short
of memory can recompute to take more layers while slower stages keep their
activations.

Algorithm.
1. Per-layer cost tables for every (GPU type, tp, micro-batch size, remat): time of one
   micro-batch forward+backward, static and per-micro-batch memory (hetshard.cost.stage).
2. For each family configuration, the layer split minimising the slowest stage: every
   split's Pareto front where there are few (exact), else binary search on that stage
   time with a greedy contiguous packing (each stage reaching furthest) as the
   feasibility test, every stage's memory under 1F1B in-flight counts checked. The
   greedy misses a packing only where a later stage cannot take a layer an earlier one
   could (less memory, more micro-batches in flight, another GPU type); on instances of
   up to ``splits.EXACT_CHECK`` stages x layers an exact dynamic program checks it (and
   searches on where it finds better), beyond that the greedy's split stands.
   Each family's step estimate is fill + (m - 1) x period, the period being 1F1B's
   exact steady state (``sim.schedule.steady_period``) with the extra warm-up that
   minimises it within memory (``best_warmup``: hides slow transfers).
3. For each assignment of groups to families, the micro-batch counts:
   sum_f m_f * mbs * R_f = B, minimising max_f (fill_f + (m_f - 1) * period_f) (greedy,
   exact, when every family takes equal micro-batches, else CP-SAT). With many
   combinations they are ranked by the closed-form relaxation (fractional counts, a
   lower bound) and only the simulated ones get exact counts.
4. The best candidates by that estimate, plus every uniform Megatron-style plan (they
   are part of the space), are simulated in full. The best eight get a layout per GPU
   type (``layouts``: each single-type segment re-laid out as its own data ways and
   tensor degree, layers re-split; coordinate descent on the simulated time, again
   with splits keeping room for extra warm-up where memory held it back). The best
   few are also tried with re-tuned warm-up, interleaved (``variants``: each submesh's
   layers cut into ``v`` stages, Megatron-LM's virtual stages: a ``v`` times smaller
   bubble for ``v`` times the transfers and more activations in flight) and under ZB-H1
   (backward split into B and W passes), then improved by local search (at most
   ``refine_evals`` simulations each); the local optimum is tried under ZB-H1 too, and
   the fastest simulated plan that fits wins. Its gap is reported against a lower bound
   on the step time: the cluster's compute-only upper bound on throughput (no
   communication, no bubble).

The effort is set by the options, not the clock, so the same inputs give the same plan
on any machine; ``time_limit_s`` only cuts a search that would overrun it (and says so).
On tiny instances the search is exhaustive over this space (tests compare it with
brute force over layer splits, warm-ups and batch shares).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
import warnings

import numpy as np
from ortools.sat.python import cp_model

from hetshard import progress
from hetshard.cluster.catalog import GPU_DTYPE_POLICIES, gpu_dtypes
from hetshard.cluster.spec import Cluster, Group
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.comm import p2p_time
from hetshard.cost.profile import ModelProfile
from hetshard.cost.stage import REMATS
from hetshard.errors import HetshardError, SpecError
from hetshard.plan import Context, Pipeline, Plan, SolverStats, Stage, grad_sync_for
from hetshard.sim.schedule import best_warmup, capped_warmup, steady_period, warmup_rooms
from hetshard.sim.simulator import (
    annotate,
    simulate,
    tune_warmup,
    upper_bound_tokens_per_s,
    warmup_short_of_memory,
)
from hetshard.solver.layouts import improve_layouts
from hetshard.solver.splits import (
    LayerTables,
    choice_parts,
    pareto_splits,
    plain,
    remat_choice,
    split_layers,
    split_layers_mixed,
    stage_fits,
    with_partial,
)
from hetshard.solver.variants import interleave, interleaved_as, layer_times, zero_bubble


class NoFeasiblePlanError(HetshardError, ValueError):
    """No plan in the search space fits the cluster's memory (or divides the batch)."""


class PlannerTimeLimitWarning(UserWarning):
    """The time limit cut the search: the plan is the best found, with its gap."""


# How a family of several GPU types orders its stages (``_orders``).
STAGE_ORDERS = ("fastest-first", "fastest-last", "memory-first")


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    time_limit_s: float = 60.0
    mbs_options: tuple[int, ...] = (1, 2, 4, 8)
    # "selective" (JAX's dots_with_no_batch_dims_saveable per layer) on request: searched
    # with the others, its candidates crowd out the starts whose descents end fastest
    # (docs/planner.md has the measurements).
    remat_options: tuple[str, ...] = ("none", "full")
    tp_options: tuple[int, ...] = (1, 2, 4, 8)
    cp_options: tuple[int, ...] = (1, 2, 4, 8)  # context parallelism, for long sequences
    context_min_seq: int = 8192  # cp > 1 is considered from this sequence length on
    memory_margin: float = 0.05  # fraction of each GPU's memory kept free
    simulate_top: int = 24
    # best simulated candidates improved by local search (fewer lost good starts once
    # collective matmuls made tensor-parallel starts rank higher: docs/planner.md)
    refine_top: int = 4
    variant_top: int = 12  # best simulated candidates tried interleaved and re-warmed
    refine_evals: int = 300  # simulations per local search (deterministic effort)
    layout_top: int = 12  # best simulated plans given a layout per GPU type
    partial_top: int = 3  # of those, the ones whose descent goes on with partial remat
    layout_evals: int = 200  # simulations per layout descent (a layout per GPU type)
    exact_combos: int = 512  # exact micro-batch counts for every combination up to this
    attention: str = "flash"
    # Tensor-parallel stages as collective matmuls (``Plan.tp_overlap``; the runtime's
    # ``hetshard.collectives.matmul``), priced with their collectives overlapped (never
    # slower than without: what cannot hide is paid as the plain collective would be).
    tp_overlap: bool = True
    schedule: str = "1f1b"
    # With schedule "1f1b": the best plans also tried under ZB-H1 (backward split into B
    # and W passes, W filling the bubbles), and kept where faster within memory.
    zero_bubble: bool = True
    virtual_options: tuple[int, ...] = (1, 2, 3, 4)  # stages per submesh (interleaving)
    # ZeRO-1 (Megatron-LM's distributed optimizer): optimizer state sharded over each
    # stage's data ways, for the same traffic as the gradient all-reduce it replaces, but
    # the parameter all-gather waits for the update. None: chosen per plan (families are
    # sized with it; the best plans are also simulated without); True/False: always/never
    distributed_optimizer: bool | None = None
    include_uniform: bool = True
    max_stages: int | None = None  # per pipeline (None: no limit)
    max_pipelines: int | None = None
    # Stage boundaries inside blocks (attention | MLP halves as layers): True searches
    # halves from the start, False never splits, None refines the best whole-block plan
    # in halves (``refine_halves``) on clusters of at most ``split_blocks_max_devices``
    # GPUs and keeps it when faster.
    split_blocks: bool | None = None
    split_blocks_max_devices: int = 256
    # Stage orders tried for every family of several GPU types (``STAGE_ORDERS``).
    stage_orders: tuple[str, ...] = STAGE_ORDERS
    exhaustive_splits: int = 2000  # enumerate every layer split when there are at most this many
    exhaustive_combos: int = 4096  # no pruning of family candidates below this many combinations
    # Compute dtype per GPU type (``Plan.gpu_dtypes``, ``catalog.gpu_dtypes``): "program"
    # (every GPU in the program's dtype) or "fastest" (float16 with loss scaling on GPU
    # types without bfloat16 tensor cores, V100 and T4, under a bfloat16 program).
    gpu_dtypes: str = "program"
    # For sequences of at least ``context_min_seq`` on clusters of several GPU types,
    # also plans whose context groups span the types, each device attending a chunk
    # sized to its speed (``hetshard.solver.context``).
    mixed_context: bool = True

    def __post_init__(self):
        if self.gpu_dtypes not in GPU_DTYPE_POLICIES:
            raise SpecError("gpu_dtypes", self.gpu_dtypes, f"one of {GPU_DTYPE_POLICIES}")
        if (not isinstance(self.stage_orders, tuple) or not self.stage_orders or
                any(o not in STAGE_ORDERS for o in self.stage_orders)):
            raise SpecError("stage_orders", self.stage_orders,
                            f"a non-empty tuple of {STAGE_ORDERS}")


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
        exhaustive = math.comb(n_layers - 1, sum(ks) - 1) <= opts.exhaustive_splits
        for mbs in opts.mbs_options:
            if time.perf_counter() > deadline:
                return out
            options, caps, names = [], [], []
            for g, k in zip(groups, ks, strict=True):
                row = [(remat, tables.get(g, tp, mbs, remat, r, cp))
                       for remat in opts.remat_options]
                options += [row] * k
            # A remat that prices every stage exactly like an earlier one adds no plan.
            keep = [j for j in range(len(options[0])) if not any(
                all(_same(options[s][j][1], options[s][i][1]) for s in range(len(options)))
                for i in range(j))]
            options = [[row[j] for j in keep] for row in options]
            for g, k in zip(groups, ks, strict=True):
                caps += [g.gpu.memory_bytes * (1 - opts.memory_margin)] * k
                names += [g.name] * k
            # With the full remat of a stage's first k layers only (k as few as fit) too,
            # where every split is listed: those splits are added where a stage takes it,
            # as their own kind. (Bisecting them on large instances cost mix3-x256 its
            # search budget for no gain: there the layout descent brings partial remat.)
            rows: dict = {}  # one per GPU type: its searches are remembered
            partial = [rows.setdefault(tuple(id(t) for _, t in row), with_partial(row))
                       for row in options]
            if len(partial[0]) == len(options[0]) or not exhaustive:
                partial = None
            if exhaustive:
                # Every split, each stage with its fastest remat that fits: the Pareto
                # set of (sum, max) covers every per-family and per-stage remat choice.
                splits = pareto_splits(options, n_layers, caps)
                if partial is not None:
                    splits += [sp for sp in pareto_splits(partial, n_layers, caps)
                               if _has_partial(sp[2])]
            else:
                # Bottleneck splits: one remat for all stages, and one per stage where
                # memory, not time, stops a stage of the fastest remat's split.
                splits = []
                for remat, _ in options[0]:
                    res = split_layers([plain(row)[remat] for row in options], n_layers, caps)
                    if res is not None:
                        splits.append((*res, [remat] * len(options)))
                if _memory_bound(options, splits, n_layers, caps):
                    best = min((max(t) for _, t, _ in splits), default=None)
                    res = split_layers_mixed(options, n_layers, caps, best)
                    if res is not None and len(set(res[2])) > 1:
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


def assign_batch(families: list[Family], global_batch: int):
    """Micro-batch counts per family minimising the slowest family's time: greedy (exact)
    when every family takes the same samples per micro-batch, else CP-SAT."""
    units = {f.samples_per_microbatch for f in families}
    if len(units) == 1:
        return _assign_equal_units(families, global_batch, units.pop())
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


def _assign_equal_units(families: list[Family], global_batch: int, unit: int):
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


def planned_gpu_dtypes(profile: ModelProfile, cluster: Cluster,
                       opts: PlannerOptions) -> tuple[tuple[str, str], ...]:
    """``Plan.gpu_dtypes`` of the options' policy for the program and cluster."""
    return gpu_dtypes(cluster, profile.dtype, opts.gpu_dtypes)


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
            mesh = (("data", f.r),) + ((("context", f.cp),) if f.cp > 1 else ()) + \
                (("tensor", f.tp),)
            remat, remat_layers = f.remat_of(len(stages))
            stages.append(Stage(a, b, devices, cluster.group(g).gpu.name, mesh, remat,
                                remat_layers))
        pipes.append(Pipeline(tuple(stages), mcount * f.samples_per_microbatch, f.mbs, mcount,
                              opts.schedule, extra_warmup=capped_warmup(f.warmup, mcount)))
    sync = grad_sync_for(pipes, global_batch)
    cp = max(f.cp for f in families)
    # Stages are single-type, so equal chunks balance a stage's context axis; the kernels
    # also take uneven chunks (context_parallel_attention) for mixed-speed devices.
    context = Context(cp, (seq_len // cp,) * cp if cp > 1 else (), True)
    return Plan(model=model, cluster=cluster.to_dict(), global_batch=global_batch,
                seq_len=seq_len, pipelines=tuple(pipes), grad_sync=sync, context=context,
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


def _assignments(groups: tuple[Group, ...], peak, orders: tuple[str, ...] = ("fastest-first",)):
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


def plan(model: str, profile: ModelProfile, cluster: Cluster, *, global_batch: int,
         seq_len: int, cal: Calibration = DEFAULT, options: PlannerOptions | None = None,
         extra_candidates: tuple[Plan, ...] = (), return_estimates: bool = False) -> Plan:
    """The best plan found for ``model`` on ``cluster`` (see the module docstring)."""
    opts = options or PlannerOptions()
    t0 = time.perf_counter()
    # The search is deterministic: its effort is fixed by the options (every family
    # configuration, every group assignment, local search of at most ``refine_evals``
    # simulations per start), not by the clock. ``time_limit_s`` is a safety net: past
    # 25% of it no more heuristic seeds, past 60% no more combinations, past 85% no
    # more refinement; a plan cut short says so (status "time_limit", a warning).
    if global_batch < 1:
        raise SpecError("global_batch", global_batch, "a positive integer")
    tables = LayerTables(profile, cluster, cal, opts.attention,
                         opts.distributed_optimizer is not False, opts.tp_overlap,
                         planned_gpu_dtypes(profile, cluster, opts))
    heads = profile.tensor_divisor
    cache: dict = {}  # stage costs shared by every simulation of this search
    timed_out = False

    def late(fraction: float) -> bool:
        """Past ``fraction`` of the limit now (recorded: the plan says it was cut). A
        phase cut early does not make the later phases late: each has its own share."""
        nonlocal timed_out
        if time.perf_counter() - t0 > opts.time_limit_s * fraction:
            timed_out = True
            return True
        return False

    # Fast heuristic plans (AMP-, then Metis-style) as extra starting points: they lie in
    # this search space, and local search starts from the best.
    seeds = []
    progress.phase("heuristic starting points")
    if not return_estimates:
        from hetshard.solver.baselines import amp_like, metis_like
        for heuristic in (amp_like, metis_like):
            if late(0.25):
                break
            seed = heuristic(model, profile, cluster, global_batch, seq_len, opts, cal,
                             deadline=t0 + opts.time_limit_s * 0.25, cache=cache)
            if seed is not None:
                seeds.append(dataclasses.replace(
                    seed, grad_sync=grad_sync_for(seed.pipelines, global_batch)))
    groups = tuple(sorted(cluster.groups, key=lambda g: -tables.peak_of(g.gpu)))
    fam_cache: dict[tuple, list[Family]] = {}
    combos = []
    progress.phase("stage layouts per GPU group")
    deadline = t0 + opts.time_limit_s * 0.6
    for assignment in _assignments(groups, tables.peak_of, opts.stage_orders):
        if opts.max_pipelines is not None and len(assignment) > opts.max_pipelines:
            continue
        per_family = []
        for fam in assignment:
            key = tuple(groups[i].name for i in fam)
            if key not in fam_cache:
                fam_cache[key] = family_configs(tuple(groups[i] for i in fam), tables,
                                                profile, opts, heads, deadline)
            cands = fam_cache[key]
            if not cands:
                break
            # Keep each family's most promising configurations (throughput at large m).
            cands = sorted(cands, key=lambda f: f.bottleneck_s / f.samples_per_microbatch)
            per_family.append(cands)
        else:
            if math.prod(len(c) for c in per_family) > opts.exhaustive_combos:
                # Per family the eight best with one remat for all stages, the best
                # with remat per stage and the best with a partial remat (ranked apart,
                # see below).
                per_family = [_prune(c, 8) for c in per_family]
            combos += [c for c in itertools.product(*per_family)
                       if global_batch >= sum(f.samples_per_microbatch for f in c)]
        if late(0.6):
            break
    # Each combination's step estimate: exact micro-batch counts (assign_batch) when there
    # are few, else the continuous relaxation (a lower bound, microseconds instead of a
    # CP-SAT solve each) ranks them and the chosen ones get exact counts.
    exact = len(combos) <= opts.exact_combos
    estimates = []
    for k, combo in enumerate(combos):
        res = assign_batch(list(combo), global_batch) if exact else \
            (None, relaxed_time(combo, global_batch))
        if res is not None:
            estimates.append((res[1], k, combo, res[0]))
    # Ties keep the enumeration order (deterministic).
    estimates = [(t, combo, counts) for t, _, combo, counts in sorted(
        estimates, key=lambda e: e[:2])]
    if return_estimates:
        return estimates
    # The estimate ignores transfers and gradient sync, so besides the global top-N the
    # best candidate of every group assignment (which groups, in which families) is
    # simulated: the simulator, not the estimate, decides between structures.
    # Plans with remat per stage, and those recomputing only some layers of a stage,
    # are ranked apart from the others: their estimates favour recomputing stages whose
    # cost the simulation then finds higher, and they must not push the others out of
    # the simulated set.
    # Exact counts are computed as candidates are chosen; a combination whose units
    # cannot add up to the batch exactly (the relaxation cannot tell) is passed over.
    candidates, seen, ranks = [], set(), {0: 0, 1: 0, 2: 0}
    for _t, combo, counts in estimates:
        mixed = max(f.kind for f in combo)
        key = (tuple(f.groups for f in combo), mixed)
        if ranks[mixed] >= opts.simulate_top and key in seen:
            continue
        if counts is None:
            res = assign_batch(list(combo), global_batch)
            if res is None:
                continue
            counts = res[0]
        candidates.append(build_plan(model, profile, cluster, list(combo), counts,
                                     global_batch, seq_len, opts))
        ranks[mixed] += 1
        seen.add(key)
    if opts.include_uniform:
        from hetshard.solver.baselines import uniform_candidates
        # Uniform plans are part of the space when each stage stays on one GPU type
        # (a mixed stage runs one SPMD program at the slowest GPU's pace).
        candidates += uniform_candidates(model, profile, cluster, global_batch, seq_len, opts,
                                         deadline=t0 + opts.time_limit_s * 0.6)
    if opts.mixed_context and not late(0.6):
        from hetshard.solver.context import mixed_context_plans
        candidates += mixed_context_plans(model, profile, cluster, global_batch=global_batch,
                                          seq_len=seq_len, opts=opts, cal=cal)
    candidates += list(extra_candidates) + seeds

    def allowed(p: Plan) -> bool:
        return single_type_stages(p, cluster, opts.mixed_context) and \
            (opts.max_stages is None or
             all(len(q.stages) <= opts.max_stages for q in p.pipelines)) and \
            (opts.max_pipelines is None or len(p.pipelines) <= opts.max_pipelines)
    candidates = [p for p in candidates if allowed(p)]
    if not candidates and opts.include_uniform and timed_out:
        # The limit cut everything before a candidate the options allow: the uniform
        # plans in full, so that a plan still comes back.
        candidates = [p for p in uniform_candidates(model, profile, cluster, global_batch,
                                                    seq_len, opts) if allowed(p)]
    if not candidates:
        raise _no_plan(profile, cluster, global_batch, tables, opts, heads)
    scored = []
    progress.phase(f"pricing {len(candidates)} candidate plans")
    for cand in candidates:
        # Past 85% of the limit, no more pricing once one candidate fits (on the largest
        # clusters one simulation takes seconds).
        if any(not key[0] for key, _, _ in scored) and late(0.85):
            break
        r = simulate(cand, profile, cluster, cal, trace=False, cache=cache,
                     margin=opts.memory_margin)
        scored.append((r.rank, cand, r))
    scored.sort(key=lambda x: x[0])
    refine_deadline = t0 + opts.time_limit_s * 0.85

    evaluate = _evaluator(profile, cluster, cal, opts, cache)
    short = _short_of_memory(profile, cluster, cal, opts, cache)

    def zero_bubble_tuned(p: Plan) -> Plan | None:
        return _zero_bubble_tuned(p, profile, cluster, cal, opts, cache)

    # A layout per GPU type (``layouts``: Metis-style stage degrees) for the best few,
    # by coordinate descent over each pipeline's single-type segments.
    relaid, partial = [], []
    progress.phase("a layout per GPU type")
    for rank, start in enumerate(scored[:opts.layout_top]):
        if start[0][0] or late(0.85) or not single_type_stages(start[1], cluster):
            continue  # (layouts per GPU type: not for context groups spanning types)
        got = improve_layouts(start, evaluate, tables, cluster, heads,
                              tp_options=opts.tp_options, remats=opts.remat_options,
                              margin=opts.memory_margin, max_stages=opts.max_stages,
                              evals=opts.layout_evals, mbs_options=opts.mbs_options,
                              short_of_memory=short, deadline=refine_deadline)
        if got[1] is not start[1]:
            relaid.append(got)
        # Then on from there with stages recomputing only their first layers. Both ends
        # stay candidates (the first can be the better once under ZB-H1); the second
        # gets its variants apart, taking no place among the best few.
        if rank >= opts.partial_top:
            continue
        more = improve_layouts(got, evaluate, tables, cluster, heads,
                               tp_options=opts.tp_options, remats=opts.remat_options,
                               margin=opts.memory_margin, max_stages=opts.max_stages,
                               evals=opts.layout_evals, partial=True,
                               mbs_options=opts.mbs_options, short_of_memory=short,
                               deadline=refine_deadline)
        if more[1] is not got[1]:
            partial.append(more)
    firsts = scored[:opts.refine_top]
    scored = sorted(scored + relaid, key=lambda x: x[0])
    # Interleaved variants of the best few (the simulator prices their extra transfers
    # and activations); with ``virtual_options`` lacking 1 only those may win.
    variants = []
    progress.phase("interleaved and zero-bubble variants")
    for key, cand, _ in scored[:opts.variant_top] + partial:
        if key[0] or late(0.85):
            continue
        tuned = tune_warmup(cand, profile, cluster, cal, margin=opts.memory_margin,
                            cache=cache)
        # Interleaved with stages cut by time and by layer count (local search starts
        # from the best; either can be better once transfers and memory are priced).
        by_time = layer_times(cand, profile, cluster, cal, cache)
        others = [interleave(cand, v, times) for v in opts.virtual_options if v != 1
                  for times in (by_time, None)]
        if opts.distributed_optimizer is None and cand.distributed_optimizer:
            others.append(dataclasses.replace(cand, distributed_optimizer=False))
        others.append(zero_bubble_tuned(cand))
        for other in [tuned if tuned != cand else None] + others:
            if other is not None:
                r = simulate(other, profile, cluster, cal, trace=False, cache=cache,
                             margin=opts.memory_margin)
                variants.append((r.rank, other, r))
    variants.sort(key=lambda x: x[0])
    if 1 not in opts.virtual_options:
        scored = [x for x in scored if interleaved_as(x[1], opts.virtual_options)]
        firsts = [x for x in firsts if interleaved_as(x[1], opts.virtual_options)]
        variants = [x for x in variants if interleaved_as(x[1], opts.virtual_options)]
        if not scored and not variants:
            vpp = opts.virtual_options
            raise SpecError("--fix vpp", vpp[0] if len(vpp) == 1 else list(vpp),
                            "1, or a value the best pipelined plans can take: at least vpp "
                            "layers on each of a pipeline's submeshes")
    # Local search from the best few plans as found, as re-laid out (one that simulates
    # faster can still end in a worse local optimum) and interleaved.
    scored = sorted(scored + partial, key=lambda x: x[0])
    starts = list({id(x[1]): x for x in firsts + scored[:opts.refine_top] +
                   variants[:opts.refine_top]}.values())
    best = min(starts, key=lambda x: x[0])
    progress.phase("local search")
    for key, cand, r in sorted(starts, key=lambda x: x[0]):
        if key[0]:
            continue
        if late(0.85):
            break
        better, better_r, cut = local_search(cand, r, profile, cluster, cal, refine_deadline,
                                             opts.refine_evals, cache, opts.memory_margin,
                                             opts.remat_options)
        timed_out = timed_out or cut
        if better_r.rank < best[0]:
            best = (better_r.rank, better, better_r)
    # The last variants (ZB-H1, without ZeRO-1) only improve on the best: skipped once the
    # limit is near (on the largest clusters each simulation takes seconds).
    chosen, result = (best[1], best[2]) if late(0.85) else \
        _last_variants(best, profile, cluster, cal, opts, cache)
    if not result.fits:
        raise _no_plan(profile, cluster, global_batch, tables, opts, heads)
    return _annotated(chosen, result, profile, cluster, cal, opts, t0, timed_out, "")


def _evaluator(profile: ModelProfile, cluster: Cluster, cal: Calibration,
               opts: PlannerOptions, cache: dict):
    """``evaluate(plan) -> (key, plan, result)``: the plan with its 1F1B warm-up tuned
    within memory, simulated; keys order plans that fit first, then by step time."""
    def evaluate(p: Plan):
        p = tune_warmup(p, profile, cluster, cal, margin=opts.memory_margin, cache=cache)
        r = simulate(p, profile, cluster, cal, trace=False, cache=cache,
                     margin=opts.memory_margin)
        return r.rank, p, r
    return evaluate


def _short_of_memory(profile: ModelProfile, cluster: Cluster, cal: Calibration,
                     opts: PlannerOptions, cache: dict):
    """``short(plan)``: whether the plan's extra warm-up is held back by memory (the
    layout descent then also splits layers keeping room for it)."""
    def short(p: Plan) -> bool:
        return warmup_short_of_memory(p, profile, cluster, cal, margin=opts.memory_margin,
                                      cache=cache)
    return short


def _zero_bubble_tuned(p: Plan, profile, cluster, cal, opts: PlannerOptions,
                       cache: dict) -> Plan | None:
    """``p`` under ZB-H1 with its best warm-up option, when the options allow it."""
    zb = zero_bubble(p) if opts.zero_bubble and opts.schedule == "1f1b" else None
    return zb and tune_warmup(zb, profile, cluster, cal, margin=opts.memory_margin,
                              cache=cache, zero_bubble_options=True)


def _last_variants(best, profile, cluster, cal, opts: PlannerOptions, cache: dict):
    """(plan, result) of the local optimum ``best`` = (key, plan, result), also tried
    under ZB-H1 (the searches start from 1F1B) and without ZeRO-1, the fastest kept."""
    zb = _zero_bubble_tuned(best[1], profile, cluster, cal, opts, cache) \
        if not best[0][0] else None
    if zb is not None:
        r = simulate(zb, profile, cluster, cal, trace=False, cache=cache,
                     margin=opts.memory_margin)
        if r.rank < best[0]:
            best = (r.rank, zb, r)
    if opts.distributed_optimizer is None:
        best = zero1_choice(best, profile, cluster, cal, cache, opts.memory_margin)
    return best[1], best[2]


def _annotated(chosen: Plan, result, profile, cluster, cal, opts: PlannerOptions,
               t0: float, timed_out: bool, doing: str) -> Plan:
    """``chosen`` with the simulator's prediction and the solver's statistics (wall time
    since ``t0``, status, gap to the compute bound); a warning when the clock cut the
    search (``doing`` says which)."""
    upper = upper_bound_tokens_per_s(profile, cluster, cal, attention=opts.attention,
                                     gpu_dtypes=chosen.gpu_dtypes)
    gap = max(0.0, 1 - chosen.global_batch * chosen.seq_len / upper / result.step_time_s)
    status = "time_limit" if timed_out else "searched"
    if timed_out:
        warnings.warn(PlannerTimeLimitWarning(
            f"planner hit its {opts.time_limit_s:g} s limit{doing}: best plan found, gap to "
            f"the compute bound {gap:.1%}"), stacklevel=3)
    chosen = dataclasses.replace(chosen, solver=SolverStats(
        time.perf_counter() - t0, status, gap))
    return annotate(chosen, result, upper)


def zero1_choice(scored, profile, cluster, cal, cache: dict | None = None,
                 margin: float = 0.0):
    """``scored`` = (key, plan, result) or, when the plan uses the distributed optimizer
    and simulates faster without it (and fits, less ``margin``), the plan without it: the
    optimizer state is then whole on every data way, but the parameter all-gather no
    longer waits for the update."""
    key, p, _ = scored
    if not p.distributed_optimizer:
        return scored
    plain = dataclasses.replace(p, distributed_optimizer=False)
    r = simulate(plain, profile, cluster, cal, trace=False, cache=cache, margin=margin)
    other = r.rank
    return (other, plain, r) if other < key else scored


def _prune(cands: list[Family], n: int) -> list[Family]:
    """The ``n`` best with one remat for all stages, the best with a remat per stage and
    the best recomputing only some layers of a stage."""
    kept = [f for kind, size in ((0, n), (1, 1), (2, 1))
            for f in [f for f in cands if f.kind == kind][:size]]
    return sorted(kept, key=lambda f: f.bottleneck_s / f.samples_per_microbatch)


def single_type_stages(plan: Plan, cluster: Cluster, context_groups: bool = False) -> bool:
    """Every stage on one GPU type (hetshard's plans; a mixed stage would run one SPMD
    program at its slowest GPU's pace), or with ``context_groups`` spanning types with
    uneven context chunks (``hetshard.solver.context``: each type its own share)."""
    return all(len({cluster.gpu_of(d).name for d in st.devices}) == 1 or
               (context_groups and bool(plan.context_chunks(st)))
               for q in plan.pipelines for st in q.stages)


def _resized(st: Stage, start: int, end: int, more: int = 0) -> Stage:
    """``st`` on layers ``[start, end)``, a partial remat recomputing ``more`` layers more
    (as many as before otherwise, at most all)."""
    k = st.remat_layers
    if k is not None:
        k = k + more
        k = None if k >= end - start else k
    return dataclasses.replace(st, start=start, end=end, remat_layers=k)


def _recomputed(st: Stage, k: int) -> Stage:
    """``st`` recomputing its first ``k`` layers (0: none, all: plain full remat)."""
    if k <= 0:
        return dataclasses.replace(st, remat="none", remat_layers=None)
    return dataclasses.replace(st, remat="full", remat_layers=None if k >= st.num_layers else k)


def _neighbours(plan: Plan, remats: tuple[str, ...] = REMATS):
    """Plans one move away: a stage boundary shifted by one layer (the stage that grows
    recomputing as many layers as before or, under a partial remat, one more), a full
    remat's stage recomputing one layer fewer or more (where ``remats`` allow a stage
    recomputing some of its layers: "none" and "full"), or one micro-batch moved from a
    pipeline to another (when their micro-batch sizes allow)."""
    pipes = plan.pipelines
    partial = {"none", "full"} <= set(remats)

    def with_stages(pi, p, st):
        new = list(pipes)
        new[pi] = dataclasses.replace(p, stages=tuple(st))
        return dataclasses.replace(plan, pipelines=tuple(new))

    for pi, p in enumerate(pipes):
        for j in range(len(p.stages) - 1):
            for delta in (-1, 1):
                a, b = p.stages[j], p.stages[j + 1]
                cut = a.end + delta
                if a.start < cut < b.end:
                    grows = (a, b)[delta < 0]
                    for more in ((0, 1) if grows.remat_layers is not None else (0,)):
                        st = list(p.stages)
                        st[j] = _resized(a, a.start, cut, more * (delta > 0))
                        st[j + 1] = _resized(b, cut, b.end, more * (delta < 0))
                        yield with_stages(pi, p, st)
        if p.virtual_stages > 1 or not partial:
            continue
        for j, a in enumerate(p.stages):
            if a.remat != "full" or a.num_layers < 2:
                continue
            k = a.num_layers if a.remat_layers is None else a.remat_layers
            for other in (k - 1, k + 1):
                if other <= a.num_layers and other != k:
                    st = list(p.stages)
                    st[j] = _recomputed(a, other)
                    yield with_stages(pi, p, st)
    for pi, qi in itertools.permutations(range(len(pipes)), 2):
        p, q = pipes[pi], pipes[qi]
        unit_p, unit_q = p.samples_per_micro_batch, q.samples_per_micro_batch
        if unit_p != unit_q or p.num_micro_batches <= 1 or \
                p.virtual_stages > 1 or q.virtual_stages > 1:  # counts stay multiples
            continue
        new = list(pipes)
        new[pi] = dataclasses.replace(p, num_micro_batches=p.num_micro_batches - 1,
                                      batch_share=p.batch_share - unit_p)
        new[qi] = dataclasses.replace(q, num_micro_batches=q.num_micro_batches + 1,
                                      batch_share=q.batch_share + unit_q)
        yield dataclasses.replace(plan, pipelines=tuple(new),
                                  grad_sync=grad_sync_for(new, plan.global_batch))


def local_search(plan: Plan, result, profile, cluster, cal, deadline: float,
                 evals: int = 1 << 30, cache: dict | None = None,
                 margin: float | None = None, remats: tuple[str, ...] = REMATS):
    """First-improvement hill climbing on the simulated step time (memory must fit, less
    ``margin``), for at most ``evals`` simulations; with ``margin``, each neighbour's 1F1B
    warm-up is re-tuned to its layer split (``tune_warmup``); moves stay within
    ``remats``. Returns (plan, result, whether the clock cut it)."""
    best, best_r = plan, result
    improved, cut = True, False
    while improved and evals > 0 and not cut:
        improved = False
        for cand in _neighbours(best, remats):
            if evals <= 0:
                break
            if time.perf_counter() > deadline:
                cut = True
                break
            evals -= 1
            try:
                if margin is not None:
                    cand = tune_warmup(cand, profile, cluster, cal, margin=margin, cache=cache)
                r = simulate(cand, profile, cluster, cal, trace=False, cache=cache,
                             margin=margin or 0.0)
            except HetshardError:
                continue
            if r.fits and r.step_time_s < best_r.step_time_s * (1 - 1e-9):
                best, best_r, improved = cand, r, True
                break
    if best is not plan:
        best = dataclasses.replace(best, grad_sync=grad_sync_for(best.pipelines,
                                                                 best.global_batch))
    return best, best_r, cut


def _no_plan(profile, cluster, global_batch, tables, opts, heads) -> Exception:
    """An error naming the tightest stage: the largest GPU type, most sharding, full remat."""
    g = max(cluster.groups, key=lambda g: g.gpu.memory_bytes * g.num_devices)
    tp = max(t for t in opts.tp_options if t <= g.gpus_per_node and heads % t == 0)
    ct, cs, ca, work = tables.get(g, tp, min(opts.mbs_options), "full", 1)
    stages = max(1, min(profile.num_layers, g.num_devices // tp))
    per_stage = profile.num_layers / stages
    need = (cs[-1] + stages * ca[-1]) / profile.num_layers * per_stage + work.max()
    cap = g.gpu.memory_bytes * (1 - opts.memory_margin)
    min_batch = min(f for f in [1])
    if need <= cap:  # memory is not what rules every candidate out: the batch split is
        mbs = sorted(opts.mbs_options)
        dividing = [m for m in mbs if global_batch % m == 0]
        why = (f"global batch {global_batch} is not a multiple of any allowed micro-batch "
               f"size {mbs}" if not dividing else
               f"no split of global batch {global_batch} into pipelines of micro-batches "
               f"of {dividing} samples per data way satisfies the constraints (tensor "
               f"degrees {list(opts.tp_options)}, at most "
               f"{opts.max_stages or 'any'} stages, {opts.max_pipelines or 'any'} pipelines)")
        return NoFeasiblePlanError(
            f"no plan: {why}; a pipeline's share is micro-batch size x micro-batches x data "
            f"ways (choose a global batch that the micro-batch size divides, or drop --fix "
            f"mbs)")
    return NoFeasiblePlanError(
        f"no plan fits: even on group {g.name!r} ({g.num_devices}x {g.gpu.name}) with "
        f"tensor parallelism {tp}, {stages} pipeline stages, micro-batch "
        f"{min(opts.mbs_options)} and full remat, the tightest stage needs "
        f"{need / 1e9:.1f} GB per GPU against {cap / 1e9:.1f} GB usable "
        f"(global batch {global_batch}, at least {min_batch} sample per pipeline)")


def _half_index(blocks: ModelProfile, halves: ModelProfile) -> list[int]:
    """Per layer of ``blocks`` (and its end), the index of its first layer in ``halves``
    (a block's attention half; other layers are the same in both)."""
    names = halves.layer_names()
    out, j = [], 0
    for layer in blocks.layers:
        while not (names[j] == layer.name or names[j].startswith(layer.name + "/")):
            j += 1
        out.append(j)
    return out + [len(names)]


def as_halves(plan: Plan, blocks: ModelProfile, halves: ModelProfile) -> Plan:
    """``plan`` with its layer indices counting block halves: the same stages, the same
    program (a stage's recomputed layers keep covering the same blocks)."""
    index = _half_index(blocks, halves)
    pipes = []
    for q in plan.pipelines:
        stages = []
        for st in q.stages:
            k = st.remat_layers
            stages.append(dataclasses.replace(
                st, start=index[st.start], end=index[st.end],
                remat_layers=None if k is None else index[st.start + k] - index[st.start]))
        pipes.append(dataclasses.replace(q, stages=tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(pipes), split_blocks=True,
                               grad_sync=grad_sync_for(pipes, plan.global_batch))


def refine_halves(plan: Plan, blocks: ModelProfile, halves: ModelProfile,
                  cluster: Cluster, *, cal: Calibration = DEFAULT,
                  options: PlannerOptions | None = None) -> Plan:
    """The best plan found from ``plan`` (a whole-block plan) with stage boundaries
    allowed inside blocks: the plan in halves (``as_halves``, the same program), then the
    layout descent (with and without partial remat), local search and ZB-H1 as in
    ``plan``, on the ``halves`` profile. The search's effort is fixed by the options;
    ``time_limit_s`` cuts it (status ``time_limit``)."""
    opts = options or PlannerOptions()
    t0 = time.perf_counter()
    tables = LayerTables(halves, cluster, cal, opts.attention,
                         opts.distributed_optimizer is not False, opts.tp_overlap,
                         planned_gpu_dtypes(halves, cluster, opts))
    heads = halves.tensor_divisor
    cache: dict = {}
    evaluate = _evaluator(halves, cluster, cal, opts, cache)
    found = [evaluate(as_halves(plan, blocks, halves))]
    layout_deadline = t0 + opts.time_limit_s * 0.5
    short = _short_of_memory(halves, cluster, cal, opts, cache)
    for partial in (False, True):
        if time.perf_counter() > layout_deadline:
            break
        found.append(improve_layouts(found[-1], evaluate, tables, cluster, heads,
                                     tp_options=opts.tp_options, remats=opts.remat_options,
                                     margin=opts.memory_margin, max_stages=opts.max_stages,
                                     evals=opts.layout_evals, partial=partial,
                                     mbs_options=opts.mbs_options, short_of_memory=short,
                                     deadline=layout_deadline))
    layouts_cut = time.perf_counter() > layout_deadline
    best = min(found, key=lambda x: x[0])
    better, better_r, cut = local_search(best[1], best[2], halves, cluster, cal,
                                         t0 + opts.time_limit_s * 0.85, opts.refine_evals,
                                         cache, opts.memory_margin, opts.remat_options)
    cut = cut or len(found) < 3 or layouts_cut
    if better_r.rank < best[0]:
        best = (better_r.rank, better, better_r)
    chosen, result = _last_variants(best, halves, cluster, cal, opts, cache)
    return _annotated(chosen, result, halves, cluster, cal, opts, t0, cut,
                      " refining with blocks split")
