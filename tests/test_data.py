"""Data-aware planning (hetshard.data): packing, per-batch placement against brute force,
the lower bound, bad sample lists, packed arrays and the flash kernel's segment skipping."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetshard.cost.calibration import DEFAULT
from hetshard.data import (
    GroupCost,
    Row,
    geometric_buckets,
    lower_bound,
    pack,
    packed_arrays,
    plan_batch,
    planner,
)
from hetshard.data.packing import Packing
from hetshard.data.planner import _compose, _group_plan, _Pricer, _two_group_bound
from hetshard.data.search import fractional_bound
from hetshard.errors import SpecError
from hetshard.kernels.flash_attention import (
    block_flags,
    block_ranges,
    flash_attention_positions,
)
from hetshard.kernels.reference import attention_reference


def _groups(fast=(2, 1.0, 0.02), slow=(2, 3.0, 0.05), chunk=8, buckets=(8, 16)):
    out = []
    for k, (n, token_s, attn) in enumerate((fast, slow)):
        start = sum(g.n for g in out)
        out.append(GroupCost(name=f"g{k}", gpu=f"gpu{k}", devices=tuple(range(start, start + n)),
                             chunk=chunk, token_s=token_s, attention_s=attn,
                             attention_fwd_share=0.3, layers=2, kv_bytes_per_token=0.0,
                             buckets=buckets))
    return tuple(out)


@pytest.mark.parametrize("order", ["best-fit", "sequential"])
def test_packing_keeps_every_sample_exactly_once(order):
    rng = np.random.default_rng(1)
    for _ in range(20):
        lengths = rng.integers(1, 65, rng.integers(1, 60))
        rows = pack(lengths, (16, 32, 64), order=order)
        seen = sorted(i for r in rows for i in r.samples)
        assert seen == list(range(lengths.size))
        for r in rows:
            assert r.used <= r.bucket
            assert list(r.lengths) == [int(lengths[i]) for i in r.samples]
        if order == "sequential":
            assert {r.bucket for r in rows} == {64}


def test_best_fit_fills_the_long_rows_leftovers_with_short_samples():
    rows = pack([40, 3, 20, 5], (16, 64))
    # 40 + 20 + 3 = 63 fit one 64-row; 5 then opens the smallest bucket that takes it.
    assert sorted((r.bucket, r.used) for r in rows) == [(16, 5), (64, 63)]


def test_best_fit_places_runs_of_equal_lengths_as_one_sample_at_a_time_would():
    """pack places a run of equal lengths a row at a time; it must give the rows of plain
    best-fit decreasing (each sample into the open row with the least room that takes
    it, the lower row first among equal rooms, else a new row of the smallest bucket)."""
    def one_at_a_time(lengths, buckets):
        rows = []  # [bucket, room, samples]
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            n = lengths[i]
            fits = [r for r in rows if r[1] >= n]
            if fits:
                row = min(fits, key=lambda r: r[1])  # min keeps the first of equal rooms
            else:
                row = [min(b for b in buckets if b >= n), 0, []]
                row[1] = row[0]
                rows.append(row)
            row[1] -= n
            row[2].append(i)
        return [(b, tuple(ss)) for b, _, ss in rows]

    rng = np.random.default_rng(7)
    for _ in range(200):
        lengths = rng.choice([1, 2, 3, 5, 8, 13, 16, 20, 31, 40], rng.integers(1, 50)).tolist()
        got = [(r.bucket, r.samples) for r in pack(lengths, (8, 16, 32, 64))]
        assert got == one_at_a_time(lengths, (8, 16, 32, 64))


def test_geometric_buckets():
    assert geometric_buckets(4096, 32768, 4) == (4096, 8192, 16384, 32768)
    assert geometric_buckets(4096, 131072, 4) == (4096, 16384, 32768, 131072)
    assert geometric_buckets(4096, 4096, 4) == (4096,)


@pytest.mark.parametrize("lengths, field", [
    ([5, 0, 3], "lengths[1]"), ([5, -2], "lengths[1]"), ([5, 2.5], "lengths[1]"),
    ([], "lengths"), ([5, 17], "lengths[1]"), ([5, "7"], "lengths[1]"),
    ([5, True], "lengths[1]"), ([5, float("nan")], "lengths[1]"), ([5, 10 ** 30], "lengths[1]"),
    ([[5, 2], [3]], "lengths")])
def test_malformed_sample_lists_are_refused_naming_the_sample(lengths, field):
    with pytest.raises(SpecError) as e:
        plan_batch(lengths, _groups(), bound=False)
    assert e.value.field == field
    with pytest.raises(SpecError):
        pack(lengths, (8, 16))


@pytest.mark.parametrize("kwargs, field", [
    (dict(groups="g0"), "groups[0]"), (dict(groups=[1]), "groups[0]"), (dict(groups=()), "groups"),
    (dict(rounds=0), "rounds"), (dict(moves=-1), "moves"), (dict(moves="3"), "moves"),
    (dict(rounds=True), "rounds"), (dict(max_context=0), "max_context"),
    (dict(images=[-1, 0]), "images[0]"), (dict(images=[0.5, 0]), "images[0]")])
def test_bad_planner_arguments_are_refused_naming_the_field(kwargs, field):
    args = {"groups": _groups(), "bound": False, **kwargs}
    with pytest.raises(SpecError) as e:
        plan_batch([4, 4], args.pop("groups"), **args)
    assert e.value.field == field
    with pytest.raises(SpecError, match="g0' twice") as e:  # a plan names its groups
        plan_batch([4, 4], (_groups()[0], _groups()[0]))
    assert e.value.field == "groups"
    with pytest.raises(SpecError) as e:
        lower_bound([], _groups())
    assert e.value.field == "lengths"


def test_packed_arrays_refuse_rows_naming_samples_not_in_the_list():
    with pytest.raises(SpecError) as e:
        packed_arrays([np.arange(3)], [Row(8, (0, 1), (3, 3))])
    assert e.value.field == "rows[0].samples"


def test_images_need_a_vision_encoder_and_one_count_per_sample():
    with pytest.raises(SpecError, match="vision encoder") as e:
        plan_batch([4, 4], _groups(), images=[1, 0], bound=False)
    assert e.value.field == "images"
    groups = tuple(g.__class__(**{**g.__dict__, "image_s": 0.5, "image_tokens": 2})
                   for g in _groups())
    with pytest.raises(SpecError, match="one per sample"):
        plan_batch([4, 4], groups, images=[1], bound=False)
    with pytest.raises(SpecError, match="max_context"):  # 14 tokens + 2 images of 2 > 16
        plan_batch([14, 4], groups, images=[2, 0], bound=False)
    r = plan_batch([10, 4], groups, images=[2, 0], bound=False)
    assert sum(g.images for g in r.groups) == 2


def _brute_force(lengths, groups):
    pricers = [_Pricer(g, None, None) for g in groups]
    lengths = np.asarray(lengths)
    best = np.inf
    for where in itertools.product(range(len(groups)), repeat=lengths.size):
        where = np.asarray(where)
        t = max(_group_plan(p, np.flatnonzero(where == k), lengths, None).time_s
                for k, p in enumerate(pricers))
        best = min(best, t)
    return best


def test_per_batch_placement_against_brute_force_on_tiny_batches():
    rng = np.random.default_rng(0)
    groups = _groups()
    ratios = []
    for _ in range(12):
        lengths = rng.integers(1, 17, 7)
        got = plan_batch(lengths, groups)
        best = _brute_force(lengths, groups)
        # the planner's plan is one of the placements searched, priced the same way
        assert got.step_time_s >= best - 1e-9
        # the bound is a bound
        assert got.bound_s <= best + 1e-9
        ratios.append(got.step_time_s / best)
    assert max(ratios) <= 1.35, ratios
    assert np.median(ratios) <= 1.1, ratios


def test_moving_samples_off_the_slowest_group_never_slows_a_plan():
    """The local search after placement (``moves``) keeps a move only where the priced
    step falls: never slower than the placement alone, and here, where micro-steps are
    coarse against the batch, faster on most batches."""
    rng = np.random.default_rng(0)
    faster = 0
    for _ in range(20):
        lengths = rng.integers(1, 17, 25)
        alone = plan_batch(lengths, _groups(), moves=0, bound=False)
        moved = plan_batch(lengths, _groups(), bound=False)
        assert moved.step_time_s <= alone.step_time_s + 1e-12
        faster += moved.step_time_s < alone.step_time_s - 1e-9
        assert sorted(i for g in moved.groups for i in g.samples) == list(range(25))
    assert faster >= 10


def test_a_part_empty_micro_step_moves_whole_to_a_group_with_room(monkeypatch):
    """The slowest group's sparsest part-empty micro-step is offered whole to the groups
    with room for its rows in a micro-step of that bucket: that group then runs one
    micro-step less, which no move of single samples (priced without the coarse
    micro-steps) finds. Against the search without that move, on replicas of a fast
    type beside a slow one: a quarter of the batches faster, and faster in total."""
    def groups():
        out, start = [], 0
        for name, n, token_s, attn in (("a/0", 4, 1.0, 0.01), ("a/1", 4, 1.0, 0.01),
                                       ("b", 8, 2.5, 0.03)):
            out.append(GroupCost(name=name, gpu=name[0], devices=tuple(range(start, start + n)),
                                 chunk=8, token_s=token_s, attention_s=attn,
                                 attention_fwd_share=0.3, layers=2, kv_bytes_per_token=0.0,
                                 buckets=(8, 32)))
            start += n
        return tuple(out)

    rng = np.random.default_rng(0)
    batches = [np.minimum(rng.geometric(0.2, 160), 32) for _ in range(30)]
    with_move = [plan_batch(b, groups(), bound=False) for b in batches]
    monkeypatch.setattr(planner, "_sparsest_step", lambda *a: None)
    without = [plan_batch(b, groups(), bound=False) for b in batches]
    faster = sum(a.step_time_s < b.step_time_s - 1e-9
                 for a, b in zip(with_move, without, strict=True))
    assert faster >= len(batches) // 4, faster
    assert sum(a.step_time_s for a in with_move) < sum(b.step_time_s for b in without)
    for plan, lengths in zip(with_move, batches, strict=True):
        assert sorted(i for g in plan.groups for i in g.samples) == list(range(lengths.size))


def test_the_planner_gives_the_fast_group_more_work():
    lengths = np.full(40, 8)
    r = plan_batch(lengths, _groups(), method="hetshard")
    fast, slow = (len(g.samples) for g in r.groups)
    assert fast > 2 * slow
    same = plan_batch(lengths, _groups(), method="identical")
    assert abs(len(same.groups[0].samples) - len(same.groups[1].samples)) <= 2
    assert r.step_time_s < same.step_time_s


def test_long_rows_get_a_context_degree_and_short_rows_none():
    r = plan_batch([16, 3, 2, 4, 5], _groups(), bound=False)
    steps = [s for g in r.groups for s in g.steps]
    assert {(s.bucket, s.degree) for s in steps} <= {(8, 1), (16, 2)}
    assert any(s.degree == 2 for s in steps)
    assert len(r.shapes) <= 4


def test_a_part_empty_micro_step_is_not_merged_into_long_remat_rows():
    """Three 16-token rows on 4 devices run as two micro-steps of 2 rows; the last one's
    row must not be merged up into a 64-token row, which on this group runs under the
    long remat at twice the slots per device (the merge cost 4x its row's time)."""
    g = dataclasses.replace(_groups(fast=(4, 1.0, 0.02))[0], buckets=(8, 16, 64),
                            long_remat="full", long_chunk=16, long_token_s=1.5)
    assert g.slots(64) > g.slots(16)  # 64-rows run in the long regime here
    pricer = _Pricer(g, None, DEFAULT)
    lengths = np.array([16, 16, 16])
    plan = _group_plan(pricer, np.arange(3), lengths, None)
    assert {s.bucket for s in plan.steps} == {16}
    merged = _compose(pricer, Packing.of(pack([16, 16], (16,)) + pack([16], (64,))), True)
    assert {bucket for bucket, _, _, _ in merged} == {16, 64}
    assert plan.time_s < sum(t for _, _, _, t in merged) + g.step_s


def test_a_part_empty_micro_step_stays_where_merging_it_up_opens_a_dearer_ring():
    """Five 8-token rows on 4 devices: the fifth alone in a micro-step, or merged up
    into a 32-token row over all 4 devices. Where that row's K/V ring is dear (and no
    32-row micro-step ran anyway) the part-empty micro-step is kept; with no ring cost,
    the merge (attention spread over 4 devices) is."""
    from hetshard.cluster import Cluster
    cluster = Cluster.from_dict({"name": "one-node", "groups": [
        {"name": "g0", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 4}]})
    g = dataclasses.replace(_groups(fast=(4, 1.0, 0.02))[0], gpu="A100-80GB",
                            buckets=(8, 32), kv_bytes_per_token=1e10)
    lengths = np.full(5, 8)
    merged = _compose(_Pricer(g, cluster, DEFAULT),
                      Packing.of(pack([8] * 4, (8,)) + pack([8], (32,))), True)
    dear = _group_plan(_Pricer(g, cluster, DEFAULT), np.arange(5), lengths, None)
    assert [s.bucket for s in dear.steps] == [8, 8]
    assert dear.time_s < sum(t for _, _, _, t in merged) + g.step_s
    free = _group_plan(_Pricer(g, None, DEFAULT), np.arange(5), lengths, None)
    assert sorted(s.bucket for s in free.steps) == [8, 32]


def test_lower_bound_is_below_every_method():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 17, 30)
    lb = lower_bound(lengths, _groups())
    for m in ("pad", "fixed-cp", "identical", "hetshard"):
        assert plan_batch(lengths, _groups(), method=m, bound=False).step_time_s >= lb


