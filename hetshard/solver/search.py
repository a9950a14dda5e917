"""Local search: first-improvement hill climbing over plans one move away (a stage
boundary shifted, a stage recomputing one layer more or fewer, a micro-batch moved
between pipelines), each priced by the simulator."""

from __future__ import annotations

import dataclasses
import itertools
import time

from hetshard._plan import Plan, Stage
from hetshard.errors import HetshardError
from hetshard.offload import OFFLOADS, parse_option
from hetshard.remat import REMATS
from hetshard.solver.evaluator import Candidate, Evaluator


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


def _neighbours(plan: Plan, remats: tuple[str, ...] = REMATS, offloads: tuple[str, ...] = ()):
    """Plans one move away: a stage boundary shifted by one layer (the stage that grows
    recomputing as many layers as before or, under a partial remat, one more), a full
    remat's stage recomputing one layer fewer or more (where ``remats`` allow a stage
    recomputing some of its layers: "none" and "full"), a stage's optimizer state moved
    to or from host memory (where ``offloads``, ``PlannerOptions.offload_options``,
    offer both), or one micro-batch moved from a pipeline to another (when their
    micro-batch sizes allow)."""
    pipes = plan.pipelines
    partial = {"none", "full"} <= set(remats)
    offered = {parse_option(o) for o in offloads}

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
        for j, a in enumerate(p.stages):
            other = tuple(o for o in OFFLOADS if (o in a.offload) != (o == "optimizer"))
            if a.offload in offered and other in offered:
                st = list(p.stages)
                st[j] = dataclasses.replace(a, offload=other)
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
        yield dataclasses.replace(plan, pipelines=tuple(new))


def local_search(start: Candidate, ev: Evaluator, deadline: float,
                 evals: int = 1 << 30) -> tuple[Candidate, bool]:
    """First-improvement hill climbing on the simulated step time from ``start``: each
    neighbour (``_neighbours``, moves within the options' remats) with its 1F1B warm-up
    re-tuned to its layer split, priced by ``ev`` (memory must fit, less the options'
    margin), for at most ``evals`` simulations. Returns (the local optimum, whether the
    clock cut the search)."""
    best = start
    improved, cut = True, False
    while improved and evals > 0 and not cut:
        improved = False
        for cand in _neighbours(best.plan, ev.opts.remat_options,
                                    ev.opts.offload_options):
            if evals <= 0:
                break
            if time.perf_counter() > deadline:
                cut = True
                break
            evals -= 1
            try:
                got = ev.evaluate(cand)
            except HetshardError:
                continue
            if got.result.fits and \
                    got.result.step_time_s < best.result.step_time_s * (1 - 1e-9):
                best, improved = got, True
                break
    return best, cut
