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

import collections
import dataclasses
import itertools
import math
import time

from hetshard import progress
from hetshard._plan import Plan
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.profile import ModelProfile
from hetshard.errors import SpecError
from hetshard.offload import split_key
from hetshard.sim.simulator import annotate
from hetshard.solver.baselines import (
    amp_like,
    group_uniform_candidates,
    metis_like,
    uniform_candidates,
)
from hetshard.solver.batch import assign_batch, relaxed_time
from hetshard.solver.context import mixed_context_plans
from hetshard.solver.evaluator import Candidate, Evaluator
from hetshard.solver.families import (
    Family,
    assignments,
    build_plan,
    family_configs,
    offloads,
    prune,
)
from hetshard.solver.layouts import improve_layouts
from hetshard.solver.options import (
    BUDGET,
    NoFeasiblePlanError,
    PlannerOptions,
)
from hetshard.solver.search import local_search
from hetshard.solver.splits import LayerTables
from hetshard.solver.variants import interleave, interleaved_as, layer_times


def plan_offloads(plan: Plan) -> bool:
    """Whether some stage of ``plan`` keeps state or activations in host memory."""
    return any(st.offload for p in plan.pipelines for st in p.stages)


def plan(model: str, profile: ModelProfile, cluster: Cluster, *, global_batch: int,
         seq_len: int, cal: Calibration = DEFAULT, options: PlannerOptions | None = None,
         extra_candidates: tuple[Plan, ...] = (), with_starts: bool = False):
    """The best plan found for ``model`` on ``cluster`` (see the module docstring).
    Under ``state_sharding="auto"``, where no plan fits, the search runs again with each
    stage's state sharded inside its nodes (hybrid), then over all its data ways.
    ``with_starts``: (the plan, the best plan found without offload to host memory where
    the plan offloads, else None, and ``_Search.orders``: the best priced candidate of
    each of the best few stage orders, for the caller's refinement in block halves)."""
    opts = options or PlannerOptions()
    tries = [opts] + ([dataclasses.replace(opts, state_sharding=s) for s in ("node", "all")]
                      if opts.state_sharding == "auto" else [])
    for k, now in enumerate(tries):
        try:
            search = _Search(model, profile, cluster, global_batch, seq_len, cal, now)
            seeds = search.seeds()
            ranked = search.estimates(search.combinations())
            candidates = search.candidates(ranked, tuple(extra_candidates) + tuple(seeds))
            scored = search.price(candidates)
            found = search.refined(scored)
            return (found, search.bare, search.orders(scored)) if with_starts else found
        except NoFeasiblePlanError:
            if k == len(tries) - 1:
                raise


def estimates(model: str, profile: ModelProfile, cluster: Cluster, *, global_batch: int,
              seq_len: int, cal: Calibration = DEFAULT,
              options: PlannerOptions | None = None) -> list[tuple]:
    """Phases 1-3 alone: (step estimate, family combination, micro-batch counts or None)
    for every combination, best first (what ``plan`` simulates the best of)."""
    search = _Search(model, profile, cluster, global_batch, seq_len, cal, options)
    return search.estimates(search.combinations())


