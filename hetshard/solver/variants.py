"""Variants of a plan the planner also prices: interleaved pipelines (Megatron-LM's
virtual stages, Narayanan et al., SC'21, sec. 2.2), with stages cut by layer count or
by time and micro-batch counts rounded to multiples of the submeshes, zero-bubble
pipelines (ZB-H1, Qi et al., ICLR'24), and stages whose data ways shard the state:
FSDP over all of them, or inside each node with data parallelism across the nodes
(hybrid sharding, PyTorch's HSDP, MaxText's ICI-FSDP x DCN-data), and expert
parallelism for mixture-of-experts models (MaxText's and Megatron-Core's: expert ranks
carved out of the data ways)."""

from __future__ import annotations

import dataclasses
import itertools

from hetshard._plan import Plan, Stage
from hetshard.sim.simulator import layers_cost, priced_dtype, recomputed_among
from hetshard.solver.options import data_axes, fsdp_ways


def interleave(plan: Plan, v: int, layer_times=None) -> Plan | None:
    """``plan`` with each pipeline's submeshes holding ``v`` stages instead of one, laid
    out in model order as stage ``c * p + w`` (submesh w's c-th). Without
    ``layer_times`` each submesh's layer count is split into ``v`` near-equal parts; with
    ``layer_times(pipeline, w)`` (per-layer forward + backward seconds on submesh w)
    the stages are cut walking the model so that each takes about a ``v``-th of its
    submesh's former time (layers differ: embeddings, heads, vision blocks). A pipeline
    can when it has 2+ submeshes and ``v`` layers on each. Micro-batch counts are rounded
    to multiples of the submeshes where the difference can be taken from or given to
    pipelines of the same micro-batch samples (the smallest change; full groups of
    micro-batches need no extra warm-up), else kept. None when no pipeline can."""
    pipes = list(plan.pipelines)
    able = [i for i, q in enumerate(pipes) if q.virtual_stages == 1 and len(q.stages) >= 2
            and q.schedule != "zbh1" and all(st.num_layers >= v and st.remat_layers is None
                                             for st in q.stages)]
    if not able:
        return None
    counts = _rounded_counts(pipes, able) or {}
    for i in sorted(set(counts) | set(able)):
        pipe = pipes[i]
        m = counts.get(i, pipe.num_micro_batches)
        unit = pipe.batch_share // pipe.num_micro_batches
        pipe = dataclasses.replace(pipe, num_micro_batches=m, batch_share=m * unit)
        if i in able:
            cuts = (_time_cuts(pipe, v, [layer_times(i, w) for w in range(len(pipe.stages))])
                    if layer_times is not None else _count_cuts(pipe, v))
            stages = [dataclasses.replace(pipe.stages[j % len(pipe.stages)], start=a, end=b)
                      for j, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]
            pipe = dataclasses.replace(pipe, stages=tuple(stages), virtual_stages=v,
                                       extra_warmup=())
        pipes[i] = pipe
    return dataclasses.replace(plan, pipelines=tuple(pipes))


def zero_bubble(plan: Plan) -> Plan | None:
    """``plan`` with its 1F1B pipelines of one stage per submesh (2 or more) under ZB-H1,
    their extra warm-up kept (it bounds the micro-batches a stage holds before their W);
    None when there is none."""
    pipes = [dataclasses.replace(q, schedule="zbh1")
             if q.schedule == "1f1b" and q.virtual_stages == 1 and len(q.stages) >= 2 else q
             for q in plan.pipelines]
    if pipes == list(plan.pipelines):
        return None
    return dataclasses.replace(plan, pipelines=tuple(pipes))


SHARDINGS = ("node", "all")


