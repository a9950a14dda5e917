"""A layout per GPU type inside a pipeline (Metis-style heterogeneous stage degrees).

The family search (``inter_op``) gives every stage of a pipeline the same data ways
``r`` and tensor degree ``tp``. That is rarely right for every GPU type at once: a
slow PCIe-only group pays dearly for tensor-parallel all-reduces that a fast NVLink
group hides, and a group with memory to spare needs no tensor split at all. Here a
*segment* (the consecutive stages of one pipeline on one GPU group) is re-laid out on
the same devices as ``k'`` stages of ``r' x tp'`` (``r'`` dividing the pipeline's
samples per micro-batch, so each of its devices runs ``samples / r'`` of them), and
the pipeline's layers are re-split over all its stages by the minimum-bottleneck
split with a remat per stage (``splits.split_layers_mixed``, memory checked under
1F1B's in-flight counts). ``improve_layouts`` does coordinate descent over the
segments, each move priced by the simulator; where the plan it ends at wants more
extra warm-up than memory allows (a slow link to hide), it descends again with splits
that keep room for ``AHEADS`` extra micro-batches in flight.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

from hetshard._plan import Pipeline, Plan, Stage, data_ways
from hetshard.cluster.spec import Cluster, Group
from hetshard.errors import HetshardError
from hetshard.solver.splits import (
    LayerTables,
    choice_parts,
    split_layers_mixed,
    stage_memory,
    with_partial,
)
from hetshard.solver.variants import with_experts

# Extra warm-up forwards the layout moves keep memory for (each a split of its own).
AHEADS = (0, 1, 2)


def segments(pipe: Pipeline, cluster: Cluster) -> list[tuple[int, int]]:
    """Stage ranges ``[i, j)`` of ``pipe`` that run on one GPU group, in order. A stage
    whose devices span groups (a context group across GPU types: ``solver.context``) is
    in none."""
    out: list[tuple[int, int]] = []
    last = None  # the group of the stage before, None where it spans groups
    for j, st in enumerate(pipe.stages):
        groups = {cluster.slot(d).group for d in st.devices}
        g = groups.pop() if len(groups) == 1 else None
        if g is not None and g == last and out and out[-1][1] == j:
            out[-1] = (out[-1][0], j + 1)
        elif g is not None:
            out.append((j, j + 1))
        last = g
    return out


def layouts(n: int, samples: int, group: Group, heads: int, tp_options, cp: int = 1,
            mbs_options=None) -> list[tuple[int, int]]:
    """(data ways, tensor degree) choices for ``n`` devices of ``group`` running
    micro-batches of ``samples``: data ways dividing the samples (each device's share
    among ``mbs_options`` when given), the tensor degree within a node and dividing the
    heads, stages of whole ``r * cp * tp`` blocks."""
    out = []
    for tp in tp_options:
        if tp > group.gpus_per_node or group.gpus_per_node % tp or heads % tp:
            continue
        for r in range(1, samples + 1):
            if samples % r == 0 and n % (r * cp * tp) == 0 and (
                    mbs_options is None or samples // r in mbs_options):
                out.append((r, tp))
    return out


def relayout(plan: Plan, pi: int, seg: tuple[int, int], layout: tuple[int, int],
             tables: LayerTables, cluster: Cluster, *, remats, margin: float,
             max_stages: int | None = None, partial: bool = False,
             aheads: tuple[int, ...] = (0,)) -> list[Plan]:
    """``plan`` with segment ``seg`` of pipeline ``pi`` laid out as ``layout`` = (data
    ways, tensor degree) on the same devices, and that pipeline's layers re-split over
    all its stages (each with the remat, among ``remats``, that lets it reach furthest;
    with ``partial``, also the full remat of a stage's first layers only): one split per
    entry of ``aheads`` (memory kept on every stage but the last for that many extra
    warm-up forwards, the warm-up that hides a slow link), skipping those the previous
    split already has room for. Empty when the layout cannot be built or nothing fits."""
    pipe = plan.pipelines[pi]
    if pipe.virtual_stages != 1 or any(st.axis("fsdp") > 1 for st in pipe.stages):
        return []
    samples = pipe.samples_per_micro_batch
    r, tp = layout
    a, b = seg
    first = pipe.stages[a]
    cp = first.axis("context")
    devices = sorted(d for st in pipe.stages[a:b] for d in st.devices)
    size = r * cp * tp
    if samples % r or len(devices) % size:
        return []
    chunks = [tuple(devices[i:i + size]) for i in range(0, len(devices), size)]
    # Tensor groups (innermost, consecutive ids) must sit inside one node.
    if any(len({cluster.slot(d).node for d in c[i:i + tp]}) > 1
           for c in chunks for i in range(0, size, tp)):
        return []
    mesh = (("data", r),) + ((("context", cp),) if cp > 1 else ()) + (("tensor", tp),)
    shells = list(pipe.stages[:a]) + [
        Stage(0, 1, c, first.gpu, mesh) for c in chunks] + list(pipe.stages[b:])
    n_layers = pipe.stages[-1].end
    if len(shells) > n_layers or (max_stages is not None and len(shells) > max_stages):
        return []
    rows, caps = [], []
    for st in shells:
        group = cluster.group(cluster.slot(st.devices[0]).group)
        ways = data_ways(st)
        row = [(remat, tables.get(group, st.axis("tensor"), samples // ways, remat, ways,
                                  st.axis("context"))) for remat in remats]
        rows.append(with_partial(row) if partial else row)
        caps.append(group.gpu.memory_bytes * (1 - margin))
    out, res = [], None
    for ahead in aheads:
        if res is not None and _has_room(rows, caps, res, ahead):
            continue
        res = split_layers_mixed(rows, n_layers, caps, ahead=ahead)
        if res is None:
            break
        bounds, _, chosen = res
        stages = tuple(_experts(tables, cluster, dataclasses.replace(
            st, start=lo, end=hi, shardings=(), **stage_memory(c)))
                       for st, (lo, hi), c in zip(shells, bounds, chosen, strict=True))
        try:
            new = dataclasses.replace(pipe, stages=stages, extra_warmup=(),
                                      micro_batch_size=samples // data_ways(stages[0]))
        except HetshardError:
            continue
        if any(q.pipelines[pi].stages == stages for q in out):
            continue
        pipes = plan.pipelines[:pi] + (new,) + plan.pipelines[pi + 1:]
        out.append(dataclasses.replace(plan, pipelines=pipes))
    return out


def _experts(tables: LayerTables, cluster: Cluster, st: Stage) -> Stage:
    """A new stage with the expert axis the tables priced it with (``ep_of``)."""
    if st.axis("fsdp") > 1:
        return st
    group = cluster.group(cluster.slot(st.devices[0]).group)
    r = st.axis("data") * st.axis("expert")
    return with_experts(st, tables.profile,
                        tables.ep_of(group, r, st.axis("tensor"), st.axis("context")))


def _has_room(rows, caps, split, ahead: int) -> bool:
    """Whether ``split`` (a ``split_layers_mixed`` answer) keeps, on every stage but the
    last, the memory of ``ahead`` extra micro-batches in flight beyond 1F1B's."""
    p = len(rows)
    for s, (row, cap, (lo, hi), c) in enumerate(zip(rows, caps, split[0], split[2],
                                                    strict=True)):
        _, static, per_mb, working = choice_parts(row, c, lo, hi)
        if s < p - 1 and static + (p - s + ahead) * per_mb + working > cap:
            return False
    return True


def moves(plan: Plan, tables: LayerTables, cluster: Cluster, heads: int, *, tp_options,
          remats, margin: float, max_stages: int | None = None,
          partial: bool = False, mbs_options=None,
          aheads: tuple[int, ...] = (0,)) -> Iterator[Plan]:
    """Every plan one segment's layout away from ``plan`` (each device's micro-batch
    among ``mbs_options`` when given; layers split once per entry of ``aheads``, see
    ``relayout``)."""
    for pi, pipe in enumerate(plan.pipelines):
        for seg in segments(pipe, cluster):
            a, b = seg
            st = pipe.stages[a]
            group = cluster.group(cluster.slot(st.devices[0]).group)
            n = sum(len(s.devices) for s in pipe.stages[a:b])
            current = (data_ways(st), st.axis("tensor"))
            for layout in layouts(n, pipe.samples_per_micro_batch, group, heads, tp_options,
                                  st.axis("context"), mbs_options):
                if layout == current and b - a == n // (layout[0] * layout[1] *
                                                         st.axis("context")):
                    continue
                yield from relayout(plan, pi, seg, layout, tables, cluster, remats=remats,
                                    margin=margin, max_stages=max_stages, partial=partial,
                                    aheads=aheads)


