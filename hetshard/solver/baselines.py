"""Baseline planners, priced by the same simulator as hetshard's plans.

Each is a simplified re-implementation of what its source does, on hetshard's cost
model; what is simplified is stated per function. They share the search machinery
of ``inter_op`` where the source's algorithm coincides with it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.profile import ModelProfile
from hetshard.errors import HetshardError
from hetshard.plan import Plan
from hetshard.sim.simulator import annotate, simulate
from hetshard.solver.batch import assign_batch
from hetshard.solver.evaluator import zero1_choice
from hetshard.solver.families import Family, build_plan, divisors, family_configs
from hetshard.solver.options import planned_gpu_dtypes
from hetshard.solver.splits import LayerTables, split_layers
from hetshard.solver.uniform import Fix, stage_bounds, uniform_plan

BASELINES = ("megatron-uniform", "fastest-only", "metis-like", "amp-like", "alpa-homogeneous")


def _blocks(profile: ModelProfile) -> int:
    return len(profile.block_indices())


def uniform_candidates(model, profile, cluster, global_batch, seq_len, opts,
                       deadline: float | None = None) -> list[Plan]:
    """Every uniform dp x tp x pp plan (with the options' micro-batch sizes and remats);
    past ``deadline`` (``time.perf_counter``) the ones built so far, at least one."""
    n = cluster.num_devices
    heads = profile.tensor_divisor
    max_tp = min(g.gpus_per_node for g in cluster.groups)
    out = []
    for tp in opts.tp_options:
        if n % tp or heads % tp or tp > max_tp:
            continue
        for pp in range(1, min(_blocks(profile), n // tp) + 1):
            if (n // tp) % pp or _blocks(profile) % pp:
                continue
            dp = n // (tp * pp)
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


def run_baseline(name: str, model, profile, cluster, global_batch, seq_len, opts,
                 cal: Calibration = DEFAULT):
    fn = {"megatron-uniform": megatron_uniform, "fastest-only": fastest_only,
          "metis-like": metis_like, "amp-like": amp_like,
          "alpa-homogeneous": alpa_homogeneous}[name]
    if name not in ("megatron-uniform", "fastest-only"):
        # Megatron-LM has the distributed optimizer (ZeRO-1); Metis, AMP and Alpa keep a
        # full optimizer state per data-parallel replica, as published.
        opts = dataclasses.replace(opts, distributed_optimizer=False)
    return fn(model, profile, cluster, global_batch, seq_len, opts, cal)


__all__ = ["BASELINES", "run_baseline", "uniform_candidates", "stage_bounds"]
