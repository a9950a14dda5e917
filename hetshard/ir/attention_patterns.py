"""Attention in a jaxpr, found: ``hetshard.nn.attention`` calls by name
(``hetshard_attention[_causal]`` jit equations with operands ``q, k, v[, segment_ids],
scale``) and the einsum-softmax-einsum pattern of unmodified Flax attention
(``nnx.dot_product_attention``, used by ``nnx.MultiHeadAttention``): a ``dot_general`` of
q and k, a scale, a softmax and a ``dot_general`` with v, back in q's layout. Masked Flax
attention (a ``select_n`` on the logits), dropout on the weights, or weights used
elsewhere do not match and are left as they are."""

from __future__ import annotations

import functools

import jax
from jax.extend import core as ext

_NAMES = {"hetshard_attention": False, "hetshard_attention_causal": True}


_SUB = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def inner_jaxpr(eqn):
    for key in _SUB:
        if key in eqn.params:
            j = eqn.params[key]
            return getattr(j, "jaxpr", j), getattr(j, "consts", ())
    return None


def attention_call(eqn):
    if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") in _NAMES:
        return _NAMES[eqn.params["name"]]
    return None


@functools.cache
def contains_attention(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if attention_call(eqn) is not None:
            return True
        inner = inner_jaxpr(eqn)
        if inner is not None and contains_attention(inner[0]):
            return True
    return bool(_softmax_patterns(jaxpr))


def count_attention(fn, *args) -> int:
    """How many attention ops (named calls and Flax patterns) ``fn(*args)`` contains."""
    def count(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            if attention_call(eqn) is not None:
                n += 1
            else:
                inner = inner_jaxpr(eqn)
                if inner is not None:
                    n += count(inner[0])
        return n + len(_softmax_patterns(jaxpr))
    return count(jax.make_jaxpr(fn)(*args).jaxpr)


_SOFTMAX_OPS = {"mul", "reduce_max", "max", "transpose", "broadcast_in_dim", "stop_gradient",
                "sub", "exp", "reduce_sum", "div", "convert_element_type"}


_LAYOUT_OPS = {"transpose", "reshape", "convert_element_type"}


def _consumers(jaxpr):
    out = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, ext.Var):
                out.setdefault(v, []).append(i)
    return out


def _softmax_patterns(jaxpr):
    """Unmasked Flax attention: reshape(q) . k -> (scale) -> softmax -> . v -> layout ops
    back to q's [b, s, h, d] shape. Returns dicts with the equation to replace (``end``),
    the equations to skip, the q, k, v variables and the scale; anything else (a mask,
    dropout, weights used elsewhere) is left alone."""
    eqns = jaxpr.eqns
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    uses = _consumers(jaxpr)
    found = []
    for i, e in enumerate(eqns):
        if e.primitive.name != "dot_general" or len(e.invars) != 2:
            continue
        lhs, rhs = e.invars
        pr = producer.get(lhs)
        if pr is None or eqns[pr].primitive.name != "reshape":
            continue
        q = eqns[pr].invars[0]
        if len(q.aval.shape) != 4 or len(lhs.aval.shape) != 5 or len(rhs.aval.shape) != 4:
            continue
        region, frontier, scale, d2, ok = {i}, [e.outvars[0]], 1.0, None, True
        while frontier and ok:
            var = frontier.pop()
            for j in uses.get(var, []):
                if j in region or j == d2:
                    continue
                name = eqns[j].primitive.name
                if name == "dot_general":
                    if d2 is not None:
                        ok = False
                    d2 = j
                elif name in _SOFTMAX_OPS:
                    if name == "mul":
                        lit = [a for a in eqns[j].invars if isinstance(a, ext.Literal)]
                        if len(lit) != 1:
                            ok = False
                            break
                        scale *= float(lit[0].val)
                    region.add(j)
                    frontier += list(eqns[j].outvars)
                else:
                    ok = False
                    break
        if not ok or d2 is None or "exp" not in {eqns[j].primitive.name for j in region}:
            continue
        others = [a for a in eqns[d2].invars
                  if not (isinstance(a, ext.Var) and producer.get(a) in region)]
        if len(others) != 1 or len(others[0].aval.shape) != 4:
            continue
        v = others[0]
        chain, var, end = [], eqns[d2].outvars[0], None
        while True:
            nxt = uses.get(var, [])
            if len(nxt) != 1 or eqns[nxt[0]].primitive.name not in _LAYOUT_OPS:
                break
            chain.append(nxt[0])
            var = eqns[nxt[0]].outvars[0]
            if tuple(var.aval.shape) == tuple(q.aval.shape):
                end = nxt[0]
                break
        if end is None:
            continue
        inside = region | {d2} | set(chain)
        if any(set(uses.get(o, [])) - inside for j in inside - {end} for o in eqns[j].outvars):
            continue  # an intermediate (e.g. the attention weights) is used elsewhere
        found.append({"end": end, "skip": inside - {end}, "q": q, "k": rhs, "v": v,
                      "scale": scale})
    return found


@functools.cache
def flax_patterns(jaxpr):
    return {p["end"]: p for p in _softmax_patterns(jaxpr)}


def skipped_equations(jaxpr) -> set[int]:
    """Equations ``eval_equations`` never runs: the inside of a recognised attention
    pattern, whose last equation computes it all."""
    patterns = flax_patterns(jaxpr)
    return set().union(*[p["skip"] for p in patterns.values()]) if patterns else set()
