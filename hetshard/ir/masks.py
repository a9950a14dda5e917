"""What an attention mask computes, read from its equations: causal, a segment mask, both,
or something else.

A user's own attention masks its logits with ``jnp.where(mask, logits, -big)``, the mask
built from index comparisons (``jnp.tril``, ``nnx.make_causal_mask``) and from a
per-token array compared with itself (``nnx.make_attention_mask(seg, seg, jnp.equal)``),
combined with ``&`` (``nnx.combine_masks``), cast to float and back, broadcast and
transposed on the way. :func:`mask_kind` evaluates the mask's equations symbolically:
each integer value is an index of one of its own dimensions plus an offset (``iota``) or
an input array read along some of its dimensions, each boolean value a conjunction of
comparisons of those. Given which dimensions of the masked logits are the queries' and
the keys' positions (and the batch), the mask is recognised as

* causal: ``query_index >= key_index`` (the same offset on both sides);
* a segment mask: ``seg[b, query] == seg[b, key]`` for one ``[batch, seq]`` array;
* a conjunction of them, or all true.

Anything else (a window, a strict comparison, a mask from data, ``or``, ``not``) is not
recognised, and the caller leaves the attention as it is.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from jax.extend import core as ext

_PASS = ("stop_gradient", "copy", "copy_p", "optimization_barrier")


_SUB = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def inner_jaxpr(eqn):
    """``(jaxpr, consts)`` of a call's or loop's body, or None."""
    for key in _SUB:
        if key in eqn.params:
            j = eqn.params[key]
            return getattr(j, "jaxpr", j), getattr(j, "consts", ())
    return None


@dataclasses.dataclass(frozen=True)
class Index:
    """An integer: the index along dimension ``dim`` of the value, plus ``offset``."""

    dim: int
    offset: int = 0


@dataclasses.dataclass(frozen=True)
class Read:
    """An integer: input ``var`` read at the value's dimensions ``dims`` (one per
    dimension of ``var``)."""

    var: object
    dims: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Const:
    value: object


@dataclasses.dataclass(frozen=True)
class Formula:
    """A boolean: the conjunction of ``atoms`` (``(op, a, b)``, op ``"ge"``, ``"gt"`` or
    ``"eq"``); ``number``: the formula cast to a number (1 or 0)."""

    atoms: frozenset
    number: bool = False


def _remap(sym, where: dict[int, int]):
    """``sym`` with its dimensions renumbered (``where[old] = new``); None where one is
    dropped."""
    if isinstance(sym, Index):
        return Index(where[sym.dim], sym.offset) if sym.dim in where else None
    if isinstance(sym, Read):
        if any(d not in where for d in sym.dims):
            return None
        return Read(sym.var, tuple(where[d] for d in sym.dims))
    if isinstance(sym, Formula):
        atoms = []
        for op, a, b in sym.atoms:
            a, b = _remap(a, where), _remap(b, where)
            if a is None or b is None:
                return None
            atoms.append((op, a, b))
        return Formula(frozenset(atoms), sym.number)
    return sym


def kept_dims(shape_in, shape_out) -> dict[int, int] | None:
    """Dimension map of a reshape that only adds or drops size-1 dimensions."""
    ins = [i for i, n in enumerate(shape_in) if n != 1]
    outs = [i for i, n in enumerate(shape_out) if n != 1]
    if [shape_in[i] for i in ins] != [shape_out[i] for i in outs]:
        return None
    return dict(zip(ins, outs, strict=True))


def _compare(op: str, a, b):
    if not isinstance(a, Index | Read) or not isinstance(b, Index | Read):
        return None
    if op in ("le", "lt"):
        op, a, b = {"le": "ge", "lt": "gt"}[op], b, a
    return Formula(frozenset([(op, a, b)]))


def _as_formula(sym):
    if isinstance(sym, Formula):
        return sym
    if isinstance(sym, Const) and isinstance(sym.value, bool | int | float):
        return Formula(frozenset()) if sym.value else None  # false: not a mask
    return None


@functools.cache
def _producers(jaxpr) -> dict:
    return {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}


def symbolic(jaxpr, var, bindings: dict, memo: dict | None = None, top: bool = True):
    """The symbolic value of ``var`` in ``jaxpr`` (its inputs bound by ``bindings``:
    jaxpr input -> symbolic value or None); None where it is not an index
    expression, an array read or a conjunction of comparisons. In the ``top`` jaxpr
    (the attention's own) an integer value computed otherwise is read as it is (a
    segment-ids array the program computes); inside a call it is not recognised."""
    memo = {} if memo is None else memo
    if isinstance(var, ext.Literal):
        val = var.val
        return Const(val.item() if isinstance(val, np.ndarray | np.generic) else val)
    if var in memo:
        return memo[var]
    if var in bindings:
        return bindings[var]
    producer = _producers(jaxpr).get(var)
    memo[var] = None  # no cycles in a jaxpr, but stay safe
    out = None if producer is None else _equation(jaxpr, producer, var, bindings, memo, top)
    if out is None and top and np.dtype(var.aval.dtype).kind in "iu":
        out = Read(var, tuple(range(len(var.aval.shape))))
    memo[var] = out
    return out


def _equation(jaxpr, eqn, var, bindings, memo, top):
    name = eqn.primitive.name
    shape = tuple(var.aval.shape)

    def arg(k):
        return symbolic(jaxpr, eqn.invars[k], bindings, memo, top)

    if name == "iota":
        d = eqn.params["dimension"]
        return Index(d) if shape[d] > 1 else Const(0)
    if name in _PASS:
        return arg(0)
    if name == "broadcast_in_dim":
        x = arg(0)
        src = tuple(eqn.invars[0].aval.shape)
        bd = eqn.params["broadcast_dimensions"]
        where = {i: int(bd[i]) for i in range(len(src)) if src[i] == shape[int(bd[i])]}
        return None if x is None else _remap(x, where)
    if name == "transpose":
        perm = eqn.params["permutation"]
        x = arg(0)
        return None if x is None else _remap(x, {int(p): j for j, p in enumerate(perm)})
    if name in ("reshape", "squeeze", "expand_dims"):
        where = kept_dims(tuple(eqn.invars[0].aval.shape), shape)
        x = arg(0)
        return None if x is None or where is None else _remap(x, where)
    if name == "convert_element_type":
        x = arg(0)
        src, dst = eqn.invars[0].aval.dtype, var.aval.dtype
        if isinstance(x, Formula):
            return dataclasses.replace(x, number=dst.kind != "b")
        if isinstance(x, Const):
            return x
        if src.kind in "iu" and dst.kind in "iu":
            return x
        return None
    if name in ("add", "sub"):
        a, b = arg(0), arg(1)
        sign = 1 if name == "add" else -1
        if isinstance(a, Index) and isinstance(b, Const) and isinstance(b.value, int):
            return Index(a.dim, a.offset + sign * b.value)
        if name == "add" and isinstance(b, Index) and isinstance(a, Const) and \
                isinstance(a.value, int):
            return Index(b.dim, b.offset + a.value)
        return None
    if name in ("ge", "gt", "le", "lt", "eq"):
        return _compare(name, arg(0), arg(1))
    if name == "ne":
        a, b = arg(0), arg(1)
        for f, c in ((a, b), (b, a)):
            if isinstance(f, Formula) and f.number and isinstance(c, Const) and c.value == 0:
                return Formula(f.atoms)
        return None
    if name == "and":
        a, b = _as_formula(arg(0)), _as_formula(arg(1))
        if a is None or b is None or a.number or b.number:
            return None
        return Formula(a.atoms | b.atoms)
    if name == "select_n" and len(eqn.invars) == 3:
        # select_n(p, on_false, on_true): p itself where the cases are false and true
        p, no, yes = arg(0), arg(1), arg(2)
        if isinstance(p, Formula) and not p.number and isinstance(no, Const) and \
                isinstance(yes, Const) and no.value is False and yes.value is True:
            return p
        if isinstance(p, Formula) and not p.number and isinstance(no, Const) and \
                no.value is False and isinstance(yes, Formula) and not yes.number:
            return Formula(p.atoms | yes.atoms)
        return None
    inner = inner_jaxpr(eqn)
    if inner is not None and len(eqn.outvars) >= 1:
        body, _ = inner
        k = list(eqn.outvars).index(var)
        binds = {iv: symbolic(jaxpr, ov, bindings, memo, top)
                 for iv, ov in zip(body.invars, eqn.invars, strict=False)}
        return symbolic(body, body.outvars[k], binds, {}, False)
    return None


def mask_kind(sym, labels) -> tuple[bool, object] | None:
    """(causal, segment-ids variable or None) of a mask whose symbolic value is ``sym``,
    on logits whose dimensions are ``labels`` ("B" batch, "Q" query positions, "K" key
    positions, anything else); None where it is neither causal nor a segment mask (nor
    their conjunction, nor all true)."""
    f = _as_formula(sym)
    if f is None or f.number:
        return None
    causal, seg = False, None

    def label(x):
        return labels[x] if 0 <= x < len(labels) else None

    for op, a, b in f.atoms:
        if op == "ge" and isinstance(a, Index) and isinstance(b, Index) and \
                a.offset == b.offset and (label(a.dim), label(b.dim)) == ("Q", "K"):
            causal = True
        elif op == "eq" and isinstance(a, Read) and isinstance(b, Read) and \
                a.var is b.var and len(a.dims) == 2 and \
                {tuple(label(d) for d in a.dims), tuple(label(d) for d in b.dims)} == \
                {("B", "Q"), ("B", "K")} and (seg is None or seg is a.var):
            seg = a.var
        else:
            return None
    return causal, seg
