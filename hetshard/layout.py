"""Layouts: how a stage's named mesh axes lay out every value. The one owner of the
translation from the plan's axes to ``NamedSharding`` (as MaxText's ``sharding.py`` and
the llama3 example's ``ShardingRules`` are for theirs); the runtime, the rewrites and
the checkpoint restore all ask here.

* Axes: a stage's mesh has named axes among ``MESH_AXES``; the batch splits over
  ``BATCH_AXES`` (``data``, then ``fsdp``; both are the plan's vocabulary, from
  ``hetshard.plan``), a sequence over ``context``, heads and weight dimensions over
  ``tensor``.
* State leaves (:func:`leaf_spec`): the plan's per-parameter spec when it names one
  (optimizer moments follow their parameter), otherwise the largest dimension divisible
  by the ``fsdp`` axis under FSDP (by ``fsdp x context`` where the plan's
  ``context.shard_state`` says so), otherwise replicated. With the plan's distributed
  optimizer (ZeRO-1) every state leaf that is not an ``nnx.Param`` (the optimizer's
  moments, its step count) is further split over ``data x context`` (the context ranks
  hold the same parameters; ``data`` alone where the product does not divide, and
  ``context`` already splitting the state leaves ``data``) along its largest dimension
  the spec leaves free and the split divides: each rank keeps and updates one shard,
  XLA reduces the gradients into it and all-gathers the updated parameters.
* Values with a batch dimension (:func:`batch_sharding`, :func:`activation_sharding`,
  :func:`boundary_layout`, :func:`attention_layout`): the batch over the batch axes where
  their product divides it; on a stage with a ``context`` axis, token arrays and
  activations also along their sequence.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetshard._plan import BATCH_AXES, MESH_AXES, Plan, Stage, named_spec, spec_axes
from hetshard.errors import SpecError
from hetshard.ir.paths import path_string

__all__ = ["BATCH_AXES", "MESH_AXES", "activation_sharding", "attention_layout",
           "batch_axes", "batch_axes_for", "batch_sharding", "batch_ways",
           "boundary_layout", "leaf_spec", "mesh_of", "param_paths", "spec",
           "stage_mesh", "state_shardings"]


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's batch axes of more than one device, in order."""
    return tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)


def batch_ways(mesh: Mesh) -> int:
    """How many ways the batch splits on ``mesh`` (the product of its batch axes)."""
    return int(np.prod([mesh.shape[a] for a in batch_axes(mesh)]))


def batch_axes_for(mesh: Mesh, n: int) -> tuple[str, ...] | None:
    """The batch axes (as a PartitionSpec entry) for a leading dimension of ``n``: all of
    them when their product divides it, else None (replicated)."""
    axes = batch_axes(mesh)
    return (axes or None) if n % batch_ways(mesh) == 0 else None


def mesh_of(stage: Stage, devices) -> Mesh:
    """The stage's devices (``devices[i]`` for each cluster id) as a Mesh of its shape."""
    shape = [n for _, n in stage.mesh_shape]
    names = [a for a, _ in stage.mesh_shape]
    return Mesh(np.array([devices[i] for i in stage.devices]).reshape(shape), names)


def stage_mesh(plan: Plan, devices) -> Mesh:
    """The mesh of a single-stage plan's one stage."""
    (stage,) = plan.pipelines[0].stages
    return mesh_of(stage, devices)


# ---- state leaves --------------------------------------------------------------------

def spec(entries) -> PartitionSpec:
    """A PartitionSpec without trailing Nones: ``P(None, None)`` and ``P()`` are the
    same layout, but a jitted function compiled for one misses its cache on the other
    (the arrays its update returns come back as ``P()``)."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def leaf_spec(path: str, shape, specs: dict[str, tuple], mesh: Mesh,
              shard_data: bool = False, over_context: bool = False) -> PartitionSpec:
    """The PartitionSpec of one state leaf (see the module docstring); ``shard_data``:
    a leaf of the optimizer's state under the distributed optimizer; ``over_context``:
    FSDP's split spans the ``context`` axis too (``Context.shard_state``)."""
    base = _base_spec(path, shape, specs, mesh, over_context)
    if not shard_data or not shape:
        return base
    # The distributed optimizer's split: data x context (the context ranks hold the same
    # parameters, as Megatron-LM's distributed optimizer shards over both), else data.
    used = spec_axes(base)
    axes = tuple(a for a in ("data", "context") if mesh.shape.get(a, 1) > 1 and a not in used)
    entries = list(base) + [None] * (len(shape) - len(base))
    for split in (axes, axes[:1]):
        ways = int(np.prod([mesh.shape[a] for a in split])) if split else 1
        if ways == 1:
            continue
        free = [d for d in range(len(shape)) if entries[d] is None and shape[d] % ways == 0]
        if free:
            entries[max(free, key=lambda d: (shape[d], -d))] = \
                split if len(split) > 1 else split[0]
            return spec(entries)
    return base


