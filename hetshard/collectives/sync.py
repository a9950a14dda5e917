"""Summing one value held by several pipelines, each copy on its own submesh.

Every pipeline computes a gradient for the parameters it holds, already weighted by its
batch share (the runtime seeds each micro-batch's backward with ``mbs / global_batch``),
so the global-batch mean gradient is the plain sum of the pipelines' copies. Two ways to
form it, both exact, both usable when the holders live in different
``jax.distributed`` processes (then ``copies[i]`` is ``None`` in a process without a
device of holder i, the holders' ``shardings`` are passed explicitly, every process
holding a device of any holder calls, and gets ``None`` for the holders it lacks):

* ``sum_across_collective``: when the holders are congruent (same mesh shape and axis
  names, same partition spec, as for pipelines with equal stages), their submeshes are
  stacked into one mesh with a leading ``pipelines`` axis, the copies viewed as one
  global array without moving data, and summed by ``jax.lax.psum`` inside
  ``jax.shard_map``: one all-reduce per group of leaves.
* ``sum_across``: otherwise (different submesh shapes, e.g. pipelines with different
  layer splits), each copy is moved to the first holder's layout
  (``hetshard.collectives.transfer``), added there, and the sum moved back to every
  holder.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from hetshard.collectives.moves import processes, put, same_layout, stacked, transfer

AXIS = "pipelines"


def congruent(shardings: Sequence[NamedSharding]) -> bool:
    """Whether copies with these shardings can be summed by one shard_map collective."""
    first = shardings[0]
    if not all(isinstance(s, NamedSharding) for s in shardings):
        return False
    devs = [d for s in shardings for d in s.mesh.devices.flat]
    return len(set(devs)) == len(devs) and all(
        same_layout(first, s) for s in shardings[1:])


@functools.cache
def _psum(mesh: Mesh, specs: tuple):
    in_specs = [stacked(AXIS, spec) for spec in specs]

    def body(xs):
        return [jax.lax.psum(x, AXIS) for x in xs]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=in_specs))


def _layouts(copies, shardings, avals):
    if shardings is None:
        shardings = [[x.sharding for x in c] for c in copies]
    if avals is None:
        avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in copies[0]]
    return shardings, avals


def sum_across_collective(copies: Sequence[Sequence[jax.Array] | None], shardings=None,
                          avals=None) -> list[list[jax.Array] | None]:
    """``copies[i]``: holder i's leaves (congruent across holders, see ``congruent``).
    Returns, for each holder, the leaves summed over holders, on that holder's devices."""
    n = len(copies)
    shardings, avals = _layouts(copies, shardings, avals)
    if n == 1:
        return [None if copies[0] is None else list(copies[0])]
    me = jax.process_index()
    meshes = [s[0].mesh for s in shardings]
    big = Mesh(np.stack([m.devices for m in meshes]), (AXIS, *meshes[0].axis_names))
    # Scalars are carried as shape (1,) so copies concatenate along dimension 0.
    flat = []
    for i, c in enumerate(copies):
        if c is None:
            flat.append(None)
            continue
        c = [x if x.sharding == s else put(x, s)
             for x, s in zip(c, shardings[i], strict=True)]
        flat.append([x.reshape(1) if not len(avals[j].shape) else x for j, x in enumerate(c)])
    together = []
    for j, s in enumerate(shardings[0]):
        shape = tuple(avals[j].shape) or (1,)
        shards = [sh.data for c in flat if c is not None for sh in c[j].addressable_shards]
        together.append(jax.make_array_from_single_device_arrays(
            (n * shape[0], *shape[1:]), NamedSharding(big, stacked(AXIS, s.spec)), shards))
    summed = _psum(big, tuple(s.spec for s in shardings[0]))(together)
    out = []
    for i, m in enumerate(meshes):
        if me not in processes(shardings[i][0]):
            out.append(None)
            continue
        mine = set(m.devices.flat)
        parts = []
        for j, s in enumerate(shardings[i]):
            shape = tuple(avals[j].shape) or (1,)
            part = jax.make_array_from_single_device_arrays(
                shape, s, [sh.data for sh in summed[j].addressable_shards if sh.device in mine])
            parts.append(part.reshape(()) if not len(avals[j].shape) else part)
        out.append(parts)
    return out


def sum_across(copies: Sequence[Sequence[jax.Array] | None], shardings=None,
               avals=None) -> list[list[jax.Array] | None]:
    """Like ``sum_across_collective`` for holders of any shape: copies are moved to the
    first holder, summed there, and the sum moved back to each holder's layout."""
    n = len(copies)
    shardings, avals = _layouts(copies, shardings, avals)
    if n == 1:
        return [None if copies[0] is None else list(copies[0])]
    me = jax.process_index()
    home = shardings[0]
    at_home = me in processes(home[0])
    total = list(copies[0]) if at_home else None
    for i in range(1, n):
        if me in processes(shardings[i][0]) | processes(home[0]):
            moved = transfer(copies[i], avals, shardings[i], home)
            if at_home:
                total = _add(total, moved)
    out = [total]
    for i in range(1, n):
        if me in processes(shardings[i][0]) | processes(home[0]):
            out.append(transfer(total, avals, home, shardings[i]))
        else:
            out.append(None)
    return out


@jax.jit
def _add(a, b):
    return [x + y for x, y in zip(a, b, strict=True)]
