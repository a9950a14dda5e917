import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import hetshard_models as models
from hetshard.errors import SpecError
from hetshard.rewrite import count_attention, swap_attention
from hetshard_models import data


def _lm_loss(graphdef):
    def loss(params, batch):
        logits = nnx.merge(graphdef, params)(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                               batch["targets"]).mean()
    return loss


def _close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_flash_swap_keeps_loss_and_gradients_of_a_train_step(name, rng):
    model = models.build(name)
    graphdef, params = nnx.split(model)
    batch = data.text_batch(rng, 2, 32, model.config.vocab)
    loss = _lm_loss(graphdef)
    swapped = swap_attention(loss, "flash", block_q=16, block_k=16)
    assert count_attention(loss, params, batch) == model.config.layers
    jaxpr = str(jax.make_jaxpr(swapped)(params, batch))
    assert jaxpr.count("pallas_call") == model.config.layers
    assert "hetshard_attention" not in jaxpr
    l0, g0 = jax.value_and_grad(loss)(params, batch)
    l1, g1 = jax.value_and_grad(swapped)(params, batch)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    _close(g1, g0)


@pytest.mark.parametrize("kv_heads,heads_split", [(4, True), (2, False)])
def test_flash_on_a_stage_mesh_runs_per_device(kv_heads, heads_split, rng):
    # A data x tensor stage: the kernel runs on each device's samples and (when the
    # tensor degree divides both head counts) heads, with no gather; same values and
    # gradients as the reference, grouped-query attention and segments included.
    from hetshard.kernels.reference import attention_reference
    from hetshard.layout import attention_layout
    from hetshard.rewrite.attention import attention_runner
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
    q = jnp.asarray(rng.standard_normal((4, 32, 8, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((4, 32, kv_heads, 16)), jnp.float32)
            for _ in range(2))
    seg = jnp.asarray(np.repeat([[0] * 20 + [1] * 12], 4, axis=0), jnp.int32)
    assert attention_layout(mesh, q.shape, kv_heads) == (
        ("data",), "tensor" if heads_split else None)
    run = attention_runner("flash", mesh=mesh, block_q=16, block_k=16)
    spec = PartitionSpec("data", None, "tensor" if heads_split else None, None)
    qkv = jax.device_put((q, k, v), NamedSharding(mesh, spec))

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) ** 2).sum()
    flash = jax.jit(jax.value_and_grad(loss(lambda q, k, v: run(q, k, v, seg, 0.25, True)),
                                       argnums=(0, 1, 2)))
    ref = jax.value_and_grad(loss(lambda q, k, v: attention_reference(
        q, k, v, causal=True, segment_ids=seg, sm_scale=0.25)), argnums=(0, 1, 2))
    got, want = flash(*qkv), ref(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    _close(got[1], want[1], rtol=1e-4, atol=1e-5)
    hlo = flash.lower(*qkv).compile().as_text()
    assert " all-gather(" not in hlo and " all-gather-start(" not in hlo


def test_ring_swap_on_four_fake_devices(rng):
    model = models.build("gpt-tiny")
    graphdef, params = nnx.split(model)
    batch = data.text_batch(rng, 2, 32, model.config.vocab)
    loss = _lm_loss(graphdef)
    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    # As the runtime does: everything lives on the stage mesh, the step is jitted.
    params, batch = jax.device_put((params, batch), NamedSharding(mesh, PartitionSpec()))
    ring = swap_attention(loss, "ring", mesh=mesh, chunk_lengths=[12, 8, 8, 4], block_q=16,
                          block_k=16)
    l0, g0 = jax.jit(jax.value_and_grad(loss))(params, batch)
    l1, g1 = jax.jit(jax.value_and_grad(ring))(params, batch)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    _close(g1, g0, rtol=1e-4, atol=1e-5)


def test_unmodified_flax_attention_is_found_and_swapped(rng):
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False,
                                 rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(mha)
    x = jnp.asarray(rng.normal(size=(2, 24, 16)), jnp.float32)

    def f(p, x):
        return jnp.sum(nnx.merge(graphdef, p)(x) ** 2)

    def masked(p, x):
        mask = nnx.make_causal_mask(jnp.ones((2, 24)))
        return jnp.sum(nnx.merge(graphdef, p)(x, mask=mask) ** 2)

    def windowed(p, x):  # a sliding window: not causal, left as it is
        i = jnp.arange(24)
        mask = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 4))[None, None]
        return jnp.sum(nnx.merge(graphdef, p)(x, mask=mask) ** 2)

    assert count_attention(f, params, x) == 1
    assert count_attention(masked, params, x) == 1  # a causal mask: the kernel's own
    assert count_attention(windowed, params, x) == 0
    for fn in (f, masked):
        swapped = swap_attention(fn, "flash", block_q=16, block_k=16)
        assert str(jax.make_jaxpr(swapped)(params, x)).count("pallas_call") == 1
        np.testing.assert_allclose(swapped(params, x), fn(params, x), rtol=1e-5)
        _close(jax.grad(swapped)(params, x), jax.grad(fn)(params, x), rtol=1e-4, atol=1e-4)
    m = swap_attention(windowed, "flash")
    assert "pallas_call" not in str(jax.make_jaxpr(m)(params, x))
    np.testing.assert_allclose(m(params, x), windowed(params, x), rtol=1e-6)


