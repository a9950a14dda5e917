"""Host memory as a tier (issue 55): hetshard's plans with and without offload.

Clusters whose GPUs are short of memory, and models that barely fit them:

* ``consumer+a100``: a node of 8 RTX 4090, a node of 8 RTX 3090 (24 GB each, PCIe Gen4,
  10 GbE between the consumer nodes) and a node of 4 A100-80GB;
* ``v100+a100``: two DGX-1 nodes of 8 V100-16GB (two GPUs per PCIe Gen3 switch to the
  host) and a node of 8 A100-40GB;
* ``4090x8``: one node of 8 RTX 4090;
* ``flashflex-consumer``: the preset of FlashFlex's GPU mix, a node each of 8 RTX 4090,
  8 RTX 3090 and 8 RTX 3080 Ti (12 GB), 10 GbE between them.

Models: gpt-6.7b and llama-13b (2048 tokens, global batch 256; float16 on clusters with
V100s, which lack bf16 units, bfloat16 elsewhere). For each row the planner runs twice
with the same options, once with ``offload_options=("none",)`` and once with the
default (a stage may keep its optimizer state, or with a named remat its kept
activations, in host memory). Each plan is priced by the simulator (the planner's
``predicted``): tokens/s, the largest per-device GPU memory, the most host memory a
node's offload takes, and what each stage offloads. The host links and memories are the
catalog's (``hetshard.cluster.catalog``, ``_HOST``): PCIe per GPU as the usual servers
wire it, pinned copies at 0.8 of it (``Efficiency.host_link_eff``, an assumption).

These are the simulator's numbers, not measured runs: no GPU was at hand when this was
written. ``tests/test_offload.py`` checks on 8 fake CPU devices that offloaded plans
train equal to one device with their state in pinned host memory.

Usage: python experiments/offload.py [--time-limit S] [--quick]
Writes experiments/results/offload.json and offload.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

from hetshard.cluster import Cluster
from hetshard.solver import NoFeasiblePlanError, PlannerOptions
from hetshard_models.steps import make_plan


def _group(name, gpu, nodes, per_node, intra, inter):
    return {"name": name, "gpu": gpu, "nodes": nodes, "gpus_per_node": per_node,
            "intra_node_gbs": intra, "inter_node_gbs": inter}


CLUSTERS = {
    "consumer+a100": {"groups": [_group("rtx4090", "RTX-4090", 1, 8, 32, 1.25),
                                 _group("rtx3090", "RTX-3090", 1, 8, 32, 1.25),
                                 _group("a100", "A100-80GB", 1, 4, 300, 12.5)],
                      "inter_group_gbs": 1.25},
    "v100+a100": {"groups": [_group("v100", "V100-16GB", 2, 8, 150, 12.5),
                             _group("a100", "A100-40GB", 1, 8, 300, 25)],
                  "inter_group_gbs": 12.5},
    "4090x8": {"groups": [_group("rtx4090", "RTX-4090", 1, 8, 32, 1.25)],
               "inter_group_gbs": 1.25},
    "flashflex-consumer": "flashflex-consumer",  # a preset
}
MODELS = ("gpt-6.7b", "llama-13b")
SEQ, BATCH = 2048, 256
PRE_AMPERE = {"V100-16GB", "V100-32GB", "T4", "P100-16GB"}


def _one(model, cluster, dtype, offload, time_limit):
    opts = PlannerOptions(time_limit_s=time_limit,
                          **({} if offload else {"offload_options": ("none",)}))
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = make_plan(model, cluster, global_batch=BATCH, seq_len=SEQ, dtype=dtype,
                             options=opts, shardings=False)
    except NoFeasiblePlanError as e:
        return {"fits": False, "error": str(e).splitlines()[0],
                "planning_time_s": time.perf_counter() - t0}
    pred = plan.predicted
    stages = [{"gpu": st.gpu, "layers": st.num_layers, "mesh": dict(st.mesh_shape),
               "remat": st.remat, "offload": list(st.offload),
               "memory_gb": st.predicted_memory_bytes / 1e9}
              for p in plan.pipelines for st in p.stages]
    from hetshard.sim import simulate  # the host memory the plan's offload takes per node
    from hetshard_models.steps import profile
    res = simulate(plan, profile(model, SEQ, dtype, plan.split_blocks), cluster)
    return {"fits": bool(pred.fits), "tokens_per_s": pred.tokens_per_s, "mfu": pred.mfu,
            "bubble": pred.bubble_fraction, "peak_gpu_memory_gb": pred.peak_memory_bytes / 1e9,
            "host_memory_gb_per_node": {k: v / 1e9 for k, v in
                                        res.host_memory_per_node.items()},
            "stages": stages, "pipelines": len(plan.pipelines),
            "micro_batches": [p.num_micro_batches for p in plan.pipelines],
            "offloading_stages": sum(1 for s in stages if s["offload"]),
            "planning_time_s": time.perf_counter() - t0}


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['cluster']}\n{r['model']}" for r in rows]
    without = [r["without"].get("tokens_per_s", 0.0) for r in rows]
    with_ = [r["with"].get("tokens_per_s", 0.0) for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 4))
    ax.bar([i - 0.2 for i in x], without, 0.4, label="no offload")
    ax.bar([i + 0.2 for i in x], with_, 0.4, label="offload searched")
    for i, r in enumerate(rows):
        if not without[i]:
            ax.text(i - 0.2, 0, "no plan\nfits", ha="center", va="bottom", fontsize=8)
        if r.get("speedup"):
            ax.text(i + 0.2, with_[i], f"{r['speedup']:.2f}x", ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("tokens/s (simulated)")
    ax.set_title(f"hetshard plans with and without host offload (seq {SEQ}, batch {BATCH})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true", help="one row, short planning")
    args = ap.parse_args(argv)
    todo = [(c, m) for c in CLUSTERS for m in MODELS]
    if args.quick:
        todo, args.time_limit = todo[5:6], 10.0
    rows = []
    t0 = time.perf_counter()
    for cname, model in todo:
        spec = CLUSTERS[cname]
        cluster = Cluster.load(spec if isinstance(spec, str) else {"name": cname, **spec})
        dtype = "float16" if {t.name for t in cluster.device_types} & PRE_AMPERE \
            else "bfloat16"
        row = {"cluster": cname, "model": model, "dtype": dtype, "seq_len": SEQ,
               "global_batch": BATCH,
               "host_link_gbs": {g.name: g.host_link for g in cluster.groups},
               "host_memory_gb_per_node": {g.name: g.host_memory_bytes / 1e9
                                           for g in cluster.groups}}
        row["without"] = _one(model, cluster, dtype, False, args.time_limit)
        row["with"] = _one(model, cluster, dtype, True, args.time_limit)
        a, b = row["without"].get("tokens_per_s"), row["with"].get("tokens_per_s")
        row["speedup"] = b / a if a and b else None
        rows.append(row)
        print(f"{cname:14s} {model:10s} without {a or 0:9.0f} tok/s  with {b or 0:9.0f} "
              f"tok/s  ({row['with'].get('offloading_stages', 0)} stages offload)",
              flush=True)
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    name = "offload_quick" if args.quick else "offload"
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"rows": rows, "time_limit_s": args.time_limit,
                   "wall_time_s": time.perf_counter() - t0, "source": "simulated"}, f,
                  indent=1)
    if not args.quick:
        _plot(rows, os.path.join(out_dir, "offload.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