def test_two_group_bound_is_the_linear_programs_optimum():
    """The sorted-ratio bound equals GLOP's optimum of the same LP (the shared
    ``fractional_bound``, each group one resource of itself), with fixed step times (a
    group's update outlasting its share) and samples only one group holds."""
    rng = np.random.default_rng(5)
    base = _groups()
    for trial in range(60):
        groups = tuple(dataclasses.replace(
            g, devices=tuple(range(int(rng.integers(1, 6)))),
            step_s=float(rng.exponential(1.0)) * (trial % 3)) for g in base)
        costs = rng.exponential(1.0, (2, int(rng.integers(1, 25)))) * \
            rng.exponential(1.0, (2, 1))
        if trial % 4 == 0:  # some samples fit on one group only
            only = rng.random(costs.shape) < 0.25
            only[1] &= ~only[0]
            costs[only] = np.inf
        want = fractional_bound(costs, [0, 1], [g.n for g in groups],
                                [g.step_s for g in groups])
        got = _two_group_bound(costs, groups)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), trial
    # nothing fits one sample: no bound
    assert np.isnan(_two_group_bound(np.array([[1.0, np.inf], [2.0, np.inf]]), base))


def test_packed_arrays_restart_positions_per_sample():
    samples = [np.array([1, 2, 3]), np.array([4, 5]), np.array([6])]
    rows = pack([3, 2, 1], (8,))
    a = packed_arrays(samples, rows)
    assert a["tokens"].shape == (1, 8)
    seg, pos, w = a["segment_ids"][0], a["positions"][0], a["loss_weight"][0]
    assert seg.tolist() == [1, 1, 1, 2, 2, 3, 0, 0]
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert a["tokens"][0].tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert a["targets"][0, :2].tolist() == [2, 3]
    assert w.tolist() == [1, 1, 0, 1, 0, 0, 0, 0]  # each sample's last token has no target
    with pytest.raises(SpecError, match="one bucket"):
        packed_arrays(samples, pack([3, 2, 1], (1, 2, 3)))


