import dataclasses
import itertools
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetshard._plan import (
    SCHEMA_VERSION,
    Context,
    Pipeline,
    Plan,
    Predicted,
    SolverStats,
    Stage,
)
from hetshard.cli import main
from hetshard.cluster import Cluster
from hetshard.cost import comm
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.comm import collective_time, p2p_time, topology
from hetshard.cost.stage import StageCost
from hetshard.errors import SpecError, SpecParseError
from hetshard.remat import REMATS
from hetshard.sim import chrome_trace, simulate, write_timeline_png
from hetshard.sim.schedule import (
    _chunked,
    _order,
    _stalled,
    best_warmup,
    inflight,
    interleaved_warmups,
    run_pipeline,
    schedule_order,
    schedule_walk,
    steady_period,
    time_pipeline,
    worker_order,
)
from hetshard.sim.simulator import _slowest, annotate, layers_cost, worker_memory
from hetshard.solver.uniform import parse_fix, spread, stage_bounds, uniform_plan
from hetshard_models import profile as profile_model

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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 2, 6),
                                   (4, 3, 12), (4, 2, 16)])
def test_interleaved_stages_cut_the_bubble_by_v(schedule, p, v, m):
    # Megatron-LM (Narayanan et al. 2021, sec. 2.2): v stages per submesh, each 1/v of the
    # work, shrink the bubble from (p - 1) to (p - 1) / v slots of (tf + tb).
    tf, tb, n = 1.0 / v, 2.0 / v, p * v
    events, free = run_pipeline([tf] * n, [tb] * n, [0.0] * (n - 1), m, schedule, v)
    assert max(free) == pytest.approx((m + (p - 1) / v) * 3.0)
    assert len(events) == 2 * n * m
    for w in range(p):  # a submesh runs one task at a time, across its stages
        spans = sorted((a, b) for st_, _, _, a, b in events if st_ % p == w)
        assert all(b1 <= a2 + 1e-12 for (_, b1), (a2, _) in zip(spans, spans[1:], strict=False))
    # Every task runs after its inputs: the walk is a topological order.
    seen = set()
    for s_, kind, i in schedule_walk(schedule, n, m, v):
        if kind == "F" and s_:
            assert ("F", s_ - 1, i) in seen
        if kind == "B":
            assert ("F", s_, i) in seen and (s_ == n - 1 or ("B", s_ + 1, i) in seen)
        seen.add((kind, s_, i))


@pytest.mark.parametrize("p,v,m", [(2, 2, 3), (3, 2, 4), (4, 3, 5), (5, 2, 7), (4, 2, 2),
                                   (3, 4, 10)])
def test_interleaved_schedule_with_a_smaller_last_group(p, v, m):
    # Micro-batch counts the p submeshes do not divide: groups of p, then the rest. Every
    # task runs once, after its inputs, one at a time per submesh, and no walk stalls.
    n = p * v
    walk = list(schedule_walk("1f1b", n, m, v))
    assert sorted(walk) == sorted((s, k, i) for s in range(n) for k in "FB" for i in range(m))
    seen = set()
    for s_, kind, i in walk:
        assert kind == "B" or not s_ or (s_ - 1, "F", i) in seen
        assert kind == "F" or ((s_, "F", i) in seen and
                               (s_ == n - 1 or (s_ + 1, "B", i) in seen))
        seen.add((s_, kind, i))
    warm = interleaved_warmups(p, m, v)
    megatron = [min(2 * (p - w - 1) + (v - 1) * p, m * v) for w in range(p)]
    assert all(a >= b for a, b in zip(warm, megatron, strict=True))
    for w in range(p):  # the submesh's order: its forwards group by group, stage by stage
        fwd = [(s_, i) for k, s_, i in worker_order("1f1b", p, w, m, v) if k == "F"]
        assert fwd[:min(p, m)] == [(w, i) for i in range(min(p, m))]
        assert [k for k, _, _ in worker_order("1f1b", p, w, m, v)][:warm[w] + 1] == \
            ["F"] * warm[w] + ["F" if warm[w] < m * v else "B"]
    events, free = run_pipeline([1.0] * n, [2.0] * n, [0.0] * (n - 1), m, "1f1b", v)
    assert len(events) == 2 * n * m and max(free) >= m * v * 3.0


def test_interleaved_warmup_grows_only_where_megatrons_would_stall():
    # Full groups: Megatron-LM's 2 (p - w - 1) + (v - 1) p. Four submeshes of three stages
    # and 5 micro-batches: with that warm-up the last submesh reaches a backward whose
    # input waits on a forward queued behind it; one more forward there resolves it.
    assert interleaved_warmups(4, 8, 3) == (14, 12, 10, 8)
    assert interleaved_warmups(4, 5, 3) == (14, 12, 10, 9)
    orders = [_order("1f1b", _chunked(4, w, 5, 3, False), _chunked(4, w, 5, 3, True),
                     (14, 12, 10, 8)[w]) for w in range(4)]
    assert _stalled(orders, 12, 5) is not None


@pytest.mark.parametrize("p,m,extra", [(2, 4, ()), (4, 8, ()), (4, 16, (2, 1, 1, 0)),
                                       (6, 12, ()), (3, 2, ())])
def test_zero_bubble_schedule_order(p, m, extra):
    # ZB-H1: every backward as B then W, each W after its own B on the same submesh; a
    # stage holds at most p - s + extra[s] micro-batches whose W has not run; the walk
    # is a topological order.
    walk = list(schedule_walk("zbh1", p, m, 1, extra))
    assert sorted(walk) == sorted((s, k, i) for s in range(p) for k in "FBW" for i in range(m))
    for s in range(p):
        order = worker_order("zbh1", p, s, m, 1, extra)
        held = peak = 0
        for k, _, i in order:
            held += {"F": 1, "B": 0, "W": -1}[k]
            peak = max(peak, held)
            if k == "W":
                assert order.index(("B", s, i)) < order.index(("W", s, i))
        assert peak <= p - s + (extra[s] if extra else 0)
    seen = set()
    for s_, kind, i in walk:
        if kind == "F":
            assert not s_ or (s_ - 1, "F", i) in seen
        elif kind == "B":
            assert (s_, "F", i) in seen and (s_ == p - 1 or (s_ + 1, "B", i) in seen)
        seen.add((s_, kind, i))


