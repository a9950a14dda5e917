"""Named remat policies (hetshard.remat): projection roles, read the same way by the cost
model's traced graph and the runtime's jaxpr, priced between none and full, searched per
stage by the planner, and refused by name where unknown."""

import collections
import dataclasses

import pytest
import user_models

import hetshard
import hetshard_models as models
from hetshard._plan import Plan
from hetshard.cluster import Cluster
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.stage import stage_cost
from hetshard.errors import SpecError
from hetshard.ir.program import reduced_graph
from hetshard.remat import (
    ATTENTION,
    OTHER,
    POLICIES,
    REMATS,
    WEIGHT,
    check_remat,
    projection_roles,
)
from hetshard.rewrite.pipeline import equation_roles, split_stages
from hetshard.solver.inter_op import plan as inter_op_plan
from hetshard.solver.options import PlannerOptions
from hetshard.solver.uniform import parse_fix, uniform_plan

SWIGLU = ("gpt:layers=3,hidden=64,heads=4,vocab=128,seq=32,mlp=swiglu,norm=rmsnorm,"
          "pos=rope,tied=false,bias=false")


def test_projection_roles_of_a_llama_block():
    # norm -> q, k, v -> rope(q) -> attention -> reshape -> wo -> add -> norm -> gate, up
    # -> silu * up -> down -> add
    nodes = [
        (OTHER, []),            # 0 norm
        (WEIGHT, [0]),          # 1 q
        (WEIGHT, [0]),          # 2 k
        (WEIGHT, [0]),          # 3 v
        (OTHER, [1]),           # 4 rope(q)
        (ATTENTION, [4, 2, 3]),  # 5
        (OTHER, [5]),           # 6 reshape
        (WEIGHT, [6]),          # 7 wo
        (OTHER, [7]),           # 8 residual add
        (OTHER, [8]),           # 9 norm
        (WEIGHT, [9]),          # 10 gate
        (WEIGHT, [9]),          # 11 up
        (OTHER, [10, 11]),      # 12 silu(gate) * up
        (WEIGHT, [12]),         # 13 down
        (OTHER, [8, 13]),       # 14 residual add
    ]
    roles = projection_roles([k for k, _ in nodes], [p for _, p in nodes])
    assert roles == {1: "qkv", 2: "qkv", 3: "qkv", 7: "attn_out", 10: "mlp_in",
                     11: "mlp_in"}
    # Paths stop at projections: the down projection's output reaches no attention and
    # no projection (the q projection of a layer after it would be another layer's).
    chained = projection_roles([WEIGHT, OTHER, WEIGHT, ATTENTION], [[], [0], [1], [2]])
    assert chained == {2: "qkv", 0: "mlp_in"}


@pytest.mark.parametrize("which", ["zoo_swiglu", "einsum_attention", "flax_mha"])
def test_the_cost_model_and_the_runtime_find_the_same_projections(which):
    # The traced graph the planner prices and the jaxpr the runtime re-evaluates (the
    # pipeline rewrite's split, as PipelineRunner makes it) give each block the same
    # projections: q, k, v; the attention output; the MLP's input(s).
    if which == "zoo_swiglu":
        program = models.program(SWIGLU, batch=2)
        want = {"qkv": 3, "attn_out": 1, "mlp_in": 2}
    else:
        make = {"einsum_attention": user_models.make_transformer,
                "flax_mha": user_models.make_flax_attention}[which]
        step, args, _ = make()
        program = hetshard.Program(step, args)
        want = {"qkv": 3, "attn_out": 1, "mlp_in": 1}
    graph, lay, _, _ = reduced_graph(program, 2)
    roles = graph.projection_roles()
    for k, name in enumerate(lay.names[:3]):
        priced = collections.Counter(r for op in graph.ops if op.layer == name and
                                     (r := roles.get(op.index)) is not None)
        assert priced == (want if lay.stacks[k] >= 0 else {}), name
    split = split_stages(program.loss_flat, program.state_avals, program.trees.batch_at(2),
                         [(0, len(lay.names))], program.diff)
    jaxpr = split.closed.jaxpr
    for k in range(len(lay.names)):
        ids = [i for i, layer in enumerate(split.eqn_layer) if layer == k]
        run = collections.Counter(equation_roles(jaxpr, ids).values())
        assert run == (want if lay.stacks[k] >= 0 else {}), lay.names[k]


