"""Per-batch plans on a pipeline outer plan: which samples each pipeline takes, how they
are packed into rows, which rows make each micro-batch and in what order the
micro-batches enter the pipeline, for one global batch of variable-length samples.

The outer plan is fixed (the static planner's ``Plan``: pipelines of stages, each stage
one GPU type on its own devices with its share of the layers, its data ways splitting
a micro-batch's rows). A micro-batch holds ``PipelineCost.tokens`` token slots: rows of
one bucket, ``tokens // bucket`` of them (the compiled shapes are one per bucket). A row
is split over a stage's data ways: a micro-batch of ``r`` rows on ``w`` ways gives each way
``r / w`` consecutive rows, or, with fewer rows than ways, each row ``w / r`` ways as a
context ring (``hetshard.kernels.ring_attention``), its K/V transfers exposed where the
row's attention does not hide them.

What a micro-batch costs differs by stage, and not in one proportion: a stage's linear
work is the same for every micro-batch of a bucket (its token slots), its attention
follows the squared lengths of the documents in its rows, and the stages' GPU types do
not price attention and matmuls alike (an older GPU's attention is slower relative to
its matmuls). So the bottleneck stage moves from micro-batch to micro-batch, and a
one-forward-one-backward pipeline's bubbles depend on which micro-batches follow which.
Per batch this module decides:

* **placement** over the plan's pipelines (longest processing time first on each
  pipeline's bottleneck-stage estimate, re-run with the priced-to-estimated ratios, as
  ``hetshard.data.planner`` places on groups);
* **packing** per pipeline, best-fit decreasing into the buckets, a bucket's last
  part-empty micro-batch's rows merged up into the next bucket where that prices faster;
* **micro-batch composition**: a bucket's rows dealt longest-processing-time first into
  ``(micro-batches x widest stage's ways)`` bins of equal row count (every way of every
  stage gets rows of like attention work, and so does every micro-batch);
* **order**: the micro-batches' order, priced by the exact one-forward-one-backward
  walk (``hetshard.sim.schedule.time_varied``): every order for up to
  ``EXACT_ORDER`` micro-batches, else the best of four (as packed, heaviest first,
  lightest first, alternating the stages they weigh on) improved by adjacent swaps.

The result is a ``BatchPlan`` (one ``GroupPlan`` per pipeline, its micro-batches in the
order they run) with a lower bound: fractional placement of the samples over the
pipelines where every stage does every sample's tokens and attention, no padding, no
ring, no fill or drain (exact for one pipeline, OR-tools' GLOP for more).
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import itertools
import time
from collections.abc import Sequence

import numpy as np

from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.comm import collective_time, p2p_time, topology
from hetshard.cost.profile import ModelProfile
from hetshard.data.packing import (
    Packing,
    Row,
    best_fit,
    check_buckets,
    check_lengths,
    geometric_buckets,
    sequential,
)
from hetshard.data.planner import (
    METHODS,
    BatchPlan,
    GroupCost,
    GroupPlan,
    MicroStep,
    _fill_steps,
    _lpt,
)
from hetshard.errors import SpecError
from hetshard.plan import Plan, data_ways
from hetshard.sim.schedule import time_varied
from hetshard.sim.simulator import layers_cost, priced_dtype

# Up to this many micro-batches a pipeline, every order is priced (5! = 120 walks).
EXACT_ORDER = 5


@dataclasses.dataclass(frozen=True)
class StageRate:
    """What one stage of a pipeline spends, per data way (``tensor x context`` devices
    of it): ``token_*_s`` per token slot (everything but attention's scores), and
    ``attention_*_s`` per squared token of causal attention, forward and backward;
    ``kv_bytes_per_token`` per layer (what a context ring passes), ``send_bytes_per_token``
    the activations it sends the next stage (0: the last), ``step_s`` its update and
    gradient sync per step."""

    gpu: str
    devices: tuple[int, ...]
    start: int
    end: int
    ways: int
    token_fwd_s: float
    token_bwd_s: float
    attention_fwd_s: float
    attention_bwd_s: float
    kv_bytes_per_token: float
    send_bytes_per_token: float
    step_s: float

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """One pipeline of the outer plan: its stages in order, ``tokens`` token slots a
    micro-batch (rows of one of ``buckets``)."""

    name: str
    stages: tuple[StageRate, ...]
    tokens: int
    buckets: tuple[int, ...]

    def rows(self, bucket: int) -> int:
        """Rows of ``bucket`` a micro-batch holds."""
        return max(1, self.tokens // bucket)

    @property
    def step_s(self) -> float:
        return max(s.step_s for s in self.stages)

    @property
    def widest(self) -> int:
        return max(s.ways for s in self.stages)


def pipeline_costs(profile: ModelProfile, cluster: Cluster, plan: Plan, *, max_context: int,
                   cal: Calibration = DEFAULT, tokens: int | None = None,
                   buckets: Sequence[int] | None = None, max_buckets: int = 4,
                   memory_margin: float = 0.9) -> tuple[PipelineCost, ...]:
    """One :class:`PipelineCost` per pipeline of ``plan`` (an outer plan over ``profile``'s
    layers on ``cluster``), each stage priced by the simulator's own stage cost
    (``hetshard.sim.simulator.layers_cost``: its mesh, remat, dtype) at the profile's
    sequence length, split into its linear and attention parts. ``tokens``: token slots a
    micro-batch (default: ``max_context``, or the profile's length times the widest
    stage's ways where that is more: every way gets at least one sequence's slots);
    ``buckets``: row lengths (powers of two, the largest ``max_context``; default
    ``geometric_buckets`` from the profile's length, at most ``max_buckets``).

    Raises:
      SpecError: ``max_context`` not a power of two at least the profile's length,
        ``tokens`` not a power of two at least ``max_context``, ``buckets`` outside the
        above, a stage whose devices do not hold the micro-batches its one-forward-
        one-backward schedule keeps in flight (within ``memory_margin``).
    """
    seq = profile.seq_len
    if max_context < seq or max_context & (max_context - 1):
        raise SpecError("max_context", max_context,
                        f"a power of two at least the profile's sequence length {seq}")
    widest = max(data_ways(st) for p in plan.pipelines for st in p.stages)
    default = max(max_context, seq * widest)
    tokens = default if tokens is None else tokens
    if (isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer))
            or tokens < max_context or tokens & (tokens - 1)):
        raise SpecError("tokens", tokens,
                        f"a power of two at least max_context={max_context}")
    tokens = int(tokens)
    if buckets is None:
        buckets = geometric_buckets(seq, max_context, max_buckets)
    else:
        b = check_buckets(buckets) if all(isinstance(x, (int, np.integer))
                                          and not isinstance(x, bool) for x in buckets) \
            else ()
        if not b or b[-1] != max_context or any(x & (x - 1) for x in b):
            raise SpecError("buckets", list(buckets),
                            f"powers of two, the largest max_context={max_context}")
        buckets = b
    out = []
    for pi, pipe in enumerate(plan.pipelines):
        stages = []
        n = len(pipe.stages)
        for j, st in enumerate(pipe.stages):
            fsdp = plan.fsdp or st.axis("fsdp") > 1
            c = layers_cost(st, st.start, st.end, 1, fsdp, plan.attention, profile, cluster,
                            cal, plan.distributed_optimizer, plan.tp_overlap,
                            priced_dtype(plan, profile, st), ())
            ways = data_ways(st)
            # In flight on stage j under 1F1B: n - j micro-batches, each tokens / ways
            # slots a way (the cost is priced at one sequence a way).
            per = c.memory_per_microbatch_bytes * max(1.0, tokens / ways / seq)
            cap = memory_margin * min(cluster.gpu_of(d).memory_bytes for d in st.devices)
            if c.memory_static_bytes + (n - j) * per + c.memory_working_bytes > cap:
                raise SpecError("tokens", tokens,
                                f"micro-batches stage {j} of pipeline {pi} ({ways} ways "
                                f"on {st.gpu}, remat {st.remat!r}) holds {n - j} of in "
                                f"flight; fewer token slots or a plan with more ways there")
            layer = profile.layers[(st.start + st.end) // 2]
            # The gradient sync joins the stage's data ways and the same stage of the
            # other pipelines.
            peers = [d for p in plan.pipelines if len(p.stages) == n
                     for d in p.stages[j].devices[::st.axis("tensor") * st.axis("context")]]
            sync = collective_time("reduce_scatter" if fsdp else "all_reduce",
                                   c.grad_sync_bytes, topology(cluster, peers), cal,
                                   st.gpu) if len(peers) > 1 else 0.0
            send = (profile.layers[st.end - 1].boundary_bytes_per_sample / seq
                    if j < n - 1 else 0.0)
            stages.append(StageRate(
                gpu=st.gpu, devices=tuple(st.devices), start=st.start, end=st.end, ways=ways,
                token_fwd_s=(c.fwd_s - c.attention_fwd_s) / seq,
                token_bwd_s=(c.bwd_s - c.attention_bwd_s) / seq,
                attention_fwd_s=c.attention_fwd_s / seq ** 2,
                attention_bwd_s=c.attention_bwd_s / seq ** 2,
                kv_bytes_per_token=2.0 * layer.boundary_bytes_per_sample / seq,
                send_bytes_per_token=send, step_s=c.optimizer_s + c.cast_s + sync))
        out.append(PipelineCost(f"pipeline{pi}", tuple(stages), tokens, tuple(buckets)))
    return tuple(out)


def identical_pipelines(pipes: Sequence[PipelineCost]) -> tuple[PipelineCost, ...]:
    """``pipes`` as a planner made for identical GPUs believes them: every stage's rates
    per layer and device the cluster's average (weighted by devices), its layers and
    ways as they are."""
    def avg(field: str) -> float:
        num = sum(getattr(s, field) * s.ways / s.layers * len(s.devices)
                  for p in pipes for s in p.stages)
        return num / sum(len(s.devices) for p in pipes for s in p.stages)

    mean = {f: avg(f) for f in ("token_fwd_s", "token_bwd_s", "attention_fwd_s",
                                "attention_bwd_s")}
    return tuple(dataclasses.replace(p, stages=tuple(
        dataclasses.replace(s, **{f: v * s.layers / s.ways for f, v in mean.items()})
        for s in p.stages)) for p in pipes)


class _Stages:
    """Micro-batch times on one pipeline's stages (per-bucket parts computed once)."""

    def __init__(self, pc: PipelineCost, cluster: Cluster | None, cal: Calibration):
        self.pc = pc
        st = pc.stages
        self.ways = [s.ways for s in st]
        self.lin = np.array([[s.token_fwd_s, s.token_bwd_s] for s in st])
        self.att = np.array([[s.attention_fwd_s, s.attention_bwd_s] for s in st])
        self.sends = [p2p_time(a.send_bytes_per_token * pc.tokens, cluster, a.devices,
                               b.devices, cal) if cluster is not None else 0.0
                      for a, b in zip(st, st[1:], strict=False)]
        self.cluster, self.cal = cluster, cal
        self._ring: dict = {}

    def ring(self, s: int, bucket: int, c: int) -> float:
        """Seconds per layer for a ``bucket`` row's K/V to go round ``c`` ways of stage
        ``s``."""
        key = (s, bucket, c)
        got = self._ring.get(key)
        if got is None:
            st = self.pc.stages[s]
            got = 0.0
            if c > 1 and self.cluster is not None:
                per = len(st.devices) // st.ways
                got = collective_time("all_gather", st.kv_bytes_per_token * bucket,
                                      topology(self.cluster, st.devices[:c * per:per]),
                                      self.cal, st.gpu)
            self._ring[key] = got
        return got

    def times(self, bucket: int, squares: np.ndarray) -> np.ndarray:
        """[stages, 2] forward and backward seconds of a micro-batch of ``bucket`` rows
        whose squared document lengths sum to ``squares`` row by row, in order (rows
        missing from the micro-batch are padding)."""
        r = self.pc.rows(bucket)
        sq = np.zeros(r)
        sq[:squares.size] = squares
        out = np.empty((len(self.ways), 2))
        for s, w in enumerate(self.ways):
            if r >= w:
                per = r // w if r % w == 0 else -(-r // w)
                part = np.zeros(per * w)
                part[:r] = sq
                most = part.reshape(w, per).sum(axis=1).max()
                out[s] = self.lin[s] * bucket * per + self.att[s] * most
            else:
                c = w // r
                attn = self.att[s] * sq.max() / c
                t = self.lin[s] * bucket / c + attn
                ring = self.pc.stages[s].layers * self.ring(s, bucket, c)
                # the forward's one pass and the backward's two, where attention does
                # not hide them
                t[0] += max(0.0, ring - attn[0])
                t[1] += 2 * max(0.0, ring - attn[1] / 2)
                out[s] = t
        return out

    def walk(self, times: Sequence[np.ndarray]) -> float:
        """The one-forward-one-backward finish time of micro-batches ``times`` (each
        :meth:`times`' result), in order, plus the step's update."""
        return self.walk_lists([t.T.tolist() for t in times])

    def walk_lists(self, times: Sequence[list]) -> float:
        """:meth:`walk` of micro-batches given as ``[forwards, backwards]`` lists by
        stage (what the order search prices many times)."""
        if not times:
            return self.pc.step_s
        m = len(times)
        fwd = [[t[0][s] for t in times] for s in range(len(self.ways))]
        bwd = [[t[1][s] for t in times] for s in range(len(self.ways))]
        sends = [[x] * m for x in self.sends]
        return time_varied(fwd, bwd, sends) + self.pc.step_s


# A micro-batch while planning: (bucket, its rows' indices in the packing, in order)
_Batch = tuple[int, np.ndarray]


def _squares(p: Packing) -> np.ndarray:
    out = np.zeros(p.counts.size)
    filled = p.counts > 0
    out[filled] = np.add.reduceat(p.lengths.astype(np.float64) ** 2, p.starts[filled])
    return out


def _deal(pc: PipelineCost, p: Packing, sq: np.ndarray) -> list[_Batch]:
    """Each bucket's rows into micro-batches: longest processing time first (by squared
    lengths: a bucket's rows cost the same otherwise) into ``micro-batches x bins`` bins
    of at most ``rows / bins`` rows, ``bins`` the widest stage's ways (at most the rows a
    micro-batch holds); a micro-batch is its bins' rows in order."""
    out = []
    for bucket in np.unique(p.bucket).tolist():
        mine = np.flatnonzero(p.bucket == bucket)
        mine = mine[np.argsort(-sq[mine], kind="stable")]
        r = pc.rows(bucket)
        k = -(-mine.size // r)
        w = min(r, pc.widest)
        while r % w:
            w -= 1
        cap = r // w
        nb = k * w
        bins: list[list[int]] = [[] for _ in range(nb)]
        # Each row to the least loaded bin with room (a full bin leaves the heap); ties
        # to the lower bin.
        heap = [(0.0, b) for b in range(nb)]
        for i, v in zip(mine.tolist(), sq[mine].tolist(), strict=True):
            load, b = heapq.heappop(heap)
            bins[b].append(i)
            if len(bins[b]) < cap:
                heapq.heappush(heap, (load + v, b))
        for j in range(k):
            rows = [i for b in range(j * w, (j + 1) * w) for i in bins[b]]
            if rows:
                out.append((bucket, np.asarray(rows, np.int64)))
    return out


def _order(stages: _Stages, times: list[np.ndarray]) -> tuple[list[int], float]:
    """The micro-batches' order and its priced time (module docstring)."""
    m = len(times)
    lists = [t.T.tolist() for t in times]
    if m <= 1:
        return list(range(m)), stages.walk_lists(lists)

    def walk(order):
        return stages.walk_lists([lists[i] for i in order])

    if m <= EXACT_ORDER:
        best = None
        seen = set()
        for perm in itertools.permutations(range(m)):
            key = tuple(tuple(map(tuple, lists[i])) for i in perm)
            if key in seen:  # alike micro-batches swapped: the same walk
                continue
            seen.add(key)
            t = walk(perm)
            if best is None or t < best[1] - 1e-15:
                best = (list(perm), t)
        return best
    load = np.array([t.sum(axis=1) for t in times])  # [micro-batches, stages]
    heavy = np.argsort(-load.max(axis=1), kind="stable")
    # Which stage a micro-batch weighs on, relative to the average micro-batch: the
    # alternation pairs one leaning on the first stages with one on the last.
    lean = (load / load.mean(axis=0)) @ np.linspace(-1.0, 1.0, load.shape[1])
    by_lean = np.argsort(lean, kind="stable")
    alternate = [int(x) for pair in itertools.zip_longest(by_lean[::-1][:(m + 1) // 2],
                                                          by_lean[:m // 2])
                 for x in pair if x is not None]
    best = None
    for cand in (list(range(m)), heavy.tolist(), heavy[::-1].tolist(), alternate):
        t = walk(cand)
        if best is None or t < best[1] - 1e-15:
            best = (cand, t)
    order, t_best = best
    # Adjacent swaps, one pass, each kept where the walk is faster.
    for i in range(m - 1):
        if lists[order[i]] == lists[order[i + 1]]:
            continue
        cand = order[:i] + [order[i + 1], order[i]] + order[i + 2:]
        t = walk(cand)
        if t < t_best - 1e-15:
            order, t_best = cand, t
    return order, t_best


@dataclasses.dataclass(frozen=True)
class _Draft:
    name: str
    samples: np.ndarray
    packing: Packing | None
    batches: list[_Batch]
    times: list[np.ndarray]
    time_s: float

    def plan(self) -> GroupPlan:
        if self.packing is None:
            return GroupPlan(self.name, (), (), self.time_s)
        rows = self.packing.rows()
        return GroupPlan(self.name, tuple(self.samples.tolist()), tuple(
            MicroStep(b, 1, tuple(rows[i] for i in idx.tolist()),
                      float(t.sum(axis=1).max()))
            for (b, idx), t in zip(self.batches, self.times, strict=True)), self.time_s)


def _proxy(pc: PipelineCost) -> GroupCost:
    """A group whose micro-steps hold the pipeline's micro-batches' rows (``tokens //
    bucket`` a bucket): what ``_fill_steps`` merges part-empty micro-batches by."""
    chunk = pc.buckets[0]
    return GroupCost(name=pc.name, gpu="", devices=tuple(range(pc.tokens // chunk)),
                     chunk=chunk, token_s=0.0, attention_s=0.0, attention_fwd_share=0.5,
                     layers=1, kv_bytes_per_token=0.0, buckets=pc.buckets)


def _compose(stages: _Stages, p: Packing, search: bool = True) -> _Draft:
    sq = _squares(p)
    batches = _deal(stages.pc, p, sq) if search else _in_order(stages.pc, p)
    times = [stages.times(b, sq[idx]) for b, idx in batches]
    if search:
        order, t = _order(stages, times)
        batches, times = [batches[i] for i in order], [times[i] for i in order]
    else:
        t = stages.walk(times)
    return _Draft(stages.pc.name, np.zeros(0, np.int64), p, batches, times, t)


def _in_order(pc: PipelineCost, p: Packing) -> list[_Batch]:
    """Rows in the packing's order, ``rows(bucket)`` a micro-batch (Megatron-LM)."""
    out = []
    for bucket in dict.fromkeys(p.bucket.tolist()):
        mine = np.flatnonzero(p.bucket == bucket)
        r = pc.rows(bucket)
        out += [(bucket, mine[i:i + r]) for i in range(0, mine.size, r)]
    return out


def _draft(stages: _Stages, samples: np.ndarray, lengths: np.ndarray) -> _Draft:
    pc = stages.pc
    if samples.size == 0:
        return _Draft(pc.name, samples, None, [], [], pc.step_s)
    packed = best_fit(lengths[samples], pc.buckets, samples)
    best = _compose(stages, packed)
    merged = _fill_steps(_proxy(pc), packed, pc.buckets)
    if merged.bucket.size != packed.bucket.size or (merged.bucket != packed.bucket).any():
        other = _compose(stages, merged)
        if other.time_s < best.time_s:
            best = other
    return dataclasses.replace(best, samples=samples)


def _costs(pipes: Sequence[PipelineCost], lengths: np.ndarray) -> np.ndarray:
    """[pipelines, stages, samples] seconds of each sample's tokens and attention on
    each stage (forward and backward, spread over its ways; no padding, no ring)."""
    s = max(len(p.stages) for p in pipes)
    x = lengths.astype(np.float64)
    out = np.zeros((len(pipes), s, lengths.size))
    for k, p in enumerate(pipes):
        for j, st in enumerate(p.stages):
            out[k, j] = ((st.token_fwd_s + st.token_bwd_s) * x
                         + (st.attention_fwd_s + st.attention_bwd_s) * x * x) / st.ways
    return out


def plan_pipeline_batch(lengths, pipes: Sequence[PipelineCost], *,
                        cluster: Cluster | None = None, cal: Calibration = DEFAULT,
                        method: str = "hetshard", rounds: int = 3,
                        bound: bool = True) -> BatchPlan:
    """The per-batch plan of one global batch of ``lengths`` (tokens per sample) on the
    pipelines ``pipes`` (:func:`pipeline_costs`); ``cluster`` prices the stages' sends and
    context rings (None: free). ``method``: ``"hetshard"`` (module docstring),
    ``"identical"`` (the same planner believing every GPU the cluster's average,
    :func:`identical_pipelines`, its plan priced on the real ones), ``"fixed-cp"``
    (Megatron-LM: samples concatenated in order into rows of the largest bucket, the
    rows shared out in proportion to the pipelines' speeds, micro-batches in order) or
    ``"pad"`` (each sample alone in a row of the largest bucket).

    Raises:
      SpecError: empty, non-integer or non-positive lengths, a sample longer than the
        largest bucket, no pipelines, pipelines of different buckets, an unknown method.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _plan(lengths, pipes, cluster, cal, method, rounds, bound)
    finally:
        if collecting:
            gc.enable()


def _plan(lengths, pipes, cluster, cal, method, rounds, bound) -> BatchPlan:
    t0 = time.perf_counter()
    if method not in METHODS:
        raise SpecError("method", method, f"one of {METHODS}")
    if not pipes:
        raise SpecError("pipes", [], "at least one PipelineCost")
    if len({p.buckets for p in pipes}) > 1:
        raise SpecError("pipes", [p.buckets for p in pipes],
                        "pipelines of the same buckets (one pipeline_costs call)")
    lengths = check_lengths(lengths)
    top = pipes[0].buckets[-1]
    over = np.flatnonzero(lengths > top)
    if over.size:
        i = int(over[0])
        raise SpecError(f"lengths[{i}]", int(lengths[i]),
                        f"at most the largest bucket, {top} tokens")
    stages = [_Stages(p, cluster, cal) for p in pipes]
    costs = _costs(pipes, lengths)
    if method in ("pad", "fixed-cp"):
        drafts = _static(method, stages, lengths, costs, top)
    else:
        believed = stages if method == "hetshard" else [
            _Stages(p, cluster, cal) for p in identical_pipelines(pipes)]
        seen_costs = costs if method == "hetshard" else _costs(
            [b.pc for b in believed], lengths)
        drafts = _place(believed, seen_costs, lengths, rounds)
        if method == "identical":  # priced on the real GPUs
            drafts = [_reprice(stages[k], d) for k, d in enumerate(drafts)]
    plan = tuple(d.plan() for d in drafts)
    planning = time.perf_counter() - t0
    lb = pipeline_bound(lengths, pipes) if bound else None
    return BatchPlan(method, plan, max(g.time_s for g in plan), int(lengths.sum()), lb,
                     planning)


def _place(stages: list[_Stages], costs: np.ndarray, lengths: np.ndarray,
           rounds: int) -> list[_Draft]:
    """Placement rounds (as ``hetshard.data.planner`` places on groups): LPT on each
    pipeline's bottleneck-stage estimate, then again with each pipeline's priced time
    over its estimate, while the priced step falls."""
    est = costs.max(axis=1)  # [pipelines, samples]: the stage a sample weighs on most
    one = np.ones(len(stages))
    if len(stages) == 1:
        return [_draft(stages[0], np.arange(lengths.size), lengths)]
    scale, best = one.copy(), None
    for _ in range(max(1, rounds)):
        where = _lpt(est, one, scale)
        drafts = [_draft(s, np.flatnonzero(where == k), lengths)
                  for k, s in enumerate(stages)]
        worst = max(d.time_s for d in drafts)
        if best is not None and worst >= best[0]:
            break
        best = (worst, drafts)
        guess = np.array([est[k, d.samples].sum() * scale[k] if d.samples.size else 0.0
                          for k, d in enumerate(drafts)])
        priced = np.array([d.time_s - s.pc.step_s for d, s in zip(drafts, stages,
                                                                   strict=True)])
        new = np.where(guess > 0, scale * priced / np.maximum(guess, 1e-30), scale)
        if np.allclose(new / new.max(), scale / scale.max(), rtol=0.01):
            break
        scale = new
    return best[1]


def _reprice(stages: _Stages, d: _Draft) -> _Draft:
    """Draft ``d`` (its rows, micro-batches and order) priced on ``stages``."""
    if d.packing is None:
        return dataclasses.replace(d, time_s=stages.pc.step_s)
    sq = _squares(d.packing)
    times = [stages.times(b, sq[idx]) for b, idx in d.batches]
    return dataclasses.replace(d, times=times, time_s=stages.walk(times))


def _static(method: str, stages: list[_Stages], lengths: np.ndarray, costs: np.ndarray,
            top: int) -> list[_Draft]:
    if method == "pad":
        rows = tuple(Row(top, (i,), (int(n),)) for i, n in enumerate(lengths.tolist()))
    else:
        rows = sequential(lengths, top)
    # Rows shared out in proportion to each pipeline's speed on a full row (its
    # bottleneck stage), largest remainders.
    full = _costs([s.pc for s in stages], np.array([top])).max(axis=1)[:, 0]
    speed = 1.0 / full
    ideal = len(rows) * speed / speed.sum()
    share = np.floor(ideal).astype(int)
    for k in np.argsort(-(ideal - share))[:len(rows) - share.sum()]:
        share[k] += 1
    bounds = np.concatenate([[0], np.cumsum(share)])
    out = []
    for k, s in enumerate(stages):
        mine = rows[bounds[k]:bounds[k + 1]]
        if not mine:
            out.append(_Draft(s.pc.name, np.zeros(0, np.int64), None, [], [], s.pc.step_s))
            continue
        d = _compose(s, Packing.of(mine), search=False)
        out.append(dataclasses.replace(
            d, samples=np.asarray([i for r in mine for i in r.samples], np.int64)))
    return out


def pipeline_bound(lengths, pipes: Sequence[PipelineCost]) -> float:
    """No placement, packing, composition or order beats this: the least T such that the
    samples, split fractionally over the pipelines, take at most ``T - step_s`` of every
    stage of each pipeline (their tokens and attention only: no padding, no ring, no
    fill or drain). Exact for one pipeline; a linear program (OR-tools GLOP) for more."""
    lengths = np.asarray(lengths)
    costs = _costs(pipes, lengths)
    if len(pipes) == 1:
        return float(costs[0].sum(axis=1).max() + pipes[0].step_s)
    from ortools.linear_solver import pywraplp
    solver = pywraplp.Solver.CreateSolver("GLOP")
    inf = solver.infinity()
    t = solver.NumVar(0.0, inf, "T")
    loads = []
    for k, p in enumerate(pipes):
        for j in range(len(p.stages)):
            c = solver.Constraint(-inf, -p.step_s)  # sum_i cost * x - T <= -step
            c.SetCoefficient(t, -1.0)
            loads.append((k, j, c))
    xs = []
    for _ in range(lengths.size):
        one = solver.Constraint(1.0, 1.0)
        row = []
        for _p in pipes:
            x = solver.NumVar(0.0, 1.0, "")
            one.SetCoefficient(x, 1.0)
            row.append(x)
        xs.append(row)
    for k, j, c in loads:
        for i in range(lengths.size):
            c.SetCoefficient(xs[i][k], float(costs[k, j, i]))
    solver.Minimize(t)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return float("nan")
    return float(t.solution_value())


__all__ = ["EXACT_ORDER", "PipelineCost", "StageRate", "identical_pipelines",
           "pipeline_bound", "pipeline_costs", "plan_pipeline_batch"]
