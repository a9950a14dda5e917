"""The ``hetshard`` command line.

  hetshard devices  [--json [FILE]]          GPU catalog
  hetshard clusters [NAME] [--json [FILE]]   cluster presets, or one cluster's spec
  hetshard models   [NAME] [--json [FILE]]   model presets with parameter counts
  hetshard simulate --plan FILE | --model M --cluster C --global-batch B --fix dp=..
  hetshard profile  [--out FILE]             calibrate the cost model on this backend
  hetshard plan     --model M --cluster C --global-batch B [--time-limit T] [--json F]
  hetshard compare  --model M --cluster C --global-batch B --json F

Errors in user input print one line (``hetshard: error: ...``) and exit 2. Each
subcommand imports what it runs when it runs (JAX, the planner, the simulator), so
``hetshard --help`` and the catalog commands answer in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from hetshard._plan import ATTENTION_IMPLEMENTATIONS, DTYPES
from hetshard.errors import HetshardError

_ATTENTION_HELP = ("attention implementation: auto (per GPU type and pattern the fastest "
                   "that computes it: cuDNN, hetshard's flash kernel, XLA), or one of them "
                   "for every stage")


def _emit_json(obj, dest: str) -> None:
    text = json.dumps(obj, indent=2)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 or c in _TEXT_COLUMNS else "right",
                     overflow="fold")
    for r in rows:
        t.add_row(*("-" if v is None else str(v) for v in r))
    # Piped output is not cut to 80 columns: it is as wide as the table needs.
    Console(width=None if sys.stdout.isatty() else 240).print(t)


_TEXT_COLUMNS = ("source", "GPU types", "family")


def _count(n: float | None) -> str | None:
    if n is None:
        return None
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}" if n < 100 * scale else f"{n / scale:.1f}{unit}"
    return str(int(n))


def _fmt(x: float | None, digits: int = 1) -> str | None:
    return None if x is None else f"{x:,.{digits}f}"


def cmd_devices(args) -> int:
    from hetshard.cluster.catalog import CATALOG
    if args.json:
        _emit_json([t.to_dict() for t in CATALOG.values()], args.json)
        return 0
    _table("GPU catalog (per device, dense TFLOP/s, GB, GB/s one direction)",
           ["name", "bf16", "fp16", "fp32", "memory GB (datasheet)", "GB (driver total)",
            "HBM GB/s", "intra GB/s", "inter GB/s"],
           [[t.name, _fmt(t.bf16_tflops), _fmt(t.fp16_tflops), _fmt(t.fp32_tflops),
             _fmt(t.memory_gb, 0), _fmt(t.memory_bytes / 1e9, 1), _fmt(t.memory_gbs, 0),
             _fmt(t.intra_node_gbs, 0),
             _fmt(t.inter_node_gbs, 2)] for t in CATALOG.values()])
    return 0


def cmd_clusters(args) -> int:
    from hetshard.cluster import PRESETS, Cluster
    if args.name:
        c = Cluster.load(args.name)
        if args.json:
            _emit_json(c.to_dict(), args.json)
        else:
            print(c.to_toml(), end="")
        return 0
    rows = []
    for name, desc in PRESETS.items():
        c = Cluster.load(name)
        rows.append({"name": name, "gpus": c.num_devices,
                     "types": [t.name for t in c.device_types],
                     "peak_bf16_pflops": c.peak_flops("bfloat16") / 1e15,
                     "description": desc})
    if args.json:
        _emit_json(rows, args.json)
        return 0
    _table("Cluster presets", ["name", "GPUs", "GPU types", "peak bf16 PFLOP/s", "source"],
           [[r["name"], r["gpus"], " + ".join(r["types"]), _fmt(r["peak_bf16_pflops"], 2),
             r["description"]] for r in rows])
    return 0


def _model_row(name: str, config) -> dict:
    from hetshard_models import PUBLISHED_PARAMS
    n = config.num_params()
    pub = PUBLISHED_PARAMS.get(name)
    row = {"name": name, "family": config.family, "params": n,
           "published_params": pub[0] if pub else None,
           "relative_error": (n / pub[0] - 1) if pub else None}
    sub = config.text if config.family == "mllm" else config
    row.update(layers=sub.layers, hidden=sub.hidden, heads=sub.heads,
               seq=sub.seq if hasattr(sub, "seq") else None)
    return row


def _flat(d: dict, prefix: str = ""):
    """``(dotted key, value)`` of a nested dict, in order."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def cmd_models(args) -> int:
    import dataclasses

    import hetshard_models as models
    if args.name:
        c = models.resolve(args.name)
        row = _model_row(args.name, c)
        row["config"] = dataclasses.asdict(c)
        if args.json:
            _emit_json(row, args.json)
        else:
            config = row.pop("config")
            for k, v in row.items():
                if k in ("params", "published_params"):
                    v = _count(v)
                elif k == "relative_error" and v is not None:
                    v = f"{v:+.2%}"
                print(f"{k:>18}: {'-' if v is None else v}")
            print(f"{'config':>18}:")
            for k, v in _flat(config):
                print(f"{k:>24} = {v}")
        return 0
    rows = [_model_row(n, c) for n, c in models.PRESETS.items()]
    if args.json:
        _emit_json(rows, args.json)
        return 0
    _table("Model presets", ["name", "family", "layers", "hidden", "heads", "params",
                             "published", "error"],
           [[r["name"], r["family"], r["layers"], r["hidden"], r["heads"],
             _count(r["params"]), _count(r["published_params"]),
             None if r["relative_error"] is None else f"{r['relative_error']:+.2%}"]
            for r in rows])
    return 0


