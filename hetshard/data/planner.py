"""Per-batch plans: packing, placement, context degrees and micro-steps for one global
batch of variable-length (and multimodal) samples, on GPUs of different speeds.

The outer plan is fixed: the cluster's GPU groups are data-parallel replicas (one GPU
type each; the group's devices shard the weights FSDP-style and each runs ``chunk``
token slots per micro-step, what its memory holds). Per batch this module decides, in
milliseconds:

* **placement**: which samples each group takes. A sample's cost on a group is priced
  by the cost model (``group_costs``): linear per token, quadratic in its length for
  causal attention, plus a vision-encoder cost per image. Longest-processing-time first
  (Graham 1969) on machines of different speeds, each sample to the group where it
  finishes earliest, then re-run with each group's priced-to-estimated ratio until the
  priced step time stops improving; then a few moves of samples from the slowest group
  (its sparsest part-empty micro-step whole, to a group with room for those rows; or
  samples, to the group that finishes first), each kept where the priced step falls;
* **packing** per group into rows of the group's buckets (``hetshard.data.packing``);
* **context parallelism per sequence**: a row of bucket ``B`` runs over ``B / chunk``
  devices (the K/V ring of ``hetshard.kernels.ring_attention``), so a long document
  gets a context group and the short ones, packed into ``chunk``-long rows, none
  (FlexSP's idea, Wang et al. ASPLOS'25, here per GPU type);
* **micro-step composition**: a micro-step of bucket ``B`` runs ``devices / degree`` rows
  at once and lasts as long as its slowest row, so rows of similar cost share one
  (sorted, then cut: this minimises the sum of the micro-steps' maxima for given rows).

The result is a :class:`BatchPlan` with its priced step time, a lower bound (a linear
program over fractional placements: every sample's tokens and attention on some group,
no padding, no ring; exact by sorting for two groups, OR-tools' GLOP for more) and the
gap between them.

Baselines priced by the same model (``plan_batch(method=...)``):
``"pad"`` (every sample alone in a row of the largest bucket, static batch shares),
``"fixed-cp"`` (Megatron-LM: samples concatenated in order into rows of the largest
bucket, one context degree for all, static shares), ``"identical"`` (this planner
believing every GPU is the cluster's average one: FlexSP's planner, made for identical
GPUs) and ``"hetshard"``.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.comm import collective_time, topology
from hetshard.cost.profile import ModelProfile
from hetshard.cost.stage import stage_cost
from hetshard.data.drafts import (
    BatchPlan,
    Draft,
    GroupPlan,
    MicroStep,
    Placement,
    draft,
    place,
    static,
)
from hetshard.data.packing import (
    Packing,
    Row,
    check_count,
    check_fits,
    check_images,
    check_lengths,
    geometric_buckets,
    image_slots,
    ranges,
    whole,
)
from hetshard.data.search import fractional_bound
from hetshard.errors import SpecError
from hetshard.sim.simulator import sync_time

METHODS = ("pad", "fixed-cp", "identical", "hetshard")
# Group packings the local search after placement may price a batch (``_rebalance``):
# its last, failing round alone tried up to seven; on the Wikipedia batches of
# experiments/data_aware.py ten cost no configuration any step time.
SEARCH_PACKINGS = 10


@dataclasses.dataclass(frozen=True)
class GroupCost:
    """What a sample costs on one data-parallel group (one GPU type), per device.

    ``chunk`` token slots per device per micro-step; ``token_s`` forward+backward seconds
    per token slot (everything but attention's scores); ``attention_s`` seconds per
    squared token of causal attention (forward+backward, one device), of which
    ``attention_fwd_share`` is the forward's; ``kv_bytes_per_token`` per layer, what the
    context ring passes around; ``image_s`` the vision encoder's forward+backward per
    image, ``image_tokens`` the decoder positions an image takes and ``image_slots``
    the images a row of each of ``buckets`` holds (its compiled image dimension; default
    as many as its tokens hold); ``step_s`` per step (the update and the gradient
    sync)."""

    name: str
    gpu: str
    devices: tuple[int, ...]
    chunk: int
    token_s: float
    attention_s: float
    attention_fwd_share: float
    layers: int
    kv_bytes_per_token: float
    remat: str = "none"
    # Rows longer than ``devices * chunk``, and those of ``long_buckets``, run under
    # ``long_remat``, where ``long_chunk`` slots a device fit in memory, at
    # ``long_token_s``: over ``bucket / long_chunk`` devices (a shorter ring, within a
    # node where it fits, for more recomputation).
    long_remat: str = ""
    long_chunk: int = 0
    long_token_s: float = 0.0
    image_s: float = 0.0
    image_tokens: int = 0
    step_s: float = 0.0
    buckets: tuple[int, ...] = ()
    long_buckets: tuple[int, ...] = ()
    image_slots: tuple[int, ...] = ()

    def images_of(self, bucket: int) -> int:
        """Images a row of ``bucket`` holds (0 without a vision encoder). Every slot is
        encoded, padding too: a row's image dimension is part of its compiled shape."""
        if not self.image_tokens:
            return 0
        if self.image_slots and bucket in self.buckets:
            return self.image_slots[self.buckets.index(bucket)]
        return bucket // self.image_tokens

    def image_caps(self, buckets: Sequence[int] | None = None) -> tuple[int, ...]:
        return tuple(self.images_of(b) for b in (buckets or self.buckets))

    def image_time(self, bucket: int) -> float:
        """Seconds a device spends encoding a ``bucket`` row's image slots: split over the
        row's context group where its degree divides them (the runtime lays the images
        and the encoder's activations out so), else every device of the group encodes
        them all."""
        slots, d = self.images_of(bucket), self.degree(bucket)
        return self.image_s * (slots / d if slots % d == 0 else slots)

    @property
    def n(self) -> int:
        return len(self.devices)

    def is_long(self, bucket: int) -> bool:
        """Whether rows of ``bucket`` run under the long remat."""
        return bool(self.long_chunk) and (bucket in self.long_buckets
                                          or bucket > self.n * self.chunk)

    def degree(self, bucket: int) -> int:
        if self.is_long(bucket):
            return min(self.n, max(1, -(-bucket // self.long_chunk)))
        return max(1, bucket // self.chunk)

    def slots(self, bucket: int) -> int:
        """Token slots per device of a micro-step of ``bucket`` rows."""
        return max(self.chunk, bucket // self.degree(bucket))

    def remat_of(self, bucket: int) -> str:
        return self.long_remat if self.is_long(bucket) else self.remat

    def token_cost(self, bucket: int) -> float:
        return self.long_token_s if self.is_long(bucket) else self.token_s

    @property
    def longest(self) -> int:
        return self.n * max(self.chunk, self.long_chunk)


# ---- costs from the cost model ----------------------------------------------------------

def group_costs(profile: ModelProfile, cluster: Cluster, *, max_context: int,
                cal: Calibration = DEFAULT, remat: str | Sequence[str] = ("none", "full"),
                dtypes: dict | None = None,
                vision: ModelProfile | None = None, image_tokens: int = 0,
                max_buckets: int = 4, memory_margin: float = 0.9,
                split: Mapping[str, int] | None = None,
                long_chunk: int | None = None,
                buckets: Sequence[int] | None = None,
                images_per_row: Mapping[int, int] | None = None) -> tuple[GroupCost, ...]:
    """One :class:`GroupCost` per group of ``cluster``, priced by
    ``hetshard.cost.stage.stage_cost`` on the whole model (FSDP over the group, ``remat``):
    the linear and attention parts from ``profile`` at its sequence length. The chunk (token
    slots per device per micro-step) is that length, under the first of ``remat`` where
    one such micro-batch fits in ``memory_margin`` of the device: the finest micro-steps.
    Rows longer than the group's chunks run under ``long_remat``, the first remat that
    holds ``long_chunk`` slots a device (below). Buckets run from the chunk to
    ``max_context`` (at most ``max_buckets``). ``vision``: a vision encoder's profile
    (one image a sample), priced per image the same way; ``image_tokens`` what each image
    adds to the language model's sequence; ``images_per_row``: bucket -> the images a
    row of it holds (default: as many as its tokens hold, ``bucket // image_tokens``).
    Every image slot of a row is encoded, padding too, and priced so (split over the
    row's context group where its degree divides them, ``GroupCost.image_time``):
    :func:`choose_groups` sizes them from the data.

    ``split``: cluster group name -> how many equal data-parallel replicas its devices
    form (default one a group). Each part is a group of its own, named
    ``"<group>/<i>"`` (its devices shard the weights; the gradients are reduce-scattered
    over every device once a step, as for one group): a long document's context ring
    then holds only its part while the other parts train other rows (see
    :func:`choose_groups`). Parts are whole nodes, or equal shares
    of a one-node group. ``long_chunk``: token slots a device holds for long rows (a
    power-of-two multiple of the sequence length; default: the fewest that hold a
    ``max_context`` row over the group's devices); buckets whose full rows then train
    faster over fewer devices, under a remat that holds them, run so (``long_buckets``).
    ``buckets``: the row lengths (powers-of-two multiples of the sequence length, the
    largest ``max_context``; default ``geometric_buckets`` up to ``max_buckets`` of them).

    Raises:
      SpecError: ``max_context`` not a power of two at least the profile's sequence
        length, a group (or part) whose devices cannot hold a ``max_context`` row, a
        split naming no group or not dividing it into equal node-aligned parts, a
        ``long_chunk``, ``buckets`` or ``images_per_row`` outside what is accepted
        above.
    """
    seq = profile.seq_len
    remats = (remat,) if isinstance(remat, str) else tuple(remat)
    if max_context < seq or max_context & (max_context - 1):
        raise SpecError("max_context", max_context,
                        f"a power of two at least the profile's sequence length {seq}")
    if long_chunk is not None and (
            isinstance(long_chunk, bool) or not isinstance(long_chunk, (int, np.integer))
            or long_chunk < 2 * seq or long_chunk > max_context or long_chunk % seq
            or (long_chunk // seq) & (long_chunk // seq - 1)):
        raise SpecError("long_chunk", long_chunk,
                        f"a power-of-two multiple of the sequence length {seq}, from "
                        f"{2 * seq} to max_context={max_context}")
    if buckets is not None:
        b = sorted(set(int(x) for x in buckets)) if all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in buckets) else []
        if not b or b[-1] != max_context or any(
                x < seq or x % seq or (x // seq) & (x // seq - 1) for x in b):
            raise SpecError("buckets", list(buckets),
                            f"powers-of-two multiples of the sequence length {seq}, the "
                            f"largest max_context={max_context}")
        buckets = tuple(b)
    parts = _parts(cluster, split)
    out = []
    everyone = list(range(cluster.num_devices))
    for g in cluster.groups:
        ids = tuple(cluster.group_device_ids(g.name))
        k = parts[g.name]
        size = len(ids) // k
        devs = ids[:size]  # the parts are alike: priced once, on the first
        dtype = (dtypes or {}).get(g.gpu.name)
        cap = memory_margin * g.gpu.memory_bytes
        def priced(mode: str, mbs: int, g=g, devs=devs, dtype=dtype):
            return stage_cost(profile, 0, profile.num_layers, g.gpu, mbs=mbs, dp=len(devs),
                              fsdp=len(devs) > 1, remat=mode, cal=cal, dtype=dtype,
                              dp_topo=topology(cluster, devs))

        # Short rows: the cheapest remat that holds one profile-length sequence per device
        # (the finest micro-steps). Long rows: ``long_chunk`` slots a device (default:
        # the fewest that hold a max_context row over the group) under the first remat
        # that holds them.
        fits = [m for m in remats if priced(m, 1).peak_memory(1) <= cap]
        need = -(-max_context // (seq * len(devs)))  # slots (in sequences) to hold one
        held = need if long_chunk is None else long_chunk // seq
        long = next((m for m in remats if held > 1 and priced(m, held).peak_memory(1) <= cap),
                    None)
        if not fits or (need > 1 and long is None):
            field, value = (f"split[{g.name!r}]", k) if k > 1 else ("cluster.groups", g.name)
            raise SpecError(field, value,
                            f"a group whose {len(devs)} {g.gpu.name} hold a {max_context}-"
                            f"token row of {profile.model} under FSDP (remat {remats})"
                            + (" in each part" if k > 1 else ""))
        if held < need or (held > 1 and long is None):
            raise SpecError("long_chunk", long_chunk,
                            f"token slots a {g.gpu.name} of group {g.name!r} holds under "
                            f"one of remat {remats}, at least {need * seq} (a "
                            f"{max_context}-token row over its {len(devs)} devices)")
        mode, chunk, one = fits[0], seq, priced(fits[0], 1)
        token_s = (one.fwd_s + one.bwd_s - one.attention_fwd_s - one.attention_bwd_s) / seq
        if long:
            c = priced(long, 1)
            long = (long, held * seq,
                    (c.fwd_s + c.bwd_s - c.attention_fwd_s - c.attention_bwd_s) / seq)
        else:
            long = ("", 0, 0.0)
        layer = profile.layers[len(profile.layers) // 2]
        kv = 2.0 * layer.boundary_bytes_per_sample / seq
        rows = buckets or geometric_buckets(chunk, max_context, max_buckets)

        def per_token(token_s: float, slots: int, bucket: int, devs=devs, g=g,
                      kv=kv) -> float:
            """Device seconds per token of full ``bucket`` rows at ``slots`` a device."""
            d = max(1, bucket // slots)
            ring = collective_time("all_gather", kv * bucket, topology(cluster, devs[:d]),
                                   cal, g.gpu.name) if d > 1 else 0.0
            return token_s + 3 * profile.num_layers * ring * d / bucket

        # Buckets whose full rows train faster on fewer devices (a shorter ring, within
        # a node where it fits) under the long remat
        long_buckets = tuple(
            b for b in rows if long[1] and chunk < b <= len(devs) * chunk
            and b >= long[1] and per_token(long[2], long[1], b) < per_token(token_s, chunk, b))
        attention = one.attention_fwd_s + one.attention_bwd_s
        # The gradient sync, and the update. Under FSDP the step's gradients are
        # reduce-scattered over every data-parallel device, every group's and replica's,
        # priced by the simulator's own sync (stage_cost prices the weights' gathers).
        sync = sync_time("reduce_scatter", profile, 0, profile.num_layers,
                         one.grad_sync_bytes, topology(cluster, everyone), cal, g.gpu.name)
        image_s = 0.0
        if vision is not None:
            v = stage_cost(vision, 0, vision.num_layers, g.gpu, mbs=1, dp=len(devs),
                           fsdp=len(devs) > 1, remat=mode, cal=cal, dtype=dtype,
                           dp_topo=topology(cluster, devs))
            image_s = v.fwd_s + v.bwd_s
        first = GroupCost(
            name=g.name, gpu=g.gpu.name, devices=devs, chunk=chunk, token_s=token_s,
            attention_s=attention / seq ** 2,
            attention_fwd_share=one.attention_fwd_s / attention if attention else 0.5,
            layers=profile.num_layers,
            kv_bytes_per_token=kv,
            remat=mode, long_remat=long[0], long_chunk=long[1], long_token_s=long[2],
            image_s=image_s, image_tokens=image_tokens,
            step_s=one.optimizer_s + sync, buckets=rows, long_buckets=long_buckets,
            image_slots=image_slots(rows, image_tokens if vision is not None else 0,
                                     images_per_row))
        out.extend([first] if k == 1 else [
            dataclasses.replace(first, name=f"{g.name}/{i}", devices=ids[i * size:(i + 1) * size])
            for i in range(k)])
    return tuple(out)


def choose_groups(profile: ModelProfile, cluster: Cluster, batches: Sequence, *,
                  max_context: int, images: Sequence | None = None, max_shapes: int = 8,
                  max_parts: int = 8, method: str = "hetshard", cal: Calibration = DEFAULT,
                  **costs) -> tuple[GroupCost, ...]:
    """The groups a run's per-batch plans go on, chosen from a sample of its data.

    Candidates split each cluster group into 1, 2, 4, ... (at most ``max_parts``) equal
    data-parallel replicas (``group_costs(split=)``), each replica given
    ``max_shapes // replicas`` buckets, so that a run compiles at most ``max_shapes``
    micro-step programs, and hold long rows at 2 to 16 sequence lengths a device
    (``group_costs(long_chunk=)``; or the fewest that hold ``max_context``); then, on
    the best of those, every set of as many power-of-two row lengths from the sequence
    length to ``max_context`` (``group_costs(buckets=)``). Each candidate plans every
    batch of ``batches`` (lists of sample lengths, drawn from the run's data;
    ``images``: per batch, images per sample, or None; with images, each candidate also
    plans with its image slots a row sized from those plans, kept where faster) and
    the one with the least summed step time is returned. Replicas trade weights and
    optimizer state sharded over fewer devices (and fewer buckets each) for rings that
    hold one replica, not the whole GPU type, while the others train other rows: worth
    it where long documents are rare. ``method``: whose plans choose (a baseline of
    ``plan_batch`` tunes its outer plan the same way). ``costs``: further
    ``group_costs`` arguments (``remat``, ``dtypes``, ``vision``, ``image_tokens``,
    ``memory_margin``).

    Raises:
      SpecError: no batches, ``max_shapes`` below the groups' count, or no candidate
        that holds a ``max_context`` row.
    """
    if method not in METHODS:
        raise SpecError("method", method, f"one of {METHODS}")
    if not len(batches):
        raise SpecError("batches", [], "at least one batch of sample lengths")
    if images is not None and len(images) != len(batches):
        raise SpecError("images", f"{len(images)} batches", f"one per batch ({len(batches)})")
    if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or (
            max_shapes < len(cluster.groups)):
        raise SpecError("max_shapes", max_shapes,
                        f"an integer at least the cluster's {len(cluster.groups)} groups")
    options = []
    for g in cluster.groups:
        unit = g.nodes if g.nodes > 1 else g.gpus_per_node
        options.append([k for k in (2 ** i for i in range(unit.bit_length()))
                        if unit % k == 0 and k <= max_parts])
    seq = profile.seq_len
    longs = [None] + [seq * 2 ** i for i in range(1, 5) if seq * 2 ** i <= max_context]

    def plans(groups):
        return [plan_batch(b, groups, images=None if images is None else images[i],
                           cluster=cluster, cal=cal, max_context=max_context,
                           method=method, bound=False) for i, b in enumerate(batches)]

    def score(groups):
        """(summed step time, the groups), with image slots sized from these batches
        where that prices faster than as many as the rows' tokens hold (fewer slots
        encode less padding; more pack images more densely)."""
        got = plans(groups)
        t = sum(p.step_time_s for p in got)
        if images is not None and groups[0].image_tokens:
            capped = _capped(groups, batches, images, got)
            t_capped = sum(p.step_time_s for p in plans(capped))
            if t_capped < t:
                return t_capped, capped
        return t, groups

    best, error = None, None
    for ks, long in itertools.product(itertools.product(*options), longs):
        total = sum(ks)
        if total > max_shapes:
            continue
        split = {g.name: k for g, k in zip(cluster.groups, ks, strict=True)}
        try:
            groups = group_costs(profile, cluster, max_context=max_context, cal=cal,
                                 max_buckets=max_shapes // total, split=split,
                                 long_chunk=long, **costs)
        except SpecError as e:  # parts too small to hold a max_context row
            error = error or e
            continue
        t, groups = score(groups)
        if best is None or t < best[0]:
            best = (t, groups, split, long)
    if best is None:
        raise error or SpecError("max_shapes", max_shapes, "room for one bucket a group")
    # Then the row lengths on the chosen replicas: every set of as many powers of two
    # from the sequence length to max_context, both ends kept.
    t_best, groups, split, long = best
    count = len(groups[0].buckets)
    inner = [seq * 2 ** i for i in range(1, 64) if seq * 2 ** i < max_context]
    for mid in itertools.combinations(inner, max(0, count - 2)):
        rows = (seq, *mid, max_context) if count > 1 else (max_context,)
        if rows == groups[0].buckets or len(set(rows)) < count:
            continue
        cand = group_costs(profile, cluster, max_context=max_context, cal=cal, split=split,
                           long_chunk=long, buckets=rows, **costs)
        t, cand = score(cand)
        if t < t_best:
            t_best, best = t, (t, cand, split, long)
    return best[1]


def _capped(groups: Sequence[GroupCost], batches: Sequence, images: Sequence,
            plans: Sequence[BatchPlan]) -> tuple[GroupCost, ...]:
    """``groups`` with image slots sized from the data: a bucket's rows hold the power
    of two at or above the most images any of its rows took in ``plans`` (of
    ``batches``), and at least the most one sample had (so that any sample like these
    fits the bucket holding its tokens) and the row's context degree (so that its
    devices split them), at most what its tokens hold."""
    one = max((int(np.max(i)) for i in images if len(i)), default=0)
    seen: dict[tuple[str, int], int] = {}
    for k, plan in enumerate(plans):
        img = np.asarray(images[k])
        for gp in plan.groups:
            for st in gp.steps:
                for r in st.rows:
                    key = (gp.group, r.bucket)
                    seen[key] = max(seen.get(key, 0), int(img[list(r.samples)].sum()))
    out = []
    for g in groups:
        slots = []
        for b in g.buckets:
            most = b // g.image_tokens
            need = max(seen.get((g.name, b), 0), min(one, most))
            if need:  # a power of two, split over the row's context group where it can be
                need = max(1 << (need - 1).bit_length(), g.degree(b))
            slots.append(min(most, need))
        out.append(dataclasses.replace(g, image_slots=tuple(slots)))
    return tuple(out)


def _parts(cluster: Cluster, split: Mapping[str, int] | None) -> dict[str, int]:
    """Replicas per cluster group (checked: whole nodes, or equal shares of one node)."""
    out = {g.name: 1 for g in cluster.groups}
    for name, k in (split or {}).items():
        if name not in out:
            raise SpecError("split", name, f"a group of the cluster: one of {sorted(out)}")
        g = cluster.group(name)
        ok = (not isinstance(k, bool) and isinstance(k, (int, np.integer)) and k >= 1
              and (g.nodes % k == 0 if g.nodes > 1 else g.gpus_per_node % k == 0))
        if not ok:
            unit = (f"{g.nodes} nodes" if g.nodes > 1 else f"{g.gpus_per_node} GPUs")
            raise SpecError(f"split[{name!r}]", k, f"a positive count dividing its {unit}")
        out[name] = int(k)
    return out


def identical(groups: Sequence[GroupCost]) -> tuple[GroupCost, ...]:
    """The groups as a planner made for identical GPUs sees them: every device the
    cluster's device-weighted average one."""
    n = sum(g.n for g in groups)
    avg = lambda f: sum(getattr(g, f) * g.n for g in groups) / n  # noqa: E731
    return tuple(dataclasses.replace(g, token_s=avg("token_s"), attention_s=avg("attention_s"),
                                     image_s=avg("image_s")) for g in groups)


# ---- pricing a placement ------------------------------------------------------------------

class _Pricer:
    """Row and micro-step times on one group (ring times cached per bucket)."""

    def __init__(self, group: GroupCost, cluster: Cluster | None, cal: Calibration):
        self.g = group
        self._ring: dict[int, float] = {}
        self._buckets: dict[int, tuple] = {}
        self.cluster, self.cal = cluster, cal
        # what hetshard.data.drafts asks of an owner
        self.name, self.buckets, self.step_s = group.name, tuple(group.buckets), group.step_s
        self.image_caps, self.merging = group.image_caps(), group

    def compose(self, p: Packing, images: np.ndarray | None = None,
                in_order: bool = False) -> tuple[list[_Step], float]:
        """``p``'s rows as micro-steps (:func:`_compose`, sorted by cost unless
        ``in_order``) and their time plus the group's update (a row's images are priced
        in its slots, whatever ``images`` holds)."""
        steps = _compose(self, p, sort=not in_order)
        return steps, sum(st.time_s for st in steps) + self.step_s

    def ring(self, bucket: int) -> float:
        """Seconds per layer for the K/V of a ``bucket`` row to go round its context
        group (an all-gather's volume)."""
        got = self._ring.get(bucket)
        if got is None:
            d = self.g.degree(bucket)
            if d <= 1 or self.cluster is None:
                got = 0.0
            else:
                topo = topology(self.cluster, self.g.devices[:d])
                got = collective_time("all_gather", self.g.kv_bytes_per_token * bucket,
                                      topo, self.cal, self.g.gpu)
            self._ring[bucket] = got
        return got

    def _of(self, bucket: int) -> tuple:
        """(degree, empty-row seconds, attention per squared token per device, ring
        seconds per layer) of ``bucket`` rows on this group, computed once. An empty row
        costs its token slots and its image slots (the encoder runs on every slot,
        ``GroupCost.image_time``)."""
        got = self._buckets.get(bucket)
        if got is None:
            g = self.g
            d = g.degree(bucket)
            got = (d, g.token_cost(bucket) * g.slots(bucket) + g.image_time(bucket),
                   g.attention_s / d, self.ring(bucket))
            self._buckets[bucket] = got
        return got

    def empty(self, bucket: int) -> float:
        return self._of(bucket)[1]

    def rows(self, p: Packing) -> np.ndarray:
        """Seconds of each of ``p``'s rows on one slot of this group: an empty row of its
        bucket, plus attention over its samples' squared lengths, plus the K/V ring where
        attention's forward does not hide it (forward and the backward's two passes)."""
        g = self.g
        starts = p.starts
        filled = p.counts > 0
        squares = np.zeros(p.counts.size, np.int64)
        squares[filled] = np.add.reduceat(p.lengths * p.lengths, starts[filled])
        kinds, which = np.unique(p.bucket, return_inverse=True)
        per = np.array([self._of(b) for b in kinds.tolist()], np.float64)[which]
        d, empty, per_square, ring = per.T
        attn = per_square * squares
        t = empty + attn
        exposed = ring - g.attention_fwd_share * attn / g.layers
        return np.where(d > 1, t + 3 * g.layers * np.maximum(0.0, exposed), t)


class _Step(NamedTuple):
    """A micro-step while planning: its bucket, context degree, its rows' indices in
    the packing, and seconds."""

    bucket: int
    degree: int
    rows: np.ndarray
    time_s: float

    def micro_step(self, rows: Sequence[Row]) -> MicroStep:
        """The plan's micro-step, ``rows`` the packing's."""
        return MicroStep(self.bucket, self.degree, tuple(rows[i] for i in self.rows.tolist()),
                         self.time_s)


def _compose(pricer: _Pricer, p: Packing, sort: bool) -> list[_Step]:
    """Micro-steps of ``p``'s rows per bucket: ``devices // degree`` rows each, sorted by
    cost when ``sort`` (else in the given order)."""
    g = pricer.g
    if not p.counts.size:
        return []
    times = pricer.rows(p)
    steps = []
    for bucket in np.unique(p.bucket).tolist():
        d = g.degree(bucket)
        if bucket > g.longest:
            raise SpecError("bucket", bucket, f"at most {g.longest} tokens on group "
                            f"{g.name!r} ({g.n} devices)")
        per = g.n // d
        mine = np.flatnonzero(p.bucket == bucket)
        if sort:
            mine = mine[np.argsort(-times[mine], kind="stable")]
        starts = np.arange(0, mine.size, per)
        slowest = np.maximum.reduceat(times[mine], starts).tolist()
        if mine.size % per:  # a part-empty last micro-step lasts at least an empty row
            slowest[-1] = max(slowest[-1], pricer.empty(bucket))
        for k, at in enumerate(starts.tolist()):
            steps.append(_Step(bucket, d, mine[at:at + per], slowest[k]))
    return steps


def _group_plan(pricer: _Pricer, samples: np.ndarray, lengths: np.ndarray,
                images: np.ndarray | None) -> GroupPlan:
    """One group's plan of ``samples`` (``hetshard.data.drafts.draft``)."""
    return draft(pricer, samples, lengths, images).plan()


def _sample_costs(groups: Sequence[GroupCost], lengths: np.ndarray,
                  images: np.ndarray | None) -> np.ndarray:
    """[groups, samples] device-seconds of each sample on each group (no padding, no
    ring), infinite where the group cannot hold it."""
    out = np.empty((len(groups), lengths.size))
    for k, g in enumerate(groups):
        c = g.token_s * lengths + g.attention_s * lengths.astype(np.float64) ** 2
        if images is not None:
            c = c + g.image_s * images
            c[~_holds(g, lengths, images)] = np.inf
        c[lengths > g.longest] = np.inf
        out[k] = c
    return out


def _holds(g: GroupCost, lengths: np.ndarray, images: np.ndarray) -> np.ndarray:
    """Whether some bucket of ``g`` holds each sample's tokens and its images."""
    buckets = np.asarray(g.buckets)
    most = np.maximum.accumulate(np.asarray(g.image_caps())[::-1])[::-1]
    at = np.searchsorted(buckets, lengths)
    return (at < buckets.size) & (images <= most[np.minimum(at, buckets.size - 1)])


def check_groups(groups, kind: type = GroupCost, field: str = "groups",
                 made_by: str = "group_costs, choose_groups") -> tuple:
    """``groups`` as a tuple of ``kind`` (``GroupCost``, or ``PipelineCost`` for
    pipelines) with distinct names: a plan names its groups, and two of one name could
    not be told apart when it runs.

    Raises:
      SpecError: none, an entry not a ``kind``, or a repeated name.
    """
    if isinstance(groups, kind):
        groups = (groups,)
    try:
        out = tuple(groups)
    except TypeError:
        raise SpecError(field, type(groups).__name__,
                        f"a sequence of {kind.__name__} ({made_by})") from None
    if not out:
        raise SpecError(field, [], f"at least one {kind.__name__}")
    for k, g in enumerate(out):
        if not isinstance(g, kind):
            raise SpecError(f"{field}[{k}]", type(g).__name__,
                            f"a {kind.__name__} ({made_by})")
    names = [g.name for g in out]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise SpecError(field, names, f"distinct names ({twice!r} twice)")
    return out


def plan_batch(lengths, groups: Sequence[GroupCost], *, images=None,
               cluster: Cluster | None = None, cal: Calibration = DEFAULT,
               method: str = "hetshard", max_context: int | None = None,
               rounds: int = 2, moves: int = 3, bound: bool = True) -> BatchPlan:
    """The per-batch plan of one global batch (see the module docstring).

    ``lengths``: tokens per sample (each image adds the groups' ``image_tokens``);
    ``images``: images per sample (None: a text batch); ``cluster``: where the groups'
    devices are (prices the context ring; None: no ring cost); ``method``: one of
    ``METHODS``; ``max_context``: the largest row (default: the groups' largest bucket);
    ``rounds``: placements re-run with the priced speeds; ``moves``: local-search moves
    after them.

    Raises:
      SpecError: empty or non-positive lengths, a sample longer than ``max_context``,
        images on groups without a vision encoder, an unknown method.
    """
    # The planner allocates many small objects; a full garbage collection landing in
    # it would cost more than the planning (collected after, not during).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _plan_batch(lengths, groups, images, cluster, cal, method, max_context,
                           rounds, moves, bound)
    finally:
        if collecting:
            gc.enable()


def _plan_batch(lengths, groups, images, cluster, cal, method, max_context, rounds,
                moves, bound) -> BatchPlan:
    t0 = time.perf_counter()
    if method not in METHODS:
        raise SpecError("method", method, f"one of {METHODS}")
    groups = check_groups(groups)
    check_count("rounds", rounds, 1)
    check_count("moves", moves, 0)
    if max_context is not None and (not whole(max_context) or max_context < 1):
        raise SpecError("max_context", max_context, "a positive token count, or None (the "
                        "groups' largest bucket)")
    lengths = check_lengths(lengths)
    img = None
    if images is not None:
        img = check_images(images, lengths)
        if img.any() and any(g.image_s <= 0 for g in groups):
            raise SpecError("images", f"{int(img.sum())} images",
                            "a text-only batch: these groups price no vision encoder "
                            "(group_costs(vision=...))")
        lengths = lengths + img * groups[0].image_tokens
    top = max_context if max_context is not None else max(g.buckets[-1] for g in groups)
    over = np.flatnonzero(lengths > top)
    if over.size:
        i = int(over[0])
        raise SpecError(f"lengths[{i}]", int(lengths[i]),
                        f"at most max_context={top} tokens"
                        + (" (with its images' tokens)" if img is not None else ""))
    if img is not None:
        if method in ("pad", "fixed-cp"):  # rows of the largest bucket on every group
            check_fits(lengths, img, (top,), (min(g.images_of(top) for g in groups),))
        else:
            held = np.zeros(lengths.size, bool)
            for g in groups:
                held |= _holds(g, lengths, img)
            if not held.all():
                i = int(np.flatnonzero(~held)[0])
                most = max(max(g.image_caps()) for g in groups)
                raise SpecError(f"images[{i}]", int(img[i]),
                                f"as many images as some group's rows of at least "
                                f"{int(lengths[i])} tokens hold (at most {most} a row; "
                                f"group_costs(images_per_row=))")
    pricers = [_Pricer(g, cluster, cal) for g in groups]
    n = np.array([g.n for g in groups], dtype=np.float64)
    if method in ("pad", "fixed-cp"):
        # rows of the largest bucket shared in proportion to each group's speed on them
        slots = None if img is None else min(g.images_of(top) for g in groups)
        speeds = np.array([g.n / (g.token_s * top + g.attention_s * top ** 2)
                           for g in groups])
        plan = tuple(d.plan() for d in static(method, pricers, speeds, lengths, img, top,
                                              slots))
    else:
        believed = identical(groups) if method == "identical" else groups
        costs = _sample_costs(believed, lengths, img)
        if not np.isfinite(costs.min(axis=0)).all():
            i = int(np.flatnonzero(~np.isfinite(costs.min(axis=0)))[0])
            raise SpecError(f"lengths[{i}]", int(lengths[i]), "a sample some group can hold")
        believed_pricers = pricers if believed is groups else [
            _Pricer(b, cluster, cal) for b in believed]
        # The planner prices its choice with the costs it believes in ...
        best = place(lambda k, samples: draft(believed_pricers[k], samples, lengths, img),
                     costs, n, [g.step_s for g in groups], rounds)
        best = _rebalance(best, believed_pricers, costs, n, lengths, img, moves)
        # ... and runs it on the real GPUs.
        plan = tuple(d.plan() for d in best.drafts) if believed is groups else tuple(
            _group_plan(p, best.parts[k], lengths, img) for k, p in enumerate(pricers))
    planning = time.perf_counter() - t0
    step = max(g.time_s for g in plan)
    lb = lower_bound(lengths, groups, img) if bound else None
    return BatchPlan(method, plan, step, int(lengths.sum()), lb, planning)


def _rebalance(best: Placement, pricers, costs: np.ndarray, n: np.ndarray,
               lengths: np.ndarray, img: np.ndarray | None, moves: int) -> Placement:
    """Local search on a placement ``best``: the slowest group
    hands its sparsest part-empty micro-step whole to a group with room for its rows
    (``_sparsest_step``), or the group that finishes first its shortest samples, worth
    a half or a quarter of the difference between them (priced on the receiver, no
    padding), or its longest sample; a move is kept where the priced step falls. Micro-
    steps are coarse (a step of short rows is one row a device), so the placement's
    estimate misses by up to a micro-step a group; the priced plans do not. At most
    ``SEARCH_PACKINGS`` group packings are priced (a packing of a thousand samples is
    about a millisecond here), whatever ``moves``."""
    worst, parts, seen = best
    parts, seen = list(parts), list(seen)
    budget = SEARCH_PACKINGS
    for _ in range(moves):
        times = np.array([d.time_s for d in seen])
        k, j = int(np.argmax(times)), int(np.argmin(times))
        mine = parts[k]
        if k == j or mine.size < 2:
            break
        order = mine[np.argsort(lengths[mine], kind="stable")]
        gain = np.cumsum(costs[j, order] / n[j])
        tries = [(order[:max(1, int(np.searchsorted(gain, f * (times[k] - times[j]))))], j)
                 for f in (0.5, 0.25)] + [(order[-1:], j)]
        sparse = _sparsest_step(seen[k], pricers[k].g.n)
        if sparse is not None:  # first, to the fastest group with room for its rows (else j)
            moved, bucket, rows = sparse
            to = next((i for i in np.argsort(times).tolist() if i != k
                       and _room(seen[i], pricers[i].g, bucket) >= rows), j)
            tries.insert(0, (moved, to))
        for moved, to in tries:
            if budget <= 0:
                break
            if not np.isfinite(costs[to, moved]).all() or moved.size >= mine.size:
                continue
            keep = np.setdiff1d(mine, moved, assume_unique=True)
            got = np.sort(np.concatenate([parts[to], moved]))
            dj = draft(pricers[to], got, lengths, img)
            budget -= 1
            if dj.time_s >= worst - 1e-12:
                continue  # the receiver alone is as slow as the step was
            dk = draft(pricers[k], keep, lengths, img)
            budget -= 1
            step = max([dk.time_s, dj.time_s] + [d.time_s for i, d in enumerate(seen)
                                                 if i not in (k, to)])
            if step < worst - 1e-12:
                worst, parts[k], parts[to], seen[k], seen[to] = step, keep, got, dk, dj
                break
        else:
            break  # no move helps
    return Placement(worst, parts, tuple(seen))


def _sparsest_step(drafted: Draft, devices: int):
    """(samples, bucket, rows) of ``drafted``'s part-empty micro-step with the fewest rows
    a device slot (None if every micro-step is full): moved whole, the group runs one
    micro-step less, and a group with room in a part-empty micro-step of that bucket
    takes them almost for free. The sample moves cannot see this: they price samples,
    not the coarse micro-steps they fill."""
    p = drafted.packing
    if p is None:
        return None
    best, fill = None, 1.0
    for bucket, d, idx, _ in drafted.steps:
        f = idx.size / (devices // d)
        if f < fill:
            best, fill = (idx, bucket), f
    if best is None:
        return None
    idx, bucket = best
    return p.samples[ranges(p.starts[idx], p.counts[idx])], bucket, idx.size


def _room(drafted: Draft, g: GroupCost, bucket: int) -> int:
    """Empty row slots in ``drafted``'s micro-steps of ``bucket`` on ``g``."""
    return sum(g.n // d - idx.size for b, d, idx, _ in drafted.steps if b == bucket)


# ---- the bound -----------------------------------------------------------------------------

def lower_bound(lengths, groups: Sequence[GroupCost], images=None) -> float:
    """No placement, packing or composition beats this: the least T such that the
    samples, split fractionally between groups, take at most T - step_s of every device
    of each group, counting each sample's tokens and attention only (no padding, no
    ring). A linear program: solved exactly by sorting for two groups, by OR-tools GLOP
    for more. ``lengths`` count each sample's image tokens too (``images``: per sample,
    the vision encoder's work).

    Raises:
      SpecError: lengths or images as ``plan_batch`` refuses them, or ``groups`` that
        are not distinct GroupCosts.
    """
    groups = check_groups(groups)
    lengths = check_lengths(lengths)
    if images is not None:
        images = check_images(images, lengths)
    costs = _sample_costs(groups, lengths, images)
    if len(groups) == 1:
        g = groups[0]
        total = costs[0].sum()
        return float(total / g.n + g.step_s) if np.isfinite(total) else float("nan")
    if len(groups) == 2:
        return _two_group_bound(costs, groups)
    return fractional_bound(costs, range(len(groups)), [g.n for g in groups],
                            [g.step_s for g in groups])


def _two_group_bound(costs: np.ndarray, groups: Sequence[GroupCost]) -> float:
    """The two-group LP's optimum. Some optimum gives the first group the samples with
    the least cost ratio (first's over second's): exchanging a fraction of a sample it
    holds for one of a lower ratio the second holds, at equal load on the second, never
    adds to the first's load. So the optimum is a prefix of the samples sorted by that
    ratio, one sample split where the two groups' finishing times cross."""
    a, b = groups
    c1, c2 = costs
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(np.isinf(c1), np.inf, np.where(np.isinf(c2), -np.inf, c1 / c2))
    order = np.argsort(ratio, kind="stable")
    c1, c2 = c1[order], c2[order]
    # t1[j]: the first group's time holding samples [0, j); t2[j]: the second's, [j, N)
    t1 = np.concatenate([[0.0], np.cumsum(c1)]) / a.n + a.step_s
    t2 = np.concatenate([np.cumsum(c2[::-1])[::-1], [0.0]]) / b.n + b.step_s
    if (np.isinf(c1) & np.isinf(c2)).any():
        return float("nan")  # a sample neither group holds: infeasible
    # j: the last prefix the first group finishes no later than the second (t1 rises,
    # t2 falls); sample j then moves over by the fraction f where both finish together
    first = np.flatnonzero(t1 <= t2)
    if not first.size:
        return float(t1[0])  # the first group's fixed step outlasts every sample on the other
    j = int(first[-1])
    if j == c1.size:
        return float(t2[j])  # all on the first group, within the second's fixed step
    d1, d2 = c1[j] / a.n, c2[j] / b.n
    if np.isinf(d1):
        return float(t2[j])
    if np.isinf(d2):
        return float(t1[j + 1])
    f = float(np.clip((t2[j] - t1[j]) / (d1 + d2), 0.0, 1.0))
    return float(max(t1[j] + f * d1, t2[j] - f * d2))


