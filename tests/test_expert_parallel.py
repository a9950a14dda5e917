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
from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster import Cluster
from hetshard.errors import PlanNotExecutableError, SpecError

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
        if len(a) > 5 and a[5]:
            calls.append(("prelaid", len(a[5])))  # weights laid out once per step
        return real(*a, **kw)
    monkeypatch.setattr(ep, "expert_parallel", spy)
    return calls


CASES = [  # (dispatch, k, shared, mesh, placement)
    ("dropless", 1, False, (("data", 2), ("expert", 4)), ()),
    ("dropless", 2, True, (("expert", 4),), ()),
    ("dropless", 2, False, (("data", 4), ("expert", 2)), (3, 1)),
    ("dropless", 1, False, (("data", 2), ("expert", 4)), (1, 1, 2, 0)),
    ("capacity", 2, False, (("data", 2), ("expert", 2)), ()),
    ("capacity", 1, True, (("expert", 4),), ()),
    ("dropless", 2, True, (("data", 2), ("expert", 2), ("tensor", 2)), ()),
    ("dropless", 2, False, (("fsdp", 4), ("expert", 2)), (3, 1)),
]


@pytest.mark.parametrize("dispatch,k,shared,mesh,placement", CASES)
def test_expert_parallel_steps_equal_one_device(monkeypatch, dispatch, k, shared, mesh,
                                                placement):
    """Top-1 and top-2, with and without a shared expert, dropless and with capacity,
    expert parallelism alone and with data, tensor parallelism (the tensor ranks
    splitting the routed tokens too) and FSDP (each expert split over it too, gathered
    for the exchange), even and uneven experts per rank: the losses of
    two AdamW steps equal one device's. A dropless layer runs its
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
    assert all(tuple(s)[:1] == ("expert",) for s in w_in)  # (stored evenly: 4 experts)
    # a stage sharding its state splits each expert over fsdp too
    assert all(("fsdp" in tuple(s)) == ("fsdp" in dict(mesh)) for s in w_in)


@pytest.mark.parametrize("remat,schedule", [("none", "1f1b"),
                                             pytest.param("full", "zbh1", marks=pytest.mark.slow)])
def test_expert_parallelism_with_pipeline_and_data_parallelism_equals_one_device(
        monkeypatch, remat, schedule):
    """A top-2 dropless MoE with a shared expert on two stages of two GPU types: EP 2 on
    the H100s, data 2 x EP 2 with 3 and 1 experts per rank on the V100s, 2 micro-batches,
    without remat under 1F1B and with full remat under ZB-H1 (its W pass): the losses
    equal one device's. The V100s' missing experts are brought once a step."""
    kw = dict(dispatch="dropless", k=2, layers=4, shared=True)
    want = _train(nnx.jit(user_models.make_moe(**kw)[0]), *user_models.make_moe(**kw)[1:],
                  steps=3)
    step, args, batches = user_models.make_moe(**kw)
    program = hetshard.Program(step, args)
    n = program.layering(2).num_layers
    stages = (Stage(0, n // 2, (0, 1), "H100-80GB", (("expert", 2),)),
              Stage(n // 2, n, (4, 5, 6, 7), "V100-32GB", (("data", 2), ("expert", 2)),
                    experts=(3, 1), remat=remat))
    plan = Plan(program.name, Cluster.load(MIXED).to_dict(), 8, program.seq_len,
                (Pipeline(stages, 8, 2, 2, schedule),), dtype=program.dtype,
                attention="reference")
    calls = _spy(monkeypatch)
    got = _train(hetshard.jit(step, cluster=MIXED, plan=plan), args, batches, steps=3)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    placements = [c for c in calls if c[0] != "prelaid"]
    assert sorted(set(placements)) == [(2, 2), (3, 1)]
    # The V100 stage's uneven experts are laid out once per step, outside the
    # micro-batches: each of its layers' exchanges takes both expert weights so.
    assert calls.count(("prelaid", 2)) == placements.count((3, 1)) > 0


def test_the_ragged_exchange_stand_in_gives_ragged_all_to_all_s_documented_result():
    """On CPU (no ragged all-to-all in XLA:CPU) the dropless exchange runs
    ``_emulated_ragged``; on GPUs ``jax.lax.ragged_all_to_all`` takes the same
    arguments. The stand-in gives the result JAX's documentation states for its example
    (two ranks: operands [1, 2, 2] and [3, 4, 0] -> [1, 3, 0, 0] and [2, 2, 4, 0])."""
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from hetshard.collectives.experts import _emulated_ragged
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    args = [np.array(a, np.int32) for a in (
        [1, 2, 2, 3, 4, 0], [0] * 8, [0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1])]

    def body(*xs):
        return _emulated_ragged(*xs, axis_name="expert")
    got = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 6,
                        out_specs=P("expert"))(*[jnp.asarray(a) for a in args])
    assert np.asarray(got).tolist() == [1, 3, 0, 0, 2, 2, 4, 0]


def test_off_cpu_the_dropless_exchange_is_three_ragged_all_to_alls():
    """Where the devices are not CPUs, the dropless exchange binds
    ``jax.lax.ragged_all_to_all`` itself (rows, their slots, the results back), not its
    stand-in: traced here (XLA:CPU cannot compile it)."""
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from hetshard.collectives.experts import _ragged_exchange
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))

    def body(rows, row_slot, per_dest):
        first = jnp.cumsum(per_dest) - per_dest
        return _ragged_exchange(rows, row_slot, per_dest, first, 2,
                                lambda got, slot: got * 2.0, emulated=False)
    traced = jax.make_jaxpr(jax.shard_map(
        body, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=P("expert")))(
        jnp.zeros((8, 3)), jnp.zeros(8, jnp.int32), jnp.full(4, 2, jnp.int32))
    assert str(traced).count("ragged_all_to_all") == 3


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


# ---- pricing and planning ---------------------------------------------------------------

def _profile(**kw):
    from hetshard.cost.profile import profile_program
    step, args, _ = user_models.make_moe(**kw)
    return profile_program(hetshard.Program(step, args))


def _cost(profile, **kw):
    from hetshard.cluster.catalog import device_type
    from hetshard.cost.calibration import DEFAULT
    from hetshard.cost.comm import topology
    from hetshard.cost.stage import stage_cost
    cluster = Cluster.load(A100)
    ep = kw.get("ep", 1)
    return stage_cost(profile, 0, profile.num_layers, device_type("A100-80GB"), mbs=4,
                      cal=DEFAULT, ep_topo=topology(cluster, list(range(ep))) if ep > 1
                      else None, **kw)


def test_expert_parallelism_is_priced_as_the_runtime_runs_it():
    """The user MoE's two layers, on A100s: expert parallelism over 4 ranks divides the
    stacked expert weights (and their gradients and AdamW state) by 4, adds the
    all-to-alls (dropless: ragged ones carrying the routed rows, each way, forward and
    backward, into buffers of 4 blocks of them; a capacity factor of 1: padded blocks of
    a quarter of the rows each, as much), and a skewed router stretches the grouped
    matmuls and the busiest rank's receives alone."""
    from hetshard.cluster.catalog import device_type
    from hetshard.cost.calibration import DEFAULT
    from hetshard.cost.comm import collective_time, topology
    profile = _profile(layers=2)
    moe = [layer for layer in profile.layers if layer.experts]
    assert len(moe) == 2 and all(layer.experts == 4 for layer in moe)
    # rows: 16 tokens a sample x top-2; rows of d=16 float32 sent and returned
    assert {(layer.routed_rows_per_sample, layer.routed_row_bytes, layer.routed_out_bytes)
            for layer in moe} == {(32.0, 64, 64)}
    expert_bytes = sum(layer.expert_param_bytes for layer in moe)
    assert expert_bytes == 2 * 2 * 4 * 16 * 32 * 4  # w_in, w_out: [4, 16, 32] float32
    plain, ep4 = _cost(profile), _cost(profile, ep=4)
    state = 2 + profile.opt_bytes_per_param_byte  # weight, gradient, optimizer state
    # (and the expert weights' share of the copies autodiff keeps of the weights)
    copies = sum(layer.weight_copy_bytes * layer.expert_param_bytes / layer.param_bytes
                 for layer in moe)
    saved = plain.memory_static_bytes - ep4.memory_static_bytes
    assert saved == pytest.approx((expert_bytes * state + copies) * 0.75, rel=1e-6)
    topo, gpu = topology(Cluster.load(A100), [0, 1, 2, 3]), device_type("A100-80GB")

    def a2a(nbytes):
        return collective_time("all_to_all", nbytes, topo, DEFAULT, gpu.name)
    rows = 4 * 32  # the device's routed rows: 4 samples
    per_layer = a2a(rows * (64 + 4)) + a2a(rows * 64)
    extra = (ep4.fwd_s + ep4.bwd_s) - (plain.fwd_s + plain.bwd_s)
    assert extra == pytest.approx(2 * 2 * per_layer, rel=1e-6)
    capped = _cost(profile, ep=4, capacity_factor=1.0)
    assert (capped.fwd_s + capped.bwd_s) - (plain.fwd_s + plain.bwd_s) == \
        pytest.approx(2 * 2 * per_layer, rel=1e-6)
    # the dropless buffers hold the worst case: 4 blocks of the rows, both directions
    assert ep4.memory_working_bytes >= 2 * 4 * rows * (64 + 64)
    assert capped.memory_working_bytes < ep4.memory_working_bytes
    skewed = _cost(profile, ep=4, router_skew=3.0)
    assert skewed.fwd_s > ep4.fwd_s and skewed.model_flops == ep4.model_flops
    exchange = (skewed.fwd_s - ep4.fwd_s) - (_cost(profile, ep=4, router_skew=3.0,
                                                   capacity_factor=1.0).fwd_s - capped.fwd_s)
    assert exchange == pytest.approx(2 * (a2a(3 * rows * 68) + a2a(3 * rows * 64))
                                     - 2 * per_layer, rel=1e-6)  # the busiest receives 3x
    assert _cost(profile, router_skew=3.0).fwd_s == plain.fwd_s  # (no EP: one rank)


