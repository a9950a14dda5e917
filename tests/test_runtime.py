import dataclasses
import json
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import hetshard
import hetshard_models as models
from hetshard import cache
from hetshard._plan import SCHEMA_VERSION
from hetshard.cluster import Cluster
from hetshard.solver.shardings import attach_shardings
from hetshard.solver.uniform import parse_fix, uniform_plan
from hetshard_models import data, losses
from hetshard_models import profile as profile_model

MODEL = "gpt-tiny"
CLUSTER = "dgx-a100-80gb-x8"


loss_fn = losses.text_loss


# Parameter equality is checked with SGD: AdamW turns float32 reduction-order noise in a
# near-zero gradient into a full +-lr step, so its parameters differ by ~lr between any
# two summation orders (one device vs eight) while the losses still agree.
def _tx(name):
    return {"sgd": optax.sgd(0.1), "momentum": optax.sgd(0.1, momentum=0.9)}.get(
        name) or optax.adamw(1e-3)


def _reference(batches, steps, tx="sgd"):
    model = models.build(MODEL, rngs=0)
    opt = nnx.Optimizer(model, _tx(tx), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, batches[i % len(batches)])) for i in range(steps)]
    return losses, nnx.state(model, nnx.Param)


def _run(plan=None, steps=3, tx="sgd", cluster=CLUSTER, **kw):
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, 8, 16, 256) for _ in range(2)]
    model = models.build(MODEL, rngs=0)
    opt = nnx.Optimizer(model, _tx(tx), wrt=nnx.Param)

    @hetshard.jit(cluster=cluster, plan=plan, **kw)
    def train_step(model, optimizer, batch):
        loss, grads = hetshard.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, opt, batches[i % 2])) for i in range(steps)]
    return losses, nnx.state(model, nnx.Param), train_step, batches, (model, opt)


def _matches_one_device(plan, cluster, steps=3):
    """Trains ``plan`` on ``cluster`` and on one device: same losses and parameters."""
    losses, params, _, batches, _ = _run(plan, steps, cluster=cluster)
    want_losses, want_params = _reference(batches, steps)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _program():
    return models.program(MODEL, seq_len=16, dtype="float32")


def _plan(fix, shardings=False):
    prof = profile_model(MODEL, 16, "float32")
    c = Cluster.load(CLUSTER)
    p = uniform_plan(MODEL, prof, c, global_batch=8, seq_len=16, fix=parse_fix(fix))
    return attach_shardings(p, _program(), c) if shardings else p


@pytest.mark.parametrize("fix,shardings", [
    ("dp=8,tp=1,pp=1", False),             # data parallel
    ("dp=8,tp=1,pp=1,fsdp=true", False),   # FSDP (ZeRO-3 style parameter sharding)
    ("dp=8,tp=1,pp=1,hsdp=4", False),      # hybrid: FSDP inside 2 groups of 4, DP across
    ("dp=2,tp=4,pp=1", True),              # tensor parallel, specs from the CP-SAT solver
    ("dp=2,tp=4,pp=1,tp_overlap=true", True),  # ... as collective matmuls
])
def test_single_stage_plans_match_single_device_training(fix, shardings):
    plan = _plan(fix, shardings)
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, 8, 16, 256) for _ in range(2)]
    want_losses, want_params = _reference(batches, 3)
    losses, params, step, _, _ = _run(plan)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if shardings:  # the plan really split weights over the tensor axis
        kernel = step.plan.pipelines[0].stages[0].shardings
        assert any("tensor" in spec for _, spec in kernel)
    if "hsdp" in fix:  # weights split over each group's fsdp ranks, whole across groups
        axes = [set(jax.tree.leaves(tuple(x.sharding.spec))) for x in jax.tree.leaves(params)
                if x.ndim == 2]
        assert axes and all(a == {"fsdp"} for a in axes)
        assert {x.addressable_shards[0].data.size * 4 == x.size
                for x in jax.tree.leaves(params) if x.ndim == 2} == {True}


