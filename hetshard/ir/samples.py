"""Does a loss treat its samples one by one? (Which plans can cut its batch.)

Plans that cut the global batch (micro-batches, pipelines with batch shares) run the
loss on each piece and add the pieces' values weighted by their share of the batch.
That equals the whole batch's loss when the loss is a mean of per-sample values (plus
anything that does not read the batch), and its outputs likewise. It does not when the
loss *mixes samples*: a value reduced over the batch is used again per sample (batch
statistics, ``nnx.BatchNorm``; in-batch negatives of a contrastive loss; a batch-wide
normalisation), an output is a maximum or minimum over the batch (a weighted sum of
the pieces' maxima is not the batch's maximum), or an output keeps a value per sample
(logits returned as aux: each piece would return only its own samples'). A
per-sample value scaled by a sum that reads the batch alone (a token count normalising
a masked loss) is not counted as mixing: like a masked mean (a ratio of two batch
sums), the pieces' values are averaged, which is exact when the pieces hold equal
counts.

:func:`sample_coupling` follows the batch axis through the loss's jaxpr: each value is
per sample along one axis (the batch leaves' leading axis to start), independent of
the samples, reduced over the samples (how: ``sum``, ``max``, ``min``), or mixed. It
answers only where it understands every equation the samples reach; an equation it does
not know (a ``while`` loop over the samples, a primitive not listed here) makes it give
no answer (None), never a false alarm.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

from jax.extend import core as ext

from hetshard.ir.dependencies import _body

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


class _Unknown(Exception):  # noqa: N818 (control flow inside this module)
    pass


def sample_coupling(closed, batch_inputs: Sequence[int]) -> str | None:
    """Why cutting the batch changes ``closed``'s outputs (a ClosedJaxpr of the loss whose
    inputs at ``batch_inputs`` are batch leaves, samples along axis 0), or None: the
    loss treats its samples one by one, or the analysis cannot tell."""
    try:
        outs, why = _relations(closed, batch_inputs)
    except _Unknown:
        return None
    if why:
        return why
    for k, o in enumerate(outs):
        if isinstance(o, int):
            return (f"output {k} of the loss holds a value per sample (per-sample values "
                    f"such as logits returned as aux: each piece of a cut batch would "
                    f"return only its own; return means over the batch, or reduce the "
                    f"metric inside the loss, to let the batch be cut)")
        if isinstance(o, tuple) and o[1] in ("max", "min", "arg"):
            name = {"max": "maximum", "min": "minimum", "arg": "arg-max or arg-min"}[o[1]]
            return (f"output {k} of the loss is a {name} over the batch (the pieces of a "
                    f"cut batch would be averaged)")
    return None


def per_sample_outputs(closed, batch_inputs: Sequence[int]) -> list[int]:
    """The outputs of ``closed`` that hold a value per sample (a batch axis), where the
    analysis can tell: a cut batch cannot even give them their shape."""
    try:
        outs, why = _relations(closed, batch_inputs)
    except _Unknown:
        return []
    return [] if why else [k for k, o in enumerate(outs) if isinstance(o, int)]


def _relations(closed, batch_inputs):
    jaxpr = closed.jaxpr
    batch = set(batch_inputs)
    start = [0 if i in batch else None for i in range(len(jaxpr.invars))]
    reads = [i not in batch for i in range(len(jaxpr.invars))]
    return _walk(jaxpr, start, reads)


def _walk(jaxpr, ins: list, reads_in: list, outer=()) -> tuple[list, str | None]:
    """The outputs' relation to the samples, or why the samples mix. ``reads_in``: per
    input, whether it reads the step's state (parameters) rather than the batch alone;
    ``outer``: the call equations this jaxpr is the body of (where to point when its own
    equations have no location in the user's code)."""
    env: dict = {}
    reads: dict = {}
    for v in jaxpr.constvars:
        env[v], reads[v] = None, False
    for v, s, r in zip(jaxpr.invars, ins, reads_in, strict=True):
        env[v], reads[v] = s, r

    def read(v):
        return None if isinstance(v, ext.Literal) else env.get(v)

    def reading(v):
        return False if isinstance(v, ext.Literal) else reads.get(v, False)

    for eqn in jaxpr.eqns:
        states = [read(v) for v in eqn.invars]
        state_in = [reading(v) for v in eqn.invars]
        for v in eqn.outvars:  # (conservative for calls: any input's)
            reads[v] = any(state_in)
        if all(s is None for s in states):
            for v in eqn.outvars:
                env[v] = None
            continue
        if MIXED in states:
            return [], _mixed(eqn, outer)
        body = _body(eqn)
        if body is not None and len(body.invars) == len(states):
            outs, why = _walk(body, states, state_in, (*outer, eqn))
            if why:
                return [], why
        else:
            # axes as Python ints (params hold numpy integers)
            outs = [int(o) if isinstance(o, Integral) else o
                    for o in _rule(eqn, states, state_in)]
        if MIXED in outs:
            return [], _mixed(eqn, outer)
        for v, s in zip(eqn.outvars, outs, strict=True):
            env[v] = s
    return [read(v) for v in jaxpr.outvars], None


def _mixed(eqn, outer) -> str:
    where = ""
    for e in (eqn, *reversed(outer)):
        frame = _user_frame(e)
        if frame is not None:
            where = f" (at {frame.file_name}:{frame.start_line})"
            break
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
        kinds = {r[1] for r in reduced}
        if name in ("add", "sub", "add_any", "neg", "convert_element_type", "copy",
                    "copy_p", "stop_gradient", "reduce_precision", "optimization_barrier"):
            return [("reduced", kinds.pop() if len(kinds) == 1 else "sum")] * n_out
        if name in ("mul", "div") and len(reduced) == 1:
            return [reduced[0]] * n_out  # scaled (a mean: the sum over the batch size)
        return [("reduced", "other")] * n_out
    if reduced:
        # anything else of a batch-wide value: still batch-wide unless it meets samples
        if axes:
            return [MIXED] * n_out
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
    if name == "conv_general_dilated":
        dn = p["dimension_numbers"]
        if states[1] is not None or a != dn.lhs_spec[0]:
            raise _Unknown(name)
        return [dn.out_spec[0]]
    raise _Unknown(name)


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
