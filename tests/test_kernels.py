import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from hetshard.errors import SpecError
from hetshard.kernels import attention_reference, context_parallel_attention, flash_attention
from hetshard.kernels.ring_attention import device_token_ids


def _inputs(rng, b=2, s=40, h=4, kvh=2, d=16, dtype=jnp.float32, skv=None):
    skv = skv or s
    q = jnp.asarray(rng.normal(size=(b, s, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, skv, kvh, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, skv, kvh, d)), dtype)
    return q, k, v


def _segments(rng, b, s):
    return jnp.asarray(np.sort(rng.integers(1, 4, (b, s)), axis=1), jnp.int32)


def _loss(fn, cot):
    return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cot)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_segments", [False, True])
@pytest.mark.parametrize("s,h,kvh", [(40, 4, 2), (32, 2, 2), (17, 4, 1)])
def test_flash_matches_reference_float32(rng, causal, with_segments, s, h, kvh):
    q, k, v = _inputs(rng, s=s, h=h, kvh=kvh)
    seg = _segments(rng, 2, s) if with_segments else None
    kw = dict(causal=causal, segment_ids=seg)
    # Outputs start as NaN (forward and backward kernels): unwritten elements would fail.
    out, lse = flash_attention(q, k, v, block_q=16, block_k=16, return_lse=True,
                               poison_outputs=True, **kw)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    cot = jnp.asarray(rng.normal(size=out.shape), jnp.float32)  # fresh cotangent
    g = jax.grad(_loss(lambda *a: flash_attention(*a, block_q=16, block_k=16,
                                                  poison_outputs=True, **kw), cot),
                 argnums=(0, 1, 2))(q, k, v)
    gr = jax.grad(_loss(lambda *a: attention_reference(*a, **kw), cot), argnums=(0, 1, 2))(
        q, k, v)
    for a, b in zip(g, gr, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _equals_reference(fn, qkv, kw, rng):
    """``fn(q, k, v)`` equals the reference attention with the same ``kw``, values (1e-5)
    and gradients under a fresh cotangent (1e-4)."""
    np.testing.assert_allclose(fn(*qkv), attention_reference(*qkv, **kw), rtol=1e-5,
                               atol=1e-5)
    cot = jnp.asarray(rng.normal(size=qkv[0].shape), jnp.float32)
    g = jax.grad(_loss(fn, cot), argnums=(0, 1, 2))(*qkv)
    gr = jax.grad(_loss(lambda *a: attention_reference(*a, **kw), cot),
                  argnums=(0, 1, 2))(*qkv)
    for a, b in zip(g, gr, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _brute_flags(qpos, kpos, qseg, kseg, bq, bk, causal):
    """Per (batch, query block, key block): whether any pair is visible, and whether
    every pair is (the masks the kernels apply, pair by pair)."""
    vis = (kpos[:, None, :] >= 0) & (qseg[:, :, None] == kseg[:, None, :])
    if causal:
        vis &= qpos[:, :, None] >= kpos[:, None, :]
    b, sq, skv = vis.shape
    blocks = vis.reshape(b, sq // bq, bq, skv // bk, bk)
    return blocks.any(axis=(2, 4)), blocks.all(axis=(2, 4))


@pytest.mark.parametrize("layout", ["aligned", "zigzag", "padded", "packed"])
@pytest.mark.parametrize("causal", [False, True])
def test_block_ranges_cover_every_visible_pair_and_skip_masks_only_on_full_blocks(
        rng, layout, causal):
    """The flash kernels compute each row block's range ``[lo, hi)`` and leave the mask
    out on ``[full_lo, full_hi)``: every block holding a visible pair is in the range,
    and every block of the unmasked run has every pair visible; causal rows compute
    about half their blocks."""
    from hetshard.kernels.flash_attention import block_flags, block_ranges
    s, bq, bk = 64, 8, 8
    pos = np.tile(np.arange(s), (2, 1))
    seg = np.zeros((2, s), np.int64)
    kpos = pos.copy()
    if layout == "zigzag":  # a device's chunks: the 2nd and 7th eighth of the sequence
        pos = np.tile(np.concatenate([np.arange(16, 48), np.arange(208, 240)]), (2, 1))
        kpos = np.tile(np.concatenate([np.arange(0, 32), np.arange(224, 256)]), (2, 1))
    elif layout == "padded":  # an uneven chunk: keys after 40 are padding
        kpos[:, 40:] = -1
    elif layout == "packed":
        seg = np.sort(rng.integers(0, 5, (2, s)), axis=1)
        pos = np.concatenate([np.arange((seg[r] == i).sum()) for r in range(2)
                              for i in range(5)]).reshape(2, s)
        kpos = pos
    kseg = np.where(kpos >= 0, seg, -2)
    want_any, want_all = _brute_flags(pos, kpos, seg, kseg, bq, bk, causal)
    active, full = block_flags(*(jnp.asarray(x, jnp.int32) for x in (pos, kpos, seg, kseg)),
                               bq, bk, causal, True)
    active, full = np.asarray(active), np.asarray(full)
    assert not (want_any & ~active).any()  # nothing visible is left out
    assert np.array_equal(full, want_all)  # unmasked exactly where every pair is seen
    for flags, fl, axis_rows in ((active, full, False), (active, full, True)):
        a, f = (np.swapaxes(flags, 1, 2), np.swapaxes(fl, 1, 2)) if axis_rows else (flags, fl)
        ranges = np.asarray(block_ranges(jnp.asarray(a), jnp.asarray(f)))
        for r in range(a.shape[0]):
            for row in range(a.shape[1]):
                lo, flo, fhi, hi = ranges[r, row]
                cols = np.flatnonzero(a[r, row])
                assert lo <= flo <= fhi <= hi
                assert all(lo <= c < hi for c in cols)
                assert f[r, row, flo:fhi].all()  # the unmasked run: full blocks only
    if layout == "aligned" and causal:
        lo, _, _, hi = np.asarray(block_ranges(jnp.asarray(active),
                                               jnp.asarray(full)))[0].T
        assert int((hi - lo).sum()) == 8 * 9 // 2


@pytest.mark.parametrize("causal,with_segments,kvh", [(True, True, 2), (False, False, 4),
                                                       (True, False, 1)])
def test_flash_with_unmasked_full_blocks_matches_reference(rng, causal, with_segments, kvh):
    """The GPU path's loops (masked edges, an unmasked run of full blocks; interpreted
    here) and separate backward tiles equal the reference, values and gradients, with
    every output poisoned first; the grouped heads' dK/dV summed, the others written in
    the inputs' dtype."""
    from hetshard.kernels import FlashTuning
    q, k, v = _inputs(rng, s=72, h=4, kvh=kvh)
    seg = _segments(rng, 2, 72) if with_segments else None
    kw = dict(causal=causal, segment_ids=seg)
    tuning = FlashTuning(block_q=16, block_k=32, block_q_bwd=32, block_k_bwd=16)
    _equals_reference(lambda *a: flash_attention(*a, tuning=tuning, poison_outputs=True,
                                                 **kw), (q, k, v), kw, rng)


def test_flash_head_dims_that_are_no_power_of_two(rng):
    """Triton's tiles are powers of two: a head dim of 24 runs zero-padded to 32 (the
    scale of 24's), equal to the reference, gradients too; the ring's backward entry
    point (explicit positions, a given output and log-sum-exp) likewise."""
    from hetshard.kernels.flash_attention import _head_dim, flash_attention_backward_positions
    assert (_head_dim(24, True), _head_dim(80, False), _head_dim(8, False),
            _head_dim(8, True)) == (32, 128, 16, 8)
    q, k, v = _inputs(rng, s=40, h=4, kvh=2, d=24)
    kw = dict(causal=True)
    _equals_reference(lambda *a: flash_attention(*a, block_q=16, block_k=16,
                                                 poison_outputs=True, **kw), (q, k, v), kw,
                      rng)
    out, lse = attention_reference(q, k, v, return_lse=True, **kw)
    dout = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))
    got = flash_attention_backward_positions(q, k, v, pos, pos, out, lse, dout, block_q=16,
                                             block_k=16, **kw)
    _, vjp = jax.vjp(lambda *a: attention_reference(*a, **kw), q, k, v)
    for a, b in zip(got, vjp(dout), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_flash_tuning_per_gpu_and_bad_tunings(monkeypatch):
    import importlib

    from hetshard.kernels import FlashTuning
    fa = importlib.import_module("hetshard.kernels.flash_attention")
    assert fa.tuning_for("NVIDIA H100 80GB HBM3", 128).warps == 8
    assert fa.tuning_for("NVIDIA A100-SXM4-80GB", 64).warps == 4
    tuned = FlashTuning(block_k=64, stages=3)
    monkeypatch.setitem(fa.TUNED, ("H100", 128), tuned)
    assert fa.tuning_for("NVIDIA H100 80GB HBM3", 128) == tuned
    assert fa.tuning_for("NVIDIA H100 80GB HBM3", 64) == fa.default_tuning(64)
    assert fa.tuning_for("NVIDIA H200", 128) == fa.default_tuning(128)
    q = jnp.zeros((1, 16, 2, 16))
    for bad, field in ((FlashTuning(block_q=24), "tuning.block_q"),
                       (FlashTuning(block_k_bwd=8), "tuning.block_k_bwd"),
                       (FlashTuning(warps=3), "tuning.warps"),
                       (FlashTuning(stages_bwd=0), "tuning.stages_bwd"),
                       ((64, 64), "tuning")):
        with pytest.raises(SpecError, match=field.replace(".", r"\.") + "="):
            flash_attention(q, q, q, tuning=bad)


def test_flash_bfloat16_within_bf16_tolerance(rng):
    q, k, v = _inputs(rng, s=48, dtype=jnp.bfloat16)
    out = flash_attention(q, k, v, causal=True, block_q=16, block_k=16, poison_outputs=True)
    ref = attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                              v.astype(jnp.float32), causal=True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), ref, rtol=2e-2, atol=2e-2)


