"""A pipeline stage's jitted functions: its forward (whose vjp holds no copies of the
stage's parameters, weights cast once per step), its backward (whole, or ZB-H1's B and
W passes), and the accumulation of gradients and losses over micro-batches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hetshard.rewrite.backward import input_backward, weight_backward


def stage_forward(program, wrap, remat_layers, mesh, layouts, autocast, chunks, params, frozen,
                  batch, recvs, extra_keys=()):
    """The stage's forward on its ``mesh`` with its sequence-parallel and expert
    ``layouts`` (``params`` ending with the values they read under ``extra_keys``),
    ``autocast`` (``stage_autocast``) and uneven context ``chunks`` for attention
    (``Plan.context_chunks``); under a remat (``wrap``: ``remat_wrap`` of the stage's
    remat and offload; None: none) each of its first ``remat_layers`` layers (None:
    all) is checkpointed on its own, so the backward recomputes one layer at a time."""
    return program.forward(params, frozen, batch, recvs,
                           remat=None if wrap is None else (wrap, remat_layers), mesh=mesh,
                           constrain=layouts, autocast=autocast, chunk_lengths=chunks,
                           extra_keys=extra_keys)


class Forward:
    """A stage's jitted forward whose vjp holds no copies of the stage's parameters.

    A jitted function's outputs are new buffers even when they are its inputs, so a
    vjp returned from ``jax.jit`` would hold a copy of every parameter its backward
    reads as is (what ``jax.checkpoint`` saves of a layer, a matmul's weight read
    without a cast): one per micro-batch in flight. Those residuals are left out of the
    jitted outputs and put back from the caller's arrays. Which residuals they are is
    fixed by the arguments' shapes and dtypes, read when the function is traced for
    them. Parameters the stage
    reads only through a cast (``casts``: position -> dtype; the compute-dtype copy of
    a float32 weight) are cast once per step, outside, so the micro-batches' vjps share
    that copy instead of keeping one each (their gradients come back in the cast dtype;
    ``backward`` converts them back, as the cast's transpose would). Where a rank of an
    unevenly placed expert axis lacks some experts of a weight (``brought``: position ->
    ``(bring, give_back)``, ``hetshard.collectives.experts.brought_experts``), they are
    brought once per step too, after the cast, and given to the forward after the
    parameters (``fn`` reads them there); their gradients accumulate beside the
    parameters' and :meth:`give_back` gives the sum back once, after the last
    micro-batch."""

    def __init__(self, fn, casts: dict | None = None, brought: dict | None = None):
        self.fn = fn
        self.casts = dict(casts or {})
        self.brought = dict(sorted((brought or {}).items()))
        # per argument signature: (vjp treedef, per vjp leaf: the parameter's index or None)
        self.layouts: dict = {}
        self.jitted = jax.jit(self._traced)
        self._cast = jax.jit(lambda xs: [x.astype(self.casts[k]) for k, x in xs.items()])
        # (the step's parameter arrays cast or brought from, (the casts, what was brought))
        self._held = ((), ({}, []))

    def _once_per_step(self, params) -> list:
        """The step's parameters cast, then the experts brought (after them), once per
        step (held while the step's parameter arrays are the same)."""
        changed = sorted(set(self.casts) | set(self.brought))
        if not changed:
            return params
        src = tuple(params[k] for k in changed)
        held = self._held[0]
        if len(held) != len(src) or any(a is not b for a, b in zip(held, src, strict=True)):
            cast = sorted(self.casts)
            casts = dict(zip(cast, self._cast({k: params[k] for k in cast}), strict=True)) \
                if cast else {}
            extra = [bring(casts.get(k, params[k])) for k, (bring, _) in self.brought.items()]
            self._held = (src, (casts, extra))
        casts, extra = self._held[1]
        return [casts.get(k, p) for k, p in enumerate(params)] + extra

    def give_back(self, grads):
        """Accumulated gradients (the parameters' and, after them, the brought
        experts') as the parameters' alone: each brought expert's gradient given back
        to the rank storing it and added to its weight's (None: no gradient yet)."""
        if grads is None or not self.brought:
            return grads
        n = len(grads) - len(self.brought)
        out = list(grads[:n])
        for j, (k, (_, give_back)) in enumerate(self.brought.items()):
            out[k] = add(out[k], give_back(grads[n + j]).astype(out[k].dtype))
        return out

    def _traced(self, params, frozen, batch, recvs):
        float_outs, other, vjp = self.fn(params, frozen, batch, recvs)
        leaves, tree = jax.tree.flatten(vjp)
        index = {id(p): k for k, p in enumerate(params)}
        where = [index.get(id(x)) for x in leaves]
        self.layouts[_signature(params, frozen, batch, recvs)] = (tree, where)
        return float_outs, other, [x for x, k in zip(leaves, where, strict=True) if k is None]

    def release(self) -> None:
        self._held = ((), ({}, []))

    def _cache_size(self) -> int:
        """Compilations of the forward (as ``jax.jit``'s)."""
        return self.jitted._cache_size()

    def __call__(self, params, frozen, batch, recvs):
        params = self._once_per_step(params)
        float_outs, other, rest = self.jitted(params, frozen, batch, recvs)
        tree, where = self.layouts[_signature(params, frozen, batch, recvs)]
        rest = iter(rest)
        leaves = [next(rest) if k is None else params[k] for k in where]
        return float_outs, other, jax.tree.unflatten(tree, leaves)


def _signature(*args) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args))