def _base_spec(path: str, shape, specs: dict[str, tuple], mesh: Mesh,
               over_context: bool = False) -> PartitionSpec:
    named = named_spec(specs, path, len(shape))
    if named is not None:
        return spec(a if a is None or shape[i] % mesh.shape[a] == 0 else None
                    for i, a in enumerate(named))
    axes = tuple(a for a in ("fsdp", "context") if mesh.shape.get(a, 1) > 1
                 and (a == "fsdp" or over_context))
    ways = int(np.prod([mesh.shape[a] for a in axes]))
    if ways > 1 and shape:
        entry = axes if len(axes) > 1 else axes[0]
        dims = sorted(range(len(shape)), key=lambda d: -shape[d])
        for d in dims:
            if shape[d] % ways == 0:
                return spec(entry if i == d else None for i in range(len(shape)))
    return PartitionSpec()


def state_shardings(tree, plan: Plan, mesh: Mesh):
    """Per leaf of ``tree`` (a step's state) its NamedSharding under a single-stage
    plan: in host memory for the optimizer's state where the stage offloads it
    (``Stage.offload``)."""
    (stage,) = plan.pipelines[0].stages
    specs = {name: tuple(entries) for name, entries in stage.shardings}
    host = "optimizer" in stage.offload
    params = param_paths(tree) if plan.distributed_optimizer or host else None

    def one(p, x):
        optimizer = params is not None and path_string(p) not in params
        return home(NamedSharding(mesh, leaf_spec(
            path_string(p), np.shape(x), specs, mesh,
            shard_data=optimizer and plan.distributed_optimizer,
            over_context=plan.context.shard_state)), host and optimizer)
    return jax.tree_util.tree_map_with_path(one, tree)


# ---- host memory (``Stage.offload``) ---------------------------------------------------

HOST = "pinned_host"


def home(sharding: NamedSharding, on_host: bool) -> NamedSharding:
    """``sharding`` in the host's pinned memory when ``on_host`` (a leaf a stage
    offloads), else as it is."""
    return sharding.with_memory_kind(HOST) if on_host else sharding


def on_device_sharding(sharding: NamedSharding) -> NamedSharding:
    """``sharding`` in the device's memory (where a step computes on a leaf)."""
    return sharding.with_memory_kind("device") if sharding.memory_kind == HOST \
        else sharding


def on_device(x, sharding: NamedSharding):
    """In a jitted step: ``x``, a leaf kept at ``sharding``, where the step computes on
    it (a host-memory leaf copied to the device's memory; others as they are)."""
    if sharding.memory_kind == HOST:
        return jax.device_put(x, sharding.with_memory_kind("device"))
    return x


