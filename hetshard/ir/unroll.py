"""Scanned stacks of blocks unrolled, so that each block is a layer of its own.

A model that stacks its blocks' weights and runs them with ``nnx.scan`` or ``lax.scan``
traces to one ``scan`` equation holding every block. ``unroll_scans(fn)`` evaluates such
a scan iteration by iteration: iteration ``i`` reads slice ``i`` of each stacked input
(``lax.index_in_dim``) and runs the body on it, so the traced function has one copy of
the block per iteration, as a Python loop over blocks would. The planner then finds the
blocks as a repeated structure (``hetshard.ir.layers``) and a pipeline can cut the stack
between stages; the loss's value and gradients are those of the scan.

Only scans worth cutting are unrolled: top-level ones of at least two iterations whose
body holds a matmul or convolution; small scans (a cumulative sum, a chunked loop inside a
block) stay as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend import core as ext

from hetshard.ir.interpret import eval_equations

_DENSE = ("dot_general", "conv_general_dilated")


def _has_dense(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _DENSE:
            return True
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns") and _has_dense(inner):
                return True
    return False


def is_block_scan(eqn) -> bool:
    """A top-level scan worth unrolling (see the module docstring)."""
    return (eqn.primitive.name == "scan" and eqn.params["length"] >= 2 and
            _has_dense(eqn.params["jaxpr"].jaxpr))


def _run_scan(eqn, invals) -> list:
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts = invals[:n_consts]
    carry = list(invals[n_consts:n_consts + n_carry])
    xs = invals[n_consts + n_carry:]
    body = p["jaxpr"]
    ys = []
    order = range(length - 1, -1, -1) if p["reverse"] else range(length)
    for i in order:
        x_i = [jax.lax.index_in_dim(x, i, 0, keepdims=False) for x in xs]
        env = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
        env.update(zip(body.jaxpr.invars, [*consts, *carry, *x_i], strict=True))
        eval_equations(body.jaxpr, env, None)
        outs = [v.val if isinstance(v, ext.Literal) else env[v] for v in body.jaxpr.outvars]
        carry = outs[:n_carry]
        ys.append(outs[n_carry:])
    if p["reverse"]:
        ys.reverse()
    stacked = [jnp.stack([y[j] for y in ys]) for j in range(len(ys[0]))] if ys else []
    return [*carry, *stacked]


def unrolled_jaxpr(closed, shape):
    """``(ClosedJaxpr, shape)`` of ``closed`` with its block scans unrolled (itself when it
    has none)."""
    if not any(is_block_scan(e) for e in closed.jaxpr.eqns):
        return closed, shape

    def run(*leaves):
        return _evaluate(closed, leaves)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    out, _ = jax.make_jaxpr(run, return_shape=True)(*avals)
    return out, shape


def _evaluate(closed, leaves) -> list:
    jaxpr = closed.jaxpr
    scans = [i for i, e in enumerate(jaxpr.eqns) if is_block_scan(e)]
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, leaves, strict=True))
    start = 0
    for i in scans:
        eval_equations(jaxpr, env, None, range(start, i))
        eqn = jaxpr.eqns[i]
        invals = [v.val if isinstance(v, ext.Literal) else env[v] for v in eqn.invars]
        for var, val in zip(eqn.outvars, _run_scan(eqn, invals), strict=True):
            env[var] = val
        start = i + 1
    eval_equations(jaxpr, env, None, range(start, len(jaxpr.eqns)))
    return [v.val if isinstance(v, ext.Literal) else env[v] for v in jaxpr.outvars]


def unroll_scans(fn):
    """``fn`` with its block scans unrolled (see the module docstring); ``fn`` itself
    when it has none."""
    scan_free: set = set()  # argument signatures known to trace without block scans

    @functools.wraps(fn)
    def wrapped(*args):
        leaves, tree = jax.tree.flatten(args)
        key = (tree, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
        if key in scan_free:
            return fn(*args)
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        if not any(is_block_scan(e) for e in closed.jaxpr.eqns):
            scan_free.add(key)
            return fn(*args)
        return jax.tree.unflatten(jax.tree.structure(shape), _evaluate(closed, leaves))
    wrapped.scan_free = scan_free
    return wrapped
