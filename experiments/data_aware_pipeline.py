"""Per-batch plans on pipeline outer plans: global batches of variable-length documents
(the 1M Wikipedia lengths FlexSP published, as in ``data_aware.py``) on pipelines whose
stages are different GPU types, priced by the simulator's stage costs.

Outer plans (llama-7b, one GPU type a stage, FSDP over a stage's devices, full remat):
a two-stage pipeline over the two GPU types of each mixed cluster (its layers split
where a micro-batch of the data's average document mix takes the same time on both
stages), the same on a homogeneous cluster (its nodes halved), and two pipelines of
different speeds (H100 nodes one pipeline, A100 nodes the other, two stages each).
Each batch is planned four ways by ``hetshard.data.plan_pipeline_batch``: ``pad``,
``fixed-cp`` (Megatron-LM packing: maximum-context rows in order, a row over all of a
stage's ways as a context ring, micro-batches in order), ``identical`` (the planner
believing every GPU the cluster's average) and ``hetshard``.

Reported per configuration: tokens/s, hetshard's speedups, per-batch planning time
(median, max), compiled shapes (pipeline, bucket), the median gap to the lower bound,
and, where ``data_aware.py`` priced the same cluster and context on data-parallel
replicas, its hetshard tokens/s (which outer plan serves this data better).

Usage: python experiments/data_aware_pipeline.py [--batches N]
Writes experiments/results/data_aware_pipeline.json and data_aware_pipeline.png.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time

import numpy as np
from data_aware import CLUSTERS, LENGTHS, TOKENS_PER_GPU, sample_batch

from hetshard.data import METHODS, pipeline_costs, plan_pipeline_batch
from hetshard.plan import Pipeline, Plan, Stage
from models import profile as profile_model

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = (("V100-32GB", "float16"),)  # no bfloat16 tensor cores
SEQ = 4096


def _stages_of(cluster, parts):
    """(gpu, devices) per stage: ``parts`` lists (group name, first node, nodes)."""
    out = []
    for name, first, nodes in parts:
        g = next(g for g in cluster.groups if g.name == name)
        ids = cluster.group_device_ids(name)
        per = len(ids) // g.nodes
        out.append((g.gpu.name, tuple(ids[first * per:(first + nodes) * per])))
    return out


def _plan(cluster, pipes, splits) -> Plan:
    pipelines = []
    for stages, split in zip(pipes, splits, strict=True):
        at, built = 0, []
        for (gpu, devs), n in zip(stages, split, strict=True):
            built.append(Stage(at, at + n, devs, gpu, (("data", len(devs)),), remat="full"))
            at += n
        ways = len(stages[0][1])
        pipelines.append(Pipeline(tuple(built), ways * 8, 1, 8))
    return Plan("llama-7b", cluster, sum(p.batch_share for p in pipelines), SEQ,
                tuple(pipelines), fsdp=True, gpu_dtypes=DTYPES)


def balanced_split(profile, cluster, stages, max_context: int, square_per_token: float):
    """Layers per stage where a micro-batch of the data's document mix (its squared
    lengths per token) takes the least time on the slowest stage."""
    layers = profile.num_layers
    best = None
    for k in range(1, layers):
        split = (k, layers - k)
        pc = pipeline_costs(profile, cluster, _plan(cluster, [stages], [split]),
                            max_context=max_context)[0]
        worst = max((s.token_fwd_s + s.token_bwd_s + (s.attention_fwd_s + s.attention_bwd_s)
                     * square_per_token) / s.ways for s in pc.stages)
        if best is None or worst < best[0]:
            best = (worst, split)
    return best[1]


CONFIGS = {  # name -> cluster, pipelines (stages as (group, first node, nodes))
    "a100-x64 2-stage": ("a100-x64", [[("a100", 0, 4), ("a100", 4, 4)]]),
    "h100-a100-x32 2-stage": ("h100-a100-x32", [[("h100", 0, 2), ("a100", 0, 2)]]),
    "h100-a100-x64 2-stage": ("h100-a100-x64", [[("h100", 0, 4), ("a100", 0, 4)]]),
    "a100-v100-x64 2-stage": ("a100-v100-x64", [[("a100", 0, 4), ("v100", 0, 4)]]),
    "h100-a100-x64 2 pipelines": ("h100-a100-x64", [[("h100", 0, 2), ("h100", 2, 2)],
                                                    [("a100", 0, 2), ("a100", 2, 2)]]),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=8)
    args = ap.parse_args()
    t_start = time.time()
    with gzip.open(LENGTHS) as f:
        lengths = np.loadtxt(f, dtype=np.int64)
    profile = profile_model("llama-7b", seq_len=SEQ)
    replicas = {}
    try:
        with open(os.path.join(HERE, "results", "data_aware.json")) as f:
            for r in json.load(f)["rows"]:
                if r["model"] == "llama-7b":
                    replicas[(r["cluster"], r["max_context"])] = \
                        r["methods"]["hetshard"]["tokens_per_s"]
    except FileNotFoundError:
        pass
    rows = []
    for name, (cname, parts) in CONFIGS.items():
        cluster = CLUSTERS[cname]()
        for max_context in (32768, 131072):
            calib = sample_batch(lengths, np.random.default_rng(1000), TOKENS_PER_GPU *
                                 cluster.num_devices, max_context).astype(np.float64)
            sq = float((calib ** 2).sum() / calib.sum())
            pipes = [_stages_of(cluster, p) for p in parts]
            splits = [balanced_split(profile, cluster, s, max_context, sq) for s in pipes]
            costs = pipeline_costs(profile, cluster, _plan(cluster, pipes, splits),
                                   max_context=max_context)
            rng = np.random.default_rng(0)
            per = {m: {"times": [], "tokens": 0, "planning": [], "gaps": [], "shapes": set()}
                   for m in METHODS}
            for _ in range(args.batches):
                batch = sample_batch(lengths, rng, TOKENS_PER_GPU * cluster.num_devices,
                                     max_context)
                for m in METHODS:
                    r = plan_pipeline_batch(batch, costs, cluster=cluster, method=m,
                                            bound=m == "hetshard")
                    p = per[m]
                    p["times"].append(r.step_time_s)
                    p["tokens"] += r.tokens
                    p["planning"].append(r.planning_s)
                    p["gaps"].append(r.gap)
                    p["shapes"] |= set(r.shapes)
            row = {"config": name, "cluster": cname, "model": "llama-7b",
                   "max_context": max_context, "gpus": cluster.num_devices,
                   "pipelines": [[{"gpu": s.gpu, "devices": len(s.devices),
                                   "layers": [s.start, s.end]} for s in pc.stages]
                                 for pc in costs],
                   "micro_batch_tokens": costs[0].tokens, "buckets": list(costs[0].buckets),
                   "methods": {}}
            for m, p in per.items():
                row["methods"][m] = {
                    "tokens_per_s": p["tokens"] / sum(p["times"]),
                    "step_times_s": p["times"],
                    "planning_ms_median": 1e3 * float(np.median(p["planning"])),
                    "planning_ms_max": 1e3 * max(p["planning"]),
                    "compiled_shapes": len(p["shapes"]),
                    "gap_median": float(np.median(p["gaps"])) if m == "hetshard" else None}
            h = row["methods"]["hetshard"]["tokens_per_s"]
            row["speedup"] = {m: h / row["methods"][m]["tokens_per_s"] for m in METHODS
                              if m != "hetshard"}
            row["replicas_hetshard_tokens_per_s"] = replicas.get((cname, max_context))
            rows.append(row)
            hm = row["methods"]["hetshard"]
            rep = row["replicas_hetshard_tokens_per_s"]
            print(f"{name:27s} {max_context // 1024:4d}K  hetshard {h:10,.0f} tok/s  "
                  f"x{row['speedup']['fixed-cp']:.2f} fixed-cp  "
                  f"x{row['speedup']['identical']:.3f} identical  "
                  f"x{row['speedup']['pad']:.1f} pad  plan {hm['planning_ms_median']:.1f}/"
                  f"{hm['planning_ms_max']:.1f} ms  shapes {hm['compiled_shapes']}  gap "
                  f"{hm['gap_median']:.1%}  split {splits}"
                  + (f"  (replicas {rep:,.0f} tok/s)" if rep else ""), flush=True)
    out = {"batches": args.batches, "tokens_per_gpu": TOKENS_PER_GPU, "rows": rows,
           "wall_time_s": time.time() - t_start}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "data_aware_pipeline.json"), "w") as f:
        json.dump(out, f, indent=1)
    plot(rows, os.path.join(HERE, "results", "data_aware_pipeline.png"))
    return 0


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = 5
    fig, axes = plt.subplots(-(-len(rows) // cols), cols, figsize=(3.6 * cols, 6),
                             squeeze=False)
    for ax, row in zip(axes.flat, rows, strict=False):
        for m, p in row["methods"].items():
            ax.plot(p["step_times_s"], marker="o", ms=3, label=m)
        ax.set_yscale("log")
        ax.set_title(f"{row['config']} {row['max_context'] // 1024}K", fontsize=7)
        ax.set_xlabel("batch", fontsize=7)
        ax.set_ylabel("step time (s)", fontsize=7)
        ax.tick_params(labelsize=6)
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
