"""A multi-process check run by tests/test_multihost.py under ``hetshard launch``.

Usage: python worker.py MODE  (MODE: dp | fingerprint | die)
Prints ``LOSSES <json>`` and ``REF <json>`` lines that the test compares.
"""

import json
import os
import sys

import hetshard.distributed as hd

hd.init_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import hetshard  # noqa: E402
import models  # noqa: E402
from hetshard.cost.profile import profile_model  # noqa: E402
from hetshard.solver.uniform import parse_fix, uniform_plan  # noqa: E402
from models import data  # noqa: E402

MODEL = "gpt-tiny"


def loss_fn(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def main(mode: str) -> int:
    rank = jax.process_index()
    print(f"process {rank} of {jax.process_count()}, {len(jax.local_devices())} local "
          f"devices, {len(jax.devices())} in all", flush=True)
    if mode == "die":
        if rank == 1:
            os._exit(3)
        # The survivor blocks in a collective that process 1 never joins.
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("never completes")
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
                        fix=parse_fix("dp=8,tp=1,pp=1"), dtype="float32")
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, 8, 16, 256) for _ in range(2)]
    model = models.build(MODEL, rngs=0)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @hetshard.jit(cluster=cluster, plan=plan)
    def step(model, optimizer, batch):
        loss, grads = hetshard.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss
    losses = [float(step(model, opt, batches[i % 2])) for i in range(3)]
    ref_model = models.build(MODEL, rngs=0)
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def ref(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss
    local = jax.local_devices()[0]
    with jax.default_device(local):
        want = [float(ref(ref_model, ref_opt, batches[i % 2])) for i in range(3)]
    print("LOSSES", json.dumps(losses), flush=True)
    print("REF", json.dumps(want), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