def test_fsdp_without_remat_gathers_each_weight_again_for_its_backward():
    """Under FSDP a layer without remat is checkpointed by remat none's policy, so its
    backward gathers its weights again (PyTorch FSDP's reshard after forward) instead of
    keeping every layer's gathered weights from its forward, which XLA does when it may
    merge the two gathers: the compiled step gathers as many weights as under full remat
    (whose backward gathers again by construction). (Its training equals one device's:
    test_single_stage_plans_match_single_device_training.)"""
    import re

    from hetshard.collectives import put

    def gathered(remat):
        plan = _plan(f"dp=8,tp=1,pp=1,fsdp=true,remat={remat}")
        assert plan.pipelines[0].stages[0].remat == remat
        _, _, step, batches, (model, opt) = _run(plan, steps=1)
        entry = next(iter(step._compiled.values()))
        hlo = entry.step.lower(nnx.state((model, opt)),
                               put(batches[0], entry.batch_shardings),
                               *entry.carry.values()).compile().as_text()
        # elements all-gathered into 2-D float32 arrays (the weight matrices)
        return sum(int(a) * int(b) for line in hlo.splitlines() if " all-gather(" in line
                   for a, b in re.findall(r"f32\[(\d+),(\d+)\]",
                                          line.split(" all-gather(")[0]))
    none, full = gathered("none"), gathered("full")
    assert none > 0 and none == full, (none, full)


def test_planned_step_with_cache_and_in_place_updates(tmp_path, monkeypatch):
    monkeypatch.setenv("HETSHARD_CACHE_DIR", str(tmp_path))
    cache.clear_memory()
    losses, params, step, batches, (model, opt) = _run(time_limit_s=10, tx="adamw")
    want, _ = _reference(batches, 3, tx="adamw")
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    assert int(opt.step[...]) == 3  # the NNX optimizer was updated in place
    assert "solver:" in step.plan.explain()
    files = list((tmp_path / "plans").glob("*.json"))
    assert len(files) == 1
    # A corrupted cache file is reported once, re-planned and rewritten.
    files[0].write_text("{not json")
    cache.clear_memory()
    with pytest.warns(UserWarning, match="corrupted"):
        _run(time_limit_s=10, steps=1, tx="adamw")
    assert json.loads(files[0].read_text())["plan"]["version"] == SCHEMA_VERSION


@pytest.mark.parametrize("fix", ["dp=4,tp=2,pp=1,zero1=true", "dp=2,tp=2,pp=2,zero1=true",
                                 "dp=2,cp=2,tp=2,pp=1,zero1=true"])