def _program(args, *, dtype_default: str | None = "bfloat16"):
    """The program ``--model`` names: a factory (``file.py:fn``, ``pkg.mod:fn``:
    ``hetshard.factory``) called with the given ``--seq-len``/``--dtype``, or a zoo preset
    or spec built shape-only through the same path (``models.steps.program``)."""
    from hetshard.factory import is_factory, load_program
    dtype = getattr(args, "dtype", None)
    if is_factory(args.model):
        return load_program(args.model, seq_len=args.seq_len, dtype=dtype,
                            implied=getattr(args, "implied", ()))
    from hetshard_models import steps
    return steps.program(args.model, seq_len=args.seq_len, dtype=dtype or dtype_default)


def cmd_simulate(args) -> int:
    from hetshard._plan import Plan
    from hetshard.cluster import Cluster
    from hetshard.cluster.catalog import gpu_dtypes, warn_precision_fallback
    from hetshard.cost.calibration import DEFAULT, Calibration
    from hetshard.cost.profile import profile_program
    from hetshard.sim.export import write_chrome_trace, write_timeline_png
    from hetshard.sim.simulator import priced
    from hetshard.solver.uniform import parse_fix, uniform_plan
    if (args.plan is None) == (args.fix is None):
        from hetshard.errors import SpecError
        raise SpecError("--plan/--fix", args.plan or args.fix,
                        "exactly one of --plan FILE (price a plan) or --fix dp=..,tp=..,pp=.. "
                        "(price a uniform plan)")
    cal = Calibration.load_all(args.calibration) if args.calibration else DEFAULT
    if args.plan is not None:
        plan = Plan.load(args.plan)
        if args.model is None:
            args.model = plan.model
        if args.seq_len is None:  # the plan's, for a factory only where it takes one
            args.seq_len, args.implied = plan.seq_len, ("seq_len",)
        cluster = Cluster.load(args.cluster or plan.cluster)
        program = _program(args, dtype_default=plan.dtype)
        if program.seq_len is not None and program.seq_len != plan.seq_len:
            from hetshard.errors import SpecError
            raise SpecError("--plan", args.plan,
                            f"a plan for the program's sequence length {program.seq_len} "
                            f"(this one is for {plan.seq_len}; --seq-len sets a factory's "
                            f"where it takes one)")
        profile = profile_program(program, plan.split_blocks)
        _check_covers(plan, profile, cluster)
    else:
        from hetshard.errors import SpecError
        for flag, value in (("--model", args.model), ("--cluster", args.cluster),
                            ("--global-batch", args.global_batch)):
            if value is None:
                raise SpecError(flag, None, "a value (required with --fix)")
        cluster = Cluster.load(args.cluster)
        program = _program(args)
        profile = profile_program(program)
        plan = uniform_plan(program.name, profile, cluster, global_batch=args.global_batch,
                            seq_len=program.seq_len, fix=parse_fix(args.fix),
                            attention=args.attention,
                            gpu_dtypes=gpu_dtypes(cluster, profile.dtype, args.gpu_dtypes))
    warn_precision_fallback(cluster, plan.dtype, gpu_dtypes=plan.gpu_dtypes)
    plan, result, upper = priced(plan, profile, cluster, cal)
    if args.trace:
        write_chrome_trace(result, args.trace, plan)
    if args.png:
        write_timeline_png(result, args.png, plan=plan)
    out = result.to_dict()
    out.update(upper_bound_tokens_per_s=upper, model_flops_counts_recompute=False,
               plan=plan.to_dict())
    if args.json:
        _emit_json(out, args.json)
    if args.json != "-":
        print(plan.explain())
    return 0