class _Search:
    """One run of ``plan``: its phases in order, sharing the evaluator, the per-layer
    tables and the clock.

    The search is deterministic: its effort is fixed by the options (every family
    configuration, every group assignment, local search of at most ``refine_evals``
    simulations per start), not by the clock. ``time_limit_s`` is a safety net: each
    phase ends at its share of it (``options.BUDGET``); a plan cut short says so (status
    "time_limit", a warning)."""

    def __init__(self, model, profile, cluster, global_batch, seq_len, cal, options):
        self.opts = opts = options or PlannerOptions()
        self.t0 = time.perf_counter()
        if global_batch < 1:
            raise SpecError("global_batch", global_batch, "a positive integer")
        self.model, self.profile, self.cluster, self.cal = model, profile, cluster, cal
        self.global_batch, self.seq_len = global_batch, seq_len
        self.tables = LayerTables.for_search(profile, cluster, cal, opts, global_batch)
        self.heads = profile.tensor_divisor
        self.ev = Evaluator(profile, cluster, cal, opts)  # its cache: every simulation's
        self.timed_out = False

    def late(self, fraction: float) -> bool:
        """Past ``fraction`` of the limit now (recorded: the plan says it was cut)."""
        if time.perf_counter() - self.t0 > self.opts.time_limit_s * fraction:
            self.timed_out = True
            return True
        return False

    def _deadline(self, fraction: float) -> float:
        return self.t0 + self.opts.time_limit_s * fraction

    def seeds(self) -> list[Plan]:
        """Fast heuristic plans (AMP-, then Metis-style) as extra starting points: they
        lie in this search space, and local search starts from the best."""
        seeds = []
        progress.phase("heuristic starting points")
        for heuristic in (amp_like, metis_like):
            if self.late(BUDGET.seeds):
                break
            seed = heuristic(self.model, self.profile, self.cluster, self.global_batch,
                             self.seq_len, self.opts, self.cal,
                             deadline=self._deadline(BUDGET.seeds), cache=self.ev.cache)
            if seed is not None:
                seeds.append(seed)
        return seeds

    def combinations(self) -> list[tuple[Family, ...]]:
        """Phases 1-2: for every assignment of groups to families, each family's best
        configurations, combined."""
        opts = self.opts
        groups = tuple(sorted(self.cluster.groups, key=lambda g: -self.tables.peak_of(g.gpu)))
        fam_cache: dict[tuple, list[Family]] = {}
        combos = []
        progress.phase("stage layouts per GPU group")
        deadline = self._deadline(BUDGET.families)
        for assignment in assignments(groups, self.tables.peak_of, opts.search.stage_orders):
            if opts.max_pipelines is not None and len(assignment) > opts.max_pipelines:
                continue
            per_family = []
            for fam in assignment:
                key = tuple(groups[i].name for i in fam)
                if key not in fam_cache:
                    fam_cache[key] = family_configs(tuple(groups[i] for i in fam),
                                                    self.tables, self.profile, opts,
                                                    self.heads, deadline)
                cands = fam_cache[key]
                if not cands:
                    break
                # Keep each family's most promising configurations (throughput at large m).
                cands = sorted(cands, key=lambda f: f.bottleneck_s / f.samples_per_microbatch)
                per_family.append(cands)
            else:
                if math.prod(len(c) for c in per_family) > opts.search.exhaustive_combos:
                    # Per family the eight best with one remat for all stages, the best
                    # with remat per stage and the best with a partial remat (ranked
                    # apart, see ``candidates``).
                    per_family = [prune(c, 8) for c in per_family]
                combos += [c for c in itertools.product(*per_family)
                           if self.global_batch >= sum(f.samples_per_microbatch for f in c)]
            if self.late(BUDGET.families):
                break
        return combos

    def estimates(self, combos) -> list[tuple]:
        """Phase 3: each combination's step estimate, best first: exact micro-batch counts
        (assign_batch) when there are few, else the continuous relaxation (a lower bound,
        microseconds instead of a CP-SAT solve each) ranks them and the chosen ones get
        exact counts later. Ties keep the enumeration order (deterministic)."""
        exact = len(combos) <= self.opts.search.exact_combos
        found = []
        for k, combo in enumerate(combos):
            res = assign_batch(list(combo), self.global_batch) if exact else \
                (None, relaxed_time(combo, self.global_batch))
            if res is not None:
                found.append((res[1], k, combo, res[0]))
        return [(t, combo, counts) for t, _, combo, counts in sorted(found,
                                                                     key=lambda e: e[:2])]

    def candidates(self, ranked, extra: tuple[Plan, ...]) -> list[Plan]:
        """Phase 4: the plans to simulate. The estimate ignores transfers and gradient
        sync, so besides the global top-N the best candidate of every group assignment
        (which groups, in which families) is simulated: the simulator, not the estimate,
        decides between structures. Plans with remat per stage, and those recomputing
        only some layers of a stage, are ranked apart from the others: their estimates
        favour recomputing stages whose cost the simulation then finds higher, and they
        must not push the others out of the simulated set (and so are plans offloading
        to host memory). Exact counts are computed as
        candidates are chosen; a combination whose units cannot add up to the batch
        exactly (the relaxation cannot tell) is passed over. Then the uniform plans, the
        mixed-type context plans, ``extra`` (the caller's and the heuristic seeds)."""
        opts, cluster = self.opts, self.cluster
        out, seen, ranks = [], set(), collections.Counter()
        for _t, combo, counts in ranked:
            # Plans offloading to host memory are ranked apart too: their estimates
            # spread the per-step host copies over the micro-batches, and the
            # simulation often finds them slower than a layout that needs none.
            mixed = (max(f.kind for f in combo), any(offloads(f) for f in combo))
            key = (tuple(f.groups for f in combo), mixed)
            if ranks[mixed] >= opts.search.simulate_top and key in seen:
                continue
            if counts is None:
                res = assign_batch(list(combo), self.global_batch)
                if res is None:
                    continue
                counts = res[0]
            out.append(build_plan(self.model, self.profile, cluster, list(combo), counts,
                                  self.global_batch, self.seq_len, opts))
            ranks[mixed] += 1
            seen.add(key)
        if opts.search.include_uniform:
            # Uniform plans are part of the space when each stage stays on one GPU type
            # (a mixed stage runs one SPMD program at the slowest GPU's pace).
            out += uniform_candidates(self.model, self.profile, cluster, self.global_batch,
                                      self.seq_len, opts,
                                      deadline=self._deadline(BUDGET.families))
        if opts.mixed_context and not self.late(BUDGET.families):
            out += mixed_context_plans(self.model, self.profile, cluster,
                                       global_batch=self.global_batch, seq_len=self.seq_len,
                                       opts=opts, cal=self.cal)
        out += list(extra)
        out = [p for p in out if self._allowed(p)]
        if not out and opts.search.include_uniform and self.timed_out:
            # The limit cut everything before a candidate the options allow: the uniform
            # plans in full, so that a plan still comes back.
            out = [p for p in uniform_candidates(self.model, self.profile, cluster,
                                                 self.global_batch, self.seq_len, opts)
                   if self._allowed(p)]
            if not out:  # e.g. one single-stage pipeline: on one GPU type's devices
                out = [p for p in group_uniform_candidates(
                    self.model, self.profile, cluster, self.global_batch, self.seq_len,
                    opts) if self._allowed(p)]
        if not out:
            raise self.no_plan()
        return out

    def _allowed(self, p: Plan) -> bool:
        opts = self.opts
        return single_type_stages(p, self.cluster, opts.mixed_context) and \
            self.ev.stage_counts_allowed(p) and self.ev.offloads_allowed(p) and \
            (opts.max_pipelines is None or len(p.pipelines) <= opts.max_pipelines)

    def price(self, candidates: list[Plan]) -> list[Candidate]:
        """Phase 5: every candidate simulated, best first. Past the refine share of the
        limit, no more pricing once one candidate fits (on the largest clusters one
        simulation takes seconds)."""
        scored = []
        progress.phase(f"pricing {len(candidates)} candidate plans")
        for cand in candidates:
            if any(c.fits for c in scored) and self.late(BUDGET.refine):
                break
            scored.append(self.ev.price(cand))
        scored.sort(key=lambda c: c.key)
        return scored

    def relayout(self, scored: list[Candidate]):
        """Phase 6: a layout per GPU type (``layouts``: Metis-style stage degrees) for the
        best few, by coordinate descent over each pipeline's single-type segments; then
        on from there with stages recomputing only their first layers. Returns (re-laid
        out, partial): both ends stay candidates (the first can be the better once under
        ZB-H1); the second gets its variants apart, taking no place among the best few."""
        opts = self.opts
        relaid, partial = [], []
        progress.phase("a layout per GPU type")
        # The plans offloading to host memory and the others each get the best few
        # descents, each descent keeping its start's kind (``_descent``).
        ranks = collections.Counter()
        for start in scored:
            kind = plan_offloads(start.plan)
            if ranks[kind] >= opts.search.layout_top:
                continue
            rank = ranks[kind]
            ranks[kind] += 1
            if not start.fits or self.late(BUDGET.refine) or \
                    not single_type_stages(start.plan, self.cluster):
                continue  # (layouts per GPU type: not for context groups spanning types)
            got = self._descent(start, False)
            if got.plan is not start.plan:
                relaid.append(got)
            if rank >= opts.search.partial_top:
                continue
            more = self._descent(got, True)
            if more.plan is not got.plan:
                partial.append(more)
        return relaid, partial

    def _descent(self, start: Candidate, partial: bool) -> Candidate:
        """A layout descent from ``start`` with the options' remats, and offload to
        host memory only from a plan that offloads already: a plan without keeps to
        layouts without (offload's split estimates would otherwise lead its descent
        away from layouts the simulation prices faster)."""
        opts = self.opts
        bare = tuple(k for k in opts.memory_options if not split_key(k)[1])
        remats = opts.memory_options if plan_offloads(start.plan) or not bare else bare
        return improve_layouts(start, self.ev.evaluate, self.tables, self.cluster, self.heads,
                               tp_options=opts.tp_options, remats=remats,
                               margin=opts.memory_margin, max_stages=opts.max_stages,
                               evals=opts.search.layout_evals, partial=partial,
                               mbs_options=opts.mbs_options,
                               short_of_memory=self.ev.short_of_memory,
                               deadline=self._deadline(BUDGET.refine))

    def variants(self, starts: list[Candidate]) -> list[Candidate]:
        """Phase 7: interleaved variants of the best few (the simulator prices their extra
        transfers and activations), with stages cut by time and by layer count (local
        search starts from the best; either can be better once transfers and memory are
        priced), re-tuned warm-up, without ZeRO-1 and under ZB-H1; best first."""
        opts, ev = self.opts, self.ev
        out = []
        progress.phase("interleaved and zero-bubble variants")
        for start in starts:
            if not start.fits or self.late(BUDGET.refine):
                continue
            cand = start.plan
            tuned = ev.tuned(cand)
            by_time = layer_times(cand, self.profile, self.cluster, self.cal, ev.cache)
            others = [interleave(cand, v, times) for v in opts.virtual_options if v != 1
                      for times in (by_time, None)]
            if opts.distributed_optimizer is None and cand.distributed_optimizer:
                others.append(dataclasses.replace(cand, distributed_optimizer=False))
            others.append(ev.zero_bubble(cand))
            others += ev.sharded(cand)
            for other in [tuned if tuned != cand else None] + others:
                if other is not None:
                    out.append(ev.price(other))
        out.sort(key=lambda c: c.key)
        return out

    def refined(self, scored: list[Candidate]) -> Plan:
        """Phases 6-9: layouts, variants, local search from the best few plans as found,
        as re-laid out (one that simulates faster can still end in a worse local
        optimum) and interleaved, then the last variants (ZB-H1, without ZeRO-1: only
        improving on the best, skipped once the limit is near)."""
        opts = self.opts
        relaid, partial = self.relayout(scored)
        firsts = scored[:opts.search.refine_top]
        scored = sorted(scored + relaid, key=lambda c: c.key)
        variants = self.variants(scored[:opts.search.variant_top] + partial)
        if 1 not in opts.virtual_options:  # with virtual_options lacking 1 only those win
            scored = [c for c in scored if self._as_asked(c.plan)]
            firsts = [c for c in firsts if self._as_asked(c.plan)]
            variants = [c for c in variants if self._as_asked(c.plan)]
            if not scored and not variants:
                vpp = opts.virtual_options
                raise SpecError("--fix vpp", vpp[0] if len(vpp) == 1 else list(vpp),
                                "1, or a value the best pipelined plans can take: at least "
                                "vpp layers on each of a pipeline's submeshes")
        scored = sorted(scored + partial, key=lambda c: c.key)
        starts = list({id(c.plan): c for c in firsts + scored[:opts.search.refine_top] +
                       variants[:opts.search.refine_top]}.values())
        best = min(starts, key=lambda c: c.key)
        # The best without offload to host memory is kept apart: the last variants
        # (ZB-H1 ...) can put it ahead of a best that offloads.
        bare = min((c for c in starts if not plan_offloads(c.plan)), key=lambda c: c.key,
                   default=None)
        progress.phase("local search")
        for start in sorted(starts, key=lambda c: c.key):
            if not start.fits:
                continue
            if self.late(BUDGET.refine):
                break
            better, cut = local_search(start, self.ev,
                                       self._deadline(BUDGET.refine), opts.search.refine_evals)
            self.timed_out = self.timed_out or cut
            if better.key < best.key:
                best = better
            if not plan_offloads(better.plan) and (bare is None or better.key < bare.key):
                bare = better
        if self.late(BUDGET.refine):
            chosen = best
        else:
            chosen = self.ev.last_variants(best)
            if bare is not None and plan_offloads(chosen.plan) and bare.fits:
                bare = self.ev.last_variants(bare)
                if bare.key <= chosen.key:  # (as fast without the host: without)
                    chosen = bare
        if not chosen.result.fits or not self.ev.stage_counts_allowed(chosen.plan) or \
                not self.ev.offloads_allowed(chosen.plan):
            raise self.no_plan()
        # (the best plan without offload, where the chosen one offloads: refined further
        # by the caller too, as it may end ahead: ``plan(..., with_bare=True)``)
        self.bare = None
        if bare is not None and plan_offloads(chosen.plan) and bare.fits and \
                self.ev.stage_counts_allowed(bare.plan):
            self.bare = self.ev.annotated(bare, self.t0, self.timed_out, "",
                                          stacklevel=4)
        return self.ev.annotated(chosen, self.t0, self.timed_out, "", stacklevel=4)

    def _as_asked(self, p: Plan) -> bool:
        """Interleaved as the options ask (``virtual_options`` without 1: only those)."""
        vpp = self.opts.virtual_options
        return 1 in vpp or interleaved_as(p, vpp)

    def orders(self, scored: list[Candidate]) -> list[Plan]:
        """The best fitting priced candidate (phase 5, before any refinement: the
        candidates are plans the options allow) of each of the
        ``SearchEffort.halves_starts`` best :func:`stage_order` s, with its predictions:
        more starts for the refinement in block halves, whose descents from there can
        end ahead of the refined plan's."""
        out, seen = [], set()
        for c in scored:
            if len(out) >= self.opts.search.halves_starts:
                break
            key = stage_order(c.plan)
            if c.fits and key not in seen and self._as_asked(c.plan):
                seen.add(key)
                out.append(annotate(c.plan, c.result))
        return out

    def no_plan(self) -> Exception:
        """An error naming the tightest stage: the largest GPU type, most sharding, full
        remat."""
        return _no_plan(self.profile, self.cluster, self.global_batch, self.tables,
                        self.opts, self.heads)


