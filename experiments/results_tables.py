"""Writes docs/results.md from experiments/results/*.json: every measured table in one
page, regenerated rather than edited by hand.

Usage: python experiments/results_tables.py
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
OUT = os.path.join(os.path.dirname(HERE), "docs", "results.md")


def _load(name):
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _table(columns, rows) -> list[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def planner(lines, data):
    lines += ["## Planner benchmark", "",
              "`python experiments/planner_bench.py`: hetshard's plan and every baseline's, "
              "priced by the same simulator; clusters with pre-Ampere GPUs in float16. "
              "Planning time is the wall time from the traced step to the plan on this "
              "2-core machine (tracing, layer discovery and profiling included; the "
              "model's own shape-only construction apart).", ""]
    rows = []
    for r in data["rows"]:
        h = r["results"]["hetshard"]
        target = r.get("planning_time_target_s")
        best = r.get("ratio_to_best_baseline")
        rows.append([r["cluster"], r["model"], r["global_batch"],
                     f"{r['gpus']}/{r['types']}", f"{h['tokens_per_s']:,.0f}",
                     f"{r['ratio_to_upper_bound']:.1%}",
                     f"{best:.3f}x" if best else "-",
                     "yes" if r["beats_every_baseline"] else "no",
                     r.get("layers", {}).get("found_by", "-"),
                     f"{r['planning_time_s']:.1f}" + (f" ({target:g})" if target else ""),
                     h.get("solver", {}).get("status", "no plan")])
    lines += _table(["cluster", "model", "B", "GPUs/types", "hetshard tokens/s",
                     "vs upper bound", "vs best baseline", "beats all", "layers from",
                     "planning s (target)", "search"], rows)
    lines.append("")


def accuracy(lines, data):
    if "sets" not in data:
        return
    lines += ["## Cost model against measured runs", "",
              "`python experiments/cost_model_accuracy.py`: step-time error per measured "
              "set as shipped (the catalog's constants; Sailor's rows with Sailor's "
              "published per-layer profiles), over the rows held out of the fits of the "
              "shipped constants (per-architecture matmul efficiency, collective-matmul "
              "interference). Others' errors are on the "
              "same rows.", ""]
    rows = []
    for name, d in data["sets"].items():
        s = d["summary"]
        ranked = s.get("others_spearman_efficiency", {})
        others = ", ".join(f"{k} {v:.1%}" + (f" / {ranked[k]:.2f}" if k in ranked else "")
                           for k, v in sorted(s.get("others_median_abs_error", {}).items()))
        rows.append([name, s["rows_held_out"], ", ".join(s["fit_rows"]) or "none",
                     f"{s['median_abs_error']:.1%}", f"{s['mean_abs_error']:.1%}",
                     f"{s['max_abs_error']:.1%}", f"{s['spearman']:.2f}",
                     f"{s['spearman_efficiency']:.2f}", others or "-"])
    lines += _table(["set", "rows held out", "fit rows", "median abs. error",
                     "mean abs. error", "max abs. error", "Spearman",
                     "Spearman of efficiency", "others (median error / of efficiency)"],
                    rows)
    by_nodes = [[name, ", ".join(f"{n}: {v['median_error']:+.1%} ({v['rows']})"
                                 for n, v in d["summary"]["by_nodes"].items())]
                for name, d in data["sets"].items() if "by_nodes" in d["summary"]]
    if by_nodes:
        lines += ["", "Median signed error of the held-out rows by node count (rows), "
                  "negative: priced too fast:", ""]
        lines += _table(["set", "nodes: median error (rows)"], by_nodes)
    fits = data.get("fits", {})
    if fits:
        lines += ["", "The shipped constants, fitted again (per-architecture `matmul_eff`, "
                  "the collective matmuls' `tp_overlap_interference`):", ""]
        rows = []
        for what, f in fits.items():
            key = next(k for k in f if k.startswith("fitted_"))
            shipped = next(f[k] for k in f if k.startswith(("catalog_", "calibration_")))
            rows.append([what, f["set"], ", ".join(f["rows"]), f"{f[key]}", f"{shipped}"])
        lines += _table(["constant", "set", "fit rows", "fitted", "shipped"], rows)
    lines.append("")


def whatif(lines, data):
    lines += ["## Collective matmuls' overlap assumption", "",
              "`python experiments/tp_overlap_whatif.py`: the rows replanned with "
              "tensor-parallel collectives priced under each setting.", ""]
    rows = [[r["cluster"], r["model"], r["setting"], f"{r['tokens_per_s']:,.0f}",
             f"{r['ratio_to_upper_bound']:.1%}"] for r in data["rows"]]
    lines += _table(["cluster", "model", "setting", "tokens/s", "vs upper bound"], rows)
    lines.append("")


def gpu_dtypes(lines, data):
    lines += ["## Per-GPU compute dtypes", "",
              "`python experiments/gpu_dtypes.py`: bfloat16 models planned with every GPU in "
              "bfloat16 (`program`), with V100/T4/P100 stages in float16 and loss scaling "
              "(`fastest`), and the whole model in float16; sequence "
              f"{data['seq_len']}.", ""]
    rows = []
    for r in data["rows"]:
        extra = (f"{r['speedup_over_program']:.2f}x" if "speedup_over_program" in r else "")
        rows.append([r["cluster"], r["model"], r["setting"], f"{r['tokens_per_s']:,.0f}",
                     extra, r["plan"].split(";")[0].replace("|", "\\|")])
    lines += _table(["cluster", "model", "setting", "tokens/s", "vs program", "plan"], rows)
    lines.append("")


def long_context(lines, data):
    lines += ["## Long sequences", "",
              "`python experiments/long_context.py`: hetshard against uniform context "
              f"parallelism, about {data['tokens_per_step'] / 2**20:g}M tokens per step, "
              f"planning limit {data['time_limit_s']:g} s; tokens/s simulated (0: nothing "
              "fits).", ""]
    names = ["hetshard", "megatron-cp", "equal-chunks", "fastest-only"]
    rows = []
    for r in data["rows"]:
        by = {e["planner"]: e for e in r["results"]}
        speed = r["speedup_over_best_uniform"]
        rows.append([r["cluster"], r["model"], f"{r['seq_len'] // 1024}K",
                     *[f"{by[n]['tokens_per_s']:,.0f}" for n in names],
                     f"{speed:.2f}x" if speed else "-",
                     f"{by['hetshard'].get('peak_memory_gb', 0):.1f}"])
    lines += _table(["cluster", "model", "seq", *names, "vs best uniform",
                     "hetshard GB/device"], rows)
    lines.append("")


def attention(lines, data):
    shape = data["shape"]
    lines += ["## Flash attention memory", "",
              f"`python experiments/attention_bench.py`: compiled temporary bytes of forward "
              f"+ backward, batch {shape['batch']}, {shape['heads']} heads, head_dim "
              f"{shape['head_dim']}, {shape['dtype']}, causal, on {data.get('backend', '?')}.",
              ""]
    rows = [[m["seq"], f"{m['reference_temp_bytes'] / 2**20:,.0f} MiB",
             f"{m['flash_temp_bytes'] / 2**20:,.1f} MiB", f"{m['ratio']:.3f}"]
            for m in data["memory"]]
    lines += _table(["S", "reference", "flash", "flash / reference"], rows)
    lines.append("")


def runtime(lines, data):
    lines += ["## Runtime overhead", "",
              f"`python experiments/runtime_overhead.py` ({data['model']}, batch "
              f"{data['batch']} x {data['seq']}, {data['steps']} steps back to back, best of "
              f"{data['rounds']}; {data['backend']} backend, JAX {data['jax']}). "
              "Dispatch/finish: when the loop's last call returned over when every output "
              "was ready. Steps ahead: steps still running when the last call returned. "
              "Host: one call's host time with the devices idle. Targets: dispatch/finish "
              f"within {data['targets']['dispatch_over_finish_gap']} of the reference's, "
              f"step <= {data['targets']['step_ratio']}x.", ""]
    rows = []
    for r in data["single_stage"] + [data["pipeline"]]:
        ref = "nnx_jit" if "nnx_jit" in r else "hand_written"
        what = (f"single stage, {r['devices']} device(s) vs nnx.jit" if ref == "nnx_jit"
                else f"2-stage pipeline, {r['micro_batches']} micro-batches vs hand-written")
        h, o = r["hetshard"], r[ref]
        rows.append([what, f"{h['dispatch_over_finish']:.2f} / {o['dispatch_over_finish']:.2f}",
                     f"{h['step_s'] * 1e3:.0f} / {o['step_s'] * 1e3:.0f}",
                     f"{r['step_ratio']:.3f}",
                     f"{h['steps_ahead']:.1f} / {o['steps_ahead']:.1f}",
                     f"{h['host_s'] * 1e3:.1f} / {o['host_s'] * 1e3:.1f}"])
    lines += _table(["path", "dispatch/finish (hetshard / ref)", "step ms", "step ratio",
                     "steps ahead", "host ms"], rows)
    lines += ["", "Single stage, the cost of the non-finite guard: step ratio of hetshard "
              "under nan_policy='apply' (no old values kept) to plain nnx.jit, and of "
              "hetshard's default to nnx.jit with optax.apply_if_finite (the same "
              "protection): " + "; ".join(
                  f"{r['devices']} device(s) {r['step_ratio_apply']:.3f} and "
                  f"{r['step_ratio_same_protection']:.3f}" for r in data["single_stage"])
              + "."]
    if all("step_ratio_apply_donated" in r for r in data["single_stage"]):
        lines += ["", "nan_policy='apply' donates the state: against nnx.jit donating the "
                  "model and optimizer too, step ratio and dispatch/finish gap " + "; ".join(
                      f"{r['devices']} device(s) {r['step_ratio_apply_donated']:.3f} and "
                      f"{r['dispatch_over_finish_gap_apply_donated']:+.2f}"
                      for r in data["single_stage"]) + "."]
    per = data.get("host_per_task", {})
    if per:
        lines += ["", "Host time per dispatched task, a model with almost no work (2 stages, "
                  "8 micro-batches): " + ", ".join(
                      f"{k} {v['host_task_s'] * 1e3:.1f} ms ({v['tasks']} tasks, "
                      f"{v['host_s'] * 1e3:.0f} ms a step)" for k, v in per.items()) + "."]
    lines.append("")


def multihost(lines, data):
    lines += ["## Across processes", "",
              "`python experiments/multihost_bench.py` (loopback, gloo, 2 x 4 fake "
              "devices).", ""]
    rows = [[f"{t['bytes'] / 2**20:g} MiB", f"{t['in_process_device_put_s'] * 1e3:.2f}",
             f"{t['cross_process_collective_s'] * 1e3:.2f}",
             f"{t['cross_process_device_put_s'] * 1e3:.2f}"] for t in data["transfers"]]
    lines += _table(["size", "in-process device_put ms", "cross-process collective ms",
                     "cross-process device_put ms"], rows)
    lines += ["", f"Data-parallel step {data['dp_step_one_process_s'] * 1e3:.0f} ms in one "
              f"process vs {data['dp_step_two_processes_s'] * 1e3:.0f} ms in two; 2-stage "
              f"pipeline {data['pp_step_one_process_s'] * 1e3:.0f} ms vs "
              f"{data['pp_step_two_processes_s'] * 1e3:.0f} ms.", ""]


def _replicas(groups) -> str:
    """'h100 2x8, a100 1x16': replicas per GPU type and their devices."""
    count: dict[tuple[str, int], int] = {}
    for g in groups:
        key = (g["name"].split("/")[0], g["devices"])
        count[key] = count.get(key, 0) + 1
    return ", ".join(f"{name} {k}x{n}" for (name, n), k in count.items())


def _planning(h) -> str:
    """median / max [slowest single run] planning milliseconds."""
    got = f"{h['planning_ms_median']:.1f} / {h['planning_ms_max']:.1f}"
    single = h.get("planning_ms_max_single_run")
    return got + (f" [{single:.1f}]" if single is not None else "")


def data_aware(lines, data):
    lines += ["## Data-aware planning", "",
              "`python experiments/data_aware.py`: per-batch plans of Wikipedia-length "
              f"batches ({data['batches']} batches of {data['tokens_per_gpu'] // 1024}K tokens "
              "per GPU), tokens/s priced by the cost model; hetshard's per-batch planning "
              "time measured on this machine (median / max over the batches of each "
              "batch's fastest of three plannings, and the slowest single planning). "
              "Each method runs on the "
              "data-parallel replicas it does best on (`choose_groups`, four calibration "
              "batches); `fixed-cp whole` is fixed-cp packing on one replica per GPU type. "
              "Replicas: hetshard's.", ""]
    names = ["hetshard", "fixed-cp", "fixed-cp-whole", "identical", "pad"]
    rows = []
    for r in data["rows"]:
        m = r["methods"]
        h = m["hetshard"]
        mine = r["groups"]["hetshard"]
        rows.append([r["cluster"], r["model"], f"{r['max_context'] // 1024}K",
                     *[f"{m[n]['tokens_per_s']:,.0f}" for n in names],
                     f"{r['speedup']['fixed-cp']:.2f}x",
                     f"{r['speedup']['fixed-cp-whole']:.2f}x",
                     _replicas(mine),
                     _planning(h), h["compiled_shapes"], f"{h['gap_median']:.1%}",
                     f"{r['bound_speedup_over_fixed_cp']:.2f}x"])
    lines += _table(["cluster", "model", "max context", *[n.replace("-whole", " whole")
                                                          for n in names],
                     "vs fixed-cp", "vs fixed-cp whole", "replicas", "planning ms", "shapes",
                     "gap to bound", "bound vs fixed-cp"], rows)
    lines.append("")


def data_aware_pipeline(lines, data):
    lines += ["## Data-aware planning on pipelines", "",
              "`python experiments/data_aware_pipeline.py`: per-batch plans of the same "
              f"batches ({data['batches']} of {data['tokens_per_gpu'] // 1024}K tokens per "
              "GPU) on pipeline outer plans (one GPU type a stage, layers split for the "
              "data's mix; `enc`: the stage that runs the vision encoder), priced by the "
              "simulator's stage costs; planning time measured here (median / max of "
              "each batch's fastest of three plannings, and the slowest single one). "
              "`replicas`: hetshard's per-batch plan on data-parallel replicas of the "
              "same cluster (data_aware.json).", ""]
    names = ["hetshard", "fixed-cp", "identical", "pad"]
    rows = []
    for r in data["rows"]:
        m = r["methods"]
        h = m["hetshard"]
        stages = "; ".join(" > ".join(
            f"{'enc ' if s['encoder'] else ''}{s['gpu'].split('-')[0]}x{s['devices']}"
            + (f" L{s['layers'][1] - s['layers'][0]}" if s['layers'][1] > s['layers'][0]
               else "") for s in p) for p in r["pipelines"])
        rep = r.get("replicas_hetshard_tokens_per_s")
        rows.append([r["config"], f"{r['max_context'] // 1024}K", stages,
                     *[f"{m[n]['tokens_per_s']:,.0f}" for n in names],
                     f"{r['speedup']['fixed-cp']:.2f}x", f"{r['speedup']['identical']:.2f}x",
                     _planning(h), h["compiled_shapes"], f"{h['gap_median']:.1%}",
                     f"{rep:,.0f}" if rep else "-"])
    lines += _table(["config", "max context", "stages", *names, "vs fixed-cp",
                     "vs identical", "planning ms", "shapes", "gap to bound", "replicas"],
                    rows)
    lines.append("")


def elastic(lines, d):
    s = d.get("straggler") or {}
    lines += ["## Elastic training", "",
              "`python experiments/elastic.py` (8 fake CPU devices): a worker killed after "
              f"step {d['killed_after_step']} (checkpoints every {d['checkpoint_every']} "
              f"steps) restarted on {d['devices_after']} devices with `elastic=True`.", ""]
    rows = [[f"re-plan on {d['devices_after']} devices", f"{d['replan_s']:.1f} s"],
            ["restore into the new plan", f"{d['restore_s']:.2f} s"],
            ["steps lost", d["steps_lost"]],
            ["largest relative loss difference vs one device",
             f"{d['max_rel_loss_difference']:.1e}"]]
    if s:
        rows += [[f"straggler found (injected {s['injected_delay_s']:g} s/task)",
                  f"group {s['group']}, {s['slowdown']:.1f}x, after {s['patience']} "
                  f"observed steps (step {s['at_step']})"],
                 ["straggler re-plan", f"{s['replan_s']:.1f} s, predicted "
                  f"{s['gain']:.2f}x faster"]]
    lines += _table(["what", "measured"], rows)
    lines.append("")


def packed_step_gpu(lines, data):
    if not data.get("measured"):
        return
    before = _load("packed_step_gpu_before.json") or {}
    ref = _load("packed_step_gpu_reference.json") or {}
    m = data["model"]
    lines += ["## Per-batch pricing against a GPU", "",
              f"`python experiments/packed_step_gpu.py --compare` on one {data['device_kind']} "
              f"(jax {data['jax']}): a micro-step of one packed row under `hetshard.jit` "
              f"(a LLaMA-style model, {m['layers']} layers of width {m['hidden']}, "
              f"{m['dtype']} compute), measured (median of {data['repeats']}) against the "
              f"per-batch planner's price of that row. `before`: the same run before the flash "
              f"kernel multiplied in the inputs' dtype (`packed_step_gpu_before.json`). "
              f"Attention per squared token: a full row's time less a row of Wikipedia "
              f"documents' (squares near zero), over their squares.", ""]
    old = {(r["bucket"], r["kind"]): r for r in before.get("rows", [])}
    rows = []
    for b in data["per_bucket"]:
        mine = {r["kind"]: r for r in data["rows"] if r["bucket"] == b["bucket"]}
        pb = next((x for x in before.get("per_bucket", []) if x["bucket"] == b["bucket"]), {})
        one, wk = mine["one"], mine["wikipedia"]
        was = old.get((b["bucket"], "one"), {}).get("measured_s")
        rows.append([b["bucket"], f"{one['predicted_s'] * 1e3:,.0f}",
                     f"{was * 1e3:,.0f}" if was else "-", f"{one['measured_s'] * 1e3:,.0f}",
                     f"{wk['predicted_s'] * 1e3:,.0f}", f"{wk['measured_s'] * 1e3:,.0f}",
                     f"{b['attention_s_per_square_predicted']:.2e}",
                     f"{pb['attention_s_per_square_measured']:.2e}" if pb else "-",
                     f"{b['attention_s_per_square_measured']:.2e}",
                     f"{b['one_over_wikipedia_predicted']:.2f} / "
                     f"{b['one_over_wikipedia_measured']:.2f}"])
    lines += _table(["bucket", "one document: predicted ms", "measured before",
                     "measured", "Wikipedia row: predicted ms", "measured",
                     "attention s/square: predicted", "measured before", "measured",
                     "one / Wikipedia: predicted / measured"], rows)
    s = data["summary"]
    lines += ["", f"All {len(data['rows'])} rows (1, 2, 4, 8 equal documents, Wikipedia "
              f"documents, half a row plus Wikipedia documents): predicted / measured median "
              f"{s['median_pred_over_measured']:.2f} (median error "
              f"{s['median_abs_error']:.0%}, largest {s['max_abs_error']:.0%})"
              + (f"; before the kernel change "
                 f"{before['summary']['median_pred_over_measured']:.2f}" if before else "")
              + "."]
    cmp_ = data.get("compare")
    if cmp_:
        att = "; ".join(
            f"S={a['seq']}: hetshard flash {a['tflops'].get('hetshard_flash', 0):.0f}"
            + (f" (before {b['tflops'].get('hetshard_flash', 0):.0f})" if b else "")
            + f", cuDNN `jax.nn.dot_product_attention` "
              f"{a['tflops'].get('dot_product_attention', 0):.0f}, XLA reference "
              f"{a['tflops'].get('reference', 0):.0f}"
            for a, b in zip(cmp_["attention"], (before.get("compare") or {}).get(
                "attention", [None] * len(cmp_["attention"])), strict=False))
        a = cmp_["attention"][0]
        lines += ["", f"Attention alone, forward + backward TFLOP/s ({a['heads']} heads of "
                  f"{a['head_dim']}, bfloat16, causal): {att}."]
        plain = ", ".join(f"{p['bucket']} {p['kind']} {p['measured_s'] * 1e3:.0f} ms"
                          for p in cmp_["plain_jit"])
        lines += ["", f"The same rows as one `jax.jit` without hetshard (the model's XLA "
                  f"attention, scores materialised): {plain}."]
    if ref.get("rows"):
        r = ", ".join(f"{x['bucket']} {x['kind']} {x['measured_s'] * 1e3:.0f} ms"
                      for x in ref["rows"] if x["kind"] in ("one", "wikipedia"))
        lines += ["", f"`--attention reference` under hetshard.jit "
                  f"(`packed_step_gpu_reference.json`): {r}."]
    lines.append("")


def gpu_bench(lines, data):
    lines += ["## One GPU: hetshard.jit against a hand-written step, attention, price", ""]
    if not data.get("measured"):
        lines += ["`python experiments/gpu_bench.py` has not run on a GPU yet "
                  f"({data.get('note', 'no GPU')}).", ""]
        return
    lines += [f"`python experiments/gpu_bench.py` on one {data['gpu']} (JAX {data['jax']}).",
              ""]
    t = data["train_step"]
    lines += _table(["step", "ms", "tokens/s", "MFU"],
                    [[k, f"{t[k]['step_s'] * 1e3:.1f}", f"{t[k]['tokens_per_s']:.0f}",
                      f"{t[k]['mfu']:.1%}"] for k in ("handwritten", "nnx_jit", "hetshard")])
    lines += ["", f"hetshard / hand-written step-time ratio "
              f"{data['hetshard_vs_handwritten']:.3f}; own kernel / cuDNN "
              f"{data.get('own_kernel_vs_cudnn')}; predicted / measured "
              f"{data.get('predicted_vs_measured')}.", ""]


def flash_tuning(lines, data):
    lines += ["## The flash kernel's tiles per GPU", ""]
    if not data or not data.get("measured"):
        lines += ["`python experiments/gpu_bench.py --tune` (12 forward and 20 backward "
                  "settings at 4K and 16K) has not run on a GPU yet: every GPU runs JAX's "
                  "Pallas attention defaults (`bash experiments/gpu_session.sh` runs it "
                  "first on a lent GPU, then gpu_bench.py with what it found).", ""]
        return
    best, lengths = data["best"], [str(s) for s in data["lengths"]]
    lines += [f"`python experiments/gpu_bench.py --tune` on one {data['gpu']} (JAX "
              f"{data['jax']}), causal bf16, {data['heads']} heads of {data['head_dim']}, "
              "forward + backward TFLOP/s:", ""]
    rows = [["default", *(f"{data['default']['fwd_bwd']['tflops'].get(s, 0):.0f}"
                          for s in lengths)],
            ["best: " + ", ".join(f"{k} {v}" for k, v in best["tuning"].items()),
             *(f"{best['tflops'][s]:.0f}" for s in lengths)],
            ["cuDNN", *(f"{data['cudnn'][s]['fwd_bwd']:.0f}" for s in lengths)]]
    lines += _table(["settings", *(f"S={s}" for s in lengths)], rows)
    lines += ["", f"`TUNED` line: `{data.get('tuned_line')}`", ""]


def attention_scaled(lines, data):
    base = {(r["cluster"], r["model"], r["max_context"]): r
            for r in (_load("data_aware.json") or {}).get("rows", [])}
    scale = data["attention_scale"]
    lines += [f"## Data-aware planning with attention at {scale:g}x the default rate", "",
              f"`python experiments/data_aware.py --repeats 1 --attention-scale {scale:g}`: "
              f"the same batches and methods with attention priced on every GPU type at "
              f"{scale:g} of the cost model's default rate (FlashAttention-2's published "
              f"one), about what hetshard's kernel ran at on the H200 (per-batch pricing "
              f"against a GPU, above); an assumption for these GPU types, none measured. "
              f"Planning times of this run are not reported (it ran beside the test "
              f"suite).", ""]
    rows = []
    for r in data["rows"]:
        b = base.get((r["cluster"], r["model"], r["max_context"]))
        rows.append([r["cluster"], r["model"], f"{r['max_context'] // 1024}K",
                     f"{b['speedup']['fixed-cp']:.2f}x" if b else "-",
                     f"{r['speedup']['fixed-cp']:.2f}x",
                     f"{b['bound_speedup_over_fixed_cp']:.2f}x" if b else "-",
                     f"{r['bound_speedup_over_fixed_cp']:.2f}x",
                     f"{r['speedup']['identical']:.2f}x",
                     _replicas(r["groups"]["hetshard"])])
    lines += _table(["cluster", "model", "max context", "vs fixed-cp (default rate)",
                     f"vs fixed-cp (x{scale:g})", "bound vs fixed-cp (default)",
                     f"bound (x{scale:g})", f"vs identical (x{scale:g})",
                     f"replicas (x{scale:g})"], rows)
    lines.append("")


def memory_fit(lines, data):
    lines += ["## Compiled peak memory against its price", "",
              f"`python experiments/memory_fit.py` ({data['model']}, batch {data['batch']} x "
              f"{data['seq']}, float32, one single-stage step on {data['devices']} fake "
              f"{data['backend']} devices, JAX {data['jax']}): per device, the compiled "
              f"program's argument + output - donated alias + temporary bytes against the "
              f"simulator's peak for the same plan. Target: within "
              f"{data['target_within']:.0%}. Two XLA CPU schedulers: the default (ordered "
              f"for concurrency: a checkpointed layer's recomputation runs right after its "
              f"forward, so remat saves nothing on CPU) and the memory-minimising one.", ""]
    scheds = list(data["schedulers"])
    rows = []
    for k, row in enumerate(data["schedulers"][scheds[0]]["rows"]):
        cells = [row["layout"]]
        for sc in scheds:
            r = data["schedulers"][sc]["rows"][k]
            cells.append(f"{r['compiled']['peak'] / 1e6:.1f}")
        cells.append(f"{row['priced_peak'] / 1e6:.1f}")
        cells += [f"{data['schedulers'][sc]['rows'][k]['ratio_priced_over_compiled']:.3f}"
                  for sc in scheds]
        rows.append(cells)
    lines += _table(["layout"] + [f"compiled MB ({sc})" for sc in scheds] + ["priced MB"] +
                    [f"priced / compiled ({sc})" for sc in scheds], rows)
    lines.append("")


def offload(lines, data):
    lines += ["## Offload", "",
              "`python experiments/offload.py`: hetshard's plan with offload to host memory "
              "searched (the default) and without (`offload_options=(\"none\",)`), priced "
              "by the simulator (no GPU run): tokens/s, the largest per-device GPU memory "
              "and the most host memory a node's offload takes. Host links and memories "
              "are the catalog's.", ""]
    rows = []
    for r in data["rows"]:
        a, b = r["without"], r["with"]
        host = max(b.get("host_memory_gb_per_node", {}).values(), default=0.0)
        rows.append([r["cluster"], r["model"], str(r["global_batch"]),
                     f"{a['tokens_per_s']:,.0f}" if a.get("fits") else "no plan fits",
                     f"{b['tokens_per_s']:,.0f}" if b.get("fits") else "no plan fits",
                     f"{r['speedup']:.3f}" if r.get("speedup") else "-",
                     f"{a['peak_gpu_memory_gb']:.1f}" if a.get("fits") else "-",
                     f"{b['peak_gpu_memory_gb']:.1f}" if b.get("fits") else "-",
                     f"{host:.0f}",
                     f"{b.get('offloading_stages', 0)} of {len(b.get('stages', []))}"])
    lines += _table(["cluster", "model", "B", "without tokens/s", "with tokens/s", "speed-up",
                     "GPU GB without", "GPU GB with", "host GB per node",
                     "stages offloading"], rows)
    lines.append("")


def moe(lines, data):
    lines += ["## Mixture of experts", "",
              "`python experiments/moe.py`: hetshard's plan against (a) type-blind expert "
              "parallelism (uniform dp x tp x pp, 2-8 expert ranks, experts even), (a') the "
              "same with each mixed stage's experts placed by speed, and (b) HeterMoE-style "
              "zebra (attention halves on the newer type, expert halves on the older), all "
              "priced by the simulator (no GPU run). Sequence "
              f"{data['seq_len']}, global batch {data['global_batch']}; `cap`: the "
              "exchange's capacity factor (dropless: exact).", ""]

    def cell(r, name):
        b = r[name]
        return f"{b['tokens_per_s']:,.0f}" if b.get("fits") else "does not fit"
    rows = []
    for r in data["rows"]:
        over = [f"{r[k]:.2f}x" if r.get(k) else "-" for k in
                ("over_ep_type_blind", "over_ep_by_speed", "over_zebra")]
        ep = sorted({s["mesh"].get("expert", 1) for s in r["hetshard"].get("stages", [])})
        rows.append([r["model"], r["cluster"], "dropless" if r["capacity_factor"] is None
                     else str(r["capacity_factor"]), cell(r, "hetshard"),
                     "/".join(map(str, ep)), f"{r['hetshard'].get('peak_memory_gb', 0):.1f}",
                     cell(r, "ep_type_blind"), cell(r, "ep_by_speed"), cell(r, "zebra"),
                     *over])
    lines += _table(["model", "cluster", "cap", "hetshard tokens/s", "its EP degrees",
                     "peak GB", "(a) tokens/s", "(a') tokens/s", "(b) tokens/s",
                     "over (a)", "over (a')", "over (b)"], rows)
    s = data["summary"]
    lines += ["", f"At least {s['min_over_ep_type_blind']:.2f}x over (a) (target 1.3x) and "
              + (f"{s['min_over_zebra']:.2f}x over (b) where it fits" if s["min_over_zebra"]
                 else "(b) fitting nowhere")
              + f"; targets met: {s['meets_targets']}.", ""]
    skew = data.get("skewed_router")
    if skew:
        lines += [f"A skewed router: {skew['model']} on {skew['cluster']}, routing histogram "
                  f"{skew['histogram']} (tokens per expert), every plan priced under it.",
                  ""]
        names = (("hetshard", "hetshard, planned with the histogram"),
                 ("hetshard_even", "the same plan, experts even"),
                 ("hetshard_blind", "hetshard, planned blind to the skew"),
                 ("hetshard_no_ep", "hetshard without an expert axis"),
                 ("ep_type_blind", "(a) type-blind EP"))
        lines += _table(["plan", "tokens/s", "peak GB", "experts per rank"], [
            [label, f"{skew[k]['tokens_per_s']:,.0f}" if skew[k].get("fits")
             else "does not fit", f"{skew[k].get('peak_memory_gb', 0):.1f}",
             " ".join(str(list(c)) if c else "even" for c in skew[k].get("experts", []))
             or "no expert axis"]
            for k, label in names if k in skew])
        lines.append("")


# The sections of docs/results.md in order: the JSON each reads, and how.
SECTIONS = (("planner_bench.json", planner), ("cost_model_accuracy.json", accuracy),
            ("tp_overlap_whatif.json", whatif), ("gpu_dtypes.json", gpu_dtypes),
            ("long_context.json", long_context), ("data_aware.json", data_aware),
            ("data_aware_pipeline.json", data_aware_pipeline),
            ("packed_step_gpu.json", packed_step_gpu), ("gpu_bench.json", gpu_bench),
            ("flash_tuning.json", flash_tuning),
            ("data_aware_attention_x0.25.json", attention_scaled),
            ("elastic.json", elastic), ("attention_bench.json", attention),
            ("runtime_overhead.json", runtime), ("memory_fit.json", memory_fit),
            ("multihost_bench.json", multihost), ("offload.json", offload),
            ("moe.json", moe))


def main() -> int:
    lines = ["# Measured results", "",
             "Generated by `python experiments/results_tables.py` from "
             "`experiments/results/*.json`; each section names the script that wrote its "
             "numbers. Everything ran on a 2-core CPU machine with fake devices (throughputs "
             "are the simulator's) except the section that names its GPU.", ""]
    for name, section in SECTIONS:
        data = _load(name)
        if data is not None:  # a benchmark not run yet has no section
            section(lines, data)
    with open(OUT, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