@pytest.mark.parametrize("order", ["best-fit", "sequential"])
def test_multimodal_packing_keeps_every_sample_once_and_each_row_within_its_image_slots(order):
    rng = np.random.default_rng(2)
    caps = {16: 1, 32: 2, 64: 6}
    for _ in range(20):
        images = rng.integers(0, 4, rng.integers(1, 60))
        lengths = rng.integers(1, 40, images.size) + 8 * images
        lengths = np.minimum(lengths, 64)
        images = np.minimum(images, lengths // 8)  # what a sample's tokens hold
        rows = pack(lengths, (16, 32, 64), order=order, images=images, images_per_row=caps)
        assert sorted(i for r in rows for i in r.samples) == list(range(lengths.size))
        for r in rows:
            assert r.used <= r.bucket
            assert images[list(r.samples)].sum() <= caps[r.bucket]
    # a 10-token sample with 2 images skips the 16-token bucket (1 image a row)
    assert [r.bucket for r in pack([10], (16, 32, 64), images=[2], images_per_row=caps)] \
        == [32]
    # an image-less sample fills the room a full row's images leave
    rows = pack([12, 4], (16,), images=[1, 0], images_per_row=1)
    assert [r.samples for r in rows] == [(0, 1)]


def test_multimodal_best_fit_is_plain_best_fit_decreasing_with_image_room():
    """pack keeps rows whose image slots are full apart from those with room (searched
    only by image-less samples); it must give the rows of the one-list rule: each sample,
    longest first, into the open row with the least token room that takes its tokens and
    has room for its images (the lower row first among equal rooms), else a new row of
    the smallest bucket holding both. Drawn where images bind, so most rows fill their
    slots first."""
    def one_at_a_time(lengths, images, buckets, caps):
        rows = []  # [bucket, room, image room, samples]
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            n, k = lengths[i], images[i]
            fits = [r for r in rows if r[1] >= n and r[2] >= k]
            if fits:
                row = min(fits, key=lambda r: r[1])  # min keeps the first of equal rooms
            else:
                b = min(b for b in buckets if b >= n and caps[b] >= k)
                row = [b, b, caps[b], []]
                rows.append(row)
            row[1] -= n
            row[2] -= k
            row[3].append(i)
        return [(b, tuple(ss)) for b, _, _, ss in rows]

    rng = np.random.default_rng(11)
    caps = {16: 1, 32: 2, 64: 4}
    for _ in range(200):
        images = rng.choice([0, 0, 1, 1, 2, 3, 4], rng.integers(1, 80))
        lengths = np.minimum(64, rng.choice([1, 2, 3, 5, 8, 13], images.size) + 4 * images)
        got = [(r.bucket, r.samples) for r in pack(lengths, (16, 32, 64), images=images,
                                                   images_per_row=caps)]
        assert got == one_at_a_time(lengths.tolist(), images.tolist(), (16, 32, 64), caps)


@pytest.mark.parametrize("kwargs, field", [
    (dict(images=[7], images_per_row={16: 2, 64: 6}), "images[0]"),  # 7 > every cap
    (dict(images=[1], images_per_row={16: 2}), "images_per_row"),  # 64 missing
    (dict(images=[1], images_per_row={16: 2, 64: -1}), "images_per_row[64]"),
    (dict(images=[1, 2], images_per_row=2), "images"),
    (dict(images=[-1], images_per_row=2), "images[0]"),
    (dict(images=[1]), "images_per_row"),
])
def test_malformed_multimodal_packing_is_refused(kwargs, field):
    with pytest.raises(SpecError) as e:
        pack([10], (16, 64), **kwargs)
    assert e.value.field == field


def _mm_samples(rng, spec, image_tokens=16):
    from hetshard.data import IMAGE_TOKEN
    out = []
    for n, k in spec:
        tok = rng.integers(0, 256, n).astype(np.int32)
        tok = np.concatenate([tok[:1], np.full(image_tokens * k, IMAGE_TOKEN, np.int32),
                              tok[1:]])
        out.append({"tokens": tok, "images": rng.normal(size=(k, 16, 16, 3))
                    .astype(np.float32)})
    return out


def test_multimodal_packed_arrays_equal_the_models_own_packer():
    """hetshard.data.packed_arrays of multimodal samples gives what models.mllm.pack
    (written for the model, first fit) gives for the same rows."""
    import hetshard_models as models
    from hetshard.data import target_count
    from hetshard_models.mllm import pack as mllm_pack

    config = models.resolve("llava-tiny")
    samples = _mm_samples(np.random.default_rng(0), ((13, 1), (7, 0), (5, 2), (3, 1)))
    want = mllm_pack(samples, config=config, seq_len=64, images_per_row=4)
    n = [s["tokens"].size for s in samples]
    rows = [Row(64, (0, 1, 3), (n[0], n[1], n[3])), Row(64, (2,), (n[2],))]  # its first fit
    got = packed_arrays(samples, rows, images_per_row=4, image_tokens=16)
    for key in want:
        np.testing.assert_array_equal(got["loss_weight" if key == "loss_mask" else key],
                                      want[key], err_msg=key)
    assert target_count(samples) == int(want["loss_mask"].sum())
    with pytest.raises(SpecError) as e:  # 2 images in a row of 1
        packed_arrays(samples, rows, images_per_row=1, image_tokens=16)
    assert e.value.field == "rows[0]"
    bad = [dict(samples[0], tokens=samples[0]["tokens"][:-17])] + samples[1:]
    with pytest.raises(SpecError) as e:
        packed_arrays(bad, [Row(64, (0,), (n[0] - 17,))], images_per_row=4, image_tokens=16)
    assert e.value.field == "samples[0].tokens"
    with pytest.raises(SpecError) as e:
        packed_arrays(samples, rows, images_per_row=4)
    assert e.value.field == "image_tokens"


def test_image_slots_are_priced_padding_too():
    """A row's image dimension is compiled: every slot runs the encoder, so a row with
    one image costs as much as one with its bucket's full slots, and more slots cost
    more; a sample with more images than any row holds is refused."""
    base = dict(chunk=16, token_s=1.0, attention_s=0.0, attention_fwd_share=0.5, layers=2,
                kv_bytes_per_token=0.0, buckets=(16, 32), image_s=3.0, image_tokens=4)
    few, many = (GroupCost(name="g", gpu="A100-80GB", devices=(0, 1), image_slots=slots,
                           **base)
                 for slots in ((1, 2), (4, 8)))
    one = plan_batch([6], (few,), images=[1], bound=False).step_time_s
    assert plan_batch([6], (many,), images=[1], bound=False).step_time_s == \
        pytest.approx(one + 3 * 3.0)
    assert plan_batch([2], (many,), images=[0], bound=False).step_time_s == \
        plan_batch([6], (many,), images=[1], bound=False).step_time_s
    with pytest.raises(SpecError) as e:
        plan_batch([6, 3], (few,), images=[3, 0], bound=False)
    assert e.value.field == "images[0]"
    # the fixed-cp baseline starts a new row where the images run out
    r = plan_batch([4, 4, 4], (few,), images=[2, 1, 0], method="fixed-cp", bound=False)
    assert [len(row.samples) for st in r.groups[0].steps for row in st.rows] == [1, 2]


def test_a_context_stage_splits_a_rows_images_and_the_encoders_activations_over_it():
    """On a data x context stage a row's tokens split along the sequence and its images
    (and the encoder's activations, of other lengths than the plan's sequence) by their
    batch over the context axis too, so that a row's context group shares its encoding
    rather than each device encoding every image."""
    import types

    from jax.sharding import Mesh

    from hetshard._plan import Stage
    from hetshard.layout import batch_sharding, boundary_layout

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "context"))
    stage = Stage(0, 2, (0, 1, 2, 3), "A100-80GB", (("data", 2), ("context", 2)))
    got = batch_sharding({"tokens": np.zeros((2, 64)), "images": np.zeros((2, 4, 8, 8, 3)),
                          "odd": np.zeros((2, 3, 5))}, types.SimpleNamespace(seq_len=64), mesh)
    assert tuple(got["tokens"].spec) == tuple(got["images"].spec) == ("data", "context")
    assert tuple(got["odd"].spec) == ("data",)
    spec = lambda shape, seq=64: tuple(boundary_layout(stage, mesh, shape, seq).spec)  # noqa: E731
    assert spec((8, 17, 32)) == (("data", "context"),)  # the encoder's 8 images of 17 patches
    assert spec((2, 64, 32)) == ("data", "context")  # the decoder's sequence
    assert spec((6, 17, 32)) == ("data",)  # 6 images do not split 4 ways
    assert spec((8, 17, 32), None) == ("data",)  # no sequence named: as before


