"""Running a single-stage plan as one SPMD program on the stage's submesh.

The stage's devices form a ``Mesh`` with the plan's named axes. Every state leaf (NNX
parameters, optimizer moments, or a pure pytree) gets a ``NamedSharding``: the plan's
per-parameter spec when it names one (optimizer moments follow their parameter),
otherwise the largest dimension divisible by the ``fsdp`` axis under FSDP, otherwise
replicated. With the plan's distributed optimizer (ZeRO-1) every state leaf that is not
an ``nnx.Param`` (the optimizer's moments, its step count) is further split over the
``data`` axis along its largest dimension the spec leaves free and ``data`` divides:
each data way keeps and updates one shard, XLA reduces the gradients into it and
all-gathers the updated parameters. The batch's leading dimension is split over the
``data`` and ``fsdp`` axes.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetshard.errors import SpecError
from hetshard.ir.program import path_string  # noqa: F401 (re-exported)
from hetshard.plan import Plan


def mesh_of(stage, devices) -> Mesh:
    """The stage's devices (``devices[i]`` for each cluster id) as a Mesh of its shape."""
    shape = [n for _, n in stage.mesh_shape]
    names = [a for a, _ in stage.mesh_shape]
    return Mesh(np.array([devices[i] for i in stage.devices]).reshape(shape), names)


def stage_mesh(plan: Plan, devices) -> Mesh:
    (stage,) = plan.pipelines[0].stages
    return mesh_of(stage, devices)


def leaf_spec(path: str, shape, specs: dict[str, tuple], mesh: Mesh,
              shard_data: bool = False) -> PartitionSpec:
    """The PartitionSpec of one state leaf (see the module docstring); ``shard_data``:
    a leaf of the optimizer's state under the distributed optimizer."""
    spec = _base_spec(path, shape, specs, mesh)
    data = mesh.shape.get("data", 1)
    if not shard_data or data == 1 or not shape:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    free = [d for d in range(len(shape)) if entries[d] is None and shape[d] % data == 0]
    if not free:
        return spec
    entries[max(free, key=lambda d: (shape[d], -d))] = "data"
    return _spec(entries)


def _spec(entries) -> PartitionSpec:
    """A PartitionSpec without trailing Nones: ``P(None, None)`` and ``P()`` are the
    same layout, but a jitted function compiled for one misses its cache on the other
    (the arrays its update returns come back as ``P()``)."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _base_spec(path: str, shape, specs: dict[str, tuple], mesh: Mesh) -> PartitionSpec:
    best = None
    for name, spec in specs.items():
        if (path == name or path.endswith("/" + name)) and len(spec) == len(shape):
            if best is None or len(name) > len(best[0]):
                best = (name, spec)
    if best is not None:
        spec = tuple(a if a is None or shape[i] % mesh.shape[a] == 0 else None
                     for i, a in enumerate(best[1]))
        return _spec(spec)
    fsdp = mesh.shape.get("fsdp", 1)
    if fsdp > 1 and shape:
        dims = sorted(range(len(shape)), key=lambda d: -shape[d])
        for d in dims:
            if shape[d] % fsdp == 0:
                return _spec("fsdp" if i == d else None for i in range(len(shape)))
    return PartitionSpec()


def state_shardings(tree, plan: Plan, mesh: Mesh):
    import jax
    (stage,) = plan.pipelines[0].stages
    specs = {name: tuple(spec) for name, spec in stage.shardings}
    params = param_paths(tree) if plan.distributed_optimizer else None
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, leaf_spec(
            path_string(p), np.shape(x), specs, mesh,
            shard_data=params is not None and path_string(p) not in params)),
        tree)


def param_paths(tree) -> set[str]:
    """Paths (``path_string``) of the ``nnx.Param`` leaves of an NNX state."""
    import jax
    from flax import nnx
    flat, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return {path_string(p) for p, x in flat if isinstance(x, nnx.Param)}


def batch_sharding(batch, plan: Plan, mesh: Mesh):
    """The batch's leading dimension over the data axes; on a stage with a ``context``
    axis, token arrays (dimension 1 of the plan's sequence length) also along their
    sequence over ``context``."""
    import jax
    axes = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
    ways = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    cp = mesh.shape.get("context", 1)

    def one(x):
        n = np.shape(x)[0] if np.ndim(x) else None
        if n is None or n % ways:
            raise SpecError("batch", f"leading dimension {n}",
                            f"a multiple of the plan's {ways} data-parallel ways "
                            f"(valid batch sizes: {[ways * k for k in range(1, 5)]})")
        batch_axes = axes if axes else None
        if cp > 1 and np.ndim(x) >= 2 and np.shape(x)[1] == plan.seq_len:
            if plan.seq_len % cp:
                raise SpecError("seq_len", plan.seq_len,
                                f"a multiple of the plan's context degree {cp}")
            return NamedSharding(mesh, PartitionSpec(batch_axes, "context"))
        return NamedSharding(mesh, PartitionSpec(batch_axes))
    return jax.tree.map(one, batch)