def test_an_uneven_placement_prices_each_type_by_its_busiest_rank():
    """A stage of 2 A100s and 2 V100s on one expert axis, 8 experts: placed by speed, the
    A100 ranks get more (``speed_placement``). Each type is priced by its own ranks'
    share of the experts (V100: 1 of a mean 2, A100: 3 of 2), so the V100s' grouped
    matmuls take a third of the A100s'. The weights stay stored evenly (the ranks divide
    the experts); each step moves each rank the experts it lacks (2 on the busiest)."""
    from hetshard.cluster.catalog import device_type
    from hetshard.cost.calibration import DEFAULT
    from hetshard.cost.comm import collective_time, topology
    from hetshard.cost.stage import stage_cost
    from hetshard.sim.simulator import _expert_ranks
    from hetshard.solver.variants import speed_placement
    profile = _profile(layers=2, experts=8)
    cluster = Cluster.load("a100-v100-x16")
    st = Stage(0, profile.num_layers, (6, 7, 8, 9), "A100-80GB+V100-32GB",
               (("expert", 4),))
    counts = speed_placement(st, cluster, 8, "float16")
    assert counts == (3, 3, 1, 1)  # 312 vs 125 TFLOP/s in float16: 2.86 vs 1.14 each
    placed = dataclasses.replace(st, experts=counts)
    v100, a100 = device_type("V100-32GB"), device_type("A100-80GB")
    assert _expert_ranks(placed, cluster, v100) == (2, 3)
    assert _expert_ranks(placed, cluster, a100) == (0, 1)
    topo = topology(cluster, list(st.devices))

    def cost(gpu, **kw):
        return stage_cost(profile, 0, profile.num_layers, gpu, mbs=2, cal=DEFAULT, ep=4,
                          ep_topo=topo, attention="reference", **kw)
    even, light, heavy = (cost(v100), cost(v100, expert_counts=counts, expert_ranks=(2, 3)),
                          cost(v100, expert_counts=counts, expert_ranks=(0, 1)))
    from hetshard.collectives.experts import moved_experts
    moved = moved_experts(counts)  # rank 1 holds 3 of its own, takes 4 and 5 from rank 2
    assert moved == 2
    gather = sum(collective_time("all_to_all", moved * layer.expert_param_bytes / 8 * 4 / 3,
                                 topo, DEFAULT, "V100-32GB")
                 for layer in profile.layers if layer.experts)
    # the experts go out once a step and their gradients come back once, outside the
    # micro-batches
    assert light.cast_s - even.cast_s == pytest.approx(2 * gather, rel=1e-9)
    assert light.fwd_s < even.fwd_s < heavy.fwd_s
    matmuls = even.fwd_s - light.fwd_s  # half of the grouped matmuls' time
    assert heavy.fwd_s - even.fwd_s == pytest.approx(matmuls, rel=1e-6)
    # stored evenly (2 a rank); for the step a rank holds the 2 experts it was brought
    # and their gradients
    held = sum(2 * 2 * layer.expert_param_bytes / 8 * (
        layer.weight_copy_bytes / layer.param_bytes if layer.weight_copy_bytes else 1)
        for layer in profile.layers if layer.experts)
    assert light.memory_static_bytes - even.memory_static_bytes == pytest.approx(held)
    assert held > 0


