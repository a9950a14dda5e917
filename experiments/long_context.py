"""Long sequences on mixed GPU generations: hetshard's plans against uniform context
parallelism, in the simulator.

For llama-7b and llama-70b at 32K, 128K and 512K tokens per sample, on a homogeneous
cluster and two mixed ones (H100 + A100, A100 + V100), this plans with hetshard (its
families of single-type stages, each with its own context degree, plus context groups
spanning GPU types with chunks in proportion to speed: ``hetshard.solver.context``) and
prices three uniform context-parallel baselines with the same simulator:

* ``megatron-cp``: Megatron-LM's layout, dp x cp x tp x pp over every GPU, equal chunks,
  the same layer count per stage (a stage spanning types runs at its slowest's pace);
* ``equal-chunks``: hetshard's mixed context groups (every group holding the same share
  of each GPU type) with equal chunks instead of speed-proportional ones;
* ``fastest-only``: Megatron-LM's layout on the fastest GPU type alone.

Each baseline is the fastest of its layouts that fits (tensor degrees, context degrees,
stages, micro-batch sizes, remats of ``PlannerOptions``). Reported per row: tokens/s,
the peak memory per device, and hetshard's speedup over the best baseline.

Usage: python experiments/long_context.py [--quick]
Writes experiments/results/long_context.json and long_context.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time
import warnings

from hetshard.cluster import Cluster
from hetshard.errors import HetshardError
from hetshard.sim import simulate
from hetshard.sim.simulator import annotate
from hetshard.solver import PlannerOptions
from hetshard.solver.context import mixed_context_plans
from hetshard.solver.uniform import Fix, uniform_plan
from hetshard_models import profile as profile_model
from hetshard_models.steps import make_plan

DGX_H100 = {"gpu": "H100-80GB", "gpus_per_node": 8, "intra_node_gbs": 450.0,
            "inter_node_gbs": 400.0}
DGX_A100 = {"gpu": "A100-80GB", "gpus_per_node": 8, "intra_node_gbs": 300.0,
            "inter_node_gbs": 200.0}
DGX_V100 = {"gpu": "V100-32GB", "gpus_per_node": 8, "intra_node_gbs": 150.0,
            "inter_node_gbs": 100.0}


def _cluster(name: str, *groups) -> Cluster:
    return Cluster.from_dict({
        "name": name, "inter_group_gbs": 100.0,
        "groups": [{"name": f"g{i}", "nodes": nodes, **spec}
                   for i, (spec, nodes) in enumerate(groups)]})


# name, cluster, the dtype its models compute in (V100s have no bfloat16 tensor cores)
CLUSTERS = [
    ("h100-x32", lambda: _cluster("h100-x32", (DGX_H100, 4)), "bfloat16"),
    ("h100-a100-x32", lambda: _cluster("h100-a100-x32", (DGX_H100, 2), (DGX_A100, 2)),
     "bfloat16"),
    ("a100-v100-x32", lambda: _cluster("a100-v100-x32", (DGX_A100, 2), (DGX_V100, 2)),
     "float16"),
]
# model, sequence lengths, global batch per sequence length (about 2M tokens per step)
MODELS = [("llama-7b", (32768, 131072, 524288)), ("llama-70b", (32768, 131072, 524288))]
TOKENS_PER_STEP = 2 * 2 ** 20
LIMIT_S = 30.0


def _opts(quick: bool) -> PlannerOptions:
    return PlannerOptions(time_limit_s=10.0 if quick else LIMIT_S, cp_options=(1, 2, 4, 8, 16),
                          mbs_options=(1,), remat_options=("none", "full"))


def _best(plans, profile, cluster):
    best = None
    for p in plans:
        try:
            r = simulate(p, profile, cluster, trace=False, margin=0.05)
        except HetshardError:
            continue
        if r.fits and (best is None or r.step_time_s < best[1].step_time_s):
            best = (p, r)
    return best


def _megatron(model, profile, cluster, batch, seq, opts):
    n = cluster.num_devices
    out = []
    for tp, cp in itertools.product(opts.tp_options, opts.cp_options):
        for pp in range(1, n // (tp * cp) + 1):
            if n % (tp * cp * pp):
                continue
            dp = n // (tp * cp * pp)
            for mbs, remat in itertools.product(opts.mbs_options, opts.remat_options):
                try:
                    out.append(uniform_plan(model, profile, cluster, global_batch=batch,
                                            seq_len=seq, fix=Fix(dp, tp, pp, cp, False, mbs,
                                                                 remat, "1f1b")))
                except HetshardError:
                    continue
    return _best(out, profile, cluster)


def _fastest_only(model, profile, cluster, batch, seq, opts):
    g = max(cluster.groups, key=lambda g: g.gpu.peak_flops(profile.dtype))
    sub = dataclasses.replace(cluster, groups=(g,))
    found = _megatron(model, profile, sub, batch, seq, opts)
    return found and (found[0], simulate(found[0], profile, sub, trace=False))


def _row(found, profile, name, applicable=True):
    if found is None:
        return {"planner": name, "fits": False, "tokens_per_s": 0.0,
                "applicable": applicable}
    plan, r = found
    return {"planner": name, "fits": True, "tokens_per_s": r.tokens_per_s,
            "peak_memory_gb": r.peak_memory_bytes / 1e9,
            "context_degree": max(st.axis("context") for q in plan.pipelines
                                  for st in q.stages),
            "chunk_lengths": list(plan.context.chunk_lengths),
            "plan": annotate(plan, r).summary()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="llama-7b at 128K only, 10 s limit")
    args = ap.parse_args()
    opts = _opts(args.quick)
    rows = []
    for (cname, make, dtype), (model, seqs) in itertools.product(CLUSTERS, MODELS):
        if args.quick and model != "llama-7b":
            continue
        cluster = make()
        for seq in seqs:
            if args.quick and seq != 131072:
                continue
            batch = max(1, TOKENS_PER_STEP // seq)
            profile = profile_model(model, seq, dtype)
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                error = None
                try:
                    ours = make_plan(model, cluster, global_batch=batch, seq_len=seq,
                                     dtype=dtype, options=opts, shardings=False)
                    found = (ours, simulate(ours, profile_model(
                        model, seq, dtype, split_blocks=ours.split_blocks), cluster,
                        trace=False))
                except HetshardError as e:
                    found, error = None, str(e)
            planning = time.perf_counter() - t0
            mixed = mixed_context_plans(model, profile, cluster, global_batch=batch,
                                        seq_len=seq, opts=opts, chunks="equal")
            base = {
                "megatron-cp": _megatron(model, profile, cluster, batch, seq, opts),
                "equal-chunks": _best(mixed, profile, cluster),
                "fastest-only": _fastest_only(model, profile, cluster, batch, seq, opts),
            }
            entry = {"cluster": cname, "model": model, "seq_len": seq, "global_batch": batch,
                     "dtype": dtype, "planning_s": planning, "hetshard_error": error,
                     "results": [_row(found, profile, "hetshard")] +
                     [_row(f, profile, k, applicable=k != "equal-chunks" or bool(mixed))
                      for k, f in base.items()]}
            best_base = max((r["tokens_per_s"] for r in entry["results"][1:]), default=0.0)
            ours_tps = entry["results"][0]["tokens_per_s"]
            entry["speedup_over_best_uniform"] = ours_tps / best_base if best_base else None
            rows.append(entry)
            print(f"{cname:14} {model:9} {seq:>7} hetshard {ours_tps:>10,.0f} tok/s, best "
                  f"uniform {best_base:>10,.0f} -> "
                  f"{entry['speedup_over_best_uniform'] or float('nan'):.2f}x  "
                  f"({entry['results'][0].get('plan', error)})", flush=True)
    out_dir = os.path.join(os.path.dirname(__file__), "results")
    name = "long_context_quick" if args.quick else "long_context"
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"tokens_per_step": TOKENS_PER_STEP, "time_limit_s": opts.time_limit_s,
                   "rows": rows}, f, indent=1)
    _plot(rows, os.path.join(out_dir, f"{name}.png"))


def _plot(rows, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = ["hetshard", "megatron-cp", "equal-chunks", "fastest-only"]
    colours = ["tab:red", "tab:blue", "tab:orange", "tab:gray"]
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), len(clusters), squeeze=False,
                             figsize=(5 * len(clusters), 3.6 * len(models)))
    for (i, model), (j, cname) in itertools.product(enumerate(models), enumerate(clusters)):
        ax = axes[i][j]
        mine = [r for r in rows if r["model"] == model and r["cluster"] == cname]
        width = 0.8 / len(names)
        for k, (name, colour) in enumerate(zip(names, colours, strict=True)):
            xs = [x + (k - 1.5) * width for x in range(len(mine))]
            found = [next(e for e in r["results"] if e["planner"] == name) for r in mine]
            ys = [e["tokens_per_s"] for e in found]
            ax.bar(xs, ys, width, color=colour, label=name if (i, j) == (0, 0) else None)
            for x, e in zip(xs, found, strict=True):
                if not e["tokens_per_s"]:
                    ax.text(x, 0, "x" if e.get("applicable", True) else "n/a",
                            ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(range(len(mine)), [f"{r['seq_len'] // 1024}K" for r in mine])
        ax.set_title(f"{model} on {cname}", fontsize=10)
        ax.set_ylabel("tokens/s (simulated)")
    fig.suptitle("Long sequences: hetshard vs uniform context parallelism, simulated "
                 "(x: no layout fits; n/a: one GPU type, no mixed groups)")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.legend(loc="lower center", ncol=4, frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.savefig(path, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
