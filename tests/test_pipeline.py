"""MPMD pipelines: stage programs on uneven submeshes match single-device training."""

import dataclasses
import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hetshard
import hetshard_models as models
from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster import Cluster
from hetshard.collectives import congruent, sum_across, sum_across_collective
from hetshard.rewrite.pipeline import Remat, StageSplitError, run_sequential, split_stages
from hetshard.runtime.pipeline import PipelineSetupError
from hetshard.sim import simulate
from hetshard_models import data, losses

CLUSTER = "h100-a100-v100-x8"  # devices 0-1 H100, 2-3 A100, 4-7 V100
H, A, V = "H100-80GB", "A100-80GB", "V100-32GB"


lm_loss, mllm_loss = losses.text_loss, losses.mllm_loss


def _stage(start, end, devices, gpu, **axes):
    shape = tuple(axes.items()) or (("data", len(devices)),)
    return Stage(start, end, tuple(devices), gpu, shape)


def _plan(model, pipelines, batch=8, seq=16, attention="reference"):
    # "flash": the plan says "auto", which runs the flash kernel on these CPU devices (an
    # explicit "flash" is refused for the V100s, which compute in bfloat16 here: Triton
    # has no bfloat16 products before compute capability 8.0).
    return Plan(model, Cluster.load(CLUSTER).to_dict(), batch, seq, tuple(pipelines),
                attention="auto" if attention == "flash" else attention)


def _batches(model, n=2, batch=8, seq=16):
    rng = np.random.default_rng(0)
    if model.startswith("llava"):
        config = models.resolve(model)
        return [data.mllm_batch(rng, batch, config, seq_len=seq) for _ in range(n)]
    return [data.text_batch(rng, batch, seq, 256) for _ in range(n)]