def test_routing_skew_reads_a_measured_histogram():
    from hetshard.cost.profile import routing_skew
    assert routing_skew([10, 10, 10, 10]) == 1.0
    assert routing_skew([[10, 10, 10, 10], [40, 0, 0, 0]]) == 4.0
    for bad in ([5], [[1, -1]], [0, 0], [1.0, float("nan")]):
        with pytest.raises(SpecError, match="routing histogram"):
            routing_skew(bad)


@pytest.mark.parametrize("field,value", [("ep_options", ()), ("ep_options", (0,)),
                                         ("capacity_factors", (0.0,)),
                                         ("capacity_factors", ()),
                                         ("router_skew", 0.5)])
def test_bad_expert_planner_options_are_refused(field, value):
    from hetshard.solver import PlannerOptions
    with pytest.raises(SpecError, match=field):
        PlannerOptions(**{field: value})


def test_fix_ep_builds_an_expert_axis_and_refuses_what_does_not_divide():
    from hetshard.solver.uniform import parse_fix, uniform_plan
    profile = _profile(layers=2, experts=4)
    cluster = Cluster.load(A100)
    fix = parse_fix("dp=8,ep=4,mbs=1,capacity=1.5")
    plan = uniform_plan("moe", profile, cluster, global_batch=8, seq_len=16, fix=fix)
    (st,) = plan.pipelines[0].stages
    assert dict(st.mesh_shape)["expert"] == 4 and dict(st.mesh_shape)["data"] == 2
    assert plan.capacity_factor == 1.5
    with pytest.raises(SpecError, match="--fix ep.*divisor of dp=8"):
        uniform_plan("moe", profile, cluster, global_batch=8, seq_len=16,
                     fix=parse_fix("dp=8,ep=3"))
    with pytest.raises(SpecError, match="--fix ep.*divisor of the model's 4 experts"):
        uniform_plan("moe", profile, cluster, global_batch=8, seq_len=16,
                     fix=parse_fix("dp=8,ep=8"))
    with pytest.raises(SpecError, match="--fix capacity"):
        parse_fix("dp=8,ep=2,capacity=0")
    from hetshard.cost.profile import profile_program
    step, args, _ = user_models.make_transformer()
    dense = profile_program(hetshard.Program(step, args))
    with pytest.raises(SpecError, match="no mixture-of-experts layer"):
        uniform_plan("dense", dense, cluster, global_batch=8, seq_len=dense.seq_len,
                     fix=parse_fix("dp=8,ep=2"))


