"""Sailor's setting: OPT-350 in float32, global batch 1024, A100-40GB + V100-16GB nodes of 4
GPUs on GCP (32+96, 80+240 and 128+384 GPUs), priced with Sailor's published per-layer
profiles (``experiments/data/profiles/sailor-profiles.json``).

For each cluster hetshard plans with the profiles as its calibration, and the plan is
simulated; for 32+96 Sailor's published plan (micro-batch 2; two stages of 13 of the 26
layer entries; stage 0 on 3 A100s at tp 1 and 24 groups of 4 V100s at tp 4, stage 1 on 27
A100s at tp 1: 27 pipelines) is priced by the same simulator, so the two plans are
compared under one cost model. Sailor's own simulator's throughputs for its plans
(0.170, 0.361, 0.523 it/s) are printed beside, from a different cost model.

Networks: as Sailor measured them in GCP's us-central1-a (its repository's fits,
``hetshard.cluster.fabric`` ``gcp-a2-a100x4`` and ``gcp-n1-v100x4``): up to 6.04 GB/s
between A100 VMs, 5.79 GB/s between V100 VMs and across the kinds, less for small
messages (an all-reduce priced as Sailor's simulator prices one: a ring whose steps move
the buffer over the workers). Before (results up to commit 421e7a0): GCP's published
per-VM egress caps, 50 and 32 Gb/s, on InfiniBand's curves.

Usage: python experiments/sailor_setting.py [--time-limit 60]
Writes experiments/results/sailor_setting.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import sailor_plans as sp

from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster import Cluster
from hetshard.cost.calibration import Calibration
from hetshard.sim import simulate
from hetshard.solver import PlannerOptions
from hetshard_models import profile as profile_model
from hetshard_models.steps import make_plan

MODEL = sp.MODELS["OPT-350"]
SIZES = [(8, 24), (20, 60), (32, 96)]  # A100 nodes, V100 nodes (4 GPUs each)
SAILOR_ITS = {(8, 24): 0.170, (20, 60): 0.361, (32, 96): 0.523}


def cluster(a100_nodes: int, v100_nodes: int) -> Cluster:
    return Cluster.load({"name": f"sailor-a100x{4 * a100_nodes}-v100x{4 * v100_nodes}",
                         "groups": [
                             {"name": "a100", "gpu": "A100-40GB", "nodes": a100_nodes,
                              "gpus_per_node": 4, "intra_node_gbs": 300,
                              "inter_node_gbs": 6.04, "fabric": "gcp-a2-a100x4"},
                             {"name": "v100", "gpu": "V100-16GB", "nodes": v100_nodes,
                              "gpus_per_node": 4, "intra_node_gbs": 150,
                              "inter_node_gbs": 5.79, "fabric": "gcp-n1-v100x4"}],
                         "inter_group_gbs": 5.79, "inter_group_fabric": "gcp-n1-v100x4"})


def sailor_plan_32_96(c: Cluster) -> Plan:
    """27 pipelines: stage 0 (entries 0-12) on one A100 (3 of them) or 4 V100s at tp 4
    (24 of them), stage 1 (entries 13-25) on one A100; micro-batch 2; the batch of 1024
    split as evenly as whole micro-batches allow."""
    a100 = list(c.group_device_ids("a100"))
    v100 = list(c.group_device_ids("v100"))
    firsts = [((a100[i],), "A100-40GB", (("data", 1), ("tensor", 1))) for i in range(3)]
    firsts += [(tuple(v100[4 * i:4 * i + 4]), "V100-16GB", (("data", 1), ("tensor", 4)))
               for i in range(24)]
    seconds = [(a100[3 + i],) for i in range(27)]
    micro = [1024 // 2 // 27 + (1 if i < 1024 // 2 % 27 else 0) for i in range(27)]
    pipes = []
    for (devs, gpu, mesh), dev2, m in zip(firsts, seconds, micro, strict=True):
        stages = (Stage(0, 13, devs, gpu, mesh),
                  Stage(13, 26, dev2, "A100-40GB", (("data", 1), ("tensor", 1))))
        pipes.append(Pipeline(stages, 2 * m, 2, m))
    return Plan("OPT-350", c.to_dict(), 1024, 2048, tuple(pipes),
                dtype="float32", attention="reference", distributed_optimizer=False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    cal = Calibration.load(sp.PROFILES)
    # (a plan may cut inside blocks: priced on the profile of block halves then)
    profiles = {split: profile_model(MODEL, 2048, "float32", split_blocks=split)
                for split in (False, True)}
    prof = profiles[False]
    rows = []
    for a, v in SIZES:
        c = cluster(a, v)
        t0 = time.time()
        plan = make_plan(MODEL, c, global_batch=1024, seq_len=2048, dtype="float32",
                         calibration=cal, options=PlannerOptions(
                             time_limit_s=args.time_limit, attention="reference"))
        wall = time.time() - t0
        r = simulate(plan, profiles[plan.split_blocks], c, cal, trace=False)
        row = {"cluster": c.name, "gpus": 4 * (a + v), "hetshard_it_s": 1 / r.step_time_s,
               "hetshard_fits": r.fits, "hetshard_plan": plan.explain(),
               "planning_s": wall, "solver": plan.solver.status,
               "bound_it_s": plan.predicted.upper_bound_tokens_per_s / (1024 * 2048),
               "sailor_own_simulator_it_s": SAILOR_ITS[(a, v)]}
        if (a, v) == (8, 24):
            s = sailor_plan_32_96(c)
            rs = simulate(s, prof, c, cal, trace=False)
            row.update(sailor_plan_it_s=1 / rs.step_time_s, sailor_plan_fits=rs.fits,
                       sailor_plan_peak_gb=rs.peak_memory_bytes / 1e9)
        rows.append(row)
        print(f"{c.name}: hetshard {row['hetshard_it_s']:.3f} it/s (fits {r.fits}, "
              f"{wall:.1f} s, {plan.solver.status}; bound {row['bound_it_s']:.3f})"
              + (f"; Sailor's plan under hetshard's simulator {row['sailor_plan_it_s']:.3f} "
                 f"it/s (fits {row['sailor_plan_fits']})" if "sailor_plan_it_s" in row
                 else "") + f"; Sailor's simulator on its plan {SAILOR_ITS[(a, v)]}")
        print(plan.explain())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sailor_setting.json"), "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
