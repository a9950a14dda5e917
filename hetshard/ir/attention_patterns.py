"""Attention in a jaxpr, found: ``hetshard.nn.attention`` calls by name
(``hetshard_attention[_causal]`` jit equations with operands ``q, k, v[, segment_ids],
scale``) and the einsum-softmax-einsum pattern of Flax-style attention
(``nnx.dot_product_attention``, ``nnx.MultiHeadAttention``, hand-written einsums): a
``dot_general`` of q and k, a scale, an optional ``where(mask, logits, -big)`` with a
mask ``hetshard.ir.masks`` recognises (causal, segment ids, both), a softmax and a
``dot_general`` with v, back in q's layout. Other masks, dropout on the weights, or
weights used elsewhere do not match and are left as they are."""

from __future__ import annotations

import functools

import jax
from jax.extend import core as ext

from hetshard.ir import masks
from hetshard.ir.masks import inner_jaxpr  # noqa: F401 (the module's callers read it here)

_NAMES = {"hetshard_attention": False, "hetshard_attention_causal": True}


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


@functools.cache
def contains_patterns(jaxpr) -> bool:
    """Whether ``jaxpr`` (or a call or loop inside it) holds recognised Flax attention."""
    if _softmax_patterns(jaxpr):
        return True
    return any(inner is not None and contains_patterns(inner[0])
               for inner in map(inner_jaxpr, jaxpr.eqns))


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


def _dot_labels(eqn) -> tuple | None:
    """Labels of the q.k ``dot_general``'s output dimensions: "B" (batch), "Q" and "K"
    (the query's and key's positions), "H" (heads and head groups); q is ``[b, s, h,
    d]`` (or reshaped to ``[b, s, ...]`` with its heads split), k ``[b, s, h, d]``."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    nl, nr = len(lhs.aval.shape), len(rhs.aval.shape)
    if tuple(lc) != (nl - 1,) or tuple(rc) != (nr - 1,) or 1 in lb or 1 in rb:
        return None  # not a product over the head dimension, or one over positions
    if 0 not in lb or 0 not in rb or list(lb).index(0) != list(rb).index(0):
        return None  # the batch dimensions not paired
    lab_l = {0: "B", 1: "Q"}
    lab_r = {0: "B", 1: "K"}
    out = [lab_l.get(d, "H") for d in lb]
    out += [lab_l.get(d, "H") for d in range(nl) if d not in lb and d not in lc]
    out += [lab_r.get(d, "H") for d in range(nr) if d not in rb and d not in rc]
    return tuple(out) if out.count("Q") == 1 and out.count("K") == 1 else None


def _moved(eqn, labels: tuple) -> tuple | None:
    """``labels`` of a layout op's operand carried to its output."""
    name = eqn.primitive.name
    shape = tuple(eqn.outvars[0].aval.shape)
    if name == "transpose":
        return tuple(labels[int(p)] for p in eqn.params["permutation"])
    if name == "broadcast_in_dim":
        out: list = [None] * len(shape)
        for i, d in enumerate(eqn.params["broadcast_dimensions"]):
            out[int(d)] = labels[i]
        return tuple(out)
    if name in ("reshape", "squeeze", "expand_dims"):
        where = masks.kept_dims(tuple(eqn.invars[0].aval.shape), shape)
        if where is None:
            return None
        out = [None] * len(shape)
        for i, o in where.items():
            out[o] = labels[i]
        return tuple(out)
    if name in ("convert_element_type", "mul", "div", "stop_gradient"):
        return labels
    return None


def _masked_fill(jaxpr, eqn, var, labels: tuple):
    """(causal, segment-ids variable) where ``eqn`` is ``where(mask, var, -big)`` (a
    ``select_n``, or a call of one: ``jnp.where``'s) with a mask ``hetshard.ir.masks``
    recognises on logits laid out as ``labels``; else None."""
    if eqn.primitive.name == "select_n":
        body, binds, sel = jaxpr, {}, eqn
        data = var
    else:
        inner = inner_jaxpr(eqn)
        if inner is None or len(eqn.outvars) != 1 or list(eqn.invars).count(var) != 1:
            return None
        body = inner[0]
        memo: dict = {}
        binds = {iv: masks.symbolic(jaxpr, ov, {}, memo)
                 for iv, ov in zip(body.invars, eqn.invars, strict=False) if ov is not var}
        data = body.invars[list(eqn.invars).index(var)]
        made = {v: e for e in body.eqns for v in e.outvars}
        sel = made.get(body.outvars[0])
        # the logits' layout inside the call, from the argument to the select
        chain, at = [], sel.invars[2] if sel is not None and len(sel.invars) == 3 else None
        while at is not None and at is not data and at in made and \
                made[at].primitive.name in _LAYOUT_OPS | {"broadcast_in_dim"}:
            chain.append(made[at])
            at = made[at].invars[0]
        if sel is None or sel.primitive.name != "select_n" or at is not data:
            return None
        for e in reversed(chain):
            labels = _moved(e, labels) if labels is not None else None
        data = sel.invars[2]
    if labels is None or len(sel.invars) != 3 or sel.invars[2] is not data:
        return None
    top = body is jaxpr
    fill = masks.symbolic(body, sel.invars[1], binds, top=top)
    if not isinstance(fill, masks.Const) or not isinstance(fill.value, float | int) or \
            fill.value > -1e4:
        return None
    return masks.mask_kind(masks.symbolic(body, sel.invars[0], binds, top=top), labels)