def _check_covers(plan, profile, cluster) -> None:
    """A plan priced on another model or cluster is an error naming what differs."""
    from hetshard.errors import SpecError
    ends = {p.stages[-1].end for p in plan.pipelines}
    if ends != {profile.num_layers}:
        raise SpecError("plan.pipelines[*].stages[-1].end", sorted(ends),
                        f"the model's {profile.num_layers} layers"
                        + (" (block halves)" if plan.split_blocks else ""), where="--plan")
    used = sorted({d for p in plan.pipelines for s in p.stages for d in s.devices})
    if used and used[-1] >= cluster.num_devices:
        raise SpecError("plan.pipelines[*].stages[*].devices", used[-1],
                        f"device ids below the cluster's {cluster.num_devices}",
                        where="--plan")


def _progress(what: str, limit_s: float | None):
    """A live status line on stderr while planning, when stderr is a terminal (phase,
    plans priced, best so far, time left); nothing otherwise."""
    import contextlib
    if not sys.stderr.isatty():
        return contextlib.nullcontext()
    return _live_status(what, limit_s)


def _live_status(what: str, limit_s: float | None):
    import contextlib

    from rich.console import Console

    from hetshard import progress

    @contextlib.contextmanager
    def run():
        with Console(stderr=True).status(what) as status, progress.reporting(
                lambda p: status.update(f"{what}: {p.line()}"), limit_s):
            yield
    return run()


def _planner_options(args):
    from hetshard.solver import PlannerOptions, options_from_fix
    base = PlannerOptions(time_limit_s=args.time_limit, attention=args.attention,
                          split_blocks={"auto": None, "yes": True, "no": False}[
                              args.split_blocks], gpu_dtypes=args.gpu_dtypes)
    return options_from_fix(args.fix, base)


def cmd_plan(args) -> int:
    from hetshard.cost.calibration import Calibration
    from hetshard.solver import make_plan
    cal = Calibration.load_all(args.calibration) if args.calibration else None
    options = _planner_options(args)
    with _progress("planning", options.time_limit_s):
        plan = make_plan(_program(args), args.cluster, global_batch=args.global_batch,
                         options=options, calibration=cal)
    if args.json:
        _emit_json(plan.to_dict(), args.json)
    if args.json != "-":
        print(plan.explain())
    return 0