def test_distributed_optimizer_shards_optimizer_state_and_matches_one_device(fix):
    # ZeRO-1 on one stage (SPMD) and on a 2-stage pipeline (MPMD): same training as one
    # device, momentum buffers split over the data axis (data x context on a stage with a
    # context axis, as the simulator prices it), parameters whole on every way.
    plan = _plan(fix, shardings=True)
    assert plan.distributed_optimizer
    stage = plan.pipelines[0].stages[0]
    data_ways = stage.axis("data") * stage.axis("context")
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, 8, 16, 256) for _ in range(2)]
    want_losses, want_params = _reference(batches, 3, tx="momentum")
    losses, params, _, _, (model, opt) = _run(plan, tx="momentum")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    ratios = set()
    for p, x in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                    jax.tree.leaves(nnx.state(opt, nnx.OptVariable)), strict=True):
        assert x.shape == p.shape  # the momentum buffer of that parameter
        shard = x.addressable_shards[0].data.size
        ratios.add(p.addressable_shards[0].data.size // shard)
        if any(n % data_ways == 0 for n in x.shape):
            axes = set(jax.tree.leaves(tuple(x.sharding.spec)))
            assert "data" in axes and ("context" in axes) == (stage.axis("context") > 1)
        assert "data" not in jax.tree.leaves(tuple(p.sharding.spec))
    assert data_ways in ratios  # each data way keeps 1/data of the buffers


def test_tensor_stage_without_shardings_runs_tensor_parallel():
    # A plan with a tensor axis and no parameter layouts (uniform_plan, `hetshard simulate
    # --fix`, or by hand): hetshard.jit solves the layouts make_plan would write, so the
    # weights are really split over `tensor` (as the simulator prices them), not replicated.
    plan = _plan("dp=2,tp=4,pp=1")
    assert not plan.pipelines[0].stages[0].shardings
    losses, params, step, batches, _ = _run(plan)
    want_losses, want_params = _reference(batches, 3)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    solved = attach_shardings(plan, _program(), Cluster.load(CLUSTER))
    assert step.plan.pipelines[0].stages[0].shardings == solved.pipelines[0].stages[0].shardings
    split = [x for x in jax.tree.leaves(params)
             if "tensor" in jax.tree.leaves(tuple(x.sharding.spec))]
    assert split and all(x.addressable_shards[0].data.size * 4 == x.size
                         for x in split if "data" not in jax.tree.leaves(tuple(x.sharding.spec)))



def test_pinned_plan_from_json_and_bad_batches(tmp_path):
    plan = _plan("dp=8,tp=1,pp=1")
    path = tmp_path / "plan.json"
    plan.save(path)
    losses, *_ = _run(str(path), steps=2)
    assert len(losses) == 2
    model = models.build(MODEL, rngs=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step = hetshard.jit(lambda m, o, b: loss_fn(m, b), cluster=CLUSTER, plan=plan)
    wrong = data.text_batch(np.random.default_rng(0), 6, 16, 256)
    with pytest.raises(hetshard.SpecError, match="global batch 8"):
        step(model, opt, wrong)


@pytest.mark.parametrize("overlap", [False, True])
def test_uniform_pipeline_parallel_plan_matches_single_device_training(overlap):
    plan = _plan(f"dp=2,tp=2,pp=2,tp_overlap={overlap}", shardings=True)
    assert [len(p.stages) for p in plan.pipelines] == [2]
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, 8, 16, 256) for _ in range(2)]
    want_losses, want_params = _reference(batches, 3)
    losses, params, step, *_ = _run(plan)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Each stage ran the flash kernel on its own mesh's devices (per sample and head).
    runner = next(iter(step._compiled.values())).runner
    assert {mesh for mesh, _ in runner.splits[0]._runners} == {
        run.mesh for run in runner.runs[0]}
    # ... with its activations split along the sequence between tensor-parallel matmuls
    # (layouts: the layer boundaries and row-parallel outputs split, gathers before the
    # column-parallel matmuls).
    # With tp_overlap the column-parallel matmuls are all-gather rings (computed from the
    # parameters: ``reads``), without it gathers then matmuls.
    from hetshard.ir.interpret import Replace
    for run in runner.runs[0]:
        layouts = run.fwd.fn.args[4]
        assert any(isinstance(c, Replace) for c in layouts.values())
        rings = [c for c in layouts.values() if isinstance(c, Replace) and c.reads]
        assert bool(rings) == overlap
        assert any(not isinstance(c, Replace) and tuple(c.spec)[1:2] == ("tensor",)
                   for c in layouts.values())  # the boundaries split along the sequence


def test_nan_loss_is_reported_and_not_applied():
    plan = _plan("dp=8,tp=1,pp=1")
    model = models.build(MODEL, rngs=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))

    @hetshard.jit(cluster=CLUSTER, plan=plan)
    def step(model, optimizer, batch):
        loss, grads = hetshard.value_and_grad(lambda m, b: loss_fn(m, b) * np.nan)(model,
                                                                                   batch)
        optimizer.update(model, grads)
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(model, opt, data.text_batch(np.random.default_rng(0), 8, 16, 256))
        step.wait()  # (said once the step has finished: the call does not wait)
    assert any("not applied" in str(w.message) for w in caught)
    after = nnx.state(model, nnx.Param)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)


