"""Does a loss treat its samples one by one? (Which plans can cut its batch.)

Plans that cut the global batch (micro-batches, pipelines with batch shares) run the
loss on each piece and add the pieces' values weighted by their share of the batch,
or, for an output that is a sum over the samples (:func:`summed_outputs`), add them.
That equals the whole batch's loss when the loss is a mean of per-sample values (plus
anything that does not read the batch), and its outputs likewise. It does not when the
loss *mixes samples*: a value reduced over the batch is used again per sample (batch
statistics, ``nnx.BatchNorm``; in-batch negatives of a contrastive loss; a batch-wide
normalisation), an output is a maximum or minimum over the batch (a weighted sum of
the pieces' maxima is not the batch's maximum), or an output keeps a value per sample
(logits returned as aux: each piece would return only its own samples'). A
per-sample value scaled by a sum that reads the batch alone (a token count normalising
a masked loss) is not counted as mixing: such a masked mean's pieces are weighted by
their shares of the count (:func:`normalized_outputs` finds it, :func:`denominator`
evaluates it per piece), which is exact for any masks.

:func:`sample_coupling` follows the batch axis through the loss's jaxpr: each value is
per sample along one axis (the batch leaves' leading axis to start), independent of
the samples, reduced over the samples (how: ``sum``, ``max``, ``min``), or mixed. It
answers only where it understands every equation the samples reach; an equation it does
not know (a ``while`` loop over the samples, a primitive not listed here) makes it give
no answer (None), never a false alarm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from numbers import Integral

import jax
import numpy as np
from jax.extend import core as ext

from hetshard.ir.attention_patterns import inner_jaxpr
from hetshard.ir.dependencies import _body
from hetshard.ir.interpret import eval_equations, needed_equations

# A value's relation to the samples: None (does not read them), an int (per sample
# along that axis), ("reduced", how) or MIXED.
MIXED = "mixed"
_REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min",
               "argmax": "arg", "argmin": "arg", "reduce_prod": "prod",
               "reduce_and": "max", "reduce_or": "max", "reduce_xor": "prod"}
_SCANS = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
_UNARY = ("neg", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos",
          "sqrt", "rsqrt", "cbrt", "abs", "sign", "floor", "ceil", "round", "is_finite",
          "not", "integer_pow", "convert_element_type", "copy", "copy_p", "erf", "erfc",
          "erf_inv", "real", "imag", "conj", "reduce_precision", "square", "tan", "asin",
          "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "lgamma", "digamma",
          "stop_gradient", "optimization_barrier", "population_count", "clz",
          "sharding_constraint", "mesh_cast", "reshard", "pvary")
_BINARY = ("add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "and", "or",
           "xor", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "nextafter", "clamp",
           "shift_left", "shift_right_logical", "shift_right_arithmetic", "add_any")


# x.at[idx].set(v) and its kin (operand, indices, updates).
_SCATTERS = ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
             "scatter-min", "scatter_min", "scatter-max", "scatter_max")
# Pooling: a reduction over a window of each axis (nnx.avg_pool, nnx.max_pool).
_WINDOWS = ("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")
# Primitives that only move or copy their operands' elements.
_MOVES = ("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice",
          "concatenate", "stack", "copy", "copy_p", "rev", "pad", "dynamic_slice")


class _Unknown(Exception):  # noqa: N818 (control flow inside this module)
    pass


def sample_coupling(closed, batch_inputs: Sequence[int],
                    per_piece: bool = False) -> str | None:
    """Why cutting the batch changes ``closed``'s outputs (a ClosedJaxpr of the loss whose
    inputs at ``batch_inputs`` are batch leaves, samples along axis 0), or None: the
    loss treats its samples one by one, or the analysis cannot tell. ``per_piece``: the
    user takes values reduced over the batch and put through a non-linear function (a
    mixture-of-experts balance loss of batch means) per piece, as Megatron-LM's
    per-micro-batch auxiliary loss is: such outputs are not a reason."""
    try:
        outs, why = _relations(closed, batch_inputs)[:2]
    except _Unknown:
        return None
    if why:
        return why
    for k, o in enumerate(outs):
        if isinstance(o, tuple) and o[1] == "curved" and not per_piece:
            return (f"output {k} of the loss puts values reduced over the batch through a "
                    f"non-linear function{o[2]} (a product of two batch means, as a "
                    f"mixture-of-experts load-balancing loss is, or the exp of a mean "
                    f"loss): each piece of a cut batch would compute it from its own "
                    f"samples, and no weighting of the pieces gives the whole batch's "
                    f"(a metric such as the perplexity can be computed from the "
                    f"returned loss outside the loss function instead)")
        if isinstance(o, tuple) and o[1] in ("max", "min", "arg"):
            name = {"max": "maximum", "min": "minimum", "arg": "arg-max or arg-min"}[o[1]]
            return (f"output {k} of the loss is a {name} over the batch (the pieces of a "
                    f"cut batch would be averaged)")
    return None


def unfollowed(closed, batch_inputs: Sequence[int]) -> str | None:
    """Where the analysis stopped following ``closed``'s samples (the primitive it does
    not know, or cannot tell the samples apart in, and the user's line), or None: it
    followed every equation the samples reach."""
    try:
        _relations(closed, batch_inputs)
    except _Unknown as err:
        return str(err.args[0]) if err.args else "an equation"
    return None


def per_sample_outputs(closed, batch_inputs: Sequence[int]) -> dict[int, int] | None:
    """The outputs of ``closed`` that hold a value per sample (logits returned as aux),
    each with its samples' axis: a cut batch's pieces are concatenated along it, in the
    batch's order. None where the analysis cannot tell."""
    try:
        outs, why = _relations(closed, batch_inputs)[:2]
    except _Unknown:
        return None
    return None if why else {k: o for k, o in enumerate(outs) if isinstance(o, int)}


