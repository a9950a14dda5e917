"""Planning: uniform plans, the intra-op (CP-SAT) and inter-op solvers, baselines."""

from __future__ import annotations

import dataclasses
import time
import warnings

from hetshard import progress
from hetshard._plan import nbytes
from hetshard.cluster.catalog import gpu_dtypes, warn_precision_fallback
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.profile import profile_program
from hetshard.errors import SpecError, check_positive
from hetshard.ir.program import Program
from hetshard.offload import option_text
from hetshard.sim.simulator import annotate, simulate
from hetshard.solver.halves import refine_halves
from hetshard.solver.inter_op import plan
from hetshard.solver.options import (
    BUDGET,
    NoFeasiblePlanError,
    PlannerMemoryWarning,
    PlannerOptions,
    PlannerTimeLimitWarning,
    SearchEffort,
)
from hetshard.solver.shardings import attach_shardings, expert_shardings
from hetshard.solver.uniform import parse_fix


def options_from_fix(text: str | None, base: PlannerOptions) -> PlannerOptions:
    """Restricts the planner with ``--fix``-style constraints (pp: stages per pipeline;
    tp, mbs, remat, schedule, vpp: stages per submesh, 1 for no interleaving; zero1: the
    distributed optimizer on or off; tp_overlap: collective matmuls on tensor stages, on
    or off); the planner chooses everything not given.

    Raises SpecError for keys the planner cannot honour (dp, cp, fsdp, hsdp, layers
    decide the rest of the layout, which is the planner's job: use ``hetshard simulate``
    to price a fixed layout).
    """
    if not text:
        return base
    fix = parse_fix(text)
    given = {item.split("=")[0].strip() for item in text.split(",") if "=" in item}
    layout = given & {"dp", "cp", "fsdp", "layers", "hsdp"}
    if layout:
        raise SpecError(f"--fix {sorted(layout)[0]}", getattr(fix, sorted(layout)[0]),
                        "only pp, tp, mbs, remat, offload, schedule, vpp, zero1 and tp_overlap for "
                        "'hetshard plan' (the planner chooses the rest of the layout; "
                        "'hetshard simulate --fix' prices a fixed one)")
    opts = base
    if "pp" in given:  # that many stages per pipeline; the planner chooses the rest
        opts = dataclasses.replace(opts, min_stages=fix.pp, max_stages=fix.pp)
    if "tp" in given:
        opts = dataclasses.replace(opts, tp_options=(fix.tp,))
    if "mbs" in given:
        opts = dataclasses.replace(opts, mbs_options=(fix.mbs,))
    if "remat" in given:
        opts = dataclasses.replace(opts, remat_options=(fix.remat,))
    if "offload" in given:
        opts = dataclasses.replace(opts, offload_options=(option_text(fix.offload),))
    if "schedule" in given:
        opts = dataclasses.replace(opts, schedule=fix.schedule, zero_bubble=False)
    if "vpp" in given:
        opts = dataclasses.replace(opts, virtual_options=(fix.vpp,))
    if "zero1" in given:
        opts = dataclasses.replace(opts, distributed_optimizer=fix.zero1)
    if "tp_overlap" in given:
        opts = dataclasses.replace(opts, tp_overlap=fix.tp_overlap)
    return opts