def test_cluster_needing_more_devices_says_how():
    model = models.build(MODEL, rngs=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step = hetshard.jit(lambda m, o, b: loss_fn(m, b), cluster="a100-v100", time_limit_s=5)
    with pytest.raises(hetshard.DeviceBindingError, match="device_count=32"):
        step(model, opt, data.text_batch(np.random.default_rng(0), 8, 16, 256))


def test_two_pipelines_with_uneven_batch_shares_match_one_device():
    from hetshard._plan import Pipeline, Plan, Stage
    cluster = Cluster.load("h100-a100-v100-x8")
    n_layers = profile_model(MODEL, 16, "float32").num_layers
    # Batch shares 5:3, one pipeline on an H100 pair, one on four V100s.
    fast = Pipeline((Stage(0, n_layers, (0,), "H100-80GB", (("data", 1),)),), 5, 5, 1)
    # The slow pipeline recomputes its first 2 layers (each pipeline's stage remat runs).
    slow = Pipeline((Stage(0, n_layers, (4, 5, 6), "V100-32GB", (("data", 3),),
                           remat="full", remat_layers=2),), 3, 1, 1)
    plan = Plan(MODEL, cluster.to_dict(), 8, 16, (fast, slow))
    _matches_one_device(plan, cluster)


def test_pipeline_with_its_slowest_gpus_first_matches_one_device():
    # The planner also orders stages slowest first (a fast GPU short of memory does best
    # last): stage 0 on two V100s (devices 4, 5), stage 1 on one H100 (device 0).
    from hetshard._plan import Pipeline, Plan, Stage
    cluster = Cluster.load("h100-a100-v100-x8")
    n_layers = profile_model(MODEL, 16, "float32").num_layers
    pipe = Pipeline((Stage(0, 2, (4, 5), "V100-32GB", (("data", 2),)),
                     Stage(2, n_layers, (0,), "H100-80GB", (("data", 1),))), 8, 2, 2)
    plan = Plan(MODEL, cluster.to_dict(), 8, 16, (pipe,))
    _matches_one_device(plan, cluster)


@pytest.mark.parametrize("attention,kernels", [("flash", 6), ("reference", 0)])
def test_runtime_runs_the_plans_attention_choice(attention, kernels):
    prof = profile_model(MODEL, 16, "float32")
    plan = uniform_plan(MODEL, prof, Cluster.load(CLUSTER), global_batch=8, seq_len=16,
                        fix=parse_fix("dp=8,tp=1,pp=1"), attention=attention)
    _, _, step, batches, (model, opt) = _run(plan, steps=1)
    entry = next(iter(step._compiled.values()))
    jaxpr = str(entry.step.trace(jax.device_put(nnx.state((model, opt)), entry.state_shardings()),
                               jax.device_put(batches[0], entry.batch_shardings),
                               *entry.carry.values()).jaxpr)
    # gpt-tiny has 2 layers: forward, dQ and dK/dV kernels each.
    assert jaxpr.count("pallas_call") == kernels
    # XLA cannot split a Pallas call: each runs inside a shard_map on its device's
    # samples. Left to the partitioner, every device gathered the whole batch's q, k, v
    # (and cotangents) and computed attention for all of it.
    hlo = entry.step.lower(jax.device_put(nnx.state((model, opt)), entry.state_shardings()),
                         jax.device_put(batches[0], entry.batch_shardings),
                         *entry.carry.values()).compile().as_text()
    assert jaxpr.count("shard_map") == (4 if kernels else 0)  # per layer: fwd, bwd
    assert " all-gather(" not in hlo and " all-gather-start(" not in hlo


@pytest.mark.parametrize("remat,layers,checkpoints", [
    ("none", None, 0), ("full", None, 4), ("full", 2, 2), ("selective", 3, 3),
    ("save_qkv_out", None, 4)])
def test_single_stage_plan_runs_its_remat_per_layer(remat, layers, checkpoints):
    # gpt-tiny's 4 layers (embed, 2 blocks, head): each recomputed layer is one checkpoint
    # in the traced step, and training still matches one device.
    plan = _plan(f"dp=8,tp=1,pp=1,remat={remat}")
    pipe = plan.pipelines[0]
    stage = dataclasses.replace(pipe.stages[0], remat_layers=layers)
    plan = dataclasses.replace(plan, pipelines=(dataclasses.replace(pipe, stages=(stage,)),))
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, 8, 16, 256) for _ in range(2)]
    want_losses, want_params = _reference(batches, 2)
    losses, params, step, _, (model, opt) = _run(plan, steps=2)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    entry = next(iter(step._compiled.values()))
    jaxpr = entry.step.trace(jax.device_put(nnx.state((model, opt)), entry.state_shardings()),
                           jax.device_put(batches[0], entry.batch_shardings),
                           *entry.carry.values()).jaxpr

    def count(jaxpr):
        n = 0
        for e in jaxpr.eqns:
            if e.primitive.name in ("checkpoint", "remat2"):
                n += 1
            elif e.primitive.name in ("pjit", "jit", "closed_call"):
                n += count(e.params["jaxpr"].jaxpr)
        return n
    assert count(jaxpr.jaxpr) == checkpoints