def test_zebra_puts_every_expert_half_on_the_older_type():
    from hetshard.solver import PlannerOptions
    from hetshard.solver.baselines import zebra_candidates
    from hetshard_models import steps
    program = steps.program("deepseekmoe-16b", seq_len=256, dtype="bfloat16")
    from hetshard.cost.profile import profile_program
    halves = profile_program(program, split_blocks=True)
    cluster = Cluster.load("a100-v100-x16")
    plans = zebra_candidates(program.name, halves, cluster, 64, 256,
                             PlannerOptions(mbs_options=(1,), remat_options=("full",)))
    assert plans
    for plan in plans:
        pipe = plan.pipelines[0]
        assert pipe.num_workers == 2 and pipe.virtual_stages == len(pipe.stages) // 2
        for st in pipe.stages:
            experts = [halves.layers[i].experts for i in range(st.start, st.end)]
            if st.gpu == "V100-32GB":
                assert experts[0] > 0  # (the head rides with the last expert half)
            else:
                assert st.gpu == "A100-80GB" and not any(experts)


def _mixtral_on_a100_v100():
    """Mixtral-8x7B's float16 step (shape-only, 4096 tokens) and two A100 nodes and two
    V100 nodes, 100 Gb/s between the types."""
    from hetshard_models import steps
    group = {"nodes": 2, "gpus_per_node": 8}
    return (steps.program("mixtral-8x7b", seq_len=4096, dtype="float16"),
            Cluster.load({"name": "a100+v100-x32", "inter_group_gbs": 12.5, "groups": [
                {"name": "a100", "gpu": "A100-80GB", **group},
                {"name": "v100", "gpu": "V100-32GB", **group}]}))