def stage_order(plan: Plan) -> tuple[tuple[str, ...], ...]:
    """Per pipeline, its GPU types in stage order (each run of stages of one type once)."""
    return tuple(tuple(g for g, _ in itertools.groupby(st.gpu for st in q.stages))
                 for q in plan.pipelines)


def single_type_stages(plan: Plan, cluster: Cluster, context_groups: bool = False) -> bool:
    """Every stage on one GPU type (hetshard's plans; a mixed stage would run one SPMD
    program at its slowest GPU's pace), or with ``context_groups`` spanning types with
    uneven context chunks (``hetshard.solver.context``: each type its own share)."""
    return all(len({cluster.gpu_of(d).name for d in st.devices}) == 1 or
               (context_groups and bool(plan.context_chunks(st)))
               for q in plan.pipelines for st in q.stages)


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
    if need <= cap and opts.min_stages > 1:
        counts = sorted({k for grp in cluster.groups for k in range(1, grp.num_devices + 1)
                         if grp.num_devices % k == 0 and k <= profile.num_layers})
        return NoFeasiblePlanError(
            f"no plan with {opts.min_stages} to {opts.max_stages or 'any'} stages per "
            f"pipeline: a pipeline's stages share a GPU group's devices evenly (data x "
            f"tensor ways alike), and each stage holds at least one of the model's "
            f"{profile.num_layers} layers; stage counts that fit "
            f"{', '.join(f'{grp.num_devices}x {grp.gpu.name}' for grp in cluster.groups)}: "
            f"{counts} per group (a pipeline over several groups adds theirs)")
    if need <= cap:  # memory is not what rules every candidate out: the batch split is
        mbs = sorted(opts.mbs_options)
        dividing = [m for m in mbs if global_batch % m == 0]
        why = (f"global batch {global_batch} is not a multiple of any allowed micro-batch "
               f"size {mbs}" if not dividing else
               f"no split of global batch {global_batch} into pipelines of micro-batches "
               f"of {dividing} samples per data way satisfies the constraints (tensor "
               f"degrees {list(opts.tp_options)}, {opts.min_stages} to "
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
