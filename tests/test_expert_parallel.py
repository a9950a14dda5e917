"""Expert parallelism (issue 51, 2): a user's MoE trains under a plan with an ``expert``
mesh axis as on one device; its dropless layers run their tokens through all-to-alls to
the ranks holding their experts; bad plans are refused naming the field."""

import dataclasses

import jax
import numpy as np
import pytest
import user_models
from flax import nnx

import hetshard
from hetshard.cluster import Cluster
from hetshard.errors import PlanNotExecutableError, SpecError
from hetshard.plan import Pipeline, Plan, Stage

A100 = "dgx-a100-80gb-x8"
MIXED = "h100-a100-v100-x8"


def _train(step, args, batches, steps=2):
    args, out = list(args), []
    for i in range(steps):
        args[-1] = batches[i % len(batches)]
        out.append(float(step(*args)))
    return out


def _one_stage(program, mesh, experts=(), capacity_factor=None):
    size = int(np.prod([n for _, n in mesh]))
    ways = int(np.prod([n for a, n in mesh if a in ("data", "fsdp", "expert")]))
    stage = Stage(0, program.layering(2).num_layers, tuple(range(size)), "A100-80GB", mesh,
                  experts=experts)
    return Plan(program.name, Cluster.load(A100).to_dict(), 8, program.seq_len,
                (Pipeline((stage,), 8, 8 // ways, 1),), dtype=program.dtype,
                attention="reference", capacity_factor=capacity_factor)


def _spy(monkeypatch):
    """Counts the expert-parallel regions traced (each makes two all-to-alls a step)."""
    import hetshard.collectives.experts as ep
    calls = []
    real = ep.expert_parallel

    def spy(*a, **kw):
        calls.append(a[3])  # the placement
        return real(*a, **kw)
    monkeypatch.setattr(ep, "expert_parallel", spy)
    return calls


CASES = [  # (dispatch, k, shared, mesh, placement)
    ("dropless", 1, False, (("data", 2), ("expert", 4)), ()),
    ("dropless", 2, True, (("expert", 4),), ()),
    ("dropless", 2, False, (("data", 4), ("expert", 2)), (3, 1)),
    ("capacity", 2, False, (("data", 2), ("expert", 2)), ()),
    ("capacity", 1, True, (("expert", 4),), ()),
]


@pytest.mark.parametrize("dispatch,k,shared,mesh,placement", CASES)
def test_expert_parallel_steps_equal_one_device(monkeypatch, dispatch, k, shared, mesh,
                                                placement):
    """Top-1 and top-2, with and without a shared expert, dropless and with capacity,
    expert parallelism alone and with data parallelism, even and uneven experts per
    rank: the losses of two AdamW steps equal one device's. A dropless layer runs its
    exchange (one expert-parallel region per layer, with the plan's placement); even
    placements store each rank's experts only."""
    kw = dict(dispatch=dispatch, k=k, shared=shared, layers=2)
    want = _train(nnx.jit(user_models.make_moe(**kw)[0]), *user_models.make_moe(**kw)[1:])
    step, args, batches = user_models.make_moe(**kw)
    plan = _one_stage(hetshard.Program(step, args), mesh, placement)
    calls = _spy(monkeypatch)
    jitted = hetshard.jit(step, cluster=A100, plan=plan)
    got = _train(jitted, args, batches)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    n = dict(mesh)["expert"]
    if dispatch == "dropless":
        assert calls == [placement or (4 // n,) * n] * 2
    else:
        assert calls == []
    specs = {jax.tree_util.keystr(p): s.spec for p, s in
             jax.tree_util.tree_flatten_with_path(jitted.state_shardings(*args))[0]}
    w_in = [s for p, s in specs.items() if "w_in" in p]  # the weight and its moments
    assert len(w_in) == 6  # 2 layers x (weight, AdamW's mu and nu)
    assert all(tuple(s)[:1] == (() if placement else ("expert",)) for s in w_in)


def test_expert_parallelism_with_pipeline_and_data_parallelism_equals_one_device(
        monkeypatch):
    """A top-2 dropless MoE with a shared expert on two stages of two GPU types: EP 2 on
    the H100s, data 2 x EP 2 with 3 and 1 experts per rank on the V100s, 2 micro-batches:
    the losses equal one device's."""
    kw = dict(dispatch="dropless", k=2, layers=4, shared=True)
    want = _train(nnx.jit(user_models.make_moe(**kw)[0]), *user_models.make_moe(**kw)[1:],
                  steps=3)
    step, args, batches = user_models.make_moe(**kw)
    program = hetshard.Program(step, args)
    n = program.layering(2).num_layers
    stages = (Stage(0, n // 2, (0, 1), "H100-80GB", (("expert", 2),)),
              Stage(n // 2, n, (4, 5, 6, 7), "V100-32GB", (("data", 2), ("expert", 2)),
                    experts=(3, 1)))
    plan = Plan(program.name, Cluster.load(MIXED).to_dict(), 8, program.seq_len,
                (Pipeline(stages, 8, 2, 2),), dtype=program.dtype, attention="reference")
    calls = _spy(monkeypatch)
    got = _train(hetshard.jit(step, cluster=MIXED, plan=plan), args, batches, steps=3)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert sorted(set(calls)) == [(2, 2), (3, 1)]


def test_a_capacity_factor_bounds_the_exchange_and_drops_past_it():
    """With a capacity factor of the expert ranks (a block as large as every routed row)
    nothing is dropped and the step is exact; with 0.25 rows are dropped: the loss
    differs from one device's but stays finite."""
    kw = dict(dispatch="dropless", k=2, layers=2)
    want = _train(nnx.jit(user_models.make_moe(**kw)[0]), *user_models.make_moe(**kw)[1:],
                  steps=1)
    mesh = (("data", 2), ("expert", 4))
    for factor, exact in ((4.0, True), (0.25, False)):
        step, args, batches = user_models.make_moe(**kw)
        plan = _one_stage(hetshard.Program(step, args), mesh, capacity_factor=factor)
        got = _train(hetshard.jit(step, cluster=A100, plan=plan), args, batches, steps=1)
        assert np.isfinite(got).all()
        if exact:
            np.testing.assert_allclose(got, want, rtol=2e-6)
        else:
            assert abs(got[0] - want[0]) > 1e-4


@pytest.mark.parametrize("factor", [0, -1.0, float("nan"), True, "2"])
def test_a_capacity_factor_must_be_positive(factor):
    program = hetshard.Program(*user_models.make_moe(layers=1)[:2])
    plan = _one_stage(program, (("expert", 2),))
    with pytest.raises(SpecError, match="capacity_factor") as e:
        dataclasses.replace(plan, capacity_factor=factor)
    assert "dropless" in str(e.value) and "> 0" in str(e.value)


def test_bad_expert_plans_are_refused_naming_the_field():
    """An expert axis that does not divide the experts, a placement dropping an expert
    or of the wrong length, and an expert axis on a dense model."""
    step, args, batches = user_models.make_moe(layers=1)  # 4 experts
    program = hetshard.Program(step, args)
    with pytest.raises(PlanNotExecutableError, match=r"mesh_shape.*expert axis of 8 does "
                       r"not divide the model's 4 experts.*\[2, 4\]"):
        _train(hetshard.jit(step, cluster=A100,
                            plan=_one_stage(program, (("expert", 8),))), args, batches, 1)
    with pytest.raises(PlanNotExecutableError, match=r"experts \[2, 1\] places 3 experts.*"
                       r"summing to 4"):
        _train(hetshard.jit(step, cluster=A100, plan=_one_stage(
            program, (("data", 4), ("expert", 2)), experts=(2, 1))), args, batches, 1)
    with pytest.raises(SpecError, match=r"stages\[0\].experts.*one count >= 0 per rank"):
        _one_stage(program, (("data", 4), ("expert", 2)), experts=(2, 1, 1))
    with pytest.raises(SpecError, match=r"experts.*no expert axis"):
        _one_stage(program, (("data", 8),), experts=(4,))
    step, args, batches = user_models.make_transformer()
    dense = hetshard.Program(step, args)
    with pytest.raises(PlanNotExecutableError, match="no mixture-of-experts layer"):
        _train(hetshard.jit(step, cluster=A100, plan=_one_stage(
            dense, (("data", 4), ("expert", 2)))), args, batches, 1)


def test_an_expert_plan_round_trips_and_older_plans_load():
    program = hetshard.Program(*user_models.make_moe(layers=1)[:2])
    plan = _one_stage(program, (("data", 4), ("expert", 2)), experts=(3, 1),
                      capacity_factor=1.5)
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.pipelines[0].stages[0].experts == (3, 1)
    assert back.capacity_factor == 1.5
    old = plan.to_dict()
    old["version"] = 15
    del old["capacity_factor"]
    del old["pipelines"][0]["stages"][0]["experts"]
    loaded = Plan.from_dict(old)
    assert loaded.capacity_factor is None and loaded.pipelines[0].stages[0].experts == ()
