"""The SPMD rewrite: a single-stage plan's layouts imposed inside the traced step.

``constrain_layers(fn, mesh, plan_stage, attention=...)`` returns ``fn`` re-interpreted
from its jaxpr on the stage mesh: every layer-boundary activation (a value one layer
computes and a later layer reads, found from the ``named_scope`` layer tags as the
pipeline rewrite finds stage boundaries) gets a ``with_sharding_constraint`` to the
plan's activation layout, and attention is computed by the plan's implementation (the
flash kernel per device of the mesh, ``hetshard.rewrite.attention._flash_on_mesh``). The
parameters' and the batch's layouts are the program's input shardings
(``hetshard.runtime.spmd``); with the boundaries pinned as well, XLA's propagation
cannot drift the batch layout across layers (for example toward a tensor-split weight's
layout), so the program the plan priced is the program that runs, with the stage's
remat (each recomputed layer under its own checkpoint, as in the pipeline rewrite).
The plan's ``activation:<layer>`` entries name the layout (batch over the data axes);
a boundary whose leading dimension the data axes do not divide is left unconstrained.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.extend import core as ext
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetshard.plan import Stage
from hetshard.rewrite.attention import attention_runner, eval_equations
from hetshard.rewrite.pipeline import (
    StageSplitError,
    eval_segments,
    layer_segments,
    layer_sequence,
    remat_wrap,
)


def boundary_layout(stage: Stage, mesh: Mesh, shape) -> NamedSharding | None:
    """The layout of a boundary activation of ``shape`` on the stage mesh."""
    axes = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
    named = [spec for name, spec in stage.shardings if name.startswith("activation:")]
    if named and "data" not in tuple(named[0])[:1]:
        return None
    ways = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if not len(shape) or shape[0] % ways:
        return None
    return NamedSharding(mesh, PartitionSpec(axes if axes else None))


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
                     split_blocks: bool = False, **options):
    """``fn`` with its layer boundaries constrained to the stage's activation layout (see
    the module docstring); a function without layer scopes is only re-interpreted.
    ``split_blocks``: the plan counts block halves as layers (its remat_layers too)."""
    if attention == "flash":
        options.setdefault("mesh", mesh)  # the kernel per device (``_flash_on_mesh``)
    run = attention_runner(attention, **options)

    @functools.wraps(fn)
    def wrapped(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        jaxpr = closed.jaxpr
        try:
            bounds = layer_boundaries(closed)
        except StageSplitError:
            bounds = []
        constrain = {}
        for v in bounds:
            layout = boundary_layout(stage, mesh, v.aval.shape)
            if layout is not None:
                constrain[v] = layout
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, jax.tree.leaves(args), strict=True))
        wrap = remat_wrap(stage.remat)
        if wrap is None:
            eval_equations(jaxpr, env, run, constrain=constrain)
        else:
            # The stage's remat: each of its first remat_layers layers (all by default)
            # checkpointed on its own; without layer scopes, the whole function.
            try:
                names, eqn_layer = layer_sequence(closed, split_blocks)
            except StageSplitError:
                names, eqn_layer = [""], [0] * len(jaxpr.eqns)
            count = len(names) if stage.remat_layers is None else stage.remat_layers
            segments = layer_segments(jaxpr, range(len(jaxpr.eqns)), eqn_layer,
                                      (0, count), jaxpr.outvars)
            eval_segments(jaxpr, env, run, segments, wrap, constrain=constrain)
        outs = [v.val if isinstance(v, ext.Literal) else env[v] for v in jaxpr.outvars]
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return wrapped
