"""Which inputs of a jaxpr each output depends on (forward data flow).

The pipeline runtime uses it to split a train step's update per stage: an optimizer is
separable when every updated leaf depends only on its own state, its own gradient and
shared scalars (AdamW is; global-norm clipping is not). Calls (``jit``,
``custom_jvp``/``custom_vjp``, ``remat``, ``closed_call``) are analysed inside; so are
``cond`` (each output reads the branch index and what that output reads in any branch:
``optax.MultiSteps`` switches every leaf's update on a shared counter), ``while`` and
``scan`` (their carries followed to a fixed point; a while loop's outputs also read what
its condition reads). Any other primitive is taken conservatively: each output depends
on all its operands.
"""

from __future__ import annotations

from jax.extend import core as ext

_CALL_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat", "remat2", "checkpoint",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


def _body(eqn):
    if eqn.primitive.name not in _CALLS:
        return None
    for key in _CALL_KEYS:
        if key in eqn.params:
            j = eqn.params[key]
            return getattr(j, "jaxpr", j)
    return None


def _flow(jaxpr, in_deps: list[frozenset], small: int | None = None,
          sizes: list[int] | None = None) -> list[frozenset]:
    env: dict = {}
    empty: frozenset = frozenset()
    for v in jaxpr.constvars:
        env[v] = empty
    for v, d in zip(jaxpr.invars, in_deps, strict=True):
        env[v] = d

    def read(v):
        return empty if isinstance(v, ext.Literal) else env.get(v, empty)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        body = _body(eqn)
        loop = _LOOPS.get(eqn.primitive.name)
        if body is not None and len(body.invars) == len(ins):
            outs = _flow(body, ins, small, sizes)
        elif loop is not None:
            outs = loop(eqn, ins, small, sizes)
        else:
            union = frozenset().union(*ins) if ins else empty
            outs = [union] * len(eqn.outvars)
        widest = max((size_of(v) for v in eqn.invars if not isinstance(v, ext.Literal)),
                     default=0) if small is not None and eqn.primitive.name in _REDUCTIONS \
            else 0
        for v, d in zip(eqn.outvars, outs, strict=True):
            # A small reduction of larger inputs (a norm) carries no dependency; so does a
            # small reduction of a larger value (the flag of every gradient being finite,
            # scalar parameters' among them): what pipeline stages can trade.
            cut = small is not None and d and size_of(v) <= small and (
                size_of(v) < min(sizes[i] for i in d) or size_of(v) < widest)
            env[v] = empty if cut else d
    return [read(v) for v in jaxpr.outvars]


_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
               "reduce_or", "reduce_xor", "argmax", "argmin", "dot_general")


def _inner(closed):
    return getattr(closed, "jaxpr", closed)


def _cond(eqn, ins, small, sizes):
    """``cond``: invars are the branch index, then the branches' operands."""
    index, operands = ins[0], ins[1:]
    outs = [index] * len(eqn.outvars)
    for branch in eqn.params["branches"]:
        got = _flow(_inner(branch), operands, small, sizes)
        outs = [a | b for a, b in zip(outs, got, strict=True)]
    return outs


def _while(eqn, ins, small, sizes):
    """``while``: invars are the condition's constants, the body's, then the carry."""
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cconsts, bconsts, carry = ins[:nc], ins[nc:nc + nb], list(ins[nc + nb:])
    body, cond = _inner(eqn.params["body_jaxpr"]), _inner(eqn.params["cond_jaxpr"])
    while True:
        got = _flow(body, bconsts + carry, small, sizes)
        new = [a | b for a, b in zip(carry, got, strict=True)]
        if new == carry:
            break
        carry = new
    (pred,) = _flow(cond, cconsts + carry, small, sizes)  # how many times the body runs
    return [d | pred for d in carry]


def _scan(eqn, ins, small, sizes):
    """``scan``: invars are the constants, the carry, then the scanned inputs; outputs
    the final carry, then the stacked per-step outputs."""
    nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, xs = ins[:nc], list(ins[nc:nc + nk]), ins[nc + nk:]
    body = _inner(eqn.params["jaxpr"])
    while True:
        got = _flow(body, consts + carry + xs, small, sizes)
        new = [a | b for a, b in zip(carry, got[:nk], strict=True)]
        if new == carry:
            break
        carry = new
    return carry + got[nk:]


_LOOPS = {"cond": _cond, "while": _while, "scan": _scan}


def cond_reads(eqn) -> list[frozenset[int]]:
    """Per output of a ``cond`` equation, the positions among its invars it reads: the
    branch index (0) and the operands it reads in any branch."""
    return _cond(eqn, [frozenset({i}) for i in range(len(eqn.invars))], None, None)


def output_dependencies(closed, small: int | None = None) -> list[frozenset[int]]:
    """For each output of ``closed`` (a ClosedJaxpr), the input positions it reads;
    with ``small``, not through reductions to at most that many elements of inputs
    larger than that (norms: what pipeline stages can trade,
    ``hetshard.runtime.exchange``)."""
    jaxpr = closed.jaxpr
    return _flow(jaxpr, [frozenset({i}) for i in range(len(jaxpr.invars))], small,
                 [size_of(v) for v in jaxpr.invars])


def size_of(v) -> int:
    """Elements of a jaxpr variable's value."""
    size = 1
    for d in getattr(v.aval, "shape", ()):
        size *= d
    return size
