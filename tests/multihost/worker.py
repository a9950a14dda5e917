"""A multi-process check run by tests/test_multihost.py under ``hetshard launch``.

Usage: python worker.py MODE  (MODE: dp | user | pipelines | idle | fingerprint | die | kill |
raise)
Prints ``LOSSES <json>`` and ``REF <json>`` lines that the test compares (``pipelines``:
``LOSSES <scenario> <json>`` per scenario, ``REF`` lines from process 0 only).
"""

import dataclasses
import json
import os
import signal
import sys
import time

import hetshard.distributed as hd

hd.init_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import hetshard  # noqa: E402
import hetshard_models as models  # noqa: E402
from hetshard._plan import Pipeline, Plan, Stage  # noqa: E402
from hetshard.errors import DeviceBindingError  # noqa: E402
from hetshard.solver.uniform import parse_fix, uniform_plan  # noqa: E402
from hetshard_models import data, losses  # noqa: E402
from hetshard_models import profile as profile_model  # noqa: E402

MODEL = "gpt-tiny"


loss_fn, mllm_loss = losses.text_loss, losses.mllm_loss


# Groups pinned to processes in reverse order: spec ids 0-3 (the "H100s") are process 1's
# devices, ids 4-7 (the "V100s") process 0's.
SPLIT_SPEC = {"name": "two-hosts", "inter_group_gbs": 25.0, "groups": [
    {"name": "h100", "gpu": "H100-80GB", "nodes": 1, "gpus_per_node": 4, "processes": [1]},
    {"name": "v100", "gpu": "V100-32GB", "nodes": 1, "gpus_per_node": 4, "processes": [0]}]}


def _stage(start, end, devices, gpu="cpu", **axes):
    shape = tuple(axes.items()) or (("data", len(devices)),)
    return Stage(start, end, tuple(devices), gpu, shape)