def test_flash_kernel_skips_blocks_of_other_segments():
    """A packed row's query block computes only the key blocks of its own documents:
    [24 | 24 | 16] tokens in blocks of 8."""
    seg = jnp.array([[1] * 24 + [2] * 24 + [3] * 16])
    pos = jnp.concatenate([jnp.arange(24), jnp.arange(24), jnp.arange(16)])[None]
    active, full = block_flags(pos, pos, seg, seg, 8, 8, True, True)
    ranges = np.asarray(block_ranges(active, full))[0]
    # query block 4 (tokens 32-39, document 2's) sees key blocks 3 and 4 only, block 3
    # unmasked (all before it, one document); block 7 (document 3) blocks 6 and 7
    assert tuple(ranges[4]) == (3, 3, 4, 5) and tuple(ranges[7]) == (6, 6, 7, 8)
    # the blocks computed are the causal ones of each document: 6 + 6 + 3
    assert int(sum(hi - lo for lo, _, _, hi in ranges)) == 15
    # without segment ids, everything before the diagonal (36 blocks)
    active, full = block_flags(pos * 0 + jnp.arange(64), pos * 0 + jnp.arange(64), seg, seg,
                               8, 8, True, False)
    assert int(sum(hi - lo for lo, _, _, hi in np.asarray(block_ranges(active, full))[0])) \
        == 36


def test_packed_flash_attention_equals_each_sample_alone():
    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(kk, (1, 64, 2, 16)) for kk in jax.random.split(key, 3))
    seg = jnp.array([[1] * 24 + [2] * 24 + [3] * 16])
    pos = jnp.concatenate([jnp.arange(24), jnp.arange(24), jnp.arange(16)])[None]
    out, _ = flash_attention_positions(q, k, v, pos, pos, causal=True, segment_ids=seg,
                                       block_q=16, block_k=16)
    at = 0
    for n in (24, 24, 16):
        sl = slice(at, at + n)
        want = attention_reference(q[:, sl], k[:, sl], v[:, sl], causal=True)
        np.testing.assert_allclose(out[:, sl], want, rtol=2e-5, atol=2e-5)
        at += n


_PAD = 16  # samples padded at the end to a multiple of this many tokens


def _padded(n: int) -> int:
    return -(-n // _PAD) * _PAD


def _text_sample_ce(model, tokens, targets, mask):
    """Summed next-token cross-entropy of one token sample, alone: ``tokens`` and
    ``targets`` padded at the end, ``mask`` true on its real targets (the models are
    causal: the padding changes no real position's logits)."""
    import optax
    logits = model(tokens[None])
    return (optax.softmax_cross_entropy_with_integer_labels(logits[0], targets) * mask).sum()


def _text_inputs(s):
    s = np.asarray(s)
    n = len(s) - 1
    pad = _padded(n) - n
    return (np.pad(s[:-1], (0, pad)), np.pad(s[1:], (0, pad)),
            np.pad(np.ones(n, bool), (0, pad)))


def _mllm_sample_ce(model, text, images, index, targets, mask):
    """Summed cross-entropy over the text targets of one multimodal sample alone through
    the MLLM: its text (image slots zeroed) and targets padded at the end, its images
    padded to a fixed count with images no slot places, ``mask`` true on its real text
    targets."""
    import optax
    logits = model(text[None], images[None], index[None])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[0, :-1], targets)
    return (ce * mask).sum()


def _mllm_inputs(s, max_images: int):
    from hetshard.data import IMAGE_TOKEN
    tok, imgs = np.asarray(s["tokens"]), np.asarray(s["images"], np.float32)
    slots = tok == IMAGE_TOKEN
    index = np.where(slots, np.cumsum(slots) - 1, -1).astype(np.int32)
    text = np.where(slots, 0, tok)
    pad = _padded(len(tok)) - len(tok)
    images = np.zeros((max_images,) + imgs.shape[1:], np.float32)
    images[:len(imgs)] = imgs
    return (np.pad(text, (0, pad)), images, np.pad(index, (0, pad), constant_values=-1),
            np.pad(text[1:], (0, pad)), np.pad(~slots[1:], (0, pad)))


