"""The attention rewrite: swap every attention op of a function for the plan's choice.

``swap_attention(fn, "flash")`` returns a function that traces ``fn`` to a jaxpr and
evaluates it equation by equation, except that each attention call is computed by the
chosen implementation:

* ``hetshard.nn.attention`` calls, found by name (``hetshard_attention[_causal]`` jit
  equations with operands ``q, k, v[, segment_ids], scale``);
* the einsum-softmax-einsum pattern of Flax-style attention
  (``nnx.dot_product_attention``, ``nnx.MultiHeadAttention``, hand-written einsums): a
  ``dot_general`` of q and k, a scale, an optional ``where(mask, logits, -big)`` whose
  mask ``hetshard.ir.masks`` reads as causal and/or a segment mask, a softmax and a
  ``dot_general`` with v, back in q's layout. Other masks, dropout on the weights, or
  weights used elsewhere do not match and are left as they are.

Calls that contain attention (``jit``, ``remat``, custom-derivative wrappers) are
inlined so the swap reaches inside them, and a ``scan`` over blocks is re-run with its
body swapped; everything else is re-bound unchanged. The
rewrite is applied before differentiation: ``jax.grad(swap_attention(loss))`` uses the
kernel's own backward pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hetshard.errors import SpecError
from hetshard.ir.interpret import evaluate_jaxpr
from hetshard.kernel_choice import Hardware, Pattern, resolve
from hetshard.kernels.dot_product import dot_product_attention
from hetshard.kernels.flash_attention import flash_attention
from hetshard.kernels.reference import attention_reference
from hetshard.kernels.ring_attention import (
    context_parallel_attention,
    device_token_ids,
    ring_attention,
)
from hetshard.layout import attention_layout
from hetshard.meshes import laid_out

IMPLEMENTATIONS = ("auto", "cudnn", "reference", "flash", "ring")


def _hardware(mesh) -> Hardware:
    """What runs the call: the stage mesh's devices, else the default backend's."""
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    return Hardware.of_device(device)


# ---- the Flax pattern ---------------------------------------------------------------


# ---- evaluation ---------------------------------------------------------------------

def _impl(name: str, *, mesh=None, axis="context", chunk_lengths=None, zigzag=True,
          sequence=None, resolved=False, **kernel):
    if name not in IMPLEMENTATIONS:
        raise SpecError("impl", name, f"one of {IMPLEMENTATIONS}", where="swap_attention")
    if name == "ring" and mesh is None:
        raise SpecError("mesh", None, "a Mesh with a context axis for ring attention",
                        where="swap_attention")

    def run(q, k, v, seg, scale, causal):
        if name in ("auto", "cudnn") and not resolved:
            impl = resolve(name, _hardware(mesh), Pattern.of(q, k, seg, causal),
                           where="swap_attention")
            return _impl(impl, mesh=mesh, axis=axis, chunk_lengths=chunk_lengths,
                         zigzag=zigzag, sequence=sequence, resolved=True,
                         **kernel)(q, k, v, seg, scale, causal)
        if name != "ring" and mesh is not None and mesh.shape.get(axis, 1) > 1 and \
                (sequence is None or q.shape[1] == sequence):
            # A stage with a context axis: its activations are split along the sequence.
            return _ring_on_mesh(mesh, axis, q, k, v, seg, scale, causal, zigzag, kernel,
                                 chunk_lengths)
        if name == "cudnn":
            if mesh is not None:
                extra = (axis,) if mesh.shape.get(axis, 1) > 1 else ()
                return _flash_on_mesh(mesh, q, k, v, seg, scale, causal, {}, extra,
                                      attend=dot_product_attention)
            return dot_product_attention(q, k, v, causal=causal, segment_ids=seg,
                                         sm_scale=scale)
        if name == "flash" and mesh is not None and mesh.shape.get(axis, 1) > 1:
            # Attention over other lengths (a vision encoder's patches) is not split
            # along the sequence: its samples are split over the context axis too.
            return _flash_on_mesh(mesh, q, k, v, seg, scale, causal, kernel, (axis,))
        if name == "reference":
            return attention_reference(q, k, v, causal=causal, segment_ids=seg,
                                       sm_scale=scale)
        if name == "flash":
            if mesh is not None:
                return _flash_on_mesh(mesh, q, k, v, seg, scale, causal, kernel)
            return flash_attention(q, k, v, causal=causal, segment_ids=seg, sm_scale=scale,
                                   **kernel)
        return context_parallel_attention(q, k, v, mesh, axis, causal=causal,
                                          segment_ids=seg, chunk_lengths=chunk_lengths,
                                          sm_scale=scale, **kernel)
    return run


def _flash_on_mesh(mesh, q, k, v, seg, scale, causal, kernel, extra=(),
                   attend=flash_attention):
    """The flash kernel (or ``attend``, cuDNN's) on each device's samples and heads
    (``jax.shard_map``; samples over the batch axes and ``extra``). XLA's partitioner
    cannot split a Pallas call: left to it, every device of a stage would gather the
    whole micro-batch's q, k and v and compute attention for all of it."""
    from jax.sharding import PartitionSpec as P

    batch, heads = attention_layout(mesh, q.shape, k.shape[2], extra)
    if batch is None and heads is None:
        return attend(q, k, v, causal=causal, segment_ids=seg, sm_scale=scale, **kernel)
    spec = P(batch, None, heads, None)

    def body(q, k, v, *seg):
        return attend(q, k, v, causal=causal, segment_ids=seg[0] if seg else None,
                      sm_scale=scale, **kernel)
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


def attention_runner(impl: str = "flash", **options):
    """The attention implementation ``eval_equations`` calls: ``run(q, k, v, segment_ids,
    scale, causal)`` (see ``swap_attention`` for the options)."""
    return _impl(impl, **options)


def swap_attention(fn, impl: str = "flash", **options):
    """``fn`` with its attention computed by ``impl``: "auto" (per call, the fastest
    implementation that computes it on the devices that run it,
    ``hetshard.kernel_choice``), "cudnn", "flash", "reference" or "ring".

    ``options`` go to the implementation: kernel tile sizes and ``interpret`` for flash,
    and a ``mesh`` to run it on each device's samples and heads (``attention_layout``);
    ``mesh``, ``axis`` and ``chunk_lengths`` for ring attention; on a mesh with a
    context axis, ``sequence``: the length split along it (None: every attention's), so
    that attention over other lengths (a vision encoder's patches) is left whole.
    """
    run = _impl(impl, **options)

    @functools.wraps(fn)
    def wrapped(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = jax.tree.leaves(args)
        outs = evaluate_jaxpr(closed.jaxpr, closed.consts, flat, run)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return wrapped