def test_spmd_rewrite_pins_layer_boundaries_to_the_plans_layout():
    from hetshard.rewrite.spmd import constrain_layers, layer_boundaries
    plan = _plan("dp=2,tp=4,pp=1", shardings=True)
    _, _, step, batches, (model, opt) = _run(plan, steps=1)
    entry = next(iter(step._compiled.values()))
    jaxpr = entry.step.trace(jax.device_put(nnx.state((model, opt)), entry.state_shardings()),
                           jax.device_put(batches[0], entry.batch_shardings),
                           *entry.carry.values()).jaxpr
    batch_split = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "sharding_constraint"
                   and tuple(e.params["sharding"].spec)[:1] in (("data",), (("data",),))
                   and len(e.invars[0].aval.shape) == 3]
    # gpt-tiny: embed -> layer_0 -> layer_1 -> head, each boundary activation once in the
    # forward and its cotangent once in the backward, split over the data axis.
    assert len(batch_split) >= 6
    # The rewrite alone: same value, boundaries found from the scopes.
    graphdef, state = nnx.split(model)

    def loss(state, batch):
        return loss_fn(nnx.merge(graphdef, state), batch)
    closed = jax.make_jaxpr(loss)(state, batches[0])
    assert len(layer_boundaries(closed)) >= 3
    mesh = next(iter(step._compiled.values())).state_shardings()
    mesh = jax.tree.leaves(mesh)[0].mesh
    rewritten = jax.jit(constrain_layers(loss, mesh, plan.pipelines[0].stages[0]))
    np.testing.assert_allclose(rewritten(state, batches[0]), jax.jit(loss)(state, batches[0]),
                               rtol=1e-6)


