"""How much the roofline's two unsourced constants matter: ``SPLIT_K_MIN`` (the least K a
split-K slice keeps, ``hetshard.cost.stage``) and ``ROW_FUSION_MAX`` (the longest row a
normalization fusion keeps on chip, ``hetshard.ir.graph``).

Neither has a published value for XLA's GPU kernels: XLA's Triton GEMM configurations
use K tiles of 32 to 256 (a split-K slice keeps at least one), its dot cost model
(``gpu_dot_fusion_cost_model``) bounds tiles to 32..256 and split-K to 128, and its
normalization fusions tile a row up to Triton's largest block (2^20 elements). So each
constant is swept over that range, and for every value the per-architecture
``matmul_eff`` is fitted again on the same rows as the catalog's
(``cost_model_accuracy.fit_matmul_eff``: the megatron set's FIT_ROWS for Ampere, the
torchtitan-h100 set's 8-GPU FSDP row for Hopper) before the held-out rows of the
roofline-priced sets (megatron, torchtitan-h100, torchtitan-a100) are priced. Sailor's
sets are priced from measured per-layer profiles, which neither constant touches.

A constant the held-out errors do not move across its range is one no measured set we
can price constrains: it stays an assumption, reported as such (docs/cost-model.md).

Usage: python experiments/constant_sensitivity.py [CONSTANT ...]  (default: both)
Writes experiments/results/constant_sensitivity.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import cost_model_accuracy as cma

import hetshard.cost.stage as stage
import hetshard.ir.graph as graph
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.profile import clear_profiles
from hetshard_models import steps

HERE = os.path.dirname(os.path.abspath(__file__))
SWEEPS = {
    "SPLIT_K_MIN": (stage, (32, 64, 128, 256, 512, 1024)),
    "ROW_FUSION_MAX": (graph, (1024, 4096, 16384, 65536, 1 << 20)),
}


def _forget() -> None:
    """Drops every cache that holds a priced shape or a profile built with the old value."""
    stage._PER_DIMS.clear()
    stage._MEASURED.clear()
    clear_profiles()
    steps.profile.cache_clear()
    cma._PROFILES.clear()


def evaluate() -> dict:
    """The held-out summary of each roofline set, each architecture's matmul_eff refitted."""
    cal = DEFAULT
    fitted = {}
    evaluators = {"megatron": cma.megatron_evaluate,
                  "torchtitan-h100": cma.torchtitan_h100_subset}
    for arch, (names, set_name, rows) in cma.ARCH_FITS.items():
        eff = cma.fit_matmul_eff(evaluators[set_name], names, rows)
        fitted[arch] = eff
        for name in names:
            cal = cal.with_type(name, cma.dataclasses.replace(DEFAULT.default,
                                                              matmul_eff=eff))
    # the A100 rows of torchtitan use the catalog's A100-80GB, fitted with megatron's
    a100 = fitted["Ampere (A100)"]
    cal = cal.with_type("A100-80GB", cma.dataclasses.replace(DEFAULT.default,
                                                             matmul_eff=a100))
    out = {"matmul_eff": fitted, "sets": {}}
    for name, rows, fit in (
            ("megatron", cma.megatron_evaluate(cal), cma.FIT_ROWS),
            ("torchtitan-h100", cma.torchtitan_evaluate(cma.TORCHTITAN_H100,
                                                        cma._grand_teton, cal),
             cma.H100_FIT_ROWS),
            ("torchtitan-a100", cma.torchtitan_evaluate(cma.TORCHTITAN_A100,
                                                        cma._dgx_a100, cal), set())):
        s = cma.summarize(rows, fit)
        out["sets"][name] = {k: s[k] for k in ("median_abs_error", "mean_abs_error",
                                               "max_abs_error", "spearman")}
    return out


def main() -> int:
    t0 = time.time()
    path = os.path.join(HERE, "results", "constant_sensitivity.json")
    result: dict = {"sweeps": {}, "shipped": {}}
    if os.path.exists(path):  # a sweep of some constants keeps the others' results
        with open(path) as f:
            result = json.load(f)
    only = sys.argv[1:] or list(SWEEPS)
    bad = [c for c in only if c not in SWEEPS]
    if bad:
        raise SystemExit(f"unknown constant(s) {bad}; accepted: {', '.join(SWEEPS)}")
    for const, (module, values) in ((c, SWEEPS[c]) for c in only):
        shipped = getattr(module, const)
        result["shipped"][const] = shipped
        rows = []
        try:
            for v in values:
                setattr(module, const, v)
                _forget()
                got = evaluate()
                rows.append({"value": v, **got})
                print(f"{const}={v}: matmul_eff {got['matmul_eff']}  " + "  ".join(
                    f"{k} median {s['median_abs_error']:.1%} mean {s['mean_abs_error']:.1%} "
                    f"rho {s['spearman']:.2f}" for k, s in got["sets"].items()), flush=True)
        finally:
            setattr(module, const, shipped)
            _forget()
        result["sweeps"][const] = rows
    result["wall_time_s"] = time.time() - t0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