@pytest.mark.slow
def test_the_planner_chooses_expert_parallelism_where_experts_are_large():
    """Mixtral-8x7B (45 B of its 46.7 B parameters in experts) on two A100 nodes and two
    V100 nodes, planned shape-only: the plan gives its stages an expert axis and fits;
    without expert parallelism (ep_options=(1,)) the best plan is slower or does not
    fit."""
    import warnings

    from hetshard.solver import PlannerOptions, make_plan
    program, cluster = _mixtral_on_a100_v100()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (limits a loaded machine still finishes the search in: a search cut short
        # may keep a worse plan)
        plan = make_plan(program, cluster, global_batch=256, shardings=False,
                         options=PlannerOptions(time_limit_s=40))
        without = make_plan(program, cluster, global_batch=256, shardings=False,
                            options=PlannerOptions(time_limit_s=40, ep_options=(1,)))
    assert plan.predicted.fits
    assert any(st.axis("expert") > 1 for p in plan.pipelines for st in p.stages)
    assert not any(st.axis("expert") > 1 for p in without.pipelines for st in p.stages)
    assert not without.predicted.fits or \
        without.predicted.step_time_s > plan.predicted.step_time_s


@pytest.mark.slow
def test_the_planner_places_large_experts_unevenly_under_a_skewed_router():
    """Mixtral-8x7B on two A100 nodes and two V100 nodes, planned shape-only with a
    measured routing histogram whose first two experts take 3x the tokens: the plan
    runs its stages expert-parallel with an uneven placement (the busy experts' rank
    holding fewer), fits, and is faster than the same plan with its experts split
    evenly."""
    import warnings

    from hetshard.solver import PlannerOptions, make_plan
    from hetshard.solver.evaluator import Evaluator
    from hetshard.solver.variants import even_experts
    program, cluster = _mixtral_on_a100_v100()
    hist = (3, 3, 1, 1, 1, 1, 1, 1)
    options = PlannerOptions(time_limit_s=120, routing_histogram=hist)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(program, cluster, global_batch=256, shardings=False,
                         options=options)
    assert plan.predicted.fits
    placed = [st.experts for p in plan.pipelines for st in p.stages if st.axis("expert") > 1]
    assert placed and all(len(set(c)) > 1 and c[0] < c[-1] for c in placed)
    from hetshard.cost.calibration import DEFAULT
    from hetshard.cost.profile import profile_program
    profile = dataclasses.replace(profile_program(program, split_blocks=plan.split_blocks),
                                  expert_loads=tuple(x / 12 for x in hist))
    even = Evaluator(profile, cluster, DEFAULT, options).price(even_experts(plan))
    assert even.result.step_time_s > 1.1 * plan.predicted.step_time_s


def test_auxiliary_loss_free_balancing_runs_expert_parallel(monkeypatch):
    """DeepSeek-V3's router bias (state nudged each step from the whole batch's expert
    loads, outside the gradient) under data 2 x EP 4: the losses and the biases after
    three steps equal one device's, and the biases did move."""
    kw = dict(dispatch="dropless", k=2, layers=2, balance="bias")
    step, args, batches = user_models.make_moe(**kw)
    want = _train(nnx.jit(step), args, batches, steps=3)
    want_bias = [np.asarray(b.moe.bias[...]) for b in args[0].blocks]
    step, args, batches = user_models.make_moe(**kw)
    plan = _one_stage(hetshard.Program(step, args), (("data", 2), ("expert", 4)))
    calls = _spy(monkeypatch)
    got = _train(hetshard.jit(step, cluster=A100, plan=plan), args, batches, steps=3)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert calls == [(1, 1, 1, 1)] * 2
    for block, bias in zip(args[0].blocks, want_bias, strict=True):
        np.testing.assert_allclose(np.asarray(block.moe.bias[...]), bias, atol=1e-7)
    assert any(np.abs(b).max() > 0 for b in want_bias)


def test_a_measured_histogram_prices_ranks_by_their_tokens_and_balances_them():
    """Per-expert loads price each rank by the tokens its experts take
    (``rank_load``), and ``balanced_placement`` (contiguous runs, at least one expert a
    rank) minimises the busiest rank, as a brute force over every split finds."""
    import itertools

    from hetshard.cost.stage import balanced_placement, rank_load
    loads = [8, 1, 1, 1, 1, 1, 1, 2]
    assert rank_load(8, 4, (), loads) == pytest.approx(9 / 4)  # even: 8+1 on rank 0
    assert rank_load(8, 4, (1, 3, 2, 2), loads) == pytest.approx(8 / 4)
    assert rank_load(8, 4, (1, 3, 2, 2), loads, ranks=(1,)) == pytest.approx(3 / 4)
    assert rank_load(8, 4, (3, 3, 1, 1)) == 1.5  # uniform loads: the share of experts
    def busiest(counts, loads):
        ends = np.cumsum(counts)
        return max(sum(loads[e - c:e]) for c, e in zip(counts, ends, strict=True))
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(2, 9))
        ep = int(rng.integers(1, n + 1))
        loads = rng.integers(0, 20, n).tolist()
        got = balanced_placement(loads, ep)
        assert sum(got) == n and len(got) == ep and min(got) >= 1
        best = min(busiest([b - a for a, b in zip((0, *cut), (*cut, n), strict=True)], loads)
                   for cut in itertools.combinations(range(1, n), ep - 1))
        assert busiest(got, loads) == best


