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
(median, max; each batch planned ``--repeats`` times, the same plan, its time the
fastest run, the slowest single run kept as ``planning_ms_max_single_run``), compiled
shapes (pipeline, bucket), the median gap to the lower bound, and, where
``data_aware.py`` priced the same cluster and context on data-parallel replicas, its
hetshard tokens/s (which outer plan serves this data better).

Usage: python experiments/data_aware_pipeline.py [--batches N] [--repeats R]
Writes experiments/results/data_aware_pipeline.json and data_aware_pipeline.png.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import time

import numpy as np
from data_aware import CLUSTERS, IMAGE_TOKENS, LENGTHS, TOKENS_PER_GPU, draw

from hetshard._plan import Pipeline, Plan, Stage
from hetshard.data import METHODS, choose_image_slots, pipeline_costs, plan_pipeline_batch
from hetshard.data.pipelines import encoder_batch
from hetshard_models import profile as profile_model

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


def _multimodal(cluster, encoders, vision, every_slot=False) -> dict:
    """pipeline_costs' multimodal arguments (none for a text model)."""
    return {} if encoders is None else dict(
        vision=vision, image_tokens=IMAGE_TOKENS,
        vision_devices=[e for _, e in _stages_of(cluster, encoders)] if encoders else None,
        encoder_slots=every_slot)


def _costs(profile, cluster, pipes, splits, max_context, encoders, vision, every_slot=False):
    return pipeline_costs(profile, cluster, _plan(cluster, pipes, splits),
                          max_context=max_context,
                          **_multimodal(cluster, encoders, vision, every_slot))


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


def balanced_split(profile, cluster, stages, max_context: int, square_per_token: float,
                   images_per_token: float = 0.0, encoders=None, vision=None,
                   every_slot=False):
    """Layers per stage where a micro-batch of the data's mix (its squared document
    lengths and images per token) takes the least time on the slowest stage."""
    layers = profile.num_layers
    best = None
    for k in range(1, layers):
        split = (k, layers - k)
        pc = _costs(profile, cluster, [stages], [split], max_context, encoders, vision,
                    every_slot=every_slot)[0]
        worst = max((s.token_fwd_s + s.token_bwd_s + (s.attention_fwd_s + s.attention_bwd_s)
                     * square_per_token + (s.image_fwd_s + s.image_bwd_s) * images_per_token)
                    / s.ways for s in pc.stages if s.layers)
        if best is None or worst < best[0]:
            best = (worst, split)
    return best[1]


