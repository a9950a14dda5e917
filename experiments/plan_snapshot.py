"""Snapshot of the plans the planner and its baselines choose on a fixed set of settings,
to show that a change moves no plan (issue 27: the solver, runtime and Plan reorganised
with behaviour unchanged).

    python experiments/plan_snapshot.py --out experiments/results/plan_snapshot.json
    python experiments/plan_snapshot.py --out after.json --compare before.json

Every setting is planned with a limit far above what it needs (the search's effort is
set by its options, so the plans are deterministic) and without intra-op shardings.
``--compare`` reports every setting whose plan (``Plan.what_runs``: everything but the
solver's wall time) differs, ignoring what only the plan schema changed: ``version``,
``grad_sync`` (schema <= 10 stored it; since 11 it is derived from the pipelines) and
``grad_sync_overlap`` (schema 11; every plan here overlaps) and a false
``context.shard_state`` (schema 12; the state replicated over context, as every plan
before it). Exits 1 on a difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import hetshard_models as models
from hetshard.cluster import Cluster
from hetshard.cost.profile import clear_profiles, profile_program
from hetshard.solver import PlannerOptions, make_plan
from hetshard.solver.baselines import BASELINES, run_baseline

# (cluster, model, global batch, sequence, dtype, PlannerOptions fields)
SETTINGS = [
    ("amp-t4-v100", "gpt-350m", 32, 1024, "float16", {}),
    ("a100-v100", "gpt-1.3b", 64, 2048, "bfloat16", {}),
    ("h100-a100-v100-x8", "llama-7b", 16, 32768, "bfloat16", {}),
    ("metis-a100-t4", "gpt-760m", 64, 2048, "float16", {"gpu_dtypes": "fastest"}),
    ("a100-v100-x16", "gpt-1.3b", 128, 2048, "bfloat16", {"max_stages": 1}),
    ("sailor-a100-v100", "gpt-350m", 256, 2048, "float32", {}),
]
SCHEMA_ONLY = ("version", "grad_sync", "grad_sync_overlap")


def snapshot() -> dict:
    out = {}
    for cluster_name, model, batch, seq, dtype, fields in SETTINGS:
        cluster = Cluster.load(cluster_name)
        models.steps.program.cache_clear()
        clear_profiles()
        program = models.program(model, seq_len=seq, dtype=dtype)
        opts = PlannerOptions(time_limit_s=600, **fields)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = make_plan(program, cluster, global_batch=batch, options=opts,
                             shardings=False)
        key = f"{cluster_name}/{model}/{batch}/{json.dumps(fields, sort_keys=True)}"
        row = {"hetshard": json.loads(plan.what_runs()), "status": plan.solver.status}
        profile = profile_program(program)
        for name in BASELINES:
            base = run_baseline(name, model, profile, cluster, batch, seq, opts)
            row[name] = None if base is None else json.loads(base.what_runs())
        out[key] = row
        print(f"{key}: {plan.predicted.tokens_per_s:,.0f} tokens/s ({plan.solver.status}, "
              f"{plan.solver.wall_time_s:.1f} s)", flush=True)
    return out


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items() if k not in SCHEMA_ONLY
                and not (k == "shard_state" and v is False)}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


def differences(old: dict, new: dict) -> list[str]:
    """Settings and planners whose plans differ (schema-only fields aside)."""
    found = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, {}), new.get(key, {})
        for name in sorted(set(a) | set(b)):
            if _plain(a.get(name)) != _plain(b.get(name)):
                found.append(f"{key}: {name}")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where to write the snapshot (JSON)")
    ap.add_argument("--compare", help="an earlier snapshot to compare with")
    args = ap.parse_args()
    got = snapshot()
    with open(args.out, "w") as f:
        json.dump(got, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            old = json.load(f)
        diff = differences(old, got)
        print(f"{len(got)} settings x {1 + len(BASELINES)} planners compared with "
              f"{args.compare}: " + ("no plan differs" if not diff else
                                     f"{len(diff)} differ: " + "; ".join(diff)))
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
