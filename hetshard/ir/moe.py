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
"""

from __future__ import annotations

import dataclasses

from jax.extend import core as ext

from hetshard.ir.attention_patterns import inner_jaxpr

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
