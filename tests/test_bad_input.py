"""Bad input, one table (issue 23): each row is refused with a named HetshardError and a
non-zero exit before any work, naming the field, and nothing the user had is written over
or lost. Cluster specs and plan JSON are fuzzed: every mutation of a valid file loads or
is a HetshardError, never another exception."""

import copy
import dataclasses
import json
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import user_models
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetshard
from hetshard._plan import Plan
from hetshard.cli import main
from hetshard.cluster import Cluster
from hetshard.errors import HetshardError, SpecError, StepTraceError

SIM = ["simulate", "--model", "gpt-tiny", "--cluster", "dgx-a100-80gb-x8"]
PLAN = ["plan", "--model", "gpt-tiny", "--cluster", "dgx-a100-80gb-x8", "--time-limit", "5"]


@pytest.fixture(scope="module")
def valid_plan(tmp_path_factory):
    """A valid 2-stage plan of gpt-tiny on 8 A100s, as hetshard simulate writes it."""
    path = tmp_path_factory.mktemp("plan") / "sim.json"
    assert main([*SIM, "--global-batch", "8", "--fix", "dp=4,tp=1,pp=2", "--json",
                 str(path)]) == 0
    return json.loads(path.read_text())["plan"]


def _mutated(plan, how):
    p = copy.deepcopy(plan)
    st0 = p["pipelines"][0]["stages"][0]
    {"device 12 of 8": lambda: st0.__setitem__("devices", [0, 1, 2, 12]),
     "repeated device": lambda: st0.__setitem__("devices", [0, 0, 1, 2]),
     "devices as text": lambda: st0.__setitem__("devices", "0-3"),
     "end beyond layers": lambda: p["pipelines"][0]["stages"][-1].__setitem__("end", 99),
     "dtype int8": lambda: p.__setitem__("dtype", "int8"),
     "mesh of 2 on 4 devices": lambda: st0.__setitem__("mesh_shape", [["data", 2]]),
     "V100 on A100s": lambda: st0.__setitem__("gpu", "V100-32GB"),
     }[how]()
    return p


# (case, argv builder, text the one-line error must contain)
CLI_ROWS = [
    ("global batch 0", lambda d: [*SIM, "--global-batch", "0", "--fix", "dp=8"],
     "--global-batch=0"),
    ("global batch -8", lambda d: [*SIM, "--global-batch", "-8", "--fix", "dp=8"],
     "--global-batch=-8"),
    ("seq len 0", lambda d: [*SIM, "--global-batch", "8", "--seq-len", "0", "--fix", "dp=8"],
     "--seq-len=0"),
    ("seq len -5", lambda d: [*SIM, "--global-batch", "8", "--seq-len", "-5", "--fix",
                              "dp=8"], "--seq-len=-5"),
    ("time limit -1", lambda d: [*PLAN[:-2], "--global-batch", "8", "--time-limit", "-1"],
     "--time-limit=-1"),
    ("time limit nan", lambda d: [*PLAN[:-2], "--global-batch", "8", "--time-limit", "nan"],
     "--time-limit=nan"),
    ("json into a missing folder", lambda d: [*PLAN, "--global-batch", "8", "--json",
                                              f"{d}/no/such/plan.json"], "--json="),
    ("json onto a folder", lambda d: [*PLAN, "--global-batch", "8", "--json", str(d)],
     "not a directory"),
    ("png into a missing folder", lambda d: [*SIM, "--global-batch", "8", "--fix", "dp=8",
                                             "--png", f"{d}/no/t.png"], "--png="),
    ("trace onto a folder", lambda d: [*SIM, "--global-batch", "8", "--fix", "dp=8",
                                       "--trace", str(d)], "--trace="),
    ("profile out into a missing folder", lambda d: ["profile", "--quick", "--out",
                                                     f"{d}/no/cal.json"], "--out="),
    ("binary plan file", lambda d: [*SIM[:1], "--plan", f"{d}/garbage.json"],
     "a UTF-8 text plan file"),
    ("tp 16", lambda d: [*PLAN, "--global-batch", "8", "--fix", "tp=16"], "tp=16 is invalid"),
    ("mbs 3 on batch 10", lambda d: [*PLAN, "--global-batch", "10", "--fix", "mbs=3"],
     "not a multiple of any allowed micro-batch size [3]"),
    ("a cluster of 800M GPUs", lambda d: ["plan", "--model", "gpt-tiny", "--cluster",
                                          f"{d}/huge.json", "--global-batch", "8"],
     "at most 131,072 GPUs"),
    ("missing executable", lambda d: ["launch", "--nprocs", "2", "--", f"{d}/nothing.sh"],
     "command="),
    ("unknown fix key", lambda d: [*PLAN, "--global-batch", "8", "--fix", "xx=1"],
     "--fix xx"),
    ("empty plan path", lambda d: [*SIM[:1], "--plan", ""], "(it is empty)"),
    ("plan path a folder", lambda d: [*SIM[:1], "--plan", str(d)], "(it is a directory)"),
] + [(f"plan JSON: {how}", lambda d, how=how: [*SIM[:1], "--plan", f"{d}/{how}.json"], text)
     for how, text in (("device 12 of 8", "devices=12"),
                       ("repeated device", "([0] repeated)"),
                       ("devices as text", "devices='0-3'"),
                       ("end beyond layers", "end=[99]"),
                       ("dtype int8", "dtype='int8'"),
                       ("mesh of 2 on 4 devices", "mesh_shape="),
                       ("V100 on A100s", "stages[0].gpu='V100-32GB' is invalid; expected "
                                         "'A100-80GB'"))]