def summed_outputs(closed, twin, ratio: float, batch_inputs: Sequence[int]) -> list[bool]:
    """Per output of ``closed`` (the loss at some batch size; ``twin``: the same loss
    traced at ``ratio`` times as many samples), whether it is a sum over the samples (its
    power of the batch size is 1: ``ce.sum()``, a count of correct predictions) rather
    than a mean: a cut batch's pieces are then added, not averaged, and a summed loss's
    gradients likewise. Where the analysis cannot tell, False (averaged)."""
    got = _traced(closed, batch_inputs, twin, ratio)
    if got is None:
        return [False] * len(closed.jaxpr.outvars)
    return [isinstance(o, tuple) and o[1] == "sum" and sc is not None and abs(sc - 1) < 1e-9
            for o, sc in zip(got[0], got[2], strict=True)]


def mixed_power_outputs(closed, twin, ratio: float, batch_inputs: Sequence[int]) -> list[int]:
    """The outputs of ``closed`` (as for :func:`summed_outputs`) that add a sum over the
    samples to a mean, or to a term that reads no sample (``ce.sum() + l2``): the pieces
    of a cut batch can be neither added (the other term would count once per piece) nor
    averaged (the sum would shrink)."""
    got = _traced(closed, batch_inputs, twin, ratio)
    if got is None:
        return []
    return [k for k, (o, sc) in enumerate(zip(got[0], got[2], strict=True))
            if o is not None and sc is not None and sc != sc]


def normalized_outputs(closed, twin, ratio: float,
                       batch_inputs: Sequence[int]) -> list[tuple | None]:
    """Per output of ``closed`` (as for :func:`summed_outputs`), where it is a masked
    mean: a sum over the samples divided by a sum over the samples that reads the
    batch alone (``(ce * mask).sum() / mask.sum()``, ``jnp.mean(ce, where=mask)``, a
    weighted mean), the path of that divisor's sum (:func:`denominator`), else None.
    The whole batch's value is then its pieces' values weighted by their shares of the
    divisor, not of the samples (exact for any masks; the pieces' gradients likewise,
    the divisor not depending on the parameters)."""
    got = _traced(closed, batch_inputs, twin, ratio, denominators=True)
    if got is None:
        return [None] * len(closed.jaxpr.outvars)
    # (a ratio of two sums is ("reduced", "other") to the relations: the denominators
    # follow only linear steps after the division, so such an output is a sum's ratio)
    return [d[0] if isinstance(o, tuple) and o[1] in ("sum", "other") and sc is not None
            and abs(sc) < 1e-9 and isinstance(d[0], tuple) else None
            for o, sc, d in zip(got[0], got[2], got[3], strict=True)]


def denominator(closed, path: tuple, args: list):
    """The value of the divisor at ``path`` (:func:`normalized_outputs`; the same loss
    traced at another batch size has it at the same path) in ``closed`` given its
    inputs ``args`` (the batch's; those the divisor does not read may be None): only
    the equations it depends on are evaluated."""
    return _evaluate_path(closed.jaxpr, closed.consts, list(args), path)


def equation_at(jaxpr, path: tuple):
    """The equation at ``path`` (:func:`normalized_outputs`), or None where ``jaxpr``
    has none there."""
    for depth, k in enumerate(path[:-1]):
        if not isinstance(k, int) or k >= len(jaxpr.eqns):
            return None
        eqn = jaxpr.eqns[k]
        if depth == len(path) - 2:
            return eqn if path[-1] < len(eqn.outvars) else None
        inner = inner_jaxpr(eqn)
        if inner is None:
            return None
        jaxpr = inner[0]
    return None


def _wants(eqn, rest: tuple) -> set:
    """The inputs of ``eqn`` that the value at ``rest`` (the path below it) reads: all of
    them for an output of ``eqn`` itself, else those its body's path reads."""
    if len(rest) == 1:
        return {v for v in eqn.invars if not isinstance(v, ext.Literal)}
    body = inner_jaxpr(eqn)[0]
    inner = needed_inputs(body, rest)
    return {v for v, b in zip(eqn.invars, body.invars, strict=True)
            if b in inner and not isinstance(v, ext.Literal)}


def needed_inputs(jaxpr, path: tuple) -> set:
    """The input variables of ``jaxpr`` that the value at ``path`` depends on
    (:func:`denominator` reads no other)."""
    k, wants = path[0], _wants(jaxpr.eqns[path[0]], path[1:])
    need = set(wants)
    for i in needed_equations(jaxpr, wants, k):
        need.update(v for v in jaxpr.eqns[i].invars if not isinstance(v, ext.Literal))
    return need & set(jaxpr.invars)


def _evaluate_path(jaxpr, consts, args, path):
    k, rest = path[0], path[1:]
    eqn = jaxpr.eqns[k]
    idx = needed_equations(jaxpr, _wants(eqn, rest), k)
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update((v, a) for v, a in zip(jaxpr.invars, args, strict=True) if a is not None)
    eval_equations(jaxpr, env, None, indices=idx)

    def read(v):
        return v.val if isinstance(v, ext.Literal) else env.get(v)
    if len(rest) == 1:
        eval_equations(jaxpr, env, None, indices=[k])
        return env[eqn.outvars[rest[0]]]
    body, body_consts = inner_jaxpr(eqn)
    return _evaluate_path(body, body_consts, [read(v) for v in eqn.invars], rest)


def _relations(closed, batch_inputs, twin=None, ratio: float = 1.0,
               denominators: bool = False):
    """``_walk`` of ``closed`` from its inputs: the batch leaves at ``batch_inputs``
    (samples along axis 0), the others the step's state; with ``twin``, each value's
    power of the batch size, and with ``denominators`` its denominator too."""
    jaxpr = closed.jaxpr
    batch = set(batch_inputs)
    start = [0 if i in batch else None for i in range(len(jaxpr.invars))]
    reads = [i not in batch for i in range(len(jaxpr.invars))]
    return _walk(jaxpr, start, reads, (), None if twin is None else (twin.jaxpr, ratio),
                 None, _Dens(jaxpr, (), None) if denominators else None)


def _traced(closed, batch_inputs, twin, ratio: float, denominators: bool = False):
    """:func:`_relations` with powers (and denominators), or None where the analysis
    cannot tell or the samples mix."""
    try:
        got = _relations(closed, batch_inputs, twin, ratio, denominators)
    except _Unknown:
        return None
    return None if got[1] else got


