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
  lightest first, alternating the stages they weigh on), the chosen drafts then
  improved by a pass of adjacent swaps.

Multimodal batches: the vision encoder runs with each pipeline's first stage (every
image slot of a row encoded, padding too), or on a vision stage of its own in front of
the language model (``pipeline_costs(vision_devices=)``), which encodes a micro-batch's
own images in passes of ``encoder_chunk`` a device; placement then decides each
pipeline's vision stage's share of the images, and the deal weighs images too.

The result is a ``BatchPlan`` (one ``GroupPlan`` per pipeline, its micro-batches in the
order they run) with a lower bound: fractional placement of the samples over the
pipelines where every stage does every sample's tokens, attention and images, no
padding, no ring, no fill or drain (exact for one pipeline, OR-tools' GLOP for more).
``hetshard.data.run_pipeline_batch_plan`` runs it (``hetshard.runtime.mixed``).
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from hetshard._plan import Plan, data_ways
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.comm import collective_time, p2p_time, topology
from hetshard.cost.profile import ModelProfile
from hetshard.cost.stage import stage_cost
from hetshard.data.drafts import BatchPlan, Draft, MicroStep, draft, place, static
from hetshard.data.packing import (
    Packing,
    Row,
    check_buckets,
    check_count,
    check_fits,
    check_images,
    check_lengths,
    geometric_buckets,
    image_slots,
)
from hetshard.data.planner import METHODS, GroupCost, check_groups
from hetshard.data.search import fractional_bound
from hetshard.errors import SpecError
from hetshard.sim.schedule import time_varied
from hetshard.sim.simulator import layers_cost, priced_dtype, sync_time

# Up to this many micro-batches a pipeline, every order is priced (5! = 120 walks).
EXACT_ORDER = 5


@dataclasses.dataclass(frozen=True)
class StageRate:
    """What one stage of a pipeline spends, per data way (``tensor x context`` devices
    of it): ``token_*_s`` per token slot (everything but attention's scores), and
    ``attention_*_s`` per squared token of causal attention, forward and backward;
    ``kv_bytes_per_token`` per layer (what a context ring passes), ``send_bytes_per_token``
    the activations it sends the next stage (0: the last), ``step_s`` its update and
    gradient sync per step. A vision stage (``start == end``: no language-model layers)
    prices only its ``image_*_s``."""

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
    # A vision encoder's forward and backward per image slot, one way (on a vision
    # stage, which holds no language-model layers, or with the first stage's layers);
    # what a vision stage sends the next per image.
    image_fwd_s: float = 0.0
    image_bwd_s: float = 0.0
    send_bytes_per_image: float = 0.0

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """One pipeline of the outer plan: its stages in order, ``tokens`` token slots a
    micro-batch (rows of one of ``buckets``); multimodal rows take ``image_tokens`` a
    image and hold ``images_of(bucket)`` image slots."""

    name: str
    stages: tuple[StageRate, ...]
    tokens: int
    buckets: tuple[int, ...]
    image_tokens: int = 0
    image_slots: tuple[int, ...] = ()
    encoder_chunk: int = 4  # a vision stage's images a way per encoder pass
    # A vision stage encodes every image slot of its micro-batch's rows (padding too), as
    # a step whose encoder takes each row's images runs it (run_pipeline_batch_plan),
    # instead of only the micro-batch's own images in passes of encoder_chunk.
    encoder_slots: bool = False

    def images_of(self, bucket: int) -> int:
        """Image slots a row of ``bucket`` holds (0 without a vision encoder); every slot
        is encoded, padding too (a row's image dimension is part of its shape)."""
        if not self.image_tokens:
            return 0
        if self.image_slots:
            return self.image_slots[self.buckets.index(bucket)]
        return bucket // self.image_tokens

    @property
    def vision(self) -> bool:
        return any(s.image_fwd_s > 0 for s in self.stages)

    @property
    def encoder_stage(self) -> int | None:
        """The vision stage of its own (no language-model layers), if any."""
        return next((i for i, s in enumerate(self.stages) if not s.layers), None)

    def rows(self, bucket: int) -> int:
        """Rows of ``bucket`` a micro-batch holds."""
        return max(1, self.tokens // bucket)

    @property
    def step_s(self) -> float:
        return max(s.step_s for s in self.stages)

    @property
    def widest(self) -> int:
        """The most data ways of a language-model stage (a vision stage's ways do not
        split rows)."""
        return max(s.ways for s in self.stages if s.layers)


def pipeline_costs(profile: ModelProfile, cluster: Cluster, plan: Plan, *, max_context: int,
                   cal: Calibration = DEFAULT, tokens: int | None = None,
                   buckets: Sequence[int] | None = None, max_buckets: int = 4,
                   memory_margin: float = 0.9, vision: ModelProfile | None = None,
                   image_tokens: int = 0, images_per_row: Mapping[int, int] | None = None,
                   vision_devices: Sequence[Sequence[int]] | None = None,
                   encoder_chunk: int = 4,
                   encoder_slots: bool = False) -> tuple[PipelineCost, ...]:
    """One :class:`PipelineCost` per pipeline of ``plan`` (an outer plan over ``profile``'s
    layers on ``cluster``), each stage priced by the simulator's own stage cost
    (``hetshard.sim.simulator.layers_cost``: its mesh, remat, dtype) at the profile's
    sequence length, split into its linear and attention parts. ``tokens``: token slots a
    micro-batch (default: ``max_context``, or the profile's length times the widest
    stage's ways where that is more: every way gets at least one sequence's slots);
    ``buckets``: row lengths (powers of two, the largest ``max_context``; default
    ``geometric_buckets`` from the profile's length, at most ``max_buckets``).

    Multimodal pipelines: ``vision`` a vision encoder's profile (one image a sample),
    ``image_tokens`` the positions an image takes in a row, ``images_per_row`` bucket ->
    image slots a row holds (default as many as its tokens hold). The encoder runs with
    each pipeline's first stage, or, with ``vision_devices`` (one device list a
    pipeline, of one GPU type, outside the plan's), on a vision stage of its own in
    front of the language model (DistTrain's disaggregation): it encodes a
    micro-batch's images in passes of ``encoder_chunk`` images a way (one compiled
    shape), and sends each image's encoding to the first stage. That encoder batch is
    compacted (DistTrain's): priced, not run. With ``encoder_slots`` the vision stage
    encodes every image slot of its micro-batch's rows, padding too (a row's images
    split over its ways as the language model's stages split rows): what
    :func:`hetshard.data.run_pipeline_batch_plan` runs, the program's encoder taking
    each row's images.

    Raises:
      SpecError: ``max_context`` not a power of two at least the profile's length,
        ``tokens`` not a power of two at least ``max_context`` or whose rows a stage's
        data ways neither divide nor are divided by, ``buckets`` outside the
        above, a stage whose devices do not hold the micro-batches its one-forward-
        one-backward schedule keeps in flight (within ``memory_margin``); ``vision``
        without ``image_tokens``, ``images_per_row`` or ``vision_devices`` without
        ``vision``, ``vision_devices`` not one list of free devices of one GPU type a
        pipeline, ``encoder_chunk`` not a whole number at least 1, ``encoder_slots``
        not a bool or without ``vision_devices``.
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
    if vision is None and (image_tokens or images_per_row is not None
                           or vision_devices is not None):
        field = "vision_devices" if vision_devices is not None else (
            "images_per_row" if images_per_row is not None else "image_tokens")
        raise SpecError(field, locals()[field], "None without a vision encoder (vision=)")
    if vision is not None and (isinstance(image_tokens, bool) or not isinstance(
            image_tokens, (int, np.integer)) or not 0 < image_tokens <= buckets[0]):
        raise SpecError("image_tokens", image_tokens,
                        f"the positions an image takes in a row, 1 to {buckets[0]}")
    if isinstance(encoder_chunk, bool) or not isinstance(encoder_chunk, (int, np.integer)) \
            or encoder_chunk < 1:
        raise SpecError("encoder_chunk", encoder_chunk, "a whole number of images, at least 1")
    if not isinstance(encoder_slots, bool) or (encoder_slots and vision_devices is None):
        raise SpecError("encoder_slots", encoder_slots,
                        "true or false; true only with a vision stage (vision_devices=)")
    slots = image_slots(tuple(buckets), int(image_tokens), images_per_row)
    encoders = _vision_devices(vision_devices, plan, cluster)
    for p in plan.pipelines:  # a micro-batch's rows split over the ways, or rows over them
        for j, st in enumerate(p.stages):
            ways = data_ways(st)
            bad = [b for b in buckets if (tokens // b) % ways and ways % (tokens // b)]
            if bad:
                raise SpecError("tokens", tokens,
                                f"token slots a micro-batch whose rows of buckets {bad} "
                                f"stage {j}'s {ways} data ways divide, or divide them")
    out = []
    for pi, pipe in enumerate(plan.pipelines):
        stages = []
        if encoders:
            ways = len(encoders[pi])
            chunk = encoder_chunk
            if encoder_slots:  # a way's share of a micro-batch's slots, at once
                bad = [b for b in buckets if (tokens // b) % ways and ways % (tokens // b)]
                if bad:
                    raise SpecError("vision_devices", list(encoders[pi]),
                                    f"devices whose count divides, or is divided by, the "
                                    f"rows of a micro-batch of buckets {bad}")
                chunk = max(-(-(tokens // b) // ways) * n if tokens // b >= ways else n
                            for b, n in zip(buckets, slots or [b // int(image_tokens)
                                                               for b in buckets],
                                            strict=True))
            stages.append(_vision_stage(vision, encoders[pi], plan, cluster, cal,
                                        len(pipe.stages) + 1, chunk,
                                        image_tokens, memory_margin,
                                        profile.layers[0].boundary_bytes_per_sample / seq))
        n = len(pipe.stages)
        for j, st in enumerate(pipe.stages):
            fsdp = plan.fsdp or st.axis("fsdp") > 1
            c = layers_cost(st, st.start, st.end, 1, fsdp, plan.attention, profile, cluster,
                            cal, plan.distributed_optimizer, plan.tp_overlap,
                            priced_dtype(plan, profile, st), ())
            ways = data_ways(st)
            image = (0.0, 0.0)
            if vision is not None and not encoders and j == 0:
                v = stage_cost(vision, 0, vision.num_layers, cluster.gpu_of(st.devices[0]),
                               mbs=1, dp=ways, fsdp=ways > 1, remat=st.remat, cal=cal,
                               dtype=priced_dtype(plan, profile, st),
                               dp_topo=topology(cluster, st.devices[::len(st.devices) // ways]))
                image = (v.fwd_s, v.bwd_s)
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
            sync = sync_time("reduce_scatter" if fsdp else "all_reduce", profile,
                             st.start, st.end, c.grad_sync_bytes, topology(cluster, peers),
                             cal, st.gpu) if len(peers) > 1 else 0.0
            send = (profile.layers[st.end - 1].boundary_bytes_per_sample / seq
                    if j < n - 1 else 0.0)
            stages.append(StageRate(
                gpu=st.gpu, devices=tuple(st.devices), start=st.start, end=st.end, ways=ways,
                token_fwd_s=(c.fwd_s - c.attention_fwd_s) / seq,
                token_bwd_s=(c.bwd_s - c.attention_bwd_s) / seq,
                attention_fwd_s=c.attention_fwd_s / seq ** 2,
                attention_bwd_s=c.attention_bwd_s / seq ** 2,
                kv_bytes_per_token=2.0 * layer.boundary_bytes_per_sample / seq,
                send_bytes_per_token=send, step_s=c.optimizer_s + c.cast_s + sync,
                image_fwd_s=image[0], image_bwd_s=image[1]))
        out.append(PipelineCost(f"pipeline{pi}", tuple(stages), tokens, tuple(buckets),
                                int(image_tokens) if vision is not None else 0, slots,
                                int(encoder_chunk), encoder_slots))
    return tuple(out)


def _vision_devices(devices, plan: Plan, cluster: Cluster) -> list[tuple[int, ...]]:
    """Checked ``vision_devices`` (module docstring of :func:`pipeline_costs`)."""
    if devices is None:
        return []
    taken = {d for p in plan.pipelines for st in p.stages for d in st.devices}
    ok = isinstance(devices, Sequence) and len(devices) == len(plan.pipelines)
    out, seen = [], set()
    for devs in devices if ok else ():
        devs = tuple(devs) if isinstance(devs, Sequence) else ()
        if not devs or any(isinstance(d, bool) or not isinstance(d, (int, np.integer))
                           or not 0 <= d < cluster.num_devices for d in devs) \
                or taken & set(devs) or seen & set(devs) \
                or len({cluster.gpu_of(d).name for d in devs}) > 1:
            ok = False
            break
        seen |= set(devs)
        out.append(tuple(int(d) for d in devs))
    if not ok:
        raise SpecError("vision_devices", devices,
                        f"one list of devices a pipeline ({len(plan.pipelines)}), each of "
                        f"one GPU type, none in the plan's stages or another list")
    return out


def _vision_stage(vision: ModelProfile, devs: tuple[int, ...], plan: Plan,
                  cluster: Cluster, cal: Calibration, n: int, chunk: int,
                  image_tokens: int, memory_margin: float, embedding: float) -> StageRate:
    """The vision stage on ``devs`` (data ways each, FSDP, full remat), first of ``n``;
    it sends an image's ``image_tokens`` positions of ``embedding`` bytes each (the
    language model's width: the projector's output)."""
    gpu = cluster.gpu_of(devs[0])
    dtype = dict(plan.gpu_dtypes).get(gpu.name, plan.dtype)
    v = stage_cost(vision, 0, vision.num_layers, gpu, mbs=1, dp=len(devs),
                   fsdp=len(devs) > 1, remat="full", cal=cal, dtype=dtype,
                   dp_topo=topology(cluster, devs))
    # In flight: n micro-batches' encodings kept for their backward, a pass of chunk
    # images a device at a time (full remat: one image's activations a pass).
    if v.memory_static_bytes + (n + chunk) * v.memory_per_microbatch_bytes + \
            v.memory_working_bytes > memory_margin * gpu.memory_bytes:
        raise SpecError("vision_devices", devs,
                        f"devices whose {gpu.name} hold the encoder's weights and {n} "
                        f"micro-batches in flight, {chunk} images a pass")
    sync = sync_time("reduce_scatter", vision, 0, vision.num_layers, v.grad_sync_bytes,
                     topology(cluster, devs), cal, gpu.name) if len(devs) > 1 else 0.0
    return StageRate(gpu=gpu.name, devices=devs, start=0, end=0, ways=len(devs),
                     token_fwd_s=0.0, token_bwd_s=0.0, attention_fwd_s=0.0,
                     attention_bwd_s=0.0, kv_bytes_per_token=0.0, send_bytes_per_token=0.0,
                     step_s=v.optimizer_s + v.cast_s + sync, image_fwd_s=v.fwd_s,
                     image_bwd_s=v.bwd_s,
                     send_bytes_per_image=image_tokens * embedding)


def identical_pipelines(pipes: Sequence[PipelineCost]) -> tuple[PipelineCost, ...]:
    """``pipes`` as a planner made for identical GPUs believes them: every stage's rates
    per layer and device the cluster's average (weighted by devices; a vision encoder's
    per image and device among the stages that run one), its layers and ways as
    they are."""
    every = [s for p in pipes for s in p.stages]

    def avg(field: str, among, per) -> float:
        num = sum(getattr(s, field) * s.ways / per(s) * len(s.devices) for s in among)
        return num / sum(len(s.devices) for s in among) if among else 0.0

    text = [s for s in every if s.layers]
    seeing = [s for s in every if s.image_fwd_s > 0]
    mean = {f: avg(f, text, lambda s: s.layers) for f in (
        "token_fwd_s", "token_bwd_s", "attention_fwd_s", "attention_bwd_s")}
    pics = {f: avg(f, seeing, lambda s: 1) for f in ("image_fwd_s", "image_bwd_s")}

    def believed(s: StageRate) -> StageRate:
        new = {f: v * s.layers / s.ways for f, v in mean.items()}
        if s.image_fwd_s > 0:
            new.update({f: v / s.ways for f, v in pics.items()})
        return dataclasses.replace(s, **new)

    return tuple(dataclasses.replace(p, stages=tuple(believed(s) for s in p.stages))
                 for p in pipes)


class _Stages:
    """Micro-batch times on one pipeline's stages (per-bucket parts computed once)."""

    def __init__(self, pc: PipelineCost, cluster: Cluster | None, cal: Calibration):
        self.pc = pc
        st = pc.stages
        self.ways = [s.ways for s in st]
        self.lin = np.array([[s.token_fwd_s, s.token_bwd_s] for s in st])
        self.att = np.array([[s.attention_fwd_s, s.attention_bwd_s] for s in st])
        self.img = np.array([[s.image_fwd_s, s.image_bwd_s] for s in st])
        self.cluster, self.cal = cluster, cal
        self._ring: dict = {}
        self._sends: dict = {}
        self._buckets: dict = {}
        # what hetshard.data.drafts asks of an owner
        self.name, self.buckets, self.step_s = pc.name, pc.buckets, pc.step_s
        self.image_caps, self.merging = _caps(pc), _proxy(pc)

    def compose(self, p: Packing, img: np.ndarray | None = None, in_order: bool = False,
                swaps: bool = True) -> tuple[list[_Batch], float]:
        """``p``'s rows as micro-batches, priced by the walk: dealt and ordered (with a
        vision stage of its own, dealt by attention and images and by attention alone,
        the faster kept; ``swaps``: the order's adjacent-swap pass too), or with
        ``in_order`` as the packing has them (Megatron-LM)."""
        sq, pics = _squares(p), _pictures(p, img)
        if in_order:
            batches = [_Batch(b, idx, self.times(b, sq[idx], pics[idx]))
                       for b, idx in _in_order(self.pc, p)]
            return batches, self.walk([b.times for b in batches])
        best = None
        seeing = self.pc.encoder_stage is not None and pics.any()
        for weigh in ((True, False) if seeing else (False,)):
            dealt = _deal(self.pc, p, sq, pics if weigh else np.zeros_like(pics))
            batches = [_Batch(b, idx, self.times(b, sq[idx], pics[idx])) for b, idx in dealt]
            order, t = _order(self, [b.times for b in batches], swaps)
            if best is None or t < best[1]:
                best = ([batches[i] for i in order], t)
        return best

    def ring(self, s: int, bucket: int, c: int) -> float:
        """Seconds per layer for a ``bucket`` row's K/V to go round ``c`` ways of stage
        ``s``."""
        key = (s, bucket, c)
        got = self._ring.get(key)
        if got is None:
            st = self.pc.stages[s]
            got = 0.0
            if c > 1 and self.cluster is not None and st.layers:
                per = len(st.devices) // st.ways
                got = collective_time("all_gather", st.kv_bytes_per_token * bucket,
                                      topology(self.cluster, st.devices[:c * per:per]),
                                      self.cal, st.gpu)
            self._ring[key] = got
        return got

    def sends(self, bucket: int) -> list[float]:
        """Each stage's transfer to the next of a micro-batch of ``bucket`` rows (its
        token slots' activations; a vision stage's are its images', :meth:`times`)."""
        got = self._sends.get(bucket)
        if got is None:
            pc = self.pc
            got = [p2p_time(a.send_bytes_per_token * pc.tokens, self.cluster, a.devices,
                            b.devices, self.cal)
                   if self.cluster is not None and a.layers else 0.0
                   for a, b in zip(pc.stages, pc.stages[1:], strict=False)] + [0.0]
            self._sends[bucket] = got
        return got

    def encodings(self, s: int, images: int) -> float:
        """Seconds to send ``images`` images' encodings from vision stage ``s`` on (a
        send's time is its latency plus its bytes at the link's rate)."""
        if images <= 0 or self.cluster is None:
            return 0.0
        got = self._sends.get(s)
        if got is None:
            a, b = self.pc.stages[s], self.pc.stages[s + 1]
            one, two = (p2p_time(k * a.send_bytes_per_image, self.cluster, a.devices,
                                 b.devices, self.cal) for k in (1, 2))
            got = self._sends[s] = (2 * one - two, two - one)
        return got[0] + got[1] * images

    def _parts(self, bucket: int) -> tuple:
        """Per stage, what a micro-batch of ``bucket`` rows costs but for its documents'
        attention and its images: (kind, forward, backward, ways a row or rows a way,
        ring seconds); computed once a bucket."""
        got = self._buckets.get(bucket)
        if got is None:
            r, slots = self.pc.rows(bucket), self.pc.images_of(bucket)
            stages = []
            for s, w in enumerate(self.ways):
                if not self.pc.stages[s].layers and not self.pc.encoder_slots:
                    stages.append(("vision", 0.0, 0.0, w, 0.0))
                elif not self.pc.stages[s].layers:
                    # every slot of the rows, a way's rows' (or its share of a row's)
                    per = -(-r // w) * slots if r >= w else (
                        slots // (w // r) if slots % (w // r) == 0 else slots)
                    f, b = self.img[s] * per
                    stages.append(("slots", f, b, w, 0.0))
                elif r >= w:
                    per = r // w if r % w == 0 else -(-r // w)
                    f, b = (self.lin[s] * bucket + self.img[s] * slots) * per
                    stages.append(("rows", f, b, per, 0.0))
                else:
                    c = w // r
                    f, b = (self.lin[s] * bucket / c
                            + self.img[s] * (slots / c if slots % c == 0 else slots))
                    stages.append(("ring", f, b, c,
                                   self.pc.stages[s].layers * self.ring(s, bucket, c)))
            got = self._buckets[bucket] = (r, stages, self.sends(bucket))
        return got

    def times(self, bucket: int, squares: np.ndarray,
              pictures: np.ndarray | None = None) -> np.ndarray:
        """[stages, 3]: forward and backward seconds of a micro-batch of ``bucket`` rows
        whose squared document lengths sum to ``squares`` row by row, in order (rows
        missing from the micro-batch are padding), holding ``pictures`` images row by
        row, and its send to the next stage. An encoder running with a stage's layers
        encodes every image slot of a row, padding too (the row's compiled shape); a
        vision stage of its own encodes the micro-batch's images in passes of
        ``encoder_chunk`` a way (``encoder_batch``) and sends their encodings on, or,
        with ``encoder_slots``, every image slot of its rows, a way its rows' (or its
        share of a row's, on a ring) and sends all their encodings on."""
        r, stages, sends = self._parts(bucket)
        sq = squares.tolist()
        out = np.empty((len(stages), 3))
        out[:, 2] = sends
        for s, (kind, f, b, k, ring) in enumerate(stages):
            af, ab = self.att[s]
            if kind == "vision":
                n = int(pictures.sum()) if pictures is not None else 0
                f, b = self.img[s] * encoder_batch(n, k, self.pc.encoder_chunk) / k
                if s + 1 < len(stages):
                    out[s, 2] = self.encodings(s, n)
            elif kind == "slots":  # the same whatever the micro-batch holds
                if s + 1 < len(stages):
                    out[s, 2] = self.encodings(s, r * self.pc.images_of(bucket))
            elif kind == "rows":
                most = max(sum(sq[i:i + k]) for i in range(0, len(sq), k)) if sq else 0.0
                f, b = f + af * most, b + ab * most
            else:
                most = max(sq, default=0.0) / k
                f, b = f + af * most, b + ab * most
                # the ring's forward pass and the backward's two, where attention does
                # not hide them
                f += max(0.0, ring - af * most)
                b += 2 * max(0.0, ring - ab * most / 2)
            out[s, 0], out[s, 1] = f, b
        return out

    def walk(self, times: Sequence[np.ndarray]) -> float:
        """The one-forward-one-backward finish time of micro-batches ``times`` (each
        :meth:`times`' result), in order, plus the step's update."""
        return self.walk_lists([t.T.tolist() for t in times])

    def walk_lists(self, times: Sequence[list]) -> float:
        """:meth:`walk` of micro-batches given as ``[forwards, backwards, sends]`` lists
        by stage (what the order search prices many times)."""
        if not times:
            return self.pc.step_s
        n = len(self.ways)
        fwd = [[t[0][s] for t in times] for s in range(n)]
        bwd = [[t[1][s] for t in times] for s in range(n)]
        sends = [[t[2][s] for t in times] for s in range(n - 1)]
        return time_varied(fwd, bwd, sends) + self.pc.step_s


class _Batch(NamedTuple):
    """A micro-batch while planning: its bucket, its rows' indices in the packing (in
    order) and its times on the stages (``_Stages.times``)."""

    bucket: int
    rows: np.ndarray
    times: np.ndarray

    def micro_step(self, rows: Sequence[Row]) -> MicroStep:
        """The plan's micro-step, ``rows`` the packing's; its time is its slowest
        stage's forward and backward."""
        return MicroStep(self.bucket, 1, tuple(rows[i] for i in self.rows.tolist()),
                         float(self.times[:, :2].sum(axis=1).max()))


def _squares(p: Packing) -> np.ndarray:
    out = np.zeros(p.counts.size)
    filled = p.counts > 0
    out[filled] = np.add.reduceat(p.lengths.astype(np.float64) ** 2, p.starts[filled])
    return out


def _pictures(p: Packing, img: np.ndarray | None) -> np.ndarray:
    """Images per row of ``p`` (zeros for a text batch)."""
    out = np.zeros(p.counts.size)
    if img is not None:
        filled = p.counts > 0
        out[filled] = np.add.reduceat(img[p.samples].astype(np.float64), p.starts[filled])
    return out


def encoder_batch(images: int, ways: int, chunk: int = 4) -> int:
    """Image slots a vision stage of ``ways`` data ways encodes for a micro-batch of
    ``images``: passes of ``chunk`` images a way (one compiled shape), as many as hold
    them."""
    per = ways * chunk
    return per * -(-max(0, images) // per)


def _deal(pc: PipelineCost, p: Packing, sq: np.ndarray,
          pics: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Each bucket's rows into micro-batches: longest processing time first (by their
    attention on the stage slowest at it, plus their images' encoding on a vision stage
    of its own: a bucket's rows cost the same otherwise) into ``micro-batches x bins``
    bins of at most ``rows / bins`` rows, ``bins`` the widest stage's ways (at most the
    rows a micro-batch holds); a micro-batch is its bins' rows in order."""
    out = []
    att = max(s.attention_fwd_s + s.attention_bwd_s for s in pc.stages)
    key = sq * att
    v = pc.encoder_stage
    for bucket in np.unique(p.bucket).tolist():
        mine = np.flatnonzero(p.bucket == bucket)
        r = pc.rows(bucket)
        if v is not None:  # a micro-batch's images split over the vision stage's ways
            enc = pc.stages[v]
            weight = (enc.image_fwd_s + enc.image_bwd_s) * min(r, pc.widest) / enc.ways
            key = sq * att + pics * weight
        mine = mine[np.argsort(-key[mine], kind="stable")]
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
        for i, x in zip(mine.tolist(), key[mine].tolist(), strict=True):
            load, b = heapq.heappop(heap)
            bins[b].append(i)
            if len(bins[b]) < cap:
                heapq.heappush(heap, (load + x, b))
        for j in range(k):
            rows = [i for b in range(j * w, (j + 1) * w) for i in bins[b]]
            if rows:
                out.append((bucket, np.asarray(rows, np.int64)))
    return out


def _order(stages: _Stages, times: list[np.ndarray],
           swaps: bool = True) -> tuple[list[int], float]:
    """The micro-batches' order and its priced time (module docstring); ``swaps``: the
    adjacent-swap pass too (placement rounds compare drafts without it, the chosen
    drafts get it, :func:`_polish`)."""
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
    load = np.array([t[:, :2].sum(axis=1) for t in times])  # [micro-batches, stages]
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
    return _swapped(stages, lists, *best) if swaps else best


def _swapped(stages: _Stages, lists: list, order: list[int],
             t_best: float) -> tuple[list[int], float]:
    """Adjacent swaps of ``order``, one pass, each kept where the walk is faster."""
    for i in range(len(order) - 1):
        if lists[order[i]] == lists[order[i + 1]]:
            continue
        cand = order[:i] + [order[i + 1], order[i]] + order[i + 2:]
        t = stages.walk_lists([lists[j] for j in cand])
        if t < t_best - 1e-15:
            order, t_best = cand, t
    return order, t_best


def _polish(stages: _Stages, d: Draft) -> Draft:
    """Draft ``d`` with the swap pass over its order (beyond ``EXACT_ORDER``)."""
    if len(d.steps) <= EXACT_ORDER:
        return d
    order, t = _swapped(stages, [b.times.T.tolist() for b in d.steps],
                        list(range(len(d.steps))), d.time_s)
    return dataclasses.replace(d, steps=[d.steps[i] for i in order], time_s=t)


def _proxy(pc: PipelineCost) -> GroupCost:
    """A group whose micro-steps hold the pipeline's micro-batches' rows (``tokens //
    bucket`` a bucket): what ``fill_steps`` merges part-empty micro-batches by."""
    chunk = pc.buckets[0]
    return GroupCost(name=pc.name, gpu="", devices=tuple(range(pc.tokens // chunk)),
                     chunk=chunk, token_s=0.0, attention_s=0.0, attention_fwd_share=0.5,
                     layers=1, kv_bytes_per_token=0.0, buckets=pc.buckets,
                     image_tokens=pc.image_tokens, image_slots=pc.image_slots)


def _in_order(pc: PipelineCost, p: Packing) -> list[tuple[int, np.ndarray]]:
    """Rows in the packing's order, ``rows(bucket)`` a micro-batch (Megatron-LM)."""
    out = []
    for bucket in dict.fromkeys(p.bucket.tolist()):
        mine = np.flatnonzero(p.bucket == bucket)
        r = pc.rows(bucket)
        out += [(bucket, mine[i:i + r]) for i in range(0, mine.size, r)]
    return out


def _caps(pc: PipelineCost) -> tuple[int, ...]:
    return tuple(pc.images_of(b) for b in pc.buckets)


def _costs(pipes: Sequence[PipelineCost], lengths: np.ndarray,
           img: np.ndarray | None = None) -> np.ndarray:
    """[pipelines, stages, samples] seconds of each sample's tokens, attention and
    images on each stage (forward and backward, spread over its ways; no padding, no
    ring)."""
    s = max(len(p.stages) for p in pipes)
    x = lengths.astype(np.float64)
    out = np.zeros((len(pipes), s, lengths.size))
    for k, p in enumerate(pipes):
        for j, st in enumerate(p.stages):
            out[k, j] = ((st.token_fwd_s + st.token_bwd_s) * x
                         + (st.attention_fwd_s + st.attention_bwd_s) * x * x) / st.ways
            if img is not None:
                out[k, j] += (st.image_fwd_s + st.image_bwd_s) * img / st.ways
    return out


def plan_pipeline_batch(lengths, pipes: Sequence[PipelineCost], *, images=None,
                        cluster: Cluster | None = None, cal: Calibration = DEFAULT,
                        method: str = "hetshard", rounds: int = 2,
                        bound: bool = True) -> BatchPlan:
    """The per-batch plan of one global batch of ``lengths`` (tokens per sample; each
    of its ``images`` adds the pipelines' ``image_tokens``) on the pipelines ``pipes``
    (:func:`pipeline_costs`); ``cluster`` prices the stages' sends and
    context rings (None: free). ``method``: ``"hetshard"`` (module docstring),
    ``"identical"`` (the same planner believing every GPU the cluster's average,
    :func:`identical_pipelines`, its plan priced on the real ones), ``"fixed-cp"``
    (Megatron-LM: samples concatenated in order into rows of the largest bucket, the
    rows shared out in proportion to the pipelines' speeds, micro-batches in order) or
    ``"pad"`` (each sample alone in a row of the largest bucket).

    Raises:
      SpecError: empty, non-integer or non-positive lengths, a sample longer than the
        largest bucket, no pipelines, pipelines of different buckets, an unknown method;
        images on pipelines priced without a vision encoder, or more images than a row
        holding the sample has slots.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _plan(lengths, images, pipes, cluster, cal, method, rounds, bound)
    finally:
        if collecting:
            gc.enable()


def _plan(lengths, images, pipes, cluster, cal, method, rounds, bound) -> BatchPlan:
    t0 = time.perf_counter()
    if method not in METHODS:
        raise SpecError("method", method, f"one of {METHODS}")
    pipes = check_groups(pipes, PipelineCost, "pipes", "pipeline_costs")
    check_count("rounds", rounds, 1)
    if len({p.buckets for p in pipes}) > 1:
        raise SpecError("pipes", [p.buckets for p in pipes],
                        "pipelines of the same buckets (one pipeline_costs call)")
    lengths = check_lengths(lengths)
    img = None
    if images is not None:
        img = check_images(images, lengths)
        if img.any() and not all(p.vision for p in pipes):
            raise SpecError("images", f"{int(img.sum())} images",
                            "a text-only batch: these pipelines price no vision encoder "
                            "(pipeline_costs(vision=...))")
        if len({(p.image_tokens, _caps(p)) for p in pipes}) > 1:
            raise SpecError("pipes", [(p.image_tokens, _caps(p)) for p in pipes],
                            "pipelines of the same image slots (one pipeline_costs call)")
        lengths = lengths + img * pipes[0].image_tokens
    top = pipes[0].buckets[-1]
    over = np.flatnonzero(lengths > top)
    if over.size:
        i = int(over[0])
        raise SpecError(f"lengths[{i}]", int(lengths[i]),
                        f"at most the largest bucket, {top} tokens"
                        + (" (with its images' tokens)" if img is not None else ""))
    if img is not None:
        caps = _caps(pipes[0])
        if method in ("pad", "fixed-cp"):  # rows of the largest bucket
            check_fits(lengths, img, (top,), caps[-1:])
        else:
            check_fits(lengths, img, pipes[0].buckets, caps)
    stages = [_Stages(p, cluster, cal) for p in pipes]
    if method in ("pad", "fixed-cp"):
        # Rows shared out in proportion to each pipeline's speed on a full row (its
        # bottleneck stage).
        full = _costs(pipes, np.array([top])).max(axis=1)[:, 0]
        drafts = static(method, stages, 1.0 / full, lengths, img, top,
                        None if img is None else pipes[0].images_of(top))
    else:
        believed = stages if method == "hetshard" else [
            _Stages(p, cluster, cal) for p in identical_pipelines(pipes)]
        drafts = _place(believed, _costs([b.pc for b in believed], lengths, img), lengths,
                        img, rounds)
        if method == "identical":  # priced on the real GPUs
            drafts = [_reprice(stages[k], d, img) for k, d in enumerate(drafts)]
    plan = tuple(d.plan() for d in drafts)
    planning = time.perf_counter() - t0
    lb = _bound(_costs(pipes, lengths, img), pipes) if bound else None
    return BatchPlan(method, plan, max(g.time_s for g in plan), int(lengths.sum()), lb,
                     planning)


def _place(stages: list[_Stages], costs: np.ndarray, lengths: np.ndarray,
           img: np.ndarray | None, rounds: int) -> list[Draft]:
    """The placement rounds (``hetshard.data.drafts.place``) on each pipeline's
    bottleneck-stage estimate, the drafts compared without the order's swap pass, the
    chosen ones then given it."""
    if len(stages) == 1:
        best = [draft(stages[0], np.arange(lengths.size), lengths, img, swaps=False)]
    else:
        est = costs.max(axis=1)  # [pipelines, samples]: the stage a sample weighs on most
        best = place(lambda k, samples: draft(stages[k], samples, lengths, img, swaps=False),
                     est, np.ones(len(stages)), [s.step_s for s in stages], rounds).drafts
    return [_polish(s, d) for s, d in zip(stages, best, strict=True)]


def _reprice(stages: _Stages, d: Draft, img: np.ndarray | None) -> Draft:
    """Draft ``d`` (its rows, micro-batches and order) priced on ``stages``."""
    if d.packing is None:
        return dataclasses.replace(d, time_s=stages.step_s)
    sq, pics = _squares(d.packing), _pictures(d.packing, img)
    steps = [_Batch(b.bucket, b.rows, stages.times(b.bucket, sq[b.rows], pics[b.rows]))
             for b in d.steps]
    return dataclasses.replace(d, steps=steps, time_s=stages.walk([b.times for b in steps]))


def image_slots_from(batches: Sequence, images: Sequence, pipes: Sequence[PipelineCost],
                     cluster: Cluster | None = None, cal: Calibration = DEFAULT
                     ) -> dict[int, int]:
    """Image slots a row of each bucket holds, sized from a sample of the data (pass as
    ``pipeline_costs(images_per_row=)``): ``batches`` planned on ``pipes`` (priced with
    every slot a row's tokens hold), a bucket holds the power of two at or above the
    most images any of its rows took, at least the most one sample had (so that any
    sample like these fits the bucket holding its tokens), at most what its tokens
    hold. Every slot is encoded, padding too: fewer slots, less padding encoded."""
    one = max((int(np.max(i)) for i in images if len(i)), default=0)
    seen: dict[int, int] = {}
    for lengths, img in zip(batches, images, strict=True):
        img = np.asarray(img)
        plan = plan_pipeline_batch(lengths, pipes, images=img, cluster=cluster, cal=cal,
                                   bound=False)
        for g in plan.groups:
            for st in g.steps:
                for r in st.rows:
                    seen[r.bucket] = max(seen.get(r.bucket, 0),
                                         int(img[list(r.samples)].sum()))
    out = {}
    for b in pipes[0].buckets:
        most = b // pipes[0].image_tokens
        need = max(seen.get(b, 0), min(one, most))
        out[b] = min(most, 1 << (need - 1).bit_length()) if need else 0
    return out


def choose_image_slots(profile: ModelProfile, cluster: Cluster, plan: Plan,
                       batches: Sequence, images: Sequence, *, max_context: int,
                       cal: Calibration = DEFAULT, method: str = "hetshard",
                       **costs) -> tuple[PipelineCost, ...]:
    """The pipelines of ``plan`` (``pipeline_costs(profile, cluster, plan, max_context=,
    cal=, **costs)``, a vision encoder among ``costs``) with the image slots a row of
    each bucket holds chosen from a sample of the run's data: :func:`image_slots_from`'s
    sizing, then every bucket's slots halved together, again and again, down to the most
    images one sample of ``batches`` had (rounded up to a power of two: any sample like
    these still fits the bucket holding its tokens), then, from the fastest of those,
    one bucket's slots at a time halved or doubled (within that floor and the data's
    sizing) while that prices faster. Candidates are priced by their plans of
    ``batches`` (``images``: per batch, images per sample), summed step time; the
    fastest wins (the larger slots on a tie). Every slot is encoded, padding too: fewer
    slots encode less padding, but pack images less densely (more rows). A candidate
    whose stages do not hold it is skipped. ``method``: whose plans price the
    candidates (a baseline of ``plan_pipeline_batch`` gets slots tuned for it).

    Raises:
      SpecError: an unknown method, no batches, not one image list a batch,
        ``images_per_row`` among
        ``costs`` (it is what is chosen), no vision encoder, or what
        :func:`pipeline_costs` refuses.
    """
    if method not in METHODS:
        raise SpecError("method", method, f"one of {METHODS}")
    if not len(batches):
        raise SpecError("batches", [], "at least one batch of sample lengths")
    if images is None or len(images) != len(batches):
        raise SpecError("images", None if images is None else f"{len(images)} batches",
                        f"one image count list per batch ({len(batches)})")
    if "images_per_row" in costs:
        raise SpecError("images_per_row", costs["images_per_row"],
                        "not given: choose_image_slots chooses it (pipeline_costs takes it)")
    if costs.get("vision") is None:
        raise SpecError("vision", None, "a vision encoder's profile: image slots are "
                        "chosen for multimodal pipelines")

    def build(slots):
        return pipeline_costs(profile, cluster, plan, max_context=max_context, cal=cal,
                              images_per_row=slots, **costs)

    def price(pipes) -> float:
        return sum(plan_pipeline_batch(b, pipes, images=i, cluster=cluster, cal=cal,
                                       method=method, bound=False).step_time_s
                   for b, i in zip(batches, images, strict=True))

    sized = image_slots_from(batches, images, build(None), cluster, cal)
    one = max((int(np.max(i)) for i in images if len(i)), default=0)
    floor = {b: min(n, 1 << (min(one, n) - 1).bit_length()) if min(one, n) else 0
             for b, n in sized.items()}
    tried: dict[tuple, float] = {}
    best, best_t, error = None, np.inf, None

    def trial(slots: dict) -> float:
        nonlocal best, best_t, error
        key = tuple(slots[b] for b in sorted(slots))
        if key not in tried:
            try:
                pipes = build(slots)
            except SpecError as e:  # its stages do not hold these slots' micro-batches
                error, tried[key] = error or e, np.inf
            else:
                tried[key] = t = price(pipes)
                if t < best_t:
                    best, best_t = pipes, t
        return tried[key]

    # every bucket halved together, down to the floor; then from the fastest, one
    # bucket at a time halved or doubled (within the floor and the data's sizing)
    # while that prices faster
    slots, at, at_t = dict(sized), dict(sized), trial(sized)
    while True:
        smaller = {b: max(floor[b], n // 2) for b, n in slots.items()}
        if smaller == slots:
            break
        slots = smaller
        if trial(slots) < at_t:
            at, at_t = dict(slots), trial(slots)
    moved = True
    while moved:
        moved = False
        for b in sorted(at, reverse=True):
            for n in (at[b] // 2, at[b] * 2):
                if floor[b] <= n <= sized[b] and n != at[b]:
                    cand = {**at, b: n}
                    if trial(cand) < at_t:
                        at, at_t, moved = cand, trial(cand), True
                        break
    if best is None:
        raise error
    return best


def pipeline_bound(lengths, pipes: Sequence[PipelineCost], images=None) -> float:
    """No placement, packing, composition or order beats this: the least T such that the
    samples, split fractionally over the pipelines, take at most ``T - step_s`` of every
    stage of each pipeline (their tokens, attention and images only: no padding, no
    ring, no fill or drain). Exact for one pipeline; a linear program (OR-tools GLOP)
    for more. ``lengths`` as :func:`plan_pipeline_batch` takes them.

    Raises:
      SpecError: lengths, images or pipelines as :func:`plan_pipeline_batch` refuses
        them.
    """
    pipes = check_groups(pipes, PipelineCost, "pipes", "pipeline_costs")
    lengths = check_lengths(lengths)
    img = None if images is None else check_images(images, lengths)
    if img is not None:
        lengths = lengths + img * pipes[0].image_tokens
    return _bound(_costs(pipes, lengths, img), pipes)


def _bound(costs: np.ndarray, pipes: Sequence[PipelineCost]) -> float:
    """``pipeline_bound`` on ``costs[pipeline, stage, sample]``: exact for one pipeline,
    else the shared linear program (``bounds.fractional_bound``: each stage a resource
    of its pipeline)."""
    if len(pipes) == 1:
        return float(costs[0].sum(axis=1).max() + pipes[0].step_s)
    rows = [(k, j) for k, p in enumerate(pipes) for j in range(len(p.stages))]
    return fractional_bound(np.stack([costs[k, j] for k, j in rows]),
                            [k for k, _ in rows], [1.0] * len(rows),
                            [pipes[k].step_s for k, _ in rows])


__all__ = ["EXACT_ORDER", "PipelineCost", "StageRate", "encoder_batch", "identical_pipelines",
           "image_slots_from", "pipeline_bound", "pipeline_costs", "plan_pipeline_batch"]