@pytest.mark.parametrize("case,argv,text", CLI_ROWS, ids=[r[0] for r in CLI_ROWS])
def test_cli_refuses_bad_input_before_work(case, argv, text, tmp_path, capsys, valid_plan):
    (tmp_path / "garbage.json").write_bytes(bytes(range(256)) * 2)
    (tmp_path / "huge.json").write_text(json.dumps({"name": "huge", "groups": [
        {"name": "a", "gpu": "A100-80GB", "nodes": 100_000_000, "gpus_per_node": 8}]}))
    for how in ("device 12 of 8", "repeated device", "devices as text", "end beyond layers",
                "dtype int8", "mesh of 2 on 4 devices", "V100 on A100s"):
        (tmp_path / f"{how}.json").write_text(json.dumps(_mutated(valid_plan, how)))
    (tmp_path / "keep.json").write_text("the user's file")
    before = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert main(argv(tmp_path)) == 2, case
    err = capsys.readouterr().err
    assert err.startswith("hetshard: error:"), err
    assert text in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    after = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == before  # nothing written, nothing lost
    assert not (tmp_path / "no").exists()


def _tiny_step():
    model = user_models.make_transformer()[1][0]
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    return user_models.nnx_step(user_models.lm_loss), model, opt


def _raises(error, field, fn):
    with pytest.raises(error) as info:
        fn()
    if field is not None:
        assert getattr(info.value, "field", None) == field or field in str(info.value), \
            str(info.value)
    return info.value


