"""A stage's backward split in two, for zero-bubble pipeline schedules (Qi et al., "Zero
Bubble Pipeline Parallelism", ICLR'24): ``B``, the equations the cotangents of the
stage's received activations need (what the previous stage waits for), and ``W``, the
rest of what the parameters' cotangents need (mostly the weight-gradient matmuls), which
can run later, in what would have been a bubble.

The split is made on the backward's own jaxpr: the ``jax.vjp`` function a stage's forward
returns is traced (``jax.make_jaxpr``) over its residuals and the sends' cotangents, ``B``
is the dead-code-eliminated slice for the received values' cotangents (a ``shard_map``
it needs kept whole), ``W`` every other equation the parameters' cotangents read, and
what ``W`` reads from ``B``'s results (the activations' cotangents inside the stage) is
handed over. Both run under ``jax.jit`` and
trace the same jaxpr, so they agree on the split; together they evaluate each equation of
the backward exactly once, so the gradients are those of the unsplit backward.
"""

from __future__ import annotations

import jax
from jax._src.core import DropVar
from jax._src.interpreters import partial_eval as pe
from jax.extend import core as ext

# Calls whose bodies are traced inline before the split: a rematerialised stage's whole
# backward is one ``checkpoint`` equation, which B and W would otherwise each recompute.
_INLINE = {"checkpoint", "remat2", "pjit", "jit", "closed_call", "core_call"}


