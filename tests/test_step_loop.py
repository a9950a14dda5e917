"""A step loop that never waits (issue 47): every execution path returns once its work is
dispatched, and the non-finite policy and the loss scale are decided on the device.

``jax.transfer_guard`` does not see ``bool()`` of a CPU array, so waiting is caught by
what it does: each step here is fed a batch that a slow program is still computing when
the step is called. A step that reads any value computed from its batch on the host
(its loss, its gradients' finiteness) cannot return before that batch exists; one that
only dispatches returns while it is still being computed.
"""

import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import user_models
from flax import nnx

import hetshard
from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster import Cluster
from hetshard.errors import NonFiniteLossError

CLUSTER = "h100-a100-v100-x8"  # 2 H100, 2 A100, 4 V100
H, V = "H100-80GB", "V100-32GB"


@jax.jit
def _spin(x, m, n):
    """``x`` once ``n`` products of ``m`` are done (a value only the device knows)."""
    s = jnp.sum(jax.lax.fori_loop(0, n, lambda i, a: jnp.tanh(a @ a), m))
    return jax.tree.map(lambda v: jnp.where(jnp.isnan(s), v + 1, v), x)


_ROUNDS: list = []


def _late(x):
    """``x`` as the output of a program that is still running (about four seconds at the
    machine's speed now: a loaded machine can make a step's dispatch take over two)
    when this returns, on device 3 (an A100 the plans here leave idle: the program holds
    no device the steps run on, and the step's own work on the batch's device stays well
    under the 32 computations a device queues before dispatch waits). Timed on each
    call: under the full suite the other worker's load comes and goes, and a length
    calibrated once fell short (seen)."""
    x = _spare(x)
    m = _spare(jnp.ones((256, 256), jnp.float32) / 256)
    # The speed is probed on device 2 (the other idle A100), where no earlier late
    # program is queued.
    probe = jax.device_put((x, m), jax.devices()[2])
    if not _ROUNDS:
        jax.block_until_ready((_spin(x, m, 10), _spin(*probe, 10)))  # compiled
        _ROUNDS.append(True)
    t = time.perf_counter()
    jax.block_until_ready(_spin(*probe, 100))
    rounds = max(200, int(100 * 4.0 / max(time.perf_counter() - t, 1e-3)))
    return _spin(x, m, rounds)


def _spare(x):
    """``x`` on the device :func:`_late` computes on. Steps are warmed up on a batch there:
    their first call on a batch from a new device compiles its slicing for that device, and
    compiling (seconds on a loaded machine) is no wait for the batch but would outlast it."""
    return jax.device_put(x, jax.devices()[3])


def _pending(tree) -> bool:
    return not all(x.is_ready() for x in jax.tree.leaves(tree))