def test_zero_bubble_shrinks_the_bubble():
    # Equal forward, B and W: 1F1B idles (p - 1) (F + B + W); ZB-H1 sends each B back at
    # once and runs W passes in 1F1B's idle time: (p - 1) (F + B) here, with 1F1B's
    # micro-batches in flight (the paper's ZB-H1 gets to (p - 1) F by holding p on every
    # stage, more memory than 1F1B's later stages hold).
    p, m = 4, 32
    one = max(run_pipeline([1.0] * p, [2.0] * p, [0.0] * (p - 1), m, "1f1b")[1])
    _, free, _ = time_pipeline([1.0] * p, [2.0] * p, [0.0] * (p - 1), m, "zbh1",
                               weight_s=[1.0] * p)
    assert one == pytest.approx(3 * (m + p - 1))
    assert max(free) == pytest.approx(3 * m + (p - 1) * 2)
    # No W (bwd_weight_s = 0): the B pass is the whole backward, as in 1F1B.
    _, free0, _ = time_pipeline([1.0] * p, [2.0] * p, [0.0] * (p - 1), m, "zbh1",
                                weight_s=[0.0] * p)
    assert max(free0) >= one - 1e-9


def test_zero_bubble_memory_keeps_activations_and_carry_until_w():
    # Activations 1 per micro-batch from F to W; from B to W also what W reads from B
    # (0.25) and the cotangent sent back (0.125). The first stage's B makes nothing (its
    # whole backward is W), but it holds the cotangent it received.
    cost = StageCost(1.0, 2.0, 0.0, 0.0, 0.0, 0.0, memory_static_bytes=10.0,
                     memory_per_microbatch_bytes=1.0, memory_working_bytes=0.5,
                     bwd_weight_s=1.0, memory_carry_bytes=0.25,
                     memory_cotangent_bytes=0.125)
    costs = [cost] * 4
    for w in range(4):
        held = 0.125 + (0.25 if w else 0.0)
        live = peak = 0.0
        for k, _, _ in worker_order("zbh1", 4, w, 8):
            live += {"F": 1.0, "B": held, "W": -1.0 - held}[k]
            peak = max(peak, live)
        assert worker_memory("zbh1", 4, w, 8, 1, costs) == pytest.approx(10 + peak + 0.5)
    # First stage: at most 4 micro-batches before their W (1F1B's p), one of them past B.
    assert worker_memory("zbh1", 4, 0, 8, 1, costs) == pytest.approx(10 + 4 + 0.125 + 0.5)


def test_interleaved_order_and_memory_in_flight():
    # Submesh 0 of 2 with 2 stages each (stages 0 and 2), 4 micro-batches: groups of p=2
    # micro-batches per stage, 2 (p - 1) + (v - 1) p = 4 warm-up forwards.
    order = worker_order("1f1b", 2, 0, 4, 2)
    assert order[:5] == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("F", 0, 2)]
    assert order[5] == ("B", 2, 0)  # backwards start from the submesh's last stage
    assert sorted(order) == sorted((k, s, i) for k in "FB" for s in (0, 2) for i in range(4))

    # Static 10 per stage, 1 per micro-batch in flight, working set 0.5.
    cost = StageCost(1.0, 2.0, 0.0, 0.0, 0.0, 0.0, memory_static_bytes=10.0,
                     memory_per_microbatch_bytes=1.0, memory_working_bytes=0.5)
    costs = [cost] * 4
    assert worker_memory("1f1b", 2, 0, 4, 2, costs) == 20 + 5 + 0.5  # 4 warm-up + 1
    assert worker_memory("gpipe", 2, 0, 4, 2, costs) == 20 + 8 + 0.5  # everything
    # One stage per submesh: the classic 1F1B count p - s.
    assert worker_memory("1f1b", 4, 1, 8, 1, costs) == 10 + 3 + 0.5


def test_extra_warmup_hides_a_slow_link():
    # Two stages of 2 time units per micro-batch, a 2-unit transfer each way: 1F1B's loop
    # (2 micro-batches in flight on stage 0) takes 8 units per 2 micro-batches; one or two
    # extra warm-up forwards on stage 0 let the stages run at their own pace.
    steps = [max(run_pipeline([1.0, 1.0], [1.0, 1.0], [2.0], 20, "1f1b", 1, (k, 0))[1])
             for k in range(4)]
    assert steps[0] == pytest.approx(82.0)
    assert steps[2] == pytest.approx(20 * 2.0 + 6.0) and steps[3] == steps[2]
    assert steps[0] > steps[1] > steps[2]
    # Warm-up on the last stage as well only delays the loop's backward: no gain.
    assert max(run_pipeline([1.0, 1.0], [1.0, 1.0], [2.0], 20, "1f1b", 1, (2, 1))[1]) > \
        steps[2]
    assert inflight("1f1b", 2, 0, 20, (2, 0)) == 4


@pytest.mark.parametrize("times,sends,extra", [
    ([3.0, 3.0, 3.0, 3.0], [0.1, 0.1, 0.1], ()),  # compute bound
    ([1.0, 2.0, 3.0, 3.0], [0.1, 4.0, 0.1], ()),  # a slow middle link binds on its own
    ([1.0, 2.0, 3.0, 3.0], [0.1, 4.0, 0.1], (2, 2, 0, 0)),
    ([2.0, 1.0, 2.5], [1.5, 1.5], (1, 1, 0)),
    ([3.0, 1.0, 1.0, 1.0, 2.0], [0.0, 3.0, 0.0, 2.0], (3, 2, 1, 1, 0)),
])
def test_steady_period_is_the_simulated_slope(times, sends, extra):
    # The max cycle mean of the schedule's event graph is the time each further
    # micro-batch adds once the pipeline is in steady state.
    def step(m):
        f = [t / 3 for t in times]
        return max(run_pipeline(f, [t - x for t, x in zip(times, f, strict=True)], sends, m,
                                 "1f1b", 1, extra)[1])
    assert (step(150) - step(90)) / 60 == pytest.approx(steady_period(times, sends, extra),
                                                       rel=1e-6)


def test_best_warmup_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(60):
        p = int(rng.integers(1, 5))
        times = rng.uniform(1, 4, p)
        sends = rng.uniform(0, 4, p - 1) * (rng.random(p - 1) < 0.7)
        rooms = [int(x) for x in rng.integers(0, 4, p)]
        period, extra = best_warmup(times, sends, rooms)
        extra = extra or (0,) * p
        assert all(0 <= e <= r for e, r in zip(extra, rooms, strict=True))
        assert all(b <= a + 1 for a, b in zip(extra, extra[1:], strict=False))
        assert period == pytest.approx(steady_period(times, sends, extra))
        brute = min(steady_period(times, sends, ex)
                    for ex in itertools.product(range(5), repeat=p)
                    if all(e <= r for e, r in zip(ex, rooms, strict=True)) and
                    all(b <= a + 1 for a, b in zip(ex, ex[1:], strict=False)))
        assert period == pytest.approx(brute, rel=1e-5)


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
                        fix=parse_fix("dp=2,tp=2,pp=2,mbs=2"))
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
    # ZB-H1: W passes in the trace and the timeline; the first stage's whole backward is W.
    zb = uniform_plan(SPEC, prof, c, global_batch=16, seq_len=32,
                      fix=parse_fix("dp=2,tp=2,pp=2,mbs=2,schedule=zbh1"))
    rz = simulate(zb, prof, c)
    spans = [e for e in chrome_trace(rz)["traceEvents"] if e["ph"] == "X"]
    assert {e["name"][0] for e in spans} >= {"F", "B", "W"}
    b0 = [t for t in rz.tasks if t.kind == "B" and t.stage == 0]
    assert b0 and all(t.end_s == t.start_s for t in b0)
    write_timeline_png(rz, tmp_path / "z.png", plan=zb)
    assert (tmp_path / "z.png").read_bytes()[:4] == b"\x89PNG"
    assert "zbh1" in annotate(zb, rz).explain()
    _slices_nest_per_thread(chrome_trace(rz, zb))