def _train(model_name, loss_fn, batches, steps, tx, plan=None):
    model = models.build(model_name, rngs=0)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if plan is None:
        @nnx.jit
        def step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss
    else:
        @hetshard.jit(cluster=CLUSTER, plan=plan)
        def step(model, optimizer, batch):
            loss, grads = hetshard.value_and_grad(loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss
    losses = [float(step(model, opt, batches[i % len(batches)])) for i in range(steps)]
    return losses, model, opt, step


def _assert_matches_one_device(model_name, plan, loss_fn=lm_loss, steps=3, batch=8, seq=16):
    # SGD: parameters are compared too (AdamW turns reduction-order noise in near-zero
    # gradients into full +-lr steps; see tests/test_runtime.py).
    batches = _batches(model_name, batch=batch, seq=seq)
    want, ref_model, _, _ = _train(model_name, loss_fn, batches, steps, optax.sgd(0.1))
    got, model, opt, step = _train(model_name, loss_fn, batches, steps, optax.sgd(0.1), plan)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                    jax.tree.leaves(nnx.state(ref_model, nnx.Param)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(opt.step[...]) == steps  # NNX objects updated in place
    return step


# ---- the split itself ------------------------------------------------------------------

def _flat_loss(model_name, loss_fn, batch):
    model = models.build(model_name, rngs=0)
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    b_leaves, b_tree = jax.tree.flatten(batch)

    def loss(sl, bl):
        return loss_fn(nnx.merge(graphdef, jax.tree.unflatten(tree, sl)),
                       jax.tree.unflatten(b_tree, bl))
    return loss, leaves, [jnp.asarray(x) for x in b_leaves]


@pytest.mark.parametrize("model_name,loss_fn,ranges", [
    ("gpt-tiny", lm_loss, [(0, 1), (1, 3), (3, 4)]),
    ("llava-tiny", mllm_loss, [(0, 5), (5, 9)]),
])
def test_stages_chained_reproduce_loss_and_gradient(model_name, loss_fn, ranges):
    batch = _batches(model_name, n=1, batch=2)[0]
    loss, leaves, b = _flat_loss(model_name, loss_fn, batch)
    split = split_stages(loss, leaves, b, ranges, list(range(len(leaves))))
    assert len(split.stages) == len(ranges) and split.num_layers == ranges[-1][1]
    assert all(st.recvs for st in split.stages[1:])  # activations really cross
    np.testing.assert_allclose(jax.jit(run_sequential, static_argnums=0)(split, leaves, b)[0],
                               jax.jit(loss)(leaves, b), rtol=1e-6)
    # Backward stage by stage, last to first, as the runtime does.
    values, vjps = {}, []
    for st in split.stages:
        fo, oo, vjp = jax.jit(st.forward)(
            [leaves[i] for i in st.params], [leaves[i] for i in st.frozen],
            [b[i] for i in st.batch], [values[v] for v in st.recvs])
        others = iter(oo)
        floats = dict(zip(st.diff_sends, fo, strict=True))
        for j, v in enumerate(st.sends):
            values[v] = floats[j] if j in floats else next(others)
        vjps.append(vjp)
    grads = [jnp.zeros_like(x) for x in leaves]
    cts: dict = {}
    for st, vjp in zip(reversed(split.stages), reversed(vjps), strict=True):
        seed = [jnp.ones(()) if st.outputs.get(j) == 0 else
                cts.get(st.sends[j], jnp.zeros(st.sends[j].aval.shape)) for j in st.diff_sends]
        pct, rct = jax.jit(lambda f, s: f(s))(vjp, seed)
        for i, g in zip(st.params, pct, strict=True):
            grads[i] = grads[i] + g
        for i, c in zip(st.diff_recvs, rct, strict=True):
            cts[st.recvs[i]] = cts.get(st.recvs[i], 0) + c
    want = jax.jit(jax.grad(loss))(leaves, b)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_split_rejects_ranges_that_do_not_cover_the_layers():
    batch = _batches("gpt-tiny", n=1, batch=2)[0]
    loss, leaves, b = _flat_loss("gpt-tiny", lm_loss, batch)
    with pytest.raises(StageSplitError, match="4 layers"):
        split_stages(loss, leaves, b, [(0, 2), (2, 3)], [])
    # A loss without layer scopes is split at the layers found in it (here one).
    with pytest.raises(StageSplitError, match="1 layers"):
        split_stages(lambda s, bl: (s[0] ** 2).sum(), leaves, b, [(0, 1), (1, 2)], [])


# ---- end to end: pipelines equal single-device training ---------------------------------

def test_two_stages_on_uneven_submeshes_3_plus_5():
    plan = _plan("gpt-tiny", [Pipeline((
        _stage(0, 2, (4, 5, 6), V, data=1, tensor=3),
        _stage(2, 4, (0, 1, 2, 3, 7), f"{A}+{H}+{V}", data=1, tensor=5)), 8, 2, 4)])
    step = _assert_matches_one_device("gpt-tiny", plan)
    runner = next(iter(step._compiled.values())).runner
    # Residuals travel inside the returned vjp pytree: one compile per stage function
    # (backward: the first micro-batch starts the accumulator), not one per micro-batch.
    for run in (r for row in runner.runs for r in row):
        assert (run.fwd._cache_size(), run.bwd._cache_size()) == (1, 2)
    assert len({d for r in runner.runs[0] for d in r.mesh.devices.flat}) == 8


@pytest.mark.parametrize("attention", ["reference", "flash"])
def test_context_parallel_pipeline_stages_match_one_device(attention):
    # Stage 0: data 2 x context 2 (over H100s and A100s), stage 1: context 4 on the V100s;
    # each splits the micro-batch's sequence over its context axis (tokens and the
    # activations it receives) and runs attention as a zigzag ring over it.
    from hetshard._plan import Context
    from hetshard.layout import activation_sharding
    stages = (_stage(0, 2, (0, 1, 2, 3), "A100-80GB+H100-80GB", data=2, context=2),
              _stage(2, 4, (4, 5, 6, 7), V, context=4))
    # Stage 1 attends uneven chunks (its context degree is the plan's): 6, 6, 2, 2 tokens.
    plan = Plan("gpt-tiny", Cluster.load(CLUSTER).to_dict(), 8, 16,
                (Pipeline(stages, 8, 2, 2),), context=Context(4, (6, 6, 2, 2), True),
                attention="auto" if attention == "flash" else attention)  # as _plan
    step = _assert_matches_one_device("gpt-tiny", plan)
    runner = next(iter(step._compiled.values())).runner
    mesh = runner.runs[0][1].mesh
    assert tuple(activation_sharding((4, 16, 32), mesh, 4, 16).spec) == (None, "context")
    assert runner.splits[0].runner(mesh) is not runner.splits[0].run  # the ring
    assert plan.context_chunks(stages[1]) == (6, 6, 2, 2) and not plan.context_chunks(
        stages[0])
    assert runner.runs[0][1].fwd.fn.args[-1] == (6, 6, 2, 2)  # what stage 1 attends


def test_four_stage_1f1b_pipeline_on_mixed_gpus_with_remat():
    plan = _plan("gpt-tiny", [Pipeline((
        _stage(0, 1, (0,), H), _stage(1, 2, (2, 3), A, data=2),
        Stage(2, 3, (4, 5), V, (("data", 2),), remat="full"),
        Stage(3, 4, (6, 7), V, (("data", 2),), remat="selective")), 8, 2, 4)])
    _assert_matches_one_device("gpt-tiny", plan)


def _blocks_stage():
    """gpt-tiny split as embedding | both blocks | head: the middle stage and its forward's
    arguments (parameters, frozen state, batch, what the first stage sent)."""
    batch = _batches("gpt-tiny", n=1, batch=2)[0]
    loss, leaves, b = _flat_loss("gpt-tiny", lm_loss, batch)
    split = split_stages(loss, leaves, b, [(0, 1), (1, 3), (3, 4)],
                         list(range(len(leaves))))
    first, st = split.stages[0], split.stages[1]
    fo, _, _ = jax.jit(first.forward)([leaves[i] for i in first.params],
                                      [leaves[i] for i in first.frozen],
                                      [b[i] for i in first.batch], [])
    recvs = dict(zip((first.sends[j] for j in first.diff_sends), fo, strict=True))
    return st, ([leaves[i] for i in st.params], [leaves[i] for i in st.frozen],
                [b[i] for i in st.batch], [recvs[v] for v in st.recvs])


def test_partial_remat_recomputes_only_the_stages_first_layers():
    # gpt-tiny's two blocks as one stage, k of them checkpointed (each on its own, the
    # rest under remat none's checkpoint): the residuals the vjp keeps shrink and the
    # backward's flops grow by one block's forward (less what remat none recomputes of
    # it) per recomputed block; k = 2 is the whole stage's full remat.
    st, args = _blocks_stage()
    wrap = functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    params = {id(x) for x in args[0]}
    kept, flops, grads = [], [], []
    for remat in ((Remat("none"), None), (wrap, 1), (wrap, 2), (wrap, None)):
        outs, _, vjp = jax.jit(functools.partial(st.forward, remat=remat))(*args)
        cts = [jnp.ones_like(o) for o in outs]
        kept.append(sum(x.nbytes for x in jax.tree.leaves(vjp) if id(x) not in params))
        cost = jax.jit(lambda v, c: v(c)).lower(vjp, cts).compile().cost_analysis()
        flops.append((cost[0] if isinstance(cost, list) else cost)["flops"])
        grads.append(jax.tree.leaves(jax.jit(lambda v, c: v(c))(vjp, cts)))
    assert kept[0] > kept[1] > kept[2] and kept[2] == kept[3]
    assert flops[0] < flops[1] < flops[2] and flops[2] == pytest.approx(flops[3], rel=1e-3)
    assert flops[2] - flops[1] == pytest.approx(flops[1] - flops[0], rel=0.1)
    for g in grads[1:]:
        for x, y in zip(g, grads[0], strict=True):
            # float32 rounding, which differs with where the elementwise values are
            # recomputed: ~1e-6 of the leaf's largest gradient (under all-ones seeds
            # some leaves' are 0 up to it)
            scale = float(np.abs(y).max())
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=5e-6 * max(scale, 1.0))


def test_pipeline_with_a_partial_remat_stage_matches_one_device():
    plan = _plan("gpt-tiny", [Pipeline((
        Stage(0, 3, (0, 1), H, (("data", 2),), remat="full", remat_layers=2),
        _stage(3, 4, (4, 5), V, data=2)), 8, 2, 2, schedule="zbh1")])
    _assert_matches_one_device("gpt-tiny", plan)


def test_stage_boundaries_inside_blocks_match_one_device():
    # Layers are block halves: gpt-tiny's 6 (embed, 2 x (attention, MLP), head). Stage 0
    # ends after block 0's attention, stage 1 after block 1's attention (a tensor-parallel
    # stage recomputing its first half), stage 2 runs the last MLP and the head.
    plan = dataclasses.replace(_plan("gpt-tiny", [Pipeline((
        _stage(0, 2, (0,), H),
        Stage(2, 4, (2, 3), A, (("data", 1), ("tensor", 2)), remat="full", remat_layers=1),
        _stage(4, 6, (4, 5), V, data=2)), 8, 2, 4)]), split_blocks=True)
    _assert_matches_one_device("gpt-tiny", plan)
    batch = _batches("gpt-tiny", n=1, batch=2)[0]
    loss, leaves, b = _flat_loss("gpt-tiny", lm_loss, batch)
    split = split_stages(loss, leaves, b, [(0, 2), (2, 4), (4, 6)], [], split_blocks=True)
    assert split.layer_names == ["decoder/embed", "decoder/layer_0/half_0",
                                 "decoder/layer_0/half_1", "decoder/layer_1/half_0",
                                 "decoder/layer_1/half_1", "decoder/head"]
    with pytest.raises(StageSplitError, match="6 layers"):
        split_stages(loss, leaves, b, [(0, 2), (2, 4)], [], split_blocks=True)


def test_stages_with_different_data_ways_share_the_micro_batch():
    # Micro-batches of 4 samples: 2 per H100 (data=2), 1 per V100 (data=4), and the
    # A100 stage splits them 2 ways again; activations re-shard between the layouts.
    plan = _plan("gpt-tiny", [Pipeline((
        _stage(0, 1, (0, 1), H, data=2), _stage(1, 3, (4, 5, 6, 7), V, data=4),
        _stage(3, 4, (2, 3), A, data=1, tensor=2)), 8, 2, 2)])
    assert [plan.pipelines[0].stage_micro_batch(j) for j in range(3)] == [2, 1, 4]
    _assert_matches_one_device("gpt-tiny", plan)
    # Data ways that do not divide the micro-batch (2 samples, 4 ways) each run all of it.
    odd = Pipeline((_stage(0, 1, (0,), H), _stage(1, 4, (4, 5, 6, 7), V, data=4)), 8, 2, 4)
    assert [odd.stage_micro_batch(j) for j in range(2)] == [2, 2]


def test_gpipe_schedule_and_flash_attention_in_stages():
    plan = _plan("gpt-tiny", [Pipeline((_stage(0, 2, (0, 1), H), _stage(2, 4, (4, 5), V)),
                                       8, 2, 2, schedule="gpipe")], attention="auto")
    _assert_matches_one_device("gpt-tiny", plan, steps=2)


def test_interleaved_schedule_two_stages_per_submesh():
    # Megatron-style virtual stages: stages 0 and 2 on the A100s, 1 and 3 on the V100s;
    # the tied embedding's head copy sits on the other submesh's second stage.
    a, v = ((2, 3), A), ((4, 5), V)
    plan = _plan("gpt-tiny", [Pipeline(tuple(
        _stage(j, j + 1, *(a if j % 2 == 0 else v)) for j in range(4)), 8, 1, 4,
        virtual_stages=2)])
    step = _assert_matches_one_device("gpt-tiny", plan)
    runner = next(iter(step._compiled.values())).runner
    assert [sorted(d.id for d in r.mesh.devices.flat) for r in runner.runs[0]] == \
        [[2, 3], [4, 5], [2, 3], [4, 5]]


def test_interleaved_schedule_with_a_micro_batch_count_the_submeshes_do_not_divide():
    # 3 micro-batches on 2 submeshes x 2 stages: a group of 2, then one of 1.
    a, v = ((2, 3), A), ((4, 5), V)
    plan = _plan("gpt-tiny", [Pipeline(tuple(
        _stage(j, j + 1, *(a if j % 2 == 0 else v)) for j in range(4)), 6, 1, 3,
        virtual_stages=2)], batch=6)
    _assert_matches_one_device("gpt-tiny", plan, steps=2, batch=6)


@pytest.mark.parametrize("overlap", [False, True])
def test_zero_bubble_schedule_runs_b_and_w_passes(overlap):
    # ZB-H1: four stages on mixed GPUs with remat, flash attention and a tensor-parallel
    # stage (with and without collective matmuls) keeping its q, k, v and MLP inputs
    # under a named remat policy; every backward runs as B (input
    # cotangent, sent back at once) then W (the weights' gradients, later). Training
    # matches one device.
    plan = _plan("gpt-tiny", [Pipeline((
        Stage(0, 1, (0, 1), H, (("data", 2),)),
        Stage(1, 2, (2, 3), A, (("data", 1), ("tensor", 2)), remat="save_qkv_mlp"),
        Stage(2, 3, (4, 5), V, (("data", 2),), remat="full"),
        Stage(3, 4, (6, 7), V, (("data", 2),), remat="selective")), 8, 1, 4,
        schedule="zbh1", extra_warmup=(1, 0, 0, 0))], attention="auto")
    plan = dataclasses.replace(plan, tp_overlap=overlap)
    from hetshard.sim.schedule import worker_order
    kinds = [k for k, _, _ in worker_order("zbh1", 4, 3, 4)]
    assert kinds.count("W") == 4 and kinds.index("W") > kinds.index("B")
    step = _assert_matches_one_device("gpt-tiny", plan, steps=2)
    runner = next(iter(step._compiled.values())).runner
    assert all(r.bwd_input is not None and r.bwd_weight is not None for r in runner.runs[0])


def test_extra_warmup_runs_forwards_ahead():
    # Stage 0 forwards all 4 micro-batches before its first backward (1F1B's 2 plus 2).
    plan = _plan("gpt-tiny", [Pipeline((_stage(0, 2, (0, 1), H), _stage(2, 4, (4, 5), V)),
                                       8, 1, 4, extra_warmup=(2, 0))])
    from hetshard.sim.schedule import worker_order
    assert [k for k, _, _ in worker_order("1f1b", 2, 0, 4, 1, (2, 0))][:5] == list("FFFFB")
    _assert_matches_one_device("gpt-tiny", plan, steps=2)


def test_two_pipelines_with_shares_5_3_and_different_layer_splits():
    fast = Pipeline((_stage(0, 1, (0,), H), _stage(1, 4, (1,), H)), 5, 1, 5)
    slow = Pipeline((_stage(0, 3, (4, 5, 6), V, data=1, tensor=3), _stage(3, 4, (7,), V)),
                    3, 1, 3)
    step = _assert_matches_one_device("gpt-tiny", _plan("gpt-tiny", [fast, slow]))
    runner = next(iter(step._compiled.values())).runner
    # The tied embedding is read by the first and the last stage of each pipeline; its
    # gradient and update live with its owner, the first stage.
    emb = runner.paths.index("0/embed/embedding")
    assert [o[emb] for o in runner.owner] == [0, 0]


def test_congruent_pipelines_sum_gradients_with_a_shard_map_collective(monkeypatch):
    calls = []
    import hetshard.runtime.pipeline as rt

    def spy(copies, *layouts):
        calls.append(len(copies[0]))
        return sum_across_collective(copies, *layouts)
    monkeypatch.setattr(rt, "sum_across_collective", spy)
    a = Pipeline((_stage(0, 2, (0,), H), _stage(2, 4, (2,), A)), 4, 2, 2)
    b = Pipeline((_stage(0, 2, (4,), V), _stage(2, 4, (5,), V)), 4, 2, 2)
    _assert_matches_one_device("gpt-tiny", _plan("gpt-tiny", [a, b]), steps=2)
    assert calls and sum(calls) > 0


def test_mllm_with_the_vision_encoder_on_its_own_stage():
    vision = _stage(0, 5, (4, 5, 6, 7), V, data=2, tensor=2)  # ViT + projector
    text = _stage(5, 9, (0, 1), H, data=2)
    plan = _plan("llava-tiny", [Pipeline((vision, text), 8, 2, 2)], seq=64)
    step = _assert_matches_one_device("llava-tiny", plan, loss_fn=mllm_loss, steps=2, seq=64)
    runner = next(iter(step._compiled.values())).runner
    first = runner.splits[0].stages[0]
    assert {runner.paths[i].split("/")[1] for i in first.params} == {"vision", "projector"}


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["reference", "flash"])
def test_mllm_pipeline_with_its_vision_encoder_on_a_context_stage(attention):
    """The vision encoder shares a data 2 x context 2 stage with the first decoder
    layers: only attention over the plan's sequence is a ring there, the encoder's
    attention over an image's patches stays whole (it failed as a ring over 17
    patches). Trains as one device."""
    from hetshard._plan import Context
    first = _stage(0, 6, (0, 1, 2, 3), "A100-80GB+H100-80GB", data=2, context=2)
    rest = _stage(6, 9, (4, 5, 6, 7), V, context=4)
    plan = Plan("llava-tiny", Cluster.load(CLUSTER).to_dict(), 8, 64,
                (Pipeline((first, rest), 8, 2, 2),), context=Context(4),
                attention="auto" if attention == "flash" else attention)  # as _plan
    _assert_matches_one_device("llava-tiny", plan, loss_fn=mllm_loss, steps=2, seq=64)