def _softmax_patterns(jaxpr):
    """Flax-style attention: q (or q reshaped, its heads grouped) . k -> (scale) ->
    (a causal or segment mask: ``where(mask, logits, -big)``) -> softmax -> . v ->
    layout ops back to q's [b, s, h, d] shape. Returns dicts with the equation to
    replace (``end``), the equations to skip, the q, k, v variables, the scale,
    ``causal`` and the segment ids ``seg`` (a variable or None); anything else (another
    mask, dropout, weights used elsewhere) is left alone. The mask's own equations are
    not skipped (nothing reads them once the attention is swapped: XLA drops them)."""
    eqns = jaxpr.eqns
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    uses = _consumers(jaxpr)
    found = []
    for i, e in enumerate(eqns):
        if e.primitive.name != "dot_general" or len(e.invars) != 2:
            continue
        lhs, rhs = e.invars
        if not isinstance(lhs, ext.Var) or len(rhs.aval.shape) != 4:
            continue
        pr = producer.get(lhs)
        if len(lhs.aval.shape) == 4:
            q = lhs
        elif pr is not None and eqns[pr].primitive.name == "reshape" and \
                len(lhs.aval.shape) == 5 and len(eqns[pr].invars[0].aval.shape) == 4:
            q = eqns[pr].invars[0]
            if tuple(q.aval.shape[:2]) != tuple(lhs.aval.shape[:2]):
                continue
        else:
            continue
        top = _dot_labels(e)
        if top is None:
            continue
        labels = {e.outvars[0]: top}
        region, frontier, scale, d2, ok = {i}, [e.outvars[0]], 1.0, None, True
        causal, seg, masked = False, None, False
        while frontier and ok:
            var = frontier.pop()
            for j in uses.get(var, []):
                if j in region or j == d2:
                    continue
                name = eqns[j].primitive.name
                lit = [a for a in eqns[j].invars if isinstance(a, ext.Literal)]
                if name == "dot_general":
                    if d2 is not None:
                        ok = False
                    d2 = j
                    continue
                if name in ("select_n", "jit", "pjit") and not masked:
                    got = _masked_fill(jaxpr, eqns[j], var, labels.get(var))
                    if got is None:
                        ok = False
                        break
                    (causal, seg), masked = got, True
                elif name in _SOFTMAX_OPS:
                    if name == "mul" or (name == "div" and lit):
                        if len(lit) != 1 or (name == "div" and eqns[j].invars[1] is not lit[0]):
                            ok = False
                            break
                        val = float(lit[0].val)
                        scale = scale * val if name == "mul" else scale / val
                    if var in labels and not masked:
                        moved = _moved(eqns[j], labels[var])
                        if moved is not None:
                            labels[eqns[j].outvars[0]] = moved
                else:
                    ok = False
                    break
                region.add(j)
                frontier += list(eqns[j].outvars)
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
        if seg is not None and tuple(seg.aval.shape) != tuple(q.aval.shape[:2]):
            continue
        found.append({"end": end, "skip": inside - {end}, "q": q, "k": rhs, "v": v,
                      "scale": scale, "causal": causal, "seg": seg})
    return found


@functools.cache
def flax_patterns(jaxpr):
    return {p["end"]: p for p in _softmax_patterns(jaxpr)}


def reads_of(jaxpr, i: int) -> list:
    """The variables equation ``i`` reads when evaluated with attention swapped: its
    operands, and for a recognised pattern's last equation the query, key and value
    the swapped attention reads and the segment ids its mask was made of (the mask's
    own equations may sit in an earlier stage)."""
    eqn = jaxpr.eqns[i]
    out = [v for v in eqn.invars if isinstance(v, ext.Var)]
    pat = flax_patterns(jaxpr).get(i)
    if pat is not None:
        out.extend(pat[key] for key in ("q", "k", "v", "seg")
                   if isinstance(pat[key], ext.Var) and pat[key] not in out)
    return out


@functools.cache
def dead_equations(jaxpr) -> frozenset[int]:
    """Equations outside the recognised patterns whose every result is read only by
    skipped equations (the patterns' insides) or by other such equations: a mask's own
    computation, which nothing reads once its attention is swapped."""
    skip = skipped_equations(jaxpr)
    if not skip:
        return frozenset()
    outs = {v for v in jaxpr.outvars if isinstance(v, ext.Var)}
    outs |= {p[key] for p in flax_patterns(jaxpr).values() for key in ("q", "k", "v", "seg")
             if p[key] is not None}  # what the swapped attention reads
    uses = _consumers(jaxpr)
    dead = set(skip)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if i in dead or not eqn.outvars or eqn.effects:
            continue
        if all(v not in outs and all(j in dead for j in uses.get(v, []))
               for v in eqn.outvars):
            dead.add(i)
    return frozenset(dead - skip)


def skipped_equations(jaxpr) -> set[int]:
    """Equations ``eval_equations`` never runs: the inside of a recognised attention
    pattern, whose last equation computes it all."""
    patterns = flax_patterns(jaxpr)
    return set().union(*[p["skip"] for p in patterns.values()]) if patterns else set()