def make_plan(program, cluster, *, global_batch: int | None = None,
              options: PlannerOptions | None = None, calibration=None, shardings: bool = True):
    """Plans ``program`` (a :class:`hetshard.Program`: the user's traced train step) on
    ``cluster``: profile, inter-op search, intra-op shardings. ``global_batch`` defaults
    to the program's batch.

    Raises:
      NoFeasiblePlanError: nothing fits (names the tightest stage's need vs capacity).
      SpecError: a batch or constraint the program or cluster cannot take.

    Warns:
      PlannerTimeLimitWarning: ``options.time_limit_s`` cut the search; the plan is the
      best found, and the warning (and ``plan.solver``) gives its gap to the compute bound.
    """
    if not isinstance(program, Program):
        raise SpecError("program", type(program).__name__,
                        "a hetshard.Program (hetshard.Program(step, args), or "
                        "models.program(name) for the zoo)", where="make_plan")
    cluster = Cluster.load(cluster)
    opts = options or PlannerOptions()
    if global_batch is None:
        global_batch = program.global_batch
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise SpecError("global_batch", global_batch, "a positive integer")
    check_positive("time_limit_s", opts.time_limit_s, where="PlannerOptions")
    seq_len = program.seq_len
    warn_precision_fallback(cluster, program.dtype,
                            gpu_dtypes=gpu_dtypes(cluster, program.dtype, opts.gpu_dtypes))
    t0 = time.perf_counter()
    split = opts.split_blocks
    progress.phase("tracing and pricing the program's layers")
    profile = _skewed(profile_program(program, split_blocks=bool(split)), opts)
    heads = profile.heads or 1
    if opts.min_stages > min(profile.num_layers, cluster.num_devices):
        halves = not split and any(x.block for x in profile.layers)
        raise SpecError("min_stages", opts.min_stages,
                        f"at most the model's {profile.num_layers} layers"
                        + (" (block halves)" if split else "")
                        + f" and the cluster's {cluster.num_devices} GPUs (a stage holds "
                          f"at least one layer and one GPU)"
                        + ("; split_blocks=True cuts stages inside blocks" if halves else ""),
                        where="PlannerOptions")
    max_gpn = max(g.gpus_per_node for g in cluster.groups)
    usable = [t for t in opts.tp_options if heads % t == 0 and t <= max_gpn]
    if not usable:
        shown = opts.tp_options[0] if len(opts.tp_options) == 1 else list(opts.tp_options)
        raise SpecError("tp", shown, f"a tensor degree dividing the model's {heads} "
                        f"heads and at most {max_gpn} (GPUs per node)")
    cal = calibration or DEFAULT
    # One budget from the start (tracing and pricing the layers included): the inter-op
    # search ends by its share of it, the intra-op shardings take the rest (one CP-SAT
    # model per block and layout, returning its best so far); where the whole-block plan
    # is then refined in halves, the search keeps part of its share for that (BUDGET).
    inter = opts.time_limit_s * (BUDGET.inter_op if shardings else 1.0)
    refine = split is None and cluster.num_devices <= opts.search.split_blocks_max_devices
    narrowed = dataclasses.replace(opts, tp_options=tuple(usable), time_limit_s=inter)
    # The searches' own time-limit warnings name their share of the budget and the gap
    # before refinement: one warning below names the caller's limit and the final gap.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlannerTimeLimitWarning)
        result, profile = _searched(program, profile, cluster, global_batch, seq_len,
                                    cal, narrowed, inter, refine, t0)
    if result.solver.status == "time_limit":
        warnings.warn(PlannerTimeLimitWarning(
            f"planner hit its {opts.time_limit_s:g} s limit: best plan found, gap to the "
            f"compute bound {result.solver.gap:.1%}"), stacklevel=2)
    if shardings:
        left = opts.time_limit_s - (time.perf_counter() - t0)
        progress.phase("per-op shardings (intra-op solver)")
        result = attach_shardings(result, program, cluster, cal, time_limit_s=max(0.5, left))
        if any(st.shardings for pipe in result.pipelines for st in pipe.stages):
            result = _repriced(result, profile, cluster, cal)
    # the expert weights split over each expert axis (and checked against the program)
    result = expert_shardings(result, program)
    return dataclasses.replace(result, fingerprint=program.model_fingerprint)


def _skewed(profile, opts):
    """``profile`` with the options' router skew and routing histogram
    (``PlannerOptions.router_skew``, ``routing_histogram``, normalised)."""
    h = opts.routing_histogram
    loads = tuple(float(x) / sum(h) for x in h) if h else ()
    if opts.router_skew == profile.router_skew and loads == profile.expert_loads:
        return profile
    return dataclasses.replace(profile, router_skew=float(opts.router_skew),
                               expert_loads=loads)


def _repriced(plan, profile, cluster, cal):
    """``plan`` with its predictions redone under its solved parameter layouts: the search
    priced tensor-parallel stages with what no layout splits whole and the rest split
    (``hetshard.cost.stage.tensor_rank_bytes``), the solver may keep more whole (the
    runtime places them so). Warns where that leaves the plan over memory."""
    result = simulate(plan, profile, cluster, cal, trace=False)
    again = annotate(plan, result, plan.predicted.upper_bound_tokens_per_s)
    if plan.predicted.fits and not again.predicted.fits:
        mem = result.memory_per_device
        worst = max(mem, key=lambda d: mem[d] / cluster.gpu_of(d).memory_bytes)
        warnings.warn(PlannerMemoryWarning(
            f"the plan's solved tensor layouts keep some weights whole on each tensor rank: "
            f"device {worst} ({cluster.gpu_of(worst).name}) is priced at "
            f"{nbytes(mem[worst])}, over its {nbytes(cluster.gpu_of(worst).memory_bytes)}; "
            f"pass PlannerOptions(tp_options=(1,)) or more GPUs"), stacklevel=3)
    return again