def test_python_api_refuses_bad_input_naming_the_field(valid_plan):
    step, model, opt = _tiny_step()
    tokens = jnp.zeros((8, 16), jnp.int32)
    # Leading sizes that disagree name both keys (no rows silently dropped).
    e = _raises(SpecError, None, lambda: hetshard.plan(
        step, model, opt, {"tokens": tokens, "targets": tokens[:4]},
        cluster="dgx-a100-80gb-x8"))
    assert "'tokens'" in str(e) and "'targets'" in str(e)
    _raises(SpecError, "nan_policy",
            lambda: hetshard.jit(step, cluster="dgx-a100-80gb-x8", nan_policy="ignore"))
    _raises(SpecError, "loss_output",
            lambda: hetshard.jit(step, cluster="dgx-a100-80gb-x8", loss_output=[0]))
    _raises(SpecError, "time_limit_s", lambda: hetshard.plan(
        step, model, opt, {"tokens": tokens, "targets": tokens},
        cluster="dgx-a100-80gb-x8", time_limit_s=float("nan")))
    # One spelling, hetshard.jit's: the singular names the plural, not PlannerOptions.
    e = _raises(SpecError, "batch_argnum", lambda: hetshard.plan(
        step, model, opt, {"tokens": tokens, "targets": tokens},
        cluster="dgx-a100-80gb-x8", batch_argnum=2))
    assert "batch_argnums" in str(e) and "PlannerOptions" not in str(e)
    # A traced Program plans as its step does, and holds its own arguments.
    args = (model, opt, {"tokens": tokens, "targets": tokens})
    program = hetshard.Program(step, args)
    from_program = hetshard.plan(program, cluster="dgx-a100-80gb-x8", shardings=False,
                                 max_stages=1, time_limit_s=10)
    from_step = hetshard.plan(step, *args, cluster="dgx-a100-80gb-x8", shardings=False,
                              max_stages=1, time_limit_s=10)
    assert from_program.what_runs() == from_step.what_runs()
    _raises(SpecError, "args", lambda: hetshard.plan(program, model,
                                                       cluster="dgx-a100-80gb-x8"))
    _raises(SpecError, "options", lambda: hetshard.plan(
        program, cluster="dgx-a100-80gb-x8", options={"max_stages": 1}))
    _raises(SpecError, "search.refine_tops", lambda: hetshard.plan(
        program, cluster="dgx-a100-80gb-x8", search={"refine_tops": 1}))
    for how, field in (("device 12 of 8", "pipelines[0].stages[0].devices"),
                       ("repeated device", "pipelines[0].stages[0].devices"),
                       ("dtype int8", "dtype"),
                       ("mesh of 2 on 4 devices", "pipelines[0].stages[0].mesh_shape")):
        _raises(SpecError, field, lambda how=how: Plan.from_dict(_mutated(valid_plan, how)))
    _raises(SpecError, "groups[*].nodes*gpus_per_node", lambda: Cluster.from_dict(
        {"name": "huge", "groups": [{"name": "a", "gpu": "A100-80GB", "nodes": 10**8,
                                     "gpus_per_node": 8}]}))


def test_a_step_that_cannot_take_its_batch_names_the_shapes():
    # 1-D tokens: the model's own code fails; the error names the step and the shapes
    # and keeps the model's exception as its cause.
    step, model, opt = _tiny_step()
    flat = jnp.zeros((8,), jnp.int32)
    jitted = hetshard.jit(step, cluster="dgx-a100-80gb-x8", time_limit_s=2)
    e = _raises(StepTraceError, None, lambda: jitted(model, opt, {"tokens": flat,
                                                                   "targets": flat}))
    assert "'tokens': (8,)" in str(e) and e.__cause__ is not None


def test_end_beyond_the_programs_layers_is_refused_by_jit(valid_plan):
    step, model, opt = _tiny_step()
    batch = user_models._text_batches(np.random.default_rng(0))[0]
    program = hetshard.Program(step, (model, opt, batch))
    n = program.layering(2).num_layers
    plan = Plan.from_dict(valid_plan)
    stages = list(plan.pipelines[0].stages)
    stages[-1] = dataclasses.replace(stages[-1], end=n + 3)
    bad = dataclasses.replace(plan, pipelines=(dataclasses.replace(
        plan.pipelines[0], stages=tuple(stages)),), fingerprint="")
    jitted = hetshard.jit(step, cluster="dgx-a100-80gb-x8", plan=bad)
    before = [np.asarray(x) for x in jax_leaves(model)]
    _raises(SpecError, "plan.pipelines[*].stages[-1].end", lambda: jitted(model, opt, batch))
    assert all(np.array_equal(a, b) for a, b in zip(before, jax_leaves(model), strict=True))


def jax_leaves(model):
    import jax
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_an_unwritable_plan_cache_warns_and_training_goes_on(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("HETSHARD_CACHE_DIR", str(blocker / "cache"))
    from hetshard import cache
    cache.clear_memory()
    cache._REPORTED.clear()
    step, model, opt = _tiny_step()
    batch = user_models._text_batches(np.random.default_rng(0))[0]
    jitted = hetshard.jit(step, cluster="dgx-a100-80gb-x8", time_limit_s=2, max_stages=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = jitted(model, opt, batch)
    assert np.isfinite(float(loss))
    assert any("cannot write" in str(w.message) for w in caught)
    assert blocker.read_text() == "not a directory"


# ---- fuzzing: every mutation of a valid file loads or is a HetshardError ---------------

def _paths(tree, prefix=()):
    yield prefix
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _paths(v, (*prefix, i))


def _replace(tree, path, value):
    if not path:
        return value
    out = copy.deepcopy(tree)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=6)
    | st.floats(allow_nan=True, allow_infinity=True),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                  max_size=3),
    max_leaves=5)


