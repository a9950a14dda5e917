"""Collective matmuls: a tensor-parallel matmul and its sequence-parallel collective as
one ring, so each step's transfer runs while the previous step's block is multiplied
(the decomposition of Wang et al., ASPLOS'23, as in XLA's windowed einsums and
Megatron-LM's ``--tp-comm-overlap``).

Both act on activations ``[batch, seq, ...]`` split along ``seq`` over the mesh's
``tensor`` axis (sequence parallelism) and a weight split over ``tensor``:

* ``allgather_matmul`` (a column-parallel weight, split along a free dimension): each
  device multiplies the sequence block it holds, passes it to the next device and
  takes the previous one's, ``tp`` steps; the result has every sequence position and
  the device's columns. The gathered input is not kept for the backward pass: the
  backward's ring passes the blocks again (Megatron's re-gather).
* ``matmul_reducescatter`` (a row-parallel weight, split along a contracting
  dimension): the partial sums for one sequence block travel the ring, each device
  adding its own, so each device ends with its block's full sum.

Their gradients are rings too (``jax.custom_vjp``), overlapping the same way: for the
all-gather matmul, a reduce-scatter ring of the input's cotangent and, in its own
``shard_map`` (ZB-H1's W pass can defer it), the input's blocks passed around again for
the weights' cotangents; for the reduce-scatter matmul, one all-gather ring of the
output's cotangent serving both gradients. ``dot(lhs, rhs)`` is the matmul (``lax.dot_general``
with the caller's dimension numbers, which must keep ``lhs``'s dimensions 0 and 1 as
the output's 0 and 1). On a mesh the transfers are ``ppermute`` steps XLA can run
asynchronously next to the independent block matmuls; on one CPU they simply run in
order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from hetshard._plan import spec_axes
from hetshard.meshes import laid_out

AXIS = "tensor"


def _ring(tp: int):
    return [(j, (j + 1) % tp) for j in range(tp)]


def _shard(body, mesh: Mesh, in_specs, out_specs):
    run = jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                        check_vma=False)

    def call(*args):  # inputs laid out as in_specs (required on an Explicit mesh)
        return run(*(laid_out(a, mesh, s) for a, s in zip(args, in_specs, strict=True)))
    return call


def _slice(x, j, block):
    return jax.lax.dynamic_slice_in_dim(x, j * block, block, axis=1)


def _summed(dw, x_spec, w_spec):
    """A weight's cotangent summed over the axes that split the samples but not the
    weight (the data axes): each device computed its samples' part."""
    axes = tuple(sorted(spec_axes(x_spec) - spec_axes(w_spec) - {AXIS}))
    return jax.lax.psum(dw, axes) if axes else dw


def _lhs_grad(dot, a, w, ct):
    """The cotangent of ``a`` in ``dot(a, w)`` (the matmul is linear in ``a``: no primal
    evaluated)."""
    like = jax.ShapeDtypeStruct(a.shape, a.dtype)
    return jax.linear_transpose(lambda a: dot(a, w), like)(ct)[0]


def _rhs_grad(dot, a, w, ct):
    like = jax.ShapeDtypeStruct(w.shape, w.dtype)
    return jax.linear_transpose(lambda w: dot(a, w), like)(ct)[0]


def _reduce_scatter_ring(parts, tp: int):
    """``sum over devices of parts(j)`` left on device j (``parts(j)``: this device's
    contribution to sequence block j): the running sum for block idx - step - 1 travels
    one device on per step, each adding its own; the last is the device's own block."""
    idx = jax.lax.axis_index(AXIS)
    acc = None
    for step in range(tp):
        part = parts((idx - step - 1) % tp)
        acc = part if acc is None else jax.lax.ppermute(acc, AXIS, _ring(tp)) + part
    return acc


def _all_gather_ring(x, use, tp: int):
    """Calls ``use(src, block)`` for every device's block of ``x`` (dimension 1), the
    blocks passed around the ring, one transfer next to each use."""
    idx = jax.lax.axis_index(AXIS)
    held = x
    for step in range(tp):
        use((idx - step) % tp, held)
        if step < tp - 1:
            held = jax.lax.ppermute(held, AXIS, _ring(tp))