def _einsum_attention(q, k, v, mask):
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(mask, scores, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _causal_tril(q, k, v, seg):
    s = q.shape[1]
    return _einsum_attention(q, k, v, jnp.tril(jnp.ones((s, s), bool)))


def _causal_and_segments(q, k, v, seg):  # Flax's mask helpers, as a packed LM writes them
    mask = nnx.combine_masks(nnx.make_causal_mask(seg),
                             nnx.make_attention_mask(seg, seg, jnp.equal))
    return nnx.dot_product_attention(q, k, v, mask=mask)


def _segments_only(q, k, v, seg):
    return _einsum_attention(q, k, v, (seg[:, :, None] == seg[:, None, :])[:, None])


def _jax_nn_causal(q, k, v, seg):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _strict(q, k, v, seg):  # a token does not see itself: not the kernel's mask
    i = jnp.arange(q.shape[1])
    return _einsum_attention(q, k, v, i[:, None] > i[None, :])


def _anti_causal(q, k, v, seg):
    i = jnp.arange(q.shape[1])
    return _einsum_attention(q, k, v, i[:, None] <= i[None, :])


def _shifted(q, k, v, seg):
    i = jnp.arange(q.shape[1])
    return _einsum_attention(q, k, v, i[:, None] + 1 >= i[None, :])


def _from_data(q, k, v, seg):  # padding keys masked: a mask from the data's values
    keep = seg > 0
    return _einsum_attention(q, k, v, (keep[:, None, :] & keep[:, :, None])[:, None])


def _positions(q, k, v, seg):  # compares an array other than an index: not provably causal
    return _einsum_attention(q, k, v, (seg[:, :, None] >= seg[:, None, :])[:, None])


@pytest.mark.parametrize("form, causal, segments", [
    (_causal_tril, True, False), (_causal_and_segments, True, True),
    (_segments_only, False, True), (_jax_nn_causal, True, False)])
def test_masked_attention_a_user_writes_is_swapped_with_its_mask(form, causal, segments, rng):
    """Causal masks (``jnp.tril``, ``nnx.make_causal_mask``, ``jax.nn``'s) and segment
    masks (a per-token array equal at query and key), alone or combined, are read from
    the mask's equations and given to the kernel: values and gradients as before, the
    mask's [s, s] arrays gone from the compiled program."""
    from hetshard.ir.attention_patterns import flax_patterns
    b, s, h, d = 2, 32, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.sort(rng.integers(1, 4, size=(b, s)), axis=1), jnp.int32)
    (pat,) = flax_patterns(jax.make_jaxpr(form)(q, k, v, seg).jaxpr).values()
    assert pat["causal"] is causal and (pat["seg"] is not None) is segments

    def loss(q, k, v, seg):
        return jnp.sum(form(q, k, v, seg) ** 2)

    for impl, opts in (("reference", {}), ("flash", {"block_q": 16, "block_k": 16})):
        swapped = swap_attention(loss, impl, **opts)
        np.testing.assert_allclose(swapped(q, k, v, seg), loss(q, k, v, seg), rtol=1e-5)
        _close(jax.grad(swapped, (0, 1, 2))(q, k, v, seg),
               jax.grad(loss, (0, 1, 2))(q, k, v, seg), rtol=1e-4, atol=1e-5)
    def compiled(fn):
        return jax.jit(jax.grad(fn)).lower(q, k, v, seg).compile().as_text()

    # No [.., s, s] array (scores, weights or mask) is left once the kernel takes it
    assert f"{s},{s}]" in compiled(loss)
    assert f"{s},{s}]" not in compiled(swap_attention(loss, "flash", block_q=16, block_k=16))


def test_attention_inside_a_scan_over_stacked_blocks_is_swapped(rng):
    """``nnx.scan`` over stacked blocks: the scan's body is evaluated with its (causal,
    masked) attention swapped, the loop kept."""
    import user_models
    step, (model, _, batch), _ = user_models.make_scanned()
    graphdef, params = nnx.split(model)
    loss = _lm_loss(graphdef)
    assert count_attention(loss, params, batch) == 1  # one body, run per block
    swapped = swap_attention(loss, "flash", block_q=16, block_k=16)
    jaxpr = str(jax.make_jaxpr(swapped)(params, batch))
    assert jaxpr.count("pallas_call") == 1 and "scan[" in jaxpr
    l0, g0 = jax.value_and_grad(loss)(params, batch)
    l1, g1 = jax.value_and_grad(swapped)(params, batch)
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    _close(g1, g0, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("form", [_strict, _anti_causal, _shifted, _from_data, _positions])
def test_masks_that_are_not_causal_or_segments_are_left_as_they_are(form, rng):
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 2, 8)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(rng.integers(0, 3, size=(2, 16)), jnp.int32)

    def loss(q, k, v, seg):
        return jnp.sum(jnp.nan_to_num(form(q, k, v, seg)) ** 2)

    assert count_attention(loss, q, k, v, seg) == 0
    swapped = swap_attention(loss, "flash", block_q=16, block_k=16)
    assert "pallas_call" not in str(jax.make_jaxpr(swapped)(q, k, v, seg))
    np.testing.assert_allclose(swapped(q, k, v, seg), loss(q, k, v, seg), rtol=1e-6)