# A dropless mixture-of-experts dispatch (``hetshard.ir.moe``): token rows sorted by
# their experts, computed row by row (grouped matmuls), and put back where they came from.
# Inside it a value's rows are the tokens' in the sort's order: PERMUTED. Only the
# equations of such a region may read it; the scatter that puts the rows back makes a
# value per sample again.
PERMUTED = "permuted"
# Row-wise primitives a region may apply to its permuted rows (each output row reads the
# same row of its permuted operands; other operands read no sample).
_ROWWISE = ("add", "sub", "mul", "div", "neg", "max", "min", "select_n", "clamp", "abs",
            "sign", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt",
            "rsqrt", "integer_pow", "square", "erf", "erf_inv", "sin", "cos", "pow", "rem",
            "floor", "ceil", "round", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not",
            "convert_element_type", "copy", "copy_p", "stop_gradient", "reduce_precision",
            "broadcast_in_dim", "floor_divide", "clip", "nextafter", "is_finite")


@dataclasses.dataclass
class _Region:
    """One dropless dispatch: the equations inside it (``inside``), the gather that reads
    the token rows (``gather``), the scatter that puts the expert outputs back
    (``exit``), and the ragged matmuls' group sizes (operands that read every token,
    allowed: a row's group is its own expert)."""

    inside: set
    gather: int
    exit: int


def dropless_regions(jaxpr) -> dict[int, _Region]:
    """The dropless dispatches of ``jaxpr`` by the index of their first equation (the
    sort). A region is taken only where its index arithmetic is checked: for a random
    permutation, the row each position gathers is the token of the row the scatter puts
    it back to (``k`` rows a token, ``k`` the router's top-k)."""
    found: dict[int, _Region] = {}
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    for r, top in enumerate(jaxpr.eqns):
        if top.primitive.name != "top_k":
            continue
        k = int(top.params["k"])
        tokens = int(top.invars[0].aval.shape[0]) if top.invars[0].aval.shape else 0
        # the sort of the expert ids: the first sort after the router reading its indices
        ids = {top.outvars[1]}
        sort = None
        for i in range(r + 1, len(jaxpr.eqns)):
            e = jaxpr.eqns[i]
            ins = [v for v in e.invars if not isinstance(v, ext.Literal)]
            if not any(v in ids for v in ins):
                continue
            if _is_argsort(e) and all(v in ids or v not in producer and
                                      v not in jaxpr.invars for v in ins):
                sort = i
                break
            if e.primitive.name in ("reshape", "convert_element_type", "copy"):
                ids.update(e.outvars)
        if sort is None:
            continue
        region = _region(jaxpr, sort, k, tokens)
        if region is not None:
            found[sort] = region
    return found


def _is_argsort(eqn) -> bool:
    if eqn.primitive.name in ("jit", "pjit"):
        return str(eqn.params.get("name", "")) == "argsort" and len(eqn.outvars) == 1
    return False


def _region(jaxpr, sort: int, k: int, tokens: int) -> _Region | None:
    perm = jaxpr.eqns[sort].outvars[0]
    n = int(perm.aval.shape[0])
    if n != tokens * k:
        return None
    permuted = {perm}
    inside, gather, exit_ = {sort}, None, None
    for i in range(sort + 1, len(jaxpr.eqns)):
        e = jaxpr.eqns[i]
        ins = [v for v in e.invars if not isinstance(v, ext.Literal)]
        if not any(v in permuted for v in ins):
            continue
        name = e.primitive.name
        if name == "gather" and e.invars[0] not in permuted and gather is None:
            gather = i
        elif name == "ragged_dot_general" and e.invars[0] in permuted and \
                e.invars[1] not in permuted:
            pass
        elif name == "scatter" and e.invars[0] not in permuted and \
                e.invars[1] in permuted and e.invars[2] in permuted:
            exit_ = i
            inside.add(i)
            break
        elif name in _ROWWISE or (name in ("jit", "pjit") and _rowwise_body(e)):
            if name == "broadcast_in_dim" and tuple(e.params["broadcast_dimensions"][:1]) \
                    != (0,):
                return None
        else:
            return None
        inside.add(i)
        permuted.update(e.outvars)
    if gather is None or exit_ is None or \
            jaxpr.eqns[gather].invars[0].aval.shape[:1] != (tokens,):
        return None
    region = _Region(inside, gather, exit_)
    return region if _rows_return(jaxpr, region, perm, k, tokens) else None


def _rowwise_body(eqn) -> bool:
    body = _body(eqn)
    return body is not None and all(
        e.primitive.name in _ROWWISE or (e.primitive.name in ("jit", "pjit") and
                                         _rowwise_body(e)) for e in body.eqns)


