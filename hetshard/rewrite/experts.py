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

What the expert equations may be is checked here, not found at run time: row-wise
primitives (as the sample analysis allows inside a region), calls of them, and the
grouped matmuls; their other operands must be the stacked expert weights (leading axis of
the expert count), the group sizes, or values that read no token. Anything else is a
``PlanNotExecutableError`` naming the equation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.extend import core as ext

from hetshard.errors import PlanNotExecutableError
from hetshard.ir.attention_patterns import inner_jaxpr
from hetshard.ir.interpret import Replace
from hetshard.ir.samples import dropless_regions
from hetshard.plan import Stage


@dataclasses.dataclass(frozen=True)
class ExpertRegion:
    """One dropless dispatch of a jaxpr, as the rewrite needs it: ``tokens`` ([T, d],
    what the gather reads), ``ids`` ([T * k], each routed row's expert, what the sort
    orders), ``rows`` (the gathered rows the expert equations start from), ``out`` (the
    scatter's result: every routed row's expert output, in token order), the expert
    equations ``chain`` (indices, in order) ending at ``result`` (the rows the scatter
    puts back), and their operands: ``sizes`` (group sizes), ``weights`` (stacked on the
    expert axis) and ``others`` (reading no token)."""

    sort: int
    experts: int
    k: int
    tokens: object
    ids: object
    rows: object
    out: object
    result: object
    chain: tuple[int, ...]
    sizes: tuple
    weights: tuple
    others: tuple


def expert_regions(jaxpr, indices=None) -> list[ExpertRegion]:
    """The dropless mixture-of-experts regions among ``jaxpr``'s equations ``indices``
    (all by default), in program order."""
    keep = None if indices is None else set(indices)
    out = []
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    for sort, region in sorted(dropless_regions(jaxpr).items()):
        if keep is not None and sort not in keep:
            continue
        out.append(_describe(jaxpr, sort, region, producer))
    return out


def _describe(jaxpr, sort: int, region, producer) -> ExpertRegion:
    eqns = jaxpr.eqns
    g, x = eqns[region.gather], eqns[region.exit]
    rows = g.outvars[0]
    ids = eqns[sort].invars[0]
    tokens = g.invars[0]
    n_rows = int(ids.aval.shape[0])
    k = n_rows // int(tokens.aval.shape[0])
    chain, made = [], {rows}
    for i in sorted(region.inside - {sort, region.gather, region.exit}):
        e = eqns[i]
        if any(not isinstance(v, ext.Literal) and v in made for v in e.invars):
            chain.append(i)
            made.update(e.outvars)
    result = x.invars[2]
    if result not in made:
        raise _refused(jaxpr, region.exit, "the rows it puts back are not computed from "
                       "the gathered tokens")
    _check_zeros(jaxpr, x.invars[0], producer, region.exit)
    sizes, weights, others = [], [], []
    experts = None
    for i in chain:
        e = eqns[i]
        if e.primitive.name == "ragged_dot_general":
            s, w = e.invars[2], e.invars[1]
            n = int(s.aval.shape[0])
            if experts not in (None, n):
                raise _refused(jaxpr, i, f"grouped matmuls of {experts} and {n} groups")
            experts = n
            if s not in made and s not in sizes:
                sizes.append(s)
            if w in made:
                raise _refused(jaxpr, i, "its grouped weight is computed from the tokens")
        for v in e.invars:
            if isinstance(v, ext.Literal) or v in made or v in sizes or v in weights \
                    or v in others:
                continue
            if e.primitive.name == "ragged_dot_general" and v is e.invars[1]:
                weights.append(v)
            elif v.aval.shape and v.aval.shape[0] == n_rows:
                raise _refused(jaxpr, i, "it reads another value per routed row")
            elif v is not e.invars[2] or e.primitive.name != "ragged_dot_general":
                others.append(v)
        if e.primitive.name not in ("ragged_dot_general",):
            _check_rowwise(jaxpr, i, e)
    if experts is None:
        raise _refused(jaxpr, region.exit, "its experts run no grouped matmul")
    for w in others:  # an expert-stacked value read row-wise (a per-expert bias)
        if w.aval.shape and w.aval.shape[0] == experts and len(w.aval.shape) >= 2:
            raise _refused(jaxpr, chain[0], "a per-expert value is read outside a grouped "
                           "matmul")
    return ExpertRegion(sort=sort, experts=experts, k=k, tokens=tokens, ids=ids, rows=rows,
                        out=x.outvars[0], result=result, chain=tuple(chain),
                        sizes=tuple(sizes), weights=tuple(weights), others=tuple(others))


def _check_zeros(jaxpr, var, producer, at: int) -> None:
    """The scatter's operand (where rows not put back would stay) must be zeros."""
    e = jaxpr.eqns[producer[var]] if not isinstance(var, ext.Literal) and \
        var in producer else None
    ok = e is not None and e.primitive.name == "broadcast_in_dim" and \
        isinstance(e.invars[0], ext.Literal) and float(np.asarray(e.invars[0].val)) == 0.0
    if not ok:
        raise _refused(jaxpr, at, "the rows are put back into something other than zeros")


_SHAPED = ("broadcast_in_dim",)  # row-wise, with the row count in their parameters


def _check_rowwise(jaxpr, i: int, e) -> None:
    inner = inner_jaxpr(e)
    if inner is not None:
        for j, sub in enumerate(inner[0].eqns):
            _check_rowwise(inner[0], j, sub)
        return
    if e.primitive.name in _SHAPED:
        dims = tuple(e.params["broadcast_dimensions"])
        if not dims or dims[0] != 0:
            raise _refused(jaxpr, i, "a broadcast that does not keep the rows first")


def _refused(jaxpr, i: int, why: str) -> PlanNotExecutableError:
    e = jaxpr.eqns[i]
    where = e.source_info.name_stack
    return PlanNotExecutableError(
        f"expert parallelism cannot run the mixture-of-experts layer at equation {i} "
        f"({e.primitive.name}{' in ' + str(where) if str(where) else ''}): {why}. It "
        f"runs dropless layers whose expert equations between the token gather and the "
        f"scatter back are grouped matmuls (jax.lax.ragged_dot) of weights stacked on a "
        f"leading expert axis and row-wise operations; use a plan without an expert axis "
        f"for this model")


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


def expert_layouts(closed, indices, mesh, stage: Stage, capacity_factor=None,
                   where: str = "stage") -> dict:
    """``var -> Replace`` for ``eval_equations``: each dropless region among the
    equations ``indices`` of ``closed`` computed expert-parallel over ``mesh``'s
    ``expert`` axis (see the module docstring); nothing on a stage without one."""
    from hetshard.collectives.experts import expert_parallel

    if mesh.shape.get("expert", 1) == 1:
        return {}
    out = {}
    for r in expert_regions(closed.jaxpr, indices):
        counts = placement(stage, r.experts, where)
        run = expert_parallel(closed.jaxpr, r, mesh, counts, capacity_factor)
        out[r.out] = Replace(lambda *xs, run=run: [run(*xs)],
                             [r.tokens, r.ids, *r.weights, *r.others])
    return out
