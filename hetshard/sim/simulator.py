"""Event-driven simulation of one training step of a :class:`~hetshard._plan.Plan`.

Each pipeline submesh is a worker that runs forward (F) and backward (B)
micro-batch tasks of its stages in its schedule's order (GPipe: all F then all B;
1F1B: ``p - s - 1`` warm-up forwards, then one F / one B, then the cool-down Bs;
interleaved 1F1B when a submesh holds several stages, see ``worker_order``).
A task starts when its worker is free and its input has arrived: F(s, i) needs
F(s-1, i) plus the activation's point-to-point transfer; B(s, i) needs
B(s+1, i) plus the cotangent's transfer, and F(s, i). Transfers are delays on
the link between the two stages (links are not modelled as contended).
The host dispatches every task of a step (``host_time_s``: each stage's forwards and
backwards, its update; a single-stage pipeline's step is one program) ahead of the
devices, one host a node; the step takes at least its busiest host's time.
After its last backward, a stage synchronises gradients with the stages that
hold the same layers (``plan.grad_sync``), then runs the optimizer update; with
``overlap``, synchronisation starts as the last backward starts, as DDP-style
bucketing does. With the distributed optimizer (ZeRO-1) that synchronisation is a
reduce-scatter, the update runs on the stage's shard, and an all-gather of the
updated parameters follows it (not overlapped). Step time is the latest finish over
all stages. A device's peak memory is its stages' state, the activations its schedule
keeps in flight and the largest working set, plus the update's new state where the
runtime writes it beside the old (``worker_memory``, ``update_kind``).
"""

from __future__ import annotations

import dataclasses
import itertools

from hetshard import progress
from hetshard._plan import Plan, Predicted, data_ways, stage_dtype
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.comm import Topology, buckets, collective_time, p2p_time, topology
from hetshard.cost.profile import ModelProfile
from hetshard.cost.stage import StageCost, stage_cost
from hetshard.errors import SpecError
from hetshard.sim.schedule import (
    best_warmup,
    capped_warmup,
    inflight,
    monotone_warmup,
    time_pipeline,
    warmup_rooms,
    worker_order,
)


@dataclasses.dataclass(frozen=True)
class Task:
    pipeline: int
    stage: int
    kind: str  # "F", "B", "sync", "opt", "send"
    micro_batch: int
    start_s: float
    end_s: float
    worker: int = 0  # the pipeline's submesh running it (== stage unless interleaved)


@dataclasses.dataclass(frozen=True)
class SimResult:
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (recomputation not counted) per GPU per second
    mfu: float  # model FLOP/s over the whole cluster's aggregate peak (idle GPUs count)
    bubble_fraction: float
    peak_memory_bytes: float  # max over devices
    memory_per_device: dict[int, float]
    busy_per_device: dict[int, float]
    fits: bool
    tasks: tuple[Task, ...]
    stage_costs: tuple[tuple[StageCost, ...], ...]
    # the devices' own time (step_time_s is the larger of it and the host's dispatch)
    device_time_s: float = 0.0
    # The jax.distributed processes (a spec's ``processes``) holding none of the plan's
    # devices: such a process could not read the step's outputs.
    idle_processes: int = 0
    # Host memory the plan's offload takes per node ("group/node"; empty: none offloads)
    host_memory_per_node: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def rank(self) -> tuple[bool, float, int, float]:
        """How plans are ranked, best first: the ones that fit, then the faster, then
        (between plans the host's dispatch paces alike) those that leave no process of a
        multi-process cluster idle, then the faster on the devices."""
        return (not self.fits, self.step_time_s, self.idle_processes, self.device_time_s)

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
                "bubble_fraction": self.bubble_fraction,
                "peak_memory_bytes": self.peak_memory_bytes, "fits": self.fits,
                "host_memory_per_node": self.host_memory_per_node}


def worker_memory(schedule: str, p: int, w: int, m: int, v: int, costs,
                  extra: tuple[int, ...] = (), update: tuple[str, ...] = ()) -> float:
    """Peak bytes per device of submesh ``w``: its stages' static memory, the activations
    its schedule keeps in flight at the worst moment, and the largest working set.
    ``costs[s]`` is stage s's StageCost. ``update[s]`` (:func:`update_kind`; none: every
    stage ``in_place``): how the runtime writes stage s's new state
    (``StageCost.memory_state_bytes``): over the old (``in_place``), beside it in the
    step's one program, whose outputs are allocated when it starts (``with_step``), or
    beside it in the stage's update program, run once the activations are gone
    (``apart``; a submesh's stages update one at a time)."""
    mine = range(w, len(costs), p)
    step = _step_memory(schedule, p, w, m, v, costs, extra)
    kinds = update or ("in_place",) * len(costs)
    step += sum(costs[s].memory_state_bytes for s in mine if kinds[s] == "with_step")
    apart = [costs[s].memory_state_bytes for s in mine if kinds[s] == "apart"]
    if apart:
        return max(step, sum(costs[s].memory_static_bytes for s in mine) + max(apart))
    return step


def update_kind(plan: Plan, pipe, donated: bool = True) -> tuple[str, ...]:
    """How the runtime writes each stage of pipeline ``pipe``'s new state
    (``hetshard.runtime.executable``, ``hetshard.runtime.pipeline``): over the old where
    it donates the state (``donated``: ``hetshard.runtime.guard.donates``; on GPUs it
    does), but for a stage of several keeping leaves in host memory; else beside it, in
    the step's one program (one SPMD stage) or in an update program of its own (a
    pipeline's stages, batch shares)."""
    one = len(plan.pipelines) == 1 and len(pipe.stages) == 1
    return tuple("in_place" if donated and (len(pipe.stages) == 1 or not st.offload) else
                 "with_step" if one else "apart" for st in pipe.stages)


