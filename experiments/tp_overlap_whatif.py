"""What-if: how much of the planner's remaining gap is tensor parallelism's collectives?

The simulator charges a tensor-parallel stage's activation collectives (Megatron's
all-reduces, or sequence parallelism's reduce-scatter + all-gather of the same volume)
on the critical path, as the runtime runs them: not overlapped with compute. This
replans the benchmark rows below 0.85 of the upper bound with those collectives' time
scaled by ``exposed`` (0: a perfect overlap; 0.5: half hidden; 1: as priced today) and
reports tokens/s against the same upper bound. It is a what-if of the cost model, not a
measurement: the runtime has no overlap, and how much a collective matmul would hide
needs a GPU.

Usage: python experiments/tp_overlap_whatif.py
Writes experiments/results/tp_overlap_whatif.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hetshard.cost.stage as stage_module  # noqa: E402
from hetshard.cluster import preset  # noqa: E402
from hetshard.cost.profile import profile_model  # noqa: E402
from hetshard.sim import upper_bound_tokens_per_s  # noqa: E402
from hetshard.solver import PlannerOptions, make_plan  # noqa: E402

# cluster, model, global batch, dtype (the planner benchmark's rows below 0.85)
ROWS = [
    ("amp-t4-v100", "gpt-6.7b", 256, "float16"),
    ("flashflex-consumer", "llama-13b", 256, "bfloat16"),
    ("mix4-x1024", "gpt-175b", 2048, "float16"),
]
EXPOSED = (1.0, 0.5, 0.0)
SEQ = 2048


def _scaled(exposed: float):
    """``collective_time`` with the stage model's all-reduces (its only use of them: the
    tensor-parallel activation collectives) scaled by ``exposed``."""
    original = stage_module.collective_time

    def collective_time(kind, nbytes, topo, cal, gpu):
        t = original(kind, nbytes, topo, cal, gpu)
        return t * exposed if kind == "all_reduce" else t
    return original, collective_time


def main() -> None:
    rows = []
    for cluster, model, batch, dtype in ROWS:
        bound = upper_bound_tokens_per_s(profile_model(model, SEQ, dtype), preset(cluster))
        for exposed in EXPOSED:
            original, patched = _scaled(exposed)
            stage_module.collective_time = patched
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan = make_plan(model, cluster, global_batch=batch, seq_len=SEQ,
                                     options=PlannerOptions(dtype=dtype))
            finally:
                stage_module.collective_time = original
            tps = plan.predicted.tokens_per_s
            row = {"cluster": cluster, "model": model, "global_batch": batch,
                   "dtype": dtype, "tp_collectives_exposed": exposed,
                   "tokens_per_s": tps, "upper_bound_tokens_per_s": bound,
                   "ratio_to_upper_bound": tps / bound,
                   "planning_time_s": time.perf_counter() - t0}
            rows.append(row)
            print(f"{cluster:20s} {model:10s} exposed {exposed:.1f}: {tps:10,.0f} tokens/s, "
                  f"{tps / bound:.1%} of the upper bound", flush=True)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "tp_overlap_whatif.json")
    with open(out, "w") as f:
        json.dump({"seq_len": SEQ, "rows": rows}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
