"""How the solver prices a plan: one :class:`Evaluator` per search holds the program's
profile, the cluster, the calibration, the options (memory margin included) and the
stage-cost cache every simulation of that search shares; each priced plan is a
:class:`Candidate` (its ranking key, the plan, the simulator's result)."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import NamedTuple

from hetshard._plan import Plan, SolverStats
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import Calibration
from hetshard.cost.profile import ModelProfile
from hetshard.offload import parse_option
from hetshard.sim.simulator import (
    SimResult,
    annotate,
    simulate,
    tune_warmup,
    upper_bound_tokens_per_s,
    warmup_short_of_memory,
)
from hetshard.solver.options import PlannerOptions, PlannerTimeLimitWarning
from hetshard.solver.variants import (
    SHARDINGS,
    balanced_experts,
    even_experts,
    expert_parallel,
    sharded_state,
    zero_bubble,
)


class Candidate(NamedTuple):
    """A priced plan. ``key`` (``SimResult.rank``) orders plans that fit first, then by
    step time."""

    key: tuple
    plan: Plan
    result: SimResult

    @property
    def fits(self) -> bool:
        """Within memory, and within the options' stage counts (``Evaluator.price``)."""
        return not self.key[0]


@dataclasses.dataclass
class Evaluator:
    """Prices plans for one search (see the module docstring)."""

    profile: ModelProfile
    cluster: Cluster
    cal: Calibration
    opts: PlannerOptions
    cache: dict = dataclasses.field(default_factory=dict)

    @property
    def margin(self) -> float:
        return self.opts.memory_margin

    def price(self, plan: Plan) -> Candidate:
        """The plan as it is, simulated; ranked after every plan that fits when its stage
        counts are outside the options' ``min_stages``..``max_stages`` (a layout move or
        variant that merged or split stages)."""
        r = simulate(plan, self.profile, self.cluster, self.cal, trace=False,
                     cache=self.cache, margin=self.margin)
        key = r.rank if self.stage_counts_allowed(plan) else (True, math.inf, *r.rank[2:])
        return Candidate(key, plan, r)

    def stage_counts_allowed(self, plan: Plan) -> bool:
        opts = self.opts
        return all(opts.min_stages <= len(p.stages) and
                   (opts.max_stages is None or len(p.stages) <= opts.max_stages)
                   for p in plan.pipelines)

    def offloads_allowed(self, plan: Plan) -> bool:
        """Whether every stage's offload is among the options' (``offload_options``)."""
        offered = {parse_option(o) for o in self.opts.offload_options}
        return all(st.offload in offered for p in plan.pipelines for st in p.stages)

    def tuned(self, plan: Plan) -> Plan:
        """The plan with its 1F1B extra warm-up tuned within memory."""
        return tune_warmup(plan, self.profile, self.cluster, self.cal, margin=self.margin,
                           cache=self.cache)

    def evaluate(self, plan: Plan) -> Candidate:
        """The plan with its warm-up tuned, simulated."""
        return self.price(self.tuned(plan))

    def short_of_memory(self, plan: Plan) -> bool:
        """Whether the plan's extra warm-up is held back by memory (the layout descent
        then also splits layers keeping room for it)."""
        return warmup_short_of_memory(plan, self.profile, self.cluster, self.cal,
                                      margin=self.margin, cache=self.cache)

    def zero_bubble(self, plan: Plan) -> Plan | None:
        """``plan`` under ZB-H1 with its best warm-up option, when the options allow it."""
        opts = self.opts
        zb = zero_bubble(plan) if opts.zero_bubble and opts.schedule == "1f1b" else None
        return zb and tune_warmup(zb, self.profile, self.cluster, self.cal,
                                  margin=self.margin, cache=self.cache,
                                  zero_bubble_options=True)

    def last_variants(self, best: Candidate) -> Candidate:
        """The local optimum ``best`` also tried under ZB-H1 (the searches start from
        1F1B) and without ZeRO-1, the fastest kept."""
        zb = self.zero_bubble(best.plan) if best.fits else None
        if zb is not None:
            other = self.price(zb)
            if other.key < best.key:
                best = other
        if self.opts.distributed_optimizer is None:
            best = zero1_choice(best, self.profile, self.cluster, self.cal, self.cache,
                                self.margin)
        for other in self.sharded(best.plan):
            other = self.price(other)
            if other.key < best.key:
                best = other
        best = self.experts(best)
        return self.without_needless_offload(best)

    def experts(self, best: Candidate) -> Candidate:
        """``best`` also priced under expert parallelism (each of the options' degrees and
        capacity factors, ``hetshard.solver.variants.expert_parallel``), alone and with
        the state sharded; the fastest kept (one that fits ahead of one that does not)."""
        if not any(layer.experts for layer in self.profile.layers):
            return best
        start = best.plan
        loads = self.profile.expert_loads
        for ep in self.opts.ep_options:
            for factor in self.opts.capacity_factors:
                plan = expert_parallel(start, self.profile, ep, factor)
                plans = [] if plan is None else [self.tuned(plan), *self.sharded(plan)]
                if plan is None and factor == start.capacity_factor:
                    plan = start  # (already at this degree: its placement still open)
                if plan is None:
                    continue
                if ep > 1 and len(loads) > ep:
                    # a measured routing histogram: experts placed to even out the ranks,
                    # and evenly (bringing a rank the experts it lacks may cost more
                    # than the balance buys)
                    placed = balanced_experts(plan, loads, ep)
                    plans += [self.tuned(placed)] if placed is not None else []
                    plans += [self.tuned(even_experts(plan))] if any(
                        st.experts for p in plan.pipelines for st in p.stages) else []
                for other in plans:
                    other = self.price(other)
                    if other.key < best.key:
                        best = other
        return best

    def without_needless_offload(self, best: Candidate) -> Candidate:
        """``best`` with each stage's offload to host memory dropped where the plan is
        as fast without it (a stage off the critical path keeps its state on its GPU:
        no host memory or link taken for nothing)."""
        if not best.fits:
            return best
        for pi, pipe in enumerate(best.plan.pipelines):
            for j in range(len(pipe.stages)):
                st = best.plan.pipelines[pi].stages[j]
                if not st.offload:
                    continue
                pipes = list(best.plan.pipelines)
                stages = list(pipes[pi].stages)
                stages[j] = dataclasses.replace(st, offload=())
                pipes[pi] = dataclasses.replace(pipes[pi], stages=tuple(stages))
                plan = dataclasses.replace(best.plan, pipelines=tuple(pipes))
                if not self.offloads_allowed(plan):
                    continue
                other = self.price(plan)
                if other.key <= best.key:
                    best = other
        return best

    def sharded(self, plan: Plan) -> list[Plan]:
        """``plan``'s state-sharded variants (hybrid, then full FSDP), where the options
        allow them, their warm-up tuned."""
        if self.opts.state_sharding != "auto":
            return []
        return [self.tuned(p) for p in (sharded_state(plan, self.cluster, w)
                                        for w in SHARDINGS) if p is not None]

    def annotated(self, chosen: Candidate, t0: float, timed_out: bool, doing: str,
                  stacklevel: int = 3) -> Plan:
        """The chosen plan with the simulator's prediction and the solver's statistics
        (wall time since ``t0``, status, gap to the compute bound); a warning when the
        clock cut the search (``doing`` says which; ``stacklevel`` for ``warnings.warn``,
        the frame of the planner's caller)."""
        plan, result, opts = chosen.plan, chosen.result, self.opts
        upper = upper_bound_tokens_per_s(self.profile, self.cluster, self.cal,
                                         attention=opts.attention,
                                         gpu_dtypes=plan.gpu_dtypes)
        gap = max(0.0, 1 - plan.global_batch * plan.seq_len / upper / result.step_time_s)
        status = "time_limit" if timed_out else "searched"
        if timed_out:
            warnings.warn(PlannerTimeLimitWarning(
                f"planner hit its {opts.time_limit_s:g} s limit{doing}: best plan found, gap "
                f"to the compute bound {gap:.1%}"), stacklevel=stacklevel)
        plan = dataclasses.replace(plan, solver=SolverStats(time.perf_counter() - t0,
                                                            status, gap))
        return annotate(plan, result, upper)


def zero1_choice(scored, profile, cluster, cal, cache: dict | None = None,
                 margin: float = 0.0) -> Candidate:
    """``scored`` = (key, plan, result) or, when the plan uses the distributed optimizer
    and simulates faster without it (and fits, less ``margin``), the plan without it: the
    optimizer state is then whole on every data way, but the parameter all-gather no
    longer waits for the update."""
    key, p, r0 = scored
    if not p.distributed_optimizer:
        return Candidate(key, p, r0)
    plain = dataclasses.replace(p, distributed_optimizer=False)
    r = simulate(plain, profile, cluster, cal, trace=False, cache=cache, margin=margin)
    return Candidate(r.rank, plain, r) if r.rank < key else Candidate(key, p, r0)
