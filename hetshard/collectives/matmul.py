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

Their gradients are JAX's transposes of the rings (a reduce-scatter ring for the
all-gather's input, an all-gather ring for the reduce-scatter's output), so the
backward overlaps the same way. ``dot(lhs, rhs)`` is the matmul (``lax.dot_general``
with the caller's dimension numbers, which must keep ``lhs``'s dimensions 0 and 1 as
the output's 0 and 1). On a mesh the transfers are ``ppermute`` steps XLA can run
asynchronously next to the independent block matmuls; on one CPU they simply run in
order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

AXIS = "tensor"


def _ring(tp: int):
    return [(j, (j + 1) % tp) for j in range(tp)]


def allgather_matmul(x, ws, dots, mesh: Mesh, x_spec: PartitionSpec, w_specs, out_specs):
    """``[dot(x, w) for w, dot in zip(ws, dots)]`` for ``x`` split along dimension 1 over
    ``tensor`` (``x_spec``) and each ``w`` split over ``tensor`` along a free dimension
    (``w_specs``); the results laid out as ``out_specs`` (whole sequence, the weight's
    split carried to the output). The matmuls sharing the input share one ring (q, k
    and v; up and gate)."""
    tp = mesh.shape[AXIS]

    def body(x, *ws):
        idx = jax.lax.axis_index(AXIS)
        block = x.shape[1]
        parts = []
        held = x
        for step in range(tp):
            parts.append(((idx - step) % tp,
                          [dot(held, w) for w, dot in zip(ws, dots, strict=True)]))
            if step < tp - 1:
                held = jax.lax.ppermute(held, AXIS, _ring(tp))
        outs = []
        for k, first in enumerate(parts[0][1]):
            out = jnp.zeros(first.shape[:1] + (block * tp,) + first.shape[2:], first.dtype)
            for src, got in parts:
                out = jax.lax.dynamic_update_slice_in_dim(out, got[k], src * block, axis=1)
            outs.append(out)
        return tuple(outs)

    # The blocks received are recomputed by the backward's ring, not kept: the input
    # stays stored split along the sequence, as sequence parallelism prices it.
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    return list(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, *w_specs),
                              out_specs=tuple(out_specs), check_vma=False)(x, *ws))


def matmul_reducescatter(x, w, dot, mesh: Mesh, x_spec: PartitionSpec,
                         w_spec: PartitionSpec, out_spec: PartitionSpec):
    """``dot(x, w)`` summed over ``tensor`` (``x`` and ``w`` split along a contracting
    dimension, ``x_spec`` / ``w_spec``) and left split along dimension 1 over ``tensor``
    (``out_spec``): a reduce-scatter of the partial sums, block by block."""
    tp = mesh.shape[AXIS]

    def body(x, w):
        idx = jax.lax.axis_index(AXIS)
        block = x.shape[1] // tp
        acc = None
        for step in range(tp):
            # Step ``step`` adds this device's part of block idx - step - 1 (mod tp) to
            # the running sum received from the previous device; the last is its own.
            j = (idx - step - 1) % tp
            part = dot(jax.lax.dynamic_slice_in_dim(x, j * block, block, axis=1), w)
            acc = part if acc is None else jax.lax.ppermute(acc, AXIS, _ring(tp)) + part
        return acc

    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec,
                         check_vma=False)(x, w)
