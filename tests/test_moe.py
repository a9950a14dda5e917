"""Mixture-of-experts layers found in a user's traced program (issue 51, 1): nothing in
the model is annotated; the router, the experts' stacked weights, the dispatch and the
combine are read off the trace."""

import jax
import jax.numpy as jnp
import pytest
import user_models
from flax import nnx

import hetshard
from hetshard.ir.moe import moe_layers

CLUSTER = "h100-a100-v100-x8"


def _two_stages(program):
    """A pinned plan: half the layers on the two H100s, half on the four V100s, global
    batch 8 in 2 micro-batches."""
    from hetshard._plan import Pipeline, Plan, Stage
    from hetshard.cluster import Cluster
    n = program.layering(2).num_layers
    stages = (Stage(0, n // 2, (0, 1), "H100-80GB", (("data", 2),)),
              Stage(n // 2, n, (4, 5, 6, 7), "V100-32GB", (("data", 4),)))
    return Plan(program.name, Cluster.load(CLUSTER).to_dict(), 8, program.seq_len,
                (Pipeline(stages, 8, 2, 2),), dtype=program.dtype, attention="reference")


def _program(**kw):
    step, args, _ = user_models.make_moe(**kw)
    return hetshard.Program(step, args)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dispatch", ["dropless", "capacity", "dense"])
def test_each_layer_is_found_with_its_router_experts_and_dispatch(dispatch, k):
    program = _program(experts=4, k=k, dispatch=dispatch, shared=k == 2, layers=2)
    layers = program.moe_layers
    assert [(x.experts, x.k, x.dispatch) for x in layers] == [(4, k, dispatch)] * 2
    for n, layer in enumerate(layers):
        assert program.param_path(layer.router) == f"blocks/{n}/moe/router/kernel"
        assert sorted(program.param_path(i) for i in layer.expert_weights) == \
            [f"blocks/{n}/moe/w_in", f"blocks/{n}/moe/w_out"]
        assert len(layer.matmuls) == 2 and layer.combine is not None
        assert layer.combine > max(layer.matmuls)
    # the capacity, of the 2-sample micro-batch traced: capacity_factor (2) x tokens
    # (2 x 16) x k / experts (4)
    expected = 2 * 2 * 16 * k // 4 if dispatch == "capacity" else None
    assert {x.capacity for x in layers} == {expected}


def test_a_shared_expert_is_not_an_expert_and_dense_models_have_no_layer():
    program = _program(experts=4, k=2, dispatch="dropless", shared=True, layers=1)
    (layer,) = program.moe_layers
    names = {program.param_path(i) for i in layer.expert_weights}
    assert not any("shared" in n for n in names)
    step, args, _ = user_models.make_transformer()
    assert hetshard.Program(step, args).moe_layers == []


def test_a_top_k_that_routes_nothing_is_no_layer():
    # A top-k over the samples' scores beside a stacked weight that no top-k's count
    # matches: neither is a mixture of experts.
    def loss(w, stack, x):
        top = jax.lax.top_k(x @ w, 2)[0]  # 3 scores per row, 2 kept
        return top.sum() + jnp.einsum("bd,edf->bef", x, stack).sum()

    closed = jax.make_jaxpr(loss)(jnp.ones((8, 3)), jnp.ones((5, 8, 4)), jnp.ones((2, 8)))
    assert moe_layers(closed.jaxpr) == []


def test_a_layer_inside_a_jitted_call_names_the_programs_weights():
    model = user_models.MoELM(nnx.Rngs(0), layers=1, experts=4, k=2,
                              dispatch="capacity")
    graph, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)

    @jax.jit
    def inner(*ls):
        m = nnx.merge(graph, jax.tree.unflatten(tree, ls))
        return m(jnp.zeros((2, 16), jnp.int32)).sum()

    closed = jax.make_jaxpr(lambda *ls: inner(*ls) * 2.0)(*leaves)
    (layer,) = moe_layers(closed.jaxpr)
    assert layer.level == (0,) and layer.dispatch == "capacity"
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        state)[0]]
    assert sorted(paths[i] for i in layer.expert_weights) == [
        "['blocks'][0]['moe']['w_in'].value", "['blocks'][0]['moe']['w_out'].value"]


