"""Context parallelism across GPU generations: speed-proportional chunks, their pricing,
and the planner choosing a context group that spans GPU types for a long sequence."""

import dataclasses

import pytest

from hetshard._plan import Context
from hetshard.cluster import Cluster
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.profile import profile_program
from hetshard.errors import SpecError
from hetshard.sim import simulate
from hetshard.solver import PlannerOptions, make_plan
from hetshard.solver.context import (
    CHUNK_GRANULE,
    balanced_shares,
    mixed_context_plans,
    speed_chunks,
)
from hetshard_models import steps

SPEC = {"name": "h100-a100-x8", "inter_group_gbs": 50.0, "groups": [
    {"name": "fast", "gpu": "H100-80GB", "nodes": 1, "gpus_per_node": 4,
     "intra_node_gbs": 450.0, "inter_node_gbs": 50.0},
    {"name": "slow", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 4,
     "intra_node_gbs": 300.0, "inter_node_gbs": 50.0}]}
LONG = "gpt:layers=4,hidden=512,heads=8,vocab=1024,seq=65536"


def test_balanced_shares_finish_every_rank_together():
    times = [(1.0, 2.0), (1.0, 2.0), (1.5, 3.0), (1.5, 3.0)]  # (other, attention) each
    shares = balanced_shares(times)
    assert sum(shares) == pytest.approx(4.0)
    ends = [o + s * a for (o, a), s in zip(times, shares, strict=True)]
    assert max(ends) - min(ends) < 1e-9 and shares[0] > 1 > shares[2]
    # A rank too slow for any attention keeps a minimal share; no attention: equal.
    assert balanced_shares([(0.0, 1.0), (5.0, 1.0)])[1] < 0.01
    assert balanced_shares([(1.0, 0.0), (2.0, 0.0)]) == [1.0, 1.0]


def test_speed_chunks_are_proportional_granular_and_cover_the_sequence():
    got = speed_chunks(65536, [3.0, 3.0, 1.0, 1.0])
    assert sum(got) == 65536 and all(c % CHUNK_GRANULE == 0 for c in got)
    assert got[0] == got[1] and got[2] == got[3]
    assert abs(got[0] / got[2] - 3.0) < 0.01
    assert speed_chunks(1024, [1.0, 1e-9, 1e-9, 1e-9]) == (256, 256, 256, 256)  # >= 1 each
    with pytest.raises(SpecError, match="seq_len"):
        speed_chunks(1000, [1.0, 2.0])
    with pytest.raises(SpecError, match="speeds"):
        speed_chunks(1024, [1.0, 0.0])


def _faster(profile, cluster, cp=8):
    """The GPU type of ``cluster`` that prices a layer with a ``cp``-way ring faster (its
    ranks get the longer chunks), and the other one. Which it is follows the measured
    attention rates (``hetshard.cost.stage.ATTENTION_TFLOPS``: on Hopper, the flash kernel
    a ring runs measured far below FlashAttention-2's published rate)."""
    from hetshard.cost.stage import stage_cost
    times = {t.name: sum(dataclasses.astuple(stage_cost(
        profile, 0, profile.num_layers, t, cp=cp, cal=DEFAULT))[:2])
        for t in cluster.device_types}
    fast, slow = sorted(times, key=times.get)
    return fast, slow


def _one_layout(profile, cluster, chunks):
    opts = PlannerOptions(cp_options=(8,), tp_options=(1,), mbs_options=(1,),
                          remat_options=("none",))
    (plan,) = mixed_context_plans(LONG, profile, cluster, global_batch=1, seq_len=65536,
                                  opts=opts, chunks=chunks)
    return plan


def test_uneven_chunks_price_each_type_by_its_share():
    profile = profile_program(steps.program(LONG))
    cluster = Cluster.load(SPEC)
    equal, uneven = (_one_layout(profile, cluster, c) for c in ("equal", "speed"))
    st = uneven.pipelines[0].stages[0]
    assert st.axis("context") == 8 and len(st.devices) == 8
    faster, _ = _faster(profile, cluster)
    first = cluster.gpu_of(st.devices[0]).name  # H100s first
    chunks = uneven.context.chunk_lengths
    assert (chunks[0] > chunks[-1]) == (first == faster)  # the faster type, more tokens
    r_eq = simulate(equal, profile, cluster, DEFAULT)
    r_un = simulate(uneven, profile, cluster, DEFAULT)
    # Equal chunks wait for the slower type; uneven chunks finish about together.
    assert r_un.step_time_s < 0.9 * r_eq.step_time_s
    # Every device holds the longest chunk's attention inputs and outputs (the ring pads
    # each chunk to it): more than with equal chunks, the same on both types.
    h = r_un.memory_per_device[st.devices[0]]
    a = r_un.memory_per_device[st.devices[-1]]
    assert h == pytest.approx(a) and h > r_eq.memory_per_device[st.devices[0]]
    # Far too much on the faster type: it paces the stage instead.
    lean = [30.0] * 4 + [1.0] * 4 if first == faster else [1.0] * 4 + [30.0] * 4
    skewed = dataclasses.replace(uneven, context=Context(8, speed_chunks(65536, lean), True))
    assert simulate(skewed, profile, cluster, DEFAULT).step_time_s > r_un.step_time_s


