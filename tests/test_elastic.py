"""Straggler response (hetshard.elastic): a stage slowed by an injected delay is found
from its measured times, the planner re-plans with the group's measured speed (predicted
gain logged), and training continues on the new plan equal to one device."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

import hetshard
import hetshard_models as models
from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster import Cluster
from hetshard.elastic import StragglerMonitor, StragglerWarning, slowed
from hetshard.errors import SpecError
from hetshard_models import data, losses, steps

MODEL = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32"
CLUSTER = {"name": "a100-2x4", "groups": [
    {"name": "a", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 4},
    {"name": "b", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 4}]}
A = "A100-80GB"
PLAN = Plan(MODEL, Cluster.load(CLUSTER).to_dict(), 8, 32, (
    Pipeline((Stage(0, 3, (0, 1, 2, 3), A, (("data", 4),)),
              Stage(3, 6, (4, 5, 6, 7), A, (("data", 4),))), 8, 1, 2),),
    attention="reference")
STEP = steps.train_step(losses.text_loss)


def _fresh():
    model = models.build(MODEL, rngs=0)
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def test_slowed_cluster_divides_the_group_rates():
    c = slowed(Cluster.load(CLUSTER), "b", 2.0)
    a, b = c.group("a").gpu, c.group("b").gpu
    assert a.name == A and b.name == "A100-80GB-slow2.00"
    assert b.bf16_tflops == a.bf16_tflops / 2 and b.memory_gbs == a.memory_gbs / 2
    assert Cluster.from_dict(c.to_dict()).group("b").gpu.fp16_tflops == b.fp16_tflops
    with pytest.raises(SpecError, match="factor"):
        slowed(Cluster.load(CLUSTER), "b", 0)


@pytest.mark.slow
def test_an_injected_straggler_is_replanned_and_training_continues_equal_to_one_device():
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, 8, 32, 128) for _ in range(5)]
    model, opt = _fresh()
    ref = nnx.jit(STEP)
    want = [float(ref(model, opt, b)) for b in batches]

    model, opt = _fresh()
    step = hetshard.jit(STEP, cluster=CLUSTER, plan=PLAN, quiet=True)
    step.time_stages(delays={(0, 1): 0.25})  # stage 1 (group b) stalls 0.25 s per task
    got = [float(step(model, opt, batches[0]))]
    monitor = StragglerMonitor(step.plan, step.program, CLUSTER, threshold=1.5, patience=2,
                               options={"time_limit_s": 5})
    decision = None
    with pytest.warns(StragglerWarning, match="group 'b'"):
        for b in batches[1:3]:
            got.append(float(step(model, opt, b)))
            times = step.stage_times()
            assert set(times) == {(0, 0), (0, 1)} and times[0, 1] > 4 * 0.25
            decision = monitor.observe(times) or decision
    assert decision is not None and decision.group == "b" and decision.slowdown > 1.5
    assert decision.new_step_s < decision.old_step_s  # a predicted gain, logged
    # the new plan moves work off the slowed group
    def load_on_b(plan):
        b = set(range(4, 8))
        return sum((st.end - st.start) * p.batch_share for p in plan.pipelines
                   for st in p.stages if set(st.devices) <= b)
    assert load_on_b(decision.plan) < load_on_b(PLAN)
    step.adopt(decision)
    step.time_stages(False)
    got += [float(step(model, opt, b)) for b in batches[3:]]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_monitor_needs_every_stage_time():
    pytest.importorskip("ortools")
    from hetshard_models.steps import program
    prog = program(MODEL, batch=8, seq_len=32)
    m = StragglerMonitor(PLAN, prog, CLUSTER)
    with pytest.raises(SpecError, match="every"):
        m.observe({(0, 0): 1.0})
    with pytest.raises(SpecError, match="threshold"):
        StragglerMonitor(PLAN, prog, CLUSTER, threshold=0.5)
    # equal ratios: nobody is a straggler, however slow the fake devices are
    assert all(m.observe({k: 1e3 * v for k, v in m.priced.items()}) is None
               for _ in range(5))


SHARES = Plan(MODEL, Cluster.load(CLUSTER).to_dict(), 8, 32, (
    Pipeline((Stage(0, 6, (0, 1, 2, 3), A, (("data", 4),)),), 4, 1, 1),
    Pipeline((Stage(0, 6, (4, 5, 6, 7), A, (("data", 4),)),), 4, 1, 1)),
    attention="reference")


@pytest.mark.slow
def test_a_straggling_pipeline_of_a_shares_plan_gets_a_smaller_share():
    rng = np.random.default_rng(1)
    batches = [data.text_batch(rng, 8, 32, 128) for _ in range(4)]
    model, opt = _fresh()
    step = hetshard.jit(STEP, cluster=CLUSTER, plan=SHARES, quiet=True)
    step.time_stages(delays={(1, 0): 0.3})
    step(model, opt, batches[0])
    monitor = StragglerMonitor(step.plan, step.program, CLUSTER, threshold=1.5, patience=2,
                               options={"time_limit_s": 5})
    decisions = []
    with pytest.warns(StragglerWarning, match="group 'b'"):
        for b in batches[1:3]:
            step(model, opt, b)
            times = step.stage_times()
            assert set(times) == {(0, 0), (1, 0)} and times[1, 0] > 0.3
            decisions.append(monitor.observe(times))
    d = decisions[-1]
    assert decisions[0] is None and d is not None and d.group == "b"
    on_b = sum(p.batch_share for p in d.plan.pipelines
               if set(p.stages[0].devices) <= set(range(4, 8)))
    assert on_b < 4 and d.gain > 1