def cmd_compare(args) -> int:
    from hetshard.cluster import Cluster
    from hetshard.cost.calibration import DEFAULT, Calibration
    from hetshard.cost.profile import profile_program
    from hetshard.sim import upper_bound_tokens_per_s
    from hetshard.solver import make_plan
    from hetshard.solver.baselines import BASELINES, MOE_BASELINES, run_baseline
    cal = Calibration.load_all(args.calibration) if args.calibration else DEFAULT
    cluster = Cluster.load(args.cluster)
    opts = _planner_options(args)
    program = _program(args)
    seq_len = program.seq_len
    profile = profile_program(program)
    rows = []
    with _progress("planning with hetshard", opts.time_limit_s):
        ours = make_plan(program, cluster, global_batch=args.global_batch, options=opts,
                         calibration=cal)
    rows.append(("hetshard", ours))
    # a mixture-of-experts model: expert-parallel baselines too (zebra on block halves)
    moe = MOE_BASELINES if any(layer.experts for layer in profile.layers) else ()
    for name in BASELINES + moe:
        priced = profile_program(program, split_blocks=True) if name == "zebra" else profile
        with _progress(f"planning as {name}", opts.time_limit_s):
            rows.append((name, run_baseline(name, program.name, priced, cluster,
                                            args.global_batch, seq_len, opts, cal)))
    upper = upper_bound_tokens_per_s(profile, cluster, cal, attention=opts.attention,
                                     gpu_dtypes=ours.gpu_dtypes)
    fitting = [p.predicted.tokens_per_s for n, p in rows[1:] if p and p.predicted.fits]
    best_base = max(fitting) if fitting else 0.0
    results = []
    for name, p in rows:
        tps = p.predicted.tokens_per_s if p else 0.0
        fits = bool(p and p.predicted.fits)
        results.append({"name": name, "tokens_per_s": tps, "fits": fits,
                        "ratio_to_upper_bound": tps / upper,
                        "ratio_to_best_baseline": tps / best_base if best_base else None,
                        "plan": p.to_dict() if p else None})
    out = {"model": args.model, "cluster": cluster.name, "global_batch": args.global_batch,
           "seq_len": seq_len, "upper_bound_tokens_per_s": upper, "results": results}
    if args.json:
        _emit_json(out, args.json)
    if args.json != "-":
        _table(f"{args.model} on {cluster.name}, global batch {args.global_batch} "
               f"(upper bound {upper:,.0f} tokens/s)",
               ["planner", "tokens/s", "fits", "vs upper bound", "vs best baseline"],
               [[r["name"], f"{r['tokens_per_s']:,.0f}", r["fits"],
                 f"{r['ratio_to_upper_bound']:.1%}",
                 None if r["ratio_to_best_baseline"] is None
                 else f"{r['ratio_to_best_baseline']:.3f}x"] for r in results])
    return 0


def _ints(text: str, field: str) -> tuple[int, ...]:
    from hetshard.errors import SpecError
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or any(b < 1 for b in out):
        raise SpecError(field, text, "comma-separated positive integers, e.g. 1,2,4")
    return out


def cmd_profile(args) -> int:
    if args.model is not None:
        from hetshard.cost.layer_profiler import profile_layers
        prof = profile_layers(_program(args), _ints(args.micro_batches, "--micro-batches"),
                              reps=2 if args.quick else 5, attention=args.attention)
        prof.save(args.out)
        for gpu, roles in prof.gpus.items():
            for role, table in roles.items():
                print(f"{gpu} {role}: " + ", ".join(
                    f"mbs {b}: fwd {t.forward_s * 1e3:.2f} ms, bwd {t.backward_s * 1e3:.2f} ms"
                    for (_, b, _), t in sorted(table.items())))
        print(f"wrote {args.out} (measured profile; pass it to --calibration)")
        return 0
    from hetshard.cost.profiler import profile_backend
    cal = profile_backend(quick=args.quick)
    cal.save(args.out)
    print(f"wrote {args.out}: " + ", ".join(
        f"{n}: matmul_eff={e.matmul_eff:.3f} attention_eff={e.attention_eff:.3f} "
        f"memory_eff={e.memory_eff:.3f} comm_eff={e.comm_eff:.3f}"
        for n, e in cal.per_type))
    return 0


