"""A jaxpr interpreter: a traced function's equations evaluated one by one, so that a
rewrite can change what some of them compute (attention swapped for a kernel, sharding
constraints on chosen values, a matmul replaced by a collective matmul, a stage's
equations alone, matmuls autocast to another dtype) while every other equation is
re-bound unchanged. Calls that contain attention (``jit``, ``remat``, custom-derivative
wrappers) are inlined so a swap reaches inside them. The pipeline, SPMD, unroll and
attention rewrites all evaluate through :func:`eval_equations`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore
from jax._src import source_info_util
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as ext

from hetshard.ir.attention_patterns import (
    attention_call,
    contains_attention,
    contains_patterns,
    flax_patterns,
    inner_jaxpr,
    skipped_equations,
)


def _same_strong_type(x, aval) -> bool:
    """``x`` already has ``aval``'s dtype and shape, neither weakly typed."""
    t = jax.typeof(x)
    return (t.dtype == aval.dtype and t.shape == aval.shape and not t.weak_type and
            not aval.weak_type)


class Replace:
    """A ``constrain`` entry for ``eval_equations``, under an equation's first output:
    compute that equation's outputs as ``fn(*inputs)`` (a list) instead of binding it;
    ``reads``: the variables whose values ``fn`` takes (default: the equation's inputs)."""

    def __init__(self, fn, reads=None):
        self.fn, self.reads = fn, reads


# Primitives whose operands an autocast computes in its dtype (``eval_equations``).
MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot")


# Calls an autocast evaluates inline when they contain a matmul (their equations are
# typed for the program's dtype); loops and branches keep their own types.
_INLINE_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
                 "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
# What ``jax.checkpoint`` (``nnx.remat``) binds: evaluated inline, its equations stay
# under a checkpoint of the same policy, so the user's remat survives the rewrite.
_CHECKPOINTS = ("remat2", "checkpoint")


def _inline(eqn, inner, invals, run, autocast) -> list:
    """``eqn``'s body evaluated in place (``evaluate_jaxpr``), under its checkpoint."""
    def body(*xs):
        return evaluate_jaxpr(inner[0], inner[1], list(xs), run, autocast)
    if eqn.primitive.name in _CHECKPOINTS:
        body = jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True),
                              policy=eqn.params.get("policy"))
    return list(body(*invals))


def _scan(eqn, inner, invals, run, autocast) -> list:
    """A ``scan`` whose body holds attention (stacked blocks under ``nnx.scan``): the
    same loop, its body evaluated with the attention swapped."""
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    consts, carry, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]

    def body(c, x):
        outs = evaluate_jaxpr(inner[0], inner[1], [*consts, *c, *x], run, autocast)
        return outs[:nk], outs[nk:]
    c, ys = jax.lax.scan(body, list(carry), list(xs), length=p["length"],
                         reverse=p["reverse"], unroll=p["unroll"])
    return [*c, *ys]


@functools.cache
def _has_matmul(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in MATMUL_PRIMITIVES:
            return True
        inner = inner_jaxpr(eqn)
        if inner is not None and eqn.primitive.name in _INLINE_CALLS and \
                _has_matmul(inner[0]):
            return True
    return False


def _autocast_in(x, autocast):
    """``x`` in the autocast's compute dtype when it holds the program's."""
    return x.astype(autocast[1]) if jnp.result_type(x) == autocast[0] else x


def needed_equations(jaxpr, wants, before: int | None = None,
                     effects: bool = False) -> list[int]:
    """Indices, in order, of the equations of ``jaxpr`` (those before index ``before``,
    or all) that the variables ``wants`` depend on. ``effects``: equations with side
    effects (a callback, a print) count as wanted too."""
    need = {v for v in wants if not isinstance(v, ext.Literal)}
    idx = []
    end = len(jaxpr.eqns) if before is None else before
    for i in range(end - 1, -1, -1):
        e = jaxpr.eqns[i]
        if any(v in need for v in e.outvars) or (effects and e.effects):
            idx.append(i)
            need.update(v for v in e.invars if not isinstance(v, ext.Literal))
    return idx[::-1]


def evaluate_jaxpr(jaxpr, consts, args, run, autocast=None):
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    eval_equations(jaxpr, env, run, autocast=autocast)
    return [v.val if isinstance(v, ext.Literal) else env[v] for v in jaxpr.outvars]


def eval_equations(jaxpr, env: dict, run, indices=None, constrain=None,
                   autocast=None, names=None) -> None:
    """Evaluates ``jaxpr``'s equations (those in ``indices``, in order, or all) into
    ``env`` (var -> value; it must hold every variable they read), computing attention
    with ``run`` (see ``attention_runner``). The pipeline rewrite evaluates one stage's
    equations this way. ``constrain`` (var -> Sharding, or a function of the value) puts
    a sharding constraint on those variables as they are computed (the SPMD rewrite's
    layouts); a ``Replace`` entry computes the equation making the variable instead.
    ``run`` None: attention is bound as traced (nothing swapped). Each equation keeps its
    own name stack (under the caller's), so scopes survive the re-interpretation.
    ``autocast`` = (program dtype, compute dtype): matmuls and attention whose operands
    are in the program's dtype compute in the other (float32 accumulation), their
    results cast back, as ``torch.autocast`` does; other values keep their types (a
    stage on a GPU without bfloat16 tensor cores, ``Plan.gpu_dtypes``). ``names``
    (var -> str): those variables' values are tagged ``checkpoint_name`` as they are
    computed (a named remat policy saves them: ``hetshard.rewrite.pipeline.Remat``)."""
    def read(v):
        return v.val if isinstance(v, ext.Literal) else env[v]

    patterns = flax_patterns(jaxpr) if run is not None else {}
    skip = skipped_equations(jaxpr) if run is not None else set()
    outer = source_info_util.current_name_stack()
    for idx in (range(len(jaxpr.eqns)) if indices is None else indices):
        eqn = jaxpr.eqns[idx]
        if idx in skip:
            continue
        with source_info_util.user_context(eqn.source_info.traceback,
                                           name_stack=outer + eqn.source_info.name_stack):
            outs = _evaluate(eqn, idx, read, run, patterns, constrain, autocast)
        for var, val in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, jcore.DropVar):
                c = constrain.get(var) if constrain else None
                if isinstance(c, Replace):
                    pass
                elif c is not None:
                    val = c(val) if callable(c) else jax.lax.with_sharding_constraint(val, c)
                if names and var in names:
                    val = checkpoint_name(val, names[var])
                env[var] = val


