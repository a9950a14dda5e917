"""What per-GPU compute dtypes buy on clusters that mix GPUs with and without bfloat16.

V100 and T4 have no bfloat16 tensor cores: a bfloat16 model runs its matmuls there at the
float32 rate (15.7 and 8.1 TFLOP/s instead of 125 and 65 in float16). This plans
bfloat16 models on mixed clusters three ways and prices them in the simulator:

* ``program``: every GPU computes in bfloat16 (the planner then leaves slow GPUs idle or
  gives them little work);
* ``fastest``: the planner's ``gpu_dtypes="fastest"``: V100/T4 stages compute in float16
  with dynamic loss scaling, the others in bfloat16 (``Plan.gpu_dtypes``);
* ``float16 model``: the whole model in float16 (``--dtype float16``), the reference a
  user gets by giving up bfloat16 everywhere.

Usage: python experiments/gpu_dtypes.py
Writes experiments/results/gpu_dtypes.json.
"""

from __future__ import annotations

import json
import os
import time
import warnings

from hetshard.solver import PlannerOptions
from hetshard_models.steps import make_plan

# cluster, model, global batch, planning-time limit
ROWS = [
    ("a100-v100-x16", "gpt-1.3b", 256, 30.0),
    ("sailor-a100-v100", "gpt-6.7b", 256, 30.0),
    ("metis-a100-t4", "llama-7b", 256, 30.0),
    ("metis-4types", "gpt-1.3b", 256, 30.0),
    ("h100-a100-v100-x8", "gpt-1.3b", 64, 30.0),
    ("amp-t4-v100", "gpt-1.3b", 256, 30.0),
]
SEQ = 2048
SETTINGS = [("program", "bfloat16", "program"), ("fastest", "bfloat16", "fastest"),
            ("float16 model", "float16", "program")]


def main() -> None:
    rows = []
    for cluster, model, batch, limit in ROWS:
        found = {}
        for label, dtype, policy in SETTINGS:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = make_plan(model, cluster, global_batch=batch, seq_len=SEQ, dtype=dtype,
                                 options=PlannerOptions(time_limit_s=limit,
                                                        gpu_dtypes=policy))
            found[label] = plan.predicted.tokens_per_s
            rows.append({"cluster": cluster, "model": model, "global_batch": batch,
                         "setting": label, "dtype": dtype,
                         "gpu_dtypes": [list(e) for e in plan.gpu_dtypes],
                         "tokens_per_s": plan.predicted.tokens_per_s,
                         "planning_s": time.perf_counter() - t0,
                         "plan": plan.summary()})
            print(f"{cluster:18} {model:9} {label:14} {plan.predicted.tokens_per_s:>10,.0f} "
                  f"tokens/s  {plan.summary()}", flush=True)
        rows[-2]["speedup_over_program"] = found["fastest"] / found["program"]
        rows[-2]["ratio_to_float16_model"] = found["fastest"] / found["float16 model"]
    out = os.path.join(os.path.dirname(__file__), "results", "gpu_dtypes.json")
    with open(out, "w") as f:
        json.dump({"seq_len": SEQ, "rows": rows}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