def _step_memory(schedule: str, p: int, w: int, m: int, v: int, costs,
                 extra: tuple[int, ...]) -> float:
    """:func:`worker_memory` before the update's new state."""
    if v == 1 and schedule != "zbh1":
        return costs[w].peak_memory(inflight(schedule, p, w, m, extra))
    live = peak = 0.0
    split = schedule == "zbh1"
    act = [c.memory_per_microbatch_bytes for c in costs]
    # ZB-H1: a micro-batch's activations stay until its W, which also reads the
    # cotangent sent back and what its B computed (nothing on the first stage, whose B
    # has no input cotangent to make: its whole backward is W).
    carry = [(c.memory_cotangent_bytes + (c.memory_carry_bytes if s else 0.0)) if split
             else 0.0 for s, c in enumerate(costs)]
    for kind, s, _ in worker_order(schedule, p, w, m, v, extra):
        if kind == "F":
            live += act[s]
            if live > peak:
                peak = live
        elif kind == "B":
            live += carry[s] if split else -act[s]
            if live > peak:
                peak = live
        else:
            live -= act[s] + carry[s]
    mine = costs[w::p]
    return (sum(c.memory_static_bytes for c in mine) + peak +
            max(c.memory_working_bytes for c in mine))


def host_memory(pipe, w: int, costs) -> float:
    """Host bytes per device of submesh ``w`` (its stages' ``offload``): the offloaded
    optimizer state, and the offloaded activations of the micro-batches in flight."""
    mine = costs[w::pipe.num_workers]
    per_mb = sum(c.host_per_microbatch_bytes for c in mine)
    live = inflight(pipe.schedule, pipe.num_workers, w, pipe.num_micro_batches,
                    pipe.extra_warmup) * pipe.virtual_stages if per_mb else 0
    return sum(c.host_static_bytes for c in mine) + live * per_mb


def host_per_node(cluster: Cluster, host: dict[int, float]) -> dict[str, tuple]:
    """``host`` (device -> host bytes) summed per node ("group/node"), each with the
    node's host memory: (bytes, capacity)."""
    out: dict[str, list] = {}
    for d, b in host.items():
        slot = cluster.slot(d)
        key = f"{slot.group}/{slot.node}"
        out.setdefault(key, [0.0, cluster.group(slot.group).host_memory_bytes])[0] += b
    return {k: tuple(v) for k, v in out.items()}


def stage_costs_for(plan: Plan, profile: ModelProfile, cluster: Cluster,
                    cal: Calibration, cache: dict | None = None) -> list[list[StageCost]]:
    """Every stage's cost; ``cache`` (a dict the caller keeps for one profile, cluster and
    calibration) reuses stages priced before, as a planner's neighbouring plans share
    most of theirs."""
    out = []
    for pipe in plan.pipelines:
        costs = []
        for j, st in enumerate(pipe.stages):
            fsdp = plan.fsdp or st.axis("fsdp") > 1
            mbs = pipe.stage_micro_batch(j)
            dtype = priced_dtype(plan, profile, st)
            key = (st.start, st.end, st.devices, st.mesh_shape, st.remat, st.remat_layers,
                   st.offload, fsdp,
                   mbs, plan.attention, plan.distributed_optimizer, plan.tp_overlap, dtype,
                   plan.context_chunks(st), plan.context.shard_state, st.experts,
                   plan.capacity_factor)
            if cache is not None and key in cache:
                cost = cache[key]
            else:
                cost = layers_cost(st, st.start, st.end, mbs, fsdp,
                                   plan.attention, profile, cluster, cal,
                                   plan.distributed_optimizer, plan.tp_overlap, dtype,
                                   plan.context_chunks(st), plan.context.shard_state,
                                   capacity_factor=plan.capacity_factor)
                if cache is not None:
                    cache[key] = cost
            costs.append(cost)
        out.append(costs)
    return out


def priced_dtype(plan: Plan, profile: ModelProfile, st) -> str:
    """The dtype stage ``st`` is priced in: its GPU type's entry of ``plan.gpu_dtypes``,
    else the program's (the profile's)."""
    return stage_dtype(st.gpu, profile.dtype, plan.gpu_dtypes)


