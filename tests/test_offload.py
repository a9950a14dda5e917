"""Host memory as a tier (``hetshard.offload``): the cluster's host links and memory,
offload in plans, its price, the runtime's memory kinds and the planner's choice."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx
from test_checkpoint import CLUSTER, PIPE6, SPMD8, STEP, _batches, _fresh
from test_checkpoint import _reference as ck_reference
from test_runtime import _plan, _reference, _run

import hetshard
from hetshard._plan import Plan
from hetshard.checkpoint import Checkpointer
from hetshard.cluster import Cluster
from hetshard.cluster.catalog import CATALOG
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.stage import stage_cost
from hetshard.errors import SpecError
from hetshard.sim import simulate
from hetshard.solver import PlannerOptions
from hetshard.solver.uniform import parse_fix, uniform_plan
from hetshard_models import profile as profile_model
from hetshard_models.steps import make_plan


def _consumer(link=None, memory=None, gpus=4, gpu="RTX-4090"):
    group = {"name": "g", "gpu": gpu, "nodes": 1, "gpus_per_node": gpus}
    if link is not None:
        group["host_link_gbs"] = link
    if memory is not None:
        group["host_memory_gb"] = memory
    return Cluster.load({"name": "c", "groups": [group], "inter_group_gbs": 1.25})


# ---- the cluster: host links and host memory --------------------------------------------

def test_every_gpu_type_has_a_host_link_and_host_memory_and_a_spec_overrides_them():
    assert all(t.host_link_gbs > 0 and t.host_memory_gb > 0 for t in CATALOG.values())
    # DGX-1 pairs V100s behind one PCIe Gen3 switch; DGX H100 gives each GPU Gen5 x16
    assert CATALOG["V100-16GB"].host_link_gbs < CATALOG["A100-80GB"].host_link_gbs < \
        CATALOG["H100-80GB"].host_link_gbs < CATALOG["GH200-96GB"].host_link_gbs
    default = _consumer()
    assert default.groups[0].host_link == CATALOG["RTX-4090"].host_link_gbs
    assert default.groups[0].host_memory_bytes == 4 * CATALOG["RTX-4090"].host_memory_gb * 1e9
    given = _consumer(link=12.0, memory=128)
    assert given.groups[0].host_link == 12.0 and given.groups[0].host_memory_bytes == 128e9
    again = Cluster.load(json.loads(given.to_json()))
    assert again.groups[0].host_link == 12.0 and again.groups[0].host_memory_bytes == 128e9
    assert "host_link_gbs" not in default.to_dict()["groups"][0]  # defaults stay implicit


@pytest.mark.parametrize("field,value", [("host_link_gbs", 0), ("host_memory_gb", -4),
                                         ("host_memory_gb", "lots")])
def test_a_bad_host_field_is_refused_naming_it(field, value):
    with pytest.raises(SpecError, match=rf"groups\[0\]\.{field}"):
        Cluster.load({"name": "c", "groups": [{"name": "g", "gpu": "T4", "nodes": 1,
                                               "gpus_per_node": 1, field: value}]})


# ---- plans ------------------------------------------------------------------------------

def _fixed(fix, cluster=None, model="gpt-tiny", seq=16, batch=8):
    prof = profile_model(model, seq, "float32")
    c = cluster or Cluster.load("dgx-a100-80gb-x8")
    return uniform_plan(model, prof, c, global_batch=batch, seq_len=seq,
                        fix=parse_fix(fix)), prof, c


def test_offload_goes_through_plan_json_and_an_older_plan_loads_without_it(tmp_path):
    plan, _, _ = _fixed("dp=8,tp=1,pp=1,remat=save_qkv,offload=optimizer+activations")
    assert plan.pipelines[0].stages[0].offload == ("optimizer", "activations")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    old = json.loads(path.read_text())
    old["version"] = 14
    del old["pipelines"][0]["stages"][0]["offload"]
    path.write_text(json.dumps(old))
    assert Plan.load(path).pipelines[0].stages[0].offload == ()
    assert "+opt +act" in plan.explain()


@pytest.mark.parametrize("offload,remat,match", [
    (("disk",), "none", "names among"),
    (("optimizer", "optimizer"), "none", "distinct"),
    (("activations",), "none", "keeps values by"),
    (("activations",), "full", "keeps values by"),
])
def test_a_bad_stage_offload_is_refused_naming_the_field(offload, remat, match):
    plan, _, _ = _fixed("dp=8,tp=1,pp=1")
    st = dataclasses.replace(plan.pipelines[0].stages[0], remat=remat, offload=offload)
    with pytest.raises(SpecError, match=r"pipelines\[0\]\.stages\[0\]\.offload") as e:
        dataclasses.replace(plan, pipelines=(dataclasses.replace(
            plan.pipelines[0], stages=(st,)),))
    assert match in str(e.value)


@pytest.mark.parametrize("text,field", [("offload=optimizer+disk", "--fix offload"),
                                        ("offload=activations", "--fix offload")])
def test_a_bad_fix_offload_is_refused(text, field):
    with pytest.raises(SpecError, match=field):
        parse_fix("dp=1,tp=1,pp=1," + text)


def test_bad_offload_options_are_refused():
    for bad in ((), ("gpu",), "optimizer", ("optimizer+optimizer",)):
        with pytest.raises(SpecError, match="offload_options"):
            PlannerOptions(offload_options=bad)
    opts = PlannerOptions(remat_options=("none", "save_qkv"),
                          offload_options=("none", "activations"))
    # "activations" only where a remat keeps values by name
    assert opts.memory_options == ("none", "save_qkv", "save_qkv@activations")


# ---- pricing ----------------------------------------------------------------------------

def _prof():
    return profile_model("gpt-1.3b", 1024, "bfloat16")


def test_optimizer_offload_moves_the_state_to_the_host_and_prices_the_stream():
    prof = _prof()
    gpu = CATALOG["RTX-4090"]
    kw = dict(profile=prof, start=0, end=prof.num_layers, gpu=gpu, mbs=1, cal=DEFAULT)
    plain = stage_cost(**kw)
    fast = stage_cost(**kw, offload=("optimizer",), host_link_gbs=64.0)
    slow = stage_cost(**kw, offload=("optimizer",), host_link_gbs=8.0)
    moved = plain.memory_static_bytes - fast.memory_static_bytes
    state = sum(layer.param_bytes for layer in prof.layers) * prof.opt_bytes_per_param_byte
    assert moved == pytest.approx(state) and fast.host_static_bytes == pytest.approx(state)
    assert plain.host_static_bytes == 0.0
    # the update waits for the state to stream in and out: at least its time on the link
    assert slow.optimizer_s >= state / (8e9 * DEFAULT.default.host_link_eff)
    assert plain.optimizer_s < fast.optimizer_s < slow.optimizer_s
    assert fast.fwd_s == plain.fwd_s and fast.bwd_s == plain.bwd_s  # per step, not per pass


def test_activation_offload_moves_the_kept_values_and_hides_behind_compute():
    prof = _prof()
    gpu = CATALOG["RTX-4090"]
    kw = dict(profile=prof, start=0, end=prof.num_layers, gpu=gpu, mbs=2, cal=DEFAULT,
              remat="save_qkv_mlp")
    kept = stage_cost(**kw)
    fast = stage_cost(**kw, offload=("activations",), host_link_gbs=1000.0)
    slow = stage_cost(**kw, offload=("activations",), host_link_gbs=0.5)
    full = stage_cost(**{**kw, "remat": "full"})
    # on the GPU the layers keep their inputs, as under full remat; the rest is host's
    assert fast.memory_per_microbatch_bytes == pytest.approx(full.memory_per_microbatch_bytes)
    assert fast.host_per_microbatch_bytes > kept.memory_per_microbatch_bytes - \
        full.memory_per_microbatch_bytes > 0
    # a fast link hides the copies behind each layer's compute; a slow one shows
    assert fast.fwd_s == pytest.approx(kept.fwd_s) and fast.bwd_s == pytest.approx(kept.bwd_s)
    assert slow.fwd_s > kept.fwd_s and slow.bwd_s > kept.bwd_s


def test_a_plan_whose_host_memory_is_too_small_is_priced_as_not_fitting():
    prof = _prof()
    for memory, fits in ((None, True), (20, False)):
        c = _consumer(memory=memory)
        plan, _, _ = _fixed("dp=4,tp=1,pp=1,mbs=2,offload=optimizer", c, "gpt-1.3b", 1024,
                            16)
        res = simulate(plan, prof, c)
        # 1.3B parameters' AdamW moments (8 bytes each) on each of the node's 4 GPUs
        assert res.host_memory_per_node["g/0"] == pytest.approx(
            4 * res.stage_costs[0][0].host_static_bytes)
        assert res.host_memory_per_node["g/0"] > 4 * 1.3e9 * 8 * 0.9
        assert res.fits is fits
        assert res.peak_memory_bytes < c.groups[0].gpu.memory_bytes  # the GPUs: room
    plain, _, _ = _fixed("dp=4,tp=1,pp=1,mbs=2", c, "gpt-1.3b", 1024, 16)
    res = simulate(plain, prof, c)
    assert not res.fits and res.host_memory_per_node == {}  # too large for a 4090 without


# ---- the runtime ------------------------------------------------------------------------

def _kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _trains_offloaded(fix):
    plan = _plan(fix)
    losses, params, step, batches, (model, opt) = _run(plan, tx="momentum")
    want_losses, want_params = _reference(batches, 3, tx="momentum")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return plan, step, opt, params


@pytest.mark.parametrize("fix", [
    "dp=8,tp=1,pp=1,remat=save_qkv_mlp,offload=optimizer+activations",  # one SPMD step
    "dp=2,tp=2,pp=2,remat=selective,offload=optimizer+activations,schedule=zbh1",  # MPMD
])
def test_an_offloaded_plan_trains_equal_to_one_device_with_its_state_on_the_host(fix):
    plan, step, opt, params = _trains_offloaded(fix)
    # the momentum lives in pinned host memory, the parameters on the devices
    assert _kinds(nnx.state(opt.opt_state)) == {"pinned_host"}
    assert _kinds(params) == {"device"}


def test_offloaded_activations_are_copied_to_the_host_in_the_step():
    plan = _plan("dp=8,tp=1,pp=1,remat=save_qkv,offload=activations")
    _, _, step, batches, (model, opt) = _run(plan, steps=1, tx="momentum")
    (entry,) = step._compiled.values()
    from hetshard.runtime.executable import step_state
    state = step_state(entry.program, (model, opt))
    traced = str(jax.make_jaxpr(entry.step)(state, batches[0], *entry.carry.values()))
    assert "<host>" in traced  # residuals placed in host memory (device_put to pinned_host)
    bare = _plan("dp=8,tp=1,pp=1,remat=save_qkv")
    _, _, step, batches, (model, opt) = _run(bare, steps=1, tx="momentum")
    (entry,) = step._compiled.values()
    state = step_state(entry.program, (model, opt))
    assert "<host>" not in str(jax.make_jaxpr(entry.step)(state, batches[0],
                                                         *entry.carry.values()))


# ---- the planner ------------------------------------------------------------------------

@pytest.mark.slow
def test_the_planner_offloads_where_memory_binds_and_the_link_is_fast():
    # A 20-block gpt-1.3b (1.1B parameters): its state (16 bytes a parameter) does not
    # fit two 12 GB cards without recomputation or model parallelism; its AdamW moments
    # can go to the host. (The 24-block gpt-1.3b no longer fits them without offload at
    # all once its embedding is priced whole on each tensor rank, as the runtime holds
    # it.)
    found, speed = {}, {}
    model = "gpt:layers=20,hidden=2048,heads=16,vocab=50257,seq=1024"
    for link in (64.0, 0.05):
        c = _consumer(link=link, gpus=2, gpu="RTX-3080Ti")
        for offload in (("none",), PlannerOptions().offload_options):
            plan = make_plan(model, c, global_batch=16, seq_len=1024, shardings=False,
                             options=PlannerOptions(time_limit_s=20,
                                                    offload_options=offload))
            assert plan.predicted.fits
            found[link, len(offload)] = [st.offload for p in plan.pipelines
                                         for st in p.stages]
            speed[link, len(offload)] = plan.predicted.tokens_per_s
    assert any("optimizer" in o for o in found[64.0, 4])  # fast link: offloaded, faster
    assert speed[64.0, 4] > speed[64.0, 1] * 1.05
    assert not any(found[0.05, 4])  # slow link: the plan without, as fast as before
    assert speed[0.05, 4] == pytest.approx(speed[0.05, 1], rel=1e-9)


@pytest.mark.slow
def test_a_checkpoint_of_an_offloaded_run_resumes_under_another_offloaded_plan(tmp_path):
    # Saved from host memory (an SPMD step offloading its optimizer), restored straight
    # into a pipeline whose second stage offloads its own: the same losses as one device.
    def offloaded(plan, stages):
        pipe = plan.pipelines[0]
        new = tuple(dataclasses.replace(st, offload=("optimizer",)) if j in stages else st
                    for j, st in enumerate(pipe.stages))
        return dataclasses.replace(plan, pipelines=(dataclasses.replace(pipe, stages=new),))

    before, after = offloaded(SPMD8, {0}), offloaded(PIPE6, {1})
    batches = _batches()
    want = ck_reference(batches)
    model, opt = _fresh()
    first = hetshard.jit(STEP, cluster=CLUSTER, plan=before, quiet=True)
    got = [float(first(model, opt, b)) for b in batches[:2]]
    assert _kinds(nnx.state(opt.opt_state)) == {"pinned_host"}
    ck = Checkpointer(tmp_path, keep=2)
    ck.save(2, (model, opt), data_position={"batch": 2}, plan=first.plan)
    ck.wait()
    del model, opt, first
    model, opt = _fresh(seed=7)
    second = hetshard.jit(STEP, cluster=CLUSTER, plan=after, quiet=True)
    where = second.state_shardings(model, opt, batches[2])
    ck.restore((model, opt), shardings=where)
    for x, s in zip(jax.tree.leaves(nnx.to_pure_dict(nnx.state((model, opt)))),
                    jax.tree.leaves(where, is_leaf=lambda s: isinstance(
                        s, jax.sharding.Sharding)), strict=True):
        assert x.sharding == s  # the second stage's moments restored into host memory
    assert "pinned_host" in _kinds(nnx.state(opt.opt_state))
    got += [float(second(model, opt, b)) for b in batches[2:]]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_two_offloading_pipelines_with_batch_shares_train_equal_to_one_device():
    # Several single-stage pipelines (the combined update on the first one's devices):
    # the update reads the host's state through device copies and writes it back there.
    from hetshard._plan import Pipeline, Stage
    cluster = Cluster.load("h100-a100-v100-x8")
    n_layers = profile_model("gpt-tiny", 16, "float32").num_layers
    fast = Pipeline((Stage(0, n_layers, (0,), "H100-80GB", (("data", 1),),
                           offload=("optimizer",)),), 5, 5, 1)
    slow = Pipeline((Stage(0, n_layers, (4, 5, 6), "V100-32GB", (("data", 3),),
                           remat="selective", offload=("optimizer", "activations")),), 3, 1, 1)
    plan = Plan("gpt-tiny", cluster.to_dict(), 8, 16, (fast, slow))
    losses, params, step, batches, (model, opt) = _run(plan, tx="momentum", cluster=cluster)
    want_losses, want_params = _reference(batches, 3, tx="momentum")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert type(next(iter(step._compiled.values()))).__name__ == "SharesStep"
    assert _kinds(nnx.state(opt.opt_state)) == {"pinned_host"}


def test_asking_for_offload_offloads_every_stage():
    # --fix offload=optimizer in `hetshard plan` (offload_options without "none"): the
    # uniform plans and heuristic seeds, which offload nothing, are not candidates.
    from hetshard.solver import options_from_fix
    opts = options_from_fix("offload=optimizer", PlannerOptions(time_limit_s=20))
    assert opts.offload_options == ("optimizer",)
    plan = make_plan("gpt-1.3b", _consumer(gpus=2, gpu="RTX-3080Ti"), global_batch=16,
                     seq_len=1024, shardings=False, options=opts)
    assert plan.predicted.fits
    assert {st.offload for p in plan.pipelines for st in p.stages} == {("optimizer",)}
