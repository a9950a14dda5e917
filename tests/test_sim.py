import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetshard.cli import main
from hetshard.cluster import Cluster
from hetshard.cost.profile import profile_model
from hetshard.errors import SpecError, SpecParseError
from hetshard.plan import Context, GradSync, Pipeline, Plan, Predicted, SolverStats, Stage
from hetshard.sim import chrome_trace, simulate, write_timeline_png
from hetshard.sim.simulator import annotate, inflight, run_pipeline, schedule_order
from hetshard.solver.uniform import parse_fix, stage_bounds, uniform_plan

SPEC = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (4, 4), (4, 8), (3, 2)])
def test_equal_stages_take_m_plus_p_minus_1_slots(schedule, p, m):
    tf, tb = 1.0, 2.0
    events, free = run_pipeline([tf] * p, [tb] * p, [0.0] * (p - 1), m, schedule)
    assert max(free) == pytest.approx((m + p - 1) * (tf + tb))
    assert len(events) == 2 * p * m
    # No stage runs two tasks at once.
    for s in range(p):
        spans = sorted((a, b) for st_, _, _, a, b in events if st_ == s)
        assert all(b1 <= a2 + 1e-12 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False))


def test_transfers_delay_the_pipeline():
    _, free = run_pipeline([1.0, 1.0], [1.0, 1.0], [0.5], 1, "1f1b")
    assert max(free) == pytest.approx(1 + 0.5 + 1 + 1 + 0.5 + 1)


