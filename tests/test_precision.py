"""Per-GPU compute dtypes: float16 stages on GPUs without bfloat16 tensor cores, priced,
planned and run (autocast, dynamic loss scaling) equal to the bfloat16 plan."""

import json
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import hetshard
from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster import Cluster
from hetshard.cluster.catalog import PrecisionWarning, gpu_dtypes
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.profile import profile_program
from hetshard.errors import NonFiniteLossError, PlanNotExecutableError, SpecError
from hetshard.runtime.precision import DynamicLossScale
from hetshard.sim import simulate
from hetshard.solver import PlannerOptions, make_plan
from hetshard_models import data, losses, steps

CLUSTER = "h100-a100-v100-x8"  # devices 0-1 H100, 2-3 A100, 4-7 V100
H, V = "H100-80GB", "V100-32GB"
BF16 = "gpt:layers=4,hidden=128,heads=4,vocab=256,seq=64,dtype=bfloat16"
FP16_V100 = ((V, "float16"),)


def _plan(pipelines, gd=FP16_V100, batch=8, attention="reference"):
    return Plan(BF16, Cluster.load(CLUSTER).to_dict(), batch, 64, tuple(pipelines),
                attention=attention, gpu_dtypes=gd)


def _pipelined(gd=FP16_V100):
    return _plan([Pipeline((Stage(0, 3, (1,), H, (("data", 1),)),
                            Stage(3, 6, (4,), V, (("data", 1),))), 8, 1, 8)], gd,
                 attention="auto")  # the flash kernel on CPU devices


def _spmd(gd=FP16_V100):
    return _plan([Pipeline((Stage(0, 6, (4, 5, 6, 7), V, (("data", 4),)),), 8, 1, 2)], gd)


def _shares(gd=FP16_V100):
    return _plan([Pipeline((Stage(0, 6, (0, 1), H, (("data", 2),)),), 4, 1, 2),
                  Pipeline((Stage(0, 6, (4, 5, 6, 7), V, (("data", 4),)),), 4, 1, 1)], gd)


def _batches(n=2):
    rng = np.random.default_rng(0)
    return [data.text_batch(rng, 8, 64, 256) for _ in range(n)]


def _train(plan, steps_=3, nan_policy="skip", scale=None):
    import hetshard_models as models
    model = models.build(BF16, rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @hetshard.jit(cluster=CLUSTER, plan=plan, nan_policy=nan_policy)
    def step(model, optimizer, batch):
        loss, grads = hetshard.value_and_grad(losses.text_loss)(model, batch)
        optimizer.update(model, grads)
        return loss
    batches = _batches()
    out = []
    for i in range(steps_):
        if i == 0 and scale is not None:
            out.append(float(step(model, opt, batches[0])))  # compiles, sets the scale
            _scaler(step).scale = scale
            continue
        out.append(float(step(model, opt, batches[i % len(batches)])))
    return out, model, step


def _scaler(step) -> DynamicLossScale:
    entry = next(iter(step._compiled.values()))
    return entry.runner.loss_scale if hasattr(entry, "runner") else entry.loss_scale


def _params(model):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _dots(jaxpr) -> dict:
    """dtype of the first operand -> count of dot_generals, calls included."""
    found: dict = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            d = str(eqn.invars[0].aval.dtype)
            found[d] = found.get(d, 0) + 1
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    for d, n in _dots(inner).items():
                        found[d] = found.get(d, 0) + n
    return found


# ---- runtime ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [pytest.param(_pipelined, marks=pytest.mark.slow), _spmd,
                                    pytest.param(_shares, marks=pytest.mark.slow)])
def test_float16_stages_train_as_the_bfloat16_plan(layout):
    # The V100 stages' matmuls in float16 (float32 accumulation), the loss scaled by
    # 2**15 and the gradients unscaled before the update: losses and weights follow the
    # all-bfloat16 plan (an unscaled gradient would step 32768x too far).
    want, ref, _ = _train(layout(()))
    got, model, step = _train(layout())
    np.testing.assert_allclose(got, want, rtol=2e-3)
    for a, b in zip(_params(model), _params(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3)
    scaler = _scaler(step)
    assert scaler.scale == 2.0 ** 15 and scaler.good_steps == 3
    assert _scaler(_train(layout(()), steps_=1)[2]) is None  # no float16: unscaled


def test_a_float16_stage_runs_its_matmuls_in_float16_and_the_others_do_not():
    _, _, step = _train(_pipelined(), steps_=1)
    runner = next(iter(step._compiled.values())).runner
    split = runner.splits[0]
    invars = split.closed.jaxpr.invars
    found = []
    for run, st in zip(runner.runs[0], split.stages, strict=True):
        avals = ([invars[i].aval for i in st.params], [invars[i].aval for i in st.frozen],
                 [invars[split.num_state + i].aval for i in st.batch],
                 [v.aval for v in st.recvs])
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), avals)
        found.append(_dots(jax.make_jaxpr(lambda *a, f=run.fwd.fn: f(*a)[0])(*args).jaxpr))
    h100, v100 = found
    assert h100.get("bfloat16", 0) > 0 and "float16" not in h100
    assert v100.get("float16", 0) > 0 and "bfloat16" not in v100