def sharded_state(plan: Plan, cluster, within: str) -> Plan | None:
    """``plan`` with the state of its stages of 2+ data ways and no tensor or state
    layout of their own (their tensor splits keep the plan's per-parameter specs)
    sharded over those ways: ``within="node"`` FSDP inside each node's share of them,
    data parallelism across the nodes (hybrid: the stage's ``data`` axis becomes
    ``data x fsdp``, devices data-major); ``"all"`` FSDP over all of them. None when no
    stage changes."""
    if within not in SHARDINGS:
        raise ValueError(within)
    pipes, changed = [], False
    for pipe in plan.pipelines:
        stages = []
        for st in pipe.stages:
            d = st.axis("data")
            if d < 2 or st.axis("fsdp") > 1 or st.axis("tensor") > 1 or st.shardings:
                stages.append(st)
                continue
            nodes = {}
            for dev in st.devices:
                slot = cluster.slot(dev)
                nodes[slot.group, slot.node] = nodes.get((slot.group, slot.node), 0) + 1
            f = fsdp_ways(within, d, st.axis("tensor"), st.axis("context"),
                          min(nodes.values()))
            if f < 2 or (within == "node" and f == d):
                stages.append(st)
                continue
            mesh = []
            for name, n in st.mesh_shape:
                if name == "data":
                    mesh += ([("data", d // f)] if d > f else []) + [("fsdp", f)]
                else:
                    mesh.append((name, n))
            stages.append(dataclasses.replace(st, mesh_shape=tuple(mesh)))
            changed = True
        pipes.append(dataclasses.replace(pipe, stages=tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(pipes)) if changed else None


def layer_times(plan: Plan, profile, cluster, cal, cache: dict):
    """``f(pipeline, w)``: per-layer forward + backward seconds on submesh w of that
    pipeline (its devices, mesh, remat and micro-batch size), priced once per layer kind."""
    def times(i: int, w: int):
        pipe = plan.pipelines[i]
        st = pipe.stages[w]
        out = []
        for layer in range(profile.num_layers):
            mbs = pipe.stage_micro_batch(w)
            key = ("layer", profile.layers[layer].kind, st.devices, st.mesh_shape, st.remat,
                   recomputed_among(st, layer, layer + 1), mbs, plan.fsdp, plan.attention,
                   plan.tp_overlap, priced_dtype(plan, profile, st), plan.context_chunks(st),
                   st.experts, plan.capacity_factor)
            if key not in cache:
                c = layers_cost(st, layer, layer + 1, mbs,
                                plan.fsdp or st.axis("fsdp") > 1, plan.attention, profile,
                                cluster, cal, tp_overlap=plan.tp_overlap,
                                dtype=priced_dtype(plan, profile, st),
                                chunks=plan.context_chunks(st),
                                capacity_factor=plan.capacity_factor)
                cache[key] = c.fwd_s + c.bwd_s
            out.append(cache[key])
        return out
    return times


def _count_cuts(pipe, v: int) -> list[int]:
    """Stage boundaries: submesh w's layer count split into v near-equal parts."""
    sizes = [[st.num_layers // v + (c < st.num_layers % v) for c in range(v)]
             for st in pipe.stages]
    cuts = [0]
    for c in range(v):
        for w in range(len(pipe.stages)):
            cuts.append(cuts[-1] + sizes[w][c])
    return cuts


def _time_cuts(pipe, v: int, times) -> list[int]:
    """Stage boundaries walking the model: stage j (submesh w = j mod p) ends at the layer
    nearest a v-th of w's former time, leaving a layer for every later stage."""
    p, n = len(pipe.stages), pipe.stages[-1].end
    target = [sum(times[w][st.start:st.end]) / v for w, st in enumerate(pipe.stages)]
    cuts = [0]
    for j in range(p * v - 1):
        w, start = j % p, cuts[-1]
        end, acc = start + 1, times[w][start]
        while end < n - (p * v - j - 1) and acc + times[w][end] / 2 <= target[w]:
            acc += times[w][end]
            end += 1
        cuts.append(end)
    return cuts + [n]


def _rounded_counts(pipes, able) -> dict[int, int] | None:
    """Micro-batch counts with every pipeline in ``able`` at a multiple of its stages and
    each group of equal micro-batch samples keeping its total; the smallest total change
    (ties: the first found). Pipelines that cannot take a multiple keep theirs."""
    units: dict[int, list[int]] = {}
    for i, q in enumerate(pipes):
        units.setdefault(q.batch_share // q.num_micro_batches, []).append(i)
    out: dict[int, int] = {}
    for members in units.values():
        inter = [i for i in members if i in able]
        rest = [i for i in members if i not in able]
        if not inter:
            continue
        options = []
        for i in inter:
            m, p = pipes[i].num_micro_batches, len(pipes[i].stages)
            down = m - m % p
            options.append([x for x in dict.fromkeys((down, down + p)) if x >= p] if m % p
                           else [m])
        best = None
        for choice in itertools.product(*options):
            delta = sum(c - pipes[i].num_micro_batches for c, i in zip(choice, inter,
                                                                       strict=True))
            absorb = {}
            if delta:
                if not rest:
                    continue
                j = max(rest, key=lambda k: pipes[k].num_micro_batches)
                if pipes[j].num_micro_batches - delta < 1:
                    continue
                absorb = {j: pipes[j].num_micro_batches - delta}
            cost = sum(abs(c - pipes[i].num_micro_batches)
                       for c, i in zip(choice, inter, strict=True)) + abs(delta)
            if best is None or cost < best[0]:
                best = (cost, dict(zip(inter, choice, strict=True)) | absorb)
        if best is not None:
            out.update(best[1])
    if not any(i in out for i in able):
        return None
    return out


def interleaved_as(plan: Plan, options) -> bool:
    """Every pipeline of several submeshes runs one of ``options`` stages per submesh, and
    when 1 is not among them at least one pipeline is interleaved (it was asked for)."""
    pipes = [p for p in plan.pipelines if p.num_workers > 1]
    return all(p.virtual_stages in options for p in pipes) and (1 in options or bool(pipes))



def with_experts(st: Stage, profile, ep: int) -> Stage:
    """Stage ``st`` with ``ep`` of its data ways (``data x expert``) as an ``expert``
    axis where it holds a mixture-of-experts layer of ``profile`` (1: none), else all of
    them plain ``data``; a stage sharding its state (``fsdp``) as it is. Its placement
    becomes the planned one (``cost.stage.planned_placement``: balanced under a
    measured routing histogram, else even)."""
    from hetshard.cost.stage import planned_placement
    if st.axis("fsdp") > 1:
        return st
    holds = any(layer.experts for layer in profile.layers[st.start:st.end])
    r = st.axis("data") * st.axis("expert")
    e = ep if holds and r % max(ep, 1) == 0 else 1
    mesh, placed = [], False
    for name, n in st.mesh_shape:
        if name in ("data", "expert"):
            if not placed:
                mesh += data_axes(r, 1, e)
                placed = True
        else:
            mesh.append((name, n))
    if not placed:
        mesh = list(data_axes(r, 1, e)) + mesh
    return dataclasses.replace(st, mesh_shape=tuple(mesh),
                               experts=planned_placement(profile, e) if e > 1 else ())


def expert_parallel(plan: Plan, profile, ep: int, capacity_factor=None) -> Plan | None:
    """``plan`` with each stage that holds a mixture-of-experts layer and ``ep``-divisible
    data ways running ``ep`` of them as an ``expert`` axis (after ``data``: each expert
    group a run of adjacent devices, inside a node where it fits; 1: none), the experts
    split evenly (``ep`` must divide every layer's expert count), and the exchange's
    ``capacity_factor``; None when nothing changes."""
    counts = {layer.experts for layer in profile.layers if layer.experts}
    if not counts or any(n % ep for n in counts):
        return None
    pipes = tuple(dataclasses.replace(pipe, stages=tuple(with_experts(st, profile, ep)
                                                         for st in pipe.stages))
                  for pipe in plan.pipelines)
    out = dataclasses.replace(plan, pipelines=pipes, capacity_factor=capacity_factor)
    return None if out == plan else out


def speed_placement(st: Stage, cluster, experts: int, dtype: str) -> tuple[int, ...]:
    """Experts per rank of stage ``st``'s ``expert`` axis in proportion to each rank's
    speed (its slowest device's peak in ``dtype``, over the expert groups), rounded by
    largest remainder to sum to ``experts``: on a stage spanning GPU types the faster
    ranks hold (and compute) more experts, as HeterMoE places them. Even where every
    rank is as fast."""
    from hetshard.sim.simulator import axis_groups
    groups = axis_groups(st, "expert")
    speed = [min(cluster.gpu_of(g[r]).peak_flops(dtype) for g in groups)
             for r in range(st.axis("expert"))]
    share = [experts * v / sum(speed) for v in speed]
    counts = [int(x) for x in share]
    for r in sorted(range(len(share)), key=lambda r: counts[r] - share[r])[
            :experts - sum(counts)]:
        counts[r] += 1
    return tuple(counts)


def even_experts(plan: Plan) -> Plan:
    """``plan`` with every stage's experts placed evenly over its expert axis."""
    pipes = tuple(dataclasses.replace(pipe, stages=tuple(
        dataclasses.replace(st, experts=()) for st in pipe.stages))
        for pipe in plan.pipelines)
    return dataclasses.replace(plan, pipelines=pipes)


def balanced_experts(plan: Plan, loads, ep: int) -> Plan | None:
    """``plan`` with each stage of an ``ep``-rank expert axis placing its experts to even
    out the ranks' routed tokens under per-expert ``loads`` (a measured histogram:
    ``cost.stage.balanced_placement``); None when the even placement is as balanced."""
    from hetshard.cost.stage import balanced_placement
    counts = balanced_placement(loads, ep)
    if len(set(counts)) == 1:
        return None
    pipes = tuple(dataclasses.replace(pipe, stages=tuple(
        dataclasses.replace(st, experts=counts) if st.axis("expert") == ep else st
        for st in pipe.stages)) for pipe in plan.pipelines)
    out = dataclasses.replace(plan, pipelines=pipes)
    return None if out == plan else out