def test_named_policies_are_priced_between_none_and_full():
    prof = models.profile(SWIGLU, 32, "bfloat16")
    gpu = Cluster.load("dgx-a100-80gb-x8").groups[0].gpu
    cost = {r: stage_cost(prof, 1, 3, gpu, mbs=2, remat=r, cal=DEFAULT) for r in REMATS}
    mem = {r: c.memory_per_microbatch_bytes for r, c in cost.items()}
    bwd = {r: c.bwd_s for r, c in cost.items()}
    for r in POLICIES:
        assert mem["full"] < mem[r] < mem["none"], r
        assert bwd["none"] < bwd[r] < bwd["full"], r
    # Keeping more projections keeps more bytes and recomputes less.
    for small, big in (("save_qkv", "save_qkv_out"), ("save_qkv", "save_qkv_mlp"),
                       ("save_qkv_out", "save_qkv_out_mlp"),
                       ("save_qkv_mlp", "save_qkv_out_mlp")):
        assert mem[small] < mem[big] and bwd[small] > bwd[big], (small, big)
        assert cost[small].hardware_flops > cost[big].hardware_flops
    # Everything selective keeps but the MLP's output projection, whose output no
    # backward reads (a residual add's): the same bytes and recomputation.
    assert mem["save_qkv_out_mlp"] == pytest.approx(mem["selective"])
    assert cost["save_qkv_out_mlp"].hardware_flops == pytest.approx(
        cost["selective"].hardware_flops)


def test_the_planner_searches_named_policies_per_stage():
    # llama-7b at 4K on 16 GB GPUs: without a named policy the stages recompute whole
    # layers; offered, the planner keeps q, k, v and the MLP inputs and is faster.
    prof = models.profile("llama-7b", 4096, "bfloat16")
    cluster = Cluster.load("amp-t4-v100")
    plans = {}
    for key, remats in (("plain", ("none", "full")),
                        ("named", ("none", "save_qkv", "save_qkv_mlp", "full"))):
        plans[key] = inter_op_plan("llama-7b", prof, cluster, global_batch=64, seq_len=4096,
                                   options=PlannerOptions(remat_options=remats,
                                                          time_limit_s=60))
    used = {s.remat for p in plans["named"].pipelines for s in p.stages}
    assert used & set(POLICIES), used
    assert plans["named"].predicted.step_time_s < plans["plain"].predicted.step_time_s


@pytest.mark.parametrize("where", ["plan", "fix", "options", "stage_cost", "check"])
def test_an_unknown_remat_name_is_refused_naming_the_field(where):
    prof = models.profile(SWIGLU, 32, "float32")
    gpu = Cluster.load("dgx-a100-80gb-x8").groups[0].gpu
    with pytest.raises(SpecError, match=r"save_kv.*one of \('none', 'selective', "
                                        r"'save_qkv'") as e:
        if where == "plan":
            plan = Plan.from_dict(_a_plan())
            pipe = plan.pipelines[0]
            stage = dataclasses.replace(pipe.stages[0], remat="save_kv")
            Plan.from_dict(dataclasses.replace(plan, pipelines=(dataclasses.replace(
                pipe, stages=(stage, *pipe.stages[1:])),)).to_dict())
        elif where == "fix":
            parse_fix("dp=8,remat=save_kv")
        elif where == "options":
            PlannerOptions(remat_options=("none", "save_kv"))
        elif where == "stage_cost":
            stage_cost(prof, 0, 2, gpu, mbs=1, remat="save_kv", cal=DEFAULT)
        else:
            check_remat("save_kv")
    assert "remat" in str(e.value)


def _a_plan() -> dict:
    prof = models.profile(SWIGLU, 32, "float32")
    return uniform_plan("m", prof, Cluster.load("dgx-a100-80gb-x8"), global_batch=8,
                        seq_len=32, fix=parse_fix("dp=8,tp=1,pp=1")).to_dict()


def test_explain_keeps_its_columns_aligned_under_a_named_policy():
    plan = Plan.from_dict(_a_plan())
    pipe = plan.pipelines[0]
    stage = dataclasses.replace(pipe.stages[0], remat="save_qkv_out_mlp")
    plan = dataclasses.replace(plan, pipelines=(dataclasses.replace(pipe, stages=(stage,)),))
    lines = plan.explain().splitlines()
    header = next(line for line in lines if "remat" in line and "attn" in line)
    row = next(line for line in lines if "save_qkv_out_mlp" in line)
    # the remat column ends where its header does, the columns after it too
    assert row.index("save_qkv_out_mlp") + len("save_qkv_out_mlp") == \
        header.index("remat") + len("remat")
    assert len(row) == len(header)
