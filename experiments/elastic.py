"""Elastic training on fake CPU devices: a run loses 2 of its 8 devices, restarts,
re-plans and resumes from its checkpoint; then a straggler is injected and re-planned
around.

1. A worker process with 8 devices trains gpt (4 layers) under a 2-stage pipeline plan,
   checkpointing every ``--every`` steps (``hetshard.checkpoint``), and is killed
   (SIGKILL) after step ``--kill-at``.
2. A new worker with 6 devices (two lost) runs ``hetshard.jit(elastic=True)``: it plans
   for the devices present, restores the last checkpoint straight into the new plan and
   trains to the end.
3. Two steps later that process switches to a 2-stage pipeline on its 6 devices and a
   delay per task is injected into the stage on group b (``time_stages(delays=...)``);
   ``hetshard.elastic.StragglerMonitor`` finds it and the step adopts the new plan.

Reported: time to re-plan and to restore, steps lost (steps done after the last
checkpoint), the straggler decision (slowdown, predicted gain, time to re-plan), and the
largest relative difference between the losses and one uninterrupted device's.

Usage: python experiments/elastic.py
Writes experiments/results/elastic.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32"
CLUSTER = {"name": "a100-2x4", "groups": [
    {"name": "a", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 4},
    {"name": "b", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 4}]}

STRAGGLER_DELAY_S = 0.2  # injected per task into the stalled stage
PATIENCE = 2  # steps over the threshold before the monitor re-plans

_COMMON = textwrap.dedent("""
    import json, os, sys, time, warnings
    import jax
    jax.config.update("jax_num_cpu_devices", {devices})
    import numpy as np, optax
    from flax import nnx
    import hetshard
    import hetshard_models as models
    from hetshard.checkpoint import Checkpointer
    from hetshard.cluster import Cluster
    from hetshard._plan import Pipeline, Plan, Stage
    from hetshard_models import data, losses, steps

    MODEL, CLUSTER, STEPS = {model!r}, {cluster!r}, {steps}
    STEP = steps.train_step(losses.text_loss)
    rng = np.random.default_rng(0)
    BATCHES = [data.text_batch(rng, 8, 32, 128) for _ in range(STEPS)]
    model = models.build(MODEL, rngs=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    A = "A100-80GB"
    PLAN = Plan(MODEL, Cluster.load(CLUSTER).to_dict(), 8, 32, (
        Pipeline((Stage(0, 3, (0, 1, 2, 3), A, (("data", 4),)),
                  Stage(3, 6, (4, 5, 6, 7), A, (("data", 4),))), 8, 1, 2),),
        attention="reference")
    ckpt = Checkpointer(sys.argv[1], keep=2)
""")

_FIRST = _COMMON + textwrap.dedent("""
    step = hetshard.jit(STEP, cluster=CLUSTER, plan=PLAN, quiet=True)
    for i in range(STEPS):
        loss = float(step(model, opt, BATCHES[i]))
        print(json.dumps({{"step": i, "loss": loss}}), flush=True)
        if (i + 1) % {every} == 0:
            ckpt.save(i + 1, (model, opt), data_position=i + 1, plan=step.plan)
        if i + 1 == {kill_at}:
            ckpt.wait()  # the checkpoint due now has landed; the process then dies
            os.kill(os.getpid(), 9)
""")

_SECOND = _COMMON + textwrap.dedent("""
    from hetshard.elastic import StragglerMonitor
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = hetshard.jit(STEP, cluster=CLUSTER, plan=PLAN, elastic=True, quiet=True,
                            time_limit_s=5)
        at = ckpt.latest_step()
        where = step.state_shardings(model, opt, BATCHES[at])
    t_plan = time.perf_counter() - t0
    t0 = time.perf_counter()
    info = ckpt.restore((model, opt), shardings=where)
    t_restore = time.perf_counter() - t0
    out = {{"resumed_at": info.step, "replan_s": t_plan, "restore_s": t_restore,
           "cluster": step.cluster.name, "plan": step.plan.summary(), "losses": {{}}}}
    for i in range(info.data_position, info.data_position + 2):
        out["losses"][i] = float(step(model, opt, BATCHES[i]))
    # Then a 2-stage pipeline on the 6 devices, its last stage (group b's 2 GPUs) stalled.
    plan6 = Plan(MODEL, step.cluster.to_dict(), 8, 32, (
        Pipeline((Stage(0, 3, (0, 1, 2, 3), A, (("data", 4),)),
                  Stage(3, 6, (4, 5), A, (("data", 2),))), 8, 1, 2),),
        attention="reference")
    step = hetshard.jit(STEP, cluster=step.cluster, plan=plan6, quiet=True)
    step.time_stages(delays={{(0, 1): {delay}}})
    monitor = None
    for i in range(info.data_position + 2, STEPS):
        out["losses"][i] = float(step(model, opt, BATCHES[i]))
        if "straggler" not in out:
            if monitor is None:
                monitor = StragglerMonitor(step.plan, step.program, step.cluster,
                                           threshold=1.5, patience={patience},
                                           options={{"time_limit_s": 5}})
                continue  # the first timed step compiled
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                d = monitor.observe(step.stage_times())
            if d is not None:
                out["straggler"] = {{"at_step": i, "group": d.group,
                                    "injected_delay_s": {delay}, "patience": {patience},
                                    "slowdown": d.slowdown, "old_step_s": d.old_step_s,
                                    "new_step_s": d.new_step_s, "gain": d.gain,
                                    "replan_s": time.perf_counter() - t0,
                                    "new_plan": d.plan.summary()}}
                step.adopt(d)
                step.time_stages(False)
    print(json.dumps(out), flush=True)
""")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=5)
    args = ap.parse_args()
    fmt = dict(model=MODEL, cluster=CLUSTER, steps=args.steps, every=args.every,
               kill_at=args.kill_at, delay=STRAGGLER_DELAY_S, patience=PATIENCE)
    ckdir = tempfile.mkdtemp(prefix="hetshard-elastic-")
    # a fresh plan cache: the re-plan time is a planning time, not a cache hit
    env = {**os.environ, "HETSHARD_CACHE_DIR": tempfile.mkdtemp(prefix="hetshard-cache-")}
    t0 = time.time()
    first = subprocess.run([sys.executable, "-c", _FIRST.format(devices=8, **fmt), ckdir],
                           capture_output=True, text=True, timeout=900, env=env)
    if first.returncode != -signal.SIGKILL:
        print(first.stderr[-3000:], file=sys.stderr)
        return 1
    before = {json.loads(x)["step"]: json.loads(x)["loss"]
              for x in first.stdout.splitlines() if x.startswith("{")}
    second = subprocess.run([sys.executable, "-c", _SECOND.format(devices=6, **fmt), ckdir],
                            capture_output=True, text=True, timeout=900, env=env)
    if second.returncode != 0:
        print(second.stderr[-3000:], file=sys.stderr)
        return 1
    after = json.loads(second.stdout.strip().splitlines()[-1])
    ref = subprocess.run([sys.executable, "-c", (_COMMON + textwrap.dedent("""
        step = nnx.jit(STEP)
        print(json.dumps([float(step(model, opt, b)) for b in BATCHES]))
    """)).format(devices=1, **fmt), ckdir], capture_output=True, text=True, timeout=900, env=env)
    want = json.loads(ref.stdout.strip().splitlines()[-1])
    got = {**before, **{int(k): v for k, v in after["losses"].items()}}
    rel = max(abs(got[i] - want[i]) / abs(want[i]) for i in range(args.steps))
    result = {
        "steps": args.steps, "checkpoint_every": args.every, "killed_after_step": args.kill_at,
        "resumed_at_step": after["resumed_at"],
        "steps_lost": args.kill_at - after["resumed_at"],
        "devices_before": 8, "devices_after": 6, "cluster_after": after["cluster"],
        "plan_after": after["plan"], "replan_s": after["replan_s"],
        "restore_s": after["restore_s"], "straggler": after.get("straggler"),
        "max_rel_loss_difference": rel, "losses": [got[i] for i in range(args.steps)],
        "reference_losses": want, "wall_time_s": time.time() - t0}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "elastic.json"), "w") as f:
        json.dump(result, f, indent=1)
    s = result["straggler"]
    print(f"killed after step {args.kill_at}, resumed at {after['resumed_at']} on 6 devices "
          f"({after['plan']}); re-plan {after['replan_s']:.1f} s, restore "
          f"{after['restore_s']:.2f} s, steps lost {result['steps_lost']}")
    if s:
        print(f"straggler: group {s['group']} {s['slowdown']:.1f}x at step {s['at_step']}, "
              f"predicted {s['old_step_s']:.3g} -> {s['new_step_s']:.3g} s "
              f"({s['gain']:.2f}x), re-plan {s['replan_s']:.1f} s: {s['new_plan']}")
    print(f"largest relative loss difference vs one device: {rel:.2e}")
    return 0 if rel <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
