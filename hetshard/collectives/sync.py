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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetshard.collectives.transfer import processes, same_layout, transfer

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
    in_specs = [PartitionSpec(AXIS, *spec) for spec in specs]

    def body(xs):
        return [jax.lax.psum(x, AXIS) for x in xs]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=in_specs))


@functools.cache
def _expand(shardings: tuple):
    out = [NamedSharding(s.mesh, PartitionSpec(None, *s.spec)) for s in shardings]
    return jax.jit(lambda xs: [x[None] for x in xs], out_shardings=out)


@functools.cache
def _squeeze(shardings: tuple):
    return jax.jit(lambda xs: [x[0] for x in xs], out_shardings=list(shardings))


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
    expanded = [None if c is None else _expand(tuple(shardings[i]))(list(c))
                for i, c in enumerate(copies)]
    stacked = []
    for j, s in enumerate(shardings[0]):
        shards = [sh.data for e in expanded if e is not None for sh in e[j].addressable_shards]
        stacked.append(jax.make_array_from_single_device_arrays(
            (n, *avals[j].shape), NamedSharding(big, PartitionSpec(AXIS, *s.spec)), shards))
    summed = _psum(big, tuple(tuple(s.spec) for s in shardings[0]))(stacked)
    out = []
    for i, m in enumerate(meshes):
        if me not in processes(shardings[i][0]):
            out.append(None)
            continue
        mine = set(m.devices.flat)
        parts = []
        for j, s in enumerate(shardings[i]):
            shards = [sh.data for sh in summed[j].addressable_shards if sh.device in mine]
            parts.append(jax.make_array_from_single_device_arrays(
                (1, *avals[j].shape), NamedSharding(m, PartitionSpec(None, *s.spec)), shards))
        out.append(_squeeze(tuple(shardings[i]))(parts))
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
