"""Straggler response: compare each stage's measured step time with the plan's prices and
re-plan with a group's measured speed when it runs slower than priced (Malleus, Li et
al. 2024, re-plans so; here through hetshard's own planner).

Measured and priced times are compared as ratios, each stage's measured time over its
priced busy time (forward and backward of its micro-batches), normalised by the
smallest ratio over the stages (the stage that runs closest to its price): on fake CPU
devices every stage runs far slower than the GPU it stands for, and only a stage slower
*than the others* relative to its price is a straggler. A cluster group whose stages'
normalised ratio exceeds ``threshold`` for ``patience`` consecutive steps is declared
slow by that factor. The monitor then plans for the cluster with that group's GPU type
slowed by the factor (every compute and memory rate divided by it: ``slowed``), prices
the current plan on the same slowed cluster, and returns a :class:`Replan` with both
predicted step times. A warning logs the decision and the predicted gain;
``HetshardJit.adopt(replan)`` runs the new plan.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping

import numpy as np

from hetshard._plan import Plan
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.profile import profile_program
from hetshard.errors import (
    SpecError,
    StragglerWarning,
)
from hetshard.sim import simulate
from hetshard.solver import PlannerOptions, make_plan


@dataclasses.dataclass(frozen=True)
class Replan:
    """A straggler decision: ``group`` ran ``slowdown`` times slower than priced (relative
    to the other stages) for ``steps`` steps; on ``cluster`` (that group slowed) the
    current plan is priced at ``old_step_s`` and ``plan`` at ``new_step_s``."""

    group: str
    slowdown: float
    steps: int
    cluster: Cluster
    plan: Plan
    old_step_s: float
    new_step_s: float

    @property
    def gain(self) -> float:
        return self.old_step_s / self.new_step_s


def slowed(cluster: Cluster, group: str, factor: float) -> Cluster:
    """``cluster`` with ``group``'s GPUs ``factor`` times slower (compute and memory
    rates divided by it; a type of its own, ``<type>-slow<factor>``)."""
    if not factor > 0:
        raise SpecError("factor", factor, "a positive slowdown")
    g = cluster.group(group)
    gpu = g.gpu
    slow = dataclasses.replace(
        gpu, name=f"{gpu.name}-slow{factor:.2f}",
        bf16_tflops=None if gpu.bf16_tflops is None else gpu.bf16_tflops / factor,
        fp16_tflops=gpu.fp16_tflops / factor, fp32_tflops=gpu.fp32_tflops / factor,
        tf32_tflops=None if gpu.tf32_tflops is None else gpu.tf32_tflops / factor,
        attention_tflops=None if gpu.attention_tflops is None else
        gpu.attention_tflops / factor, memory_gbs=gpu.memory_gbs / factor, device_kinds=(),
        source=f"{gpu.name} measured {factor:.2f}x slower than priced (straggler)")
    groups = tuple(dataclasses.replace(x, gpu=slow) if x.name == group else x
                   for x in cluster.groups)
    return dataclasses.replace(cluster, groups=groups)


def _on(plan: Plan, cluster: Cluster) -> Plan:
    """``plan`` with its stages' GPU names and its cluster from ``cluster``."""
    pipes = tuple(dataclasses.replace(p, stages=tuple(
        dataclasses.replace(st, gpu=cluster.gpu_of(st.devices[0]).name) for st in p.stages))
        for p in plan.pipelines)
    return dataclasses.replace(plan, pipelines=pipes, cluster=cluster)


class StragglerMonitor:
    """Watches per-stage step times of ``plan`` (for ``program`` on ``cluster``); see the
    module docstring. ``observe`` once per step; it returns a :class:`Replan` when a
    group has been slow for ``patience`` steps (then the count starts again)."""

    def __init__(self, plan: Plan, program, cluster, *, threshold: float = 1.3,
                 patience: int = 3, options=None, calibration=None):
        if not threshold > 1:
            raise SpecError("threshold", threshold, "a ratio above 1")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise SpecError("patience", patience, "a positive number of steps")
        self.plan, self.program = plan, program
        self.cluster = Cluster.load(cluster)
        self.threshold, self.patience = threshold, patience
        if isinstance(options, Mapping):  # PlannerOptions fields, as hetshard.jit takes them
            options = PlannerOptions.from_fields(dict(options), "StragglerMonitor")
        self.options, self.cal = options, calibration or DEFAULT
        self.profile = profile_program(program, plan.split_blocks)
        r = simulate(plan, self.profile, self.cluster, self.cal, trace=False)
        self.priced = {}
        for pi, (p, costs) in enumerate(zip(plan.pipelines, r.stage_costs, strict=True)):
            for si, c in enumerate(costs):
                self.priced[pi, si] = (c.fwd_s + c.bwd_s) * p.num_micro_batches
        self._streak: dict[str, int] = {}
        self._ratios: dict[str, list[float]] = {}

    def group_of(self, pi: int, si: int) -> str:
        st = self.plan.pipelines[pi].stages[si]
        return self.cluster.slot(st.devices[0]).group

    def observe(self, measured: Mapping[tuple[int, int], float]) -> Replan | None:
        """``measured``: seconds each (pipeline, stage) was busy this step."""
        missing = set(self.priced) - set(measured)
        if missing:
            raise SpecError("measured", sorted(measured),
                            f"a time for every (pipeline, stage) of the plan: "
                            f"{sorted(self.priced)}")
        ratio = {k: measured[k] / self.priced[k] for k in self.priced if self.priced[k] > 0}
        typical = min(ratio.values())
        by_group: dict[str, float] = {}
        for k, r in ratio.items():
            g = self.group_of(*k)
            by_group[g] = max(by_group.get(g, 0.0), r / typical)
        for g, r in by_group.items():
            if r > self.threshold:
                self._streak[g] = self._streak.get(g, 0) + 1
                self._ratios.setdefault(g, []).append(r)
            else:
                self._streak[g] = 0
                self._ratios[g] = []
        slow = [g for g, n in self._streak.items() if n >= self.patience]
        if not slow:
            return None
        g = max(slow, key=lambda x: np.median(self._ratios[x]))
        factor = float(np.median(self._ratios[g]))
        self._streak[g], self._ratios[g] = 0, []
        return self._replan(g, factor)

    def _replan(self, group: str, factor: float) -> Replan:
        cluster = slowed(self.cluster, group, factor)
        old = simulate(_on(self.plan, cluster), self.profile, cluster, self.cal,
                       trace=False).step_time_s
        new_plan = make_plan(self.program, cluster, global_batch=self.plan.global_batch,
                             options=self.options, calibration=self.cal)
        new = simulate(new_plan, self.profile, cluster, self.cal, trace=False).step_time_s
        out = Replan(group, factor, self.patience, cluster, new_plan, old, new)
        warnings.warn(f"straggler: group {group!r} ran {factor:.2f}x slower than priced for "
                      f"{self.patience} steps; re-planned with its measured speed: predicted "
                      f"step {old:.3g} s -> {new:.3g} s ({out.gain:.2f}x): "
                      f"{new_plan.summary()}", StragglerWarning, stacklevel=2)
        return out
