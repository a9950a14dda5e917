"""Baseline planners, priced by the same simulator as hetshard's plans.

Each is a simplified re-implementation of what its source does, on hetshard's cost
model; what is simplified is stated per function. They share the search machinery
of ``inter_op`` where the source's algorithm coincides with it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.profile import ModelProfile
from hetshard.errors import HetshardError
from hetshard.sim.simulator import annotate, simulate
from hetshard.solver.batch import assign_batch
from hetshard.solver.evaluator import zero1_choice
from hetshard.solver.families import Family, build_plan, divisors, family_configs
from hetshard.solver.options import data_axes, planned_gpu_dtypes
from hetshard.solver.splits import LayerTables, split_layers
from hetshard.solver.uniform import Fix, stage_bounds, uniform_plan
from hetshard.solver.variants import speed_placement

BASELINES = ("megatron-uniform", "fastest-only", "metis-like", "amp-like", "alpa-homogeneous")
# Mixture-of-experts baselines (``experiments/moe.py``)
MOE_BASELINES = ("ep-type-blind", "ep-by-speed", "zebra")


def _blocks(profile: ModelProfile) -> int:
    return len(profile.block_indices())


def _degrees(profile, cluster, opts, spread: bool = False):
    """``(tp, pp, dp)`` of every uniform layout of the whole cluster: tensor degrees of
    the options dividing the heads within a node, stage counts dividing the rest and
    (unless ``spread``: blocks spread as ``stage_bounds`` does) the blocks."""
    n, blocks = cluster.num_devices, _blocks(profile)
    heads = profile.tensor_divisor
    max_tp = min(g.gpus_per_node for g in cluster.groups)
    for tp in opts.tp_options:
        if n % tp or heads % tp or tp > max_tp:
            continue
        for pp in range(1, min(blocks, n // tp) + 1):
            if (n // tp) % pp or (blocks % pp and not spread):
                continue
            yield tp, pp, n // (tp * pp)


def uniform_candidates(model, profile, cluster, global_batch, seq_len, opts,
                       deadline: float | None = None) -> list[Plan]:
    """Every uniform dp x tp x pp plan (with the options' micro-batch sizes and remats);
    past ``deadline`` (``time.perf_counter``) the ones built so far, at least one."""
    out = []
    for tp, pp, dp in _degrees(profile, cluster, opts):
        for mbs, remat in itertools.product(opts.mbs_options, opts.remat_options):
            if global_batch % (dp * mbs):
                continue
            if deadline is not None and out and time.perf_counter() > deadline:
                return out
            try:
                out.append(uniform_plan(model, profile, cluster, global_batch=global_batch,
                                        seq_len=seq_len,
                                        fix=Fix(dp, tp, pp, 1, False, mbs, remat,
                                                opts.schedule,
                                                zero1=opts.distributed_optimizer
                                                is not False,
                                                tp_overlap=opts.tp_overlap),
                                        attention=opts.attention,
                                        gpu_dtypes=planned_gpu_dtypes(profile, cluster,
                                                                      opts)))
            except HetshardError:
                continue
    return out


def _best(plans, profile, cluster, cal, deadline: float | None = None,
          cache: dict | None = None, choose_zero1: bool = False, margin: float = 0.0):
    """The fastest plan that fits (each GPU's memory less ``margin``); with
    ``choose_zero1`` the winner is also simulated without the distributed optimizer (its
    all-gather waits for the update)."""
    best = None
    for p in plans:
        if deadline is not None and best is not None and time.perf_counter() > deadline:
            break
        r = simulate(p, profile, cluster, cal, trace=False, cache=cache, margin=margin)
        key = r.rank
        if best is None or key < best[0]:
            best = (key, p, r)
    if best is None:
        return None
    if choose_zero1:
        best = zero1_choice(best, profile, cluster, cal, cache, margin)
    return annotate(best[1], best[2])


def megatron_uniform(model, profile, cluster, global_batch, seq_len, opts, cal=DEFAULT):
    """Best uniform TP x PP x DP over the whole cluster: even layers per stage, equal batch
    per replica, devices in id order, so each SPMD stage runs at its slowest GPU's pace
    (what a mixed cluster gets from a homogeneous framework)."""
    return _best(uniform_candidates(model, profile, cluster, global_batch, seq_len, opts),
                 profile, cluster, cal, choose_zero1=opts.distributed_optimizer is None,
                 margin=opts.memory_margin)


def _sub_cluster(cluster: Cluster, group: str) -> Cluster:
    g = cluster.group(group)
    return dataclasses.replace(cluster, name=f"{cluster.name}:{group}", groups=(g,),
                               inter_group_gbs=g.inter_node_gbs)


def _shift(plan: Plan, offset: int, cluster: Cluster) -> Plan:
    pipes = []
    for p in plan.pipelines:
        stages = tuple(dataclasses.replace(s, devices=tuple(d + offset for d in s.devices))
                       for s in p.stages)
        pipes.append(dataclasses.replace(p, stages=stages))
    return dataclasses.replace(plan, pipelines=tuple(pipes), cluster=cluster)


def group_uniform_candidates(model, profile, cluster, global_batch, seq_len, opts,
                             groups=None) -> list[Plan]:
    """Uniform plans on each of ``groups`` (default: every GPU group) alone, the rest of
    the cluster idle: plans whose stages each hold one GPU type."""
    out = []
    for g in groups or cluster.groups:
        plans = uniform_candidates(model, profile, _sub_cluster(cluster, g.name),
                                   global_batch, seq_len, opts)
        offset = cluster.group_device_ids(g.name).start
        out += [_shift(p, offset, cluster) for p in plans]
    return out


def fastest_only(model, profile, cluster, global_batch, seq_len, opts, cal=DEFAULT):
    """The best uniform plan on the fastest GPU group alone (the rest idle)."""
    fastest = max(cluster.groups, key=lambda g: g.gpu.peak_flops(profile.dtype))
    plans = group_uniform_candidates(model, profile, cluster, global_batch, seq_len, opts,
                                     groups=(fastest,))
    return _best(plans, profile, cluster, cal,
                 choose_zero1=opts.distributed_optimizer is None, margin=opts.memory_margin)


def metis_like(model, profile, cluster, global_batch, seq_len, opts, cal=DEFAULT,
               deadline: float | None = None, cache: dict | None = None):
    """Metis (Um et al., ATC'24), simplified: one pipeline family over all groups with
    per-group stage counts, a common TP degree and data ways searched; layers split in
    proportion to each stage's peak throughput (not balanced on the cost model); one
    batch share (Metis' per-pipeline uneven batches are not modelled here)."""
    import math

    groups = tuple(sorted(cluster.groups, key=lambda g: -g.gpu.peak_flops(profile.dtype)))
    heads = profile.tensor_divisor
    n_layers = profile.num_layers
    plans = []
    gcd = math.gcd(*[g.num_devices for g in groups])
    for r in divisors(gcd):
        for tp in opts.tp_options:
            if heads % tp or any(tp > g.gpus_per_node or g.num_devices % (r * tp)
                                 for g in groups):
                continue
            ks = [g.num_devices // (r * tp) for g in groups]
            if sum(ks) > n_layers:
                continue
            speeds = [g.gpu.peak_flops(profile.dtype) for g, k in zip(groups, ks, strict=True)
                      for _ in range(k)]
            names = [g.name for g, k in zip(groups, ks, strict=True) for _ in range(k)]
            cuts, acc, total = [0], 0.0, sum(speeds)
            for sp in speeds[:-1]:
                acc += sp
                cuts.append(min(max(round(acc / total * n_layers), cuts[-1] + 1),
                                n_layers - (len(speeds) - len(cuts))))
            bounds = tuple(zip(cuts, cuts[1:] + [n_layers], strict=True))
            for mbs, remat in itertools.product(opts.mbs_options, opts.remat_options):
                if global_batch % (r * mbs):
                    continue
                fam = Family(tuple(g.name for g in groups), r, tp, mbs, remat, bounds,
                             tuple(names), 0.0, 0.0)
                plans.append(build_plan(model, profile, cluster, [fam],
                                        [global_batch // (r * mbs)], global_batch, seq_len,
                                        opts))
    return _best(plans, profile, cluster, cal, deadline, cache, margin=opts.memory_margin)


def amp_like(model, profile, cluster, global_batch, seq_len, opts, cal=DEFAULT,
             deadline: float | None = None, cache: dict | None = None):
    """AMP (Li et al., NeurIPS'22), simplified: uniform TP x PP x DP degrees (as AMP
    searches), with the layers re-split across the pipeline stages to balance each
    stage's predicted time on its own (slowest) GPU type."""
    tables = LayerTables(profile, cluster, cal, opts.attention,
                         opts.distributed_optimizer is not False, opts.tp_overlap,
                         planned_gpu_dtypes(profile, cluster, opts))
    out = []
    for p in uniform_candidates(model, profile, cluster, global_batch, seq_len, opts,
                                deadline):
        if deadline is not None and out and time.perf_counter() > deadline:
            break
        pipe = p.pipelines[0]
        stages, caps = [], []
        for st in pipe.stages:
            g = min((cluster.group(cluster.slot(d).group) for d in st.devices),
                    key=lambda g: tables.peak_of(g.gpu))
            stages.append(tables.get(g, st.axis("tensor"), pipe.micro_batch_size, st.remat,
                                     st.axis("data")))
            caps.append(g.gpu.memory_bytes * (1 - opts.memory_margin))
        res = split_layers(stages, profile.num_layers, caps)
        if res is None:
            out.append(p)
            continue
        bounds, _ = res
        new = tuple(dataclasses.replace(st, start=a, end=b)
                    for st, (a, b) in zip(pipe.stages, bounds, strict=True))
        out.append(dataclasses.replace(p, pipelines=(dataclasses.replace(pipe, stages=new),)))
    return _best(out, profile, cluster, cal, deadline, cache, margin=opts.memory_margin)


def alpa_homogeneous(model, profile, cluster, global_batch, seq_len, opts, cal=DEFAULT):
    """Alpa (Zheng et al., OSDI'22), simplified: its stage/submesh search run as if every
    GPU were the cluster's most common type (one pipeline over all devices, stage layer
    split balanced on that assumption), then priced on the real cluster."""
    common = max(cluster.groups, key=lambda g: g.num_devices).gpu
    homo = dataclasses.replace(cluster, groups=tuple(dataclasses.replace(g, gpu=common)
                                                     for g in cluster.groups))
    tables = LayerTables(profile, homo, cal, opts.attention,
                         opts.distributed_optimizer is not False, opts.tp_overlap)
    fams = family_configs(tuple(homo.groups), tables, profile, opts, profile.tensor_divisor,
                          time.perf_counter() + opts.time_limit_s)
    plans = []
    for fam in sorted(fams, key=lambda f: f.bottleneck_s / f.samples_per_microbatch)[:8]:
        res = assign_batch([fam], global_batch)
        if res is None:
            continue
        fam = dataclasses.replace(fam, groups=fam.groups)
        assert isinstance(fam, Family)
        plans.append(build_plan(model, profile, cluster, [fam], res[0], global_batch,
                                seq_len, opts))
    return _best(plans, profile, cluster, cal, margin=opts.memory_margin)


def ep_by_speed(model, profile, cluster, global_batch, seq_len, opts, cal=DEFAULT):
    """``ep_type_blind``'s plans with each stage that spans GPU types placing its experts
    in proportion to its ranks' speed (``variants.speed_placement``: uneven experts per
    device, the faster types holding more); the rest of the stage (attention, dense
    layers) still runs at its slowest type's pace. None where no plan can be built."""
    return ep_type_blind(model, profile, cluster, global_batch, seq_len, opts, cal,
                         by_speed=True)


def ep_type_blind(model, profile, cluster, global_batch, seq_len, opts, cal=DEFAULT,
                  by_speed: bool = False):
    """Expert parallelism that ignores GPU types: the best uniform dp x tp x pp plan over
    the whole cluster (``uniform_candidates``: even layers per stage, devices in id order,
    a stage mixing types at its slowest's pace) with each of ``opts.ep_options`` of its
    data ways holding different experts, evenly (MaxText's or Megatron-Core's EP on a
    cluster taken as homogeneous); None where no such plan can be built."""
    plans = []
    for tp, pp, dp in _degrees(profile, cluster, opts, spread=True):
        for ep, factor, mbs, remat in itertools.product(
                sorted(e for e in set(opts.ep_options) if e > 1), opts.capacity_factors,
                opts.mbs_options, opts.remat_options):
            if global_batch % (dp * mbs) or dp % ep:
                continue
            try:
                plan = uniform_plan(
                    model, profile, cluster, global_batch=global_batch, seq_len=seq_len,
                    fix=Fix(dp, tp, pp, 1, False, mbs, remat, opts.schedule,
                            zero1=opts.distributed_optimizer is not False,
                            tp_overlap=opts.tp_overlap, ep=ep, capacity=factor or 0.0),
                    attention=opts.attention,
                    gpu_dtypes=planned_gpu_dtypes(profile, cluster, opts))
                if by_speed:
                    plan = _placed_by_speed(plan, profile, cluster)
                    if plan is None:
                        continue
                plans.append(plan)
            except HetshardError:
                continue
    return _best(plans, profile, cluster, cal, choose_zero1=opts.distributed_optimizer is None,
                 margin=opts.memory_margin) if plans else None


def _placed_by_speed(plan: Plan, profile, cluster) -> Plan | None:
    """``plan`` with its expert stages spanning GPU types placed by speed; None when no
    stage spans types."""
    experts = min(layer.experts for layer in profile.layers if layer.experts)
    changed = False
    pipes = []
    for pipe in plan.pipelines:
        stages = []
        for st in pipe.stages:
            if st.axis("expert") > 1 and "+" in st.gpu:
                counts = speed_placement(st, cluster, experts, plan.stage_dtype(st))
                if len(set(counts)) > 1:
                    st = dataclasses.replace(st, experts=counts)
                    changed = True
            stages.append(st)
        pipes.append(dataclasses.replace(pipe, stages=tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(pipes)) if changed else None


def zebra_candidates(model, profile, cluster, global_batch, seq_len, opts) -> list[Plan]:
    """HeterMoE's "zebra" split (2025), on hetshard's plan: the attention (and every
    dense) half of each block on the newer GPU type, each mixture-of-experts half on the
    older, as one interleaved pipeline of two submeshes (stage ``j`` on submesh ``j mod
    2``, block halves as layers: ``profile`` must be traced with ``split_blocks``). The
    newer type's devices run data parallelism, the older's data x expert parallelism
    (each of ``opts.ep_options`` that divides them); micro-batch sizes, remats and
    capacity factors from the options. Simplified: HeterMoE also overlaps the two halves
    of different micro-batches in its own schedule; here the interleaved 1F1B schedule
    does that. Empty when the
    cluster has one GPU type or the profile no expert half."""
    if not profile.split_blocks or len(cluster.groups) < 2 or \
            not any(layer.experts for layer in profile.layers):
        return []
    groups = sorted(cluster.groups, key=lambda g: -g.gpu.peak_flops(profile.dtype))
    new, old = groups[0], groups[1]
    runs: list[list[int]] = []  # alternating runs of layers: newer, older, newer, ...
    for i, layer in enumerate(profile.layers):
        side = 1 if layer.experts else 0
        if not runs and side:
            return []
        if not runs or (len(runs) - 1) % 2 != side:  # (run k is on side k mod 2)
            runs.append([])
        runs[-1].append(i)
    if len(runs) % 2:  # (the head after the last expert half: with it, on the older)
        runs[-2].extend(runs.pop())
    v = len(runs) // 2
    n_new = cluster.group(new.name).num_devices
    n_old = cluster.group(old.name).num_devices
    dev_new = tuple(cluster.group_device_ids(new.name))
    dev_old = tuple(cluster.group_device_ids(old.name))
    experts = {layer.experts for layer in profile.layers if layer.experts}
    out = []
    for ep in sorted(set(opts.ep_options) | {1}):
        if n_old % ep or any(n % ep for n in experts) or ep > old.gpus_per_node:
            continue
        meshes = ((("data", n_new),), data_axes(n_old, 1, ep))
        for mbs, remat, factor in itertools.product(opts.mbs_options, opts.remat_options,
                                                    opts.capacity_factors):
            samples = mbs * n_new
            m = global_batch // samples
            if global_batch % samples or m < 2 or m % 2 or samples % n_old:
                continue
            stages = []
            for j, run in enumerate(runs):
                w = j % 2
                stages.append(Stage(run[0], run[-1] + 1, (dev_new, dev_old)[w],
                                    (new, old)[w].gpu.name, meshes[w], remat=remat))
            try:
                pipe = Pipeline(tuple(stages), global_batch, mbs, m, "1f1b",
                                virtual_stages=v)
                out.append(Plan(model=model, cluster=cluster, global_batch=global_batch,
                                seq_len=seq_len, pipelines=(pipe,), dtype=profile.dtype,
                                distributed_optimizer=opts.distributed_optimizer is not False,
                                attention=opts.attention, split_blocks=True,
                                fingerprint=profile.fingerprint,
                                gpu_dtypes=planned_gpu_dtypes(profile, cluster, opts),
                                capacity_factor=factor if ep > 1 else None))
            except HetshardError:
                continue
    return out


def zebra(model, profile, cluster, global_batch, seq_len, opts, cal=DEFAULT):
    """The best of ``zebra_candidates`` (None when there is none)."""
    plans = zebra_candidates(model, profile, cluster, global_batch, seq_len, opts)
    return _best(plans, profile, cluster, cal, choose_zero1=opts.distributed_optimizer is None,
                 margin=opts.memory_margin) if plans else None


def run_baseline(name: str, model, profile, cluster, global_batch, seq_len, opts,
                 cal: Calibration = DEFAULT):
    fn = {"megatron-uniform": megatron_uniform, "fastest-only": fastest_only,
          "metis-like": metis_like, "amp-like": amp_like,
          "alpa-homogeneous": alpa_homogeneous, "ep-type-blind": ep_type_blind,
          "ep-by-speed": ep_by_speed,
          "zebra": zebra}[name]
    if name not in ("megatron-uniform", "fastest-only", *MOE_BASELINES):
        # Megatron-LM (and MaxText's and Megatron-Core's expert parallelism) have the
        # distributed optimizer (ZeRO-1); Metis, AMP and Alpa keep a full optimizer state
        # per data-parallel replica, as published.
        opts = dataclasses.replace(opts, distributed_optimizer=False)
    return fn(model, profile, cluster, global_batch, seq_len, opts, cal)


__all__ = ["BASELINES", "MOE_BASELINES", "run_baseline", "uniform_candidates", "stage_bounds"]
