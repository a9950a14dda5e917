"""Data-aware planning: a plan per global batch of variable-length documents, in the
simulator's cost model.

Global batches are sampled from the 1M Wikipedia document lengths FlexSP published
(``experiments/data/lengths/wikipedia-flexsp.txt.gz``; documents longer than the maximum
context are cut to it, as FlexSP does), at 32K and 128K maximum context, for llama-7b on
homogeneous and mixed clusters of 32 and 64 GPUs, plus an MLLM mixture (llama-7b with a
ViT-L/14 encoder; 0-8 images per sample, each 256 tokens in the language model; a
row holds a fixed number of image slots per bucket, every slot encoded, split over the
row's context group, sized from the calibration batches where that prices faster). Each
batch is planned four ways and priced by the same model (``hetshard.data.plan_batch``),
each way on the outer plan it does best on: ``hetshard.data.choose_groups`` splits each
GPU type into 1, 2, 4 or 8 data-parallel replicas (node-aligned; at most 8 compiled
micro-step programs a run) and keeps the split with the least step time over four
calibration batches drawn apart from the eight measured ones:

* ``pad``: every sample padded to the maximum context (a static plan for the longest);
* ``fixed-cp``: Megatron-LM-style packing (samples concatenated into maximum-context
  rows, one context degree for all: the replica's devices), static batch shares by
  throughput; ``fixed-cp-whole`` is the same on one replica per GPU type (the context
  ring over all of a type's devices), the baseline before replicas were chosen;
* ``identical``: the per-batch planner believing all GPUs are the cluster's average one
  (FlexSP's planner is made for identical GPUs);
* ``hetshard``: the per-batch planner with each GPU type's priced costs.

Reported per configuration: tokens/s over all batches, hetshard's per-batch planning
time (median and max over the batches, on this machine; each batch is planned
``--repeats`` times, the same plan every time, and its time is the fastest run, as
``timeit`` reports: this 2-core machine's speed varies up to twofold from run to run;
the slowest single run is kept as ``planning_ms_max_single_run``), the number of
compiled micro-step shapes over the run, the median gap to the lower bound, and the
bound's speedup over fixed-cp packing (no per-batch plan on hetshard's replicas can
beat it), and the replicas each method chose. A PNG shows every batch's step time.

``--attention-scale S`` prices attention on every GPU type at ``S`` times the cost
model's default rate (FlashAttention-2's published one) and writes
``data_aware_attention_x{S}.json`` instead: hetshard's own kernel ran at about a quarter
of that rate on the one GPU measured (an H200, ``packed_step_gpu.py``), so ``0.25``
asks whether the speedups hold where attention costs what that kernel makes it cost
(an assumption for the A100, H100 and V100 groups priced here, none of them measured).

Usage: python experiments/data_aware.py [--batches N] [--repeats R] [--attention-scale S]
Writes experiments/results/data_aware.json and data_aware.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import json
import os
import time

import numpy as np
from long_context import DGX_A100, DGX_H100, DGX_V100  # the DGX node specs

from hetshard.cluster import Cluster
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.stage import attention_rate
from hetshard.data import METHODS, choose_groups, group_costs, plan_batch
from hetshard_models import profile as profile_model

HERE = os.path.dirname(os.path.abspath(__file__))
LENGTHS = os.path.join(HERE, "data", "lengths", "wikipedia-flexsp.txt.gz")

def _cluster(name: str, *groups) -> Cluster:
    return Cluster.from_dict({
        "name": name, "inter_group_gbs": 100.0,
        "groups": [{"name": f"{spec['gpu'].split('-')[0].lower()}", "nodes": nodes, **spec}
                   for spec, nodes in groups]})


CLUSTERS = {
    "a100-x32": lambda: _cluster("a100-x32", (DGX_A100, 4)),
    "h100-a100-x32": lambda: _cluster("h100-a100-x32", (DGX_H100, 2), (DGX_A100, 2)),
    "a100-x64": lambda: _cluster("a100-x64", (DGX_A100, 8)),
    "h100-a100-x64": lambda: _cluster("h100-a100-x64", (DGX_H100, 4), (DGX_A100, 4)),
    "a100-v100-x64": lambda: _cluster("a100-v100-x64", (DGX_A100, 4), (DGX_V100, 4)),
}
# (cluster, max context, multimodal)
RUNS = [(c, m, False) for c in CLUSTERS for m in (32768, 131072)] + [
    ("h100-a100-x32", 32768, True), ("a100-v100-x64", 32768, True)]
TOKENS_PER_GPU = 32768  # per global batch
IMAGE_TOKENS = 256  # ViT-L/14 at 224 px: 16 x 16 patches


def draw(lengths: np.ndarray, rng, cluster, max_context: int, mllm: bool):
    """One global batch: sample lengths and (multimodal) images per sample."""
    batch = sample_batch(lengths, rng, TOKENS_PER_GPU * cluster.num_devices, max_context)
    if not mllm:
        return batch, None
    images = rng.integers(0, 9, batch.size)
    # the text part leaves room for the images' tokens
    return np.maximum(1, np.minimum(batch, max_context - images * IMAGE_TOKENS)), images


def sample_batch(lengths: np.ndarray, rng, tokens: int, max_context: int):
    out, total = [], 0
    while total < tokens:
        n = int(min(lengths[rng.integers(lengths.size)], max_context))
        out.append(n)
        total += n
    return np.asarray(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3,
                    help="plannings of each batch (the same plan); its time is the fastest")
    ap.add_argument("--attention-scale", type=float, default=1.0,
                    help="attention priced at this times the default rate (module docstring)")
    args = ap.parse_args()
    t_start = time.time()
    with gzip.open(LENGTHS) as f:
        lengths = np.loadtxt(f, dtype=np.int64)
    text = profile_model("llama-7b", seq_len=4096)
    vision = profile_model("vit-l14")
    rows = []
    for name, max_context, mllm in RUNS:
        cluster = CLUSTERS[name]()
        dtypes = {"V100-32GB": "float16"}  # no bfloat16 tensor cores (gpu_dtypes="fastest")
        costs = dict(dtypes=dtypes, vision=vision if mllm else None,
                     image_tokens=IMAGE_TOKENS if mllm else 0)
        cal = scaled_attention(cluster, dtypes, args.attention_scale)
        if cal is not None:
            costs["cal"] = cal
        # Calibration batches (their own seed) choose each method's replicas; the
        # measured batches are drawn apart.
        calib = [draw(lengths, np.random.default_rng(1000 + k), cluster, max_context, mllm)
                 for k in range(4)]
        cal_images = [i for _, i in calib] if mllm else None
        chosen, choose_s = {}, {}
        for m in METHODS:
            t0 = time.perf_counter()
            chosen[m] = choose_groups(text, cluster, [b for b, _ in calib],
                                      images=cal_images, max_context=max_context,
                                      method=m, **costs)
            choose_s[m] = time.perf_counter() - t0
        whole = group_costs(text, cluster, max_context=max_context, **costs)
        rng = np.random.default_rng(0)
        per = {m: {"times": [], "tokens": 0, "planning": [], "planning_runs": [], "gaps": [],
                   "shapes": set()} for m in (*METHODS, "fixed-cp-whole")}
        bounds = []  # per batch: no plan on hetshard's replicas is faster (lower_bound)
        for _ in range(args.batches):
            batch, images = draw(lengths, rng, cluster, max_context, mllm)
            for m in (*METHODS, "fixed-cp-whole"):
                groups = whole if m == "fixed-cp-whole" else chosen[m]
                planned = functools.partial(
                    plan_batch, batch, groups, images=images, cluster=cluster,
                    method="fixed-cp" if m == "fixed-cp-whole" else m, max_context=max_context,
                    **({"cal": cal} if cal is not None else {}))
                r = planned(bound=m == "hetshard")
                runs = [r.planning_s] + [planned(bound=False).planning_s
                                         for _ in range(args.repeats - 1)]
                p = per[m]
                p["times"].append(r.step_time_s)
                p["tokens"] += r.tokens
                p["planning"].append(min(runs))  # the same plan each run
                p["planning_runs"].append(max(runs))
                p["gaps"].append(r.gap)
                p["shapes"] |= set(r.shapes)
                if m == "hetshard":
                    bounds.append(r.bound_s)
        row = {"cluster": name, "model": "llava-7b-like" if mllm else "llama-7b",
               "max_context": max_context, "gpus": cluster.num_devices,
               "groups": {m: [{"name": g.name, "gpu": g.gpu, "devices": g.n, "chunk": g.chunk,
                               "remat": g.remat, "long_remat": g.long_remat,
                               "long_chunk": g.long_chunk, "buckets": list(g.buckets),
                               "long_buckets": list(g.long_buckets),
                               "images_per_row": list(g.image_caps())} for g in gs]
                          for m, gs in (*chosen.items(), ("fixed-cp-whole", whole))},
               "choose_s": choose_s, "methods": {}}
        for m, p in per.items():
            row["methods"][m] = {
                "tokens_per_s": p["tokens"] / sum(p["times"]),
                "step_times_s": p["times"],
                "planning_ms_median": 1e3 * float(np.median(p["planning"])),
                "planning_ms_max": 1e3 * max(p["planning"]),
                "planning_ms_max_single_run": 1e3 * max(p["planning_runs"]),
                "compiled_shapes": len(p["shapes"]),
                "gap_median": (float(np.median(p["gaps"])) if m == "hetshard" else None)}
        h = row["methods"]["hetshard"]["tokens_per_s"]
        row["speedup"] = {m: h / row["methods"][m]["tokens_per_s"] for m in per
                          if m != "hetshard"}
        # The most a per-batch plan on hetshard's replicas could gain over fixed-cp
        # packing: its step times over the batches' lower bounds.
        row["bound_s"] = bounds
        row["bound_speedup_over_fixed_cp"] = sum(per["fixed-cp"]["times"]) / sum(bounds)
        rows.append(row)
        hm = row["methods"]["hetshard"]
        print(f"{name:15s} {row['model']:14s} {max_context // 1024:4d}K  hetshard "
              f"{h:10,.0f} tok/s  x{row['speedup']['fixed-cp']:.2f} fixed-cp  "
              f"(x{row['speedup']['fixed-cp-whole']:.2f} whole)  "
              f"x{row['speedup']['identical']:.2f} identical  x{row['speedup']['pad']:.1f} pad  "
              f"plan {hm['planning_ms_median']:.1f}/{hm['planning_ms_max']:.1f} ms  "
              f"shapes {hm['compiled_shapes']}  gap {hm['gap_median']:.1%}  "
              f"bound x{row['bound_speedup_over_fixed_cp']:.2f} fixed-cp  replicas "
              f"{len(chosen['hetshard'])} (fixed-cp {len(chosen['fixed-cp'])})", flush=True)
    out = {"batches": args.batches, "tokens_per_gpu": TOKENS_PER_GPU, "rows": rows,
           "attention_scale": args.attention_scale, "wall_time_s": time.time() - t_start}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    if args.attention_scale != 1.0:
        name = f"data_aware_attention_x{args.attention_scale:g}.json"
        with open(os.path.join(HERE, "results", name), "w") as f:
            json.dump(out, f, indent=1)
        return 0
    with open(os.path.join(HERE, "results", "data_aware.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(rows, os.path.join(HERE, "results", "data_aware.png"))
    return 0


def scaled_attention(cluster, dtypes, scale: float):
    """A calibration pricing attention on each of ``cluster``'s GPU types at ``scale``
    times the default rate (``hetshard.cost.stage.attention_rate``), or None for 1."""
    if scale == 1.0:
        return None
    if not scale > 0:
        raise SystemExit(f"--attention-scale {scale}: a positive number")
    per = []
    for gpu in {g.gpu.name: g.gpu for g in cluster.groups}.values():
        dtype = dtypes.get(gpu.name, "bfloat16")
        rate = attention_rate(gpu, dtype, DEFAULT.for_type(gpu.name))
        per.append((gpu.name, dataclasses.replace(
            DEFAULT.for_type(gpu.name), attention_eff=scale * rate / gpu.peak_flops(dtype))))
    return dataclasses.replace(DEFAULT, per_type=tuple(per),
                               source=f"attention x{scale:g} of the default rate")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = 4
    n = len(rows)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(4 * cols, 3 * ((n + 3) // 4)),
                             squeeze=False)
    for ax, row in zip(axes.flat, rows, strict=False):
        for m, p in row["methods"].items():
            ax.plot(p["step_times_s"], marker="o", ms=3, label=m)
        ax.set_yscale("log")
        ax.set_title(f"{row['cluster']} {row['model']} {row['max_context'] // 1024}K",
                     fontsize=8)
        ax.set_xlabel("batch", fontsize=7)
        ax.set_ylabel("step time (s)", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels))
    fig.suptitle("Per-batch step time, priced: static padding, fixed context parallelism, "
                 "identical-GPU per-batch plans, hetshard", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