def _slices_nest_per_thread(trace):
    """Perfetto draws slices of one thread as a stack: any two must be disjoint or one
    inside the other. Threads are named by GPU type."""
    spans = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["dur"] > 0:
            spans.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert spans
    for lane in spans.values():
        lane.sort()
        for (a0, a1), (b0, b1) in zip(lane, lane[1:], strict=False):
            assert b0 >= a1 - 1e-6 or b1 <= a1 + 1e-6, (a0, a1, b0, b1)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert names and all("GB" in n for n in names)  # "H100-80GB x2: stage 0", ...
    assert any("(communication)" in n for n in names)


def test_trace_lanes_do_not_overlap_with_gradient_sync(prof):
    # Several data ways: each stage's gradient sync overlaps its backward in time; the
    # trace puts it on the submesh's communication thread.
    c = Cluster.load("h100-a100-v100-x8")
    plan = uniform_plan(SPEC, prof, c, global_batch=16, seq_len=32,
                        fix=parse_fix("dp=4,tp=1,pp=2,mbs=2"))
    r = simulate(plan, prof, c)
    assert any(t.kind == "sync" for t in r.tasks)
    _slices_nest_per_thread(chrome_trace(r, plan))


def test_slow_gpus_pace_a_uniform_plan(prof, device_only):
    c = Cluster.load("h100-a100-v100-x8")
    plan = uniform_plan(SPEC, prof, c, global_batch=16, seq_len=32,
                        fix=parse_fix("dp=4,tp=1,pp=2,mbs=2"))
    # Stage 0 mixes H100s and A100s (devices 0-3): one SPMD program runs at the A100's pace.
    assert plan.pipelines[0].stages[0].gpu == "A100-80GB+H100-80GB"
    r = simulate(plan, prof, c, device_only)
    s0, s1 = r.stage_costs[0]
    assert s1.fwd_s > 1.5 * s0.fwd_s  # stage 1 sits on V100s (devices 4-7)
    h100 = dataclasses.replace(c, groups=(dataclasses.replace(c.groups[0], nodes=4),))
    fast = simulate(dataclasses.replace(plan, pipelines=(dataclasses.replace(
        plan.pipelines[0], stages=plan.pipelines[0].stages[:1] + (dataclasses.replace(
            plan.pipelines[0].stages[1], devices=(4, 5, 6, 7)),)),)), prof, h100,
        device_only)
    assert fast.step_time_s < r.step_time_s


def test_stages_price_their_own_share_of_the_micro_batch(prof):
    # 4-sample micro-batches: 2 per device on the H100 stage (data=2), 1 per V100 (data=4).
    c = Cluster.load("h100-a100-v100-x8")
    stages = (Stage(0, 3, (0, 1), "H100-80GB", (("data", 2),)),
              Stage(3, 6, (4, 5, 6, 7), "V100-32GB", (("data", 4),)))
    plan = Plan(SPEC, c.to_dict(), 16, 32, (Pipeline(stages, 16, 2, 4),))
    r = simulate(plan, prof, c)
    for j, mbs in ((0, 2), (1, 1)):
        st = stages[j]
        assert r.stage_costs[0][j] == layers_cost(st, st.start, st.end, mbs, False, "flash",
                                                  prof, c, DEFAULT)
    sends = [t for t in r.tasks if t.stage == 1 and t.kind == "F"]
    first = [t for t in r.tasks if t.stage == 0 and t.kind == "F"]
    # The activation of all 4 samples crosses from the H100s to the V100s.
    hop = p2p_time(prof.layers[2].boundary_bytes_per_sample * 4, c, stages[0].devices,
                   stages[1].devices, DEFAULT)
    assert sends[0].start_s == pytest.approx(first[0].end_s + hop)


def test_distributed_optimizer_shards_state_and_gathers_after_the_update(prof, device_only):
    c = Cluster.load("h100-a100-v100-x8")
    base = uniform_plan(SPEC, prof, c, global_batch=16, seq_len=32,
                        fix=parse_fix("dp=4,tp=1,pp=2,mbs=2"))
    zero1 = uniform_plan(SPEC, prof, c, global_batch=16, seq_len=32,
                         fix=parse_fix("dp=4,tp=1,pp=2,mbs=2,zero1=true"))
    assert zero1.distributed_optimizer and not base.distributed_optimizer
    a, b = simulate(base, prof, c, device_only), simulate(zero1, prof, c, device_only)
    st_all = base.pipelines[0].stages
    for s, (ca, cb) in enumerate(zip(a.stage_costs[0], b.stage_costs[0], strict=True)):
        # Three quarters of the optimizer state leave every device; the update is 1/4.
        st = base.pipelines[0].stages[s]
        opt = ca.grad_sync_bytes * prof.opt_bytes_per_param_byte
        assert ca.memory_static_bytes - cb.memory_static_bytes == pytest.approx(opt * 3 / 4)
        assert cb.optimizer_s == pytest.approx(ca.optimizer_s / 4)
        assert all(b.memory_per_device[d] < a.memory_per_device[d] for d in st.devices)
        tasks = {t.kind: t for t in b.tasks if t.stage == s and t.micro_batch < 0}
        # The last stage also sends the tied head's gradient to the embedding's owner.
        tied = {"send"} if s == len(st_all) - 1 else set()
        assert set(tasks) == {"sync", "opt", "gather"} | tied
        topo = topology(c, st.devices)
        gpu = _slowest(c, st.devices).name
        assert tasks["sync"].end_s - tasks["sync"].start_s == pytest.approx(
            collective_time("reduce_scatter", cb.grad_sync_bytes, topo, DEFAULT, gpu))
        assert tasks["gather"].start_s >= tasks["opt"].end_s
        assert tasks["gather"].end_s - tasks["gather"].start_s == pytest.approx(
            collective_time("all_gather", cb.grad_sync_bytes, topo, DEFAULT, gpu))
    assert b.step_time_s == pytest.approx(max(t.end_s for t in b.tasks))
    # Stages of one data way have nothing to shard, even when other pipelines hold the
    # same layers: the flag changes neither time nor memory.
    pipes = tuple(Pipeline((Stage(0, 6, (d,), "H100-80GB", (("data", 1),)),), 8, 2, 4)
                  for d in (0, 1))
    one = [Plan(SPEC, c.to_dict(), 16, 32, pipes, dtype="float32", distributed_optimizer=z)
           for z in (False, True)]
    x, y = (simulate(p, prof, c) for p in one)
    assert x.tasks == y.tasks and x.memory_per_device == y.memory_per_device