def test_swap_rejects_bad_choices():
    with pytest.raises(SpecError, match="impl"):
        swap_attention(lambda x: x, "triton")
    with pytest.raises(SpecError, match="mesh"):
        swap_attention(lambda x: x, "ring")


@pytest.mark.parametrize("remat", [False, True])
def test_backward_splits_into_input_and_weight_passes(remat, rng):
    # Two dense layers: B makes the input's cotangent (the two dX matmuls), W the weights'
    # (the two dW matmuls) from what B hands over; together they equal the vjp.
    from hetshard.rewrite.backward import input_backward, weight_backward

    def f(p, x):
        h = jnp.tanh(x @ p["w1"])
        return [jnp.sin(h @ p["w2"])]
    g = jax.checkpoint(f) if remat else f
    p = {"w1": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32),
         "w2": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
    out, vjp = jax.jit(lambda p, x: jax.vjp(g, p, x))(p, x)
    cts = [jnp.asarray(rng.normal(size=out[0].shape), jnp.float32)]
    want_p, want_x = vjp(cts)
    got_x, carried = jax.jit(input_backward)(vjp, cts)
    got_p = jax.jit(weight_backward)(vjp, cts, carried)
    _close(got_x[0], want_x)
    _close(got_p, jax.tree.leaves(want_p))
    assert carried  # W reads the layers' output cotangents from B

    def dots(fn, *args):
        return jax.jit(fn).lower(*args).as_text().count("dot_general")
    full = dots(lambda v, c: v(c), vjp, cts)
    b, w = dots(input_backward, vjp, cts), dots(weight_backward, vjp, cts, carried)
    # Every matmul once: the dW pair in W, the dX pair (and any recomputation) in B.
    assert (b, w, full) == ((4, 2, 6) if remat else (2, 2, 4))


def test_dependencies_follow_cond_while_and_scan_bodies():
    """Each output of a cond reads the branch index and what it reads in either branch,
    not every operand; a loop's carries are followed to a fixed point (a swap reaches
    both), and a while loop's outputs read what its condition reads."""
    from hetshard.ir.dependencies import output_dependencies

    def cond(i, a, b):
        return jax.lax.cond(i > 0, lambda a, b: (a * 2, b), lambda a, b: (a, b + 1), a, b)
    deps = output_dependencies(jax.make_jaxpr(cond)(1, jnp.ones(3), jnp.ones(3)))
    assert deps == [frozenset({0, 1}), frozenset({0, 2})]

    def swap(n, a, b, c):
        def body(carry):
            k, a, b = carry
            return k + 1, b, a
        _, a, b = jax.lax.while_loop(lambda carry: carry[0] < n, body, (0, a, b))
        return a, b, c
    deps = output_dependencies(jax.make_jaxpr(swap)(3, jnp.ones(3), jnp.ones(3),
                                                    jnp.ones(3)))
    assert deps == [frozenset({0, 1, 2}), frozenset({0, 1, 2}), frozenset({3})]

    def scan(a, b, xs):
        def body(carry, x):
            a, b = carry
            return (a + x, b * 2), a
        (a, b), ys = jax.lax.scan(body, (a, b), xs)
        return a, b, ys
    deps = output_dependencies(jax.make_jaxpr(scan)(jnp.ones(()), jnp.ones(()),
                                                    jnp.ones(4)))
    assert deps == [frozenset({0, 2}), frozenset({1}), frozenset({0, 2})]


def test_a_users_remat_survives_the_attention_swap(rng):
    """A block under ``nnx.remat`` (a checkpoint around the attention) is evaluated in
    place to swap its attention, and stays under a checkpoint of the same policy: the
    rewritten function still recomputes it in the backward (same values and
    gradients). Without it the user's remat was silently dropped."""
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False,
                                 rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(mha)
    x = jnp.asarray(rng.normal(size=(2, 24, 16)), jnp.float32)
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def f(p, x):
        block = jax.checkpoint(lambda p, x: nnx.merge(graphdef, p)(x), policy=policy)
        return jnp.sum(block(p, x) ** 2)

    swapped = swap_attention(f, "flash", block_q=16, block_k=16)
    forward = jax.make_jaxpr(swapped)(params, x)
    assert str(forward).count("pallas_call") == 1
    (eqn,) = [e for e in forward.jaxpr.eqns if e.primitive.name == "remat2"]
    assert eqn.params["policy"] is policy and "pallas_call" in str(eqn.params["jaxpr"])
    np.testing.assert_allclose(swapped(params, x), f(params, x), rtol=1e-5)
    _close(jax.grad(swapped)(params, x), jax.grad(f)(params, x), rtol=1e-4, atol=1e-4)
