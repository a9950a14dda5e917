"""The SPMD rewrite: a single-stage plan's layouts imposed inside the traced step.

``constrain_layers(fn, mesh, plan_stage, attention=...)`` returns ``fn`` re-interpreted
from its jaxpr on the stage mesh: every layer-boundary activation (a value one layer
computes and a later layer reads, found from the ``named_scope`` layer tags as the
pipeline rewrite finds stage boundaries) gets a ``with_sharding_constraint`` to the
plan's activation layout, and attention is computed by the plan's implementation (the
flash kernel per device of the mesh, ``hetshard.rewrite.attention._flash_on_mesh``). The
parameters' and the batch's layouts are the program's input shardings
(``hetshard.layout``); with the boundaries pinned as well, XLA's propagation
cannot drift the batch layout across layers (for example toward a tensor-split weight's
layout), so the program the plan priced is the program that runs, with the stage's
remat (each recomputed layer under its own checkpoint, as in the pipeline rewrite).
The plan's ``activation:<layer>`` entries name the layout (batch over the data axes);
a boundary whose leading dimension the data axes do not divide is left unconstrained.
On a stage with tensor-split weights the boundaries are also split along the sequence
(sequence parallelism, ``stage_sequence_layouts``, which pipeline stages share).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as ext
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetshard._plan import Stage
from hetshard.collectives.matmul import allgather_matmul, matmul_reducescatter
from hetshard.ir.interpret import Replace, eval_equations
from hetshard.ir.paths import path_string
from hetshard.layout import batch_axes_for, boundary_layout, leaf_spec
from hetshard.rewrite.attention import attention_runner
from hetshard.rewrite.experts import expert_layouts
from hetshard.rewrite.pipeline import (
    StageSplitError,
    eval_segments,
    layer_sequence,
    remat_segments,
    remat_wrap,
    static_values,
)


def _sequence_split(mesh: Mesh, shape) -> NamedSharding | None:
    """An activation ``[batch, seq, ...]`` split over the data axes and, along its
    sequence, ``tensor`` (Megatron-LM's sequence parallelism, Korthikanti et al. 2022);
    None when the shape does not allow it."""
    tp = mesh.shape.get("tensor", 1)
    if tp == 1 or len(shape) < 3 or shape[1] % tp:
        return None
    return NamedSharding(mesh, PartitionSpec(batch_axes_for(mesh, shape[0]), "tensor"))


def _gather_sequence(mesh: Mesh, shape):
    """Megatron's ``g`` under sequence parallelism: the input of a column-parallel matmul
    gathered along its sequence (an all-gather), its cotangent reduce-scattered back."""
    full = NamedSharding(mesh, PartitionSpec(batch_axes_for(mesh, shape[0])))
    split = _sequence_split(mesh, shape)

    @jax.custom_vjp
    def gather(x):
        return jax.lax.with_sharding_constraint(x, full)

    def fwd(x):
        return gather(x), None

    def bwd(_, ct):
        return (jax.lax.with_sharding_constraint(ct, split),)
    gather.defvjp(fwd, bwd)
    return gather


def _dot(eqn):
    """The matmul of a ``dot_general`` equation, to apply to other operands."""
    p = eqn.params

    def dot(a, b):
        return jax.lax.dot_general(a, b, p["dimension_numbers"], precision=p["precision"],
                                   preferred_element_type=p["preferred_element_type"])
    return dot


def _weight_spec(eqn, spec) -> tuple | None:
    """The weight's spec padded to its rank; None when it is split over more than
    ``tensor`` (FSDP: XLA's layouts then)."""
    spec = tuple(spec) + (None,) * (len(eqn.invars[1].aval.shape) - len(spec))
    return spec if all(a in (None, "tensor") for a in spec) else None


def _row_matmul(eqn, mesh: Mesh, spec: tuple):
    """A ``Replace`` computing the row-parallel ``eqn`` as a matmul + reduce-scatter ring
    (``matmul_reducescatter``), or None."""
    wspec = _weight_spec(eqn, spec)
    if wspec is None:
        return None
    lhs = eqn.invars[0].aval
    (lc, rc), _ = eqn.params["dimension_numbers"]
    batch = batch_axes_for(mesh, lhs.shape[0])
    x = [batch] + [None] * (len(lhs.shape) - 1)
    x[lc[list(rc).index(wspec.index("tensor"))]] = "tensor"
    dot = _dot(eqn)
    return Replace(lambda a, b: [matmul_reducescatter(
        a, b, dot, mesh, PartitionSpec(*x), PartitionSpec(*wspec),
        PartitionSpec(batch, "tensor"))])


def _column_group(group, mesh: Mesh, spec_of: dict, made_from: dict) -> dict | None:
    """``Replace`` entries computing the column-parallel matmuls ``group`` (equations
    sharing their input) as one all-gather ring (``allgather_matmul``), or None. The
    first computes them all, from the parameters the weights are made of (a cast or
    transpose of one may come after it), and hands the others their results."""
    wspecs, outs, makers = [], [], []
    lhs = group[0].invars[0]
    batch = batch_axes_for(mesh, lhs.aval.shape[0])
    for eqn in group:
        rhs = eqn.invars[1]
        wspec = _weight_spec(eqn, spec_of[rhs])
        if wspec is None or rhs not in made_from:
            return None
        (lc, rc), _ = eqn.params["dimension_numbers"]
        free = [i for i in range(len(rhs.aval.shape)) if i not in rc]
        out = [batch] + [None] * (len(eqn.outvars[0].aval.shape) - 1)
        out[len(lhs.aval.shape) - len(lc) + free.index(wspec.index("tensor"))] = "tensor"
        wspecs.append(PartitionSpec(*wspec))
        outs.append(PartitionSpec(*out))
        makers.append(made_from[rhs])
    dots = [_dot(eqn) for eqn in group]
    box: list = []

    def first(x, *sources):
        ws = [make(src) for (_, make), src in zip(makers, sources, strict=True)]
        box[:] = allgather_matmul(x, ws, dots, mesh, PartitionSpec(batch, "tensor"), wspecs,
                                  outs)
        return [box[0]]
    entries = {group[0].outvars[0]: Replace(first, [lhs] + [src for src, _ in makers])}
    for k, eqn in enumerate(group[1:], 1):
        entries[eqn.outvars[0]] = Replace(lambda *_, k=k: [box[k]], [])
    return entries


def sequence_layouts(jaxpr, weights: dict, mesh: Mesh, indices=None,
                     overlap: bool = False) -> dict:
    """Sequence-parallel layouts for the equations ``indices`` (all by default) of
    ``jaxpr`` on a mesh with a ``tensor`` axis: ``var -> constraint`` for
    ``eval_equations``. ``weights`` maps the variables holding parameters to their
    PartitionSpec. A matmul whose weight is split over ``tensor`` along a contracting
    dimension (row-parallel) leaves its output split along the sequence (XLA turns the
    partial sums' reduction into a reduce-scatter); one whose weight is split along a
    free dimension (column-parallel) gathers its input's sequence first. Between them
    (layer norms, residual adds, dropout) activations stay split, as the simulator
    prices their memory (``hetshard.cost.stage``). With ``overlap`` each such matmul
    runs as a collective matmul instead, its collective overlapped with its blocks
    (``hetshard.collectives.matmul``; column-parallel matmuls of one input share a
    ring)."""
    if mesh.shape.get("tensor", 1) == 1:
        return {}
    spec_of = {v: tuple(spec) for v, spec in weights.items()}
    made_from = {v: (v, lambda w: w) for v in weights}  # var -> (parameter, make)
    out: dict = {}
    columns: dict = {}  # input var -> its column-parallel matmuls, in order
    for idx in (range(len(jaxpr.eqns)) if indices is None else indices):
        eqn = jaxpr.eqns[idx]
        name = eqn.primitive.name
        src = eqn.invars[0] if eqn.invars else None
        if name in ("convert_element_type", "copy", "copy_p") and \
                isinstance(src, ext.Var) and src in spec_of:
            spec_of[eqn.outvars[0]] = spec_of[src]
            if src in made_from:
                root, make = made_from[src]
                dtype = eqn.outvars[0].aval.dtype
                made_from[eqn.outvars[0]] = (root, lambda w, m=make, t=dtype: m(w).astype(t))
        elif name == "transpose" and isinstance(src, ext.Var) and src in spec_of:
            perm = tuple(eqn.params["permutation"])
            spec = spec_of[src] + (None,) * (len(src.aval.shape) - len(spec_of[src]))
            spec_of[eqn.outvars[0]] = tuple(spec[p] for p in perm)
            if src in made_from:
                root, make = made_from[src]
                made_from[eqn.outvars[0]] = (root,
                                             lambda w, m=make, p=perm: jnp.transpose(m(w), p))
        elif name == "dot_general" and isinstance(eqn.invars[1], ext.Var) and \
                eqn.invars[1] in spec_of and "tensor" in spec_of[eqn.invars[1]]:
            lhs, rhs, res = eqn.invars[0], eqn.invars[1], eqn.outvars[0]
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            d = spec_of[rhs].index("tensor")
            if 0 in lc or 0 in lb or 1 in lc or 1 in lb or lb:
                continue  # not a [batch, seq, ...] activation times a weight
            if d in rc:
                layout = _sequence_split(mesh, res.aval.shape)
                if layout is not None:
                    fused = _row_matmul(eqn, mesh, spec_of[rhs]) if overlap else None
                    out[res] = fused or layout
            elif isinstance(lhs, ext.Var) and _sequence_split(mesh, lhs.aval.shape) is not None:
                columns.setdefault(lhs, []).append(eqn)
    for group in columns.values():
        fused = _column_group(group, mesh, spec_of, made_from) if overlap else None
        out.update(fused or {eqn.outvars[0]: _gathered_matmul(eqn, mesh) for eqn in group})
    return out


def _gathered_matmul(eqn, mesh: Mesh):
    """A ``Replace`` computing a column-parallel ``eqn`` on its input gathered along the
    sequence (``_gather_sequence``), the gathered input not kept for the backward pass
    (which gathers it again, as Megatron-LM does): it stays stored split."""
    gather, dot = _gather_sequence(mesh, eqn.invars[0].aval.shape), _dot(eqn)
    matmul = jax.checkpoint(lambda a, b: dot(gather(a), b),
                            policy=jax.checkpoint_policies.nothing_saveable)
    return Replace(lambda a, b: [matmul(a, b)])


def stage_sequence_layouts(closed, eqns, weights: dict, mesh: Mesh,
                           overlap: bool = False) -> dict:
    """``sequence_layouts`` for the equations ``eqns`` of the loss ``closed`` (a pipeline
    stage's, or all of a single-stage plan's), with the layer boundaries they compute
    split along the sequence too; nothing when no weight is split over ``tensor``."""
    if mesh.shape.get("tensor", 1) == 1 or not any("tensor" in s for s in weights.values()):
        return {}
    made = {v for i in eqns for v in closed.jaxpr.eqns[i].outvars}
    try:
        bounds = [v for v in layer_boundaries(closed) if v in made]
    except StageSplitError:
        bounds = []
    out = {v: lay for v in bounds if (lay := _sequence_split(mesh, v.aval.shape)) is not None}
    out.update(sequence_layouts(closed.jaxpr, weights, mesh, eqns, overlap))
    return out


def layer_boundaries(closed) -> list:
    """Variables computed in one layer and read by a later one (in equation order)."""
    _, layer = layer_sequence(closed)
    made = {}
    out = []
    for i, eqn in enumerate(closed.jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, ext.Var) and v in made and made[v] < layer[i] and v not in out:
                out.append(v)
        for v in eqn.outvars:
            made[v] = layer[i]
    return out


def constrain_layers(fn, mesh: Mesh, stage: Stage, attention: str = "reference",
                     split_blocks: bool = False, sequence_parallel: bool = True,
                     tp_overlap: bool = False, autocast=None, capacity_factor=None,
                     **options):
    """``fn`` with its layer boundaries constrained to the stage's activation layout (see
    the module docstring); a function without layer scopes is only re-interpreted.
    ``split_blocks``: the plan counts block halves as layers (its remat_layers too);
    ``sequence_parallel`` (on a stage with a tensor axis and parameter layouts): the
    ``sequence_layouts``, with ``tp_overlap`` as collective matmuls; ``autocast``: the
    stage's matmul dtype where it differs from the program's (``eval_equations``). On a
    stage with an ``expert`` axis the dropless mixture-of-experts layers run
    expert-parallel (``hetshard.rewrite.experts``, with the plan's ``capacity_factor``)."""
    context = mesh.shape.get("context", 1) > 1
    if attention != "reference" or context:
        # a kernel per device (``_flash_on_mesh``), the ring over ``context``
        options.setdefault("mesh", mesh)
    run = attention_runner(attention, **options)
    specs = {name: tuple(spec) for name, spec in stage.shardings}
    # With a context axis the sequence is split over it; Megatron's sequence parallelism
    # over ``tensor`` is not combined with it (the tensor axis splits heads and weights).
    sequence = (sequence_parallel and not context and mesh.shape.get("tensor", 1) > 1
                and bool(specs))

    @functools.wraps(fn)
    def wrapped(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        jaxpr = closed.jaxpr
        try:
            bounds = layer_boundaries(closed)
        except StageSplitError:
            bounds = []
        constrain = {v: layout for v in bounds
                     if (layout := boundary_layout(stage, mesh, v.aval.shape,
                                                   options.get("sequence"))) is not None}
        leaves = jax.tree_util.tree_flatten_with_path(args)[0]
        if sequence:
            weights = {var: leaf_spec(path_string(path[1:]), np.shape(x), specs, mesh)
                       for var, (path, x) in zip(jaxpr.invars, leaves, strict=True)
                       if path and getattr(path[0], "idx", None) == 0}
            constrain.update(stage_sequence_layouts(closed, range(len(jaxpr.eqns)), weights,
                                                    mesh, tp_overlap))
        constrain.update(expert_layouts(closed, range(len(jaxpr.eqns)), mesh, stage,
                                        capacity_factor))
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, [x for _, x in leaves], strict=True))
        # Under FSDP the layers no remat recomputes are checkpointed by remat none's
        # policy too: their backward gathers the weights again instead of keeping every
        # layer's gathered from its forward (PyTorch FSDP's reshard after forward).
        fsdp = mesh.shape.get("fsdp", 1) > 1
        wrap = remat_wrap(stage.remat, stage.offload, checkpoint_none=fsdp)
        if wrap is None:
            eval_equations(jaxpr, env, run, constrain=constrain, autocast=autocast)
        else:
            # The stage's remat: each of its first remat_layers layers (all by default)
            # checkpointed on its own; without layer scopes, the whole function.
            try:
                names, eqn_layer = layer_sequence(closed, split_blocks)
            except StageSplitError:
                names, eqn_layer = [""], [0] * len(jaxpr.eqns)
            segments, rest = remat_segments(jaxpr, range(len(jaxpr.eqns)), eqn_layer,
                                            (0, len(names)), stage.remat_layers,
                                            jaxpr.outvars, wrap, rest=fsdp)
            weights = [var for var, (path, _) in zip(jaxpr.invars, leaves, strict=True)
                       if path and getattr(path[0], "idx", None) == 0]
            eval_segments(jaxpr, env, run, segments, wrap, constrain=constrain,
                          autocast=autocast, rest=rest, static=static_values(jaxpr, weights))
        outs = [v.val if isinstance(v, ext.Literal) else env[v] for v in jaxpr.outvars]
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return wrapped
