"""The attention rewrite: swap every attention op of a function for the plan's choice.

``swap_attention(fn, "flash")`` returns a function that traces ``fn`` to a jaxpr and
evaluates it equation by equation, except that each attention call is computed by the
chosen implementation:

* ``hetshard.nn.attention`` calls, found by name (``hetshard_attention[_causal]`` jit
  equations with operands ``q, k, v[, segment_ids], scale``);
* the einsum-softmax-einsum pattern of unmodified Flax attention
  (``nnx.dot_product_attention``, used by ``nnx.MultiHeadAttention``): a
  ``dot_general`` of q and k, a scale, a softmax and a ``dot_general`` with v, back in
  q's layout. Masked Flax attention (a ``select_n`` on the logits), dropout on the
  weights, or weights used elsewhere do not match and are left as they are.

Calls that contain attention (``jit``, ``remat``, custom-derivative wrappers) are
inlined so the swap reaches inside them; everything else is re-bound unchanged. The
rewrite is applied before differentiation: ``jax.grad(swap_attention(loss))`` uses the
kernel's own backward pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore
from jax._src import source_info_util
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


# ---- evaluation ---------------------------------------------------------------------

def _impl(name: str, *, mesh=None, axis="context", chunk_lengths=None, zigzag=True,
          **kernel):
    if name not in IMPLEMENTATIONS:
        raise SpecError("impl", name, f"one of {IMPLEMENTATIONS}", where="swap_attention")
    if name == "ring" and mesh is None:
        raise SpecError("mesh", None, "a Mesh with a context axis for ring attention",
                        where="swap_attention")

    def run(q, k, v, seg, scale, causal):
        if name != "ring" and mesh is not None and mesh.shape.get(axis, 1) > 1:
            # A stage with a context axis: its activations are split along the sequence.
            return _ring_on_mesh(mesh, axis, q, k, v, seg, scale, causal, zigzag, kernel,
                                 chunk_lengths)
        if name == "reference":
            from hetshard.kernels.reference import attention_reference
            return attention_reference(q, k, v, causal=causal, segment_ids=seg,
                                       sm_scale=scale)
        if name == "flash":
            from hetshard.kernels.flash_attention import flash_attention
            if mesh is not None:
                return _flash_on_mesh(mesh, q, k, v, seg, scale, causal, kernel)
            return flash_attention(q, k, v, causal=causal, segment_ids=seg, sm_scale=scale,
                                   **kernel)
        from hetshard.kernels.ring_attention import context_parallel_attention
        return context_parallel_attention(q, k, v, mesh, axis, causal=causal,
                                          segment_ids=seg, chunk_lengths=chunk_lengths,
                                          sm_scale=scale, **kernel)
    return run


def attention_layout(mesh, q_shape, kv_heads: int):
    """``(batch axes or None, heads axis or None)``: how attention splits over a stage
    mesh, each sample and head being independent. The batch goes over the data axes
    (``data``, then ``fsdp``) as far as their product divides it; the heads over
    ``tensor`` when it divides the query and the key/value heads (grouped-query
    attention keeps each key/value head with its queries)."""
    b, h = q_shape[0], q_shape[2]
    batch, ways = [], 1
    for a in ("data", "fsdp"):
        n = mesh.shape.get(a, 1)
        if n > 1 and b % (ways * n) == 0:
            batch.append(a)
            ways *= n
    tp = mesh.shape.get("tensor", 1)
    heads = "tensor" if tp > 1 and h % tp == 0 and kv_heads % tp == 0 else None
    return (tuple(batch) or None), heads


def _flash_on_mesh(mesh, q, k, v, seg, scale, causal, kernel):
    """The flash kernel on each device's samples and heads (``jax.shard_map``). XLA's
    partitioner cannot split a Pallas call: left to it, every device of a stage would
    gather the whole micro-batch's q, k and v and compute attention for all of it."""
    from jax.sharding import PartitionSpec as P

    from hetshard.kernels.flash_attention import flash_attention
    batch, heads = attention_layout(mesh, q.shape, k.shape[2])
    if batch is None and heads is None:
        return flash_attention(q, k, v, causal=causal, segment_ids=seg, sm_scale=scale,
                               **kernel)
    spec = P(batch, None, heads, None)

    def body(q, k, v, *seg):
        return flash_attention(q, k, v, causal=causal, segment_ids=seg[0] if seg else None,
                               sm_scale=scale, **kernel)
    from hetshard.meshes import laid_out
    args, specs = (q, k, v), (spec,) * 3
    if seg is not None:
        args, specs = args + (seg,), specs + (P(batch, None),)
    args = tuple(laid_out(a, mesh, s) for a, s in zip(args, specs, strict=True))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec,
                         check_vma=False)(*args)