def _loads_or_refuses(load, text):
    try:
        load(text)
    except HetshardError:
        pass  # a named refusal is the other accepted outcome


def _fuzz(load, valid: dict, data):
    paths = list(_paths(valid))
    kind = data.draw(st.sampled_from(["replace", "delete", "bytes"]))
    if kind == "bytes":
        raw = bytearray(json.dumps(valid).encode())
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
        cut = data.draw(st.integers(1, len(raw)))
        text = bytes(raw[:cut]).decode("utf-8", errors="surrogateescape")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = bytes(raw[:cut]).decode("latin-1")
    else:
        path = data.draw(st.sampled_from(paths))
        if kind == "delete" and path:
            parent = valid
            for k in path[:-1]:
                parent = parent[k]
            tree = _replace(valid, path[:-1], (
                {k: v for k, v in parent.items() if k != path[-1]} if isinstance(parent, dict)
                else [v for i, v in enumerate(parent) if i != path[-1]]))
        else:
            tree = _replace(valid, path, data.draw(_values))
        text = json.dumps(tree, allow_nan=True)
    _loads_or_refuses(load, text)


_FUZZ = settings(max_examples=300, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])


@_FUZZ
@given(data=st.data())
def test_fuzzed_plan_json_loads_or_is_refused(valid_plan, data):
    _fuzz(lambda text: Plan.from_json(text, source="fuzz"), valid_plan, data)


_SPEC = {"name": "mixed", "inter_group_gbs": 25.0, "groups": [
    {"name": "h", "gpu": "H100-80GB", "nodes": 2, "gpus_per_node": 8, "intra_node_gbs": 450,
     "inter_node_gbs": 50},
    {"name": "v", "gpu": {"name": "MyGPU", "bf16_tflops": 100, "memory_gb": 32,
                          "memory_gbs": 900, "fp32_tflops": 15}, "nodes": 1,
     "gpus_per_node": 4, "processes": [1]}]}


@_FUZZ
@given(data=st.data())
def test_fuzzed_cluster_specs_load_or_are_refused(data):
    _fuzz(lambda text: Cluster.from_json(text, source="fuzz"), _SPEC, data)


def test_fuzz_base_files_are_valid(valid_plan):
    assert Plan.from_json(json.dumps(valid_plan)).global_batch == 8
    assert Cluster.from_json(json.dumps(_SPEC)).num_devices == 20


def test_a_pinned_pipeline_on_a_step_whose_loss_call_is_unseen_names_that_cause():
    # The value_and_grad is made outside the step and passed in: hetshard sees no loss
    # call, so the step's fingerprint differs from the plan's; the refusal says why
    # (it said "another model, parameter shapes or batch shapes").
    import jax

    from hetshard._plan import Pipeline, Stage
    from hetshard.runtime.executable import PlanNotExecutableError
    step, (model, opt, batch), _ = user_models.make_transformer()
    program = hetshard.Program(step, (model, opt, batch))
    n = program.layering(2).num_layers
    cluster = Cluster.from_jax_devices()
    cpu = cluster.groups[0].gpu.name
    plan = Plan(program.name, cluster.to_dict(), 8, program.seq_len, (Pipeline(tuple(
        Stage(i * n // 4, (i + 1) * n // 4, (2 * i, 2 * i + 1), cpu, (("data", 2),))
        for i in range(4)), 8, 1, 4),), fingerprint=program.model_fingerprint,
        attention="reference")
    vg = nnx.value_and_grad(user_models.lm_loss)

    def outside(model, optimizer, batch):
        value, grads = vg(model, batch)
        optimizer.update(model, grads)
        return value
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    err = _raises(PlanNotExecutableError, None,
                  lambda: hetshard.jit(outside, cluster=cluster, plan=plan)(model, opt, batch))
    assert "sees no loss call" in str(err) and "inside the step" in str(err)
    assert "another model" not in str(err)
    # Asking the planner for a pipeline such a step cannot run: refused, naming why.
    _raises(SpecError, "min_stages", lambda: hetshard.jit(
        outside, cluster=cluster, min_stages=2)(model, opt, batch))
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(
        before, jax.tree.leaves(nnx.state(model, nnx.Param)), strict=True))
