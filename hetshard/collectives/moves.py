"""Moving values between submeshes, within one process or across ``jax.distributed``
processes.

``transfer(xs, avals, srcs, dsts)`` moves arrays laid out by ``srcs`` (all on one source
mesh) to the layouts ``dsts`` (all on one destination mesh). Every process that holds a
device of either mesh calls it, in the same order as its peers (the runtime walks one
global schedule in every process); a process without source devices passes ``None``
for ``xs`` and one without destination devices gets ``None`` back.

* Both meshes in this process: :func:`put`, ``jax.device_put`` where JAX moves the
  shards device to device, else shard by shard (:func:`reshard`): JAX (0.10) copies an
  array whose destination shards are no source shard (two halves to four quarters)
  through the host, waiting for the value, which stalled every pipeline step at its
  first such transfer.
* Across processes, congruent layouts (same mesh shape, axis names and spec, as for
  equal stages): the two meshes are stacked into one with a leading ``hop`` axis and
  the value and a cached zero buffer on the receiver viewed as one global array,
  concatenated along dimension 0 (``stacked``: every device's shard is the value's own
  shard, nothing is copied to build it); ``jax.lax.ppermute`` inside ``jax.shard_map``
  sends each shard to its counterpart.
* Across processes, other layouts: the value is gathered on the source mesh, sent from
  the source mesh's first device to the destination's first device by the same
  ``ppermute`` over a two-device mesh, and laid out on the destination (a local
  ``device_put``, or a ``psum`` broadcast when the destination spans processes).
* Scalars travel as shape ``(1,)``.

Why collectives rather than JAX's cross-host ``device_put``
(``jax_cross_host_transfer_socket_address``), measured on loopback by
``experiments/multihost_bench.py`` (4 devices to 4 devices): the collective moves 1 MiB
in 1.3 ms and 16 MiB in 6.8 ms, the cross-host ``device_put`` in 1.3 ms and 12.2 ms;
and a cross-host ``device_put`` returns on the sender before the bytes leave, so a
sender that then enters a collective with the receiver can deadlock (seen: a 16 MiB
transfer followed by a ``ppermute``). With every cross-process move a collective, a
step's cross-process traffic is one ordered sequence that every pair of processes
issues identically, and needs no extra sockets or ports.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

HOP = "hop"


def processes(sharding: NamedSharding) -> frozenset[int]:
    """Process indices holding a device of ``sharding``'s mesh."""
    return frozenset(int(d.process_index) for d in sharding.mesh.devices.flat)


def here(sharding: NamedSharding) -> bool:
    """Whether this process holds a device of ``sharding``'s mesh."""
    return jax.process_index() in processes(sharding)


def takes_part(*shardings: NamedSharding) -> bool:
    """Whether this process must join a transfer between these shardings."""
    return any(here(s) for s in shardings)


def empty(aval, sharding: NamedSharding) -> jax.Array:
    """A global array of ``aval`` laid out by ``sharding`` with no data in this process
    (the view other processes' values have here)."""
    return jax.make_array_from_single_device_arrays(tuple(aval.shape), sharding, [],
                                                     dtype=aval.dtype)


def replicated(x, mesh: Mesh) -> jax.Array:
    """A batch value every process holds whole (as the step was given it), replicated
    on ``mesh`` (each process puts its own devices' copies)."""
    return jax.device_put(np.asarray(x) if isinstance(x, np.ndarray) else x,
                          NamedSharding(mesh, PartitionSpec()))


def _box(index, shape) -> tuple:
    """A shard's index (slices) as ((start, stop), ...) per dimension."""
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True))


@functools.cache
def _direct(src, dst, shape: tuple) -> bool:
    """Whether ``jax.device_put`` moves an array of ``shape`` from ``src`` to ``dst``
    device to device: every destination shard is a source shard (or the source is one
    device); else JAX reads the value on the host."""
    if len(src.device_set) == 1:
        return True
    have = {_box(i, shape) for i in src.devices_indices_map(shape).values()}
    return all(_box(i, shape) in have for i in dst.devices_indices_map(shape).values())