def test_tensor_parallel_stage_splits_activations_along_the_sequence():
    # Megatron-LM's sequence parallelism, which the simulator's memory model assumes:
    # between the tensor-parallel matmuls activations stay split along the sequence over
    # `tensor` (gathered before a column-parallel matmul, reduce-scattered after a
    # row-parallel one). Without it XLA kept them whole on every tensor rank.
    import re

    from hetshard.ir.program import path_string
    from hetshard.layout import leaf_spec, mesh_of
    from hetshard.rewrite.spmd import constrain_layers
    plan = _plan("dp=2,tp=4,pp=1", shardings=True)
    stage = plan.pipelines[0].stages[0]
    mesh = mesh_of(stage, jax.devices())
    specs = {n: tuple(sp) for n, sp in stage.shardings}
    graphdef, params, rest = nnx.split(models.build(MODEL, rngs=0), nnx.Param, ...)
    params = jax.device_put(params, jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, leaf_spec(path_string(p), x.shape, specs, mesh)),
        params))
    batch = data.text_batch(np.random.default_rng(0), 8, 16, 256)

    def loss(p, b):
        return loss_fn(nnx.merge(graphdef, p, rest), b)
    got = {}
    for seq, overlap in ((True, False), (False, False), (True, True)):
        f = jax.jit(jax.value_and_grad(constrain_layers(loss, mesh, stage, attention="flash",
                                                        sequence_parallel=seq,
                                                        tp_overlap=overlap)))
        compiled = f.lower(params, batch).compile()
        hlo = compiled.as_text()
        # all-gathers of a [batch / data, seq, features] activation, by dimension
        gathers = re.findall(r"f32\[4,16,\d+\]\{[0-9,]+\} all-gather\(.*?dimensions=\{(\d)\}",
                             hlo)
        got[seq, overlap] = (f(params, batch), compiled.memory_analysis().temp_size_in_bytes,
                             gathers, len(re.findall(r" collective-permute(-start)?\(", hlo)))
    (l1, g1), temp_seq, gathers_seq, _ = got[True, False]
    (l0, g0), temp_whole, gathers_whole, _ = got[False, False]
    (l2, g2), temp_ring, gathers_ring, permutes = got[True, True]
    for loss_, grads in ((l1, g1), (l2, g2)):
        np.testing.assert_allclose(loss_, l0, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(g0), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert gathers_seq and set(gathers_seq) == {"1"}  # along the sequence only
    assert "1" not in gathers_whole
    assert temp_seq < 0.8 * temp_whole  # measured: 593 KB vs 822 KB
    # Collective matmuls (tp_overlap): the sequence travels collective-permute rings; the
    # gathers left along it feed the one matmul whose weight is not split (the tied head).
    assert permutes > 0 and len(gathers_ring) < len(gathers_seq)
    assert temp_ring < 0.8 * temp_whole  # measured: 495 KB


def test_pinned_plan_for_another_model_or_sequence_is_refused():
    plan = _plan("dp=8,tp=1,pp=1")
    model = models.build(MODEL, rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step_fn(model, optimizer, batch):
        loss, grads = hetshard.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss
    longer = data.text_batch(np.random.default_rng(0), 8, 32, 256)
    with pytest.raises(hetshard.SpecError, match="seq_len 16"):
        hetshard.jit(step_fn, cluster=CLUSTER, plan=plan)(model, opt, longer)
    # A plan made for another model (gpt-1.3b's fingerprint) is refused; the same model
    # under another optimizer (the plan was made with AdamW, this step uses SGD) is not.
    other = dataclasses.replace(plan, model="gpt-1.3b", fingerprint=profile_model(
        "gpt-1.3b", 16, "float32").fingerprint)
    batch = data.text_batch(np.random.default_rng(0), 8, 16, 256)
    with pytest.raises(hetshard.SpecError, match="plan.fingerprint"):
        hetshard.jit(step_fn, cluster=CLUSTER, plan=other)(model, opt, batch)
    # ... with another layer count too: said as another program, not as a layer range.
    (st,) = other.pipelines[0].stages
    longer_model = dataclasses.replace(other, pipelines=(dataclasses.replace(
        other.pipelines[0], stages=(dataclasses.replace(st, end=st.end + 2),)),))
    with pytest.raises(hetshard.SpecError, match=r"plan.fingerprint.*made for another "
                                                 r"program \('gpt-1.3b', whose layers end at"):
        hetshard.jit(step_fn, cluster=CLUSTER, plan=longer_model)(model, opt, batch)
    assert plan.fingerprint == _program().model_fingerprint
    # ... or for another cluster: its devices have other GPU types here, or are missing.
    with pytest.raises(hetshard.SpecError, match=r"plan.cluster.*device 0: A100-80GB in "
                                                 r"the plan's cluster, H100-80GB in"):
        hetshard.jit(step_fn, cluster="h100-a100-v100-x8", plan=plan)(model, opt, batch)
    four = {"name": "four", "groups": [{"name": "a", "gpu": "A100-80GB", "nodes": 1,
                                        "gpus_per_node": 4}]}
    with pytest.raises(hetshard.SpecError, match=r"device 4: .* missing from 'four' \(4 dev"):
        hetshard.jit(step_fn, cluster=four, plan=plan)(model, opt, batch)


@pytest.mark.parametrize("fix,chunks", [
    ("dp=2,tp=1,pp=1,cp=4", None), ("dp=2,tp=2,pp=1,cp=2", None),
    ("dp=2,tp=1,pp=1,cp=4", (6, 6, 2, 2)), ("dp=2,tp=1,pp=1,cp=4", (2, 8, 4, 2))])
def test_context_parallel_stage_matches_single_device_training(fix, chunks):
    # A stage with a context axis (and data, and tensor): the batch and every layer
    # boundary split along the sequence, attention a ring over ``context`` (zigzag:
    # gpt-tiny's attention is causal). Uneven chunks: each device attends its own share
    # of the sequence, padded to the longest, while the other layers keep an even split.
    from hetshard._plan import Context
    plan = _plan(fix, shardings="tp=2" in fix)
    assert plan.pipelines[0].stages[0].axis("context") > 1
    if chunks:
        plan = dataclasses.replace(plan, context=Context(4, chunks, True))
        assert plan.context_chunks(plan.pipelines[0].stages[0]) == chunks
    losses, params, step, batches, _ = _run(plan)
    want_losses, want_params = _reference(batches, 3)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    (entry,) = step._compiled.values()
    jitted, s_shard, b_shard = entry.step, entry.state_shardings(), entry.batch_shardings
    assert tuple(b_shard["tokens"].spec)[1] == "context"  # the batch's sequence is split
    hlo = jitted.lower(jax.device_put(nnx.state(_fresh_state()), s_shard),
                       jax.device_put(batches[0], b_shard), *entry.carry.values()).as_text()
    assert "collective_permute" in hlo or "collective-permute" in hlo  # the ring
    if chunks:  # the ring's token positions: 4 devices x the longest chunk (padded)
        assert f"tensor<8x{4 * max(chunks)}xi32>" in hlo


def _fresh_state():
    model = models.build(MODEL, rngs=0)
    return (model, nnx.Optimizer(model, _tx("sgd"), wrt=nnx.Param))


def test_argument_signatures_are_remembered_for_the_same_objects_and_follow_their_shapes(
        monkeypatch):
    """A step's programs are cached by its arguments' signature. For the same objects
    again the signature is found without walking their NNX graph (the walk is most of a
    micro-step's Python time); it is the signature that walk gives, and it changes when
    a leaf's shape or dtype does, or for objects that are not pytrees."""
    import importlib
    hjit = importlib.import_module("hetshard._jit")

    model = models.build("llama-tiny", rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = {"tokens": np.zeros((2, 8), np.int32)}
    sigs = hjit._Signatures()
    first = sigs((model, opt, batch))
    assert first == hjit._signature((model, opt, batch))

    walks = []
    state = nnx.state
    monkeypatch.setattr(hjit.nnx, "state", lambda *a, **k: walks.append(1) or state(*a, **k))
    assert sigs((model, opt, batch)) == first and not walks  # remembered: no walk
    wider = {"tokens": np.zeros((2, 16), np.int32)}
    assert sigs((model, opt, wider)) == hjit._signature((model, opt, wider)) != first
    assert sigs((model, opt, {"tokens": np.zeros((2, 8), np.float32)})) != first

    # a leaf of the same objects reshaped in place: a new signature, not the old one
    kernel = model.layers[0].attn.q_proj.kernel
    kernel.set_value(np.zeros((kernel.shape[0], kernel.shape[1] + 1), np.float32))
    assert sigs((model, opt, batch)) != first
    assert sigs((model, opt, batch)) == hjit._signature((model, opt, batch))

    class Opaque(nnx.Module, pytree=False):  # a graph node that is no pytree
        def __init__(self):
            self.w = nnx.Param(np.ones((3,), np.float32))
    o = Opaque()
    before = sigs((o, batch))
    o.w.set_value(np.ones((4,), np.float32))
    assert sigs((o, batch)) != before


def test_micro_steps_on_one_group_place_the_state_once_a_step(monkeypatch):
    """``grads_under`` places the step's state on the micro-step's devices once and
    reuses it while the objects hold the same arrays (a step's micro-steps on one group
    read one copy); after the update (``apply_grads``) the new arrays are placed again,
    and the values and gradients stay those of a fresh placement."""
    import importlib

    from hetshard.data import group_costs, pack, packed_arrays
    from hetshard.data.runner import micro_step_plan
    from hetshard_models.losses import packed_text_loss
    from hetshard_models.steps import train_step
    hjit = importlib.import_module("hetshard.runtime.micro_steps")

    cluster = Cluster.from_dict({"name": "one", "groups": [
        {"name": "g", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 2}]})
    model = models.build("llama-tiny", rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = hetshard.jit(train_step(packed_text_loss), cluster=cluster, quiet=True)
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, 256, n).astype(np.int32) for n in (30, 20, 12)]
    batch = {k: jax.numpy.asarray(v) for k, v in packed_arrays(
        samples, pack([30, 20, 12], (32,)), target_tokens=59).items()}
    group, = group_costs(step.profile(model, opt, batch), cluster, max_context=64,
                         buckets=(32, 64))
    plan = micro_step_plan(step, (model, opt, batch), group, 32, 1)

    walks = []
    state_of = hjit.step_state
    monkeypatch.setattr(hjit, "step_state",
                        lambda *a: walks.append(1) or state_of(*a))
    first = step.micro_steps.grads_under(plan, model, opt, batch)
    assert walks  # compiled and placed
    walks.clear()
    again = step.micro_steps.grads_under(plan, model, opt, batch)
    assert not walks  # the second micro-step read the placed copy
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)
    step.micro_steps.apply_grads(first, model, opt, batch)
    walks.clear()
    after = step.micro_steps.grads_under(plan, model, opt, batch)
    assert walks  # new arrays: placed again
    step.micro_steps._placed.clear()
    fresh = step.micro_steps.grads_under(plan, model, opt, batch)
    assert float(after[0]) < float(first[0])  # the update is what the step reads
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_row_over_a_whole_group_keeps_the_state_sharded_over_the_group():
    """A micro-step whose one row spans a group's four devices as a context ring shards
    the state over all four (``Context.shard_state``: ZeRO-3 over ``fsdp x context``,
    as ``group_costs`` prices and memory-checks it), laid out as a micro-step of four
    one-device rows lays it out; its value and gradients equal that micro-step's on the
    same row (three empty rows beside it)."""
    import importlib

    from hetshard.data import Row, group_costs, packed_arrays
    from hetshard.data.runner import micro_step_plan
    from hetshard.layout import mesh_of, state_shardings
    from hetshard_models.losses import packed_text_loss
    from hetshard_models.steps import train_step

    cluster = Cluster.from_dict({"name": "one", "groups": [
        {"name": "g", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 4}]})
    model = models.build("llama-tiny", rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = hetshard.jit(train_step(packed_text_loss), cluster=cluster, quiet=True)
    rng = np.random.default_rng(1)
    samples = [rng.integers(0, 256, n).astype(np.int32) for n in (40, 20)]
    row = Row(64, (0, 1), (40, 20))

    def batch(rows):
        return {k: jax.numpy.asarray(v) for k, v in packed_arrays(
            samples, rows, target_tokens=58).items()}

    ring, flat = batch([row]), batch([row] + [Row(64, (), ())] * 3)
    group, = group_costs(step.profile(model, opt, flat), cluster, max_context=64,
                         buckets=(64,))
    over = micro_step_plan(step, (model, opt, ring), group, 64, 4)
    rows = micro_step_plan(step, (model, opt, flat), group, 64, 1)
    assert over.context.shard_state and over.pipelines[0].stages[0].mesh_shape == (
        ("fsdp", 1), ("context", 4))
    # the layout the state is placed in: a quarter of every large leaf on each device
    hjit = importlib.import_module("hetshard.runtime.executable")
    program = step.micro_steps.program_for(model, opt, ring)
    tree = hjit.step_state(program, (model, opt))
    mesh = mesh_of(over.pipelines[0].stages[0], step.cluster.bind().devices)
    laid = jax.tree.leaves(state_shardings(tree, over, mesh))
    big = [(x, s) for x, s in zip(jax.tree.leaves(tree), laid, strict=True) if x.size >= 1024]
    assert big and all(np.prod(s.shard_shape(x.shape)) * 4 == x.size for x, s in big)

    got = step.micro_steps.grads_under(over, model, opt, ring)
    want = step.micro_steps.grads_under(rows, model, opt, flat)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
        if a.size >= 1024:  # a quarter a device, where the four-row micro-step has it
            assert a.addressable_shards[0].data.size * 4 == a.size
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_tensor_layouts_priced_as_the_runtime_places_them():
    # The simulator prices each parameter as the plan's solved layout places it: split
    # over `tensor` where its spec names the axis, whole on every tensor rank otherwise
    # (norms, biases, embeddings and heads stay replicated), not every weight / tp.
    from hetshard.cost.profile import profile_program
    from hetshard.ir.paths import path_string
    from hetshard.layout import stage_mesh, state_shardings
    from hetshard.sim.simulator import simulate

    plan = _plan("dp=2,tp=4,pp=1", shardings=True)
    params = nnx.state(models.build(MODEL, rngs=0), nnx.Param)
    placed = state_shardings(params, plan, stage_mesh(plan, jax.devices()[:8]))
    per_device = sum(np.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in zip(
        jax.tree.leaves(params), jax.tree.leaves(placed), strict=True))
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert per_device > 1.2 * whole / 4  # some weights really stay whole on each rank
    profile = profile_program(_program(), plan.split_blocks)
    cluster = Cluster.load(CLUSTER)

    def priced(p):
        return simulate(p, profile, cluster, trace=False).stage_costs[0][0].grad_sync_bytes
    assert priced(plan) == pytest.approx(per_device, rel=1e-6)
    # A stage whose layouts are not solved yet (the planner's search, a --fix plan) is
    # priced with every block's matrices split and what no layout splits whole: the
    # embeddings, the final norm, the blocks' norm scales and biases.
    bare = dataclasses.replace(plan, pipelines=(dataclasses.replace(
        plan.pipelines[0], stages=(dataclasses.replace(plan.pipelines[0].stages[0],
                                                       shardings=()),)),))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    prior = sum(x.size * x.dtype.itemsize / (4 if path_string(p).startswith("layers/")
                                              and x.ndim >= 2 else 1) for p, x in flat)
    assert prior > 1.5 * whole / 4
    assert priced(bare) == pytest.approx(prior, rel=1e-6)
