"""Stage boundaries inside blocks: a whole-block plan re-expressed in block halves
(attention | MLP as layers) and refined there (layouts, local search, ZB-H1)."""

from __future__ import annotations

import dataclasses
import time

from hetshard._plan import Plan
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.profile import ModelProfile
from hetshard.solver.evaluator import Evaluator
from hetshard.solver.layouts import improve_layouts
from hetshard.solver.options import BUDGET, PlannerOptions
from hetshard.solver.search import local_search
from hetshard.solver.splits import LayerTables


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
    return dataclasses.replace(plan, pipelines=tuple(pipes), split_blocks=True)


def refine_halves(plan: Plan, blocks: ModelProfile, halves: ModelProfile,
                  cluster: Cluster, *, cal: Calibration = DEFAULT,
                  options: PlannerOptions | None = None) -> Plan:
    """The best plan found from ``plan`` (a whole-block plan) with stage boundaries
    allowed inside blocks: the plan in halves (``as_halves``, the same program), then the
    layout descent (with and without partial remat), local search and ZB-H1 as in
    ``inter_op.plan``, on the ``halves`` profile. The search's effort is fixed by the
    options; ``time_limit_s`` cuts it (status ``time_limit``)."""
    opts = options or PlannerOptions()
    t0 = time.perf_counter()
    ev = Evaluator(halves, cluster, cal, opts)
    tables = LayerTables.for_search(halves, cluster, cal, opts, plan.global_batch)
    found = [ev.evaluate(as_halves(plan, blocks, halves))]
    layout_deadline = t0 + opts.time_limit_s * BUDGET.halves_layouts
    for partial in (False, True):
        if time.perf_counter() > layout_deadline:
            break
        found.append(improve_layouts(found[-1], ev.evaluate, tables, cluster,
                                     halves.tensor_divisor, tp_options=opts.tp_options,
                                     remats=opts.memory_options, margin=opts.memory_margin,
                                     max_stages=opts.max_stages, evals=opts.search.layout_evals,
                                     partial=partial, mbs_options=opts.mbs_options,
                                     short_of_memory=ev.short_of_memory,
                                     deadline=layout_deadline))
    layouts_cut = time.perf_counter() > layout_deadline
    best = min(found, key=lambda c: c.key)
    better, cut = local_search(best, ev, t0 + opts.time_limit_s * BUDGET.refine,
                               opts.search.refine_evals)
    cut = cut or len(found) < 3 or layouts_cut
    if better.key < best.key:
        best = better
    return ev.annotated(ev.last_variants(best), t0, cut, " refining with blocks split")