def _seeded(program, incoming, seeds) -> list:
    """The sends' cotangents: what later stages sent back plus the loss's seed.
    ``seeds``: (per send, the loss's weight or None; the loss scale, a device scalar
    under loss scaling: multiplied in here, not by a program of its own)."""
    weights, scale = seeds
    cts = []
    for j, ct, seed in zip(program.diff_sends, incoming, weights, strict=True):
        aval = program.sends[j].aval
        base = jnp.zeros(aval.shape, aval.dtype) if seed is None else \
            jnp.full(aval.shape, seed * scale, aval.dtype)
        cts.append(base if ct is None else base + ct.astype(aval.dtype))
    return cts


def _param_dtypes(program, pcts) -> list:
    """Parameter cotangents in the parameters' dtypes (those of parameters given cast,
    ``Forward``, come in the cast dtype; converting is the cast's transpose); those of
    the values after the parameters (experts brought, ``Forward``) as they are."""
    n = len(program.param_dtypes)
    return [g if g.dtype == dt else g.astype(dt)
            for g, dt in zip(pcts[:n], program.param_dtypes, strict=True)] + list(pcts[n:])


def backward(program, vjp, incoming, seeds, acc):
    pcts, rcts = vjp(_seeded(program, incoming, seeds))
    pcts = _param_dtypes(program, pcts)
    if acc is not None:
        pcts = [a + g for a, g in zip(acc, pcts, strict=True)]
    return pcts, list(rcts)


def backward_input(program, vjp, incoming, seeds):
    """ZB-H1's B: (received values' cotangents, the seeded cotangents, what W reads)."""
    cts = _seeded(program, incoming, seeds)
    rcts, carried = input_backward(vjp, cts)
    return rcts, cts, carried


def backward_weight(program, vjp, cts, carried, acc):
    """ZB-H1's W: the parameters' cotangents, accumulated."""
    pcts = _param_dtypes(program, weight_backward(vjp, cts, carried))
    if acc is not None:
        pcts = [a + g for a, g in zip(acc, pcts, strict=True)]
    return pcts


@jax.jit
def add(a, b):
    return a + b


@jax.jit
def _weighted_sum(xs, ws):  # (ws traced: a masked mean's weights change every step)
    acc = None
    for x, w in zip(xs, ws, strict=True):
        x = x * jnp.asarray(w, x.dtype)
        acc = x if acc is None else acc + x
    return acc


@jax.jit
def _sum(xs):
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x
    return acc


@functools.lru_cache(maxsize=64)
def _joiner(axis: int, sharding):
    return jax.jit(lambda *xs: jnp.concatenate(xs, axis), out_shardings=sharding)


def joined(parts, axis: int, sharding):
    """``parts`` (a per-sample loss output's pieces, in the batch's order) concatenated
    along their samples' ``axis``, laid out as ``sharding``."""
    return _joiner(axis, sharding)(*parts)


def weighted_sum(xs, ws, summed: bool = False):
    """``sum_i ws[i] * xs[i]`` in order (a loss output over micro-batches), one program
    for all of them; an integer output is added when it is a sum over the samples
    (``summed``: a count), else the last piece's."""
    if not jnp.issubdtype(xs[0].dtype, jnp.inexact):
        return _sum(xs) if summed and len(xs) > 1 else xs[-1]
    return _weighted_sum(list(xs), [float(w) for w in ws])