@pytest.mark.parametrize("fix,match", [
    ("dp=3,tp=1,pp=1", "product equal"),
    ("dp=8,tp=1,pp=1,mbs=3", "multiple of dp"),
    ("dp=1,tp=1,pp=8", "at most the model's 4 blocks"),
    ("dp=8,tp=1,pp=1,hsdp=3", "hsdp=3.*a divisor of dp=8"),
    ("dp=4,tp=1,pp=2,layers=1,2", "summing to the model's 4 blocks.*sum to 3"),
    ("dp=4,tp=1,pp=2,layers=1,1,2", "2 block counts, one per stage"),
    ("dp=4,tp=1,pp=2,vpp=2,mbs=1,layers=2,2", "4 block counts.*pp\\*vpp"),
    ("dp=1,tp=8,pp=1", "divisor of the model's 4 heads"),
])
def test_fix_that_does_not_divide_is_an_error(prof, fix, match):
    c = Cluster.load("h100-a100-v100-x8")
    with pytest.raises(SpecError, match=match):
        uniform_plan(SPEC, prof, c, global_batch=16, seq_len=32, fix=parse_fix(fix))


@pytest.mark.parametrize("text,match", [
    ("dp=2,depth=3", "depth"), ("dp=two", "positive integer"), ("dp=0", "positive integer"),
    ("dp=2,dp=4", "contradictory"), ("remat=some", "remat"), ("fsdp=perhaps", "true or false"),
    ("schedule=zb", "schedule"), ("dp=2,zero1=true,fsdp=true", "zero1=True.*with fsdp"),
    ("layers=0,2", "layers='0'.*positive"), ("layers=2,x", "layers='x'.*N\\*k"),
    ("layers=2*0", "positive"), ("pp=2,8", "key=value"),
    ("dp=8,hsdp=4,fsdp=true", "hsdp=4.*no hsdp with fsdp=true"), ("hsdp=0", "positive")])
def test_parse_fix_errors(text, match):
    with pytest.raises(SpecError, match=match):
        parse_fix(text)


def test_stage_bounds_put_embed_first_and_head_last(prof):
    assert stage_bounds(prof, 2) == [(0, 3), (3, 6)]
    assert stage_bounds(prof, 4) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    # Uneven: a layer list, or pp that does not divide the blocks (the remainder to the
    # stages farthest from the ends, which also hold the embedding and the head).
    assert stage_bounds(prof, 2, (1, 3)) == [(0, 2), (2, 6)]
    assert stage_bounds(prof, 3) == [(0, 2), (2, 4), (4, 6)]


def test_spread_takes_blocks_from_the_first_and_last_stages():
    assert spread(126, 16) == (7,) + (8,) * 14 + (7,)  # Llama 3 405B's pipeline
    assert spread(10, 4) == (2, 3, 3, 2) and spread(11, 4) == (3, 3, 3, 2)
    assert sum(spread(61, 7)) == 61 and max(spread(61, 7)) - min(spread(61, 7)) == 1
    assert parse_fix("pp=16,layers=7,8*14,7").layers == spread(126, 16)


