"""hetshard quickstart: a tiny multimodal model on a heterogeneous cluster emulated by
8 fake CPU devices.

What runs today (the foundation): the cluster spec ``h100-a100-v100-x8`` (2x H100,
2x A100, 4x V100) is bound onto 8 fake CPU devices, the tiny LLaVA-style model is
built, and it trains on a synthetic packed multimodal data set with plain JAX data
parallelism over the bound devices, checked step by step against a single-device
run. The planner, simulator and heterogeneous runtime replace the plain data
parallelism as they land (see the README's status table).

Usage: python experiments/quickstart.py [--steps N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

import hetshard  # noqa: E402
import models  # noqa: E402
from models import data  # noqa: E402

# At 3e-3 this tiny model trains chaotically enough that float32 reduction-order noise
# (8-way data-parallel sums vs one device) grows to 1.4e-5 relative by step 47; at 1e-3
# it stays near 2.5e-7 (measured; see README).
LEARNING_RATE = 1e-3


def loss_fn(model, batch):
    logits = model(batch["tokens"], batch["images"], batch["image_index"],
                   positions_bs=batch["positions"], segment_ids_bs=batch["segment_ids"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return (ce * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


def make_step():
    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss
    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--global-batch", type=int, default=8)
    args = ap.parse_args()
    console = Console()
    t0 = time.time()

    cluster = hetshard.Cluster.load("h100-a100-v100-x8")
    bound = cluster.bind()
    table = Table(title=f"cluster {cluster.name!r} bound to {len(bound.devices)} JAX devices")
    for col in ("group", "GPU", "count", "bf16 TFLOP/s", "memory GB", "JAX devices"):
        table.add_column(col)
    for g in cluster.groups:
        ids = [d.id for d in bound.group_devices(g.name)]
        table.add_row(g.name, g.gpu.name, str(g.num_devices),
                      f"{g.gpu.peak_flops() / 1e12:.1f}", f"{g.gpu.memory_gb:g}", str(ids))
    console.print(table)

    config = models.mllm.preset("llava-tiny")
    console.print(f"model {config.name}: {config.num_params():,} parameters "
                  f"(ViT {config.vision.layers} layers + LLaMA-style decoder "
                  f"{config.text.layers} layers, {config.image_tokens} tokens per image)")

    rng = np.random.default_rng(0)
    batches = [data.mllm_batch(rng, args.global_batch, config, seq_len=64)
               for _ in range(4)]

    # Reference: one device. Candidate: data parallel over the bound cluster devices.
    ref_model = models.build(config, rngs=0)
    ref_opt = nnx.Optimizer(ref_model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)
    mesh = Mesh(np.array(bound.devices), ("data",))
    model = models.build(config, rngs=0)
    opt = nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)
    replicated = NamedSharding(mesh, PartitionSpec())
    nnx.update((model, opt), jax.device_put(nnx.state((model, opt)), replicated))
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
    ref_step, dp_step = make_step(), make_step()

    losses, max_rel = [], 0.0
    with Progress(console=console) as progress:
        task = progress.add_task("training (data parallel on 8 fake devices)", total=args.steps)
        for i in range(args.steps):
            batch = batches[i % len(batches)]
            ref_loss = float(ref_step(ref_model, ref_opt, batch))
            loss = float(dp_step(model, opt, jax.device_put(batch, batch_sharding)))
            max_rel = max(max_rel, abs(loss - ref_loss) / abs(ref_loss))
            losses.append(loss)
            progress.update(task, advance=1, description=f"step {i + 1} loss {loss:.4f}")

    console.print(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f}")
    console.print(f"largest relative difference from the single-device run: {max_rel:.2e}")
    ok = losses[-1] < losses[0] and max_rel <= 1e-5
    console.print(f"{'OK' if ok else 'FAILED'} in {time.time() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
