"""Summing one value held by several pipelines, each copy on its own submesh.

Every pipeline computes a gradient for the parameters it holds, already weighted by its
batch share (the runtime seeds each micro-batch's backward with ``mbs / global_batch``),
so the global-batch mean gradient is the plain sum of the pipelines' copies. Two ways to
form it, both exact:

* ``sum_across_collective``: when the holders are congruent (same mesh shape and axis
  names, same partition spec, as for pipelines with equal stages), their submeshes are
  stacked into one mesh with a leading ``pipelines`` axis, the copies viewed as one
  global array without moving data, and summed by ``jax.lax.psum`` inside
  ``jax.shard_map``: one all-reduce per group of leaves, the way that also works when
  the submeshes live in different ``jax.distributed`` processes.
* ``sum_across``: otherwise (different submesh shapes, e.g. pipelines with different
  layer splits), each copy is moved to the first holder's sharding with
  ``jax.device_put``, added there, and the sum moved back to every holder.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "pipelines"


def congruent(shardings: Sequence[NamedSharding]) -> bool:
    """Whether copies with these shardings can be summed by one shard_map collective."""
    first = shardings[0]
    if not all(isinstance(s, NamedSharding) for s in shardings):
        return False
    devs = [d for s in shardings for d in s.mesh.devices.flat]
    return (len(set(devs)) == len(devs) and all(
        s.mesh.axis_names == first.mesh.axis_names and
        s.mesh.devices.shape == first.mesh.devices.shape and s.spec == first.spec
        for s in shardings))


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


def sum_across_collective(copies: Sequence[Sequence[jax.Array]]) -> list[list[jax.Array]]:
    """``copies[i]``: holder i's leaves (congruent across holders, see ``congruent``).
    Returns, for each holder, the leaves summed over holders, on that holder's devices."""
    n = len(copies)
    if n == 1:
        return [list(copies[0])]
    shardings = [x.sharding for x in copies[0]]
    meshes = [copies[i][0].sharding.mesh for i in range(n)]
    big = Mesh(np.stack([m.devices for m in meshes]), (AXIS, *meshes[0].axis_names))
    expanded = [_expand(tuple(x.sharding for x in c))(list(c)) for c in copies]
    stacked = []
    for j, s in enumerate(shardings):
        shape = (n, *copies[0][j].shape)
        shards = [sh.data for e in expanded for sh in e[j].addressable_shards]
        stacked.append(jax.make_array_from_single_device_arrays(
            shape, NamedSharding(big, PartitionSpec(AXIS, *s.spec)), shards))
    summed = _psum(big, tuple(tuple(s.spec) for s in shardings))(stacked)
    out = []
    for i, m in enumerate(meshes):
        mine = set(m.devices.flat)
        parts = []
        for j, s in enumerate(shardings):
            shards = [sh.data for sh in summed[j].addressable_shards if sh.device in mine]
            parts.append(jax.make_array_from_single_device_arrays(
                (1, *copies[i][j].shape), NamedSharding(m, PartitionSpec(None, *s.spec)),
                shards))
        out.append(_squeeze(tuple(x.sharding for x in copies[i]))(parts))
    return out


def sum_across(copies: Sequence[Sequence[jax.Array]]) -> list[list[jax.Array]]:
    """Like ``sum_across_collective`` for holders of any shape: copies are moved to the
    first holder, summed there, and the sum moved back to each holder's sharding."""
    n = len(copies)
    if n == 1:
        return [list(copies[0])]
    home = [x.sharding for x in copies[0]]
    total = list(copies[0])
    for c in copies[1:]:
        total = _add(total, jax.device_put(list(c), home))
    return [total] + [jax.device_put(total, [x.sharding for x in c]) for c in copies[1:]]


@jax.jit
def _add(a, b):
    return [x + y for x, y in zip(a, b, strict=True)]