CALIBRATION_HELP = ("a calibration (hetshard profile) or a measured per-layer profile "
                    "(hetshard profile --model, AMP's or Sailor's published files: "
                    "docs/profile-format.md); repeat to combine")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetshard", description="Sharding planner and runtime "
                                "for heterogeneous GPU clusters.")
    sub = p.add_subparsers(dest="command", required=True)

    def json_flag(sp):
        sp.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write JSON (to FILE, or stdout when FILE is omitted or '-')")

    def gpu_dtypes_flag(sp, when=""):
        sp.add_argument("--gpu-dtypes", default="program", choices=["program", "fastest"],
                        help=when + "compute dtype per GPU type: program (every GPU in the "
                             "model's dtype) or fastest (float16 with dynamic loss scaling "
                             "on V100/T4 under a bfloat16 model: they lack bfloat16 tensor "
                             "cores)")

    sp = sub.add_parser("devices", help="list the GPU catalog")
    json_flag(sp)
    sp.set_defaults(func=cmd_devices)
    sp = sub.add_parser("clusters", help="list cluster presets, or print one cluster's spec")
    sp.add_argument("name", nargs="?", help="a preset name or spec file to print")
    json_flag(sp)
    sp.set_defaults(func=cmd_clusters)
    sp = sub.add_parser("models", help="list model presets, or describe one model")
    sp.add_argument("name", nargs="?", help="a preset name or 'family:key=value,...' spec")
    json_flag(sp)
    sp.set_defaults(func=cmd_models)

    model_help = ("a zoo preset or 'gpt:key=value,...' spec, or a factory: file.py:fn or "
                  "package.module:fn returning (step, args) (see docs/cli.md)")
    sp = sub.add_parser("simulate", help="price a plan file, or a user-fixed uniform plan")
    sp.add_argument("--plan", default=None, help="a Plan JSON to price (exported, "
                    "hand-edited or converted); its model, cluster and sequence by default")
    sp.add_argument("--model", default=None, help=model_help)
    sp.add_argument("--cluster", default=None, help="preset name or spec file")
    sp.add_argument("--global-batch", type=int, default=None)
    sp.add_argument("--seq-len", type=int, default=None, help="default: the model's seq")
    sp.add_argument("--fix", default=None,
                    help="dp=,tp=,pp=,cp=,fsdp=true|false,hsdp=,mbs=,remat=none|selective|"
                         "save_qkv..|full,offload=none|optimizer|activations|"
                         "optimizer+activations,schedule=1f1b|gpipe|zbh1,vpp=,zero1=,"
                         "tp_overlap=,layers=7,8*14,7 (docs/cli.md)")
    sp.add_argument("--dtype", default=None, choices=DTYPES,
                    help="zoo models: compute dtype (default bfloat16, or the plan's)")
    sp.add_argument("--attention", default="auto", choices=list(ATTENTION_IMPLEMENTATIONS),
                    help=_ATTENTION_HELP)
    gpu_dtypes_flag(sp, "with --fix: ")
    sp.add_argument("--calibration", action="append", default=None,
                    help=CALIBRATION_HELP)
    sp.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    sp.add_argument("--png", default=None, help="write a PNG timeline here")
    json_flag(sp)
    sp.set_defaults(func=cmd_simulate)

    for cmd, fn, hlp in (("plan", cmd_plan, "plan a model on a cluster"),
                         ("compare", cmd_compare, "plan with hetshard and every baseline")):
        sp = sub.add_parser(cmd, help=hlp)
        sp.add_argument("--model", required=True, help=model_help)
        sp.add_argument("--cluster", required=True)
        sp.add_argument("--global-batch", type=int, required=True)
        sp.add_argument("--seq-len", type=int, default=None)
        sp.add_argument("--time-limit", type=float, default=60.0,
                        help="seconds the search may take (default 60). Its effort is "
                             "fixed by the options; the limit is a safety net that cuts "
                             "its phases (at 25%%, 60%%, 85%% of it) and says so. Tracing "
                             "the program and the last layout solve come on top; on the "
                             "largest clusters the search can overrun it by seconds")
        sp.add_argument("--fix", default=None,
                        help="constraints: pp=,tp=,mbs=,remat=,offload=,schedule=,vpp=,zero1=,"
                             "tp_overlap=")
        sp.add_argument("--dtype", default=None, choices=DTYPES,
                        help="zoo models: compute dtype (default bfloat16); a factory "
                             "gets it as its dtype argument")
        sp.add_argument("--attention", default="auto", choices=list(ATTENTION_IMPLEMENTATIONS),
                    help=_ATTENTION_HELP)
        sp.add_argument("--split-blocks", default="auto", choices=["auto", "yes", "no"],
                        help="stage boundaries inside blocks (attention | MLP): auto "
                             "refines the best whole-block plan with them (clusters of up "
                             "to 256 GPUs) and keeps it when faster; yes searches halves")
        gpu_dtypes_flag(sp)
        sp.add_argument("--calibration", action="append", default=None,
                        help=CALIBRATION_HELP)
        json_flag(sp)
        sp.set_defaults(func=fn)

    sp = sub.add_parser("profile", help="time matmuls, elementwise ops and collectives on "
                                        "this backend and write a calibration file; with "
                                        "--model, time that model's layers and write a "
                                        "measured profile (docs/profile-format.md)")
    sp.add_argument("--out", default="calibration.json")
    sp.add_argument("--quick", action="store_true", help="small shapes (tests)")
    sp.add_argument("--model", default=None, help=model_help)
    sp.add_argument("--seq-len", type=int, default=None)
    sp.add_argument("--dtype", default=None, choices=DTYPES)
    sp.add_argument("--micro-batches", default="1,2", help="sizes to time, e.g. 1,2,4")
    sp.add_argument("--attention", default="reference", choices=["flash", "reference"])
    sp.set_defaults(func=cmd_profile)

    sp = sub.add_parser("launch", help="run a script as N local jax.distributed processes "
                                       "with K fake CPU devices each")
    sp.add_argument("--nprocs", type=int, required=True)
    sp.add_argument("--devices-per-proc", type=int, default=1)
    sp.add_argument("--cluster", default=None,
                    help="cluster spec passed to the processes as $HETSHARD_CLUSTER")
    sp.add_argument("--max-restarts", type=int, default=0,
                    help="start a failed job again, every process, up to this many times "
                         "($HETSHARD_RESTART counts the starts; default 0)")
    sp.add_argument("command", nargs=argparse.REMAINDER,
                    help="-- python train.py ... (the command every process runs)")
    sp.set_defaults(func=cmd_launch)
    return p