def _one_by_one(model, opt, batches):
    """Per-step losses of one device training each batch's samples one at a time
    (unpacked; token arrays, or multimodal mappings), the loss their token mean: what
    packed training must equal. Each sample's loss and gradient is one jitted program of
    its padded shape (shared by the samples of that shape: a program per batch, all its
    samples inlined, took half these tests' time compiling), summed over the batch."""
    from flax import nnx

    from hetshard.data import target_count

    grad_of = {False: nnx.jit(nnx.value_and_grad(_text_sample_ce)),
               True: nnx.jit(nnx.value_and_grad(_mllm_sample_ce))}
    add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
    out = []
    for samples in batches:
        multimodal = isinstance(samples[0], dict)
        most = max((len(s["images"]) for s in samples), default=0) if multimodal else 0
        total, grads = 0.0, None
        for s in samples:
            inputs = _mllm_inputs(s, max(most, 1)) if multimodal else _text_inputs(s)
            loss, g = grad_of[multimodal](model, *(jnp.asarray(x) for x in inputs))
            total = total + loss
            grads = g if grads is None else add(grads, g)
        count = target_count(samples)
        opt.update(model, jax.tree.map(lambda x, c=count: x / c, grads))
        out.append(float(total / count))
    return out


def _run_equals_one_device(cluster, groups, batches, model_name="llama-tiny", *,
                           build=None, loss=None):
    """Train ``model_name`` (llama-tiny, or llava-tiny on multimodal samples; or
    ``build()`` with its packed ``loss``) on ``batches`` ((samples, BatchPlan) pairs)
    with ``run_batch_plan`` on ``groups``; assert its losses and weights equal one
    device training the samples one by one. Returns the step and its (model,
    optimizer)."""
    import optax
    from flax import nnx

    import hetshard
    import hetshard_models as models
    from hetshard.data import run_batch_plan
    from hetshard_models.losses import packed_mllm_loss, packed_text_loss
    from hetshard_models.steps import train_step

    multimodal = model_name.startswith("llava")
    build = build or (lambda: models.build(model_name, rngs=0))
    loss = loss or (packed_mllm_loss if multimodal else packed_text_loss)
    model = build()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    want = _one_by_one(model, opt, [s for s, _ in batches])
    want_params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    model = build()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = hetshard.jit(train_step(loss), cluster=cluster, quiet=True)
    got = [float(run_batch_plan(step, (model, opt, None), s, p, groups)) for s, p in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    got_params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    return step, (model, opt)


@pytest.mark.slow
def test_packed_batches_under_hetshard_jit_equal_one_device_on_the_samples():
    """Two steps, each a global batch of variable-length samples packed into rows of its
    own bucket, trained under hetshard.jit on 4 fake GPUs: losses equal those of one
    device training on the unpacked samples one by one; one compiled entry per bucket."""
    import optax
    from flax import nnx

    import hetshard
    import hetshard_models as models
    from hetshard_models.losses import packed_text_loss
    from hetshard_models.steps import train_step

    rng = np.random.default_rng(0)
    batches = []
    for bucket, count in ((32, 4), (64, 4)):
        lengths = rng.integers(3, bucket + 1, 6)
        while True:  # a batch whose rows all land in `bucket`, `count` of them
            rows = pack(lengths, (bucket,))
            if len(rows) == count:
                break
            lengths = rng.integers(3, bucket + 1, 6)
        samples = [rng.integers(0, 256, n).astype(np.int32) for n in lengths]
        targets = int(sum(n - 1 for n in lengths))
        batches.append((samples, packed_arrays(samples, rows, target_tokens=targets)))

    model = models.build("llama-tiny", rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    want = _one_by_one(model, opt, [s for s, _ in batches])

    model = models.build("llama-tiny", rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    cluster = {"name": "a100-x4", "groups": [{"name": "a", "gpu": "A100-80GB", "nodes": 1,
                                              "gpus_per_node": 4}]}
    step = hetshard.jit(train_step(packed_text_loss), cluster=cluster, quiet=True,
                        time_limit_s=5)
    got = [float(step(model, opt, {k: jnp.asarray(v) for k, v in b.items()}))
           for _, b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert len(step._compiled) == 2


def _two_speeds(slow, *, chunk, attention, layers, buckets, image_s=0.0, **extra):
    """A cluster of two 4-GPU groups and their GroupCosts, the second ``slow`` times
    slower (per token slot, per squared token over ``attention``, per image)."""
    cluster = {"name": "two-speeds", "groups": [
        {"name": "fast", "gpu": "H100-80GB", "nodes": 1, "gpus_per_node": 4},
        {"name": "slow", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 4}]}
    groups = tuple(GroupCost(name=n, gpu=g, devices=tuple(range(o, o + 4)), chunk=chunk,
                             token_s=t, attention_s=t / attention, attention_fwd_share=0.3,
                             layers=layers, kv_bytes_per_token=0.0, buckets=buckets,
                             image_s=image_s * t, **extra)
                   for n, g, o, t in (("fast", "H100-80GB", 0, 1.0),
                                      ("slow", "A100-80GB", 4, slow)))
    return cluster, groups


@pytest.mark.slow
def test_a_per_batch_plan_runs_as_one_step_equal_to_one_device():
    """A batch of variable-length samples planned on two groups of different speeds
    (the faster one takes more), long rows over a context group of 2, short rows packed:
    every group's micro-steps summed into one update under hetshard.jit; losses and
    weights equal one device training the samples one by one, over two steps; each
    (group, bucket) compiled once."""


    cluster, groups = _two_speeds(2.5, chunk=16, attention=200, layers=4, buckets=(16, 32))
    batches = _variable_length_batches(groups, seed=4)
    assert any(s.degree == 2 for _, p in batches for g in p.groups for s in g.steps)
    fast, slow = (sum(len(g.samples) for _, p in batches for g in p.groups if g.group == n)
                  for n in ("fast", "slow"))
    assert fast > slow

    step, (model, opt) = _run_equals_one_device(cluster, groups, batches)
    shapes = {s for _, p in batches for s in p.shapes}
    assert len(step.micro_steps._captures) == len(shapes) <= 4
    # The state stays sharded over a group's devices (FSDP, as group_costs prices it),
    # the optimizer's moments too: no device holds a whole weight.
    from flax import nnx
    weights = [x for x in jax.tree.leaves(nnx.state((model, opt))) if x.size >= 1024]
    assert weights and all(x.addressable_shards[0].data.size < x.size for x in weights)


def _variable_length_batches(groups, seed, steps=2, vocab=256):
    """(samples, plan) of ``steps`` batches: two long samples (20-32 tokens) and ten
    short ones each, planned on ``groups``."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = np.concatenate([rng.integers(20, 33, 2), rng.integers(3, 12, 10)])
        samples = [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]
        out.append((samples, plan_batch(lengths, groups, bound=False)))
    return out


@pytest.mark.slow
def test_a_users_own_packed_model_runs_a_per_batch_plan_equal_to_one_device(monkeypatch):
    """A packed LM as a user writes it in Flax (``nnx.MultiHeadAttention`` under
    ``nnx.make_causal_mask`` and a segment mask, not the zoo): its masked attention is
    read as causal with the batch's segment ids and runs as the kernel, a ring over the
    context group on long rows; a per-batch plan on two groups trains equal to one
    device training the samples one by one."""
    import user_models
    from flax import nnx

    import hetshard.rewrite.attention as swap
    from hetshard.ir.attention_patterns import flax_patterns

    cluster, groups = _two_speeds(2.5, chunk=16, attention=200, layers=2, buckets=(16, 32))
    batches = _variable_length_batches(groups, seed=4, vocab=user_models.VOCAB)
    assert any(s.degree == 2 for _, p in batches for g in p.groups for s in g.steps)
    model = user_models.PackedLM(nnx.Rngs(0))
    batch = packed_arrays(batches[0][0], pack([len(x) for x in batches[0][0]], (32,)))
    pats = flax_patterns(jax.make_jaxpr(user_models.packed_loss)(
        model, {k: jnp.asarray(v) for k, v in batch.items()}).jaxpr).values()
    assert len(pats) == 2 and all(p["causal"] and p["seg"] is not None for p in pats)

    rings = []
    ring = swap._ring_on_mesh
    monkeypatch.setattr(swap, "_ring_on_mesh",
                        lambda *a, **k: rings.append(a[5] is not None and a[7]) or ring(*a, **k))
    _run_equals_one_device(cluster, groups, batches, build=lambda: user_models.PackedLM(
        nnx.Rngs(0)), loss=user_models.packed_loss)
    assert rings and all(rings)  # the long rows' attention: a ring, with segment ids


@pytest.mark.slow
def test_a_plan_on_replicas_of_one_gpu_type_with_long_remat_rows_equals_one_device():
    """One cluster group split into two replicas (``group_costs(split=)`` names them
    ``a/0`` and ``a/1``) beside a second group; on ``a/0`` rows of the larger bucket run
    on one device under the long remat (``long_buckets``), so its micro-step plan
    carries remat "full". The step's losses and weights equal one device's."""

    from hetshard.data import micro_step_plan

    cluster = {"name": "replicas", "groups": [
        {"name": "a", "gpu": "A100-80GB", "nodes": 2, "gpus_per_node": 2},
        {"name": "b", "gpu": "H100-80GB", "nodes": 1, "gpus_per_node": 4}]}
    base = dict(chunk=16, attention_fwd_share=0.3, layers=4, kv_bytes_per_token=0.0,
                buckets=(16, 32))
    groups = (GroupCost(name="a/0", gpu="A100-80GB", devices=(0, 1), token_s=2.0,
                        attention_s=0.01, long_remat="full", long_chunk=32,
                        long_token_s=2.0, long_buckets=(32,), **base),
              GroupCost(name="a/1", gpu="A100-80GB", devices=(2, 3), token_s=2.0,
                        attention_s=0.01, **base),
              GroupCost(name="b", gpu="H100-80GB", devices=(4, 5, 6, 7), token_s=1.5,
                        attention_s=0.005, **base))
    assert groups[0].degree(32) == 1 and groups[0].remat_of(32) == "full"
    assert groups[1].degree(32) == 2 and groups[1].remat_of(32) == "none"
    rng = np.random.default_rng(5)
    batches = []
    for _ in range(2):
        lengths = np.concatenate([rng.integers(20, 33, 6), rng.integers(3, 12, 12)])
        samples = [rng.integers(0, 256, n).astype(np.int32) for n in lengths]
        batches.append((samples, plan_batch(lengths, groups, bound=False)))
    used = {(g.group, s.bucket) for _, p in batches for g in p.groups for s in g.steps}
    assert ("a/0", 32) in used and ("a/1", 32) in used and ("b", 32) in used

    step, (model, opt) = _run_equals_one_device(cluster, groups, batches)
    batch = {k: jnp.asarray(v) for k, v in packed_arrays(
        batches[0][0], [Row(32, (0,), (int(batches[0][0][0].size),))]).items()}
    plan = micro_step_plan(step, (model, opt, batch), groups[0], 32, 1)
    stage = plan.pipelines[0].stages[0]
    assert stage.remat == "full" and stage.devices == (0, 1)


def multimodal_batches(seed: int, plan):
    """Two (samples, plan) batches of llava-tiny samples: two long ones (3 and 2 images)
    and eight short, 0-3 images each (16 decoder tokens an image, ``IMAGE_TOKEN``
    placeholders after the first text token); ``plan(text lengths, images)``."""
    from hetshard.data import IMAGE_TOKEN

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        text = np.concatenate([rng.integers(10, 16, 2), rng.integers(2, 10, 8)])
        images = rng.integers(0, 3, text.size)
        images[:2] = (3, 2)  # long samples, one with a full row's images
        samples = []
        for n, k in zip(text.tolist(), images.tolist(), strict=True):
            tok = rng.integers(0, 256, n).astype(np.int32)
            tok = np.concatenate([tok[:1], np.full(16 * k, IMAGE_TOKEN, np.int32), tok[1:]])
            samples.append({"tokens": tok,
                            "images": rng.normal(size=(k, 16, 16, 3)).astype(np.float32)})
        out.append((samples, plan(text, images)))
    return out


@pytest.mark.slow
def test_a_multimodal_per_batch_plan_runs_equal_to_one_device():
    """llava-tiny samples with 0-3 images each (16 decoder tokens an image), planned on
    two groups of different speeds with image slots sized per bucket: rows of the long
    bucket over a context group of 2 (the encoder's patch attention left whole, the
    decoder's a ring), every row's images padded to its bucket's slots. Losses and
    weights over two steps equal one device training the samples one by one."""
    cluster, groups = _two_speeds(2.0, chunk=32, attention=400, layers=2, buckets=(32, 64),
                                  image_tokens=16, image_slots=(2, 3), image_s=4.0)
    batches = multimodal_batches(
        6, lambda text, images: plan_batch(text, groups, images=images, bound=False))
    rows = [(g.group, s.bucket, s.degree, r) for _, p in batches for g in p.groups
            for s in g.steps for r in s.rows]
    assert any(d == 2 for _, _, d, _ in rows)
    for samples, p in batches:
        for gp in p.groups:
            for st in gp.steps:
                for r in st.rows:  # no row takes more images than its bucket's slots
                    k = sum(len(samples[i]["images"]) for i in r.samples)
                    assert k <= groups[0].images_of(st.bucket)
    _run_equals_one_device(cluster, groups, batches, "llava-tiny")


_DGX_A100 = {"gpu": "A100-80GB", "gpus_per_node": 8, "intra_node_gbs": 300.0,
             "inter_node_gbs": 200.0}


@pytest.fixture(scope="module")
def llama7b():
    from hetshard_models import profile as profile_model
    return profile_model("llama-7b", seq_len=4096)


def _a100s(nodes=4):
    from hetshard.cluster import Cluster
    return Cluster.from_dict({"name": f"a100-x{8 * nodes}", "inter_group_gbs": 100.0,
                              "groups": [{"name": "a100", "nodes": nodes, **_DGX_A100}]})


def test_split_groups_are_node_aligned_replicas(llama7b):
    from hetshard.data import group_costs
    cluster = _a100s()
    whole, = group_costs(llama7b, cluster, max_context=32768)
    parts = group_costs(llama7b, cluster, max_context=32768, split={"a100": 2})
    assert [p.name for p in parts] == ["a100/0", "a100/1"]
    assert parts[0].devices == tuple(range(16)) and parts[1].devices == tuple(range(16, 32))
    # the gradients are reduce-scattered over every device, one group or replicas ...
    assert whole.step_s > 0.1
    # ... and a replica shards the update over fewer devices (more to update each) and
    # gathers the weights over fewer, nearer ones (faster token slots)
    assert parts[0].step_s > whole.step_s and parts[0].token_s < whole.token_s
    # a row of max_context holds 8 devices in either case: 32K / 4K
    assert whole.degree(32768) == parts[0].degree(32768) == 8
    for split, field in (({"a100": 3}, "split['a100']"), ({"h100": 2}, "split"),
                         ({"a100": 0}, "split['a100']"), ({"a100": True}, "split['a100']")):
        with pytest.raises(SpecError) as e:
            group_costs(llama7b, cluster, max_context=32768, split=split)
        assert e.value.field == field


def test_long_chunk_runs_long_rows_on_a_shorter_ring_under_remat(llama7b):
    from hetshard.data import group_costs
    cluster = _a100s()
    default, = group_costs(llama7b, cluster, max_context=131072)
    # 128K over 32 devices: 4K a device, no remat, a ring over four nodes
    assert default.degree(131072) == 32 and default.remat_of(131072) == "none"
    short, = group_costs(llama7b, cluster, max_context=131072, long_chunk=16384)
    # 16K a device under full remat: the ring stays in one node, and its saving beats
    # the recomputation there
    assert short.degree(131072) == 8 and short.remat_of(131072) == "full"
    assert 131072 in short.long_buckets and short.slots(131072) == 16384
    assert short.degree(4096) == 1 and short.remat_of(4096) == "none"
    for bad in (4096, 12288, 262144, True):
        with pytest.raises(SpecError) as e:
            group_costs(llama7b, cluster, max_context=131072, long_chunk=bad)
        assert e.value.field == "long_chunk"
    with pytest.raises(SpecError, match="at least 16384"):  # 8K x 8 devices < 128K
        group_costs(llama7b, cluster, max_context=131072, split={"a100": 4}, long_chunk=8192)


def test_buckets_can_be_given_and_are_checked(llama7b):
    from hetshard.data import group_costs
    cluster = _a100s()
    g, = group_costs(llama7b, cluster, max_context=131072, buckets=(65536, 4096, 131072))
    assert g.buckets == (4096, 65536, 131072) and g.degree(65536) == 16
    for bad in ((4096, 65536), (4096, 12288, 131072), (2048, 131072), (), (4096.0, 131072)):
        with pytest.raises(SpecError) as e:
            group_costs(llama7b, cluster, max_context=131072, buckets=bad)
        assert e.value.field == "buckets"


def _wikipedia_like(rng, count, tokens=32 * 32768, max_context=131072):
    """Batches of log-normal document lengths shaped like FlexSP's Wikipedia sample
    (median 347 tokens, p99 about 11K), cut at ``max_context``: long documents rare."""
    out = []
    for _ in range(count):
        lengths = rng.lognormal(np.log(347), 1.5, 8000).astype(np.int64).clip(1, max_context)
        out.append(lengths[:np.searchsorted(np.cumsum(lengths), tokens) + 1])
    return out


def test_choose_groups_picks_replicas_that_beat_one_group_on_fresh_batches(llama7b):
    from hetshard.data import choose_groups, group_costs
    # (8 nodes, 64 x 32K tokens a batch: on 4 nodes with half the tokens a ring of all
    # 32 GPUs now holds the longest rows about as well, within 3%)
    cluster = _a100s(8)
    calib = _wikipedia_like(np.random.default_rng(0), 3, tokens=64 * 32768)
    chosen = choose_groups(llama7b, cluster, calib, max_context=131072)
    assert len(chosen) > 1  # replicas: a long row's ring holds one, the others go on
    assert sum(len(g.buckets) for g in chosen) <= 8
    assert all(g.buckets[0] == 4096 and g.buckets[-1] == 131072 for g in chosen)
    assert sorted(d for g in chosen for d in g.devices) == list(range(64))
    whole = group_costs(llama7b, cluster, max_context=131072, max_buckets=8)
    quarters = group_costs(llama7b, cluster, max_context=131072, max_buckets=2,
                           split={"a100": 4})

    def total(groups, batches, method="hetshard"):
        return sum(plan_batch(b, groups, cluster=cluster, method=method,
                              bound=False).step_time_s for b in batches)

    # the least step time of the candidates on the calibration batches ...
    assert total(chosen, calib) <= min(total(whole, calib), total(quarters, calib))
    # ... and on batches it has not seen
    fresh = _wikipedia_like(np.random.default_rng(1), 3, tokens=64 * 32768)
    assert total(chosen, fresh) < 0.95 * total(whole, fresh)
    # a baseline tunes its replicas the same way
    fixed = choose_groups(llama7b, cluster, calib, max_context=131072, method="fixed-cp")
    assert total(fixed, calib, "fixed-cp") <= total(whole, calib, "fixed-cp")
    for kwargs, field in (({"batches": []}, "batches"), ({"max_shapes": 0}, "max_shapes"),
                          ({"method": "best"}, "method"),
                          ({"images": [None, None]}, "images")):
        args = {"batches": calib, **kwargs}
        with pytest.raises(SpecError) as e:
            choose_groups(llama7b, cluster, args.pop("batches"), max_context=131072, **args)
        assert e.value.field == field


def test_choose_groups_sizes_image_slots_from_the_data(llama7b):
    """A multimodal run's rows hold as many image slots as price fastest on its data:
    every slot is encoded, so fewer slots encode less padding, and more pack the images
    more densely. The chosen groups plan the calibration batches at least as fast as
    with either the default slots (what the rows' tokens hold) or slots sized from the
    rows' images, and every row of fresh plans keeps within its slots.
    group_costs(images_per_row=) is checked."""
    from hetshard.data import choose_groups, group_costs
    from hetshard.data.planner import _capped
    from hetshard_models import profile as profile_model

    vision = profile_model("vit-l14")
    cluster = _a100s(2)
    mm = dict(vision=vision, image_tokens=256)

    def draw(rng, images_at_most):
        text = _wikipedia_like(rng, 1, tokens=16 * 32768, max_context=16384)[0]
        images = rng.integers(0, images_at_most + 1, text.size)
        return np.maximum(1, np.minimum(text, 32768 - 256 * images)), images

    for most in (1, 8):  # sparse images: sized slots win; dense: the default's packing
        calib = [draw(np.random.default_rng(k), most) for k in (10, 11)]
        texts, images = [t for t, _ in calib], [i for _, i in calib]
        chosen = choose_groups(llama7b, cluster, texts, max_context=32768, images=images,
                               max_parts=2, **mm)

        def total(groups, texts=texts, images=images):
            return [plan_batch(t, groups, images=i, cluster=cluster, bound=False)
                    for t, i in zip(texts, images, strict=True)]
        default = tuple(dataclasses.replace(g, image_slots=()) for g in chosen)
        sized = _capped(default, texts, images, total(default))
        got, want = (sum(p.step_time_s for p in total(g)) for g in (chosen, default))
        assert got <= min(want, sum(p.step_time_s for p in total(sized))) + 1e-9
        if most == 1:
            assert chosen[0].image_caps() != default[0].image_caps()
        text, img = draw(np.random.default_rng(20), most)
        plan = plan_batch(text, chosen, images=img, cluster=cluster, bound=False)
        by_name = {g.name: g for g in chosen}
        lengths = text + 256 * img
        for gp in plan.groups:
            for st in gp.steps:
                for r in st.rows:
                    assert img[list(r.samples)].sum() <= by_name[gp.group].images_of(st.bucket)
                    assert list(r.lengths) == lengths[list(r.samples)].tolist()

    one, = group_costs(llama7b, cluster, max_context=32768, images_per_row={4096: 3}, **mm)
    assert one.images_of(4096) == 3 and one.images_of(32768) == 128
    for kwargs, field in (({"images_per_row": {4096: 17}, **mm}, "images_per_row[4096]"),
                          ({"images_per_row": {1000: 1}, **mm}, "images_per_row"),
                          ({"images_per_row": {4096: 1}}, "images_per_row")):
        with pytest.raises(SpecError) as e:
            group_costs(llama7b, cluster, max_context=32768, **kwargs)
        assert e.value.field == field


def test_group_costs_price_the_users_own_program():
    """The per-batch planner's costs come from the step it is given: a user's own Flax
    model (not a zoo model; width 512, shape-only, so compute and not kernel launches
    sets its speed) under hetshard.jit, profiled from its trace
    (``HetshardJit.profile``), priced per GPU type (the faster type's token slots
    cheaper) and planned on: the faster type takes more of the batch's tokens."""
    import optax
    import user_models
    from flax import nnx

    import hetshard
    from hetshard.cluster import Cluster
    from hetshard.data import group_costs

    step_fn, args, _ = user_models.make_transformer()
    model = nnx.eval_shape(lambda: user_models.TinyLM(nnx.Rngs(0), d=512, heads=8))
    opt = nnx.eval_shape(lambda m: nnx.Optimizer(m, optax.adamw(1e-3), wrt=nnx.Param), model)
    args = (model, opt, args[-1])
    cluster = Cluster.from_dict({"name": "mixed", "groups": [
        {"name": "v100", "gpu": "V100-32GB", "nodes": 1, "gpus_per_node": 4},
        {"name": "h100", "gpu": "H100-80GB", "nodes": 1, "gpus_per_node": 4}]})
    step = hetshard.jit(step_fn, cluster=cluster, quiet=True)
    profile = step.profile(*args)
    seq = args[-1]["tokens"].shape[1]
    assert profile.seq_len == seq and profile.num_layers > 1
    slow, fast = group_costs(profile, cluster, max_context=4 * seq)
    assert 0 < 1.3 * fast.token_s < slow.token_s
    lengths = np.random.default_rng(0).integers(1, 4 * seq + 1, 40)
    plan = plan_batch(lengths, (slow, fast), cluster=cluster)
    done = {g.group: int(lengths[list(g.samples)].sum()) for g in plan.groups}
    assert sum(len(g.samples) for g in plan.groups) == 40 and done["h100"] > done["v100"]


def test_proportional_shares_split_by_speed_with_largest_remainders():
    """The static baselines' split: every item placed once, each owner within one item
    of its exact share, the remainders to the largest fractions."""
    from hetshard.data.search import proportional_shares
    rng = np.random.default_rng(3)
    for _ in range(50):
        speed = rng.exponential(1.0, int(rng.integers(1, 6)))
        count = int(rng.integers(0, 40))
        got = proportional_shares(count, speed)
        ideal = count * speed / speed.sum()
        assert got.sum() == count and np.all(np.abs(got - ideal) < 1.0)
    assert proportional_shares(5, np.array([1.0, 1.0, 2.0])).tolist() == [1, 1, 3]
    assert proportional_shares(3, np.array([0.6, 0.4])).tolist() == [2, 1]


class _Owner:
    """An owner of the planner family (hetshard.data.drafts) whose micro-steps cost
    ``per_row[bucket]`` a row: what ``draft`` and ``place`` are tested on, apart from
    either planner's pricing."""

    def __init__(self, name, per_row, buckets=(8, 16), devices=2, step_s=0.5):
        self.name, self.buckets, self.step_s = name, buckets, step_s
        self.image_caps = (0,) * len(buckets)
        self.merging = GroupCost(name=name, gpu="", devices=tuple(range(devices)), chunk=8,
                                 token_s=0.0, attention_s=0.0, attention_fwd_share=0.5,
                                 layers=1, kv_bytes_per_token=0.0, buckets=buckets)
        self.per_row = per_row

    def compose(self, p, images=None, in_order=False):
        from hetshard.data.planner import _Step
        steps = [_Step(int(b), 1, np.flatnonzero(p.bucket == b), 0.0)
                 for b in np.unique(p.bucket).tolist()]
        steps = [s._replace(time_s=self.per_row[s.bucket] * s.rows.size) for s in steps]
        return steps, sum(s.time_s for s in steps) + self.step_s


def test_a_draft_keeps_the_merged_packing_only_where_it_prices_faster():
    """Three 8-token samples on 2 devices: best-fit gives three 8-rows, two micro-steps
    of two slots, the second part-empty; fill_steps moves its row up into a 16-row (two
    devices). The family's draft keeps whichever packing its owner prices faster, the
    unmerged one on a tie."""
    from hetshard.data.drafts import draft
    lengths = np.array([8, 8, 8])
    cheap_long = draft(_Owner("a", {8: 1.0, 16: 0.1}), np.arange(3), lengths, None)
    dear_long = draft(_Owner("b", {8: 1.0, 16: 5.0}), np.arange(3), lengths, None)
    assert 16 in cheap_long.packing.bucket.tolist()
    assert dear_long.packing.bucket.tolist() == [8, 8, 8]
    assert cheap_long.time_s < 3.5 and dear_long.time_s == pytest.approx(3.5)
    tie = draft(_Owner("c", {8: 1.0, 16: 1.0}), np.arange(3), lengths, None)
    assert tie.packing.bucket.tolist() == [8, 8, 8]
    plan = cheap_long.plan()
    assert sorted(i for s in plan.steps for r in s.rows for i in r.samples) == [0, 1, 2]


def test_placement_rounds_never_end_on_a_worse_placement_than_their_first():
    from hetshard.data.drafts import draft, place
    from hetshard.data.search import lpt_placement
    rng = np.random.default_rng(11)
    for _ in range(20):
        owners = [_Owner("fast", {8: 0.2, 16: 0.5}), _Owner("slow", {8: 1.0, 16: 1.5})]
        lengths = rng.integers(1, 17, 12)
        costs = np.array([lengths * 0.02, lengths * 0.1])
        n = np.ones(2)
        got = place(lambda k, s, o=owners, x=lengths: draft(o[k], s, x, None), costs, n,
                    [o.step_s for o in owners], rounds=3)
        where = lpt_placement(costs, n, np.ones(2))
        first = max(draft(o, np.flatnonzero(where == k), lengths, None).time_s
                    for k, o in enumerate(owners))
        assert got.time_s <= first + 1e-12
        assert got.time_s == pytest.approx(max(d.time_s for d in got.drafts))
        assert sorted(np.concatenate(got.parts).tolist()) == list(range(12))