def test_collectives_sum_copies_on_other_submeshes():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    d = jax.devices()
    m1, m2 = Mesh(np.array(d[:2]), ("data",)), Mesh(np.array(d[2:4]), ("data",))
    m3 = Mesh(np.array(d[4:7]), ("data",))
    x = np.arange(8.0).reshape(4, 2)
    a = [jax.device_put(x, NamedSharding(m1, P("data")))]
    b = [jax.device_put(10 * x, NamedSharding(m2, P("data")))]
    c = [jax.device_put(100 * x, NamedSharding(m3, P()))]
    assert congruent([a[0].sharding, b[0].sharding])
    assert not congruent([a[0].sharding, c[0].sharding])
    out = sum_across_collective([a, b])
    for got, src in zip(out, (a, b), strict=True):
        np.testing.assert_array_equal(got[0], 11 * x)
        assert got[0].sharding == src[0].sharding
    out = sum_across([a, b, c])
    for got, src in zip(out, (a, b, c), strict=True):
        np.testing.assert_array_equal(got[0], 111 * x)
        assert got[0].sharding == src[0].sharding


def test_stacked_copies_and_shard_to_shard_hop():
    """The cross-process paths' building blocks, run within one process: congruent
    copies concatenate into one array on the stacked mesh without copies; the hop moves
    every shard to its counterpart; a scalar travels as shape (1,)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from hetshard.collectives import moves
    assert moves.stacked("hop", P("data", "tensor")) == P(("hop", "data"), "tensor")
    assert moves.stacked("hop", P(None, "tensor")) == P("hop", "tensor")
    assert moves.stacked("hop", P(("data", "fsdp"))) == P(("hop", "data", "fsdp"))
    assert moves.stacked("hop", P()) == P("hop")
    d = jax.devices()
    a = Mesh(np.array(d[:4]).reshape(2, 2), ("data", "tensor"))
    b = Mesh(np.array(d[4:]).reshape(2, 2), ("data", "tensor"))
    x = np.arange(48.0).reshape(4, 12)
    src, dst = NamedSharding(a, P("data", "tensor")), NamedSharding(b, P("data", "tensor"))
    assert moves.same_layout(src, dst) and not moves.same_layout(src, src)
    got = moves._hop_congruent([jax.device_put(x, src)], [jax.ShapeDtypeStruct(x.shape, x.dtype)],
                               [src], [dst])[0]
    np.testing.assert_array_equal(got, x)
    assert got.sharding == dst
    # Different layouts go through one device of each side (within one process the
    # device-to-device leg is a device_put).
    other = NamedSharding(Mesh(np.array(d[4:7]), ("tensor",)), P(None, "tensor"))
    got = moves._hop_gathered([jax.device_put(x, src)], [jax.ShapeDtypeStruct(x.shape, x.dtype)],
                              [src], [other])[0]
    np.testing.assert_array_equal(got, x)
    assert got.sharding == other
    scalar = moves.transfer([jax.device_put(np.float32(3.5), NamedSharding(a, P()))],
                            [jax.ShapeDtypeStruct((), np.float32)], [NamedSharding(a, P())],
                            [NamedSharding(b, P())])[0]
    assert scalar.shape == () and float(scalar) == 3.5


# ---- what cannot run gets a clear error -------------------------------------------------

def test_an_update_coupling_stages_beyond_scalars_is_refused_with_the_fix():
    """An update mixing every parameter's gradient with its neighbour's in the flattened
    gradient: no stage can update its own parameters alone (a global-norm clip can: the
    stages trade the norm, test_stages_trade_small_values_and_refuse_large_ones;
    optax.MultiSteps can: each leaf's update reads its own gradient and a shared
    counter)."""
    from user_models import rolled_gradients
    plan = _plan("gpt-tiny", [Pipeline((_stage(0, 2, (0,), H), _stage(2, 4, (4,), V)),
                                       8, 4, 2)])
    batches = _batches("gpt-tiny")
    tx = rolled_gradients(optax.sgd(0.1))
    with pytest.raises(PipelineSetupError, match="single-stage plan \\(max_stages=1\\)"):
        _train("gpt-tiny", lm_loss, batches, 1, tx, plan)


def _two_stage_call(value_and_grad, shift=0, pinned=True):
    """One call of a step under a 2-stage plan (or one device's ``nnx.jit`` when not
    ``pinned``), its loss taken with ``value_and_grad`` on the batch (tokens shifted by
    ``shift`` inside the step when nonzero); ``value_and_grad`` None: a transform made
    outside the step."""
    plan = _plan("gpt-tiny", [Pipeline((_stage(0, 2, (0,), H), _stage(2, 4, (4,), V)),
                                       8, 4, 2)])
    model = models.build("gpt-tiny", rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    made_outside = nnx.value_and_grad(lm_loss)

    def step(model, optimizer, batch):
        if shift:
            batch = {"tokens": batch["tokens"] + shift, "targets": batch["targets"]}
        grad_fn = made_outside if value_and_grad is None else value_and_grad(lm_loss)
        loss, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return loss

    jitted = hetshard.jit(step, cluster=CLUSTER, plan=plan) if pinned else nnx.jit(step)
    return float(jitted(model, opt, _batches("gpt-tiny")[0]))


@pytest.mark.parametrize("how", ["hetshard", "nnx"])
def test_loss_arguments_computed_in_the_step_run_under_a_pipeline(how):
    # The loss is traced on what the step passes it (tokens shifted inside the step, once
    # refused as "computed inside the step"); the plain nnx.value_and_grad is hetshard's
    # while it runs the step (it was refused under pipeline plans).
    vg = hetshard.value_and_grad if how == "hetshard" else (
        lambda f: nnx.value_and_grad(f))  # noqa: PLW0108 (nnx's, looked up in the step)
    got = _two_stage_call(vg, shift=1)
    assert got == pytest.approx(_two_stage_call(vg, shift=1, pinned=False), rel=1e-5)


def test_a_transform_made_outside_the_step_gets_single_stage_plans_only():
    with pytest.raises(hetshard.PlanNotExecutableError,
                       match="differentiates no loss with hetshard.value_and_grad"):
        _two_stage_call(None)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_zero_bubble_passes_split_a_real_stage_without_recomputing(remat):
    # gpt-tiny's two blocks as one stage: XLA's flop count of B plus W equals the unsplit
    # backward's (with full remat the recomputation runs once, in B), and each pass does a
    # real share of it (W: the weight-gradient matmuls).
    from hetshard.rewrite.backward import input_backward, weight_backward
    st, args = _blocks_stage()
    wrap = (functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
            if remat == "full" else None)
    outs, _, vjp = jax.jit(functools.partial(st.forward, remat=wrap and (wrap, None)))(*args)
    cts = [jnp.ones_like(o) for o in outs]

    def flops(fn, *args):
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]
    full = flops(lambda v, c: v(c), vjp, cts)
    rc, carried = jax.jit(input_backward)(vjp, cts)
    fb, fw = flops(input_backward, vjp, cts), flops(weight_backward, vjp, cts, carried)
    assert fb + fw == pytest.approx(full, rel=0.05)
    assert fb > 0.2 * full and fw > 0.2 * full
    want_p, want_r = jax.jit(lambda v, c: v(c))(vjp, cts)
    got_p = jax.jit(weight_backward)(vjp, cts, carried)
    for g, w in zip(list(got_p) + list(rc), jax.tree.leaves(want_p) + list(want_r),
                    strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(jnp.abs(w).max()))


# ---- memory: what the runtime holds ----------------------------------------------------

BF16 = "gpt:layers=4,hidden=128,heads=4,vocab=256,seq=64,dtype=bfloat16"


def _two_stage_plan(spec, schedule="1f1b", m=8, remat="none"):
    return Plan(spec, Cluster.load(CLUSTER).to_dict(), m, 64, (Pipeline((
        Stage(0, 3, (1,), H, (("data", 1),), remat=remat),
        Stage(3, 6, (2,), A, (("data", 1),), remat=remat)), m, 1, m, schedule=schedule),),
        attention="flash")


def test_compute_dtype_weight_copies_are_cast_once_per_step(monkeypatch):
    # bfloat16 compute on float32 weights: each stage casts its weights once per step and
    # every micro-batch's vjp shares the copy. Training is bit-for-bit what casting in
    # every micro-batch's program gives (the gradients converted back as the cast's
    # transpose converts them), float32 accumulation included.
    from hetshard.rewrite.pipeline import StageProgram
    plan = _two_stage_plan(BF16, "zbh1")
    batches = _batches(BF16, batch=8, seq=64)
    got, model, _, step = _train(BF16, lm_loss, batches, 2, optax.adamw(1e-2), plan)
    runs = next(iter(step._compiled.values())).runner.runs[0]
    assert all(len(r.program.cast_params) >= 8 for r in runs)  # two blocks' weights each
    monkeypatch.setattr(StageProgram, "cast_params", property(lambda self: {}))
    want, ref, _, _ = _train(BF16, lm_loss, batches, 2, optax.adamw(1e-2), plan)
    assert got == want
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                    jax.tree.leaves(nnx.state(ref, nnx.Param)), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)


def _live_bytes() -> dict:
    """Bytes of every live array per device id."""
    out: dict = {}
    for a in jax.live_arrays():
        n = int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize
        for d in a.sharding.device_set:
            out[d.id] = out.get(d.id, 0) + n
    return out


@pytest.mark.parametrize("spec", [BF16, BF16.replace("bfloat16", "float32")])
@pytest.mark.parametrize("schedule,remat", [("1f1b", "none"), ("1f1b", "full"),
                                            ("zbh1", "none"), ("zbh1", "full")])
def test_runtime_holds_the_memory_the_simulator_predicts(monkeypatch, spec, schedule, remat):
    # A step of two stages, 8 micro-batches: the arrays live on each stage's device
    # after every task (parameters, optimizer state, gradients, a tied embedding's read
    # copy, the in-flight micro-batches' residuals, weight copies, activations in
    # transit, under ZB-H1 what B leaves for W), at their peak, against the simulator's
    # peak for the device. The model also counts a backward's working set (transient
    # inside one program, not a live array between tasks). (Vocabulary x hidden here is
    # the size of 4 micro-batches' activations: the profile tells them apart by shape.)
    import hetshard.runtime.walk as runtime
    from hetshard_models import profile as profile_model
    plan = _two_stage_plan(spec, schedule, remat=remat)
    walk, peaks = runtime.schedule_walk, {}

    def measured_walk(*args, **kwargs):
        for t in walk(*args, **kwargs):
            yield t
            for d, n in _live_bytes().items():
                peaks[d] = max(peaks.get(d, 0), n)
    monkeypatch.setattr(runtime, "schedule_walk", measured_walk)
    batches = _batches(spec, batch=8, seq=64)
    gc.collect()  # earlier tests' arrays
    before = _live_bytes()
    _train(spec, lm_loss, batches, 2, optax.adamw(1e-3), plan)  # peaks: both steps
    dtype = "bfloat16" if "bfloat16" in spec else "float32"
    r = simulate(plan, profile_model(spec, 64, dtype), Cluster.load(CLUSTER))
    # (Device 0 also holds the model as built, before the runtime distributes it.)
    for d, cost in ((1, r.stage_costs[0][0]), (2, r.stage_costs[0][1])):
        predicted = r.memory_per_device[d]
        held = predicted - cost.memory_working_bytes
        peak = peaks[d] - before.get(d, 0)
        assert 0.97 * held <= peak <= 1.03 * predicted, (d, peak, held, predicted)


def test_stages_trade_small_values_and_refuse_large_ones():
    """plan_exchange publishes the small values an equation reads from two stages (each
    stage's sum of squares, then what the other stage's update reads: one round) and
    refuses a large value of one stage read by another."""
    from hetshard.runtime.exchange import CouplingError, evaluate, plan_exchange

    def clip(a, b):  # a on stage 0, b on stage 1
        norm = jnp.sqrt(jnp.sum(a * a) + jnp.sum(b * b))
        return a / norm, b / norm
    closed = jax.make_jaxpr(clip)(jnp.ones(8), jnp.ones(8))
    ex = plan_exchange(closed, [0, 1], [0, 1])
    assert len(ex.rounds) == 1 and sorted(st for _, st in ex.rounds[0]) == [0, 1]
    a, b = jnp.arange(8.0), jnp.arange(8.0) + 1
    # each stage sees zeros for the other's input, then the traded values put in
    zero = jnp.zeros(8)
    traded = {}
    for stage, args in ((0, (a, zero)), (1, (zero, b))):
        mine = [v for v, st in ex.rounds[0] if st == stage]
        traded.update(zip(mine, evaluate(closed.jaxpr, closed.consts, args, {}, mine),
                          strict=True))
    got_a = evaluate(closed.jaxpr, closed.consts, (a, zero), traded, closed.jaxpr.outvars)[0]
    got_b = evaluate(closed.jaxpr, closed.consts, (zero, b), traded, closed.jaxpr.outvars)[1]
    want_a, want_b = clip(a, b)
    np.testing.assert_allclose(got_a, want_a, rtol=1e-6)
    np.testing.assert_allclose(got_b, want_b, rtol=1e-6)
    with pytest.raises(CouplingError, match="held by stage"):
        plan_exchange(jax.make_jaxpr(lambda a, b: (a + b, b))(jnp.ones(128), jnp.ones(128)),
                      [0, 1], [0, 1])


@pytest.mark.parametrize("kind", ["single-stage shares", "pipelines"])
def test_pipelines_with_hybrid_and_fsdp_stages_match_one_device(kind):
    """What the planner's state-sharded variants emit: stages whose state is sharded over
    their fsdp ranks (data x fsdp: hybrid, inside each data group), in two pipelines of
    batch shares, single-stage or pipelined, next to stages without; training matches
    one device."""
    if kind == "single-stage shares":
        a = Pipeline((Stage(0, 4, (0, 1, 2, 3), f"{A}+{H}", (("data", 2), ("fsdp", 2))),),
                     4, 1, 1)
        b = Pipeline((Stage(0, 4, (4, 5, 6, 7), V, (("data", 2), ("fsdp", 2))),), 4, 1, 1)
    else:
        a = Pipeline((Stage(0, 2, (0, 1), H, (("fsdp", 2),)),
                      Stage(2, 4, (2, 3), A, (("data", 1), ("fsdp", 2)))), 4, 1, 2)
        b = Pipeline((Stage(0, 2, (4, 5), V, (("data", 2),)),
                      Stage(2, 4, (6, 7), V, (("fsdp", 2),))), 4, 1, 2)
    _assert_matches_one_device("gpt-tiny", _plan("gpt-tiny", [a, b]), steps=2)
