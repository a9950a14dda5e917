"""hetshard quickstart: what a mixed cluster is worth, then such a plan trained for real.

1. Plans llama-13b, shape-only, on ``h100-a100-v100-x32`` (a DGX H100 node, a DGX A100
   node and two 8-GPU V100 nodes) with hetshard and every baseline, all priced by the
   same simulator. Prints hetshard's plan, a table of every planner's throughput, the
   GPUs each plan uses and leaves idle, and draws hetshard's simulated timeline.
2. Plans llama-13b on ``h100-a100-v100-x8`` (2 H100, 2 A100, 4 V100: the GPUs the 8 fake
   CPU devices stand for). There the planner's plan spans the GPU types, with uneven
   layer splits and micro-batches. The same plan, its blocks scaled in proportion onto
   a small LLaMA (8 blocks, width 64), is trained with ``@hetshard.jit`` on the 8 fake
   devices; every step's loss is checked against a single-device run (float32,
   relative difference <= 1e-5).
3. Writes everything (plans as JSON, the timeline PNGs, the pipeline's Perfetto trace)
   to a new run directory, printed at the end.

Usage: python experiments/quickstart.py [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

import hetshard  # noqa: E402
import hetshard_models as models  # noqa: E402
from hetshard._plan import Context, Plan  # noqa: E402
from hetshard.cost.profile import profile_program  # noqa: E402
from hetshard.sim import simulate, write_chrome_trace, write_timeline_png  # noqa: E402
from hetshard.sim.simulator import annotate  # noqa: E402
from hetshard.solver import PlannerOptions  # noqa: E402
from hetshard.solver.baselines import BASELINES, run_baseline  # noqa: E402
from hetshard.solver.uniform import stage_bounds  # noqa: E402
from hetshard_models import data, losses  # noqa: E402
from hetshard_models.steps import make_plan, profile  # noqa: E402

BIG_MODEL, SEQ = "llama-13b", 2048
BIG_CLUSTER, BIG_BATCH = "h100-a100-v100-x32", 256
FAKE_CLUSTER, FAKE_BATCH = "h100-a100-v100-x8", 32
# The model trained on the fake devices: a LLaMA block (RMSNorm, RoPE, SwiGLU) at toy
# width, float32 so that every step can be compared with one device.
SMALL = ("gpt:layers=8,hidden=64,heads=4,kv_heads=4,ffn=128,vocab=256,seq=64,pos=rope,"
         "norm=rmsnorm,mlp=swiglu,tied=false,bias=false,dtype=float32")
SMALL_SEQ = 64
LEARNING_RATE = 1e-3
# Both big plans: bfloat16, with the V100s (no bfloat16 tensor cores) computing in
# float16 under loss scaling; blocks whole (the small model is scaled by blocks).
OPTIONS = PlannerOptions(time_limit_s=15, gpu_dtypes="fastest", split_blocks=False)


def step_fn(model, optimizer, batch):
    """The train step: what hetshard.jit traces and runs."""
    loss, grads = hetshard.value_and_grad(losses.text_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def used_devices(plan: Plan) -> set[int]:
    return {d for p in plan.pipelines for st in p.stages for d in st.devices}


def by_type(cluster, devices) -> str:
    counts: dict[str, int] = {}
    for d in sorted(devices):
        name = cluster.gpu_of(d).name
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {t}" for t, n in counts.items()) or "none"


def scaled(plan: Plan, big, small, program) -> Plan:
    """``plan`` (for the profile ``big``) on the small model (``small``, its program):
    the same pipelines, stages, devices, meshes, remat, batch shares, micro-batches and
    schedule; each stage's blocks in proportion (each keeps at least one; the
    embedding stays on the first stage, the head on the last)."""
    big_blocks = set(big.block_indices())
    n_small = len(small.block_indices())
    pipes = []
    for pipe in plan.pipelines:
        counts = [sum(1 for i in range(st.start, st.end) if i in big_blocks)
                  for st in pipe.stages]
        if len(counts) > n_small:
            raise SystemExit(f"the plan has {len(counts)} stages; the small model "
                             f"{n_small} blocks")
        want = np.array(counts, float) * n_small / sum(counts)
        new = np.maximum(np.floor(want).astype(int), 1)
        while new.sum() < n_small:  # largest remainders first
            new[int(np.argmax(want - new))] += 1
        while new.sum() > n_small:
            new[int(np.argmax(np.where(new > 1, new - want, -np.inf)))] -= 1
        bounds = stage_bounds(small, len(counts), tuple(int(c) for c in new))
        stages = []
        for st, (a, b) in zip(pipe.stages, bounds, strict=True):
            k = st.remat_layers
            stages.append(dataclasses.replace(
                st, start=a, end=b, shardings=(), activations=(), predicted_fwd_s=0.0,
                predicted_bwd_s=0.0, predicted_memory_bytes=0.0,
                remat_layers=None if k is None else min(b - a, round(k * (b - a) /
                                                                   (st.end - st.start)))))
        pipes.append(dataclasses.replace(pipe, stages=tuple(stages)))
    cp = plan.context.degree
    context = Context(cp, (SMALL_SEQ // cp,) * cp, True) if cp > 1 else Context()
    return Plan(model=program.name, cluster=plan.cluster, global_batch=plan.global_batch,
                seq_len=SMALL_SEQ, pipelines=tuple(pipes), context=context,
                dtype="float32", fsdp=plan.fsdp,
                distributed_optimizer=plan.distributed_optimizer, attention="reference",
                tp_overlap=plan.tp_overlap, fingerprint=small.fingerprint)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None,
                    help="run directory (default: a new one under $TMPDIR/hetshard-quickstart)")
    args = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)  # piped: not cut to 80
    t0 = time.time()
    out = args.out or tempfile.mkdtemp(prefix="run-", dir=_runs_root())
    os.makedirs(out, exist_ok=True)
    checks = run(args.steps, out, console)
    for what, ok in checks.items():
        console.print(f"  {'ok' if ok else 'FAILED'}: {what}")
    ok = all(checks.values())
    console.print(f"run directory: {out} (plan.json, plan_schedule.png, trained_plan.json, "
                  f"trained_schedule.png, trained_trace.json)")
    console.print(f"{'OK' if ok else 'FAILED'} in {time.time() - t0:.1f} s")
    return 0 if ok else 1


def run(steps: int, out: str, console: Console) -> dict[str, bool]:
    """Sections 1 and 2 (see the module docstring), writing into ``out``; what they
    showed, by name."""

    # 1. A model size where a mixed cluster matters, shape-only.
    cluster = hetshard.Cluster.load(BIG_CLUSTER)
    console.print(f"[bold]1. {BIG_MODEL} on {cluster.name}: "
                  f"{by_type(cluster, range(cluster.num_devices))}[/bold]")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(BIG_MODEL, cluster, global_batch=BIG_BATCH, seq_len=SEQ,
                         options=OPTIONS, shardings=False)
        prof = profile(BIG_MODEL, SEQ, "bfloat16")
        baselines = {name: run_baseline(name, BIG_MODEL, prof, cluster, BIG_BATCH, SEQ,
                                        OPTIONS) for name in BASELINES}
    console.print(plan.explain())
    result = simulate(plan, prof, cluster)
    write_timeline_png(result, os.path.join(out, "plan_schedule.png"), plan=plan,
                       title=f"hetshard's plan for {BIG_MODEL} on {cluster.name} "
                             f"(simulated)")
    plan.save(os.path.join(out, "plan.json"))
    speed = Table(title=f"{BIG_MODEL}, global batch {BIG_BATCH} x {SEQ} tokens: simulated "
                        f"throughput, one simulator for every planner")
    for col in ("planner", "tokens/s", "fits", "hetshard speed-up", "GPUs used",
                "GPUs left idle"):
        speed.add_column(col)
    everyone = set(range(cluster.num_devices))
    mine = used_devices(plan)
    speed.add_row("hetshard", f"{plan.predicted.tokens_per_s:,.0f}", "True", "1.00x",
                  by_type(cluster, mine), by_type(cluster, everyone - mine))
    gains = {}
    for name, base in baselines.items():
        ok = bool(base and base.predicted.fits)
        tps = base.predicted.tokens_per_s if ok else 0.0
        gains[name] = plan.predicted.tokens_per_s / tps if tps else float("inf")
        used = used_devices(base) if base else set()
        speed.add_row(name, f"{tps:,.0f}" if ok else "-", str(ok),
                      f"{gains[name]:.2f}x" if tps else "-",
                      by_type(cluster, used) if base else "no plan",
                      by_type(cluster, everyone - used) if base else "-")
    console.print(speed)

    # 2. The same kind of plan, trained for real on the 8 fake devices.
    small_cluster = hetshard.Cluster.load(FAKE_CLUSTER)
    bound = small_cluster.bind()
    console.print(f"[bold]2. {BIG_MODEL} planned on {small_cluster.name} "
                  f"({by_type(small_cluster, range(small_cluster.num_devices))}; JAX "
                  f"devices {[d.id for d in bound.devices]}), scaled onto a small LLaMA "
                  f"and trained[/bold]")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        big8 = make_plan(BIG_MODEL, small_cluster, global_batch=FAKE_BATCH, seq_len=SEQ,
                         options=OPTIONS, shardings=False)
    console.print(big8.explain())
    config = models.resolve(SMALL)
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, big8.global_batch, SMALL_SEQ, config.vocab)
               for _ in range(4)]
    model = models.build(config, rngs=0)
    optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)
    program = hetshard.Program(step_fn, (model, optimizer, batches[0]), name="llama-small")
    small_prof = profile_program(program)
    small_plan = scaled(big8, profile(BIG_MODEL, SEQ, "bfloat16"), small_prof, program)
    piped = simulate(small_plan, small_prof, small_cluster)
    small_plan = annotate(small_plan, piped)  # its own predictions, at its size
    small_plan.save(os.path.join(out, "trained_plan.json"))
    write_chrome_trace(piped, os.path.join(out, "trained_trace.json"), small_plan)
    write_timeline_png(piped, os.path.join(out, "trained_schedule.png"), plan=small_plan,
                       title=f"the plan trained below, on {small_cluster.name} (simulated)")

    @nnx.jit
    def ref_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(losses.text_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    train_step = hetshard.jit(step_fn, cluster=small_cluster, plan=small_plan)
    ref_model = models.build(config, rngs=0)
    ref_opt = nnx.Optimizer(ref_model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)
    step_losses, max_rel = [], 0.0
    with Progress(console=console) as progress:
        task = progress.add_task("training", total=steps)
        for i in range(steps):
            batch = batches[i % len(batches)]
            ref_loss = float(ref_step(ref_model, ref_opt, batch))
            loss = float(train_step(model, optimizer, batch))
            max_rel = max(max_rel, abs(loss - ref_loss) / abs(ref_loss))
            step_losses.append(loss)
            progress.update(task, advance=1, description=f"step {i + 1} loss {loss:.4f}")
    console.print(small_plan.explain())
    console.print("(at this size the step is bound by the host's dispatch of its 32 "
                  "micro-batches: what this section shows is the plan's structure running "
                  "correctly, not its speed)")
    console.print(f"loss: first {step_losses[0]:.4f} -> last {step_losses[-1]:.4f}; largest "
                  f"relative difference from the single-device run: {max_rel:.2e}")

    types_big = {cluster.gpu_of(d).name for d in mine}
    types_trained = {small_cluster.gpu_of(d).name for d in used_devices(small_plan)}
    stages = sum(len(p.stages) for p in small_plan.pipelines)
    checks = {
        "the big plan uses more than one GPU type": len(types_big) > 1,
        "it beats fastest-only": gains["fastest-only"] > 1.0,
        "the trained plan spans GPU types over several stages or pipelines":
            len(types_trained) > 1 and (stages > 1 or len(small_plan.pipelines) > 1),
        "the loss falls": step_losses[-1] < step_losses[0],
        "every step matches one device (<= 1e-5)": max_rel <= 1e-5,
    }
    return checks


def _runs_root() -> str:
    root = os.path.join(tempfile.gettempdir(), "hetshard-quickstart")
    os.makedirs(root, exist_ok=True)
    return root


if __name__ == "__main__":
    sys.exit(main())