def _rows_return(jaxpr, region: _Region, perm, k: int, tokens: int) -> bool:
    """For random permutations ``p`` (and the identity), the scatter puts position ``i``
    back to row ``p[i]`` (whose expert the sort put there) and the gather reads it from
    token ``p[i] // k`` (row ``j`` of the ``k`` per token holds token ``j // k``):
    evaluated on the region's own index arithmetic, which must read the permutation
    alone."""
    g, x = jaxpr.eqns[region.gather], jaxpr.eqns[region.exit]
    sort = min(region.inside)
    need = {v for v in (g.invars[1], x.invars[1]) if not isinstance(v, ext.Literal)}
    idx = []
    for i in range(region.exit - 1, sort, -1):
        e = jaxpr.eqns[i]
        if any(v in need for v in e.outvars):
            idx.append(i)
            need.update(v for v in e.invars if not isinstance(v, ext.Literal))
    idx.reverse()
    made = {v for i in idx for v in jaxpr.eqns[i].outvars}
    if need - made - {perm}:
        return False  # the indices read something besides the permutation
    rng = np.random.default_rng(0)
    n = tokens * k
    for p in (np.arange(n), rng.permutation(n), rng.permutation(n)):
        env = {perm: np.asarray(p, perm.aval.dtype)}
        with jax.ensure_compile_time_eval():  # concrete even while a step is traced
            eval_equations(jaxpr, env, None, indices=idx)
        rows = np.asarray(env[g.invars[1]]).reshape(-1)
        dest = np.asarray(env[x.invars[1]]).reshape(-1)
        if rows.shape != (n,) or not np.array_equal(dest, p) or \
                not np.array_equal(rows, p // k):
            return False
    return True


def _permuted(eqn, k: int, region: _Region, states: list) -> list:
    """The outputs' relation to the samples for an equation inside a dropless dispatch:
    PERMUTED rows, or (the scatter putting them back) per sample along axis 0; MIXED
    where an operand is not what the region's rows allow."""
    n = len(eqn.outvars)
    name = eqn.primitive.name
    if k == min(region.inside):  # the sort of the expert ids, per sample along axis 0
        return [PERMUTED] * n if states == [0] else [MIXED] * n
    if k == region.gather:
        return [PERMUTED] if states[0] == 0 and states[1] == PERMUTED else [MIXED]
    if name == "ragged_dot_general":  # the group sizes read every token: any but mixed
        ok = states[0] == PERMUTED and states[1] is None and states[2] not in (MIXED,
                                                                                PERMUTED)
        return [PERMUTED] if ok else [MIXED]
    if k == region.exit:
        return [0] if states[0] is None and states[1:] == [PERMUTED, PERMUTED] else [MIXED]
    return [PERMUTED] * n if all(s in (None, PERMUTED) for s in states) else [MIXED] * n


def _walk(jaxpr, ins: list, reads_in: list, outer=(), twin=None, scales_in=None,
          dens: _Dens | None = None) -> tuple[list, str | None, list | None, list | None]:
    """(The outputs' relation to the samples, why the samples mix or None, their powers
    of the batch size, their denominators). ``reads_in``: per input, whether it reads
    the step's state (parameters) rather than the batch alone; ``outer``: the call
    equations this jaxpr is the body of (where to point when its own equations have no
    location in the user's code). With ``twin`` (``(jaxpr, ratio)``: the same loss
    traced at ``ratio`` times the samples) each value's power of the batch size is
    followed (``_Scales``), else the third element is None; with ``dens`` (a
    ``_Dens`` of this jaxpr) each value's denominator, else the fourth is None."""
    env: dict = {}
    reads: dict = {}
    for v in jaxpr.constvars:
        env[v], reads[v] = None, False
    for v, s, r in zip(jaxpr.invars, ins, reads_in, strict=True):
        env[v], reads[v] = s, r
    scales = _Scales(jaxpr, twin, scales_in) if twin is not None else None

    def read(v):
        return None if isinstance(v, ext.Literal) else env.get(v)

    def reading(v):
        return False if isinstance(v, ext.Literal) else reads.get(v, False)

    inside = {i: r for r in (dropless_regions(jaxpr) if any(
        e.primitive.name == "top_k" for e in jaxpr.eqns) else {}).values() for i in r.inside}
    for k, eqn in enumerate(jaxpr.eqns):
        states = [read(v) for v in eqn.invars]
        state_in = [reading(v) for v in eqn.invars]
        for v in eqn.outvars:  # (conservative for calls: any input's)
            reads[v] = any(state_in)
        if k in inside:
            outs = _permuted(eqn, k, inside[k], states)
            if MIXED in outs:
                return [], _mixed(eqn, outer), None, None
            if scales is not None:
                scales.rule(k, eqn, states, outs)
            if dens is not None:
                dens.rule(k, eqn, states, outs, any(state_in))
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
            continue
        if PERMUTED in states:  # rows in the dispatch's order, read outside it
            return [], _mixed(eqn, outer), None, None
        if all(s is None for s in states):
            for v in eqn.outvars:
                env[v] = None
            if scales is not None:
                scales.constant(k, eqn)
            if dens is not None:
                dens.constant(eqn)
            continue
        if MIXED in states:
            return [], _mixed(eqn, outer), None, None
        body = _body(eqn)
        if body is not None and len(body.invars) == len(states):
            inner = scales.inner(k, eqn) if scales is not None else None
            got = _walk(body, states, state_in, (*outer, eqn), *(inner or (None, None)),
                        dens.inner(k, eqn, body) if dens is not None else None)
            outs, why = got[0], got[1]
            if why:
                return [], why, None, None
            if scales is not None:
                scales.called(k, eqn, got[2] if inner else None)
            if dens is not None:
                dens.called(eqn, got[3])
        else:
            # axes as Python ints (params hold numpy integers)
            try:
                outs = [int(o) if isinstance(o, Integral) else o
                        for o in _rule(eqn, states, state_in)]
            except _Unknown as err:  # where, in the user's code
                raise _Unknown(f"{err.args[0]}{_where(eqn, outer)}") from None
            if CURVED in outs:  # where it turned: the user's line
                outs = [("reduced", "curved", _where(eqn, outer)) if o == CURVED else o
                        for o in outs]
            if scales is not None:
                scales.rule(k, eqn, states, outs)
            if dens is not None:
                dens.rule(k, eqn, states, outs, any(state_in))
        if MIXED in outs:
            return [], _mixed(eqn, outer), None, None
        for v, s in zip(eqn.outvars, outs, strict=True):
            env[v] = s
    outs = [read(v) for v in jaxpr.outvars]
    return (outs, None, scales.outputs() if scales is not None else None,
            dens.outputs() if dens is not None else None)


# The power of a value that adds terms of different powers (a sum over the samples plus
# a mean, or plus a term that reads no sample): NaN, which the rules' arithmetic carries
# to whatever the value reaches.
MIXED_POWERS = float("nan")

# Primitives that keep their data operand's power of the batch size (the first operand;
# a select's cases), and those whose result does not scale with it at all.
_KEEP = ("neg", "abs", "convert_element_type", "copy", "copy_p", "stop_gradient",
         "reduce_precision", "optimization_barrier", "broadcast_in_dim", "reshape",
         "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice", "rev", "pad",
         "gather", "sharding_constraint", "mesh_cast", "reshard", "pvary", "real", "conj",
         "reduce_window_sum", "reduce_window_max", "reduce_window_min", "top_k",
         "reduce_max", "reduce_min", "cummax", "cummin", "sort", "split")
_SAME = ("add", "sub", "add_any", "max", "min", "select_n", "clamp", "concatenate", "stack",
         "rem", "nextafter")
_NONE = ("eq", "ne", "lt", "le", "gt", "ge", "is_finite", "sign", "floor", "ceil",
         "round", "argmax", "argmin", "and", "or", "not", "xor")


class _Scales:
    """Each value's power of the batch size (samples being alike: a sum over the samples
    is 1, a mean 0), read off two traces of one loss at batch sizes ``ratio`` apart,
    equation by equation: a literal that changes by the ratio between them (a mean's
    divisor) scales by the batch size. None: it cannot tell."""

    def __init__(self, jaxpr, twin, scales_in):
        self.twin, self.ratio = twin
        self.ok = (len(self.twin.eqns) == len(jaxpr.eqns) and
                   [e.primitive for e in self.twin.eqns] == [e.primitive for e in jaxpr.eqns])
        self.env: dict = {v: 0.0 for v in jaxpr.constvars}
        ins = scales_in if scales_in is not None else [0.0] * len(jaxpr.invars)
        self.env.update(zip(jaxpr.invars, ins, strict=True))
        self.jaxpr = jaxpr

    def _of(self, k, eqn, i):
        v = eqn.invars[i]
        if not isinstance(v, ext.Literal):
            return self.env.get(v, 0.0)
        other = self.twin.eqns[k].invars[i] if self.ok else None
        if not isinstance(other, ext.Literal):
            return None
        try:
            a, b = float(v.val), float(other.val)
        except (TypeError, ValueError):
            return None
        if a == b:
            return 0.0
        for power in (1.0, -1.0):
            if a and abs(b / a - self.ratio ** power) < 1e-6 * self.ratio:
                return power
        return None

    def _set(self, eqn, value):
        for v in eqn.outvars:
            self.env[v] = value

    def constant(self, k, eqn):
        """An equation that reads no sample: a literal of the batch size stays one."""
        ins = [self._of(k, eqn, i) for i in range(len(eqn.invars))]
        name = eqn.primitive.name
        if name in ("mul", "div") and None not in ins and len(ins) == 2:
            self._set(eqn, ins[0] + ins[1] if name == "mul" else ins[0] - ins[1])
        elif name in _KEEP + ("convert_element_type",) and ins and ins[0] is not None:
            self._set(eqn, ins[0])
        else:
            self._set(eqn, 0.0 if all(x == 0.0 for x in ins) else None)

    def inner(self, k, eqn):
        body, twin = _body(eqn), _body(self.twin.eqns[k]) if self.ok else None
        if twin is None or len(twin.invars) != len(body.invars):
            return None
        return (twin, self.ratio), [self._of(k, eqn, i) for i in range(len(eqn.invars))]

    def called(self, k, eqn, outs):
        for i, v in enumerate(eqn.outvars):
            self.env[v] = outs[i] if outs is not None else None

    def rule(self, k, eqn, states, outs):
        name = eqn.primitive.name
        ins = [self._of(k, eqn, i) for i in range(len(eqn.invars))]
        literal = [isinstance(v, ext.Literal) for v in eqn.invars]
        if name == "mul":
            value = None if None in ins else sum(ins)
        elif name == "div":
            value = None if None in ins else ins[0] - ins[1]
        elif name == "dot_general":
            value = None if None in ins[:2] else ins[0] + ins[1] + (
                1.0 if isinstance(outs[0], tuple) and all(
                    isinstance(x, Integral) for x in states[:2] if x is not None) else 0.0)
        elif name in _REDUCTIONS and isinstance(states[0], Integral) and \
                isinstance(outs[0], tuple):
            value = None if ins[0] is None else ins[0] + (1.0 if outs[0][1] == "sum" else 0.0)
        elif name in _KEEP or name in _REDUCTIONS:
            value = ins[0]
        elif name in _SCATTERS:  # the operand's and the updates' (not the indices')
            data = [x for i, x in enumerate(ins) if i != 1 and not literal[i]]
            value = (None if None in data else MIXED_POWERS if len(set(data)) > 1 or
                     any(x != x for x in data) else (data[0] if data else 0.0))
            if value is not None and isinstance(outs[0], tuple) and outs[0][1] == "sum":
                value += 1.0  # the samples' terms added up (scatter-add by sample)
        elif name in _SAME:
            data = ins[1:] if name == "select_n" else ins
            lit = literal[1:] if name == "select_n" else literal
            # an added literal is an epsilon or a floor (sum(m) + 1e-8), not a term
            vals = [x for x, is_lit in zip(data, lit, strict=True) if not is_lit]
            if None in vals:
                value = None
            elif any(x != x for x in vals) or len(set(vals)) > 1:
                value = MIXED_POWERS  # terms of other powers added: no one weight
            else:
                value = vals[0] if vals else 0.0
        elif name == "integer_pow":
            value = None if ins[0] is None else ins[0] * eqn.params["y"]
        elif name in ("sqrt", "rsqrt", "square"):
            f = {"sqrt": 0.5, "rsqrt": -0.5, "square": 2.0}[name]
            value = None if ins[0] is None else ins[0] * f
        elif name in _NONE:
            value = 0.0 if all(x == 0.0 for x in ins) else None
        else:  # exp, log, tanh, ...: only of a value that does not scale
            value = 0.0 if all(x == 0.0 for x in ins) else None
        self._set(eqn, value)

    def outputs(self):
        return [None if isinstance(v, ext.Literal) else self.env.get(v, 0.0)
                for v in self.jaxpr.outvars]


# A value's denominator (``_Dens``): None, the path of a batch sum dividing it, or BAD
# (divided by something else too, or combined non-linearly: no exact weighting known).
BAD = "bad"
# Primitives that carry a batch sum through to a divisor (a count cast to float, floored
# at 1, broadcast), the other operands not reading the samples.
_SRC_KEEP = ("convert_element_type", "copy", "copy_p", "reshape", "broadcast_in_dim",
             "squeeze", "expand_dims", "stop_gradient", "max", "min", "add", "sub",
             "mul", "div", "select_n", "reduce_precision", "optimization_barrier")
# Primitives linear in their first operand: its denominator stays.
_LINEAR = ("neg", "convert_element_type", "copy", "copy_p", "reshape", "broadcast_in_dim",
           "squeeze", "expand_dims", "transpose", "slice", "reduce_sum", "stop_gradient",
           "reduce_precision", "optimization_barrier", "sharding_constraint", "mesh_cast",
           "reshard", "pvary", "real")


class _Dens:
    """Each value's denominator: a sum over the samples that reads the batch alone (a
    token count) by which it was divided (``src``: such a sum, or a value that is one
    up to a cast, a floor or a constant factor; ``den``: the path of the sum dividing
    the value, None or BAD). A path is the equations' indices down the call bodies and
    the output's index."""

    def __init__(self, jaxpr, prefix: tuple, ins):
        self.jaxpr, self.prefix = jaxpr, prefix
        self.env: dict = {}
        for v, x in zip(jaxpr.invars, ins or [(None, None)] * len(jaxpr.invars),
                        strict=True):
            self.env[v] = x

    def _get(self, v):
        return (None, None) if isinstance(v, ext.Literal) else self.env.get(v, (None, None))

    def constant(self, eqn):
        for v in eqn.outvars:
            self.env[v] = (None, None)

    def inner(self, k, eqn, body):
        return _Dens(body, (*self.prefix, k), [self._get(v) for v in eqn.invars])

    def called(self, eqn, outs):
        for v, x in zip(eqn.outvars, outs, strict=True):
            self.env[v] = x

    def rule(self, k, eqn, states, outs, reads):
        name = eqn.primitive.name
        ins = [self._get(v) for v in eqn.invars]
        dens = [d for d, _ in ins]
        srcs = [s for _, s in ins]
        reading = [s is not None for s in states]
        src = None
        if name == "reduce_sum" and isinstance(states[0], Integral) and \
                isinstance(outs[0], tuple) and not reads and dens[0] is None:
            src = (*self.prefix, k, 0)
        elif name in _SRC_KEEP:
            start = 1 if name == "select_n" else 0
            carried = [(i, x) for i, x in enumerate(srcs) if x is not None and i >= start]
            rest = [r for i, (r, x) in enumerate(zip(reading, srcs, strict=True))
                    if i >= start and x is None]
            if len(carried) == 1 and not any(rest) and \
                    (name != "div" or carried[0][0] == 0):
                src = carried[0][1]
        if name == "div":
            a, b = dens[0], dens[1]
            if b is not None:
                den = BAD
            elif srcs[1] is not None:
                den = srcs[1] if a is None else BAD
            else:
                den = a
        elif name in ("mul", "dot_general"):
            known = [d for d in dens[:2] if d is not None]
            den = None if not known else (known[0] if len(known) == 1 and known[0] != BAD
                                          else BAD)
        elif name in _LINEAR:
            den = dens[0] if all(d is None for d in dens[1:]) else BAD
        elif name in _SAME:
            start = 1 if name == "select_n" else 0
            if name == "select_n" and dens[0] is not None:
                den = BAD
            else:
                # the operands that read the samples share one denominator (a term that
                # does not read them, a weight decay, adds to every piece alike)
                kinds = {d for i, (d, r) in enumerate(zip(dens, reading, strict=True))
                         if i >= start and r}
                den = kinds.pop() if len(kinds) == 1 else (None if not kinds else BAD)
                if den is None and any(d is not None for d in dens):
                    den = BAD
        else:
            den = BAD if any(d is not None for d in dens) else None
        for v in eqn.outvars:
            self.env[v] = (den, src)

    def outputs(self):
        return [self._get(v) for v in self.jaxpr.outvars]


# Primitives that draw random values: their result depends on each element's position.
_DRAWS = ("random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform", "random_split")


def batch_shaped_draw(closed, twin, batch_inputs: Sequence[int]) -> str | None:
    """Why ``closed`` (the loss at some batch size; ``twin``: the same loss traced at
    another) changes when its batch is cut, because it draws random values shaped by the
    batch from a key that is not the batch's (``jax.random.normal(key, x.shape)`` in the
    step before its loss, a dropout mask): each piece of a cut batch would draw its own
    values from the same key (the same noise, the same mask, for every micro-batch), not
    its rows of the whole batch's draw. None where there is no such draw or the traces
    differ in structure."""
    found = _draw_in(closed.jaxpr, twin.jaxpr,
                     [i in set(batch_inputs) for i in range(len(closed.jaxpr.invars))], ())
    if found is None:
        return None
    eqn, outer = found
    where = ""
    for e in (eqn, *reversed(outer)):
        frame = _user_frame(e)
        if frame is not None:
            where = f" (at {frame.file_name}:{frame.start_line})"
            break
    return (f"the loss draws random values shaped by the batch{where} from a key that is "
            f"not the batch's (noise drawn from the step's key, a dropout mask): each piece "
            f"of a cut batch would draw its own from the same key, the same for every "
            f"micro-batch, not its rows of the whole batch's draw; draw them from "
            f"per-sample keys in the batch, or pass them in the batch, to let it be cut")


def _draw_in(jaxpr, twin, reads: list, outer: tuple):
    """(The first equation drawing batch-shaped random values from no batch input,
    the call equations around it), or None."""
    if len(jaxpr.eqns) != len(twin.eqns):
        return None
    env = dict(zip(jaxpr.invars, reads, strict=True))
    for eqn, other in zip(jaxpr.eqns, twin.eqns, strict=True):
        if eqn.primitive is not other.primitive:
            return None
        ins = [False if isinstance(v, ext.Literal) else env.get(v, False)
               for v in eqn.invars]
        for v in eqn.outvars:
            env[v] = any(ins)
        shaped = any(_shape(a) != _shape(b) for a, b in zip(eqn.outvars, other.outvars,
                                                              strict=False))
        if eqn.primitive.name in _DRAWS and shaped and not any(ins):
            return eqn, outer
        body, twin_body = _body(eqn), _body(other)
        if body is not None and twin_body is not None and \
                len(body.invars) == len(eqn.invars) == len(twin_body.invars):
            got = _draw_in(body, twin_body, ins, (*outer, eqn))
            if got is not None:
                return got
    return None


def _where(eqn, outer) -> str:
    """`` (at file:line)`` of ``eqn`` or the nearest call around it in the user's code, or
    nothing where unknown."""
    for e in (eqn, *reversed(outer)):
        frame = _user_frame(e)
        if frame is not None:
            return f" (at {frame.file_name}:{frame.start_line})"
    return ""


def _mixed(eqn, outer) -> str:
    where = _where(eqn, outer)
    return (f"the loss mixes samples: {eqn.primitive.name}{where} combines values of "
            f"different samples other than by summing them (batch statistics such as "
            f"nnx.BatchNorm's, in-batch negatives, a batch-wide normalisation)")


def _user_frame(eqn):
    """The user's source line of ``eqn`` (None where unknown: a location is a courtesy)."""
    try:
        from jax._src import source_info_util
        return source_info_util.user_frame(eqn.source_info.traceback)
    except Exception:  # noqa: BLE001
        return None


def _shape(v) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


def _rule(eqn, states: list, state_in: list) -> list:
    """The outputs' relation to the samples (see the module docstring); ``state_in``: per
    input, whether it reads the step's state."""
    name = eqn.primitive.name
    p = eqn.params
    n_out = len(eqn.outvars)
    axes = [int(s) for s in states if isinstance(s, Integral)]
    reduced = [s for s in states if isinstance(s, tuple)]
    if name in _UNARY or name in _BINARY:
        if axes and reduced:
            # A batch-wide value meets per-sample ones: the samples are mixed, unless
            # it scales them and reads the batch alone (a token count normalising a
            # masked loss: the pieces' ratios are averaged, as a masked mean's are).
            counts = all(not r for s, r in zip(states, state_in, strict=True)
                         if isinstance(s, tuple))
            if name in ("mul", "div") and counts and len(set(axes)) == 1 and \
                    not isinstance(states[1] if name == "div" else None, Integral):
                return [axes[0]] * n_out
            return [MIXED] * n_out
        if axes:
            if len(set(axes)) != 1:
                raise _Unknown(name)
            return [axes[0]] * n_out
        carried = _curved_of(reduced)
        if carried:
            return [carried] * n_out
        kinds = {r[1] for r in reduced}
        if name in ("add", "sub", "add_any", "neg", "convert_element_type", "copy",
                    "copy_p", "stop_gradient", "reduce_precision", "optimization_barrier"):
            return [("reduced", kinds.pop() if len(kinds) == 1 else "sum")] * n_out
        if _curves(name, states, state_in):
            return [CURVED] * n_out
        if name in ("mul", "div") and len(reduced) == 1:
            return [reduced[0]] * n_out  # scaled (a mean: the sum over the batch size)
        return [("reduced", "other")] * n_out
    if reduced:
        # anything else of a batch-wide value: still batch-wide unless it meets samples
        if axes:
            return [MIXED] * n_out
        carried = _curved_of(reduced)
        if carried:
            return [carried] * n_out
        if _curves(name, states, state_in):
            return [CURVED] * n_out
        kinds = {r[1] for r in reduced}
        if (name in _MOVES or name == "reduce_sum") and len(kinds) == 1:
            return [("reduced", kinds.pop())] * n_out  # sums stacked or added: sums
        return [("reduced", "other")] * n_out
    if name == "dot_general":
        return [_dot(eqn, states)]
    if name == "gather":
        return [_gather(eqn, states)]
    if len(set(axes)) != 1:
        raise _Unknown(name)
    a = axes[0]
    if name in _REDUCTIONS:
        red = tuple(p["axes"])
        if a in red:
            return [("reduced", _REDUCTIONS[name])] * n_out
        return [a - sum(1 for r in red if r < a)] * n_out
    if name in _SCANS:
        return [MIXED if p["axis"] == a else a] * n_out
    if name == "sort":
        return [MIXED if p["dimension"] == a else a] * n_out
    if name == "broadcast_in_dim":
        return [p["broadcast_dimensions"][a]]
    if name == "transpose":
        return [list(p["permutation"]).index(a)]
    if name == "squeeze":
        dims = tuple(p["dimensions"])
        if a in dims:
            raise _Unknown(name)
        return [a - sum(1 for d in dims if d < a)]
    if name == "reshape":
        old, new = _shape(eqn.invars[0]), tuple(p["new_sizes"])
        # samples stay the leading axis when it merges with the axes after it, or
        # splits back (sample-major rows)
        if a == 0 and new and old and (new[0] % old[0] == 0 or old[0] % new[0] == 0):
            return [0]
        if old[:a + 1] == new[:a + 1]:
            return [a]
        raise _Unknown(name)
    if name in ("slice", "dynamic_slice", "pad", "rev", "split"):
        src = _shape(eqn.invars[0])
        outs = [_shape(v) for v in eqn.outvars]
        if all(len(o) == len(src) and o[a] == src[a] for o in outs) and \
                (name != "rev" or a not in p["dimensions"]) and \
                (name != "pad" or tuple(p["padding_config"][a]) == (0, 0, 0)):
            if name == "dynamic_slice" and any(s is not None for s in states[1:]):
                raise _Unknown(name)
            return [a] * n_out
        return [MIXED] * n_out  # some samples picked or moved: they meet others
    if name == "concatenate":  # (a part that is not per sample is the same for each)
        if p["dimension"] == a:
            raise _Unknown(name)
        return [a]
    if name == "stack":  # a new axis before p["axis"]'s position
        return [a + 1 if p["axis"] <= a else a]
    if name == "top_k":  # the k largest along one axis: of each sample unless it is theirs
        return [MIXED if p.get("axis", len(_shape(eqn.invars[0])) - 1) == a else a] * n_out
    if name in _SCATTERS:
        return [_scatter(eqn, states)]
    if name in _WINDOWS:
        # pooling: a window of one sample along the samples' axis keeps them apart
        one = (p["window_dimensions"][a] == 1 and p["window_strides"][a] == 1 and
               tuple(p["padding"][a]) == (0, 0) and p["base_dilation"][a] == 1)
        if not one:
            return [MIXED] * n_out
        if any(s is not None for s in states[1:]):
            raise _Unknown(name)
        return [a] * n_out
    if name == "conv_general_dilated":
        dn = p["dimension_numbers"]
        if states[1] is not None or a != dn.lhs_spec[0]:
            raise _Unknown(name)
        return [dn.out_spec[0]]
    raise _Unknown(name)


# A batch-wide value of the parameters put through a non-linear function (a product of
# two batch means, as a mixture-of-experts load-balancing loss is; the exp of a mean
# loss): each piece of a cut batch would compute it from its own samples' reductions,
# and no weighting of the pieces gives the whole batch's. The third element: where.
CURVED = ("reduced", "curved", None)
# Non-linear functions of their operands (comparisons, floors and is_finite are left
# out: they guard or floor a value, as a NaN guard on the loss does, not reshape it).
_CURVING = ("exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos",
            "sqrt", "rsqrt", "cbrt", "abs", "integer_pow", "erf", "erfc", "erf_inv",
            "square", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh",
            "atanh", "lgamma", "digamma", "pow", "max", "min", "atan2", "rem",
            "reduce_max", "reduce_min", "reduce_prod", "cumprod", "cummax", "cummin",
            "cumlogsumexp", "sort", "argmax", "argmin", "logsumexp")


def _curves(name: str, states: list, state_in: list) -> bool:
    """Whether equation ``name`` puts a batch-wide value that reads the step's state
    (``state_in``) through a non-linear function (``CURVED``): a product or a dot of two
    such values, a division by one, or a function in ``_CURVING`` of one. A batch-wide
    value of the batch alone (a token count) may be floored, inverted or divided by: a
    masked mean's divisor (``normalized_outputs`` weighs the pieces by it)."""
    learned = [isinstance(s, tuple) and r for s, r in zip(states, state_in, strict=True)]
    if name in ("mul", "dot_general"):
        return sum(learned[:2]) == 2
    if name == "div":
        return learned[1]
    return name in _CURVING and any(learned)


def _curved_of(reduced: list):
    """The first ``CURVED`` value among ``reduced`` (what it reaches stays curved)."""
    return next((r for r in reduced if r[1] == "curved"), None)


def _scatter(eqn, states) -> object:
    """``x.at[idx].set(v)`` and its kin: the samples' axis of the result, where the
    indices read no sample and the samples' axis is one the scatter keeps whole (a
    window dimension), in the operand, the updates or both alike."""
    op, idx, upd = states[0], states[1], states[2]
    dn = eqn.params["dimension_numbers"]
    if idx is not None:
        if eqn.primitive.name in ("scatter-add", "scatter_add") and op is None and \
                isinstance(idx, Integral):
            # x.at[idx].add(v), idx per sample along a scatter dimension: each sample
            # adds its own terms (a count of tokens per expert): a sum over the samples
            ivd = len(_shape(eqn.invars[1])) - 1  # (JAX: the indices' last axis)
            # (a batched scatter's batch axis keeps the samples apart: not this rule)
            if idx != ivd and idx not in getattr(dn, "scatter_indices_batching_dims", ()):
                scatter_dims = [d for d in range(len(_shape(eqn.invars[2])))
                                if d not in dn.update_window_dims]
                pos = idx - (1 if idx > ivd else 0)
                if pos < len(scatter_dims) and upd in (None, scatter_dims[pos]):
                    return ("reduced", "sum")
        raise _Unknown(eqn.primitive.name)
    rank = len(_shape(eqn.invars[0]))
    window = [d for d in range(rank) if d not in dn.inserted_window_dims and
              d not in getattr(dn, "operand_batching_dims", ())]
    to_updates = dict(zip(window, dn.update_window_dims, strict=True))
    if op is not None:
        if op not in to_updates or upd not in (None, to_updates[op]):
            raise _Unknown(eqn.primitive.name)
        return op
    from_updates = {u: d for d, u in to_updates.items()}
    if upd not in from_updates:  # samples scattered to positions: they may meet
        raise _Unknown(eqn.primitive.name)
    return from_updates[upd]


def _dot(eqn, states) -> object:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    la, ra = states[0], states[1]
    lhs, rhs = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    if la is not None and ra is not None:
        if la in lb and ra in rb and list(lb).index(la) == list(rb).index(ra):
            return list(lb).index(la)  # the samples are a batch dimension of the product
        if la in lc and ra in rc and list(lc).index(la) == list(rc).index(ra):
            return ("reduced", "sum")
        return MIXED  # sample against sample: an in-batch similarity
    if la is not None:
        if la in lc:
            return ("reduced", "sum")
        if la in lb:
            return list(lb).index(la)
        return len(lb) + lfree.index(la)
    if ra in rc:
        return ("reduced", "sum")
    if ra in rb:
        return list(rb).index(ra)
    return len(lb) + len(lfree) + rfree.index(ra)


def _gather(eqn, states) -> object:
    op, idx = states[0], states[1]
    dn = eqn.params["dimension_numbers"]
    out_rank = len(_shape(eqn.outvars[0]))
    offset = list(dn.offset_dims)
    batch_positions = [d for d in range(out_rank) if d not in offset]
    idx_rank = len(_shape(eqn.invars[1]))
    ivd = idx_rank - 1  # jnp's gathers keep the index vector last
    idx_batch = [d for d in range(idx_rank) if d != ivd]
    if idx is not None:
        if idx == ivd:
            raise _Unknown("gather")
        out = batch_positions[idx_batch.index(idx)]
        if op is None:
            return out
        # rows of a per-sample operand picked by per-sample indices of the same sample
        ob = tuple(getattr(dn, "operand_batching_dims", ()))
        ib = tuple(getattr(dn, "start_indices_batching_dims", ()))
        if op in ob and idx in ib and ob.index(op) == ib.index(idx):
            return out
        raise _Unknown("gather")
    # a per-sample operand, indices that are not: a slice of every sample
    if op in dn.collapsed_slice_dims or op in dn.start_index_map:
        raise _Unknown("gather")
    kept = [d for d in range(len(_shape(eqn.invars[0])))
            if d not in dn.collapsed_slice_dims and
            d not in getattr(dn, "operand_batching_dims", ())]
    return offset[kept.index(op)]
