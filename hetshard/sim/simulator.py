"""Event-driven simulation of one training step of a :class:`~hetshard.plan.Plan`.

Each pipeline submesh is a worker that runs forward (F) and backward (B)
micro-batch tasks of its stages in its schedule's order (GPipe: all F then all B;
1F1B: ``p - s - 1`` warm-up forwards, then one F / one B, then the cool-down Bs;
interleaved 1F1B when a submesh holds several stages, see ``worker_order``).
A task starts when its worker is free and its input has arrived: F(s, i) needs
F(s-1, i) plus the activation's point-to-point transfer; B(s, i) needs
B(s+1, i) plus the cotangent's transfer, and F(s, i). Transfers are delays on
the link between the two stages (links are not modelled as contended).
After its last backward, a stage synchronises gradients with the stages that
hold the same layers (``plan.grad_sync``), then runs the optimizer update; with
``overlap``, synchronisation starts as the last backward starts, as DDP-style
bucketing does. Step time is the latest finish over all stages.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.comm import collective_time, p2p_time, topology
from hetshard.cost.profile import ModelProfile
from hetshard.cost.stage import StageCost, stage_cost
from hetshard.plan import Plan, Predicted


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

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
                "bubble_fraction": self.bubble_fraction,
                "peak_memory_bytes": self.peak_memory_bytes, "fits": self.fits}


def worker_order(schedule: str, p: int, w: int, m: int, v: int = 1,
                 extra: tuple[int, ...] = ()) -> list[tuple[str, int, int]]:
    """``(kind, stage, micro_batch)`` in the order submesh ``w`` of ``p`` runs its tasks
    when each submesh holds ``v`` stages (stage ``c * p + w`` is its c-th).

    GPipe: every forward, then every backward. 1F1B with ``v = 1``: ``p - w - 1``
    warm-up forwards, then one forward / one backward, then the cool-down backwards.
    Interleaved 1F1B (``v > 1``, Megatron-LM's schedule; ``m`` a multiple of ``p``):
    forwards go through the submesh's stages in groups of ``p`` micro-batches (stage
    ``w`` for micro-batches 0..p-1, then stage ``p + w`` for the same ones, ...),
    backwards likewise from the last stage down, with ``2 (p - w - 1) + (v - 1) p``
    warm-up forwards. Under 1F1B ``extra[w]`` more warm-up forwards on submesh w keep
    more micro-batches in flight, so that transfers slower than compute no longer stall
    the loop each micro-batch makes from w to the last stage and back, for their
    activations' memory (warm-up counts must not grow along the pipeline).
    """
    n_tasks = m * v

    def task(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        if backward:
            chunk = v - 1 - chunk
        return chunk * p + w, group * p + within % p

    if v == 1:
        fwds = [(w, i) for i in range(m)]
        bwds = fwds
        warm = min(p - w - 1 + (extra[w] if extra else 0), m)
    else:
        fwds = [task(k, False) for k in range(n_tasks)]
        bwds = [task(k, True) for k in range(n_tasks)]
        warm = min(2 * (p - w - 1) + (v - 1) * p + (extra[w] if extra else 0), n_tasks)
    if schedule == "gpipe":
        return [("F", *t) for t in fwds] + [("B", *t) for t in bwds]
    order = [("F", *t) for t in fwds[:warm]]
    f, b = warm, 0
    while f < n_tasks:
        order += [("F", *fwds[f]), ("B", *bwds[b])]
        f += 1
        b += 1
    order += [("B", *t) for t in bwds[b:]]
    return order


def schedule_order(schedule: str, p: int, s: int, m: int) -> list[tuple[str, int]]:
    """The order in which stage ``s`` of ``p`` (one stage per submesh) runs its ``m``
    micro-batches."""
    return [(kind, i) for kind, _, i in worker_order(schedule, p, s, m)]


def inflight(schedule: str, p: int, s: int, m: int, extra: tuple[int, ...] = ()) -> int:
    """Micro-batches whose activations stage ``s`` holds at once (one stage per submesh)."""
    return m if schedule == "gpipe" else min(p - s + (extra[s] if extra else 0), m)


def schedule_walk(schedule: str, n: int, m: int, v: int = 1, extra: tuple[int, ...] = ()):
    """Yields ``(stage, "F"|"B", micro_batch)`` for every task of one pipeline of ``n``
    stages on ``n / v`` submeshes, each submesh in its ``worker_order`` and every task after
    those it depends on (its forward input, or the next stage's backward). The simulator
    prices tasks in this order and the runtime dispatches them in it (every process the
    same)."""
    yield from _walk(schedule, n, m, v, extra)


@functools.lru_cache(maxsize=64)
def _walk(schedule: str, n: int, m: int, v: int,
          extra: tuple[int, ...] = ()) -> tuple[tuple[int, str, int], ...]:
    p = n // v
    orders = [worker_order(schedule, p, w, m, v, extra) for w in range(p)]
    ptr, out = [0] * p, []
    f_done = [[False] * m for _ in range(n)]
    b_done = [[False] * m for _ in range(n)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for w in range(p):
            order = orders[w]
            while ptr[w] < len(order):
                kind, s, i = order[ptr[w]]
                if kind == "F":
                    if s and not f_done[s - 1][i]:
                        break
                    f_done[s][i] = True
                else:
                    if not f_done[s][i] or (s < n - 1 and not b_done[s + 1][i]):
                        break
                    b_done[s][i] = True
                out.append((s, kind, i))
                ptr[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the schedules above
            raise RuntimeError(f"pipeline schedule deadlocked at {ptr}")
    return tuple(out)


def run_pipeline(fwd_s, bwd_s, sends_s, m: int, schedule: str, v: int = 1,
                 extra: tuple[int, ...] = ()):
    """Runs one pipeline's micro-batches; returns (events, per-submesh finish times).

    ``fwd_s[s]``/``bwd_s[s]``: one micro-batch's forward/backward time on stage s;
    ``sends_s[s]``: transfer time between stage s and s+1 (both directions); stage s runs
    on submesh ``s mod (len(fwd_s) / v)``, one task at a time.
    Events are ``(stage, "F"|"B", micro_batch, start_s, end_s)``.
    """
    events, free, _ = _run(fwd_s, bwd_s, sends_s, m, schedule, v, True, extra)
    return events, free


def _run(fwd_s, bwd_s, sends_s, m: int, schedule: str, v: int, record: bool,
         extra: tuple[int, ...] = ()):
    """``run_pipeline`` plus each stage's last backward (start, end); events only when
    ``record`` (the planner prices thousands of plans and needs only the times)."""
    n = len(fwd_s)
    p = n // v
    f_end = [[0.0] * m for _ in range(n)]
    b_end = [[0.0] * m for _ in range(n)]
    last_b = [(0.0, 0.0)] * n
    free, events = [0.0] * p, []
    for s, kind, i in _walk(schedule, n, m, v, extra):
        w = s % p
        if kind == "F":
            ready = f_end[s - 1][i] + sends_s[s - 1] if s else 0.0
            start = free[w] if free[w] > ready else ready
            end = f_end[s][i] = free[w] = start + fwd_s[s]
        else:
            own = f_end[s][i]
            ready = own if s == n - 1 else max(own, b_end[s + 1][i] + sends_s[s])
            start = free[w] if free[w] > ready else ready
            end = b_end[s][i] = free[w] = start + bwd_s[s]
            last_b[s] = (start, end)
        if record:
            events.append((s, kind, i, start, end))
    return events, free, last_b


def steady_period(times, sends, extra=()) -> float:
    """The steady-state time per micro-batch of a 1F1B pipeline (one stage per submesh):
    ``times[s]`` a micro-batch's forward + backward on stage s, ``sends[s]`` the transfer
    between s and s+1, ``extra[s]`` its extra warm-up forwards.

    The schedule is a timed event graph whose period is its maximum cycle mean. Its
    cycles run from a stage s down the forwards to a stage q, turn back through q's
    backward and up the backwards to s, where the next forward of s waits for that
    backward: weight ``sum(times[s..q]) + 2 sum(sends[s..q-1])``, spanning ``q - s + 1 +
    e_s - e_q`` micro-batches (the warm-up difference). With q = s it is the stage's own
    time; with q the last stage, 1F1B's familiar round-trip bound. A slow link between
    two stages can bind on its own: only a larger warm-up before it than after it helps.
    """
    t = np.asarray(times, dtype=float)
    p = len(t)
    if p == 1:
        return float(t[0])
    e = np.asarray(extra if len(extra) else np.zeros(p), dtype=float)
    ct = np.concatenate([[0.0], np.cumsum(t)])
    cs = np.concatenate([[0.0], np.cumsum(np.asarray(sends, dtype=float))])
    s, q = np.triu_indices(p)
    weight = ct[q + 1] - ct[s] + 2 * (cs[q] - cs[s])
    span = q - s + 1 + e[s] - e[q]
    return float(np.max(weight / span))


def best_warmup(times, sends, rooms) -> tuple[float, tuple[int, ...]]:
    """(period, extra warm-up per stage) minimising ``steady_period`` with at most
    ``rooms[s]`` extra micro-batches in flight on stage s and warm-up forwards
    (``p - s - 1 + e_s``) never growing along the pipeline. For a target period the
    least warm-ups follow from the last stage back (every cycle is a difference
    constraint ``e_s - e_q >= weight / period - (q - s + 1)``); the period is bisected."""
    t = np.asarray(times, dtype=float)
    p = len(t)
    if p == 1:
        return float(t[0]), ()
    ct = np.concatenate([[0.0], np.cumsum(t)])
    cs = np.concatenate([[0.0], np.cumsum(np.asarray(sends, dtype=float))])
    idx = np.arange(p)

    def least(period: float):
        e = np.zeros(p)
        for s in range(p - 2, -1, -1):
            q = idx[s + 1:]
            w = ct[q + 1] - ct[s] + 2 * (cs[q] - cs[s])
            need = np.ceil(w / period - (q - s + 1) - 1e-9) + e[q]
            e[s] = max(0.0, e[s + 1] - 1, need.max())
            if e[s] > rooms[s]:
                return None
        return e

    # e = 0 reaches steady_period(t, sends); the slowest stage's time bounds from below.
    lo, hi = float(t.max()), steady_period(t, sends)
    e = least(lo)
    if e is None:
        while hi - lo > 1e-6 * hi:  # least(lo) infeasible, least(hi) feasible
            mid = (lo + hi) / 2
            if least(mid) is None:
                lo = mid
            else:
                hi = mid
        e = least(hi)
    return steady_period(t, sends, e), tuple(int(x) for x in e) if e.any() else ()


def worker_memory(schedule: str, p: int, w: int, m: int, v: int, costs,
                  extra: tuple[int, ...] = ()) -> float:
    """Peak bytes per device of submesh ``w``: its stages' static memory, the activations
    its schedule keeps in flight at the worst moment, and the largest working set.
    ``costs[s]`` is stage s's StageCost."""
    if v == 1:
        return costs[w].peak_memory(inflight(schedule, p, w, m, extra))
    live = peak = 0.0
    for kind, s, _ in worker_order(schedule, p, w, m, v, extra):
        live += costs[s].memory_per_microbatch_bytes * (1 if kind == "F" else -1)
        peak = max(peak, live)
    mine = costs[w::p]
    return (sum(c.memory_static_bytes for c in mine) + peak +
            max(c.memory_working_bytes for c in mine))


def stage_costs_for(plan: Plan, profile: ModelProfile, cluster: Cluster,
                    cal: Calibration, cache: dict | None = None) -> list[list[StageCost]]:
    """Every stage's cost; ``cache`` (a dict the caller keeps for one profile, cluster and
    calibration) reuses stages priced before, as a planner's neighbouring plans share
    most of theirs."""
    out = []
    for pipe in plan.pipelines:
        costs = []
        for st in pipe.stages:
            fsdp = plan.fsdp or st.axis("fsdp") > 1
            key = (st.start, st.end, st.devices, st.mesh_shape, st.remat, fsdp,
                   pipe.micro_batch_size, plan.attention)
            if cache is not None and key in cache:
                costs.append(cache[key])
                continue
            cost = layers_cost(st, st.start, st.end, pipe.micro_batch_size, fsdp,
                               plan.attention, profile, cluster, cal)
            if cache is not None:
                cache[key] = cost
            costs.append(cost)
        out.append(costs)
    return out


def layers_cost(st, start: int, end: int, mbs: int, fsdp: bool, attention: str,
                profile: ModelProfile, cluster: Cluster, cal: Calibration) -> StageCost:
    """Layers ``[start, end)`` priced on stage ``st``'s submesh (its devices, mesh, remat)."""
    gpu = _slowest(cluster, st.devices)
    tp, cp = st.axis("tensor"), st.axis("context")
    dp = st.axis("data") * st.axis("fsdp")
    devs = list(st.devices)
    # Device order inside a stage: data-major, then context, then tensor (innermost).
    tp_topo = topology(cluster, devs[:tp]) if tp > 1 else None
    cp_topo = topology(cluster, devs[:tp * cp:tp]) if cp > 1 else None
    dp_topo = topology(cluster, devs[::tp * cp]) if dp > 1 else None
    return stage_cost(profile, start, end, gpu, tp=tp, cp=cp, dp=dp, fsdp=fsdp, mbs=mbs,
                      remat=st.remat, attention=attention, cal=cal, tp_topo=tp_topo,
                      cp_topo=cp_topo, dp_topo=dp_topo)


def _sends(pipe, profile: ModelProfile, cluster: Cluster, cal: Calibration) -> list[float]:
    """Transfer time of one micro-batch's activations between each stage and the next."""
    out = []
    for a, b in zip(pipe.stages, pipe.stages[1:], strict=False):
        nbytes = profile.layers[a.end - 1].boundary_bytes_per_sample * \
            pipe.micro_batch_size * a.axis("data") * a.axis("fsdp")
        out.append(p2p_time(nbytes, cluster, a.devices, b.devices, cal))
    return out


def capped_warmup(extra, m: int) -> tuple[int, ...]:
    """``extra`` warm-up with no stage warming up beyond its ``m`` micro-batches (more
    changes nothing), () when none is left: one canonical plan per schedule."""
    p = len(extra)
    out = tuple(min(e, max(0, m - (p - s))) for s, e in enumerate(extra))
    return out if any(out) else ()


def tune_warmup(plan: Plan, profile: ModelProfile, cluster: Cluster,
                cal: Calibration = DEFAULT, *, margin: float = 0.0,
                cache: dict | None = None) -> Plan:
    """``plan`` with every 1F1B pipeline of one stage per submesh given the extra warm-up
    that minimises its steady-state period (``best_warmup``) within each GPU's memory
    (less ``margin``); other pipelines unchanged."""
    costs = stage_costs_for(plan, profile, cluster, cal, cache)
    pipes = []
    for pipe, cs in zip(plan.pipelines, costs, strict=True):
        p = len(pipe.stages)
        if pipe.schedule != "1f1b" or pipe.virtual_stages != 1 or p < 2:
            pipes.append(pipe)
            continue
        rooms = []
        for s, (st, c) in enumerate(zip(pipe.stages, cs, strict=True)):
            cap = min(_capacity(cluster, d) for d in st.devices) * (1 - margin)
            free = cap - c.memory_static_bytes - c.memory_working_bytes
            per = c.memory_per_microbatch_bytes
            rooms.append(max(0, int(free // per) - (p - s)) if per > 0 else 1 << 20)
        _, extra = best_warmup([c.fwd_s + c.bwd_s for c in cs],
                               _sends(pipe, profile, cluster, cal), rooms)
        pipes.append(dataclasses.replace(
            pipe, extra_warmup=capped_warmup(extra, pipe.num_micro_batches)))
    return dataclasses.replace(plan, pipelines=tuple(pipes))


def _slowest(cluster: Cluster, devices) -> object:
    """The GPU type that paces an SPMD program over ``devices`` (the slowest one)."""
    types = {cluster.gpu_of(d).name: cluster.gpu_of(d) for d in devices}
    return min(types.values(), key=lambda t: (t.peak_flops(), t.memory_gbs))


def simulate(plan: Plan, profile: ModelProfile, cluster: Cluster,
             cal: Calibration = DEFAULT, *, trace: bool = True,
             cache: dict | None = None) -> SimResult:
    """Simulates one step of ``plan``; see the module docstring for the model. With
    ``trace=False`` the result's ``tasks`` are left empty, and ``cache`` keeps stage costs
    between calls on the same profile, cluster and calibration (the planner's use)."""
    costs = stage_costs_for(plan, profile, cluster, cal, cache)
    tasks: list[Task] = []
    stage_end: dict[tuple[int, int], float] = {}
    last_b_start: dict[tuple[int, int], float] = {}
    last_b_end: dict[tuple[int, int], float] = {}
    busy: dict[int, float] = {}
    mem: dict[int, float] = {}
    for pi, pipe in enumerate(plan.pipelines):
        n, m, v = len(pipe.stages), pipe.num_micro_batches, pipe.virtual_stages
        p = n // v
        act = costs[pi]
        sends = _sends(pipe, profile, cluster, cal)
        events, free, last_b = _run([c.fwd_s for c in act], [c.bwd_s for c in act], sends, m,
                                    pipe.schedule, v, trace, pipe.extra_warmup)
        tasks += [Task(pi, s_, kind, i, start, end, s_ % p)
                  for s_, kind, i, start, end in events]
        for s_, (start, end) in enumerate(last_b):
            last_b_start[(pi, s_)], last_b_end[(pi, s_)] = start, end
        for w in range(p):
            peak = worker_memory(pipe.schedule, p, w, m, v, act, pipe.extra_warmup)
            work = m * sum(c.fwd_s + c.bwd_s for c in act[w::p])
            for d in pipe.stages[w].devices:
                busy[d] = work
                mem[d] = peak
            for s in range(w, n, p):
                stage_end[(pi, s)] = last_b_end[(pi, s)]
    # Gradient synchronisation and optimizer step per stage. Stages sharing a submesh
    # (interleaved) take its network one synchronisation at a time and its GPUs for the
    # optimizer once their compute is done.
    step_end = 0.0
    for pi, pipe in enumerate(plan.pipelines):
        p = pipe.num_workers
        net_free = [0.0] * p
        gpu_free = [max(stage_end[(pi, s)] for s in range(w, len(pipe.stages), p))
                    for w in range(p)]
        for s, st in enumerate(pipe.stages):
            c, w = costs[pi][s], s % p
            partners = _sync_partners(plan, pi, st)
            if partners:
                devices, holders, overlap = partners
                topo = topology(cluster, devices)
                kind = "reduce_scatter" if (plan.fsdp or st.axis("fsdp") > 1) else "all_reduce"
                t_sync = collective_time(kind, c.grad_sync_bytes, topo, cal,
                                         _slowest(cluster, devices).name)
                # Gradients are complete once every holder finished its last backward;
                # with overlap, buckets start streaming when the last backward starts.
                ends = [stage_end[k] for k in holders]
                starts = [last_b_start.get(k, 0.0) for k in holders]
                sync_ready = max(max(starts) if overlap else max(ends), net_free[w])
                sync_end = max(sync_ready + t_sync, stage_end[(pi, s)])
                net_free[w] = sync_end
                if trace:
                    tasks.append(Task(pi, s, "sync", -1, sync_end - t_sync, sync_end, w))
            else:
                sync_end = stage_end[(pi, s)]
            opt_start = max(sync_end, gpu_free[w])
            gpu_free[w] = opt_end = opt_start + c.optimizer_s
            if trace:
                tasks.append(Task(pi, s, "opt", -1, opt_start, opt_end, w))
            step_end = max(step_end, opt_end)
    n_dev = plan.num_devices
    model_flops = profile.flops_per_sample() * plan.global_batch
    tokens = plan.global_batch * plan.seq_len
    peak = cluster.peak_flops(plan.dtype)  # the whole cluster, idle GPUs included
    capacity = {d: _capacity(cluster, d) for d in mem}
    fits = all(mem[d] <= capacity[d] for d in mem)
    bubble = 1.0 - sum(busy.values()) / (n_dev * step_end) if step_end else 0.0
    return SimResult(
        step_time_s=float(step_end), tokens_per_s=float(tokens / step_end),
        tflops_per_gpu=float(model_flops / step_end / n_dev / 1e12),
        mfu=float(model_flops / step_end / peak), bubble_fraction=float(bubble),
        peak_memory_bytes=float(max(mem.values())),
        memory_per_device={d: float(v) for d, v in mem.items()}, busy_per_device=busy,
        fits=bool(fits), tasks=tuple(tasks), stage_costs=tuple(tuple(c) for c in costs))


def _capacity(cluster: Cluster, device: int) -> float:
    return cluster.gpu_of(device).memory_bytes


def _sync_partners(plan: Plan, pi: int, stage):
    """(devices, holder stages, overlap) for the replicas of this stage's layers across
    pipelines and the stage's own data axis; None when it has no replica."""
    devices = list(stage.devices)
    holders = []
    dp = stage.axis("data") * stage.axis("fsdp")
    for qi, q in enumerate(plan.pipelines):
        for qs, other in enumerate(q.stages):
            if other.start < stage.end and other.end > stage.start:
                holders.append((qi, qs))
                if qi != pi:
                    devices += list(other.devices)
    if dp <= 1 and len(holders) == 1:
        return None
    overlap = all(g.overlap for g in plan.grad_sync) if plan.grad_sync else True
    tp_cp = stage.axis("tensor") * stage.axis("context")
    # One representative device per replica: the collective runs tp*cp-way in parallel.
    return devices[::tp_cp], holders, overlap


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


def predicted(result: SimResult, upper_bound_tokens_per_s: float = 0.0) -> Predicted:
    return Predicted(step_time_s=float(result.step_time_s),
                     tokens_per_s=float(result.tokens_per_s),
                     tflops_per_gpu=float(result.tflops_per_gpu), mfu=float(result.mfu),
                     bubble_fraction=float(result.bubble_fraction),
                     peak_memory_bytes=float(result.peak_memory_bytes), fits=bool(result.fits),
                     upper_bound_tokens_per_s=float(upper_bound_tokens_per_s))


def upper_bound_tokens_per_s(profile: ModelProfile, cluster: Cluster,
                             cal: Calibration = DEFAULT, mbs: int = 8) -> float:
    """Every GPU computing the whole model on its own samples with no communication,
    no bubble and no memory limit: the cluster's aggregate attainable throughput."""
    total = 0.0
    for g in cluster.groups:
        c = stage_cost(profile, 0, profile.num_layers, g.gpu, mbs=mbs, cal=cal)
        total += g.num_devices * mbs * profile.tokens_per_sample / (c.fwd_s + c.bwd_s)
    return total
