"""Mixture-of-experts on mixed GPU generations (issue 51, 7): hetshard's plans against
(a) expert parallelism that ignores GPU types and (b) HeterMoE's "zebra" split, each
priced by the same simulator.

* hetshard: ``make_plan`` (stages of one GPU type, uneven layer splits, expert
  parallelism searched per stage: ``PlannerOptions.ep_options``);
* (a) ``ep-type-blind``: the best uniform dp x tp x pp plan over the whole cluster with
  an expert axis of 2, 4 or 8 of its data ways, experts even, as a framework that takes
  the cluster as homogeneous runs it (``hetshard.solver.baselines.ep_type_blind``);
* (a') ``ep-by-speed``: (a) with the experts of each stage that spans GPU types placed in
  proportion to its ranks' speed (uneven experts per device,
  ``hetshard.solver.variants.speed_placement``); attention still at the slowest pace;
* (b) ``zebra``: attention and dense halves of every block on the newer GPU type, the
  expert halves on the older, one interleaved pipeline between them, expert parallelism
  on the older type (``hetshard.solver.baselines.zebra``).

Clusters: ``h100+a100`` (a DGX H100 node and a DGX A100-80GB node) and ``a100+v100``
(the ``a100-v100-x16`` preset: a DGX A100-80GB node and a DGX-1 node of V100-32GB), 100
Gb/s between the types, and ``h100+a100`` again with 400 Gb/s between them (zebra sends
every block's activations across twice each way). Models: DeepSeekMoE-16B (fine-grained:
64 experts, top-6, 2 shared) on 16 GPUs and Mixtral-8x7B (8 experts, top-2) on 32 GPUs
of each pair (two nodes of each type). Sequence 4096, global batch 256; float16 where a
V100 is in the cluster (no bfloat16 units there), bfloat16 elsewhere. Every method is
priced twice: dropless (every routed token computed: the exact exchange, buffers sized
for the worst case) and with a capacity factor of 1.25 (``Plan.capacity_factor``: tokens
past it dropped, as MaxText and GShard do), the same for all three.

A skewed router (``SKEW_CASE``: Mixtral's first two experts taking 3x the tokens)
compares, all priced under that routing histogram: hetshard planning with it (experts
placed unevenly per rank where that pays, the missing ones brought once a step), the same
plan with even experts, hetshard planning blind to the skew, the best plan without an
expert axis, and (a).

These are the simulator's numbers: no GPU was at hand. ``tests/test_expert_parallel.py``
checks on 8 fake CPU devices that expert-parallel plans train equal to one device.

Usage: python experiments/moe.py [--time-limit S] [--quick]
Writes experiments/results/moe.json and moe.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

from hetshard.cluster import Cluster
from hetshard.cost.profile import profile_program
from hetshard.solver import NoFeasiblePlanError, PlannerOptions, make_plan
from hetshard.solver.baselines import ep_by_speed, ep_type_blind, zebra
from hetshard_models import steps


def _group(name, gpu, nodes):
    return {"name": name, "gpu": gpu, "nodes": nodes, "gpus_per_node": 8}


def _pair(name, new, old, nodes):
    return {"name": name, "groups": [_group(new[0], new[1], nodes),
                                     _group(old[0], old[1], nodes)],
            "inter_group_gbs": 12.5}


CLUSTERS = {
    "h100+a100 x16": _pair("h100+a100-x16", ("h100", "H100-80GB"), ("a100", "A100-80GB"), 1),
    # the same with 400 Gb/s between the types (zebra moves every block's activations
    # between them, twice a layer each way)
    "h100+a100 x16 400G": {**_pair("h100+a100-x16-400g", ("h100", "H100-80GB"),
                                   ("a100", "A100-80GB"), 1), "inter_group_gbs": 50.0},
    "a100+v100 x16": "a100-v100-x16",
    "h100+a100 x32": _pair("h100+a100-x32", ("h100", "H100-80GB"), ("a100", "A100-80GB"), 2),
    "a100+v100 x32": _pair("a100+v100-x32", ("a100", "A100-80GB"), ("v100", "V100-32GB"), 2),
}
CASES = [("deepseekmoe-16b", "h100+a100 x16"), ("deepseekmoe-16b", "h100+a100 x16 400G"),
         ("deepseekmoe-16b", "a100+v100 x16"),
         ("mixtral-8x7b", "h100+a100 x32"), ("mixtral-8x7b", "a100+v100 x32")]
SEQ, BATCH = 4096, 256
FACTORS = (None, 1.25)
PRE_AMPERE = {"V100-16GB", "V100-32GB", "T4", "P100-16GB"}


def _summary(plan, cluster, seconds) -> dict:
    if plan is None:
        return {"fits": False, "tokens_per_s": 0.0, "error": "no plan can be built"}
    pred = plan.predicted
    per_type: dict[str, float] = {}
    for p in plan.pipelines:
        for st in p.stages:
            per_type[st.gpu] = max(per_type.get(st.gpu, 0.0), st.predicted_memory_bytes / 1e9)
    return {"fits": bool(pred.fits), "tokens_per_s": pred.tokens_per_s,
            "step_s": pred.step_time_s, "mfu": pred.mfu, "bubble": pred.bubble_fraction,
            "peak_memory_gb": pred.peak_memory_bytes / 1e9,
            "memory_gb_per_type": per_type, "summary": plan.summary(),
            "stages": [{"gpu": st.gpu, "layers": [st.start, st.end],
                        "mesh": dict(st.mesh_shape), "remat": st.remat,
                        "experts": list(st.experts),
                        "memory_gb": st.predicted_memory_bytes / 1e9}
                       for p in plan.pipelines for st in p.stages[:p.num_workers]],
            "virtual_stages": plan.pipelines[0].virtual_stages,
            "capacity_factor": plan.capacity_factor, "seconds": seconds}


def _row(model, cname, factor, time_limit) -> dict:
    spec = CLUSTERS[cname]
    cluster = Cluster.load(spec)
    dtype = "float16" if {t.name for t in cluster.device_types} & PRE_AMPERE else "bfloat16"
    program = steps.program(model, seq_len=SEQ, dtype=dtype)
    opts = PlannerOptions(time_limit_s=time_limit, capacity_factors=(factor,))
    row = {"model": model, "cluster": cname, "dtype": dtype, "capacity_factor": factor}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        try:
            plan = make_plan(program, cluster, global_batch=BATCH, options=opts,
                             shardings=False)
        except NoFeasiblePlanError as e:
            plan = None
            row["hetshard_error"] = str(e).splitlines()[0]
        row["hetshard"] = _summary(plan, cluster, time.perf_counter() - t0)
        whole = profile_program(program)
        t0 = time.perf_counter()
        row["ep_type_blind"] = _summary(ep_type_blind(program.name, whole, cluster, BATCH,
                                                      SEQ, opts), cluster,
                                        time.perf_counter() - t0)
        t0 = time.perf_counter()
        row["ep_by_speed"] = _summary(ep_by_speed(program.name, whole, cluster, BATCH, SEQ,
                                                  opts), cluster, time.perf_counter() - t0)
        halves = profile_program(program, split_blocks=True)
        t0 = time.perf_counter()
        row["zebra"] = _summary(zebra(program.name, halves, cluster, BATCH, SEQ, opts),
                                cluster, time.perf_counter() - t0)
    ours = row["hetshard"]["tokens_per_s"] if row["hetshard"]["fits"] else 0.0
    for base in ("ep_type_blind", "ep_by_speed", "zebra"):
        b = row[base]
        row[f"over_{base}"] = ours / b["tokens_per_s"] if b["fits"] and b["tokens_per_s"] \
            else None
    return row


# A skewed router: the first two of Mixtral's 8 experts take 3x the tokens of the others
# (a measured routing histogram, ``PlannerOptions.routing_histogram``).
SKEW_CASE = ("mixtral-8x7b", "a100+v100 x32", (3, 3, 1, 1, 1, 1, 1, 1))


def _skewed_row(time_limit) -> dict:
    """Under a skewed router (``SKEW_CASE``), every plan priced with the histogram:
    hetshard planning with it (experts placed per rank to balance the routed tokens,
    the missing ones brought once a step), the same plan with its experts even,
    hetshard planning without it (blind to the skew), the best plan without an expert
    axis, and (a)."""
    import dataclasses

    from hetshard.cost.calibration import DEFAULT
    from hetshard.solver.evaluator import Evaluator
    from hetshard.solver.variants import even_experts
    model, cname, hist = SKEW_CASE
    cluster = Cluster.load(CLUSTERS[cname])
    dtype = "float16" if {t.name for t in cluster.device_types} & PRE_AMPERE else "bfloat16"
    program = steps.program(model, seq_len=SEQ, dtype=dtype)
    skewed = PlannerOptions(time_limit_s=time_limit, routing_histogram=hist)
    loads = tuple(x / sum(hist) for x in hist)

    def priced(plan):  # under the skewed router
        profile = dataclasses.replace(
            profile_program(program, split_blocks=plan.split_blocks), expert_loads=loads)
        r = Evaluator(profile, cluster, DEFAULT, skewed).price(plan).result
        return {"fits": bool(r.fits), "tokens_per_s": r.tokens_per_s, "step_s": r.step_time_s,
                "peak_memory_gb": r.peak_memory_bytes / 1e9,
                "experts": sorted({tuple(st.experts) for p in plan.pipelines
                                   for st in p.stages if st.axis("expert") > 1})}
    row = {"model": model, "cluster": cname, "dtype": dtype, "histogram": list(hist)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        plan = make_plan(program, cluster, global_batch=BATCH, options=skewed,
                         shardings=False)
        row["hetshard"] = {**priced(plan), "seconds": time.perf_counter() - t0}
        row["hetshard_even"] = priced(even_experts(plan))
        blind = make_plan(program, cluster, global_batch=BATCH, shardings=False,
                          options=PlannerOptions(time_limit_s=time_limit))
        row["hetshard_blind"] = priced(blind)
        no_ep = make_plan(program, cluster, global_batch=BATCH, shardings=False,
                          options=dataclasses.replace(skewed, ep_options=(1,)))
        row["hetshard_no_ep"] = priced(no_ep)
        whole = profile_program(program)
        a = ep_type_blind(program.name, whole, cluster, BATCH, SEQ, PlannerOptions())
        row["ep_type_blind"] = priced(a) if a is not None else {"fits": False}
    return row


def _plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(2.2 * len(rows) + 2, 4.5))
    names = ("hetshard", "ep_type_blind", "ep_by_speed", "zebra")
    for k, name in enumerate(names):
        xs = [i + (k - 1.5) * 0.2 for i in range(len(rows))]
        ys = [r[name]["tokens_per_s"] if r[name]["fits"] else 0.0 for r in rows]
        ax.bar(xs, ys, 0.2, label={"hetshard": "hetshard",
                                   "ep_type_blind": "(a) type-blind EP",
                                   "ep_by_speed": "(a') type-blind, experts by speed",
                                   "zebra": "(b) zebra (HeterMoE-style)"}[name])
        for x, y, r in zip(xs, ys, rows, strict=True):
            if not y:
                ax.text(x, 0, "does\nnot fit", ha="center", va="bottom", fontsize=7)
            elif name == "hetshard" and r["over_ep_type_blind"]:
                ax.text(x, y, f"{r['over_ep_type_blind']:.2f}x", ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)),
                  [f"{r['model']}\n{r['cluster']}\n"
                   + ("dropless" if r["capacity_factor"] is None
                      else f"capacity {r['capacity_factor']}") for r in rows], fontsize=7)
    ax.set_ylabel("tokens/s (simulated)")
    ax.set_title(f"MoE on mixed GPUs: hetshard vs type-blind EP and zebra (seq {SEQ}, "
                 f"batch {BATCH}; label: hetshard over (a))")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="one row, short planning")
    args = ap.parse_args(argv)
    todo = [(m, c, f) for m, c in CASES for f in FACTORS]
    if args.quick:
        todo, args.time_limit = todo[:1], 10.0
    rows = []
    t0 = time.perf_counter()
    for model, cname, factor in todo:
        row = _row(model, cname, factor, args.time_limit)
        rows.append(row)
        a, b = row["over_ep_type_blind"], row["over_zebra"]
        print(f"{model:16s} {cname:14s} {'dropless' if factor is None else factor!s:8s} "
              f"hetshard {row['hetshard']['tokens_per_s']:9.0f} tok/s"
              f"{'' if row['hetshard']['fits'] else ' (does not fit)'}  "
              f"(a) {row['ep_type_blind']['tokens_per_s']:9.0f}"
              f"{'' if row['ep_type_blind']['fits'] else ' (does not fit)'}  "
              f"(a') {row['ep_by_speed']['tokens_per_s']:9.0f}"
              f"{'' if row['ep_by_speed']['fits'] else ' (does not fit)'}  "
              f"(b) {row['zebra']['tokens_per_s']:9.0f}"
              f"{'' if row['zebra']['fits'] else ' (does not fit)'}  "
              f"over (a) {a and f'{a:.2f}x'}  over (b) {b and f'{b:.2f}x'}", flush=True)
    fitting = [r for r in rows if r["over_ep_type_blind"]]
    summary = {"min_over_ep_type_blind": min((r["over_ep_type_blind"] for r in fitting),
                                             default=None),
               "min_over_zebra": min((r["over_zebra"] for r in rows if r["over_zebra"]),
                                     default=None),
               "rows_hetshard_fits": sum(r["hetshard"]["fits"] for r in rows),
               "rows": len(rows)}
    summary["min_over_ep_by_speed"] = min(
        (r["over_ep_by_speed"] for r in rows if r["over_ep_by_speed"]), default=None)
    summary["meets_targets"] = bool(
        summary["min_over_ep_type_blind"] is not None and
        summary["min_over_ep_type_blind"] >= 1.3 and
        (summary["min_over_zebra"] is None or summary["min_over_zebra"] >= 1.0) and
        summary["rows_hetshard_fits"] == len(rows))
    skew = None if args.quick else _skewed_row(args.time_limit)
    if skew is not None:
        print("skewed router " + "  ".join(
            f"{k} {v['tokens_per_s']:.0f} tok/s{'' if v['fits'] else ' (does not fit)'}"
            f" {v.get('experts', '')}" for k, v in skew.items() if isinstance(v, dict)),
            flush=True)
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    name = "moe_quick" if args.quick else "moe"
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"rows": rows, "summary": summary, "skewed_router": skew,
                   "seq_len": SEQ, "global_batch": BATCH,
                   "time_limit_s": args.time_limit,
                   "wall_time_s": time.perf_counter() - t0, "source": "simulated"}, f,
                  indent=1)
    if not args.quick:
        _plot(rows, os.path.join(out_dir, "moe.png"))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