def put(xs, shardings):
    """``jax.device_put(xs, shardings)`` (pytrees, one sharding a leaf or one for all)
    that never waits for a value on the host: leaves JAX would copy through the host
    are moved shard by shard (:func:`reshard`)."""
    leaves, tree = jax.tree.flatten(xs)
    dsts = jax.tree.leaves(shardings) if not isinstance(shardings, jax.sharding.Sharding) \
        else [shardings] * len(leaves)
    if len(dsts) != len(leaves):  # (a prefix tree of shardings: JAX's own broadcasting)
        dsts = jax.tree.leaves(jax.tree.map(lambda s, x: s, shardings, xs,
                                            is_leaf=lambda s: isinstance(
                                                s, jax.sharding.Sharding)))
    # Leaves already where they go are kept as they are, without a call into JAX (a
    # step's state after its first step: hundreds of leaves on every call).
    todo = [k for k, (x, d) in enumerate(zip(leaves, dsts, strict=True))
            if not (isinstance(x, jax.Array) and x.sharding == d)]
    if not todo:
        return xs
    slow = [k for k in todo if isinstance(leaves[k], jax.Array) and
            leaves[k].is_fully_addressable and
            not _direct(leaves[k].sharding, dsts[k], tuple(leaves[k].shape))]
    if not slow and len(todo) == len(leaves):
        return jax.device_put(xs, shardings)
    fast = [k for k in todo if k not in set(slow)]
    out = list(leaves)
    if fast:
        for k, y in zip(fast, jax.device_put([leaves[k] for k in fast],
                                             [dsts[k] for k in fast]), strict=True):
            out[k] = y
    for k in slow:
        out[k] = reshard(leaves[k], dsts[k])
    return jax.tree.unflatten(tree, out)


def reshard(x: jax.Array, dst) -> jax.Array:
    """``x`` laid out by ``dst`` (any devices), shard by shard on the devices: each
    destination shard gathered from the source shards that overlap it (sliced where
    they are, copied device to device, put together on the destination device). Every
    step is an asynchronous dispatch: nothing waits for ``x``."""
    shape = tuple(x.shape)
    plan = _pieces(x.sharding, dst, shape)
    by_device = {s.device: s.data for s in x.addressable_shards}
    shards = []
    for device, box, parts in plan:
        pieces = []
        for src_device, local, offset in parts:
            piece = by_device[src_device]
            if local is not None:
                piece = piece[local]
            pieces.append((jax.device_put(piece, device), offset))
        if len(pieces) == 1 and pieces[0][1] is None:
            shards.append(pieces[0][0])
        else:
            shards.append(_assemble(tuple(b - a for a, b in box), x.dtype,
                                    tuple(o for _, o in pieces))(*(p for p, _ in pieces)))
    return jax.make_array_from_single_device_arrays(shape, dst, shards)


@functools.cache
def _pieces(src, dst, shape: tuple) -> list:
    """Per addressable destination device: (device, its box, [(source device, slice of
    that device's shard or None for all of it, offset in the destination shard or None
    when the piece is all of it)]), one source copy a distinct overlapping box."""
    srcs: dict = {}
    for device, index in src.devices_indices_map(shape).items():
        if device.process_index == jax.process_index():
            srcs.setdefault(_box(index, shape), device)
    out = []
    for device, index in dst.devices_indices_map(shape).items():
        if device.process_index != jax.process_index():
            continue
        box = _box(index, shape)
        parts = []
        for sbox, sdev in srcs.items():
            lo = [max(a[0], b[0]) for a, b in zip(box, sbox, strict=True)]
            hi = [min(a[1], b[1]) for a, b in zip(box, sbox, strict=True)]
            if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
                continue
            whole_src = all((l_, h) == b for l_, h, b in zip(lo, hi, sbox, strict=True))
            local = None if whole_src else tuple(
                slice(l_ - b[0], h - b[0]) for l_, h, b in zip(lo, hi, sbox, strict=True))
            whole_dst = all((l_, h) == b for l_, h, b in zip(lo, hi, box, strict=True))
            offset = None if whole_dst else tuple(
                l_ - b[0] for l_, b in zip(lo, box, strict=True))
            parts.append((sdev, local, offset))
            if whole_dst:
                parts = [parts[-1]]
                break
        out.append((device, box, parts))
    return out


@functools.cache
def _assemble(shape: tuple, dtype, offsets: tuple):
    """A jitted function putting pieces at ``offsets`` into a ``shape`` array."""
    def fn(*pieces):
        out = jax.numpy.zeros(shape, dtype)
        for p, off in zip(pieces, offsets, strict=True):
            out = jax.lax.dynamic_update_slice(out, p, off if off is not None
                                               else (0,) * len(shape))
        return out
    return jax.jit(fn)


def same_layout(a: NamedSharding, b: NamedSharding) -> bool:
    """Congruent shardings on disjoint devices: one shard per device maps to one."""
    if not (isinstance(a, NamedSharding) and isinstance(b, NamedSharding)):
        return False
    if set(a.mesh.devices.flat) & set(b.mesh.devices.flat):
        return False
    return (a.mesh.axis_names == b.mesh.axis_names and
            a.mesh.devices.shape == b.mesh.devices.shape and a.spec == b.spec)


