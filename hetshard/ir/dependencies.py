"""Which inputs of a jaxpr each output depends on (forward data flow).

The pipeline runtime uses it to split a train step's update per stage: an optimizer is
separable when every updated leaf depends only on its own state, its own gradient and
shared scalars (AdamW is; global-norm clipping is not). Calls (``jit``,
``custom_jvp``/``custom_vjp``, ``remat``, ``closed_call``) are analysed inside; any other
primitive with a body (``scan``, ``while``, ``cond``) is taken conservatively: each
output depends on all its operands.
"""

from __future__ import annotations

from jax.extend import core as ext

_CALL_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat", "checkpoint",
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
        if body is not None and len(body.invars) == len(ins):
            outs = _flow(body, ins, small, sizes)
        else:
            union = frozenset().union(*ins) if ins else empty
            outs = [union] * len(eqn.outvars)
        for v, d in zip(eqn.outvars, outs, strict=True):
            # a small reduction of larger inputs (a norm) carries no dependency
            cut = small is not None and d and size_of(v) <= small and \
                size_of(v) < min(sizes[i] for i in d)
            env[v] = empty if cut else d
    return [read(v) for v in jaxpr.outvars]


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