def test_poisoning_catches_an_unwritten_output():
    # The check the kernel tests rely on: a kernel writing half its output leaves NaNs.
    from jax.experimental import pallas as pl

    from hetshard.kernels.flash_attention import _lowering, _pallas

    def half(x_ref, o_ref):
        o_ref[:4] = x_ref[:4]

    x = jnp.ones((8,), jnp.float32)
    out = _pallas(half, grid=(1,), in_specs=[pl.BlockSpec((8,), lambda i: (0,))],
                  out_specs=pl.BlockSpec((8,), lambda i: (0,)),
                  out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), name="half",
                  lowering=_lowering(True), poison=True, args=(x,))
    assert bool(jnp.all(out[:4] == 1)) and bool(jnp.all(jnp.isnan(out[4:])))


def test_flash_writes_every_output_element(rng):
    # Rows with no visible key (segment of one padded query) must still be written: the
    # output must be finite everywhere and zero where nothing is visible.
    q, k, v = _inputs(rng, s=20)
    seg = jnp.asarray([[1] * 10 + [2] * 10, [3] * 20], jnp.int32)
    out = flash_attention(q, k, v, causal=True, segment_ids=seg, block_q=16, block_k=16,
                          poison_outputs=True)
    assert bool(jnp.all(jnp.isfinite(out)))
    ref = attention_reference(q, k, v, causal=True, segment_ids=seg)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_flash_cross_attention_lengths(rng):
    q, k, v = _inputs(rng, s=12, skv=30)
    for causal in (False, True):
        np.testing.assert_allclose(
            flash_attention(q, k, v, causal=causal, block_q=16, block_k=16,
                            poison_outputs=True),
            attention_reference(q, k, v, causal=causal), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args,match", [
    (dict(k_shape=(2, 8, 3, 16)), "kv heads dividing"),
    (dict(seg=np.zeros((2, 7), np.int32)), "segment_ids.shape"),
    (dict(k_dtype=jnp.bfloat16), "dtype"),
])
def test_flash_rejects_bad_arguments(args, match):
    q = jnp.zeros((2, 8, 4, 16))
    k = jnp.zeros(args.get("k_shape", (2, 8, 2, 16)), args.get("k_dtype", jnp.float32))
    with pytest.raises(SpecError, match=match):
        flash_attention(q, k, k, segment_ids=args.get("seg"))