def test_1f1b_holds_fewer_micro_batches_than_gpipe():
    assert schedule_order("1f1b", 4, 0, 6)[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)]
    assert [inflight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert inflight("gpipe", 4, 0, 8) == 8


@pytest.fixture(scope="module")
def prof():
    return profile_model(SPEC, 32, "float32")


def test_uniform_plan_simulates_and_exports(prof, tmp_path):
    c = Cluster.load("h100-a100-v100-x8")
    plan = uniform_plan(SPEC, prof, c, global_batch=16, seq_len=32,
                        fix=parse_fix("dp=2,tp=2,pp=2,mbs=2"), dtype="float32")
    r = simulate(plan, prof, c)
    assert r.step_time_s > 0 and 0 <= r.bubble_fraction < 1 and r.fits
    assert r.tokens_per_s == pytest.approx(16 * 32 / r.step_time_s)
    trace = json.loads(json.dumps(chrome_trace(r)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"][0] for e in spans} >= {"F", "B"}
    assert all({"ts", "dur", "pid", "tid"} <= set(e) for e in spans)
    write_timeline_png(r, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    annotated = annotate(plan, r)
    assert annotated.predicted.step_time_s == r.step_time_s
    assert "pipeline 0" in annotated.explain()


def test_slow_gpus_pace_a_uniform_plan(prof):
    c = Cluster.load("h100-a100-v100-x8")
    plan = uniform_plan(SPEC, prof, c, global_batch=16, seq_len=32,
                        fix=parse_fix("dp=4,tp=1,pp=2,mbs=2"), dtype="float32")
    # Stage 0 mixes H100s and A100s (devices 0-3): one SPMD program runs at the A100's pace.
    assert plan.pipelines[0].stages[0].gpu == "A100-80GB+H100-80GB"
    r = simulate(plan, prof, c)
    s0, s1 = r.stage_costs[0]
    assert s1.fwd_s > 1.5 * s0.fwd_s  # stage 1 sits on V100s (devices 4-7)
    h100 = dataclasses.replace(c, groups=(dataclasses.replace(c.groups[0], nodes=4),))
    fast = simulate(dataclasses.replace(plan, pipelines=(dataclasses.replace(
        plan.pipelines[0], stages=plan.pipelines[0].stages[:1] + (dataclasses.replace(
            plan.pipelines[0].stages[1], devices=(4, 5, 6, 7)),)),)), prof, h100)
    assert fast.step_time_s < r.step_time_s


@pytest.mark.parametrize("fix,match", [
    ("dp=3,tp=1,pp=1", "product equal"),
    ("dp=8,tp=1,pp=1,mbs=3", "multiple of dp"),
    ("dp=1,tp=1,pp=8", "divisor of the model's 4 blocks"),
    ("dp=1,tp=8,pp=1", "divisor of the model's 4 heads"),
])
def test_fix_that_does_not_divide_is_an_error(prof, fix, match):
    c = Cluster.load("h100-a100-v100-x8")
    with pytest.raises(SpecError, match=match):
        uniform_plan(SPEC, prof, c, global_batch=16, seq_len=32, fix=parse_fix(fix))


@pytest.mark.parametrize("text,match", [
    ("dp=2,depth=3", "depth"), ("dp=two", "positive integer"), ("dp=0", "positive integer"),
    ("dp=2,dp=4", "contradictory"), ("remat=some", "remat"), ("fsdp=perhaps", "true or false"),
    ("schedule=zb", "schedule")])
def test_parse_fix_errors(text, match):
    with pytest.raises(SpecError, match=match):
        parse_fix(text)


def test_stage_bounds_put_embed_first_and_head_last(prof):
    assert stage_bounds(prof, 2) == [(0, 3), (3, 6)]
    assert stage_bounds(prof, 4) == [(0, 2), (2, 3), (3, 4), (4, 6)]


def test_simulate_cli_json(capsys, tmp_path):
    trace = tmp_path / "t.json"
    assert main(["simulate", "--model", SPEC, "--cluster", "dgx-a100-80gb-x8",
                 "--global-batch", "16", "--seq-len", "32", "--fix",
                 "dp=2,tp=2,pp=2,fsdp=true,mbs=2,remat=selective", "--trace", str(trace),
                 "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_bytes",
                "fits"):
        assert key in out
    assert Plan.from_dict(out["plan"]).pipelines[0].stages[0].remat == "selective"
    assert json.loads(trace.read_text())["traceEvents"]
    assert main(["simulate", "--model", SPEC, "--cluster", "dgx-a100-80gb-x8",
                 "--global-batch", "16", "--fix", "dp=3"]) == 2
    assert "dp*tp*pp*cp=3" in capsys.readouterr().err


# ---- Plan schema ----------------------------------------------------------------------

@st.composite
def plans(draw):
    n_pipes = draw(st.integers(1, 3))
    layers = draw(st.integers(2, 12))
    pipes, next_dev = [], 0
    for _ in range(n_pipes):
        n_stages = draw(st.integers(1, min(4, layers)))
        cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=n_stages - 1,
                                   max_size=n_stages - 1)))
        bounds = list(zip([0] + cuts, cuts + [layers], strict=True))
        dp = draw(st.integers(1, 2))
        tp = draw(st.sampled_from([1, 2]))
        stages = []
        for a, b in bounds:
            devs = tuple(range(next_dev, next_dev + dp * tp))
            next_dev += dp * tp
            stages.append(Stage(a, b, devs, draw(st.sampled_from(["A100-80GB", "V100-16GB"])),
                                (("data", dp), ("tensor", tp)),
                                draw(st.sampled_from(["none", "selective", "full"])),
                                predicted_fwd_s=draw(st.floats(0, 10))))
        mbs, m = draw(st.integers(1, 4)), draw(st.integers(1, 8))
        pipes.append(Pipeline(tuple(stages), mbs * m * dp, mbs, m,
                              draw(st.sampled_from(["1f1b", "gpipe"]))))
    gb = sum(p.batch_share for p in pipes)
    return Plan(model="gpt-tiny", cluster={"name": "x"}, global_batch=gb, seq_len=64,
                pipelines=tuple(pipes),
                grad_sync=(GradSync(0, layers, tuple(range(next_dev)), (1.0,)),),
                context=Context(2, (40, 24)), fsdp=draw(st.booleans()),
                predicted=Predicted(step_time_s=draw(st.floats(0, 100))),
                solver=SolverStats(1.5, "optimal", 0.0))


@settings(max_examples=50, deadline=None)
@given(plans())
def test_plan_json_round_trip(plan):
    assert Plan.from_json(plan.to_json()) == plan


@settings(max_examples=20, deadline=None)
@given(plans())
def test_what_processes_agree_on_ignores_solver_timing_only(plan):
    timed = dataclasses.replace(plan, solver=SolverStats(99.0, "feasible", 0.25))
    assert timed.what_runs() == plan.what_runs()
    other = dataclasses.replace(plan, fsdp=not plan.fsdp)
    assert other.what_runs() != plan.what_runs()


def test_plan_validation_and_load_errors(tmp_path):
    stage = Stage(0, 4, (0, 1), "A100-80GB", (("data", 2),))
    pipe = Pipeline((stage,), 8, 2, 2)
    plan = Plan("gpt-tiny", {}, 8, 64, (pipe,))
    with pytest.raises(SpecError, match="global_batch=9"):
        dataclasses.replace(plan, global_batch=9)
    with pytest.raises(SpecError, match="product"):
        Plan("gpt-tiny", {}, 8, 64, (Pipeline((dataclasses.replace(
            stage, mesh_shape=(("data", 2), ("tensor", 2))),), 8, 2, 2),))
    with pytest.raises(SpecError, match="no other stage"):
        Plan("gpt-tiny", {}, 16, 64, (pipe, pipe))
    path = tmp_path / "p.json"
    plan.save(path)
    assert Plan.load(path) == plan
    d = plan.to_dict()
    d["version"] = 99
    path.write_text(json.dumps(d))
    with pytest.raises(SpecError, match="version=99"):
        Plan.load(path)
    path.write_text("{bad json")
    with pytest.raises(SpecParseError, match="line 1"):
        Plan.load(path)
