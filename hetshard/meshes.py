"""Meshes as JAX 0.10 makes them: Explicit axes, ambient meshes.

``jax.make_mesh`` gives a mesh whose axes are ``Explicit`` by default: arrays on it carry
their sharding in their type, ``jax.shard_map`` requires its inputs already laid out as
its ``in_specs`` say, and an indexing op on a sharded dimension must be told its output
sharding. ``jax.set_mesh`` also puts a mesh in context, which every traced operation then
checks its operands against. hetshard's entry points that take a mesh accept both kinds
(:func:`laid_out` before a ``shard_map``; :func:`gathered` before indexing), and its
runtime runs its own submeshes' programs outside the caller's ambient mesh
(:func:`no_ambient_mesh`).
"""

from __future__ import annotations

import contextlib

import jax
from jax._src import core as _core  # trace_state_clean: no public spelling in JAX 0.10
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec


def is_explicit(mesh: Mesh) -> bool:
    """Some axis of ``mesh`` is ``Explicit`` (``jax.make_mesh``'s default)."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def laid_out(x, mesh: Mesh, spec: PartitionSpec):
    """``x`` with layout ``spec`` on ``mesh`` where the mesh is Explicit (shard_map takes
    inputs only as they are laid out there); ``x`` itself on an Auto mesh, where
    ``shard_map`` reshards its inputs."""
    if not is_explicit(mesh):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def gathered(x, mesh: Mesh):
    """``x`` replicated on an Explicit ``mesh`` (so it can be indexed freely); ``x`` on an
    Auto one."""
    return laid_out(x, mesh, PartitionSpec())


def untyped(tree):
    """``tree`` with every array sharded over an Explicit mesh moved to the same layout on
    that mesh with Auto axes (no data moves): hetshard slices and re-lays out a caller's
    arrays, which explicit sharding types would forbid."""
    def one(x):
        sharding = getattr(x, "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if not isinstance(sharding, NamedSharding) or not isinstance(mesh, Mesh) or \
                not is_explicit(mesh):
            return x
        auto = Mesh(mesh.devices, mesh.axis_names,
                    axis_types=(AxisType.Auto,) * len(mesh.axis_names))
        return jax.device_put(x, NamedSharding(auto, sharding.spec))
    return jax.tree.map(one, tree)


@contextlib.contextmanager
def no_ambient_mesh():
    """Runs the block with no mesh in context (a caller's ``jax.set_mesh`` would make
    every operation on hetshard's own submeshes check against the caller's mesh);
    nothing to do when none is set, or inside a trace."""
    ambient = not jax.sharding.get_abstract_mesh().empty
    if not ambient or not _core.trace_state_clean():
        yield
        return
    with jax.set_mesh(None):
        yield