def typed_layers_costs(st, start: int, end: int, mbs: int, fsdp: bool, attention: str,
                       profile: ModelProfile, cluster: Cluster, cal: Calibration,
                       shard_optimizer: bool = False, tp_overlap: bool = False,
                       dtype: str | None = None, chunks: tuple[int, ...] = (),
                       shard_context: bool = False, capacity_factor: float | None = None
                       ) -> dict[str, StageCost]:
    """Per GPU type of stage ``st`` with uneven context ``chunks`` (``Plan.context_chunks``): what
    its devices spend on layers ``[start, end)``, as the runtime runs them: the layers
    around attention keep the sequence's even split, attention takes each device's chunk
    (``hetshard.rewrite.attention._ring_on_mesh``). Each type is priced at equal chunks on
    the stage's mesh with its attention time (kernels, the flash backward's recompute,
    the ring's exposed transfers) scaled by the largest chunk one of its devices holds
    over the equal chunk: under the zigzag split (a piece from each end of the sequence)
    a rank's causal attention work is in proportion to its chunk. Every device holds
    the attention inputs and outputs of the longest chunk (the ring pads to it).
    Without ``chunks``: every type at equal chunks."""
    if not chunks:
        return {t.name: _priced(st, start, end, mbs, fsdp, attention, profile, cluster, cal,
                                shard_optimizer, tp_overlap, dtype, t, shard_context,
                                capacity_factor)
                for t in {cluster.gpu_of(d).name: cluster.gpu_of(d)
                          for d in st.devices}.values()}
    tp, cp = st.axis("tensor"), st.axis("context")
    equal = sum(chunks) / cp
    pad = max(chunks) / equal
    share: dict[str, float] = {}
    types = {}
    for i, d in enumerate(st.devices):
        t = cluster.gpu_of(d)
        types[t.name] = t
        share[t.name] = max(share.get(t.name, 0.0), chunks[(i // tp) % cp] / equal)
    return {name: _scaled(_priced(st, start, end, mbs, fsdp, attention, profile, cluster,
                                  cal, shard_optimizer, tp_overlap, dtype, types[name],
                                  capacity_factor=capacity_factor),
                          share[name], pad)
            for name in types}


def _scaled(c: StageCost, f: float, pad: float) -> StageCost:
    """``c`` with ``f`` times its attention work and ``pad`` times its attention inputs
    and outputs (``typed_layers_costs``)."""
    return dataclasses.replace(
        c, fwd_s=c.fwd_s + c.attention_fwd_s * (f - 1),
        bwd_s=c.bwd_s + c.attention_bwd_s * (f - 1),
        attention_fwd_s=c.attention_fwd_s * f, attention_bwd_s=c.attention_bwd_s * f,
        memory_per_microbatch_bytes=c.memory_per_microbatch_bytes +
        c.attention_memory_bytes * (pad - 1),
        attention_memory_bytes=c.attention_memory_bytes * pad)


def layers_cost(st, start: int, end: int, mbs: int, fsdp: bool, attention: str,
                profile: ModelProfile, cluster: Cluster, cal: Calibration,
                shard_optimizer: bool = False, tp_overlap: bool = False,
                dtype: str | None = None, chunks: tuple[int, ...] = (),
                shard_context: bool = False, capacity_factor: float | None = None
                ) -> StageCost:
    """Layers ``[start, end)`` priced on stage ``st``'s submesh (its devices, mesh, remat:
    the part of ``st``'s recomputed layers among them); ``shard_optimizer``: ZeRO-1 over
    the stage's data ways; ``tp_overlap``: collective matmuls (``Plan.tp_overlap``);
    ``dtype``: the stage's compute dtype (``Plan.stage_dtype``; None: the program's);
    ``chunks``: uneven context chunks (``Plan.context_chunks``), the stage then paced by the
    GPU type that takes longest with its share (``typed_layers_costs``); ``shard_context``:
    the state sharded over the context ranks too (``Context.shard_state``)."""
    if chunks:
        return max(typed_layers_costs(st, start, end, mbs, fsdp, attention, profile,
                                      cluster, cal, shard_optimizer, tp_overlap, dtype,
                                      chunks, shard_context, capacity_factor).values(),
                   key=lambda c: c.fwd_s + c.bwd_s)
    types = {cluster.gpu_of(d).name: cluster.gpu_of(d) for d in st.devices}
    if len(types) == 1:
        return _priced(st, start, end, mbs, fsdp, attention, profile, cluster, cal,
                       shard_optimizer, tp_overlap, dtype, next(iter(types.values())),
                       shard_context, capacity_factor)
    # A stage spanning types runs at the pace of the type that takes longest as priced
    # (not the lowest peak: a type's attention kernel may be the slower one).
    return max((_priced(st, start, end, mbs, fsdp, attention, profile, cluster, cal,
                        shard_optimizer, tp_overlap, dtype, t, shard_context,
                        capacity_factor)
                for t in types.values()), key=lambda c: c.fwd_s + c.bwd_s)


def _priced(st, start, end, mbs, fsdp, attention, profile, cluster, cal, shard_optimizer,
            tp_overlap, dtype, gpu, shard_context: bool = False,
            capacity_factor: float | None = None) -> StageCost:
    """``layers_cost`` with the stage's work priced on GPU type ``gpu``."""
    tp, cp = st.axis("tensor"), st.axis("context")
    dp = data_ways(st)
    devs = list(st.devices)
    # Device order inside a stage: data-major, then context, then tensor (innermost). A
    # stage spanning GPU types or nodes runs at its slowest group's pace.
    tp_topo = _slowest_group(cluster, [devs[i:i + tp] for i in range(0, len(devs), tp)]) \
        if tp > 1 else None
    cp_topo = _slowest_group(cluster, [devs[i:i + tp * cp:tp] for i in range(
        0, len(devs), tp * cp)]) if cp > 1 else None
    shard_context = shard_context and cp > 1
    # the devices FSDP gathers a weight from: one a data way, or a (data, context) pair
    dp_topo = topology(cluster, devs[::tp] if shard_context else devs[::tp * cp]) \
        if dp > 1 or shard_context else None
    opt_ways = None
    if fsdp and is_hybrid(st):
        # Hybrid sharding: each data group of ``fsdp`` ways gathers from its own ranks
        # (the slowest group's links); the distributed optimizer also splits the
        # optimizer state over the groups (``hetshard.layout.leaf_spec``).
        f, step = st.axis("fsdp"), tp if shard_context else tp * cp
        span = f * cp * tp
        dp_topo = _slowest_group(cluster, [devs[i:i + span:step]
                                           for i in range(0, len(devs), span)])
        opt_ways = f * (cp if shard_context else 1) * \
            (st.axis("data") if shard_optimizer else 1)
        dp = f
    return stage_cost(profile, start, end, gpu, tp=tp, cp=cp, dp=dp, fsdp=fsdp,
                      shard_context=shard_context, optimizer_ways=opt_ways,
                      shard_optimizer=shard_optimizer, mbs=mbs, remat=st.remat,
                      remat_layers=recomputed_among(st, start, end),
                      attention=attention, cal=cal, tp_topo=tp_topo, cp_topo=cp_topo,
                      dp_topo=dp_topo, tp_overlap=tp_overlap, dtype=dtype,
                      offload=st.offload, host_link_gbs=min(
                          cluster.group(cluster.slot(d).group).host_link for d in devs)
                      if st.offload else None,
                      # (a stage whose layouts are not solved yet: the runtime solves
                      # them, ``fill_missing_shardings``; ``tensor_rank_bytes``' prior)
                      shardings=st.shardings or None, ep=st.axis("expert"),
                      ep_topo=_slowest_group(cluster, axis_groups(st, "expert"))
                      if st.axis("expert") > 1 else None,
                      capacity_factor=capacity_factor, expert_counts=st.experts,
                      expert_ranks=_expert_ranks(st, cluster, gpu))


def _expert_ranks(st, cluster: Cluster, gpu) -> tuple[int, ...] | None:
    """The ranks of stage ``st``'s expert axis that have a device of type ``gpu``, where
    the stage spans types (each type priced at its own busiest rank: HeterMoE's uneven
    placement gives the faster more); None: every rank."""
    if st.axis("expert") < 2 or "+" not in st.gpu:
        return None
    return tuple(sorted({r for g in axis_groups(st, "expert") for r, d in enumerate(g)
                         if cluster.gpu_of(d).name == gpu.name}))


def axis_groups(st, axis: str) -> list[list[int]]:
    """The device groups along mesh axis ``axis`` of stage ``st`` (one per position of
    the other axes; devices laid out in ``mesh_shape`` order, the last axis fastest)."""
    import numpy as np
    names = [a for a, _ in st.mesh_shape]
    grid = np.array(st.devices).reshape([n for _, n in st.mesh_shape])
    moved = np.moveaxis(grid, names.index(axis), -1)
    return [list(map(int, row)) for row in moved.reshape(-1, st.axis(axis))]


def is_hybrid(st) -> bool:
    """Whether stage ``st`` shards its state over an ``fsdp`` axis inside each of its
    ``data`` groups (hybrid sharding: FSDP inside a group, data parallelism across)."""
    return st.axis("fsdp") > 1 and st.axis("data") > 1


def _hybrid_sync(st, cluster: Cluster, cal: Calibration, nbytes: float,
                 sharded_context: bool) -> float:
    """A hybrid-sharded stage's gradient sync (``is_hybrid``): a reduce-scatter inside
    each data group over its fsdp ranks (on their links), then an all-reduce of each
    rank's 1/fsdp shard across the groups (on the links between them), the groups' and
    the shards' collectives running at once and sharing each node's network card."""
    devs = list(st.devices)
    d, f, cp, tp = (st.axis(a) for a in ("data", "fsdp", "context", "tensor"))

    def at(di, fi, ci, ti):  # the stage's devices are data-major, then fsdp, context, tensor
        return devs[((di * f + fi) * cp + ci) * tp + ti]
    ctx = range(cp) if sharded_context else (0,)
    # inside a data group: its fsdp (and, sharded, context) ranks
    inner = _slowest_group(cluster, [[at(di, fi, ci, 0) for fi in range(f) for ci in ctx]
                                     for di in range(d)])
    # across the groups: one ring per shard (and, unsharded, over the context ranks too)
    across = (0,) if sharded_context else range(cp)
    outer = _slowest_group(cluster, [[at(di, fi, ci, 0) for di in range(d) for ci in across]
                                     for fi in range(f)])
    slowest = _slowest(cluster, devs).name
    rs = collective_time("reduce_scatter", nbytes, inner, cal, slowest,
                         tp * (1 if sharded_context else cp))
    shards = f * len(ctx)
    ar = collective_time("all_reduce", nbytes / shards, outer, cal, slowest, tp * shards)
    return rs + ar


def _slowest_group(cluster: Cluster, groups):
    """The topology of the slowest of ``groups`` (device lists doing the same collective):
    the most nodes, then the slowest links."""
    topos = [topology(cluster, g) for g in groups]
    return max(topos, key=lambda t: (t.nodes, -t.intra_gbs, -t.inter_gbs))


def recomputed_among(st, start: int, end: int) -> int | None:
    """How many of layers ``[start, end)`` stage ``st``'s remat covers (None: all)."""
    if st.remat_layers is None:
        return None
    return min(max(st.start + st.remat_layers - start, 0), end - start)


def _sends(pipe, profile: ModelProfile, cluster: Cluster, cal: Calibration) -> list[float]:
    """Transfer time of one micro-batch's activations between each stage and the next."""
    out = []
    for a, b in zip(pipe.stages, pipe.stages[1:], strict=False):
        nbytes = profile.layers[a.end - 1].boundary_bytes_per_sample * \
            pipe.samples_per_micro_batch
        out.append(p2p_time(nbytes, cluster, a.devices, b.devices, cal))
    return out


def tune_warmup(plan: Plan, profile: ModelProfile, cluster: Cluster,
                cal: Calibration = DEFAULT, *, margin: float = 0.0,
                cache: dict | None = None, zero_bubble_options: bool = False) -> Plan:
    """``plan`` with every 1F1B or ZB-H1 pipeline of one stage per submesh given the extra
    warm-up that minimises its 1F1B steady-state period (``best_warmup``) within each
    GPU's memory (less ``margin``); other pipelines unchanged. Under ZB-H1 that warm-up
    bounds the micro-batches a stage holds before their W passes, which also keep what
    their B computed; with ``zero_bubble_options`` the plan is simulated with it, without
    any, and with every stage holding at least ``p`` (the zero-bubble paper's ZB-H1), and
    the fastest that fits is returned."""
    pipes = []
    for pipe, args in zip(plan.pipelines, _warmup_problems(plan, profile, cluster, cal,
                                                           margin, cache), strict=True):
        if args is None:
            pipes.append(pipe)
            continue
        _, extra = best_warmup(*args)
        pipes.append(dataclasses.replace(
            pipe, extra_warmup=capped_warmup(extra, pipe.num_micro_batches)))
    tuned = dataclasses.replace(plan, pipelines=tuple(pipes))
    if not zero_bubble_options or not any(q.schedule == "zbh1" for q in pipes):
        return tuned

    def zb_with(extra_of):
        return dataclasses.replace(plan, pipelines=tuple(
            dataclasses.replace(q, extra_warmup=capped_warmup(extra_of(q),
                                                              q.num_micro_batches))
            if q.schedule == "zbh1" else q for q in pipes))
    # Also: none, and the zero-bubble paper's p micro-batches on every stage (at least).
    options = [tuned, zb_with(lambda q: ()),
               zb_with(lambda q: tuple(max(s, q.extra_warmup[s] if q.extra_warmup else 0)
                                       for s in range(len(q.stages))))]
    fitted = _fit_zero_bubble(tuned, profile, cluster, cal, margin, cache)
    if fitted is not None:
        options.append(fitted)
    options = list({q.what_runs(): q for q in options}.values())
    keys = [r.rank for r in
            (simulate(q, profile, cluster, cal, trace=False, cache=cache, margin=margin)
             for q in options)]
    return options[keys.index(min(keys))]


def _fit_zero_bubble(plan: Plan, profile: ModelProfile, cluster: Cluster, cal: Calibration,
                     margin: float, cache: dict | None) -> Plan | None:
    """``plan``'s ZB-H1 pipelines with the extra warm-up of each stage over memory (less
    ``margin``) lowered one at a time until it fits, or None when that cannot make it
    fit. The 1F1B warm-up the tuning starts from counts a held micro-batch's
    activations, not what its W pass keeps from B as well."""
    for _ in range(sum(sum(q.extra_warmup) for q in plan.pipelines) + 1):
        r = simulate(plan, profile, cluster, cal, trace=False, cache=cache, margin=margin)
        if r.fits:
            return plan
        over = {d for d, m in r.memory_per_device.items()
                if m > _capacity(cluster, d) * (1 - margin)}
        pipes, lowered = [], False
        for q in plan.pipelines:
            extra = list(q.extra_warmup)
            if q.schedule == "zbh1":
                for j, st in enumerate(q.stages[:len(extra)]):
                    if extra[j] > 0 and over & set(st.devices):
                        extra[j] -= 1
                        lowered = True
            # Lowering one stage may leave the next warming up more than it: lowered too.
            pipes.append(dataclasses.replace(q, extra_warmup=monotone_warmup(extra)))
        if not lowered:
            return None
        plan = dataclasses.replace(plan, pipelines=tuple(pipes))
    return None


def _warmup_problems(plan: Plan, profile: ModelProfile, cluster: Cluster, cal: Calibration,
                     margin: float, cache: dict | None):
    """Per pipeline, ``best_warmup``'s arguments (stage times, transfer times, rooms
    within memory less ``margin``), or None where extra warm-up does not apply."""
    costs = stage_costs_for(plan, profile, cluster, cal, cache)
    out = []
    for pipe, cs in zip(plan.pipelines, costs, strict=True):
        p = len(pipe.stages)
        if pipe.schedule not in ("1f1b", "zbh1") or pipe.virtual_stages != 1 or p < 2:
            out.append(None)
            continue
        memory = [(min(_capacity(cluster, d) for d in st.devices) * (1 - margin)
                   - c.memory_static_bytes - c.memory_working_bytes,
                   c.memory_per_microbatch_bytes)
                  for st, c in zip(pipe.stages, cs, strict=True)]
        out.append(([c.fwd_s + c.bwd_s for c in cs], _sends(pipe, profile, cluster, cal),
                    warmup_rooms(memory, p)))
    return out


def warmup_short_of_memory(plan: Plan, profile: ModelProfile, cluster: Cluster,
                           cal: Calibration = DEFAULT, *, margin: float = 0.0,
                           cache: dict | None = None) -> bool:
    """Whether some pipeline's best extra warm-up (``tune_warmup``) is held back by
    memory: with unbounded memory its steady period would be shorter."""
    for args in _warmup_problems(plan, profile, cluster, cal, margin, cache):
        if args is not None:
            times, sends, rooms = args
            within, _ = best_warmup(times, sends, rooms)
            free, _ = best_warmup(times, sends, [1 << 20] * len(rooms))
            if free < within * (1 - 1e-9):
                return True
    return False


def _typed_peaks(plan: Plan, pi: int, w: int, act, profile: ModelProfile, cluster: Cluster,
                 cal: Calibration, cache: dict | None,
                 update: str) -> dict[str, float] | None:
    """Peak bytes per GPU type on submesh ``w`` of pipeline ``pi`` when one of its stages
    has uneven context chunks (each type holds its own share of the sequence), else
    None. ``update``: :func:`update_kind`."""
    pipe = plan.pipelines[pi]
    p = pipe.num_workers
    mine = range(w, len(pipe.stages), p)
    if not any(plan.context_chunks(pipe.stages[s]) for s in mine):
        return None
    typed = {}
    for s in mine:
        st = pipe.stages[s]
        key = ("typed", st, plan.capacity_factor, pipe.stage_micro_batch(s), plan.fsdp,
               plan.attention,
               plan.distributed_optimizer, plan.tp_overlap, priced_dtype(plan, profile, st),
               plan.context_chunks(st))
        if cache is None or key not in cache:
            got = typed_layers_costs(
                st, st.start, st.end, pipe.stage_micro_batch(s),
                plan.fsdp or st.axis("fsdp") > 1, plan.attention, profile, cluster, cal,
                plan.distributed_optimizer, plan.tp_overlap, priced_dtype(plan, profile, st),
                plan.context_chunks(st), capacity_factor=plan.capacity_factor)
            if cache is None:
                typed[s] = got
                continue
            cache[key] = got
        typed[s] = cache[key]
    names = {cluster.gpu_of(d).name for d in pipe.stages[w].devices}
    out = {}
    for name in names:
        costs = list(act)
        for s in mine:
            costs[s] = typed[s].get(name, act[s])
        out[name] = worker_memory(pipe.schedule, p, w, pipe.num_micro_batches,
                                  pipe.virtual_stages, costs, pipe.extra_warmup, update)
    return out


def _slowest(cluster: Cluster, devices) -> object:
    """The GPU type that paces an SPMD program over ``devices`` (the slowest one)."""
    types = {cluster.gpu_of(d).name: cluster.gpu_of(d) for d in devices}
    return min(types.values(), key=lambda t: (t.peak_flops(), t.memory_gbs))


def simulate(plan: Plan, profile: ModelProfile, cluster: Cluster,
             cal: Calibration = DEFAULT, *, trace: bool = True,
             cache: dict | None = None, margin: float = 0.0,
             donated: bool = True) -> SimResult:
    """Simulates one step of ``plan``; see the module docstring for the model. With
    ``trace=False`` the result's ``tasks`` are left empty, and ``cache`` keeps stage costs
    between calls on the same profile, cluster and calibration (the planner's use).
    ``fits``: every device's peak within its memory less ``margin`` (a fraction).
    ``donated``: whether the step donates its state, the update written over it
    (:func:`update_kind`: as the runtime does on GPUs; on CPU only under
    ``nan_policy="apply"``)."""
    if plan.split_blocks != profile.split_blocks:
        raise SpecError("profile.split_blocks", profile.split_blocks,
                        f"the plan's split_blocks={plan.split_blocks} (profile the model with "
                        f"profile_model(..., split_blocks={plan.split_blocks}))")
    costs = stage_costs_for(plan, profile, cluster, cal, cache)
    tasks: list[Task] = []
    stage_end: dict[tuple[int, int], float] = {}
    last_b_start: dict[tuple[int, int], float] = {}
    last_b_end: dict[tuple[int, int], float] = {}
    busy: dict[int, float] = {}
    mem: dict[int, float] = {}
    host: dict[int, float] = {}  # host memory each device's offload takes
    for pi, pipe in enumerate(plan.pipelines):
        n, m, v = len(pipe.stages), pipe.num_micro_batches, pipe.virtual_stages
        p = n // v
        act = costs[pi]
        update = update_kind(plan, pipe, donated)
        sends = _sends(pipe, profile, cluster, cal)
        # A pipeline's walk depends only on its stage costs, transfers and schedule: the
        # planner's neighbouring plans mostly change one pipeline, so the others' walks
        # and memory peaks are remembered.
        key = ("walk", tuple(act), tuple(sends), m, pipe.schedule, v, pipe.extra_warmup,
               update)
        walked = None if (trace or cache is None) else cache.get(key)
        if walked is None:
            events, _, last_b = time_pipeline(
                [c.fwd_s for c in act], [c.bwd_s for c in act], sends, m, pipe.schedule, v,
                pipe.extra_warmup, trace, [c.bwd_weight_s for c in act])
            peaks = [worker_memory(pipe.schedule, p, w, m, v, act, pipe.extra_warmup, update)
                     for w in range(p)]
            if cache is not None and not trace:
                cache[key] = (last_b, peaks)
        else:
            (last_b, peaks), events = walked, []
        tasks += [Task(pi, s_, kind, i, start, end, s_ % p)
                  for s_, kind, i, start, end in events]
        for s_, (start, end) in enumerate(last_b):
            last_b_start[(pi, s_)], last_b_end[(pi, s_)] = start, end
        for w in range(p):
            peak = peaks[w]
            work = m * sum(c.fwd_s + c.bwd_s for c in act[w::p])
            typed = _typed_peaks(plan, pi, w, act, profile, cluster, cal, cache, update)
            held = host_memory(pipe, w, act)
            for d in pipe.stages[w].devices:
                busy[d] = work
                mem[d] = peak if typed is None else typed[cluster.gpu_of(d).name]
                if held:
                    host[d] = held
            for s in range(w, n, p):
                stage_end[(pi, s)] = last_b_end[(pi, s)]
    # Gradient synchronisation and optimizer step per stage. Stages sharing a submesh
    # (interleaved) take its network one synchronisation at a time and its GPUs for the
    # optimizer once their compute is done.
    step_end = 0.0
    names = {name: i for i, name in enumerate(profile.layer_names())}
    for pi, pipe in enumerate(plan.pipelines):
        p = pipe.num_workers
        net_free = [0.0] * p
        gpu_free = [max(stage_end[(pi, s)] for s in range(w, len(pipe.stages), p))
                    for w in range(p)]
        tied = _tied_transfers(pipe, costs[pi], names, profile, cluster, cal)
        # A tied weight's owner updates it once the readers' gradients have arrived.
        tied_ready: dict[int, float] = {}
        for reader, owner, t in tied:
            tied_ready[owner] = max(tied_ready.get(owner, 0.0),
                                    stage_end[(pi, reader)] + t)
        opt_done: dict[int, float] = {}
        for s, st in enumerate(pipe.stages):
            c, w = costs[pi][s], s % p
            partners = _sync_partners(plan, pi, st)
            if partners:
                devices, holders, overlap = partners
                topo = topology(cluster, devices)
                fsdp = plan.fsdp or st.axis("fsdp") > 1 or _context_sharded(plan, st)
                # ZeRO-1 shards over the stage's own data and context ways (none: nothing
                # to shard).
                zero1 = plan.distributed_optimizer and not fsdp and \
                    st.axis("data") * st.axis("context") > 1
                kind = "reduce_scatter" if (fsdp or zero1) else "all_reduce"
                slowest = _slowest(cluster, devices).name
                # One ring per tensor rank, all at once, sharing each node's network card.
                rings = st.axis("tensor")
                if is_hybrid(st) and len(holders) == 1:
                    def price(b, st=st):
                        return _hybrid_sync(st, cluster, cal, b, _context_sharded(plan, st))
                else:
                    def price(b, kind=kind, topo=topo, slowest=slowest, rings=rings):
                        return collective_time(kind, b, topo, cal, slowest, rings)
                # In XLA's combined buckets (``buckets``), each its own collective.
                pieces = sync_buckets(profile, st.start, st.end, c.grad_sync_bytes)
                t_sync = _run_sum((price(b), m) for _, b, m in pieces)
                t_gather = _run_sum((collective_time("all_gather", b, topo, cal, slowest,
                                                     rings), m)
                                    for _, b, m in pieces) if zero1 else 0.0
                # Gradients are complete once every holder finished its last backward;
                # with overlap, each layer's gradients stream once the last backward has
                # produced them (``_streamed_sync``), on every holder.
                ends = [stage_end[k] for k in holders]
                starts = [last_b_start.get(k, 0.0) for k in holders]
                free = max(net_free[w], tied_ready.get(s, 0.0))
                if overlap:
                    sync_end = _streamed_sync(profile, st, starts, ends, free, pieces,
                                              price)
                else:
                    sync_end = max(ends + [free]) + t_sync
                sync_end = max(sync_end, stage_end[(pi, s)])
                net_free[w] = sync_end
                if trace:
                    tasks.append(Task(pi, s, "sync", -1, sync_end - t_sync, sync_end, w))
            else:
                sync_end, t_gather = max(stage_end[(pi, s)], tied_ready.get(s, 0.0)), 0.0
            opt_start = max(sync_end, gpu_free[w])
            gpu_free[w] = opt_end = opt_start + c.optimizer_s + c.cast_s
            if trace:
                tasks.append(Task(pi, s, "opt", -1, opt_start, opt_end, w))
            if t_gather:
                # ZeRO-1: the updated shards are all-gathered (the submesh's network).
                gather_start = max(opt_end, net_free[w])
                net_free[w] = opt_end = gather_start + t_gather
                if trace:
                    tasks.append(Task(pi, s, "gather", -1, gather_start, opt_end, w))
            opt_done[s] = opt_end
            step_end = max(step_end, opt_end)
        for reader, owner, t in tied:  # the updated copy goes back to the reader
            if trace:
                tasks.append(Task(pi, reader, "send", -1, opt_done[owner],
                                  opt_done[owner] + t, reader % p))
            step_end = max(step_end, opt_done[owner] + t)
    # The devices cannot run faster than the host dispatches their tasks.
    device_end = step_end
    step_end = max(step_end, host_time_s(plan, cluster, cal))
    n_dev = plan.num_devices
    model_flops = profile.flops_per_sample() * plan.global_batch
    tokens = plan.global_batch * plan.seq_len
    # the whole cluster, idle GPUs included, each type at its compute dtype's rate
    peak = sum(g.num_devices * g.gpu.peak_flops(stage_dtype(g.gpu.name, plan.dtype,
                                                            plan.gpu_dtypes))
               for g in cluster.groups)
    capacity = {d: _capacity(cluster, d) for d in mem}
    fits = all(mem[d] <= capacity[d] * (1 - margin) for d in mem)
    per_node = host_per_node(cluster, host)
    fits = fits and all(b <= cap * (1 - margin) for b, cap in per_node.values())
    bubble = 1.0 - sum(busy.values()) / (n_dev * step_end) if step_end else 0.0
    progress.priced(tokens / step_end, fits)
    return SimResult(
        step_time_s=float(step_end), tokens_per_s=float(tokens / step_end),
        tflops_per_gpu=float(model_flops / step_end / n_dev / 1e12),
        mfu=float(model_flops / step_end / peak), bubble_fraction=float(bubble),
        peak_memory_bytes=float(max(mem.values())),
        memory_per_device={d: float(v) for d, v in mem.items()}, busy_per_device=busy,
        fits=bool(fits), tasks=tuple(tasks), stage_costs=tuple(tuple(c) for c in costs),
        device_time_s=float(device_end), idle_processes=_idle_processes(plan, cluster),
        host_memory_per_node={k: float(b) for k, (b, _) in per_node.items()})


def _idle_processes(plan: Plan, cluster: Cluster) -> int:
    """How many of the processes a cluster spec names (its groups' ``processes``) hold
    none of the plan's devices (0 without ``processes``)."""
    named = {}
    for g in cluster.groups:
        if g.processes:
            for i, d in enumerate(cluster.group_device_ids(g.name)):
                named[d] = g.processes[i // g.gpus_per_node]
    if not named:
        return 0
    used = {named[d] for p in plan.pipelines for st in p.stages for d in st.devices
            if d in named}
    return len(set(named.values()) - used)


def dispatched_tasks(pipe) -> int:
    """The tasks the host dispatches for one pipeline's step, as the runtime runs it: a
    single-stage pipeline's step is one program; a stage of a multi-stage pipeline runs
    a forward and a backward per micro-batch (and ZB-H1's weight pass) and one update."""
    if len(pipe.stages) == 1:
        return 1
    per = 3 if pipe.schedule == "zbh1" else 2
    return len(pipe.stages) * (per * pipe.num_micro_batches + 1)


def host_time_s(plan: Plan, cluster: Cluster, cal: Calibration = DEFAULT) -> float:
    """The busiest host's time to dispatch a step of ``plan``: one host a node, each
    dispatching the tasks of the stages with a device there (a stage across nodes: on
    each), at ``Efficiency.host_task_s`` of the stage's GPU type a task; several
    single-stage pipelines add one program combining them."""
    busy: dict = {}
    for pipe in plan.pipelines:
        per_stage = dispatched_tasks(pipe) / len(pipe.stages)
        for st in pipe.stages:
            cost = per_stage * cal.for_type(st.gpu).host_task_s
            for node in {(cluster.slot(d).group, cluster.slot(d).node) for d in st.devices}:
                busy[node] = busy.get(node, 0.0) + cost
    if len(plan.pipelines) > 1 and all(len(p.stages) == 1 for p in plan.pipelines):
        first = plan.pipelines[0].stages[0]
        node = (cluster.slot(first.devices[0]).group, cluster.slot(first.devices[0]).node)
        busy[node] = busy.get(node, 0.0) + cal.for_type(first.gpu).host_task_s
    return max(busy.values(), default=0.0)


def _tied_transfers(pipe, costs, names: dict, profile: ModelProfile, cluster: Cluster,
                    cal: Calibration) -> list[tuple[int, int, float]]:
    """(reader stage, owner stage, seconds) for every stage holding a read copy of a
    weight another stage of the pipeline owns (a tied embedding read by the head): its
    gradient goes to the owner after the last backward, the updated weight comes back
    after the owner's update (Megatron-LM all-reduces the embedding's gradient between
    the first and the last stage)."""
    out = []
    for s, (st, c) in enumerate(zip(pipe.stages, costs, strict=True)):
        by_owner: dict[int, float] = {}
        for owner_name, nbytes in c.read_copies:
            layer = names.get(owner_name)
            owner = next((j for j, o in enumerate(pipe.stages)
                          if layer is not None and o.start <= layer < o.end), None)
            if owner is not None and owner != s:
                by_owner[owner] = by_owner.get(owner, 0.0) + nbytes
        for owner, nbytes in by_owner.items():
            # Each tensor rank sends its shard; the stage's devices send in parallel.
            total = nbytes * st.axis("tensor")
            out.append((s, owner, p2p_time(total, cluster, st.devices,
                                           pipe.stages[owner].devices, cal)))
    return out


def sync_buckets(profile: ModelProfile, start: int, end: int,
                 total: float) -> list[tuple[int, float, int]]:
    """The collectives of the gradient sync of layers ``[start, end)``, ``total`` bytes
    a device: per layer, last layer first (the order the backward produces them), in
    proportion to the layers' parameters, combined as XLA combines them
    (``hetshard.cost.comm.buckets``), as runs ``(the piece that completes them, bytes
    each, how many)``: a layer above the combine threshold is hundreds of equal
    collectives (a mixture of experts' layer of gigabytes), priced once."""
    size = [max(layer.param_bytes, 0.0) for layer in profile.layers[start:end]]
    whole = sum(size)
    runs: list[tuple[int, float, int]] = []
    for k, b in buckets([total] if whole <= 0 else
                        [total * b / whole for b in reversed(size)]):
        if runs and runs[-1][:2] == (k, b):
            runs[-1] = (k, b, runs[-1][2] + 1)
        else:
            runs.append((k, b, 1))
    return runs


def sync_time(kind: str, profile: ModelProfile, start: int, end: int, total: float,
              topo: Topology, cal: Calibration, gpu_name: str, rings: int = 1) -> float:
    """The gradient sync of layers ``[start, end)`` (``total`` bytes a device; ``kind``:
    "all_reduce" or, sharded state, "reduce_scatter") over ``topo``, not overlapped: one
    collective per bucket (``sync_buckets``), as the simulator prices a stage's sync.
    The per-batch planner (``hetshard.data``) prices its groups' syncs with it."""
    return _run_sum((collective_time(kind, b, topo, cal, gpu_name, rings), m)
                    for _, b, m in sync_buckets(profile, start, end, total))


def _run_sum(runs) -> float:
    """The sum of ``(value, count)`` runs, added one by one as ``sum`` adds the pieces
    they stand for (the same float, whatever the count: a plan's price does not move by
    a rounding when its pieces are grouped)."""
    return sum(itertools.chain.from_iterable(itertools.repeat(v, m) for v, m in runs))


def _streamed_sync(profile: ModelProfile, stage, starts, ends, free: float, pieces,
                   price) -> float:
    """When a stage's overlapped gradient sync ends: its last backward produces the
    layers' gradients last layer first, each holder's at its share of the backward's
    compute (the layers' flops), and each bucket of them (``pieces``: ``sync_buckets``'
    runs, (the layer, last first, that completes them; bytes each; how many)) crosses the
    network, ``price(bytes)`` seconds, once every holder has it and the buckets before
    it have crossed (a run of ``m`` equal buckets, ``sync_buckets``, back to back). So
    only the backward that runs after a bucket is ready hides it: the first layers' sync
    (the last gradients produced, often the embedding's) is exposed after the backward
    ends."""
    layers = profile.layers[stage.start:stage.end]
    work = [max(layer.flops(1), 0.0) for layer in reversed(layers)]
    total_work = sum(work)
    if not any(layer.param_bytes > 0 for layer in layers):
        work, total_work = [], 0.0  # one piece: ready when the backward ends
    done, acc = [], 0.0
    for w in work:
        acc += w / total_work if total_work > 0 else 1.0 / len(work)
        done.append(min(acc, 1.0))
    t = free
    for k, nbytes, m in pieces:
        frac = done[k] if k < len(done) else 1.0
        ready = max(a + (b - a) * frac for a, b in zip(starts, ends, strict=True))
        cost = price(nbytes)
        t = max(t, ready) + cost
        for _ in range(m - 1):  # (added one by one: see _run_sum)
            t += cost
    return t


def _capacity(cluster: Cluster, device: int) -> float:
    return cluster.gpu_of(device).memory_bytes


def _sync_partners(plan: Plan, pi: int, stage):
    """(devices, holder stages, overlap) for the replicas of this stage's layers across
    pipelines and the stage's own data axis; None when it has no replica."""
    devices = list(stage.devices)
    holders = []
    dp = data_ways(stage)
    for qi, q in enumerate(plan.pipelines):
        for qs, other in enumerate(q.stages):
            if other.start < stage.end and other.end > stage.start:
                holders.append((qi, qs))
                if qi != pi:
                    devices += list(other.devices)
    if dp <= 1 and len(holders) == 1 and stage.axis("context") <= 1:
        return None
    # One device per data and context rank: each context rank's gradients are partial
    # sums over its share of the tokens, summed (or, under ``Context.shard_state`` and
    # the distributed optimizer, reduce-scattered) over data x context, as Megatron-LM's
    # data-and-context group does; the collective runs tp-way in parallel.
    return devices[::stage.axis("tensor")], holders, plan.grad_sync_overlap


def _context_sharded(plan: Plan, stage) -> bool:
    """The stage's state is sharded over its context ranks (their gradients are
    reduce-scattered among them)."""
    return plan.context.shard_state and stage.axis("context") > 1


def annotate(plan: Plan, result: SimResult, upper_bound: float = 0.0) -> Plan:
    """``plan`` with the simulator's predictions filled in (plan-wide and per stage)."""
    pipes = []
    for pi, pipe in enumerate(plan.pipelines):
        stages = []
        for s, st in enumerate(pipe.stages):
            c = result.stage_costs[pi][s]
            stages.append(dataclasses.replace(
                st, predicted_fwd_s=c.fwd_s, predicted_bwd_s=c.bwd_s,
                predicted_memory_bytes=max(result.memory_per_device[d] for d in st.devices)))
        pipes.append(dataclasses.replace(pipe, stages=tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(pipes),
                               predicted=predicted(result, upper_bound))


def priced(plan: Plan, profile: ModelProfile, cluster: Cluster, cal: Calibration = DEFAULT,
           trace: bool = True) -> tuple[Plan, SimResult, float]:
    """``(plan with its predictions, the simulation, the cluster's upper bound in
    tokens/s)``: ``plan`` simulated on ``profile`` and ``cluster``, the bound computed
    with its attention and compute dtypes (what ``hetshard simulate`` reports and what
    ``hetshard.jit`` gives a pinned plan)."""
    result = simulate(plan, profile, cluster, cal, trace=trace)
    upper = upper_bound_tokens_per_s(profile, cluster, cal, attention=plan.attention,
                                     gpu_dtypes=plan.gpu_dtypes)
    return annotate(plan, result, upper), result, upper


def predicted(result: SimResult, upper_bound_tokens_per_s: float = 0.0) -> Predicted:
    return Predicted(step_time_s=float(result.step_time_s),
                     tokens_per_s=float(result.tokens_per_s),
                     tflops_per_gpu=float(result.tflops_per_gpu), mfu=float(result.mfu),
                     bubble_fraction=float(result.bubble_fraction),
                     peak_memory_bytes=float(result.peak_memory_bytes), fits=bool(result.fits),
                     upper_bound_tokens_per_s=float(upper_bound_tokens_per_s))


def upper_bound_tokens_per_s(profile: ModelProfile, cluster: Cluster,
                             cal: Calibration = DEFAULT, mbs: int = 8,
                             attention: str = "auto", gpu_dtypes=()) -> float:
    """Every GPU computing the whole model on its own samples with no communication,
    no bubble and no memory limit: the cluster's aggregate attainable throughput, with
    the plans' ``attention`` (the reference one's materialised scores cost more than
    the flash kernel's) and compute dtypes (``Plan.gpu_dtypes``)."""
    total = 0.0
    for g in cluster.groups:
        c = stage_cost(profile, 0, profile.num_layers, g.gpu, mbs=mbs, cal=cal,
                       attention=attention,
                       dtype=stage_dtype(g.gpu.name, profile.dtype, gpu_dtypes))
        total += g.num_devices * mbs * profile.tokens_per_sample / (c.fwd_s + c.bwd_s)
    return total