def test_zigzag_token_assignment():
    ids = device_token_ids(16, [4, 4, 4, 4], zigzag=True)
    assert [list(t) for t in ids] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                      [6, 7, 8, 9]]
    uneven = device_token_ids(10, [4, 3, 2, 1], zigzag=True)
    assert sorted(np.concatenate(uneven).tolist()) == list(range(10))
    assert [len(t) for t in uneven] == [4, 3, 2, 1]


@pytest.mark.parametrize("chunks,zigzag,causal", [
    (None, True, True), ([10, 6, 4, 4], True, True), ([5, 7, 9, 3], False, False),
    (None, False, True)])
def test_context_parallel_equals_full_attention(rng, chunks, zigzag, causal):
    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    q, k, v = _inputs(rng, b=1, s=24, h=2, kvh=1, d=8)
    seg = _segments(rng, 1, 24)
    kw = dict(causal=causal, segment_ids=seg)
    cp = lambda q, k, v: context_parallel_attention(q, k, v, mesh, "context",
                                                    chunk_lengths=chunks, zigzag=zigzag,
                                                    block_q=16, block_k=16, **kw)
    _equals_reference(cp, (q, k, v), kw, rng)


def test_context_parallel_rejects_bad_chunks(rng):
    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    q, k, v = _inputs(rng, b=1, s=24, h=2, kvh=1, d=8)
    with pytest.raises(SpecError, match="summing to the sequence length 24"):
        context_parallel_attention(q, k, v, mesh, chunk_lengths=[6, 6, 6, 5])
    with pytest.raises(SpecError, match="4 lengths"):
        context_parallel_attention(q, k, v, mesh, chunk_lengths=[12, 12])
    with pytest.raises(SpecError, match="mesh axis"):
        context_parallel_attention(q, k, v, mesh, axis="seq")