def _mixed(**kw):
    """(profile, cluster, options, mixed-context plans) of LONG on SPEC."""
    profile = profile_program(steps.program(LONG))
    cluster = Cluster.load(SPEC)
    opts = PlannerOptions(cp_options=(2, 4, 8), tp_options=(1, 2), mbs_options=(1,),
                          remat_options=("full",))
    return profile, cluster, opts, mixed_context_plans(
        LONG, profile, cluster, global_batch=2, seq_len=65536, opts=opts, **kw)


def test_mixed_context_plans_share_every_type_out_evenly():
    profile, cluster, opts, plans = _mixed()
    assert plans
    for p in plans:
        cp = p.context.degree
        for st in p.pipelines[0].stages:
            tp = st.axis("tensor")
            ranks = [st.devices[i] for i in range(0, len(st.devices), tp)]
            for g in range(st.axis("data")):
                group = ranks[g * cp:(g + 1) * cp]
                kinds = [cluster.gpu_of(d).name for d in group]
                assert kinds.count("H100-80GB") == kinds.count("A100-80GB")
        fast = [c for c, d in zip(p.context.chunk_lengths, range(cp), strict=True)]
        assert len(set(fast)) == 2 and sum(fast) == 65536  # two types, two lengths
    equal = _mixed(chunks="equal")[3]
    assert {len(set(p.context.chunk_lengths)) for p in equal} == {1}


def test_layout_moves_keep_a_context_group_across_types_as_it_is():
    """The layout descent re-lays out a pipeline's stages on one GPU group; a stage
    whose context ranks span the types (mixed_context_plans) is not one: no move of it
    is offered (it used to be re-laid out as if its first device's group held it all,
    a plan naming both types on one type's devices)."""
    from hetshard.solver.layouts import moves
    from hetshard.solver.splits import LayerTables
    profile, cluster, _, plans = _mixed()
    tables = LayerTables(profile, cluster, DEFAULT, "flash", True)
    for p in plans:
        assert "+" in p.pipelines[0].stages[0].gpu
        assert list(moves(p, tables, cluster, 8, tp_options=(1, 2, 4), remats=("full",),
                          margin=0.05)) == []


def test_a_long_sequence_makes_the_planner_span_types_with_uneven_chunks():
    # One 64K-token sample per step: no data parallelism, and a pipeline of one
    # micro-batch runs its stages one after the other. A context group over both GPU
    # types, chunks in proportion to their speed, uses all eight at once.
    program = steps.program(LONG)
    cluster = Cluster.load(SPEC)
    opts = PlannerOptions(time_limit_s=20, tp_options=(1, 2), mbs_options=(1,))
    plan = make_plan(program, cluster, global_batch=1, options=opts, shardings=False)
    st = plan.pipelines[0].stages[0]
    assert st.axis("context") > 1
    assert {cluster.gpu_of(d).name for d in st.devices} == {"H100-80GB", "A100-80GB"}
    chunks = plan.context.chunk_lengths
    tp = st.axis("tensor")
    by_type = {}
    for i, d in enumerate(st.devices):
        by_type.setdefault(cluster.gpu_of(d).name, set()).add(
            chunks[(i // tp) % st.axis("context")])
    faster, slower = _faster(profile_program(program), cluster, st.axis("context"))
    assert min(by_type[faster]) > max(by_type[slower])
    # Without context groups spanning types the same search finds a slower plan.
    single = make_plan(program, cluster, global_batch=1, options=dataclasses.replace(
        opts, mixed_context=False), shardings=False)
    assert plan.predicted.tokens_per_s > 1.2 * single.predicted.tokens_per_s


def test_a_mixed_context_plan_from_the_planner_trains_as_one_device():
    # The planner's layout for one context group over 4 H100s and 4 A100s, chunks sized
    # from the priced times, run by hetshard.jit on 8 fake devices: attention over
    # uneven chunks, the layers around it evenly split, losses and weights as one device.
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import hetshard
    import hetshard_models as models
    from hetshard_models import data, losses
    small = "gpt:layers=2,hidden=64,heads=4,vocab=64,seq=64"
    profile = profile_program(steps.program(small))
    cluster = Cluster.load(SPEC)
    opts = PlannerOptions(cp_options=(8,), tp_options=(1,), mbs_options=(1,),
                          remat_options=("none",), context_min_seq=64, attention="reference")
    (plan,) = mixed_context_plans(small, profile, cluster, global_batch=2, seq_len=64,
                                  opts=opts, granule=2)
    chunks = plan.context.chunk_lengths
    assert len(set(chunks)) == 2 and chunks[0] > chunks[-1]  # H100s attend more
    plan = dataclasses.replace(plan, fingerprint="")
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, 2, 64, 64) for _ in range(2)]

    def train(pinned):
        model = models.build(small, rngs=0)
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        def step(model, optimizer, batch):
            grad = hetshard.value_and_grad if pinned else nnx.value_and_grad
            loss, grads = grad(losses.text_loss)(model, batch)
            optimizer.update(model, grads)
            return loss
        run = hetshard.jit(step, cluster=SPEC, plan=plan) if pinned else nnx.jit(step)
        out = [float(run(model, opt, batches[i % 2])) for i in range(3)]
        return out, jax.tree.leaves(nnx.state(model, nnx.Param))
    got, got_params = train(True)
    want, want_params = train(False)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_params, want_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