def _plans(program):
    """Global batch 8 on the tiny LM, one plan a path: one SPMD stage on the V100s,
    batch shares (H100s 4 | V100s 4), a two-stage pipeline (H100s | V100s, 2
    micro-batches)."""
    n = program.layering(2).num_layers
    cluster = Cluster.load(CLUSTER).to_dict()

    def plan(*pipes):
        return Plan(program.name, cluster, 8, program.seq_len, pipes, dtype=program.dtype,
                    attention="reference")
    v100s = Stage(0, n, (4, 5, 6, 7), V, (("data", 4),))
    return {
        "spmd": plan(Pipeline((v100s,), 8, 2, 1)),
        "shares": plan(Pipeline((Stage(0, n, (0, 1), H, (("data", 2),)),), 4, 2, 1),
                       Pipeline((v100s,), 4, 1, 1)),
        "pipeline": plan(Pipeline((Stage(0, n // 2, (0, 1), H, (("data", 2),)),
                                   Stage(n // 2, n, (4, 5, 6, 7), V, (("data", 4),))),
                                  8, 2, 2)),
    }


def _tiny():
    """The tiny LM's step, its loss NaN for a batch whose ``poison`` flags a sample
    (per sample: the plans may cut the batch), and a clean batch."""
    model = user_models.make_transformer()[1][0]
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batch = user_models._text_batches(np.random.default_rng(0))[0]
    batch = {**batch, "poison": jnp.zeros((8,), jnp.int32)}

    def loss(m, b):
        ce = optax.softmax_cross_entropy_with_integer_labels(m(b["tokens"]), b["targets"])
        return jnp.mean(ce.mean(axis=1) * jnp.where(b["poison"] > 0, jnp.nan, 1.0))
    return user_models.nnx_step(loss), model, opt, batch


def _poisoned(batch):
    return {**batch, "poison": jnp.ones((8,), jnp.int32)}


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.parametrize("path", ["spmd", "shares", "pipeline"])
def test_a_step_returns_before_its_batch_exists(path):
    step, model, opt, batch = _tiny()
    plan = _plans(hetshard.Program(step, (model, opt, batch)))[path]
    jitted = hetshard.jit(step, cluster=CLUSTER, plan=plan, quiet=True)
    jax.block_until_ready(jitted(model, opt, _spare(batch)))  # compiled
    first, second = _late(batch), _late(batch)
    loss1 = jitted(model, opt, first)
    loss2 = jitted(model, opt, second)  # nor for the step before it
    assert _pending(second) and _pending(loss2)
    # ... and trains as nnx.jit does (the last loss reads the late steps' updates)
    got = [float(loss1), float(loss2), float(jitted(model, opt, batch))]
    reference = user_models.make_transformer()[1][0]
    ref_opt = nnx.Optimizer(reference, optax.adamw(1e-3), wrt=nnx.Param)
    ref = nnx.jit(step)
    expect = [float(ref(reference, ref_opt, batch)) for _ in range(4)]
    np.testing.assert_allclose(got, expect[1:], rtol=2e-5)


@pytest.mark.parametrize("layout", ["spmd", pytest.param("pipeline", marks=pytest.mark.slow)])
def test_a_loss_scaled_step_returns_before_its_batch_exists_and_halves_on_overflow(layout):
    import hetshard_models as models
    from hetshard_models import data, losses
    bf16 = "gpt:layers=4,hidden=128,heads=4,vocab=256,seq=64,dtype=bfloat16"
    n = 6
    stages = {"spmd": (Stage(0, n, (4, 5, 6, 7), V, (("data", 4),)),),
              "pipeline": (Stage(0, 3, (1,), H, (("data", 1),)),
                           Stage(3, n, (4,), V, (("data", 1),)))}[layout]
    plan = Plan(bf16, Cluster.load(CLUSTER).to_dict(), 8, 64,
                (Pipeline(stages, 8, 2 if layout == "spmd" else 1,
                          1 if layout == "spmd" else 8),),
                attention="reference", gpu_dtypes=((V, "float16"),))
    model = models.build(bf16, rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @hetshard.jit(cluster=CLUSTER, plan=plan, nan_policy="raise", quiet=True)
    def step(model, optimizer, batch):
        loss, grads = hetshard.value_and_grad(losses.text_loss)(model, batch)
        optimizer.update(model, grads)
        return loss
    batch = data.text_batch(np.random.default_rng(0), 8, 64, 256)
    jax.block_until_ready(step(model, opt, _spare({k: jnp.asarray(v) for k, v in batch.items()})))
    entry = next(iter(step._compiled.values()))
    scaler = entry.loss_scale if hasattr(entry, "loss_scale") else entry.runner.loss_scale
    before = _params(model)
    scaler.scale = 2.0 ** 40  # overflows float16 in the backward pass
    late = _late({k: jnp.asarray(v) for k, v in batch.items()})
    step(model, opt, late)
    assert _pending(late)
    step.wait()  # an overflow is no error, even under "raise"
    assert scaler.overflows == 1 and scaler.scale == 2.0 ** 39
    for a, b in zip(_params(model), before, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("policy", ["skip", "apply", "raise"])
@pytest.mark.parametrize("path", ["spmd", "shares", "pipeline"])
def test_a_nan_step_is_decided_on_the_device(policy, path):
    step, model, opt, batch = _tiny()
    plan = _plans(hetshard.Program(step, (model, opt, batch)))[path]
    jitted = hetshard.jit(step, cluster=CLUSTER, plan=plan, quiet=True, nan_policy=policy)
    jax.block_until_ready(jitted(model, opt, _spare(batch)))  # compiled, applied
    before = _params(model)
    # Two non-finite steps, both dispatched before either has its batch (so neither has
    # finished, and nothing is said, before wait()).
    late = [_late(_poisoned(batch)) for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jitted(model, opt, late[0])
        jitted(model, opt, late[1])
        assert _pending(late)  # neither step read its loss on the host
        if policy == "raise":
            with pytest.raises(NonFiniteLossError, match=r"non-finite loss nan.*the 1 "
                               r"dispatched after it"):
                jitted.wait()
        else:
            jitted.wait()
    said = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    after = _params(model)
    if policy == "apply":
        assert len(said) == 2 and all("applied: nan_policy='apply'" in s for s in said)
        assert not all(np.isfinite(x).all() for x in after)
        return
    assert len(said) == (2 if policy == "skip" else 0), said
    for a, b in zip(after, before, strict=True):  # bit-identical
        np.testing.assert_array_equal(a, b)
    jitted(model, opt, batch)  # a clean step applies (raise's error cleared its flag)
    jitted.wait()
    assert not any(np.array_equal(a, b) for a, b in zip(_params(model), before,
                                                        strict=True))


def test_micro_steps_and_passes_return_before_their_batch_exists():
    """The per-batch runner's doors: ``grads_under``, ``apply_grads`` and
    ``run_passes`` dispatch without waiting."""
    step, model, opt, batch = _tiny()
    plans = _plans(hetshard.Program(step, (model, opt, batch)))
    jitted = hetshard.jit(step, cluster=CLUSTER, quiet=True)
    micro = jitted.micro_steps
    got = micro.grads_under(plans["spmd"], model, opt, _spare(batch))
    jax.block_until_ready(micro.apply_grads(got, model, opt, _spare(batch)))  # compiled
    jax.block_until_ready(micro.run_passes([(plans["pipeline"], (model, opt, _spare(batch)))],
                                           [(0, 0), (0, 1)]))
    late = _late(batch)
    got = jitted.micro_steps.grads_under(plans["spmd"], model, opt, late)
    out = jitted.micro_steps.apply_grads(got, model, opt, late)
    assert _pending(late) and _pending(out)
    late = _late(batch)
    out = jitted.micro_steps.run_passes([(plans["pipeline"], (model, opt, late))], [(0, 0), (0, 1)])
    assert _pending(late) and _pending(out)
    jitted.wait()


# ---- the host's time, priced ------------------------------------------------------------

class _MLP(nnx.Module):
    def __init__(self, rngs, d, layers=4):
        self.layers = nnx.List([nnx.Linear(d, d, rngs=rngs) for _ in range(layers)])
        self.out = nnx.Linear(d, 10, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return self.out(x)


def _mlp_step(model, optimizer, batch):
    def loss(m, b):
        return optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"]).mean()
    value, grads = nnx.value_and_grad(loss)(model, batch)
    optimizer.update(model, grads)
    return value


def _mlp_plan(d, batch, cluster, calibration):
    def make():
        model = _MLP(nnx.Rngs(0), d)
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    model, opt = nnx.eval_shape(make)
    data = {"x": jax.ShapeDtypeStruct((batch, d), jnp.float32),
            "y": jax.ShapeDtypeStruct((batch,), jnp.int32)}
    return hetshard.plan(_mlp_step, model, opt, data, cluster=cluster,
                         calibration=calibration, time_limit_s=10)


def test_a_tiny_model_gets_no_deep_pipeline_once_the_host_is_priced(device_only):
    from hetshard.sim.simulator import dispatched_tasks, host_time_s
    free = _mlp_plan(64, 256, "dgx-h100-x8", device_only)  # the host for free
    priced = _mlp_plan(64, 256, "dgx-h100-x8", None)
    tasks = [sum(dispatched_tasks(p) for p in plan.pipelines) for plan in (free, priced)]
    assert tasks[0] >= 20 and tasks[1] <= 2, tasks  # a pipeline before; one program now
    assert priced.predicted.step_time_s == pytest.approx(
        host_time_s(priced, Cluster.load("dgx-h100-x8")))  # the host binds it
    # A model the devices take far longer on than the host keeps its plan.
    big = [_mlp_plan(8192, 8192, "dgx-h100-x8", cal) for cal in (device_only, None)]
    assert big[0].what_runs() == big[1].what_runs()
    assert big[1].predicted.step_time_s > 50 * host_time_s(big[1],
                                                           Cluster.load("dgx-h100-x8"))


@pytest.mark.parametrize("path", ["spmd", "pipeline"])
def test_state_already_in_place_is_not_placed_again(path, monkeypatch):
    """The second step hands the program the very arrays the first left in the objects
    (no copy, no re-layout); a pipeline does not distribute its state again."""
    step, model, opt, batch = _tiny()
    plan = _plans(hetshard.Program(step, (model, opt, batch)))[path]
    jitted = hetshard.jit(step, cluster=CLUSTER, plan=plan, quiet=True)
    jitted(model, opt, batch)
    entry = next(iter(jitted._compiled.values()))
    held = {id(x) for x in jax.tree.leaves(nnx.state((model, opt)))}
    if path == "spmd":
        seen = []
        compiled = entry.step
        monkeypatch.setattr(entry, "step", lambda state, *a: seen.append(
            jax.tree.leaves(state)) or compiled(state, *a))
        jitted(model, opt, batch)
        assert {id(x) for x in seen[0]} == held
    else:
        runner = entry.runner
        calls = []
        monkeypatch.setattr(runner, "_distribute", lambda leaves: calls.append(1))
        jitted(model, opt, batch)
        assert not calls  # (each stage kept the copies it updated last step)
    jitted.wait()


@pytest.mark.parametrize("policy", ["apply", "skip"])
def test_a_single_stage_nnx_step_donates_its_state_under_apply(policy):
    """Under nan_policy="apply" the update is written over the state (one copy of
    parameters and optimizer state at the step's peak, as the simulator prices): the
    arrays the objects held are consumed, the objects hold the new ones, and the
    compiled program aliases every state byte. Under "skip" (the guard's select) the
    state is not donated and the old arrays stay valid."""
    step, model, opt, batch = _tiny()
    plan = _plans(hetshard.Program(step, (model, opt, batch)))["spmd"]
    jitted = hetshard.jit(step, cluster=CLUSTER, plan=plan, quiet=True, nan_policy=policy)
    jitted(model, opt, batch)
    held = jax.tree.leaves(nnx.state((model, opt)))
    jitted(model, opt, batch)
    jitted.wait()
    assert all(x.is_deleted() == (policy == "apply") for x in held)
    entry = next(iter(jitted._compiled.values()))
    from hetshard.collectives import put
    m = entry.step.lower(nnx.state((model, opt)), put(batch, entry.batch_shardings),
                         *entry.carry.values()).compile().memory_analysis()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state((model, opt))))
    if policy == "apply":
        assert m.alias_size_in_bytes >= 0.99 * state_bytes
    else:
        assert m.alias_size_in_bytes < 0.01 * state_bytes


@pytest.mark.parametrize("path", ["shares", "pipeline"])
def test_updates_apart_donate_the_state_they_rewrite_under_apply(path):
    """Batch shares' combined update and each pipeline stage's update are programs of
    their own: under "apply" they write over the state they rewrite (the arrays the last
    step left are consumed), under "skip" (on CPU: ``hetshard.runtime.guard.donates``)
    they do not; both train alike."""
    got = {}
    for policy in ("apply", "skip"):
        step, model, opt, batch = _tiny()
        plan = _plans(hetshard.Program(step, (model, opt, batch)))[path]
        jitted = hetshard.jit(step, cluster=CLUSTER, plan=plan, quiet=True,
                              nan_policy=policy)
        jitted(model, opt, batch)
        jitted.wait()
        entry = next(iter(jitted._compiled.values()))
        if path == "shares":
            held = jax.tree.leaves(nnx.state((model, opt)))
        else:  # what each stage updates: the leaves it owns
            runner = entry.runner
            held = [view[i] for row, views in zip(runner.runs, runner.views, strict=True)
                    for run, view in zip(row, views, strict=True) for i in run.owned]
        jitted(model, opt, batch)
        jitted.wait()
        assert held and all(x.is_deleted() == (policy == "apply") for x in held), policy
        got[policy] = _params(model)
    for a, b in zip(got["apply"], got["skip"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_host_time_counts_each_nodes_tasks(device_only):
    """One host a node dispatches the tasks of its stages: a single-stage step is one
    program; a pipeline stage 2 (ZB-H1: 3) a micro-batch and one update; the step takes
    the busiest host's time when that is longer than the devices'."""
    import dataclasses

    from hetshard.cost.calibration import DEFAULT
    from hetshard.sim import simulate
    from hetshard.sim.simulator import dispatched_tasks, host_time_s
    from hetshard_models import profile as profile_model
    spec = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32"
    c = Cluster.from_dict({"name": "two-by-two", "groups": [  # nodes of 4
        {"name": "a", "gpu": "A100-80GB", "nodes": 2, "gpus_per_node": 4},
        {"name": "v", "gpu": "V100-32GB", "nodes": 2, "gpus_per_node": 4}]})
    a, v = "A100-80GB", "V100-32GB"
    task = DEFAULT.default.host_task_s
    one = Plan(spec, c.to_dict(), 64, 32, (Pipeline(
        (Stage(0, 6, tuple(range(8)), a, (("data", 8),)),), 64, 8, 1),))
    assert dispatched_tasks(one.pipelines[0]) == 1
    assert host_time_s(one, c) == pytest.approx(task)  # each node: the one program
    pipe = Pipeline((Stage(0, 3, (0, 1, 2, 3), a, (("data", 4),)),
                     Stage(3, 6, (8, 9, 10, 11), v, (("data", 4),))), 64, 2, 8)
    two = Plan(spec, c.to_dict(), 64, 32, (pipe,))
    assert dispatched_tasks(pipe) == 2 * (2 * 8 + 1)
    assert host_time_s(two, c) == pytest.approx((2 * 8 + 1) * task)  # a node a stage
    same_node = dataclasses.replace(pipe, stages=(
        dataclasses.replace(pipe.stages[0], devices=(0, 1), mesh_shape=(("data", 2),)),
        dataclasses.replace(pipe.stages[1], devices=(2, 3), mesh_shape=(("data", 2),),
                            gpu=a)), micro_batch_size=4)
    both = Plan(spec, c.to_dict(), 64, 32, (same_node,))
    assert host_time_s(both, c) == pytest.approx(2 * (2 * 8 + 1) * task)
    zb = dataclasses.replace(two, pipelines=(dataclasses.replace(pipe, schedule="zbh1"),))
    assert host_time_s(zb, c) == pytest.approx((3 * 8 + 1) * task)
    prof = profile_model(spec, 32, "float32")
    priced, free = simulate(two, prof, c), simulate(two, prof, c, device_only)
    assert free.step_time_s < host_time_s(two, c)  # so small a model: host-bound
    assert priced.step_time_s == pytest.approx(host_time_s(two, c))
    assert priced.device_time_s == pytest.approx(free.step_time_s)