def _inlined(jaxpr, consts, args) -> list:
    """Evaluates ``jaxpr`` binding its equations, with the calls in ``_INLINE`` replaced by
    their bodies (so that a trace of it is flat)."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return v.val if isinstance(v, ext.Literal) else env[v]
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if eqn.primitive.name in _INLINE and inner is not None:
            if hasattr(inner, "consts"):
                out = _inlined(inner.jaxpr, inner.consts, invals)
            else:
                out = _inlined(inner, [], invals)
        else:
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                out = [out]
        env.update(zip(eqn.outvars, out, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _traced(vjp, cts):
    """(flat closed jaxpr of ``vjp(cts)`` over (residuals, cts), residual leaves, number
    of parameter-cotangent outputs)."""
    leaves, tree = jax.tree_util.tree_flatten(vjp)

    def run(res, c):
        return jax.tree_util.tree_flatten(jax.tree_util.tree_unflatten(tree, res)(c))[0]
    nested = jax.make_jaxpr(run)(leaves, list(cts))
    flat = jax.make_jaxpr(lambda *a: _inlined(nested.jaxpr, nested.consts, a))(
        *leaves, *cts)
    n_param = len(jax.tree_util.tree_leaves(
        jax.eval_shape(lambda r, c: jax.tree_util.tree_unflatten(tree, r)(c)[0], leaves,
                       list(cts))))
    return flat, leaves, n_param


def _split(jaxpr, n_param: int):
    """(B's equations, W's equations, the variables W reads from B) of a backward whose
    first ``n_param`` outputs are the parameters' cotangents, the rest the received
    values'. Dead-code elimination may prune a call (a ``pjit``, a ``checkpoint``) to the
    outputs each side needs; a call both need then runs in each, for its own outputs."""
    n_out = len(jaxpr.outvars)
    b_jaxpr, _ = pe.dce_jaxpr(jaxpr, [False] * n_param + [True] * (n_out - n_param),
                              instantiate=True)
    w_all, _ = pe.dce_jaxpr(jaxpr, [True] * n_param + [False] * (n_out - n_param),
                            instantiate=True)
    # A shard_map B needs runs whole in B, W reading its other outputs: pruned to each
    # side's outputs its collectives would run twice (a row-parallel collective
    # matmul's one ring serves both its gradients).
    whole = {v: e for e in jaxpr.eqns if e.primitive.name == "shard_map" for v in e.outvars
             if not isinstance(v, DropVar)}
    b_eqns = []
    for e in b_jaxpr.eqns:
        first = next((v for v in e.outvars if not isinstance(v, DropVar)), None)
        b_eqns.append(whole.get(first, e) if e.primitive.name == "shard_map" else e)
    b_eqns = _with_producers(jaxpr, b_eqns)
    made_in_b = {v for e in b_eqns for v in e.outvars if not isinstance(v, DropVar)}
    w_eqns = [e for e in w_all.eqns
              if any(v not in made_in_b for v in e.outvars if not isinstance(v, DropVar))]
    made_in_w = {v for e in w_eqns for v in e.outvars}
    read = [v for e in w_eqns for v in e.invars] + list(jaxpr.outvars[:n_param])
    carried = list(dict.fromkeys(v for v in read if isinstance(v, ext.Var) and
                                 v in made_in_b and v not in made_in_w))
    return b_eqns, w_eqns, carried


def _with_producers(jaxpr, eqns: list) -> list:
    """``eqns`` (a slice of ``jaxpr``'s, in its order, some pruned copies) with the
    equations of ``jaxpr`` that make what they read added where no equation of theirs
    makes it: a ``shard_map`` kept whole reads inputs its pruned copy did not (under a
    remat keeping some values, the recomputed input of a collective matmul's weight
    gradient)."""
    position = {v: k for k, e in enumerate(jaxpr.eqns) for v in e.outvars
                if not isinstance(v, DropVar)}
    have = set(jaxpr.invars) | set(jaxpr.constvars)
    have.update(v for e in eqns for v in e.outvars if not isinstance(v, DropVar))
    added: dict[int, object] = {}
    stack = [v for e in eqns for v in e.invars]
    while stack:
        v = stack.pop()
        if not isinstance(v, ext.Var) or v in have:
            continue
        k = position[v]
        added[k] = jaxpr.eqns[k]
        have.update(u for u in jaxpr.eqns[k].outvars if not isinstance(u, DropVar))
        stack.extend(jaxpr.eqns[k].invars)
    if not added:
        return eqns

    keyed, last = [], -1
    for e in eqns:  # (an equation without outputs stays after the one before it)
        last = min((position[v] for v in e.outvars if not isinstance(v, DropVar)),
                   default=last)
        keyed.append((last, 1, len(keyed), e))
    keyed += [(k, 0, 0, e) for k, e in added.items()]
    return [e for *_, e in sorted(keyed, key=lambda t: t[:3])]


def _evaluate(eqns, env: dict) -> None:
    def read(v):
        return v.val if isinstance(v, ext.Literal) else env[v]
    for eqn in eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*[read(v) for v in eqn.invars], **params)
        for var, val in zip(eqn.outvars, out if eqn.primitive.multiple_results else [out],
                            strict=True):
            env[var] = val


def _env(closed, leaves, cts) -> dict:
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, list(leaves) + list(cts), strict=True))
    return env


def input_backward(vjp, cts):
    """``B``: (the received values' cotangents, what ``W`` needs from B)."""
    closed, leaves, n_param = _traced(vjp, cts)
    b_eqns, _, carried = _split(closed.jaxpr, n_param)
    env = _env(closed, leaves, cts)
    _evaluate(b_eqns, env)
    read = [v.val if isinstance(v, ext.Literal) else env[v]
            for v in closed.jaxpr.outvars[n_param:]]
    return read, [env[v] for v in carried]


def weight_backward(vjp, cts, carried):
    """``W``: the parameters' cotangents, given ``B``'s ``carried`` values."""
    closed, leaves, n_param = _traced(vjp, cts)
    _, w_eqns, names = _split(closed.jaxpr, n_param)
    env = _env(closed, leaves, cts)
    env.update(zip(names, carried, strict=True))
    _evaluate(w_eqns, env)
    return [v.val if isinstance(v, ext.Literal) else env[v]
            for v in closed.jaxpr.outvars[:n_param]]