def _train(name, loss, cluster, plan, batches, steps, planned=False):
    """Losses of ``steps`` SGD steps: on one local device (no cluster), or under
    ``hetshard.jit`` with ``plan`` (or the planner's plan when ``planned``); also returns
    the pipeline runner (the plan when ``planned``)."""
    model = models.build(name, rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    if plan is None and not planned:
        @nnx.jit
        def step(model, optimizer, batch):
            loss_value, grads = nnx.value_and_grad(loss)(model, batch)
            optimizer.update(model, grads)
            return loss_value
        with jax.default_device(jax.local_devices()[0]):
            return [float(step(model, opt, batches[i % 2])) for i in range(steps)], None

    @hetshard.jit(cluster=cluster, plan=plan)
    def step(model, optimizer, batch):
        loss_value, grads = hetshard.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return loss_value
    losses = [float(step(model, opt, batches[i % 2])) for i in range(steps)]
    if planned:
        return losses, step.plan
    runner = getattr(next(iter(step._compiled.values())), "runner", None)  # MPMD plans
    return losses, runner


def pipelines() -> None:
    """Pipelines spread over the two processes; each scenario's losses vs one device."""
    rank = jax.process_index()
    local = hetshard.Cluster.from_jax_devices()
    rng = np.random.default_rng(0)
    text = [data.text_batch(rng, 8, 16, 256) for _ in range(2)]
    cpu = local.groups[0].gpu.name
    scenarios = {
        # One stage per process; different layouts (2x2 tensor-split vs 4-way data), so
        # activations take the gathered route; the tied embedding's gradient and copy
        # cross processes too.
        "pp2": (MODEL, loss_fn, local, [Pipeline((
            _stage(0, 2, (0, 1, 2, 3), cpu, data=2, tensor=2),
            _stage(2, 4, (4, 5, 6, 7), cpu, data=4)), 8, 1, 4)], text, 16),
        # A middle stage whose 2x2 mesh spans both processes: its program runs on both,
        # activations into and out of it are broadcast/gathered across processes.
        "span": (MODEL, loss_fn, local, [Pipeline((
            _stage(0, 1, (0, 1), cpu, data=2),
            _stage(1, 3, (2, 3, 4, 5), cpu, data=2, tensor=2),
            _stage(3, 4, (6, 7), cpu, data=1, tensor=2)), 8, 2, 2)], text, 16),
        # The same under ZB-H1: the B and W passes of the spanning stage run on both
        # processes, W with no transfer, every process walking the same order; that
        # stage keeps its optimizer state (the momentum) in each process's host memory.
        "span_zb": (MODEL, loss_fn, local, [Pipeline((
            _stage(0, 1, (0, 1), cpu, data=2),
            dataclasses.replace(_stage(1, 3, (2, 3, 4, 5), cpu, data=2, tensor=2),
                                offload=("optimizer",)),
            _stage(3, 4, (6, 7), cpu, data=1, tensor=2)), 8, 2, 2, schedule="zbh1")],
            text, 16),
        # Two pipelines with shares 5:3 and different layer splits, one per process:
        # gradients summed across processes through transfers.
        "pipes": (MODEL, loss_fn, local, [
            Pipeline((_stage(0, 1, (0,), cpu), _stage(1, 4, (1, 2, 3), cpu, data=1, tensor=3)),
                     5, 1, 5),
            Pipeline((_stage(0, 3, (4, 5, 6), cpu, data=1, tensor=3), _stage(3, 4, (7,), cpu)),
                     3, 1, 3)], text, 16),
        # Two congruent single-stage pipelines, one per process: one psum across them.
        "pipes_eq": (MODEL, loss_fn, local, [
            Pipeline((_stage(0, 4, (0, 1, 2, 3), cpu),), 4, 1, 1),
            Pipeline((_stage(0, 4, (4, 5, 6, 7), cpu),), 4, 1, 1)], text, 16),
    }
    config = models.resolve("llava-tiny")
    mllm = [data.mllm_batch(rng, 8, config, seq_len=64) for _ in range(2)]
    split = hetshard.Cluster.load(SPLIT_SPEC)
    # ViT + projector on the "V100s" (process 0), the language model on the "H100s"
    # (process 1); same 2x2 layouts, so activations go shard to shard.
    scenarios["mllm"] = ("llava-tiny", mllm_loss, split, [Pipeline((
        _stage(0, 5, (4, 5, 6, 7), "V100-32GB", data=2, tensor=2),
        _stage(5, 9, (0, 1, 2, 3), "H100-80GB", data=2, tensor=2)), 8, 2, 2)], mllm, 64)
    bound = split.bind()
    print("BOUND", json.dumps([d.process_index for d in bound.devices]), flush=True)
    # Both groups pinned to process 0, which has 4 devices, not 8: a clear error.
    bad = dict(SPLIT_SPEC, groups=[dict(g, processes=[0]) for g in SPLIT_SPEC["groups"]])
    try:
        hetshard.Cluster.load(bad).bind()
    except DeviceBindingError as e:
        print("BINDERR", str(e), flush=True)
    for name, (model_name, loss, cluster, pipes, batches, seq) in scenarios.items():
        plan = Plan(model_name, cluster.to_dict(), 8, seq, tuple(pipes))
        losses, runner = _train(model_name, loss, cluster, plan, batches, 3)
        runs = [r for row in runner.runs for r in row]
        info = {"losses": losses,
                # (pipeline, stage) pairs this process runs, and the processes of each
                "mine": [[pi, si] for pi, row in enumerate(runner.runs)
                         for si, r in enumerate(row) if r.here],
                "procs": [[sorted({d.process_index for d in r.mesh.devices.flat})
                           for r in row] for row in runner.runs],
                # programs compiled here for stages on the other process's devices
                "foreign_compiled": sum(r.fwd._cache_size() + r.bwd._cache_size() +
                                        r.bwd_input._cache_size() +
                                        r.bwd_weight._cache_size() +
                                        r.apply._cache_size() for r in runs if not r.here),
                "zb_compiled": sum(r.bwd_weight._cache_size() for r in runs if r.here),
                "own_compiled": sum(r.fwd._cache_size() for r in runs if r.here),
                # state leaves this process holds in host memory (Stage.offload)
                "host_leaves": sum(1 for row, held in zip(runner.runs, runner.views,
                                                          strict=True)
                                   for r, view in zip(row, held, strict=True) if r.here
                                   for x in view.values()
                                   if x.sharding.memory_kind == "pinned_host")}
        print("LOSSES", name, json.dumps(info), flush=True)
        if rank == 0:
            want, _ = _train(model_name, loss, None, None, batches, 3)
            print("REF", name, json.dumps(want), flush=True)


def idle() -> None:
    """Plans that leave a process without a device (2 processes x 4 devices, or 3 x 2):
    every process calls the step, the idle ones run no part of it, and every process
    gets the step's outputs as one process would (``LOSSES <scenario> <json>``)."""
    rank, count = jax.process_index(), jax.process_count()
    local = hetshard.Cluster.from_jax_devices()
    cpu = local.groups[0].gpu.name
    rng = np.random.default_rng(0)
    text = [data.text_batch(rng, 8, 16, 256) for _ in range(2)]
    if count == 2:
        scenarios = {
            # Everything on process 0's devices: process 1 idle.
            "single_p0": [Pipeline((_stage(0, 4, (0, 1, 2, 3), cpu),), 8, 2, 1)],
            "pipe_p0": [Pipeline((_stage(0, 2, (0, 1), cpu), _stage(2, 4, (2, 3), cpu)),
                                 8, 2, 2)],
            # Everything on process 1's devices: process 0 idle.
            "single_p1": [Pipeline((_stage(0, 4, (4, 5), cpu, data=1, tensor=2),), 8, 8, 1)],
        }
    else:
        scenarios = {
            # One stage over processes 0 and 1; process 2 idle.
            "span_single": [Pipeline((_stage(0, 4, (0, 1, 2, 3), cpu),), 8, 2, 1)],
            # A stage over processes 0 and 1, the next on process 1; process 2 idle.
            "span_pipe": [Pipeline((_stage(0, 2, (1, 2), cpu), _stage(2, 4, (3,), cpu)),
                                   8, 2, 2)],
            # Process 0 idle, the stages on processes 1 and 2.
            "pipe_p12": [Pipeline((_stage(0, 2, (2, 3), cpu), _stage(2, 4, (4, 5), cpu)),
                                  8, 2, 2)],
        }
    if count == 2:
        # The case: the planner's own plan on a mixed cluster whose fastest GPUs
        # are all process 0's (2 "H100" + 2 "A100" there, 4 "V100" in process 1).
        mixed = hetshard.Cluster.load({"name": "mixed", "inter_group_gbs": 25.0, "groups": [
            {"name": "h100", "gpu": "H100-80GB", "nodes": 1, "gpus_per_node": 2,
             "processes": [0]},
            {"name": "a100", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 2,
             "processes": [0]},
            {"name": "v100", "gpu": "V100-32GB", "nodes": 1, "gpus_per_node": 4,
             "processes": [1]}]})
        losses, plan = _train(MODEL, loss_fn, mixed, None, text, 3, planned=True)
        used = sorted({mixed.bind().devices[i].process_index for p in plan.pipelines
                       for st in p.stages for i in st.devices})
        print("LOSSES", "planned", json.dumps({"losses": losses, "runs": rank in used,
                                                "used": used}), flush=True)
        if rank == 0:
            want, _ = _train(MODEL, loss_fn, None, None, text, 3)
            print("REF", "planned", json.dumps(want), flush=True)
    for name, pipes in scenarios.items():
        plan = Plan(MODEL, local.to_dict(), 8, 16, tuple(pipes))
        losses, runner = _train(MODEL, loss_fn, local, plan, text, 3)
        here = sorted({d.process_index for p in pipes for st in p.stages
                       for d in (jax.devices()[i] for i in st.devices)})
        print("LOSSES", name, json.dumps({"losses": losses, "runs": rank in here}), flush=True)
        if rank == 0:
            want, _ = _train(MODEL, loss_fn, None, None, text, 3)
            print("REF", name, json.dumps(want), flush=True)


def user_programs() -> None:
    """Models written in the tests (tests/user_models.py: an NNX transformer without
    scopes, a params-dict step with optax.lion) in a pipeline whose two stages run in
    the two processes, each a different layout."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import user_models
    rank = jax.process_index()
    local = hetshard.Cluster.from_jax_devices()
    cpu = local.groups[0].gpu.name
    for name in ("transformer", "functional"):
        step, args, batches = user_models.MODELS[name]()
        program = hetshard.Program(step, args)
        n = program.layering(2).num_layers
        plan = Plan(program.name, local.to_dict(), 8, program.seq_len, (Pipeline((
            _stage(0, n // 2, (0, 1, 2, 3), cpu, data=2, tensor=2),
            _stage(n // 2, n, (4, 5, 6, 7), cpu, data=4)), 8, 1, 4),), attention="reference")
        losses = _user_train(hetshard.jit(step, cluster=local, plan=plan), args, batches)
        print("LOSSES", name, json.dumps(losses), flush=True)
        if rank == 0:
            step, args, batches = user_models.MODELS[name]()
            jitted = nnx.jit(step) if isinstance(args[0], nnx.Module) else jax.jit(step)
            with jax.default_device(jax.local_devices()[0]):
                print("REF", name, json.dumps(_user_train(jitted, args, batches)), flush=True)


def _user_train(step, args, batches, steps=3):
    args, losses = list(args), []
    for i in range(steps):
        args[-1] = batches[i % len(batches)]
        out = step(*args)
        if isinstance(out, tuple):
            out, *state = out
            args[:len(state)] = state
        losses.append(float(out))
    return losses


def _failing_now():
    """Wall-clock time of the failure, for the test to time the job's end from it."""
    print(f"FAILING_AT {time.time()!r}", flush=True)


def main(mode: str) -> int:
    rank = jax.process_index()
    print(f"process {rank} of {jax.process_count()}, {len(jax.local_devices())} local "
          f"devices, {len(jax.devices())} in all", flush=True)
    if mode == "die":
        if rank == 1:
            _failing_now()
            os._exit(3)
        # The survivor blocks in a collective that process 1 never joins.
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("never completes")
        return 0
    if mode == "kill":
        if rank == 1:
            _failing_now()
            os.kill(os.getpid(), signal.SIGKILL)
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("never completes")
        return 0
    if mode == "raise":
        if rank == 1:
            _failing_now()
            raise ValueError("rank one broke")
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("never completes")
        return 0
    if mode == "pipelines":
        pipelines()
        return 0
    if mode == "idle":
        idle()
        return 0
    if mode == "user":
        user_programs()
        return 0
    if mode == "fingerprint":
        hd.agree("same", "test value")
        try:
            hd.agree(f"value-of-{rank}", "test value")
        except hd.DistributedError as e:
            print(f"MISMATCH {e}", flush=True)
        return 0
    cluster = hetshard.Cluster.from_jax_devices()
    print("CLUSTER", json.dumps([[g.name, g.nodes, g.gpus_per_node, list(g.processes)]
                                 for g in cluster.groups]), flush=True)
    prof = profile_model(MODEL, 16, "float32")
    plan = uniform_plan(MODEL, prof, cluster, global_batch=8, seq_len=16,
                        fix=parse_fix("dp=8,tp=1,pp=1"))
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, 8, 16, 256) for _ in range(2)]
    losses, _ = _train(MODEL, loss_fn, cluster, plan, batches, 3)
    want, _ = _train(MODEL, loss_fn, None, None, batches, 3)
    print("LOSSES", json.dumps(losses), flush=True)
    print("REF", json.dumps(want), flush=True)
    # What each process holds, process 0's everywhere (a planned plan travels this way).
    from hetshard.distributed import from_first
    print("FIRST", json.dumps(from_first(f"process {rank} " + "x" * (5 - 3 * rank))),
          flush=True)
    # No plan given: every process runs process 0's plan (checked by fingerprint).
    planned, step_plan = _train(MODEL, loss_fn, cluster, None, batches, 3, planned=True)
    print("PLANNED", json.dumps({"losses": planned, "plan": [
        [[list(st.devices), list(st.mesh_shape)] for st in p.stages]
        for p in step_plan.pipelines]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