def allgather_matmul(x, ws, dots, mesh: Mesh, x_spec: PartitionSpec, w_specs, out_specs):
    """``[dot(x, w) for w, dot in zip(ws, dots)]`` for ``x`` split along dimension 1 over
    ``tensor`` (``x_spec``) and each ``w`` split over ``tensor`` along a free dimension
    (``w_specs``); the results laid out as ``out_specs`` (whole sequence, the weight's
    split carried to the output). The matmuls sharing the input share one ring (q, k
    and v; up and gate).

    The backward is two rings in two ``shard_map`` calls: the input's cotangent
    (partial sums reduce-scattered block by block) and the weights' (the input's blocks
    passed around again, not kept from the forward), so a zero-bubble schedule can defer
    the second to its W pass."""
    tp = mesh.shape[AXIS]
    n = len(ws)

    def forward(x, *ws):
        block = x.shape[1]
        got = []
        _all_gather_ring(x, lambda src, held: got.append(
            (src, [dot(held, w) for w, dot in zip(ws, dots, strict=True)])), tp)
        outs = []
        for k, first in enumerate(got[0][1]):
            out = jnp.zeros(first.shape[:1] + (block * tp,) + first.shape[2:], first.dtype)
            for src, parts in got:
                out = jax.lax.dynamic_update_slice_in_dim(out, parts[k], src * block, axis=1)
            outs.append(out)
        return tuple(outs)

    def input_grad(x_like, *args):
        ws, cts = args[:n], args[n:]
        block = cts[0].shape[1] // tp
        return _reduce_scatter_ring(lambda j: sum(
            _lhs_grad(dot, x_like, w, _slice(ct, j, block))
            for w, ct, dot in zip(ws, cts, dots, strict=True)), tp)

    def weight_grads(x, *args):
        ws, cts = args[:n], args[n:]
        block = x.shape[1]
        acc = [jnp.zeros_like(w) for w in ws]

        def use(src, held):
            for k, (w, ct, dot) in enumerate(zip(ws, cts, dots, strict=True)):
                acc[k] = acc[k] + _rhs_grad(dot, held, w, _slice(ct, src, block))
        _all_gather_ring(x, use, tp)
        return tuple(_summed(a, x_spec, spec) for a, spec in zip(acc, w_specs, strict=True))

    @jax.custom_vjp
    def run(x, *ws):
        return _shard(forward, mesh, (x_spec, *w_specs), tuple(out_specs))(x, *ws)

    def run_fwd(x, *ws):
        return run(x, *ws), (x, ws)

    def run_bwd(res, cts):
        x, ws = res
        dx = _shard(input_grad, mesh, (x_spec, *w_specs, *out_specs), x_spec)(x, *ws, *cts)
        dws = _shard(weight_grads, mesh, (x_spec, *w_specs, *out_specs),
                     tuple(w_specs))(x, *ws, *cts)
        return (dx, *dws)
    run.defvjp(run_fwd, run_bwd)
    return list(run(x, *ws))


def matmul_reducescatter(x, w, dot, mesh: Mesh, x_spec: PartitionSpec,
                         w_spec: PartitionSpec, out_spec: PartitionSpec):
    """``dot(x, w)`` summed over ``tensor`` (``x`` and ``w`` split along a contracting
    dimension, ``x_spec`` / ``w_spec``) and left split along dimension 1 over ``tensor``
    (``out_spec``): a reduce-scatter of the partial sums, block by block.

    The backward is one all-gather ring of the output's cotangent, each block used for
    both the input's and the weight's cotangent (passing it around twice to defer the
    weight's to a zero-bubble W pass would double the transfers)."""
    tp = mesh.shape[AXIS]

    def forward(x, w):
        block = x.shape[1] // tp
        return _reduce_scatter_ring(lambda j: dot(_slice(x, j, block), w), tp)

    def grads(x, w, ct):
        block = ct.shape[1]
        dx, dw = jnp.zeros_like(x), jnp.zeros_like(w)

        def use(src, held):
            nonlocal dx, dw
            part = _lhs_grad(dot, _slice(x, src, block), w, held)
            dx = jax.lax.dynamic_update_slice_in_dim(dx, part, src * block, axis=1)
            dw = dw + _rhs_grad(dot, _slice(x, src, block), w, held)
        _all_gather_ring(ct, use, tp)
        return dx, _summed(dw, x_spec, w_spec)

    @jax.custom_vjp
    def run(x, w):
        return _shard(forward, mesh, (x_spec, w_spec), out_spec)(x, w)

    def run_fwd(x, w):
        return run(x, w), (x, w)

    def run_bwd(res, ct):
        x, w = res
        return _shard(grads, mesh, (x_spec, w_spec, out_spec), (x_spec, w_spec))(x, w, ct)
    run.defvjp(run_fwd, run_bwd)
    return run(x, w)