def test_simulate_prices_an_uneven_pipeline_by_its_slowest_stage():
    """A layer list sets each stage's blocks; the even list costs what plain pp costs,
    and piling blocks on the last stage (with the head) is slower."""
    spec8 = "gpt:layers=8,hidden=4096,heads=32,vocab=512,seq=2048"  # compute-bound
    prof8 = profile_model(spec8, 2048)
    c = Cluster.load("dgx-a100-80gb-x8")

    def step(fix):
        p = uniform_plan(spec8, prof8, c, global_batch=8, seq_len=2048,
                         fix=parse_fix("dp=1,tp=2,mbs=1," + fix))
        return simulate(p, prof8, c).step_time_s, p
    even, p = step("pp=4")
    assert [s.end - s.start for s in p.pipelines[0].stages][1:-1] == [2, 2]
    _, p3 = step("pp=4,layers=1,3,3,1")
    assert [(s.start, s.end) for s in p3.pipelines[0].stages][0][1] == 2  # embed + 1 block
    same, _ = step("pp=4,layers=2,2,2,2")
    assert same == pytest.approx(even)
    heavy, _ = step("pp=4,layers=1,1,1,5")
    assert heavy > even


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
    # The file --json writes pins as it is (Plan.load, jit(plan=), simulate --plan),
    # the plan under "plan" next to the predictions.
    written = tmp_path / "sim.json"
    written.write_text(json.dumps(out))
    assert Plan.load(written) == Plan.from_dict(out["plan"])
    assert main(["simulate", "--plan", str(written), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == out["step_time_s"]
    with pytest.raises(SpecError, match="version=None"):
        Plan.from_dict({"plan": {"no": "version"}})
    assert json.loads(trace.read_text())["traceEvents"]
    assert main(["simulate", "--model", SPEC, "--cluster", "dgx-a100-80gb-x8",
                 "--global-batch", "16", "--fix", "dp=3"]) == 2
    assert "dp*tp*pp*cp=3" in capsys.readouterr().err


def test_simulate_interleaved_fix(capsys, device_only_file):
    # 8 blocks on 2 submeshes x 2 virtual stages, 8 micro-batches: a smaller bubble
    # (a model big enough for compute, not transfer latency, to fill the step; the host's
    # dispatch, which twice the tasks lengthen, left out: device_only_file).
    def run(fix):
        assert main(["simulate", "--model", "gpt:layers=8,hidden=2048,heads=16,vocab=1024,seq=1024",
                     "--cluster", "dgx-a100-80gb-x8", "--global-batch", "32", "--seq-len",
                     "1024", "--fix", fix, "--calibration", device_only_file,
                     "--json", "-"]) == 0
        return json.loads(capsys.readouterr().out)
    plain, inter = run("dp=4,tp=1,pp=2,mbs=1"), run("dp=4,tp=1,pp=2,mbs=1,vpp=2")
    pipe = Plan.from_dict(inter["plan"]).pipelines[0]
    assert (pipe.virtual_stages, len(pipe.stages)) == (2, 4)
    assert pipe.stages[0].devices == pipe.stages[2].devices != pipe.stages[1].devices
    assert inter["bubble_fraction"] < plain["bubble_fraction"]
    for fix, match in (("dp=4,pp=2,mbs=4,vpp=2", "vpp=2.*the 1 micro-batches"),
                       ("dp=8,pp=1,vpp=2", "vpp=2.*pp > 1"),
                       ("dp=2,pp=4,mbs=1,vpp=2", "pp\\*vpp=8.*at most.*4 blocks")):
        assert main(["simulate", "--model", SPEC, "--cluster", "dgx-a100-80gb-x8",
                     "--global-batch", "16", "--fix", fix]) == 2
        assert re.search(match, capsys.readouterr().err), fix


# ---- Plan schema ----------------------------------------------------------------------

@st.composite
def plans(draw):
    n_pipes = draw(st.integers(1, 3))
    layers = draw(st.integers(2, 12))
    pipes, next_dev = [], 0
    for _ in range(n_pipes):
        # v = 2: interleaved, the submeshes of the first k stages again for k more.
        v = draw(st.sampled_from([1, 2])) if layers >= 4 else 1
        k = draw(st.integers(2 if v == 2 else 1, min(4, layers // v)))
        cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=k * v - 1,
                                   max_size=k * v - 1)))
        bounds = list(zip([0] + cuts, cuts + [layers], strict=True))
        dp = draw(st.integers(1, 2))
        tp = draw(st.sampled_from([1, 2]))
        stages = []
        for j, (a, b) in enumerate(bounds):
            if j < k:
                devs = tuple(range(next_dev, next_dev + dp * tp))
                next_dev += dp * tp
                gpu = draw(st.sampled_from(["A100-80GB", "V100-16GB"]))
            else:
                devs, gpu = stages[j - k].devices, stages[j - k].gpu
            stages.append(Stage(a, b, devs, gpu, (("data", dp), ("tensor", tp)),
                                draw(st.sampled_from(REMATS)),
                                predicted_fwd_s=draw(st.floats(0, 10))))
        mbs, m = draw(st.integers(1, 4)), draw(st.integers(1, 8)) * (k if v > 1 else 1)
        schedule = draw(st.sampled_from(["1f1b", "gpipe"]))
        extra = ()
        if schedule == "1f1b" and v == 1 and draw(st.booleans()):
            extra = tuple(max(0, 2 - j) for j in range(k))  # (2, 1, 0, ...)
        pipes.append(Pipeline(tuple(stages), mbs * m * dp, mbs, m, schedule, v, extra))
    gb = sum(p.batch_share for p in pipes)
    return Plan(model="gpt-tiny", cluster={}, global_batch=gb, seq_len=64,
                pipelines=tuple(pipes),
                grad_sync_overlap=draw(st.booleans()),
                context=Context(2, (40, 24)), fsdp=draw(st.booleans()),
                distributed_optimizer=draw(st.booleans()),
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
    # Schema 1 (no virtual stages) and 2 (no distributed optimizer) still read, as one
    # stage per submesh and a full optimizer state per data way.
    old = plan.to_dict()
    old["version"] = 2
    del old["distributed_optimizer"]
    path.write_text(json.dumps(old))
    assert Plan.load(path) == plan
    old["version"] = 1
    del old["pipelines"][0]["virtual_stages"]
    path.write_text(json.dumps(old))
    assert Plan.load(path) == plan
    zero1 = dataclasses.replace(plan, distributed_optimizer=True)
    zero1.save(path)
    assert Plan.load(path) == zero1
    assert json.loads(path.read_text())["version"] == SCHEMA_VERSION == 16
    # Schema 11 (no context.shard_state: the state replicated over context) reads so.
    old = zero1.to_dict()
    del old["context"]["shard_state"]
    old["version"] = 11
    path.write_text(json.dumps(old))
    assert Plan.load(path) == zero1 and not Plan.load(path).context.shard_state
    with pytest.raises(SpecError, match="context.shard_state=1.*true or false"):
        dataclasses.replace(plan, context=Context(shard_state=1))
    # Schema 8 (no gpu_dtypes: every stage computes in the plan's dtype) reads unchanged.
    old = zero1.to_dict()
    del old["gpu_dtypes"]
    old["version"] = 8
    path.write_text(json.dumps(old))
    assert Plan.load(path) == zero1 and Plan.load(path).gpu_dtypes == ()
    # Schema 7 (no fingerprint: a plan naming no traced program) reads with an empty one.
    old = dataclasses.replace(zero1, fingerprint="abc").to_dict()
    del old["fingerprint"]
    old["version"] = 7
    path.write_text(json.dumps(old))
    assert Plan.load(path) == zero1 and Plan.load(path).fingerprint == ""
    # Schemas 3 (no ZB-H1 schedule yet), 4 (no remat_layers: the remat covers the whole
    # stage) and 5 (no split_blocks: layers are whole blocks) read unchanged.
    old = zero1.to_dict()
    del old["split_blocks"]
    old["version"] = 5
    path.write_text(json.dumps(old))
    assert Plan.load(path) == zero1
    for entry in old["pipelines"][0]["stages"]:
        del entry["remat_layers"]
    for version in (3, 4):
        old["version"] = version
        path.write_text(json.dumps(old))
        assert Plan.load(path) == zero1
    # A remat of the stage's first layers: a count of them, with a remat to apply.
    part = dataclasses.replace(stage, remat="full", remat_layers=3)
    partial = Plan("gpt-tiny", {}, 8, 64, (Pipeline((part,), 8, 2, 2),))
    partial.save(path)
    assert Plan.load(path) == partial and "full 3/4" in partial.explain()
    for bad, match in ((dict(remat_layers=5), r"remat_layers=5.*1 to 4"),
                       (dict(remat_layers=0), r"remat_layers=0.*1 to 4"),
                       (dict(remat_layers=2.0), r"remat_layers=2.0"),
                       (dict(remat="none", remat_layers=2), r"remat_layers=2.*null when"),
                       (dict(remat="most"), r"remat='most'.*one of")):
        with pytest.raises(SpecError, match=match):
            Plan("gpt-tiny", {}, 8, 64, (Pipeline((dataclasses.replace(part, **bad),), 8, 2,
                                                  2),))
    # ZB-H1: one stage per submesh; its extra warm-up bounds the micro-batches held.
    zb = dataclasses.replace(pipe, schedule="zbh1")
    assert Plan("gpt-tiny", {}, 8, 64, (zb,)).pipelines[0].schedule == "zbh1"
    with pytest.raises(SpecError, match="distributed_optimizer='yes'.*true or false"):
        dataclasses.replace(plan, distributed_optimizer="yes")
    with pytest.raises(SpecError, match="split_blocks=1.*true or false"):
        dataclasses.replace(plan, split_blocks=1)
    assert "block halves" in dataclasses.replace(plan, split_blocks=True).explain()
    two = (Stage(0, 1, (0,), "A100-80GB", (("data", 1),)),
           Stage(1, 2, (1,), "A100-80GB", (("data", 1),)))
    inter = Pipeline(two + (dataclasses.replace(two[0], start=2, end=3),
                            dataclasses.replace(two[1], start=3, end=4)), 4, 1, 4,
                     virtual_stages=2)
    assert Plan("gpt-tiny", {}, 4, 64, (inter,)).num_devices == 2
    with pytest.raises(SpecError, match=r"stages\[3\].devices.*stage 1's devices"):
        Plan("gpt-tiny", {}, 4, 64, (dataclasses.replace(inter, stages=inter.stages[:3] + (
            dataclasses.replace(inter.stages[3], devices=(2,)),)),))
    # A micro-batch count the submeshes do not divide: a smaller last group.
    assert Plan("gpt-tiny", {}, 3, 64, (dataclasses.replace(inter, batch_share=3,
                                                            num_micro_batches=3),))
    with pytest.raises(SpecError, match="virtual_stages=3"):
        Plan("gpt-tiny", {}, 4, 64, (dataclasses.replace(inter, virtual_stages=3),))
    with pytest.raises(SpecError, match="schedule='zbh1'.*virtual_stages > 1"):
        Plan("gpt-tiny", {}, 4, 64, (dataclasses.replace(inter, schedule="zbh1"),))
    with pytest.raises(SpecError, match="--fix schedule='zbh1'"):
        parse_fix("schedule=zbh1,vpp=2")
    # Extra warm-up: one count per submesh, 1F1B without virtual stages, never growing.
    plain = Pipeline(two, 4, 1, 4)
    assert Plan("gpt-tiny", {}, 4, 64, (dataclasses.replace(plain, extra_warmup=(2, 1)),))
    for bad in ((1,), (0, 2), (-1, 0)):
        with pytest.raises(SpecError, match="extra_warmup"):
            Plan("gpt-tiny", {}, 4, 64, (dataclasses.replace(plain, extra_warmup=bad),))
    with pytest.raises(SpecError, match="extra_warmup"):
        Plan("gpt-tiny", {}, 4, 64, (dataclasses.replace(plain, extra_warmup=(1, 0),
                                                         schedule="gpipe"),))
    path.write_text("{bad json")
    with pytest.raises(SpecParseError, match="line 1"):
        Plan.load(path)


def test_zero_bubble_warm_up_is_lowered_where_w_keeps_too_much():
    # gpt-175b on mix4-x1024 in one 8-stage pipeline, the groups joined by 0.45 GB/s (slow
    # enough that the stages' sends make extra warm-up pay). Its 1F1B warm-up, tuned to
    # the activations a held micro-batch keeps, does not fit an H100 stage under ZB-H1,
    # whose W passes also keep what B computed; lowered stage by stage where memory is
    # short, ZB-H1 fits and beats both 1F1B and ZB-H1 without extra warm-up.
    from hetshard.sim.simulator import tune_warmup
    from hetshard.solver.variants import zero_bubble
    cluster = Cluster.load({**Cluster.load("mix4-x1024").to_dict(), "inter_group_gbs": 0.45})
    prof = profile_model("gpt-175b", 2048, "float16")
    cuts = [(0, 11, 256, "A100-80GB"), (11, 21, 384, "A100-80GB"), (21, 25, 768, "V100-32GB"),
            (25, 29, 896, "V100-32GB"), (29, 38, 512, "A100-40GB"),
            (38, 47, 640, "A100-40GB"), (47, 72, 0, "H100-80GB"), (72, 98, 128, "H100-80GB")]
    stages = tuple(Stage(a, b, tuple(range(d, d + 128)), gpu, (("data", 16), ("tensor", 8)))
                   for a, b, d, gpu in cuts)
    warmup = (6, 5, 4, 3, 2, 2, 3, 3)
    plan = Plan("gpt-175b", cluster.to_dict(), 2048, 2048,
                (Pipeline(stages, 2048, 1, 128, extra_warmup=warmup),),
                dtype="float16", distributed_optimizer=True, tp_overlap=True)

    # The stage times this scenario was built for: collective matmuls' interference
    # 0.57 (the default is refitted as measurements come in; at 0.92 less warm-up is
    # simply faster on every stage, and memory no longer decides which stage lowers it).
    cal = dataclasses.replace(DEFAULT, default=dataclasses.replace(
        DEFAULT.default, tp_overlap_interference=0.57))

    def run(p):
        return simulate(p, prof, cluster, cal, trace=False, margin=0.05)
    zb = zero_bubble(plan)
    assert run(plan).fits and not run(zb).fits
    tuned = tune_warmup(zb, prof, cluster, cal, margin=0.05, zero_bubble_options=True)
    got = run(tuned)
    assert got.fits and tuned.pipelines[0].schedule == "zbh1"
    bare = dataclasses.replace(zb, pipelines=(dataclasses.replace(zb.pipelines[0],
                                                                  extra_warmup=()),))
    assert got.step_time_s < run(plan).step_time_s
    assert got.step_time_s < run(bare).step_time_s
    # The A100 and V100 stages keep (at least) their warm-up; an H100 stage gave it up.
    extra = tuned.pipelines[0].extra_warmup
    assert all(a >= b for a, b in zip(extra[:6], warmup[:6], strict=True))
    assert any(a < b for a, b in zip(extra[6:], warmup[6:], strict=True))


def test_schema_9_activation_layouts_load_into_their_own_field():
    """Plan schema 10 keeps parameter layouts (Stage.shardings) and the activation a
    stage hands on (Stage.activations) apart; a schema 9 plan's "activation:<layer>"
    shardings load into activations, and schema 10 refuses them among the parameters."""
    stage = Stage(0, 4, (0, 1), "A100-80GB", (("data", 2),),
                  shardings=(("decoder/blocks/0/attn/wq/kernel", (None, "tensor")),),
                  activations=(("decoder/blocks/3", ("data", None, None)),))
    plan = Plan("gpt-tiny", {}, 8, 64, (Pipeline((stage,), 8, 2, 2),))
    assert Plan.from_json(plan.to_json()) == plan
    old = plan.to_dict()
    old["version"] = 9
    st = old["pipelines"][0]["stages"][0]
    st["shardings"] = st["shardings"] + [["activation:decoder/blocks/3", ["data", None, None]]]
    del st["activations"]
    assert Plan.from_dict(old) == plan
    old["version"] = 10
    with pytest.raises(SpecError, match=r"stages\[0\]\.shardings.*activations"):
        Plan.from_dict(old)


def test_grad_sync_is_derived_from_the_pipelines_and_its_overlap_priced(prof, device_only):
    """Plan schema 11: ``grad_sync`` follows the pipelines (a replaced plan never keeps a
    stale one) and is not stored; a schema 10 file's per-entry ``overlap`` flags load as
    ``grad_sync_overlap``, a schema 11 file naming ``grad_sync`` is refused; the
    simulator starts the sum later without overlap."""
    c = Cluster.load("h100-a100-v100-x8")
    plan = uniform_plan(SPEC, prof, c, global_batch=16, seq_len=32,
                        fix=parse_fix("dp=4,tp=1,pp=2,mbs=2"))
    first, second = (tuple(st.devices) for st in plan.pipelines[0].stages)
    assert [(g.start, g.end, g.devices) for g in plan.grad_sync] == [
        (plan.pipelines[0].stages[0].start, plan.pipelines[0].stages[0].end, first),
        (plan.pipelines[0].stages[1].start, plan.pipelines[0].stages[1].end, second)]
    assert all(g.weights == (1.0,) for g in plan.grad_sync)  # one pipeline
    # The two stages swap devices: the sync follows.
    pipe = plan.pipelines[0]
    swapped = dataclasses.replace(plan, pipelines=(dataclasses.replace(pipe, stages=(
        dataclasses.replace(pipe.stages[0], devices=second, gpu=pipe.stages[1].gpu),
        dataclasses.replace(pipe.stages[1], devices=first, gpu=pipe.stages[0].gpu))),))
    assert swapped.grad_sync[0].devices == second
    # Two pipelines sharing layers: weighted by their batch shares.
    one = tuple(Stage(0, 6, (d,), "H100-80GB", (("data", 1),)) for d in (0, 1))
    two = Plan(SPEC, c.to_dict(), 16, 32, (Pipeline((one[0],), 12, 2, 6),
                                           Pipeline((one[1],), 4, 2, 2)))
    assert [(g.devices, g.weights) for g in two.grad_sync] == [((0, 1), (0.75, 0.25))]
    assert "layers 0-5 over 2 devices weighted 0.75/0.25, during" in two.explain()
    alone = Plan(SPEC, c.to_dict(), 4, 32, (Pipeline((one[0],), 4, 2, 2),))
    assert alone.grad_sync == () and "gradient sync not needed" in alone.explain()
    d = plan.to_dict()
    assert "grad_sync" not in d and Plan.from_dict(d) == plan
    with pytest.raises(SpecError, match="grad_sync.*derived from the pipelines"):
        Plan.from_dict({**d, "grad_sync": []})
    old = json.loads(json.dumps(d))
    old["version"] = 10
    del old["grad_sync_overlap"]
    old["grad_sync"] = [{"start": g.start, "end": g.end, "devices": list(g.devices),
                         "weights": list(g.weights), "collective": "all_reduce",
                         "overlap": False} for g in plan.grad_sync]
    late = Plan.from_dict(old)
    assert not late.grad_sync_overlap and late == dataclasses.replace(
        plan, grad_sync_overlap=False)
    assert "after the last backward" in late.explain()
    for g in old["grad_sync"]:
        g["overlap"] = True
    assert Plan.from_dict(old) == plan
    with pytest.raises(SpecError, match="grad_sync_overlap='no'"):
        dataclasses.replace(plan, grad_sync_overlap="no")
    # Read by the simulator: without overlap every stage's sum waits for its last
    # backward to end, not start. This model's gradients (a few hundred KB a stage) fit
    # in one of XLA's combined all-reduces, which waits for the last gradient: overlap
    # gains nothing. In buckets of 4 KB, the buckets of the last layers cross the network
    # while the backward goes on.
    on, off = simulate(plan, prof, c, device_only), simulate(late, prof, c, device_only)
    assert off.step_time_s == on.step_time_s
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(comm, "COMBINE_BYTES", 4096)
        on, off = simulate(plan, prof, c, device_only), simulate(late, prof, c, device_only)
    assert off.step_time_s > on.step_time_s


def test_plan_cluster_is_a_typed_cluster_written_as_its_spec(prof):
    """Plan.cluster is a Cluster (a spec dict is read as one, {} as none); the JSON holds
    the spec Cluster.to_dict writes; a malformed spec is refused naming its field."""
    c = Cluster.load("h100-a100-v100-x8")
    plan = uniform_plan(SPEC, prof, c, global_batch=16, seq_len=32,
                        fix=parse_fix("dp=4,tp=1,pp=2,mbs=2"))
    assert isinstance(plan.cluster, Cluster) and plan.cluster == c
    d = plan.to_dict()
    assert d["cluster"] == c.to_dict()
    assert Plan.from_dict(d) == plan and Plan.from_dict(d).cluster.num_devices == 8
    assert dataclasses.replace(plan, cluster=c.to_dict()) == plan
    bare = dataclasses.replace(plan, cluster={})
    assert bare.cluster is None and bare.to_dict()["cluster"] == {}
    bad = json.loads(json.dumps(d))
    bad["cluster"]["groups"][0]["nodes"] = 0
    with pytest.raises(SpecError, match="nodes"):
        Plan.from_dict(bad)
    with pytest.raises(SpecError, match="cluster.*a Cluster, a cluster spec"):
        dataclasses.replace(plan, cluster="h100")
    # Devices beyond the cluster's are refused (the cluster's device count is read).
    with pytest.raises(SpecError, match="devices"):
        dataclasses.replace(plan, cluster=Cluster.load("dgx-h100-x8").shrunk(4))


def test_state_sharded_over_context_is_priced_a_share_a_device():
    """``Context.shard_state``: llama-7b's one row over eight A100s as a context ring
    (no data ways) holds an eighth of the weights and AdamW moments a device, and fits,
    where the state replicated over the ring (112 GB a device) does not; the stage's
    static memory is exactly the replicated one's over the ring's size; the gradients
    are then reduce-scattered over the ring and each layer's weights gathered from it.
    The replicated state's gradients are partial sums over each rank's tokens too:
    they are all-reduced over the ring (a CP-only plan still syncs its gradients)."""
    profile = profile_model("llama-7b", seq_len=4096)
    cluster = Cluster.from_dict({"name": "a100", "groups": [
        {"name": "a", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 8}]})
    stage = Stage(0, profile.num_layers, tuple(range(8)), "A100-80GB", (("context", 8),),
                  remat="full")
    whole = Plan("llama-7b", cluster, 1, 32768, (Pipeline((stage,), 1, 1, 1),),
                 context=Context(8))
    shared = dataclasses.replace(whole, context=Context(8, shard_state=True))
    a, b = simulate(whole, profile, cluster), simulate(shared, profile, cluster)
    assert not a.fits and b.fits
    ((ca,),), ((cb,),) = a.stage_costs, b.stage_costs
    assert cb.memory_static_bytes == pytest.approx(ca.memory_static_bytes / 8)
    assert ca.memory_static_bytes > 100e9
    assert cb.fwd_s > ca.fwd_s  # the per-layer gathers
    assert cb.optimizer_s == pytest.approx(ca.optimizer_s / 8)
    sync = {name: [t for t in r.tasks if t.kind == "sync"] for name, r in (("a", a), ("b", b))}
    assert len(sync["a"]) == len(sync["b"]) == 1
    # An all-reduce moves twice a reduce-scatter's bytes.
    (sa,), (sb,) = sync["a"], sync["b"]
    assert sa.end_s - sa.start_s == pytest.approx(2 * (sb.end_s - sb.start_s), rel=0.05)


def test_lowering_one_stages_warm_up_keeps_the_warm_up_from_growing_along_the_pipeline():
    """ZB-H1's fit lowers the warm-up of the stages short of memory; a later stage left
    warming up more forwards than the one before it would deadlock (and is no valid
    plan): it is lowered too (found on long_context.py's H100+A100 llama-70b row)."""
    from hetshard.sim.schedule import monotone_warmup
    assert monotone_warmup((2, 0, 0, 0, 2, 1, 0, 0)) == (2, 0, 0, 0, 1, 1, 0, 0)
    assert monotone_warmup((3, 2, 1, 0)) == (3, 2, 1, 0)
    assert monotone_warmup((0, 1, 2, 3)) == (0, 1, 2, 3)  # one more each: allowed
    for extra in [(2, 0, 0, 0, 2, 1, 0, 0), (0, 3, 0, 5), (1, 1, 4, 0, 2)]:
        got = monotone_warmup(extra)
        p = len(got)
        assert all(a <= b for a, b in zip(got, extra, strict=True))
        forwards = [p - w - 1 + e for w, e in enumerate(got)]
        assert all(x >= y for x, y in zip(forwards, forwards[1:], strict=False))


def test_hybrid_sharding_gathers_inside_a_node_and_syncs_a_shard_across_nodes():
    """``--fix hsdp=8`` on two 8-GPU nodes: FSDP inside each node, data parallelism
    across. Its per-layer gathers stay on NVLink (the forward is the same on a 2 or a 200
    GB/s network, where flat FSDP's gathers cross it); its gradient sync is a
    reduce-scatter inside the node plus an all-reduce of each GPU's eighth across the
    nodes, the only part on the slow link; each device holds an eighth of the state."""
    prof = profile_model("llama-7b", seq_len=2048)

    def run(fix, inter):
        c = Cluster.from_dict({"name": "two", "groups": [{
            "name": "a", "gpu": "A100-80GB", "nodes": 2, "gpus_per_node": 8,
            "inter_node_gbs": inter}]})
        p = uniform_plan("llama-7b", prof, c, global_batch=64, seq_len=2048,
                         fix=parse_fix(fix), attention="flash")
        return simulate(p, prof, c), c
    (hs, c), (hf, _) = run("dp=16,hsdp=8,mbs=2", 2), run("dp=16,hsdp=8,mbs=2", 200)
    (fs, _), (ff, _) = run("dp=16,fsdp=true,mbs=2", 2), run("dp=16,fsdp=true,mbs=2", 200)
    ((h,),), ((f,),) = hs.stage_costs, fs.stage_costs
    assert h.fwd_s == pytest.approx(hf.stage_costs[0][0].fwd_s)
    assert f.fwd_s > 5 * ff.stage_costs[0][0].fwd_s and f.fwd_s > 5 * h.fwd_s
    (sync,) = [t for t in hs.tasks if t.kind == "sync"]
    n = h.grad_sync_bytes
    # In XLA's combined buckets of at most 30 MiB (each layer's gradients, last layer
    # first, in equal parts): per bucket, both collectives.
    sizes = [layer.param_bytes for layer in reversed(prof.layers)]
    parts = comm.buckets([n * b / sum(sizes) for b in sizes])
    assert len(parts) > 2 * prof.num_layers and max(b for _, b in parts) <= 30 * 2**20
    want = sum(collective_time("reduce_scatter", b, topology(c, range(8)), DEFAULT,
                               "A100-80GB")
               + collective_time("all_reduce", b / 8, topology(c, [0, 8]), DEFAULT,
                                 "A100-80GB", 8) for _, b in parts)
    assert sync.end_s - sync.start_s == pytest.approx(want)
    assert hs.step_time_s < 0.7 * fs.step_time_s
    # the state: an eighth a device (flat FSDP's a sixteenth)
    assert h.memory_static_bytes == pytest.approx(2 * f.memory_static_bytes)


def test_the_update_holds_a_second_copy_of_the_state_only_where_the_runtime_keeps_one():
    """Donated (on GPUs: ``hetshard.runtime.guard.donates``), the update is written over
    the state; not donated, one SPMD stage's program holds the new state beside the old
    all along (its outputs are allocated when it starts), and a pipeline stage's update
    program holds both once the activations are gone. A pipeline stage keeping leaves in
    host memory is never donated."""
    from hetshard.runtime.guard import donates
    from hetshard.sim.simulator import update_kind
    assert donates("nnx", "skip", "gpu") and donates("nnx", "apply", "cpu")
    assert not donates("nnx", "skip", "cpu") and not donates("tree", "apply", "gpu")
    spec = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32"
    prof = profile_model(spec, 32, "float32")
    cluster = Cluster.load("dgx-a100-80gb-x8")

    def fixed(fix):
        return uniform_plan(spec, prof, cluster, global_batch=16, seq_len=32,
                            fix=parse_fix(fix))
    one = fixed("dp=8,tp=1,pp=1,mbs=2")
    kept, written = (simulate(one, prof, cluster, trace=False, donated=d) for d in
                     (False, True))
    state = written.stage_costs[0][0].memory_state_bytes
    assert state > 0 and kept.peak_memory_bytes == pytest.approx(
        written.peak_memory_bytes + state)
    pipe = fixed("dp=4,tp=1,pp=2,mbs=2")
    kept, written = (simulate(pipe, prof, cluster, trace=False, donated=d) for d in
                     (False, True))
    for w, c in enumerate(written.stage_costs[0]):
        d = pipe.pipelines[0].stages[w].devices[0]
        step = written.memory_per_device[d]
        assert kept.memory_per_device[d] == pytest.approx(
            max(step, c.memory_static_bytes + c.memory_state_bytes))
    assert update_kind(pipe, pipe.pipelines[0]) == ("in_place", "in_place")
    offloading = fixed("dp=4,tp=1,pp=2,mbs=2,offload=optimizer")
    assert update_kind(offloading, offloading.pipelines[0]) == ("apart", "apart")
    first, second = offloading.pipelines[0].stages
    mixed = dataclasses.replace(offloading.pipelines[0], stages=(
        first, dataclasses.replace(second, offload=())))
    assert update_kind(offloading, mixed) == ("apart", "in_place")
    assert update_kind(one, one.pipelines[0], donated=False) == ("with_step",)
    alone = fixed("dp=8,tp=1,pp=1,mbs=2,offload=optimizer")  # its whole step donates
    assert update_kind(alone, alone.pipelines[0]) == ("in_place",)