def _ring_grad_temp_bytes(n, chunk=64, h=2, d=16, custom=True):
    """Compiled temp bytes per device of the gradient of ring attention over ``n``
    devices, each holding ``chunk`` tokens (the sequence grows with the ring)."""
    from jax.sharding import PartitionSpec as P

    from hetshard.kernels.ring_attention import _ring_forward, ring_attention
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    s = n * chunk
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (1, s))

    def body(q, k, v, p):
        if custom:
            return ring_attention(q, k, v, axis_name="context", axis_size=n, causal=True,
                                  q_positions=p, kv_positions=p, block_q=32, block_k=32)
        z = jnp.zeros(p.shape, jnp.int32)  # autodiff of the forward loop: steps kept
        return _ring_forward(q, k, v, p, p, z, z, ("context", n, True, False, None, 32, 32,
                                                  None))[0]

    def loss(q, k, v, p):
        out = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "context"),) * 4,
                            out_specs=P(None, "context"), check_vma=False)(q, k, v, p)
        return jnp.sum(out * out)

    x = jax.ShapeDtypeStruct((1, s, h, d), jnp.float32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        x, x, x, jax.ShapeDtypeStruct(pos.shape, jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_ring_backward_holds_a_constant_number_of_chunks():
    # Per-device chunk fixed, ring from 2 to 8 devices: the custom backward's temp memory
    # stays flat (it re-sends K/V instead of keeping each step's chunk), where autodiff of
    # the forward loop grows with the ring.
    chunk_bytes = 64 * 2 * 16 * 4
    custom = [_ring_grad_temp_bytes(n) for n in (2, 4, 8)]
    plain = [_ring_grad_temp_bytes(n, custom=False) for n in (2, 4, 8)]
    assert custom[2] - custom[0] <= 2 * chunk_bytes, (custom, plain)
    assert plain[2] - plain[0] >= 6 * chunk_bytes, (custom, plain)  # what the test guards
