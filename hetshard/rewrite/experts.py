"""The expert-parallel rewrite: a stage's dropless mixture-of-experts layers run with
their experts split over the mesh's ``expert`` axis.

A dropless layer (``hetshard.ir.samples``: token rows sorted by expert, computed row by
row with grouped matmuls, scattered back) is per token: what it makes of a token reads no
other token. So each device can run it on its own tokens. ``expert_layouts`` finds each
such region in a stage's equations and returns, for ``eval_equations``, a ``Replace`` of
the value the region's scatter makes (every routed row, back in token order) by
:func:`hetshard.collectives.experts.expert_parallel`: inside ``jax.shard_map`` each
device sorts its own rows by expert, sends each rank of the ``expert`` axis the rows of
the experts it holds (an all-to-all), runs the user's own expert equations (those between
the gather and the scatter, re-evaluated on the rows it received, its own expert weights
and their group sizes), and sends the results back (the second all-to-all).

The region's own equations stay in the traced program unread (XLA removes them). The
router, the gates, the combine and any load-balancing loss are the user's, evaluated as
traced: their reductions over the batch see every token, as on one device.

What the expert equations may be is checked where the regions are found
(``hetshard.ir.moe.expert_regions``), not at run time.
"""

from __future__ import annotations

from jax.extend.core import Literal

from hetshard._plan import Stage
from hetshard.errors import PlanNotExecutableError
from hetshard.ir.interpret import Replace
from hetshard.ir.moe import expert_regions


def placement(stage: Stage, experts: int, where: str = "stage") -> tuple[int, ...]:
    """Experts per rank of the stage's ``expert`` axis: ``Stage.experts``, or an even
    split, which the axis must divide."""
    n = stage.axis("expert")
    if stage.experts:
        if sum(stage.experts) != experts:
            raise PlanNotExecutableError(
                f"{where}.experts {list(stage.experts)} places {sum(stage.experts)} "
                f"experts; the model's mixture-of-experts layers have {experts}: a "
                f"placement must hold every expert exactly once (counts summing to "
                f"{experts}, one per rank of the expert axis of {n})")
        return tuple(stage.experts)
    if experts % n:
        raise PlanNotExecutableError(
            f"{where}.mesh_shape: an expert axis of {n} does not divide the model's "
            f"{experts} experts; accepted: a divisor of {experts} "
            f"({[d for d in range(2, experts + 1) if experts % d == 0]}), or an uneven "
            f"placement in {where}.experts (one count per rank, summing to {experts})")
    return (experts // n,) * n


def brought(var) -> tuple:
    """The key under which a stage's forward holds, for one step, the experts each rank
    lacks of the stacked expert weight ``var`` (see :func:`prelaid_weights`)."""
    return ("experts brought", var)


def prelaid_weights(closed, program, mesh, stage: Stage,
                    where: str = "stage") -> dict[int, tuple[tuple[int, ...], object]]:
    """The stacked expert weights whose missing experts a pipeline stage brings once per
    step: position in ``program.params`` -> (the placement, the region's weight
    variable), for each weight of an unevenly placed dropless region (whose ranks divide
    the experts: stored evenly) that the stage reads only in that region's expert
    equations, as is or through the one cast it hoists (``StageProgram.cast_params``).
    The runtime brings each rank the experts it lacks before the first micro-batch
    (``collectives.experts.brought_experts``) and gives their summed gradients back
    after the last; other weights bring them inside each micro-batch's exchange."""
    if mesh.shape.get("expert", 1) == 1:
        return {}
    jaxpr = closed.jaxpr
    position = {jaxpr.invars[idx]: k for k, idx in enumerate(program.params)}
    readers: dict = {}
    for i in program.eqns:
        for v in jaxpr.eqns[i].invars:
            if not isinstance(v, Literal):
                readers.setdefault(v, set()).add(i)
    kept = {v for v in [*program.sends, *jaxpr.outvars] if not isinstance(v, Literal)}
    producer = {v: i for i in program.eqns for v in jaxpr.eqns[i].outvars}
    out = {}
    for r in expert_regions(jaxpr, program.eqns):
        counts = placement(stage, r.experts, where)
        if len(set(counts)) == 1 or r.experts % len(counts):
            continue
        for w in r.weights:
            if w in kept or not readers.get(w, set()) <= set(r.chain):
                continue
            k = position.get(w)
            if k is None and w in producer:  # the hoisted cast of a parameter
                e = jaxpr.eqns[producer[w]]
                src = e.invars[0]
                if e.primitive.name == "convert_element_type" and \
                        not isinstance(src, Literal) and position.get(src) in \
                        program.cast_params:
                    k = position[src]
            if k is not None:
                out[k] = (counts, w)
    return out


def expert_layouts(closed, indices, mesh, stage: Stage, capacity_factor=None,
                   where: str = "stage", prelaid=frozenset()) -> dict:
    """``var -> Replace`` for ``eval_equations``: each dropless region among the
    equations ``indices`` of ``closed`` computed expert-parallel over ``mesh``'s
    ``expert`` axis (see the module docstring); nothing on a stage without one.
    ``prelaid``: weight variables whose missing experts the stage's forward holds
    ready, under :func:`brought` of the variable (:func:`prelaid_weights`)."""
    from hetshard.collectives.experts import expert_parallel

    if mesh.shape.get("expert", 1) == 1:
        return {}
    out = {}
    for r in expert_regions(closed.jaxpr, indices):
        counts = placement(stage, r.experts, where)
        laid = sorted(j for j, w in enumerate(r.weights) if w in prelaid)
        run = expert_parallel(closed.jaxpr, r, mesh, counts, capacity_factor,
                              frozenset(laid))
        out[r.out] = Replace(lambda *xs, run=run: [run(*xs)],
                             [r.tokens, r.ids, *r.weights, *r.others,
                              *(brought(r.weights[j]) for j in laid)])
    return out