# name -> cluster, pipelines (stages as (group, first node, nodes)), max contexts,
# and for the MLLM mixture the vision encoder's place: [] with each pipeline's first
# stage, else a vision stage of its own per pipeline (group, first node, nodes); a fifth
# entry True: that vision stage encodes every image slot of its rows (what
# run_pipeline_batch_plan runs), else only the micro-batch's images in passes (compacted,
# priced only).
CONFIGS = {
    "a100-x64 2-stage": ("a100-x64", [[("a100", 0, 4), ("a100", 4, 4)]], (32768, 131072),
                         None),
    "h100-a100-x32 2-stage": ("h100-a100-x32", [[("h100", 0, 2), ("a100", 0, 2)]],
                              (32768, 131072), None),
    "h100-a100-x64 2-stage": ("h100-a100-x64", [[("h100", 0, 4), ("a100", 0, 4)]],
                              (32768, 131072), None),
    "a100-v100-x64 2-stage": ("a100-v100-x64", [[("a100", 0, 4), ("v100", 0, 4)]],
                              (32768, 131072), None),
    "h100-a100-x64 2 pipelines": ("h100-a100-x64", [[("h100", 0, 2), ("h100", 2, 2)],
                                                    [("a100", 0, 2), ("a100", 2, 2)]],
                                  (32768, 131072), None),
    "MLLM a100-v100-x64 2-stage, encoder in stage 0": (
        "a100-v100-x64", [[("a100", 0, 4), ("v100", 0, 4)]], (32768,), []),
    "MLLM a100-v100-x64 V100 vision stage + 2-stage": (
        "a100-v100-x64", [[("a100", 0, 4), ("v100", 2, 2)]], (32768,), [("v100", 0, 2)]),
    "MLLM h100-a100-x64 2-stage, encoder in stage 0": (
        "h100-a100-x64", [[("h100", 0, 4), ("a100", 0, 4)]], (32768,), []),
    "MLLM h100-a100-x64 A100 vision stage + 2-stage": (
        "h100-a100-x64", [[("h100", 0, 4), ("a100", 2, 2)]], (32768,), [("a100", 0, 2)]),
    "MLLM a100-v100-x64 V100 vision stage, every slot": (
        "a100-v100-x64", [[("a100", 0, 4), ("v100", 2, 2)]], (32768,), [("v100", 0, 2)],
        True),
    "MLLM h100-a100-x64 A100 vision stage, every slot": (
        "h100-a100-x64", [[("h100", 0, 4), ("a100", 2, 2)]], (32768,), [("a100", 0, 2)],
        True),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3,
                    help="plannings of each batch (the same plan); its time is the fastest")
    args = ap.parse_args()
    t_start = time.time()
    with gzip.open(LENGTHS) as f:
        lengths = np.loadtxt(f, dtype=np.int64)
    profile = profile_model("llama-7b", seq_len=SEQ)
    vision = profile_model("vit-l14")
    replicas = {}
    try:
        with open(os.path.join(HERE, "results", "data_aware.json")) as f:
            for r in json.load(f)["rows"]:
                replicas[(r["cluster"], r["model"], r["max_context"])] = \
                    r["methods"]["hetshard"]["tokens_per_s"]
    except FileNotFoundError:
        pass
    rows = []
    for name, (cname, parts, contexts, encoders, *every) in CONFIGS.items():
        every_slot = bool(every and every[0])
        cluster = CLUSTERS[cname]()
        mllm = encoders is not None
        for max_context in contexts:
            # Calibration batches (their own seed) size the layer split and the image
            # slots; the measured batches are drawn apart.
            calib = [draw(lengths, np.random.default_rng(1000 + k), cluster, max_context,
                          mllm) for k in range(4)]
            text = np.concatenate([b for b, _ in calib]).astype(np.float64)
            pics = np.concatenate([i for _, i in calib]) if mllm else np.zeros(1)
            total = text.sum() + IMAGE_TOKENS * pics.sum()
            sq = float(((text + IMAGE_TOKENS * pics) ** 2).sum() / total)
            pipes = [_stages_of(cluster, p) for p in parts]
            splits = [balanced_split(profile, cluster, s, max_context, sq,
                                     float(pics.sum() / total), encoders, vision,
                                     every_slot)
                      for s in pipes]
            costs = _costs(profile, cluster, pipes, splits, max_context, encoders, vision,
                           every_slot=every_slot)
            slots, costs_of = None, dict.fromkeys(METHODS, costs)
            if mllm:  # the image slots a row holds, chosen for each method on the
                # calibration batches
                costs_of = {m: choose_image_slots(
                    profile, cluster, _plan(cluster, pipes, splits),
                    [b for b, _ in calib], [i for _, i in calib], max_context=max_context,
                    method=m, **_multimodal(cluster, encoders, vision, every_slot))
                    for m in METHODS}
                costs = costs_of["hetshard"]
                slots = {m: {b: c[0].images_of(b) for b in c[0].buckets}
                         for m, c in costs_of.items()}
            rng = np.random.default_rng(0)
            per = {m: {"times": [], "tokens": 0, "planning": [], "planning_runs": [],
                       "gaps": [], "shapes": set(), "encoder": set()} for m in METHODS}
            for _ in range(args.batches):
                batch, images = draw(lengths, rng, cluster, max_context, mllm)
                for m in METHODS:
                    planned = functools.partial(plan_pipeline_batch, batch, costs_of[m],
                                                images=images, cluster=cluster, method=m)
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
                    for pc, g in zip(costs_of[m], r.groups, strict=True):
                        if pc.encoder_stage is not None and not pc.encoder_slots:
                            # the compacted vision stage's passes
                            one = pc.stages[pc.encoder_stage].ways * pc.encoder_chunk
                            p["encoder"] |= {encoder_batch(int(images[[
                                i for row in s.rows for i in row.samples]].sum()), one,
                                1) // one for s in g.steps}
            model = "llava-7b-like" if mllm else "llama-7b"
            row = {"config": name, "cluster": cname, "model": model,
                   "max_context": max_context, "gpus": cluster.num_devices,
                   "pipelines": [[{"gpu": s.gpu, "devices": len(s.devices),
                                   "layers": [s.start, s.end],
                                   "encoder": s.image_fwd_s > 0} for s in pc.stages]
                                 for pc in costs],
                   "images_per_row": slots, "encoder_every_slot": every_slot,
                   "micro_batch_tokens": costs[0].tokens, "buckets": list(costs[0].buckets),
                   "methods": {}}
            for m, p in per.items():
                row["methods"][m] = {
                    "tokens_per_s": p["tokens"] / sum(p["times"]),
                    "step_times_s": p["times"],
                    "planning_ms_median": 1e3 * float(np.median(p["planning"])),
                    "planning_ms_max": 1e3 * max(p["planning"]),
                    "planning_ms_max_single_run": 1e3 * max(p["planning_runs"]),
                    "compiled_shapes": len(p["shapes"]),
                    # a vision stage's encoder passes a micro-batch (one shape each)
                    "encoder_passes": [min(p["encoder"]), max(p["encoder"])]
                    if p["encoder"] else None,
                    "gap_median": float(np.median(p["gaps"])) if m == "hetshard" else None}
            h = row["methods"]["hetshard"]["tokens_per_s"]
            row["speedup"] = {m: h / row["methods"][m]["tokens_per_s"] for m in METHODS
                              if m != "hetshard"}
            row["replicas_hetshard_tokens_per_s"] = replicas.get((cname, model, max_context))
            rows.append(row)
            hm = row["methods"]["hetshard"]
            rep = row["replicas_hetshard_tokens_per_s"]
            print(f"{name:47s} {max_context // 1024:4d}K  hetshard {h:10,.0f} tok/s  "
                  f"x{row['speedup']['fixed-cp']:.2f} fixed-cp  "
                  f"x{row['speedup']['identical']:.3f} identical  "
                  f"x{row['speedup']['pad']:.1f} pad  plan {hm['planning_ms_median']:.1f}/"
                  f"{hm['planning_ms_max']:.1f} ms  shapes {hm['compiled_shapes']}"
                  + (f" (+1 encoder, {hm['encoder_passes'][0]}-{hm['encoder_passes'][1]}"
                     " passes)" if hm["encoder_passes"] else "")
                  + "  gap "
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
    fig, axes = plt.subplots(-(-len(rows) // cols), cols,
                             figsize=(3.6 * cols, 3 * -(-len(rows) // cols)),
                             squeeze=False)
    for ax, row in zip(axes.flat, rows, strict=False):
        for m, p in row["methods"].items():
            ax.plot(p["step_times_s"], marker="o", ms=3, label=m)
        ax.set_yscale("log")
        ax.set_title(f"{row['config']} {row['max_context'] // 1024}K", fontsize=6)
        ax.set_xlabel("batch", fontsize=7)
        ax.set_ylabel("step time (s)", fontsize=7)
        ax.tick_params(labelsize=6)
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
