"""The attention rewrite: swap every attention op of a function for the plan's choice.

``swap_attention(fn, "flash")`` returns a function that traces ``fn`` to a jaxpr and
evaluates it equation by equation, except that each attention call is computed by the
chosen implementation:

* ``hetshard.nn.attention`` calls, found by name (``hetshard_attention[_causal]`` jit
  equations with operands ``q, k, v[, segment_ids], scale``);
* the einsum-softmax-einsum pattern of unmodified Flax attention
  (``nnx.dot_product_attention``, used by ``nnx.MultiHeadAttention``): a
  ``dot_general`` of q and k, a softmax, and a ``dot_general`` with v, with no mask.

Calls that contain attention (``jit``, ``remat``, custom-derivative wrappers) are
inlined so the swap reaches inside them; everything else is re-bound unchanged. The
rewrite is applied before differentiation: ``jax.grad(swap_attention(loss))`` uses the
kernel's own backward pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import core as jcore
from jax.extend import core as ext

from hetshard.errors import SpecError

IMPLEMENTATIONS = ("reference", "flash", "ring")
_NAMES = {"hetshard_attention": False, "hetshard_attention_causal": True}
_SUB = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _inner(eqn):
    for key in _SUB:
        if key in eqn.params:
            j = eqn.params[key]
            return getattr(j, "jaxpr", j), getattr(j, "consts", ())
    return None


def _attention_call(eqn):
    if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") in _NAMES:
        return _NAMES[eqn.params["name"]]
    return None


@functools.cache
def _contains(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if _attention_call(eqn) is not None:
            return True
        inner = _inner(eqn)
        if inner is not None and _contains(inner[0]):
            return True
    return bool(_softmax_patterns(jaxpr))


def count_attention(fn, *args) -> int:
    """How many attention ops (named calls and Flax patterns) ``fn(*args)`` contains."""
    def count(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            if _attention_call(eqn) is not None:
                n += 1
            else:
                inner = _inner(eqn)
                if inner is not None:
                    n += count(inner[0])
        return n + len(_softmax_patterns(jaxpr))
    return count(jax.make_jaxpr(fn)(*args).jaxpr)


# ---- the Flax pattern ---------------------------------------------------------------

def _consumers(jaxpr):
    out = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, ext.Var):
                out.setdefault(v, []).append(i)
    return out


def _is_softmax(eqn) -> bool:
    inner = _inner(eqn)
    if inner is None:
        return False
    prims = {e.primitive.name for e in inner[0].eqns}
    return {"exp", "reduce_sum"} <= prims and ("reduce_max" in prims or "max" in prims)


def _softmax_patterns(jaxpr):
    """(dot1 index, softmax index, dot2 index) of q.k -> softmax -> .v chains, where
    dot1 is [b, q, h, d] x [b, k, h, d] -> [b, h, q, k] (Flax's einsum layout)."""
    found = []
    uses = _consumers(jaxpr)
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "dot_general":
            continue
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        if tuple(lc) != (3,) or tuple(rc) != (3,) or tuple(lb) != (0, 2) or tuple(rb) != (0, 2):
            continue
        j, v = i, eqn.outvars[0]
        hops = 0
        while hops < 3:  # a cast or a scale may sit between the dot and the softmax
            nxt = uses.get(v, [])
            if len(nxt) != 1:
                break
            j = nxt[0]
            if _is_softmax(jaxpr.eqns[j]):
                break
            if jaxpr.eqns[j].primitive.name not in ("convert_element_type", "mul", "div"):
                j = None
                break
            v = jaxpr.eqns[j].outvars[0]
            hops += 1
        if j is None or not _is_softmax(jaxpr.eqns[j]):
            continue
        sm_out = jaxpr.eqns[j].outvars[0]
        k2 = [u for u in uses.get(sm_out, [])]
        while len(k2) == 1 and jaxpr.eqns[k2[0]].primitive.name == "convert_element_type":
            k2 = uses.get(jaxpr.eqns[k2[0]].outvars[0], [])
        if len(k2) != 1 or jaxpr.eqns[k2[0]].primitive.name != "dot_general":
            continue
        found.append((i, j, k2[0]))
    return found


# ---- evaluation ---------------------------------------------------------------------

def _impl(name: str, *, mesh=None, axis="context", chunk_lengths=None, **kernel):
    if name not in IMPLEMENTATIONS:
        raise SpecError("impl", name, f"one of {IMPLEMENTATIONS}", where="swap_attention")
    if name == "ring" and mesh is None:
        raise SpecError("mesh", None, "a Mesh with a context axis for ring attention",
                        where="swap_attention")

    def run(q, k, v, seg, scale, causal):
        if name == "reference":
            from hetshard.kernels.reference import attention_reference
            return attention_reference(q, k, v, causal=causal, segment_ids=seg,
                                       sm_scale=scale)
        if name == "flash":
            from hetshard.kernels.flash_attention import flash_attention
            return flash_attention(q, k, v, causal=causal, segment_ids=seg, sm_scale=scale,
                                   **kernel)
        from hetshard.kernels.ring_attention import context_parallel_attention
        return context_parallel_attention(q, k, v, mesh, axis, causal=causal,
                                          segment_ids=seg, chunk_lengths=chunk_lengths,
                                          sm_scale=scale, **kernel)
    return run


def _eval(jaxpr, consts, args, run):
    env = {}

    def read(v):
        return v.val if isinstance(v, ext.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    patterns = {p[2]: p for p in _softmax_patterns(jaxpr)}
    skip = set()
    for idx, eqn in enumerate(jaxpr.eqns):
        if idx in skip:
            continue
        invals = [read(v) for v in eqn.invars]
        causal = _attention_call(eqn)
        if idx in patterns:
            d1, _, d2 = patterns[idx]
            q, k = [read(v) for v in jaxpr.eqns[d1].invars]
            vv = read(eqn.invars[1])
            out = run(q, k, vv, None, 1.0, False)  # Flax scales q itself beforehand
            outs = [out.astype(eqn.outvars[0].aval.dtype)]
        elif causal is not None:
            if len(invals) == 5:
                q, k, v, seg, scale = invals
            else:
                (q, k, v, scale), seg = invals, None
            outs = [run(q, k, v, seg, float(scale) if not isinstance(scale, jax.core.Tracer)
                        else scale, causal)]
        else:
            inner = _inner(eqn)
            if inner is not None and _contains(inner[0]):
                outs = _eval(inner[0], inner[1], invals, run)
            else:
                params = eqn.primitive.get_bind_params(eqn.params)
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*invals, **params)
                if not eqn.primitive.multiple_results:
                    outs = [outs]
        for var, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, jcore.DropVar):
                env[var] = val
    return [read(v) for v in jaxpr.outvars]


def swap_attention(fn, impl: str = "flash", **options):
    """``fn`` with its attention computed by ``impl`` ("reference", "flash" or "ring").

    ``options`` go to the implementation: kernel tile sizes and ``interpret`` for flash;
    ``mesh``, ``axis`` and ``chunk_lengths`` for ring attention.
    """
    run = _impl(impl, **options)

    @functools.wraps(fn)
    def wrapped(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = jax.tree.leaves(args)
        outs = _eval(closed.jaxpr, closed.consts, flat, run)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return wrapped


del jnp