def _searched(program, profile, cluster, global_batch, seq_len, cal, narrowed, inter,
              refine, t0):
    """(plan, its profile): the whole-block search, refined in block halves when
    ``refine`` (kept when faster)."""
    share = max(0.0, t0 + inter - time.perf_counter())  # less what tracing took
    result, bare, orders = plan(
        profile.model, profile, cluster, global_batch=global_batch, seq_len=seq_len,
        cal=cal, with_starts=True, options=dataclasses.replace(
            narrowed, time_limit_s=share * (BUDGET.whole_blocks if refine else 1.0)))
    if refine and any(layer.block for layer in profile.layers):
        # The whole-block plan refined with stage boundaries allowed inside blocks
        # (attention | MLP): kept when it fits and is faster (the whole-block plan in
        # halves can be priced over memory: the halves' boundaries keep other values).
        # Where it offloads to host memory, the best plan without is refined too (its
        # refinement can end ahead), each in half the time left. Then, in the time left
        # after them, the best priced candidates of the best few stage orders as they
        # were before the whole-block refinement (``_Search.orders``): a descent at
        # half-block grain from there can end ahead (mix3-x256 llama-70b: 152,790 tokens/s
        # from the refined plan, 154,085 from the best memory-first candidate,
        # docs/planner.md).
        progress.phase("stage boundaries inside blocks")
        halves = _skewed(profile_program(program, split_blocks=True), narrowed)
        starts = ([bare] if bare is not None else []) + [result]  # (ties: without offload)
        cut = result.solver.status == "time_limit"
        best_refined = None
        for k, start in enumerate(starts + orders):
            remaining = t0 + inter - time.perf_counter()
            if k < len(starts):  # the main starts share it, a second each at least
                left = max(1.0, remaining / (len(starts) - k))
            else:  # then the others, in what the main ones left
                left = remaining / (len(starts) + len(orders) - k)
                if left <= 0.0:  # (the search's effort not done: cut)
                    cut = True
                    break
            refined = refine_halves(start, profile, halves, cluster, cal=cal,
                                    options=dataclasses.replace(narrowed, time_limit_s=left))
            cut = cut or refined.solver.status == "time_limit"
            if refined.predicted.fits and (best_refined is None or refined.predicted.step_time_s
                                           < best_refined.predicted.step_time_s):
                best_refined = refined
        if best_refined is not None and best_refined.predicted.step_time_s < \
                result.predicted.step_time_s * (1 - 1e-9):
            result, profile = best_refined, halves
        result = dataclasses.replace(result, solver=dataclasses.replace(
            result.solver, wall_time_s=time.perf_counter() - t0,
            status="time_limit" if cut else result.solver.status))
    return _or_zebra(result, profile, program, cluster, global_batch, seq_len, cal,
                     narrowed, t0)


def _or_zebra(result, profile, program, cluster, global_batch, seq_len, cal, opts, t0):
    """``(result, profile)``, or for a mixture-of-experts model on several GPU types
    HeterMoE's zebra split (``baselines.zebra``: attention halves on the newest type,
    expert halves on the next, one interleaved pipeline) where it fits and is faster:
    the expert placement across types searched with the rest."""
    if len(cluster.groups) < 2 or not any(layer.experts for layer in profile.layers) or \
            opts.max_stages is not None or opts.min_stages > 2 or \
            (opts.virtual_options and max(opts.virtual_options) < 2):
        return result, profile
    from hetshard.solver.baselines import zebra
    halves = _skewed(profile_program(program, split_blocks=True), opts)
    found = zebra(result.model, halves, cluster, global_batch, seq_len, opts, cal)
    if found is None or not found.predicted.fits or (
            result.predicted.fits and found.predicted.step_time_s >=
            result.predicted.step_time_s):
        return result, profile
    found = dataclasses.replace(found, solver=dataclasses.replace(
        result.solver, wall_time_s=time.perf_counter() - t0))
    return found, halves


__all__ = ["NoFeasiblePlanError", "PlannerMemoryWarning", "PlannerOptions", "SearchEffort",
           "PlannerTimeLimitWarning", "make_plan",
           "options_from_fix"]