def at_home(x, sharding: NamedSharding):
    """In a jitted step: ``x`` laid out at ``sharding`` (copied to host memory where
    that is its memory)."""
    if sharding.memory_kind == HOST:
        return jax.device_put(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def param_paths(tree) -> set[str]:
    """Paths (``path_string``) of the ``nnx.Param`` leaves of an NNX state."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return {path_string(p) for p, x in flat if isinstance(x, nnx.Param)}


# ---- values with a batch dimension ----------------------------------------------------

def batch_sharding(batch, plan: Plan, mesh: Mesh):
    """The batch's leading dimension over the batch axes; on a stage with a ``context``
    axis, token arrays (dimension 1 of the plan's sequence length) also along their
    sequence over ``context``, and other arrays of a row's items (a row's images,
    ``[batch, items, ...]``) their items over it where it divides them: each device of
    a row's context group takes its share (a vision encoder then runs split, not
    repeated on every device of the group)."""
    axes, ways = batch_axes(mesh), batch_ways(mesh)
    cp = mesh.shape.get("context", 1)

    def one(x):
        n = np.shape(x)[0] if np.ndim(x) else None
        if n is None or n % ways:
            raise SpecError("batch", f"leading dimension {n}",
                            f"a multiple of the plan's {ways} data-parallel ways "
                            f"(valid batch sizes: {[ways * k for k in range(1, 5)]})")
        entry = axes if axes else None
        if cp > 1 and np.ndim(x) >= 2 and np.shape(x)[1] == plan.seq_len:
            if plan.seq_len % cp:
                raise SpecError("seq_len", plan.seq_len,
                                f"a multiple of the plan's context degree {cp}")
            return NamedSharding(mesh, PartitionSpec(entry, "context"))
        if cp > 1 and np.ndim(x) >= 3 and np.shape(x)[1] % cp == 0:
            return NamedSharding(mesh, PartitionSpec(entry, "context"))
        return NamedSharding(mesh, PartitionSpec(entry))
    return jax.tree.map(one, batch)


def activation_sharding(shape, mesh: Mesh, mbs: int, seq_len: int | None = None
                        ) -> NamedSharding:
    """A pipeline stage's micro-batch value: split over the batch axes when its leading
    dimension is the micro-batch and divides evenly, and replicated otherwise; on a stage
    with a ``context`` axis, values ``[micro-batch, seq_len, ...]`` (token arrays,
    boundary activations) also along their sequence over it."""
    axes = batch_axes(mesh)
    ways = batch_ways(mesh)
    batch = axes if axes and len(shape) and shape[0] == mbs and mbs % ways == 0 else None
    cp = mesh.shape.get("context", 1)
    if cp > 1 and seq_len and len(shape) >= 2 and shape[0] == mbs and \
            shape[1] == seq_len and seq_len % cp == 0:
        return NamedSharding(mesh, PartitionSpec(batch, "context"))
    return NamedSharding(mesh, PartitionSpec(batch) if batch else PartitionSpec())


def boundary_layout(stage: Stage, mesh: Mesh, shape, sequence: int | None = None
                    ) -> NamedSharding | None:
    """The layout of a boundary activation of ``shape`` on the stage mesh: its batch over
    the batch axes and, on a stage with a ``context`` axis, its sequence (dimension 1)
    over ``context``; None where the stage's activation layout does not split the batch
    first or the shape does not divide. Given the ``sequence`` the context axis splits,
    activations over other lengths (a vision encoder's patches) split their batch over
    ``context`` too, where it divides."""
    axes = batch_axes(mesh)
    named = [entries for _, entries in stage.activations]
    if named and "data" not in tuple(named[0])[:1]:
        return None
    if not len(shape) or shape[0] % batch_ways(mesh):
        return None
    cp = mesh.shape.get("context", 1)
    if cp > 1 and len(shape) >= 3 and sequence is not None and shape[1] != sequence:
        if shape[0] % (batch_ways(mesh) * cp) == 0:
            return NamedSharding(mesh, PartitionSpec(axes + ("context",)))
    elif cp > 1 and len(shape) >= 3 and shape[1] % cp == 0:
        return NamedSharding(mesh, PartitionSpec(axes if axes else None, "context"))
    return NamedSharding(mesh, PartitionSpec(axes if axes else None))


def attention_layout(mesh: Mesh, q_shape, kv_heads: int, extra: tuple[str, ...] = ()):
    """``(batch axes or None, heads axis or None)``: how attention splits over a stage
    mesh, each sample and head being independent. The batch goes over the batch axes
    (``data``, then ``fsdp``, then any ``extra``) as far as their product divides it;
    the heads over ``tensor`` when it divides the query and the key/value heads
    (grouped-query attention keeps each key/value head with its queries)."""
    b, h = q_shape[0], q_shape[2]
    batch, ways = [], 1
    for a in BATCH_AXES + tuple(extra):
        n = mesh.shape.get(a, 1)
        if n > 1 and b % (ways * n) == 0:
            batch.append(a)
            ways *= n
    tp = mesh.shape.get("tensor", 1)
    heads = "tensor" if tp > 1 and h % tp == 0 and kv_heads % tp == 0 else None
    return (tuple(batch) or None), heads