@pytest.mark.parametrize("layout", [pytest.param(_pipelined, marks=pytest.mark.slow), _spmd])
def test_an_overflow_skips_the_step_and_halves_the_scale(layout):
    # A scale of 2**40 overflows float16 in the backward pass: the step is skipped (the
    # weights kept, no NonFiniteLossError even under nan_policy="raise") and the scale
    # halved.
    _, after_one, _ = _train(layout(), steps_=1)
    _, model, step = _train(layout(), steps_=2, nan_policy="raise", scale=2.0 ** 40)
    scaler = _scaler(step)
    assert scaler.overflows == 1 and scaler.scale == 2.0 ** 39
    for a, b in zip(_params(model), _params(after_one), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_non_finite_loss_is_not_taken_for_an_overflow():
    scaler = DynamicLossScale(scale=8.0, growth_interval=2)
    assert not scaler.overflowed(False, False) and scaler.scale == 8.0  # the policy's
    assert scaler.overflowed(False, True) and scaler.scale == 4.0
    assert not scaler.overflowed(True, True) and scaler.scale == 4.0
    assert not scaler.overflowed(True, True) and scaler.scale == 8.0  # grown after 2
    low = DynamicLossScale(scale=1.0)
    assert not low.overflowed(False, True) and low.scale == 1.0  # nothing left to halve


def test_a_nan_loss_under_loss_scaling_still_meets_the_nan_policy():
    import hetshard_models as models
    model = models.build(BF16, rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @hetshard.jit(cluster=CLUSTER, plan=_spmd(), nan_policy="raise")
    def step(model, optimizer, batch):
        loss, grads = hetshard.value_and_grad(
            lambda m, b: losses.text_loss(m, b) * np.float32("nan"))(model, batch)
        optimizer.update(model, grads)
        return loss
    step(model, opt, _batches(1)[0])
    with pytest.raises(NonFiniteLossError):
        step.wait()


# ---- pricing and planning --------------------------------------------------------------

def test_float16_prices_a_v100_stage_at_its_tensor_core_rate():
    program = steps.program("gpt-350m", seq_len=1024, dtype="bfloat16")
    profile = profile_program(program)
    cluster = Cluster.load("a100-v100-x16")
    v_ids = tuple(cluster.group_device_ids(cluster.groups[1].name))[:4]
    gpu = cluster.groups[1].gpu.name
    assert gpu.startswith("V100")

    def plan(gd):
        return Plan("gpt-350m", cluster.to_dict(), 8, 1024, (Pipeline(
            (Stage(0, profile.num_layers, v_ids, gpu, (("data", 4),)),), 8, 2, 1),),
            gpu_dtypes=gd)
    slow = simulate(plan(()), profile, cluster, DEFAULT)
    fast = simulate(plan(((gpu, "float16"),)), profile, cluster, DEFAULT)
    ratio = slow.step_time_s / fast.step_time_s
    # Matmuls are most of the step: far faster, but not the full 125/15.7 of the peaks.
    assert 2.0 < ratio < 125 / 15.7


def test_the_planner_computes_in_float16_where_bfloat16_is_missing():
    program = steps.program("gpt-1.3b", seq_len=2048, dtype="bfloat16")
    with pytest.warns(PrecisionWarning, match="--gpu-dtypes fastest"):
        plain = make_plan(program, "a100-v100-x16", global_batch=256,
                          options=PlannerOptions(time_limit_s=20))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)  # nothing falls back now
        fast = make_plan(program, "a100-v100-x16", global_batch=256,
                         options=PlannerOptions(time_limit_s=20, gpu_dtypes="fastest"))
    assert plain.gpu_dtypes == () and fast.gpu_dtypes == (("V100-32GB", "float16"),)
    assert fast.loss_scaled and "V100-32GB in float16 (loss scaled)" in fast.explain()
    # The V100s are worth using once priced in float16.
    assert fast.predicted.tokens_per_s > 1.2 * plain.predicted.tokens_per_s
    assert any(st.gpu.startswith("V100") for p in fast.pipelines for st in p.stages)


def test_fastest_leaves_float_programs_and_bfloat16_gpus_alone():
    cluster = Cluster.load("a100-v100-x16")
    assert gpu_dtypes(cluster, "float32", "fastest") == ()
    assert gpu_dtypes(cluster, "bfloat16", "program") == ()
    assert gpu_dtypes(Cluster.load("mix3-x256"), "bfloat16", "fastest") == ()


# ---- bad input -------------------------------------------------------------------------

def test_bad_gpu_dtypes_are_refused_naming_the_field():
    with pytest.raises(SpecError, match="gpu_dtypes.*fp16.*program"):
        PlannerOptions(gpu_dtypes="fp16")
    d = _spmd().to_dict()
    d["gpu_dtypes"] = [[V, "int8"]]
    with pytest.raises(SpecError, match=r"gpu_dtypes\[V100-32GB\]=.?int8"):
        Plan.from_json(json.dumps(d))
    d["gpu_dtypes"] = [[V, "float16"], [V, "float32"]]
    with pytest.raises(SpecError, match="each GPU type at most once"):
        Plan.from_json(json.dumps(d))
    d["gpu_dtypes"] = "V100"
    with pytest.raises(SpecError, match="gpu_dtypes"):
        Plan.from_json(json.dumps(d))


def test_float16_stages_need_the_loss_call():
    import hetshard_models as models
    model = models.build(BF16, rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    # A transform made outside the step is not seen as the step's loss call (one called
    # in the step, nnx.value_and_grad included, is hetshard's).
    made_outside = nnx.value_and_grad(losses.text_loss)

    def plain_step(model, optimizer, batch):
        loss, grads = made_outside(model, batch)
        optimizer.update(model, grads)
        return loss
    before = _params(model)
    with pytest.raises(PlanNotExecutableError, match="gpu_dtypes"):
        hetshard.jit(plain_step, cluster=CLUSTER, plan=_spmd())(model, opt, _batches(1)[0])
    with pytest.raises(SpecError, match="gpu_dtypes"):
        hetshard.jit(plain_step, cluster=CLUSTER, gpu_dtypes="fastest")(
            model, opt, _batches(1)[0])
    for a, b in zip(_params(model), before, strict=True):
        np.testing.assert_array_equal(a, b)