def named_attention(q, k, v, seg, scale, causal):
    """A ``run`` for ``eval_equations`` that makes each recognised Flax attention a
    ``hetshard.nn.attention`` call and leaves everything else as traced: the cost
    model's trace then prices a user's attention as the kernel the runtime swaps in
    (forward and backward), as it prices the named calls."""
    from hetshard.nn import attention
    return attention(q, k, v, causal=causal, segment_ids=seg, sm_scale=scale)


named_attention.patterns_only = True


def _evaluate(eqn, idx, read, run, patterns, constrain, autocast=None) -> list:
    """One equation's outputs (see ``eval_equations``)."""
    only = getattr(run, "patterns_only", False)
    holds = contains_patterns if only else contains_attention
    causal = attention_call(eqn) if run is not None and not only else None
    if autocast is not None and run is not None:
        run = _autocast_run(run, autocast)
    invals = [] if idx in patterns else [read(v) for v in eqn.invars]
    replace = constrain.get(eqn.outvars[0]) if constrain and eqn.outvars else None
    if isinstance(replace, Replace):
        outs = replace.fn(*(invals if replace.reads is None else
                            [read(v) for v in replace.reads]))
    elif idx in patterns:
        pat = patterns[idx]
        seg = None if pat["seg"] is None else read(pat["seg"])
        out = run(read(pat["q"]), read(pat["k"]), read(pat["v"]), seg, pat["scale"],
                  pat["causal"])
        outs = [out.astype(eqn.outvars[0].aval.dtype)]
    elif causal is not None:
        if len(invals) == 5:
            q, k, v, seg, scale = invals
        else:
            (q, k, v, scale), seg = invals, None
        outs = [run(q, k, v, seg, float(scale) if not isinstance(scale, jax.core.Tracer)
                    else scale, causal)]
    else:
        inner = inner_jaxpr(eqn)
        if run is not None and inner is not None and holds(inner[0]) and \
                eqn.primitive.name in _INLINE_CALLS:
            outs = _inline(eqn, inner, invals, run, autocast)
        elif run is not None and eqn.primitive.name == "scan" and holds(inner[0]):
            outs = _scan(eqn, inner, invals, run, autocast)
        elif autocast is not None and inner is not None and \
                eqn.primitive.name in _INLINE_CALLS and _has_matmul(inner[0]):
            outs = _inline(eqn, inner, invals, run, autocast)
        elif autocast is not None and eqn.primitive.name in MATMUL_PRIMITIVES and \
                any(jnp.result_type(x) == autocast[0] for x in invals):
            params = dict(eqn.primitive.get_bind_params(eqn.params))
            params["preferred_element_type"] = np.dtype(np.float32)
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*[_autocast_in(x, autocast) for x in invals],
                                         **params)
            outs = [out.astype(eqn.outvars[0].aval.dtype)]
        elif eqn.primitive.name == "convert_element_type" and \
                _same_strong_type(invals[0], eqn.outvars[0].aval):
            outs = [invals[0]]  # already cast (a pipeline stage's parameters are)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
    return outs


def _autocast_run(run, autocast):
    """``run`` with q, k and v in the autocast's compute dtype, its output cast back."""
    def cast(q, k, v, seg, scale, causal):
        out = run(_autocast_in(q, autocast), _autocast_in(k, autocast),
                  _autocast_in(v, autocast), seg, scale, causal)
        return out.astype(jnp.result_type(q))
    return cast
