"""Per-parameter shardings for a plan's stages, from the intra-op CP-SAT solver.

Each distinct (layer kind, GPU type, tensor degree, micro-batch size) among the plan's
tensor-parallel stages is solved once, on the forward equations of the first layer of
that kind in the traced program (``hetshard.ir.program.reduced_graph``; identical blocks
reuse the answer), and the resulting specs are written to every stage's ``shardings``
as ``(parameter path, spec)`` pairs, a spec being a tuple with ``"tensor"`` where the
parameter is split. A parameter of another layer of the same kind gets the spec of the
parameter at the same position in its layer (``Program.layer_params``). Only layers of
repeated stacks are split this way; embeddings and heads stay replicated over
``tensor``. Each stage also records the layout of the activation it hands on
(``activation:<layer>``: batch over ``data``).
"""

from __future__ import annotations

import dataclasses
import time
import warnings

from hetshard._plan import Plan
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.comm import topology
from hetshard.ir.moe import expert_regions
from hetshard.ir.program import Program, reduced_graph
from hetshard.solver.intra_op import solve, spec_of


def attach_shardings(plan: Plan, program: Program, cluster: Cluster,
                     cal: Calibration = DEFAULT, time_limit_s: float = 10.0) -> Plan:
    """``plan`` with every stage's ``shardings`` filled in; the distinct intra-op problems
    share ``time_limit_s`` (each gets at least half a second)."""
    deadline = time.perf_counter() + time_limit_s
    lay = program.layering(2, plan.split_blocks)
    reads = program.layer_params(2, plan.split_blocks)
    first_of: dict[str, int] = {}
    for k, kind in enumerate(lay.kinds):
        first_of.setdefault(kind, k)
    todo = {(lay.kinds[li], cluster.gpu_of(st.devices[0]).name, st.axis("tensor"),
             pipe.stage_micro_batch(j))
            for pipe in plan.pipelines for j, st in enumerate(pipe.stages)
            if st.axis("tensor") > 1 for li in range(st.start, st.end)
            if lay.stacks[li] >= 0}
    solved: dict = {}
    pipes = []
    for pipe in plan.pipelines:
        stages = []
        for j, st in enumerate(pipe.stages):
            tp = st.axis("tensor")
            mbs = pipe.stage_micro_batch(j)
            entries = []
            gpu = cluster.gpu_of(st.devices[0])
            for li in range(st.start, st.end):
                if tp == 1 or lay.stacks[li] < 0:
                    continue
                key = (lay.kinds[li], gpu.name, tp, mbs)
                if key not in solved:
                    left = max(1, len(todo) - len(solved))
                    limit = max(0.5, (deadline - time.perf_counter()) / left)
                    solved[key] = _solve_kind(program, plan, first_of[lay.kinds[li]], mbs,
                                              tp, gpu, cluster, st, cal, limit)
                for pos, spec in sorted(solved[key].items()):
                    entries.append((program.param_path(reads[li][pos]), spec))
            stages.append(dataclasses.replace(
                st, shardings=tuple(entries),
                activations=((lay.names[st.end - 1], ("data", None, None)),)))
        pipes.append(dataclasses.replace(pipe, stages=tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(pipes))


def _solve_kind(program, plan, layer: int, mbs: int, tp: int, gpu, cluster, stage, cal,
                limit) -> dict[int, tuple]:
    """Position in the layer's parameter reads -> spec, for one layer kind."""
    graph, lay, _, param_index = reduced_graph(program, mbs, plan.split_blocks)
    name = lay.names[layer]
    ops = [op for op in graph.ops if op.layer == name and op.phase == "fwd"]
    res = solve(ops, tp=tp, gpu=gpu, topo=topology(cluster, stage.devices[:tp]), cal=cal,
                dtype=plan.stage_dtype(stage), param_bytes=dict(enumerate(graph.param_bytes)),
                time_limit_s=limit)
    reads = program.layer_params(2, plan.split_blocks)[layer]
    out = {}
    for k, lay_str in res.param_specs.items():
        leaf = param_index[k]
        if leaf in reads:
            rank = len(program.state_avals[leaf].shape)
            out[reads.index(leaf)] = spec_of(lay_str, rank)
    return out


def lacks_shardings(stage) -> bool:
    """A stage with a ``tensor`` axis whose plan names no parameter layout for it (a plan
    written by hand, by ``uniform_plan`` or ``hetshard simulate --fix``)."""
    return stage.axis("tensor") > 1 and not stage.shardings


def fill_missing_shardings(plan: Plan, program: Program, cluster: Cluster,
                           cal: Calibration = DEFAULT, time_limit_s: float = 10.0) -> Plan:
    """``plan`` with the parameter layouts of every stage that ``lacks_shardings`` solved
    on ``program`` as ``make_plan`` solves them; every other stage is kept as written.
    Without this such a stage would run its parameters replicated over ``tensor`` while
    the simulator prices it tensor-parallel."""
    missing = [(i, j) for i, pipe in enumerate(plan.pipelines)
               for j, st in enumerate(pipe.stages) if lacks_shardings(st)]
    if not missing:
        return plan
    solved = attach_shardings(plan, program, cluster, cal, time_limit_s=time_limit_s)
    pipes = []
    for i, pipe in enumerate(plan.pipelines):
        stages = tuple(solved.pipelines[i].stages[j] if (i, j) in missing else st
                       for j, st in enumerate(pipe.stages))
        pipes.append(dataclasses.replace(pipe, stages=stages))
    return dataclasses.replace(plan, pipelines=tuple(pipes))


def expert_shardings(plan: Plan, program: Program) -> Plan:
    """``plan`` with the stacked expert weights of every stage with an ``expert`` axis
    split along their expert axis over it, evenly (their optimizer state follows): under
    an even placement each rank stores the experts it computes; under an uneven one
    (``Stage.experts``) each rank is brought the experts it lacks from that even storage
    (JAX arrays split evenly; ``hetshard.collectives.experts.brought_experts``), and
    where the axis does not divide the experts they stay whole on every rank. On a stage
    sharding its state (``fsdp``) each expert is split over that axis too, and gathered
    for its layer's exchange. Checks what expert parallelism needs of the program:
    mixture-of-experts layers (a ``PlanNotExecutableError`` for a dense model) whose
    expert count the placement holds (``hetshard.rewrite.experts.placement``)."""
    from hetshard.errors import PlanNotExecutableError
    from hetshard.rewrite.experts import placement

    staged = [(i, j, st) for i, pipe in enumerate(plan.pipelines)
              for j, st in enumerate(pipe.stages) if st.axis("expert") > 1]
    if not staged:
        return plan
    layers = program.moe_layers
    if not layers:
        i, j, st = staged[0]
        raise PlanNotExecutableError(
            f"pipelines[{i}].stages[{j}].mesh_shape {dict(st.mesh_shape)} has an expert "
            f"axis of {st.axis('expert')}, but {program.name} has no mixture-of-experts "
            f"layer (a top_k router whose experts' weights are stacked on a leading "
            f"axis): a dense model takes no expert axis (use data, fsdp, tensor or "
            f"context)")
    # Dropless layers the rewrite cannot reach (inside a jax.checkpoint, jit or loop
    # body the step keeps) run under XLA's partitioner instead: said, not hidden.
    dropless = [layer for layer in layers if layer.dispatch == "dropless"]
    reached = expert_regions(program.loss_jaxpr(2)[0].jaxpr)  # (refuses what it cannot run)
    if len(reached) < len(dropless):
        warnings.warn(
            f"{len(dropless) - len(reached)} of {program.name}'s {len(dropless)} dropless "
            f"mixture-of-experts layers sit inside a call hetshard does not rewrite (a "
            f"jax.checkpoint, jit or loop body): they run under XLA's partitioner with "
            f"their expert weights split over the expert axis, without the all-to-all "
            f"exchange the plan prices; call the layer outside such a wrapper",
            stacklevel=4)
    weights: dict[str, tuple[int, tuple]] = {}
    for layer in layers:
        for w in layer.expert_weights:
            shape = tuple(program.state_avals[w].shape)
            weights[program.param_path(w)] = (len(shape), shape)
    pipes = []
    for i, pipe in enumerate(plan.pipelines):
        stages = list(pipe.stages)
        for j, st in enumerate(stages):
            if st.axis("expert") == 1:
                continue
            for layer in layers:
                placement(st, layer.experts, f"pipelines[{i}].stages[{j}]")
            if any(layer.experts % st.axis("expert") for layer in layers):
                continue
            named = dict(st.shardings)
            fsdp = st.axis("fsdp")
            for path, (rank, shape) in weights.items():
                spec = list(named.get(path, (None,) * rank)) + [None] * rank
                if spec[0] is None:
                    spec[0] = "expert"
                if fsdp > 1 and "fsdp" not in spec:
                    # FSDP splits each expert too (its largest free dimension it
                    # divides), gathered for the layer as the stage's other weights are
                    free = [d for d in range(1, rank) if spec[d] is None and
                            shape[d] % fsdp == 0]
                    if free:
                        spec[max(free, key=lambda d: (shape[d], -d))] = "fsdp"
                named[path] = tuple(spec[:rank])
            stages[j] = dataclasses.replace(st, shardings=tuple(sorted(named.items())))
        pipes.append(dataclasses.replace(pipe, stages=tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(pipes))
