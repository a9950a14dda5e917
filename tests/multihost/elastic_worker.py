"""A 2-process run that checkpoints, loses a process and resumes (tests/test_multihost.py).

Usage (under ``hetshard launch --max-restarts 1``):
    python elastic_worker.py CKPT_DIR STEPS EVERY KILL_AT

On the first start, process 1 kills itself (SIGKILL) after step KILL_AT, once the
checkpoint due by then has landed; the launcher stops process 0 and starts both again.
A start that finds a checkpoint restores it into its plan's layout with
``hetshard.jit(elastic=True)`` and continues. Process 0 prints ``LOSS <step> <loss>``.
"""

import os
import signal
import sys

import hetshard.distributed as hd

hd.init_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import hetshard  # noqa: E402
import hetshard_models as models  # noqa: E402
from hetshard.checkpoint import Checkpointer  # noqa: E402
from hetshard_models import data, losses, steps  # noqa: E402

MODEL = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32"
CLUSTER = {"name": "two-hosts", "inter_group_gbs": 25.0, "groups": [
    {"name": "p0", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 2, "processes": [0]},
    {"name": "p1", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 2, "processes": [1]}]}


def main(ckpt_dir, total, every, kill_at):
    restart = int(os.environ.get(hd.ENV_RESTART, "0"))
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, 8, 32, 128) for _ in range(total)]
    model = models.build(MODEL, rngs=restart)  # a restart's own weights: restored over
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    step = hetshard.jit(steps.train_step(losses.text_loss), cluster=CLUSTER, elastic=True,
                        quiet=True, time_limit_s=5, max_stages=1)
    ckpt = Checkpointer(ckpt_dir, keep=2)
    start = 0
    if ckpt.latest_step() is not None:
        info = ckpt.restore((model, opt), shardings=step.state_shardings(model, opt,
                                                                         batches[0]))
        start = info.data_position
        if jax.process_index() == 0:
            print(f"RESUMED {start} restart {restart}", flush=True)
    for i in range(start, total):
        loss = float(step(model, opt, batches[i]))
        if jax.process_index() == 0:
            print(f"LOSS {i} {loss!r}", flush=True)
        if (i + 1) % every == 0:
            ckpt.save(i + 1, (model, opt), data_position=i + 1)
        if restart == 0 and i + 1 == kill_at:
            ckpt.wait()
            if jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()


if __name__ == "__main__":
    main(sys.argv[1], *(int(x) for x in sys.argv[2:5]))