def _dispatch_loss(shift: int):
    """A dropless top-2 layer's loss on ``x`` [batch, seq, d]; the gather reads token
    ``(order // 2 + shift) % tokens``: 0 is the dispatch, 1 gives each routed row its
    neighbour's token (the last token of a sample takes the next sample's)."""
    def loss(router, w_in, x):
        b, s, d = x.shape
        t = x.reshape(b * s, d)
        gates, idx = jax.lax.top_k(jax.nn.softmax(t @ router), 2)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat)
        sizes = jnp.bincount(flat, length=4).astype(jnp.int32)
        y = jax.lax.ragged_dot(t[(order // 2 + shift) % (b * s)], w_in, sizes)
        out = jnp.zeros((b * s * 2, d), y.dtype).at[order].set(y)
        out = (out.reshape(b * s, 2, d) * gates[..., None]).sum(1)
        return jnp.mean(out.reshape(b, s, d) ** 2)
    return jax.make_jaxpr(loss)(jnp.ones((8, 4)), jnp.ones((4, 8, 8)), jnp.ones((2, 3, 8)))


def test_a_dropless_dispatch_cuts_by_token_and_one_that_moves_rows_does_not():
    """The sort, grouped matmuls and scatter back are read as per token only where the
    index arithmetic returns each row to the token it was gathered from (checked on
    the region's own arithmetic); a gather that reads a neighbouring token mixes
    samples, and is said to."""
    from hetshard.ir.samples import sample_coupling, unfollowed
    exact = _dispatch_loss(0)
    assert sample_coupling(exact, [2]) is None and unfollowed(exact, [2]) is None
    moved = _dispatch_loss(1)
    assert "mixes samples" in sample_coupling(moved, [2])


@pytest.mark.parametrize("balance", [None, "sequence"])
def test_a_dropless_moe_pipeline_with_micro_batches_equals_one_device(balance):
    """A top-2 dropless MoE (sort, ragged_dot, scatter back), pinned to two stages on two
    GPU types with 2 micro-batches: no warning that the loss mixes samples, and the
    same losses as one device; with DeepSeek-V3's sequence-level balance loss (one per
    sample) too."""
    import warnings

    import numpy as np
    from flax import nnx

    def train(step, args, batches):
        args, out = list(args), []
        for i in range(3):
            args[-1] = batches[i % len(batches)]
            out.append(float(step(*args)))
        return out

    step, args, batches = user_models.make_moe(dispatch="dropless", k=2, layers=4,
                                               balance=balance)
    want = train(nnx.jit(step), args, batches)
    step, args, batches = user_models.make_moe(dispatch="dropless", k=2, layers=4,
                                               balance=balance)
    program = hetshard.Program(step, args)
    assert program.samples.coupling is None and program.samples.gap is None
    cluster, plan = CLUSTER, _two_stages(program)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = train(hetshard.jit(step, cluster=cluster, plan=plan), args, batches)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_count_by_expert_is_a_sum_over_the_samples_and_a_per_sample_one_is_not():
    """``zeros.at[ids].add(1)`` over every sample's ids (a dropless layer's tokens per
    expert) is a sum over the samples; the same under ``jax.vmap`` (one count per
    sample) is not taken for one (the analysis stops there instead)."""
    from hetshard.ir.samples import summed_outputs, unfollowed

    def counts(ids):
        return jnp.zeros(4).at[ids.reshape(-1)].add(1.0)[0]
    ids = jnp.zeros((3, 5), jnp.int32)
    closed = jax.make_jaxpr(counts)(ids)
    twin = jax.make_jaxpr(counts)(jnp.zeros((6, 5), jnp.int32))
    assert unfollowed(closed, [0]) is None
    assert summed_outputs(closed, twin, 2.0, [0]) == [True]
    per_sample = jax.make_jaxpr(jax.vmap(lambda i: jnp.zeros(4).at[i].add(1.0)))(ids)
    assert "scatter-add" in unfollowed(per_sample, [0])


def test_a_grouped_matmul_is_priced_as_the_tokens_it_routes():
    """``ragged_dot`` and its two gradients each cost 2 * rows * K * N flops (JAX's
    roofline counts none), as matmuls, and their shape for the GEMM efficiency is the
    groups' (the tokens per expert set the tiles)."""
    from hetshard.cost.profile import _dims
    from hetshard.ir.graph import MATMULS
    from hetshard.ir.trace import trace

    def f(x, w, g):
        return jax.lax.ragged_dot(x, w, g).sum()
    shapes = (jax.ShapeDtypeStruct((64, 16), jnp.float32),
              jax.ShapeDtypeStruct((4, 16, 32), jnp.float32),
              jax.ShapeDtypeStruct((4,), jnp.int32))
    ops = [o for o in trace(jax.grad(f, argnums=(0, 1)), *shapes).ops
           if o.primitive == "ragged_dot_general"]
    assert [o.flops for o in ops] == [2.0 * 64 * 16 * 32] * 3
    assert all(o.primitive in MATMULS for o in ops)
    # forward: 4 groups of 16 rows, N 32, K 16; weight gradient: K (the rows) split
    assert sorted(_dims(o) for o in ops) == sorted(
        [(4.0, 16.0, 32.0, 16.0), (4.0, 16.0, 32.0, 16.0), (4.0, 16.0, 16.0, 32.0)])


def test_a_whole_batch_balance_loss_is_taken_per_micro_batch_when_asked():
    """Switch's balance loss (a product of two batch means) keeps its step whole by
    default. With ``batch_reductions="per_piece"`` a pinned 2-stage plan of 2
    micro-batches runs without that warning, and trains as the per-micro-batch
    reference does: each half of the batch's loss and gradients from its own tokens,
    averaged, one AdamW update."""
    import warnings

    import numpy as np

    from hetshard.errors import SpecError

    step, args, batches = user_models.make_moe(dispatch="dropless", k=2, layers=2,
                                               balance="batch")
    assert "non-linear function" in hetshard.Program(step, args).samples.coupling
    with pytest.raises(SpecError, match="batch_reductions"):
        hetshard.jit(step, cluster=CLUSTER, batch_reductions="micro")
    program = hetshard.Program(step, args, batch_reductions="per_piece")
    assert program.samples.coupling is None

    model, opt, _ = args
    want = []
    for i in range(3):
        batch = batches[i % len(batches)]
        halves = [jax.tree.map(lambda x, a=a: x[a:a + 4], batch) for a in (0, 4)]
        got = [nnx.value_and_grad(user_models.moe_balanced_loss)(model, h) for h in halves]
        want.append(float(sum(v for v, _ in got) / 2))
        opt.update(model, jax.tree.map(lambda a, b: (a + b) / 2, got[0][1], got[1][1]))

    step, args, batches = user_models.make_moe(dispatch="dropless", k=2, layers=2,
                                               balance="batch")
    cluster, plan = CLUSTER, _two_stages(program)
    jitted = hetshard.jit(step, cluster=cluster, plan=plan, batch_reductions="per_piece")
    got, args = [], list(args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            args[-1] = batches[i % len(batches)]
            got.append(float(jitted(*args)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    whole = float(user_models.moe_balanced_loss(user_models.make_moe(
        dispatch="dropless", k=2, layers=2, balance="batch")[1][0], batches[0]))
    assert abs(whole - want[0]) > 1e-6  # (the pieces' loss is not the whole batch's)