def stacked(axis: str, spec: PartitionSpec) -> PartitionSpec:
    """``spec`` with its first dimension also split over a new leading mesh ``axis``:
    copies laid out by ``spec`` on congruent submeshes, concatenated along dimension 0,
    form one array on the stacked mesh whose per-device shards are the copies' own
    shards (no data moves to build it)."""
    first = spec[0] if len(spec) else None
    if first is None:
        lead = axis
    elif isinstance(first, tuple):
        lead = (axis, *first)
    else:
        lead = (axis, first)
    return PartitionSpec(lead, *spec[1:])


def transfer(xs: Sequence[jax.Array] | None, avals: Sequence, srcs: Sequence[NamedSharding],
             dsts: Sequence[NamedSharding]) -> list[jax.Array] | None:
    """See the module docstring. ``avals[j]`` gives leaf j's shape and dtype (known to
    every process, with or without the data)."""
    if not srcs:
        return []
    me = jax.process_index()
    src_procs, dst_procs = processes(srcs[0]), processes(dsts[0])
    if me not in src_procs | dst_procs:
        raise ValueError("transfer called by a process holding neither mesh")
    if src_procs | dst_procs == {me}:
        return put(list(xs), list(dsts))
    scalars = [j for j, a in enumerate(avals) if not len(a.shape)]
    if scalars:  # carried as shape (1,)
        avals = [jax.ShapeDtypeStruct((1,), a.dtype) if j in scalars else a
                 for j, a in enumerate(avals)]
    if me in src_procs:
        xs = [x if x.sharding == s else jax.device_put(x, s)
              for x, s in zip(xs, srcs, strict=True)]
        xs = [x.reshape(1) if j in scalars else x for j, x in enumerate(xs)]
    out: list = [None] * len(srcs)
    fast = [j for j in range(len(srcs)) if same_layout(srcs[j], dsts[j])]
    slow = [j for j in range(len(srcs)) if j not in set(fast)]
    for idx, move in ((fast, _hop_congruent), (slow, _hop_gathered)):
        if not idx:
            continue
        moved = move(None if xs is None or me not in src_procs else [xs[j] for j in idx],
                     [avals[j] for j in idx], [srcs[j] for j in idx], [dsts[j] for j in idx])
        for j, y in zip(idx, moved, strict=True):
            out[j] = y
    if me not in dst_procs:
        return None
    return [y.reshape(()) if j in scalars else y for j, y in enumerate(out)]


def idle_processes(meshes) -> tuple[int, ...]:
    """The job's processes holding no device of any of ``meshes`` (a plan that leaves
    them out: they run no part of the step)."""
    busy = {int(d.process_index) for m in meshes for d in m.devices.flat}
    return tuple(p for p in range(jax.process_count()) if p not in busy)


def home_device(process: int):
    """Where a process that runs no part of a step gets its outputs: its first device."""
    return min((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)


def deliver(xs: Sequence[jax.Array] | None, avals: Sequence, mesh: Mesh,
            idle: Sequence[int]) -> list[jax.Array] | None:
    """A step's outputs, computed on ``mesh``, handed to the ``idle`` processes (each
    gets them replicated on :func:`home_device`), so that every process of the job
    returns them as one process would. Every process calls it, in the same order as
    its peers: those holding ``mesh`` pass ``xs`` and get them back; an idle process
    passes None and gets its copies; a process in neither gets None."""
    me = jax.process_index()
    src = NamedSharding(mesh, PartitionSpec())
    if here(src) and xs:
        xs = _replicate(mesh, len(xs))(list(xs))
    got = None
    for p in idle:
        if me != p and not here(src):
            continue
        dst = NamedSharding(Mesh(np.array([home_device(p)]), ("home",)), PartitionSpec())
        moved = transfer(xs if here(src) else None, avals, [src] * len(avals),
                         [dst] * len(avals))
        if me == p:
            got = moved
    return list(xs) if here(src) else got


# ---- congruent layouts: shard to shard ----------------------------------------------------

@functools.cache
def _shift(mesh: Mesh, specs: tuple):
    in_specs = [stacked(HOP, spec) for spec in specs]

    def body(xs):
        return [jax.lax.ppermute(x, HOP, [(0, 1)]) for x in xs]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=in_specs))


@functools.lru_cache(maxsize=256)
def _zeros(shape: tuple, dtype, device) -> jax.Array:
    return jax.device_put(np.zeros(shape, dtype), device)


def _local(sharding: NamedSharding) -> list:
    me = jax.process_index()
    return [d for d in sharding.mesh.devices.flat if d.process_index == me]


def _concatenated(aval, copies: int) -> tuple:
    return (copies * aval.shape[0], *aval.shape[1:])