def _ring_on_mesh(mesh, axis, q, k, v, seg, scale, causal, zigzag, kernel,
                  chunk_lengths=None):
    """Ring attention over the stage mesh's ``axis`` on sequence-split q, k, v: each
    device attends its own chunk (zigzag order for causal masks: the sequence is
    permuted into device order first, and the output back), its samples over the data
    axes and its heads over ``tensor`` as ``_flash_on_mesh`` splits them. The ring's
    backward is its own (O(1) chunks per device). ``chunk_lengths`` (per device, in
    mesh order; default equal): uneven chunks, each padded to the longest (padding
    slots get position -1, which the ring masks), so a faster device attends more of the
    sequence; the layers around attention keep their even split."""
    from jax.sharding import PartitionSpec as P

    from hetshard.kernels.ring_attention import device_token_ids, ring_attention
    from hetshard.meshes import laid_out
    n, s = mesh.shape[axis], q.shape[1]
    chunks = [s // n] * n if chunk_lengths is None else [int(c) for c in chunk_lengths]
    if len(chunks) != n or sum(chunks) != s or min(chunks) < 1:
        raise SpecError("chunk_lengths", chunk_lengths,
                        f"{n} positive lengths summing to the sequence length {s}",
                        where="context-parallel attention")
    if chunk_lengths is None and s % n:
        raise SpecError("seq_len", s, f"a multiple of the context degree {n}",
                        where="context-parallel attention")
    batch, heads = attention_layout(mesh, q.shape, k.shape[2])
    zig = bool(zigzag and causal)
    ids = device_token_ids(s, chunks, zig)
    width = max(chunks)
    gather = np.zeros((n, width), np.int64)  # padded slot -> token (padding: token 0)
    pos = np.full((n, width), -1, np.int32)
    for i, t in enumerate(ids):
        gather[i, :len(t)] = t
        pos[i, :len(t)] = t
    order = gather.reshape(-1)
    moved = zig or len(set(chunks)) > 1
    if moved:  # device i's tokens (zigzag: the i-th piece from the front and the back)
        q, k, v = (jnp.take(x, jnp.asarray(order), axis=1) for x in (q, k, v))
        seg = None if seg is None else jnp.take(seg, jnp.asarray(order), axis=1)
    positions = jnp.broadcast_to(jnp.asarray(pos.reshape(-1)), (q.shape[0], n * width))
    spec, tokens = P(batch, axis, heads, None), P(batch, axis)

    def body(q, k, v, pos, *seg):
        return ring_attention(q, k, v, axis_name=axis, axis_size=n, causal=causal,
                              q_positions=pos, kv_positions=pos,
                              segment_ids=seg[0] if seg else None, sm_scale=scale, **kernel)
    args, specs = (q, k, v, positions), (spec, spec, spec, tokens)
    if seg is not None:
        args, specs = args + (seg,), specs + (tokens,)
    args = tuple(laid_out(a, mesh, sp) for a, sp in zip(args, specs, strict=True))
    out = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec,
                        check_vma=False)(*args)
    if moved:
        slot = np.empty(s, np.int64)  # token -> its padded slot
        for i, t in enumerate(ids):
            slot[t] = i * width + np.arange(len(t))
        out = jnp.take(out, jnp.asarray(slot), axis=1)
    return out


def _eval(jaxpr, consts, args, run, autocast=None):
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    eval_equations(jaxpr, env, run, autocast=autocast)
    return [v.val if isinstance(v, ext.Literal) else env[v] for v in jaxpr.outvars]


@functools.cache
def _patterns_of(jaxpr):
    return {p["end"]: p for p in _softmax_patterns(jaxpr)}


def skipped_equations(jaxpr) -> set[int]:
    """Equations ``eval_equations`` never runs: the inside of a recognised attention
    pattern, whose last equation computes it all."""
    patterns = _patterns_of(jaxpr)
    return set().union(*[p["skip"] for p in patterns.values()]) if patterns else set()


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
_INLINE_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat", "checkpoint",
                 "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


@functools.cache
def _has_matmul(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in MATMUL_PRIMITIVES:
            return True
        inner = _inner(eqn)
        if inner is not None and eqn.primitive.name in _INLINE_CALLS and \
                _has_matmul(inner[0]):
            return True
    return False


def _autocast_in(x, autocast):
    """``x`` in the autocast's compute dtype when it holds the program's."""
    return x.astype(autocast[1]) if jnp.result_type(x) == autocast[0] else x


def eval_equations(jaxpr, env: dict, run, indices=None, constrain=None,
                   autocast=None) -> None:
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
    stage on a GPU without bfloat16 tensor cores, ``Plan.gpu_dtypes``)."""
    def read(v):
        return v.val if isinstance(v, ext.Literal) else env[v]

    patterns = _patterns_of(jaxpr) if run is not None else {}
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
                env[var] = val


def _evaluate(eqn, idx, read, run, patterns, constrain, autocast=None) -> list:
    """One equation's outputs (see ``eval_equations``)."""
    causal = _attention_call(eqn) if run is not None else None
    if autocast is not None and run is not None:
        run = _autocast_run(run, autocast)
    invals = [] if idx in patterns else [read(v) for v in eqn.invars]
    replace = constrain.get(eqn.outvars[0]) if constrain and eqn.outvars else None
    if isinstance(replace, Replace):
        outs = replace.fn(*(invals if replace.reads is None else
                            [read(v) for v in replace.reads]))
    elif idx in patterns:
        pat = patterns[idx]
        out = run(read(pat["q"]), read(pat["k"]), read(pat["v"]), None, pat["scale"],
                  False)
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
        if run is not None and inner is not None and _contains(inner[0]):
            outs = _eval(inner[0], inner[1], invals, run, autocast)
        elif autocast is not None and inner is not None and \
                eqn.primitive.name in _INLINE_CALLS and _has_matmul(inner[0]):
            outs = _eval(inner[0], inner[1], invals, run, autocast)
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


def attention_runner(impl: str = "flash", **options):
    """The attention implementation ``eval_equations`` calls: ``run(q, k, v, segment_ids,
    scale, causal)`` (see ``swap_attention`` for the options)."""
    return _impl(impl, **options)


def swap_attention(fn, impl: str = "flash", **options):
    """``fn`` with its attention computed by ``impl`` ("reference", "flash" or "ring").

    ``options`` go to the implementation: kernel tile sizes and ``interpret`` for flash,
    and a ``mesh`` to run it on each device's samples and heads (``attention_layout``);
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