def test_a_skewed_router_gets_its_experts_placed_to_balance_the_ranks_where_it_pays():
    """DeepSeekMoE-16B (64 experts, four of them taking 8x the tokens) on two 8-A100
    stages of data 4 x EP 2: the placement search (``Evaluator.experts``) prices the
    even split (rank 0 busiest: 60 of 92 shares) against the balanced one (18 and 46
    experts, 46 shares each), whose rank 1 is brought the 14 experts a layer it lacks
    once a step: the balanced one is within 1% of the same plan without skew, holding
    the brought experts and their gradients for the step. It is kept (its state sharded
    to fit)."""
    from hetshard.cost.calibration import DEFAULT
    from hetshard.cost.profile import profile_program
    from hetshard.cost.stage import rank_load
    from hetshard.solver import PlannerOptions
    from hetshard.solver.evaluator import Evaluator
    from hetshard.solver.uniform import parse_fix, uniform_plan
    from hetshard.solver.variants import balanced_experts
    from hetshard_models import steps
    program = steps.program("deepseekmoe-16b", seq_len=4096, dtype="bfloat16")
    cluster = Cluster.load("dgx-a100-80gb-x16")
    hist = (8.0,) * 4 + (1.0,) * 60
    loads = tuple(x / sum(hist) for x in hist)
    flat = profile_program(program)
    profile = dataclasses.replace(flat, expert_loads=loads)
    plan = uniform_plan(program.name, profile, cluster, global_batch=256, seq_len=4096,
                        fix=parse_fix("dp=8,pp=2,ep=2,mbs=1,remat=full"))
    assert rank_load(64, 2, (), loads) == pytest.approx(60 / 46)
    placed = balanced_experts(plan, loads, 2)
    assert [st.experts for st in placed.pipelines[0].stages] == [(18, 46)] * 2
    ev = Evaluator(profile, cluster, DEFAULT, PlannerOptions(ep_options=(2,),
                                                             routing_histogram=hist))
    even, balanced = ev.price(plan), ev.price(placed)
    assert balanced.result.step_time_s < even.result.step_time_s
    # neither fits 80 GB: the search keeps the balanced placement with the state
    # sharded inside the data ways (fsdp 4 x expert 2), which does
    assert not even.result.fits and not balanced.result.fits
    chosen = ev.experts(even)
    assert chosen.result.fits and [(st.axis("fsdp"), st.experts) for st in
                                   chosen.plan.pipelines[0].stages] == [(4, (18, 46))] * 2
    unskewed = Evaluator(flat, cluster, DEFAULT, PlannerOptions()).price(plan)
    assert even.result.step_time_s > 1.05 * unskewed.result.step_time_s
    assert balanced.result.step_time_s == pytest.approx(unskewed.result.step_time_s,
                                                        rel=0.01)
    assert balanced.result.step_time_s > unskewed.result.step_time_s  # (the moves)
    assert balanced.result.peak_memory_bytes > even.result.peak_memory_bytes