def cmd_launch(args) -> int:
    from hetshard.distributed import launch
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.cluster:
        from hetshard.cluster import Cluster
        Cluster.load(args.cluster)  # a bad spec fails here, before any process starts
    return launch(args.nprocs, args.devices_per_proc, command, cluster=args.cluster,
                  max_restarts=args.max_restarts)


_OUTPUTS = ("json", "png", "trace", "out")


def check_args(args) -> None:
    """Every number and output path the command was given, checked before any work: a
    run that plans for a minute must not fail when it writes its result."""
    from hetshard.errors import check_positive
    for name in ("global_batch", "seq_len", "nprocs", "devices_per_proc"):
        value = getattr(args, name, None)
        if value is not None:
            check_positive(f"--{name.replace('_', '-')}", value, integer=True)
    limit = getattr(args, "time_limit", None)
    if limit is not None:
        check_positive("--time-limit", limit)
    for name in _OUTPUTS:
        dest = getattr(args, name, None)
        if dest is None or dest == "-":
            continue
        check_output_path(f"--{name}", dest)


def check_output_path(field: str, dest: str) -> None:
    """``dest`` can be written: not a directory, in an existing writable directory."""
    import os

    from hetshard.errors import SpecError
    folder = os.path.dirname(os.path.abspath(dest))
    if os.path.isdir(dest):
        raise SpecError(field, dest, "a file path, not a directory")
    if not os.path.isdir(folder):
        raise SpecError(field, dest, f"a path in an existing directory ({folder} does not "
                                     f"exist)")
    if not os.access(folder, os.W_OK | os.X_OK) or (
            os.path.exists(dest) and not os.access(dest, os.W_OK)):
        raise SpecError(field, dest, "a path this user can write")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"hetshard: warning: {message}", file=sys.stderr)
    shown, warnings.showwarning = warnings.showwarning, show
    try:
        check_args(args)
        status = args.func(args)
        sys.stdout.flush()  # (a reader that went away shows here, not at exit)
        return status
    except HetshardError as e:
        print(f"hetshard: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader closed the pipe (``hetshard devices | head -1``): stop quietly, with
        # stdout pointed at /dev/null so that Python's own flush at exit finds no pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
