"""Mixture-of-experts layers found in a traced program, as attention is found: nothing in
the user's model is annotated.

A layer is read off the jaxpr as four parts:

* a **router**: a ``top_k`` over the last axis of a value of ``E`` entries per token (the
  experts' logits or probabilities); the router weight is the parameter whose product
  makes those ``E`` entries;
* **experts**: matmuls one of whose operands is a parameter stacked on a leading axis of
  ``E`` (after casts, reshapes and transposes): ``ragged_dot`` groups, or a
  ``dot_general`` that batches over that axis or keeps it;
* a **dispatch**, named by how the experts' tokens arrive: ``"dropless"`` (tokens sorted
  by expert, grouped matmuls: every routed token is computed), ``"capacity"`` (tokens
  scattered into per-expert buffers of a fixed size, ``capacity`` rows each: a token past
  it is dropped) or ``"dense"`` (every expert computes every token, weighted after);
* a **combine**: the first equation that joins what the experts computed with the
  router's gates.

Each ``top_k`` owns the expert matmuls after it, up to the next ``top_k`` of the same
expert count (layers run one after another). Calls (``jit``, ``remat``,
custom-derivative wrappers) are searched inside; a layer found there names the
program's inputs its weights come from where the call passes them through.

``expert_regions`` reads a dropless layer as expert parallelism runs it
(``hetshard.rewrite.experts``): the tokens, the routed rows' experts, the expert
equations between the token gather and the scatter back, and their operands. Those
equations may be row-wise primitives (as the sample analysis allows inside a region),
calls of them, and the grouped matmuls; their other operands must be the stacked expert
weights, the group sizes, or values that read no token. Anything else is a
``PlanNotExecutableError`` naming the equation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.extend import core as ext

from hetshard.errors import PlanNotExecutableError
from hetshard.ir.attention_patterns import inner_jaxpr
from hetshard.ir.samples import dropless_regions

# Equations that hand a weight on unchanged but for its type or layout.
_VIEWS = ("convert_element_type", "copy", "copy_p", "reshape", "transpose", "squeeze",
          "expand_dims", "reduce_precision")


@dataclasses.dataclass(frozen=True)
class MoeLayer:
    """One mixture-of-experts layer (see the module docstring). Equation indices are of
    the jaxpr at ``level`` (the call equations' indices from the top jaxpr down; ``()``:
    the top). ``router`` and ``expert_weights`` are indices among the top jaxpr's
    inputs (None / left out where a weight is made inside the program)."""

    level: tuple[int, ...]
    top_k: int
    experts: int
    k: int
    dispatch: str  # "dropless" | "capacity" | "dense"
    capacity: int | None
    router: int | None
    expert_weights: tuple[int, ...]
    matmuls: tuple[int, ...]
    combine: int | None


def moe_layers(jaxpr) -> list[MoeLayer]:
    """The mixture-of-experts layers of ``jaxpr`` (a forward program: a loss), in program
    order."""
    found: list[MoeLayer] = []
    _search(jaxpr, {v: i for i, v in enumerate(jaxpr.invars)}, (), found)
    return found


def _search(jaxpr, inputs: dict, level: tuple, found: list) -> None:
    """``inputs``: this level's variables that are the top jaxpr's inputs, by index."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    routers = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "top_k"
               and _axis(e) == len(e.invars[0].aval.shape) - 1]
    mine: dict[int, list[tuple[int, object]]] = {r: [] for r in routers}
    for i, e in enumerate(jaxpr.eqns):
        expert = _expert_operand(e, jaxpr, producer)
        if expert is None:
            continue
        n, weight = expert
        owner = [r for r in routers if r < i and
                 jaxpr.eqns[r].invars[0].aval.shape[-1] == n]
        if owner:
            mine[owner[-1]].append((i, weight))
    for r in routers:
        if mine[r]:
            found.append(_layer(jaxpr, r, mine[r], inputs, level, producer))
    for i, e in enumerate(jaxpr.eqns):
        inner = inner_jaxpr(e)
        if inner is None or e.primitive.name == "top_k":
            continue
        body = inner[0]
        if len(body.invars) != len(e.invars):
            continue
        passed = {b: inputs[o] for b, o in zip(body.invars, e.invars, strict=True)
                  if not isinstance(o, ext.Literal) and o in inputs}
        _search(body, passed, (*level, i), found)


def _axis(eqn) -> int:
    axis = eqn.params.get("axis", -1)
    return axis % len(eqn.invars[0].aval.shape)


