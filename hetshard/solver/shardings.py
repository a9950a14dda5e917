"""Per-parameter shardings for a plan's stages, from the intra-op CP-SAT solver.

Each distinct (block kind, GPU type, tensor degree, micro-batch size) among the plan's
stages is solved once on the traced block (identical blocks reuse the answer), and the
resulting specs are written to every stage's ``shardings`` as ``(parameter path,
spec)`` pairs, a spec being a tuple with ``"tensor"`` where the parameter is split.
Each stage also records the layout of the activation it hands on
(``activation:<layer>``: batch over ``data``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time

import models
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.comm import topology
from hetshard.cost.profile import ModelProfile, profile_model
from hetshard.errors import HetshardError, SpecError
from hetshard.ir.train_step import param_paths, trace_train_step, with_layers
from hetshard.plan import Plan
from hetshard.solver.intra_op import solve, spec_of

# A block, or with split blocks one of its halves (its parameters: attn*, mlp*).
_LAYER = re.compile(r"^(?P<stack>.+)/layer_(?P<i>\d+)(?:/(?P<part>attn|mlp))?$")


@functools.lru_cache(maxsize=16)
def _reduced(model: str, mbs: int, seq_len: int, dtype: str):
    config = with_layers(models.resolve(model), 2)
    graph = trace_train_step(config, micro_batch=mbs, seq_len=seq_len, dtype=dtype)
    return graph, param_paths(config)


def _path_prefix(stack: str, config) -> str:
    if isinstance(config, models.MLLMConfig):
        return "vision/layers" if stack == "vision" else "text/layers"
    return "layers"


def attach_shardings(plan: Plan, profile: ModelProfile, cluster: Cluster,
                     cal: Calibration = DEFAULT, time_limit_s: float = 10.0) -> Plan:
    """``plan`` with every stage's ``shardings`` filled in; the distinct intra-op problems
    share ``time_limit_s`` (each gets at least half a second)."""
    config = models.resolve(plan.model)
    deadline = time.perf_counter() + time_limit_s
    todo = {(m.group("stack"), cluster.gpu_of(st.devices[0]).name, st.axis("tensor"),
             pipe.stage_micro_batch(j))
            for pipe in plan.pipelines for j, st in enumerate(pipe.stages)
            if st.axis("tensor") > 1
            for li in range(st.start, st.end)
            if (m := _LAYER.match(profile.layers[li].name)) is not None}
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
                layer = profile.layers[li]
                m = _LAYER.match(layer.name)
                if tp == 1 or m is None:
                    continue
                key = (m.group("stack"), gpu.name, tp, mbs)
                if key not in solved:
                    graph, paths = _reduced(plan.model, mbs, plan.seq_len,
                                            plan.dtype)
                    src = f"{m.group('stack')}/layer_0"
                    ops = [op for op in graph.ops if op.layer == src and op.phase == "fwd"]
                    left = max(1, len(todo) - len(solved))
                    limit = max(0.5, (deadline - time.perf_counter()) / left)
                    res = solve(ops, tp=tp, gpu=gpu, topo=topology(cluster, st.devices[:tp]),
                                cal=cal, dtype=plan.dtype,
                                param_bytes=dict(enumerate(graph.param_bytes)),
                                time_limit_s=limit)
                    prefix = f"{_path_prefix(m.group('stack'), config)}/0/"
                    ranks = {}
                    for op in ops:
                        for src_k, shape in op.inputs:
                            if src_k <= -2:
                                ranks[-src_k - 2] = len(shape)
                    solved[key] = {paths[k][len(prefix):]: spec_of(lay, ranks.get(k, 2))
                                   for k, lay in res.param_specs.items()
                                   if paths[k].startswith(prefix)}
                prefix = f"{_path_prefix(m.group('stack'), config)}/{m.group('i')}/"
                part = m.group("part")
                entries += [(prefix + name, spec) for name, spec in
                            sorted(solved[key].items())
                            if part is None or name.split("/")[0].startswith(part)]
            entries.append((f"activation:{profile.layers[st.end - 1].name}",
                            ("data", None, None)))
            stages.append(dataclasses.replace(st, shardings=tuple(entries)))
        pipes.append(dataclasses.replace(pipe, stages=tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(pipes))


def lacks_shardings(stage) -> bool:
    """A stage with a ``tensor`` axis whose plan names no parameter layout for it (a plan
    written by hand, by ``uniform_plan`` or ``hetshard simulate --fix``)."""
    return stage.axis("tensor") > 1 and not any(
        not name.startswith("activation:") for name, _ in stage.shardings)


def fill_missing_shardings(plan: Plan, cluster: Cluster, cal: Calibration = DEFAULT,
                           time_limit_s: float = 10.0) -> Plan:
    """``plan`` with the parameter layouts of every stage that ``lacks_shardings`` solved
    as ``make_plan`` solves them; every other stage is kept as written. Without this such
    a stage would run its parameters replicated over ``tensor`` while the simulator
    prices it tensor-parallel.

    Raises:
      SpecError: the plan's model is not one of ``models/`` (its blocks cannot be traced
      to solve their layouts).
    """
    missing = [(i, j) for i, pipe in enumerate(plan.pipelines)
               for j, st in enumerate(pipe.stages) if lacks_shardings(st)]
    if not missing:
        return plan
    try:
        models.resolve(plan.model)
    except HetshardError:
        i, j = missing[0]
        raise SpecError(f"pipelines[{i}].stages[{j}].shardings", "[]",
                        "parameter PartitionSpecs for a stage with a tensor axis (hetshard "
                        "solves them itself only for models in models/)", where="plan") from None
    profile = profile_model(plan.model, plan.seq_len, plan.dtype,
                            split_blocks=plan.split_blocks)
    solved = attach_shardings(plan, profile, cluster, cal, time_limit_s=time_limit_s)
    pipes = []
    for i, pipe in enumerate(plan.pipelines):
        stages = tuple(solved.pipelines[i].stages[j] if (i, j) in missing else st
                       for j, st in enumerate(pipe.stages))
        pipes.append(dataclasses.replace(pipe, stages=stages))
    return dataclasses.replace(plan, pipelines=tuple(pipes))