def test_an_uneven_placement_moves_only_the_experts_a_rank_lacks():
    """``relayout``: for random placements of 8 experts on 4 ranks, each rank's slots,
    from its even shard and what each shift's ppermute brings, are its own experts in
    order; what moves is only what a rank lacks (none for an even placement)."""
    from hetshard.collectives.experts import moved_experts, relayout
    rng = np.random.default_rng(1)
    shards = np.arange(8).reshape(4, 2)  # rank q stores experts 2q, 2q + 1
    assert moved_experts((2, 2, 2, 2)) == 0 and moved_experts((3, 1, 2, 2)) == 1
    for _ in range(30):
        cuts = np.sort(rng.choice(np.arange(0, 9), 3))
        counts = tuple(int(c) for c in np.diff(np.concatenate([[0], cuts, [8]])))
        plan = relayout(counts)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        for r in range(4):
            parts = [shards[r]]
            for d, send in plan.shifts:
                src = r + d
                parts.append(shards[src][send[src]] if 0 <= src < 4 else
                             np.full(send.shape[1], -1))
            got = np.concatenate(parts)[plan.take[r]]
            assert list(got[:counts[r]]) == list(range(first[r], first[r] + counts[r]))


@pytest.mark.parametrize("counts", [(3, 1, 2, 2), (1, 1, 2, 0), (4, 0)])
def test_brought_experts_are_what_each_rank_lacks_and_their_gradients_go_home(counts):
    """``brought_experts``: ``bring`` gives each rank of the expert axis the experts of
    its placement it does not store (even storage: 2 a rank), which with its own shard
    make its experts in order; ``give_back`` is its transpose, so each brought
    expert's gradient returns to the rank storing it (added once; experts nobody
    brings get none)."""
    from jax.sharding import Mesh

    from hetshard.collectives.experts import brought_experts, relayout
    ranks, e = len(counts), sum(counts)
    mesh = Mesh(np.array(jax.devices()[:2 * ranks]).reshape(2, ranks), ("data", "expert"))
    bring, give_back = brought_experts(counts, mesh)
    w = np.arange(e * 3, dtype=np.float32).reshape(e, 3) + 1
    got = np.asarray(bring(w))
    plan, s = relayout(counts), e // ranks
    assert got.shape == (ranks * plan.moved, 3)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    for r in range(ranks):
        mine = np.concatenate([w[r * s:(r + 1) * s], got[r * plan.moved:(r + 1) * plan.moved]])
        np.testing.assert_array_equal(mine[plan.take[r][:counts[r]]],
                                      w[first[r]:first[r] + counts[r]])
    g = np.zeros_like(got)
    wanted = np.zeros(e, bool)
    for r in range(ranks):  # a gradient on each expert rank r uses from the brought ones
        for slot in range(counts[r]):
            j = plan.take[r][slot] - s
            if j >= 0:
                g[r * plan.moved + j] = first[r] + slot + 1
                wanted[first[r] + slot] = True
    back = np.asarray(give_back(g))
    for x in range(e):
        np.testing.assert_array_equal(back[x], np.full(3, x + 1.0) if wanted[x] else 0.0)
    elsewhere = [x for r in range(ranks) for x in range(first[r], first[r] + counts[r])
                 if x // s != r]  # the experts a rank holds but another stores
    assert list(np.flatnonzero(wanted)) == elsewhere and elsewhere


def test_a_layer_the_rewrite_cannot_reach_is_said_and_still_trains(monkeypatch):
    """A dropless layer called through ``nnx.remat`` (a checkpoint body the step keeps)
    is found, but the exchange cannot replace it: an expert-parallel plan warns, naming
    how many layers run without it, and the step still equals one device."""
    import warnings

    call = user_models.MoE.__call__
    monkeypatch.setattr(user_models.MoE, "__call__", lambda self, x: nnx.remat(call)(self, x))
    kw = dict(dispatch="dropless", k=2, layers=2)
    want = _train(nnx.jit(user_models.make_moe(**kw)[0]), *user_models.make_moe(**kw)[1:])
    step, args, batches = user_models.make_moe(**kw)
    program = hetshard.Program(step, args)
    assert [layer.level != () for layer in program.moe_layers] == [True, True]
    plan = _one_stage(program, (("data", 2), ("expert", 4)))
    calls = _spy(monkeypatch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _train(hetshard.jit(step, cluster=A100, plan=plan), args, batches)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert calls == []
    assert any("2 of" in str(w.message) and "without the all-to-all" in str(w.message)
               for w in seen)


def test_the_planner_offers_no_expert_axis_for_layers_the_exchange_cannot_run(monkeypatch):
    """The layers of ``test_a_layer_the_rewrite_cannot_reach...`` are priced as having
    no experts to split (``Program.moe_traffic``'s ``parallel``), so the planner's
    search gives no stage an expert axis for them."""
    from hetshard.cost.profile import profile_program
    from hetshard.solver.options import ep_ways
    call = user_models.MoE.__call__
    monkeypatch.setattr(user_models.MoE, "__call__", lambda self, x: nnx.remat(call)(self, x))
    step, args, _ = user_models.make_moe(dispatch="dropless", k=2, layers=2)
    program = hetshard.Program(step, args)
    assert [info["parallel"] for info in program.moe_traffic] == [False, False]
    profile = profile_program(program)
    assert not any(layer.experts for layer in profile.layers)
    assert ep_ways(profile, (2, 4), 8, 1, 1, 8) == 1
    monkeypatch.undo()  # (the layer called plainly: the exchange reaches it)
    reachable = profile_program(hetshard.Program(*user_models.make_moe(layers=2)[:2]))
    assert ep_ways(reachable, (2, 4), 8, 1, 1, 8) == 4