def _hop_congruent(xs, avals, srcs, dsts):
    me = jax.process_index()
    src_mesh, dst_mesh = srcs[0].mesh, dsts[0].mesh
    big = Mesh(np.stack([src_mesh.devices, dst_mesh.devices]), (HOP, *src_mesh.axis_names))
    halves = []
    for j, (aval, s, d) in enumerate(zip(avals, srcs, dsts, strict=True)):
        shards = [] if xs is None else [sh.data for sh in xs[j].addressable_shards]
        if me in processes(d):
            shape = d.shard_shape(tuple(aval.shape))
            shards += [_zeros(shape, np.dtype(aval.dtype), dev) for dev in _local(d)]
        halves.append(jax.make_array_from_single_device_arrays(
            _concatenated(aval, 2), NamedSharding(big, stacked(HOP, s.spec)), shards))
    moved = _shift(big, tuple(s.spec for s in srcs))(halves)
    if me not in processes(dsts[0]):
        return [None] * len(srcs)
    mine = set(_local(dsts[0]))
    return [jax.make_array_from_single_device_arrays(
        tuple(aval.shape), d, [sh.data for sh in m.addressable_shards if sh.device in mine])
        for m, aval, d in zip(moved, avals, dsts, strict=True)]


# ---- other layouts: through one device of each side --------------------------------------

@functools.cache
def _replicate(mesh: Mesh, n: int):
    return jax.jit(lambda xs: list(xs), out_shardings=[NamedSharding(mesh, PartitionSpec())] * n)


@functools.cache
def _pair_shift(a, b, n: int):
    mesh = Mesh(np.array([a, b]), (HOP,))
    specs = [PartitionSpec(HOP)] * n

    def body(xs):
        return [jax.lax.ppermute(x, HOP, [(0, 1)]) for x in xs]
    return mesh, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=specs))


@functools.cache
def _broadcast(mesh: Mesh, n: int):
    """Over a flat mesh of a destination's devices: the first device's block holds the
    value, the others zeros; the psum leaves every device with the value."""
    specs = [PartitionSpec(HOP)] * n

    def body(xs):
        return [jax.lax.psum(x, HOP) for x in xs]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,),
                                 out_specs=[PartitionSpec()] * n))


@functools.cache
def _relayout(shardings: tuple):
    return jax.jit(lambda xs: list(xs), out_shardings=list(shardings))


def _hop_gathered(xs, avals, srcs, dsts):
    me = jax.process_index()
    n = len(srcs)
    first_src = srcs[0].mesh.devices.flat[0]
    first_dst = dsts[0].mesh.devices.flat[0]
    full = None
    if xs is not None:
        full = _replicate(srcs[0].mesh, n)(list(xs))
        full = [next(sh.data for sh in f.addressable_shards if sh.device == first_src)
                if first_src.process_index == me else None for f in full]
    # The value on the destination's first device (None elsewhere).
    at_dst = None
    if first_src.process_index == first_dst.process_index == me:
        at_dst = jax.device_put(full, first_dst)
    elif me in (first_src.process_index, first_dst.process_index):
        mesh, shift = _pair_shift(first_src, first_dst, n)
        halves = []
        for j, aval in enumerate(avals):
            shard = (full[j] if me == first_src.process_index
                     else _zeros(tuple(aval.shape), np.dtype(aval.dtype), first_dst))
            halves.append(jax.make_array_from_single_device_arrays(
                _concatenated(aval, 2), NamedSharding(mesh, PartitionSpec(HOP)), [shard]))
        moved = shift(halves)
        if me == first_dst.process_index:
            at_dst = [next(sh.data for sh in m.addressable_shards if sh.device == first_dst)
                      for m in moved]
    if me not in processes(dsts[0]):
        return [None] * n
    dst_mesh = dsts[0].mesh
    if processes(dsts[0]) == {me}:
        return jax.device_put(at_dst, list(dsts))
    flat = Mesh(dst_mesh.devices.reshape(-1), (HOP,))
    blocks = []
    for j, aval in enumerate(avals):
        shards = [at_dst[j] if dev == first_dst else
                  _zeros(tuple(aval.shape), np.dtype(aval.dtype), dev)
                  for dev in _local(dsts[0])]
        blocks.append(jax.make_array_from_single_device_arrays(
            _concatenated(aval, flat.size), NamedSharding(flat, PartitionSpec(HOP)), shards))
    everywhere = _broadcast(flat, n)(blocks)
    replicated = [jax.make_array_from_single_device_arrays(
        tuple(aval.shape), NamedSharding(dst_mesh, PartitionSpec()),
        [sh.data for sh in e.addressable_shards])
        for e, aval in zip(everywhere, avals, strict=True)]
    return _relayout(tuple(dsts))(replicated)