def improve_layouts(start, evaluate: Callable[[Plan], Any], tables: LayerTables,
                    cluster: Cluster, heads: int, *, tp_options, remats, margin: float,
                    max_stages: int | None = None, evals: int = 200, partial: bool = False,
                    mbs_options=None, short_of_memory: Callable[[Plan], bool] | None = None,
                    deadline: float | None = None):
    """Coordinate descent over segment layouts from ``start`` (an
    ``evaluator.Candidate``: key, plan, result): each round takes the best move by
    ``evaluate(plan) -> Candidate`` (lower keys are better; ``evaluate`` may return a
    tuned plan, e.g. with its warm-up)
    until none improves or ``evals`` plans were evaluated. Where the descent's plan
    wants more warm-up than its memory allows (``short_of_memory(plan)``), a second
    descent (``evals`` more) also splits the layers with memory kept for ``AHEADS``
    extra warm-up forwards. Past ``deadline`` (``time.perf_counter()``) the descent
    stops where it is (the caller's time limit). Returns the best Candidate."""
    def descend(best, aheads):
        left = evals
        while left > 0:
            round_best = None
            for cand in moves(best.plan, tables, cluster, heads, tp_options=tp_options,
                              remats=remats, margin=margin, max_stages=max_stages,
                              partial=partial, mbs_options=mbs_options, aheads=aheads):
                if left <= 0 or (deadline is not None and time.perf_counter() > deadline):
                    left = 0
                    break
                left -= 1
                got = evaluate(cand)
                if got.key < best.key and (round_best is None or got.key < round_best.key):
                    round_best = got
            if round_best is None:
                break
            best = round_best
        return best
    best = descend(start, (0,))
    if short_of_memory is not None and (deadline is None or time.perf_counter() <= deadline) \
            and short_of_memory(best.plan):
        best = descend(best, AHEADS)
    return best