def _source(var, jaxpr, producer: dict):
    """The variable ``var`` was made from by views alone (itself if none)."""
    while not isinstance(var, ext.Literal) and var in producer:
        e = jaxpr.eqns[producer[var]]
        if e.primitive.name not in _VIEWS or len(e.invars) != 1:
            break
        var = e.invars[0]
    return var


def _expert_operand(eqn, jaxpr, producer):
    """``(E, weight variable)`` when ``eqn`` is an expert matmul: a ``ragged_dot`` of
    ``E`` groups, or a ``dot_general`` whose operand made from an input of ``jaxpr`` by
    views keeps its leading axis (size ``E``, not contracted)."""
    name = eqn.primitive.name
    if name in ("ragged_dot", "ragged_dot_general"):
        return int(eqn.invars[2].aval.shape[0]), _source(eqn.invars[1], jaxpr, producer)
    if name != "dot_general":
        return None
    contract, _ = eqn.params["dimension_numbers"]
    for side in (0, 1):
        v = eqn.invars[side]
        src = _source(v, jaxpr, producer)
        if isinstance(src, ext.Literal) or src not in jaxpr.invars:
            continue
        shape = src.aval.shape
        # the stacked axis is the weight's first; the operand keeps it at the front
        if len(shape) >= 3 and len(v.aval.shape) >= 3 and v.aval.shape[0] == shape[0] \
                and 0 not in contract[side]:
            return int(shape[0]), src
    return None


def _layer(jaxpr, r: int, matmuls: list, inputs: dict, level: tuple, producer) -> MoeLayer:
    top = jaxpr.eqns[r]
    n = int(top.invars[0].aval.shape[-1])
    idx = [i for i, _ in matmuls]
    kinds = {jaxpr.eqns[i].primitive.name for i in idx}
    capacity = None
    if kinds & {"ragged_dot", "ragged_dot_general"}:
        dispatch = "dropless"
    else:
        first = jaxpr.eqns[idx[0]]
        contract, batch = first.params["dimension_numbers"]
        side = 0 if _source(first.invars[1], jaxpr, producer) in jaxpr.invars else 1
        tokens = first.invars[side]  # the operand that is not the weight
        if batch[side] and tokens.aval.shape[batch[side][0]] == n:
            dispatch = "capacity"  # tokens arrive in [E, capacity, ...] buffers
            free = [d for d in range(len(tokens.aval.shape))
                    if d not in batch[side] and d not in contract[side]]
            capacity = int(tokens.aval.shape[free[0]]) if free else None
        else:
            dispatch = "dense"
    weights = []
    for _, w in matmuls:
        if w in inputs and inputs[w] not in weights:
            weights.append(inputs[w])
    return MoeLayer(level=level, top_k=r, experts=n, k=int(top.params["k"]),
                    dispatch=dispatch, capacity=capacity,
                    router=_router(jaxpr, r, n, inputs, producer),
                    expert_weights=tuple(weights), matmuls=tuple(idx),
                    combine=_combine(jaxpr, r, idx))


def _router(jaxpr, r: int, n: int, inputs: dict, producer) -> int | None:
    """The input whose matmul makes the ``n`` entries the ``top_k`` at ``r`` ranks."""
    todo, seen = [jaxpr.eqns[r].invars[0]], set()
    while todo:
        v = todo.pop()
        if isinstance(v, ext.Literal) or v in seen or v not in producer:
            continue
        seen.add(v)
        e = jaxpr.eqns[producer[v]]
        if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == n:
            for o in e.invars:
                src = _source(o, jaxpr, producer)
                if src in inputs and src.aval.shape[-1] == n:
                    return inputs[src]
        todo.extend(e.invars)
    return None


def _combine(jaxpr, r: int, matmuls: list[int]) -> int | None:
    """The first equation after the experts that reads both what they computed and the
    router's gates (values made from the ``top_k``'s values or from what it ranked; not
    from its indices alone, which the dispatch reads)."""
    top = jaxpr.eqns[r]
    gated = {top.outvars[0], *(v for v in top.invars if not isinstance(v, ext.Literal))}
    expert = set(jaxpr.eqns[matmuls[-1]].outvars)
    for i in range(r + 1, len(jaxpr.eqns)):
        e = jaxpr.eqns[i]
        ins = [v for v in e.invars if not isinstance(v, ext.Literal)]
        from_gates = any(v in gated for v in ins)
        from_experts = any(v in expert for v in ins)
        if i > matmuls[-1] and from_gates and from_experts:
            return i
        if from_gates:
            gated.update(e.outvars)
        if from_experts:
            expert.update(e.outvars)
    return None


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
