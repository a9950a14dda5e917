"""Binding a cluster spec onto the JAX devices that exist.

On real hardware the devices are the spec's GPUs. On CPU, fake devices stand in
for them (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` or
``jax.config.update("jax_num_cpu_devices", N)`` before JAX initialises), so any
plan for the spec runs for real; only the speed is not the GPUs'.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hetshard.errors import DeviceBindingError

if TYPE_CHECKING:  # annotations only: bind reads a Cluster's fields, spec.py imports bind
    from hetshard.cluster.spec import Cluster


@dataclasses.dataclass(frozen=True)
class BoundCluster:
    """A cluster spec whose GPU ``i`` is ``devices[i]``."""

    cluster: Cluster
    devices: tuple

    def group_devices(self, name: str) -> tuple:
        return tuple(self.devices[i] for i in self.cluster.group_device_ids(name))

    def device(self, device_id: int):
        return self.devices[device_id]


def bind(cluster: Cluster, devices=None) -> BoundCluster:
    """Maps the spec's GPUs, in device-id order, onto ``devices`` (default ``jax.devices()``).

    Groups whose ``processes`` are given take devices of those processes only
    (node ``k`` of the group on process ``processes[k]``); the others take the
    remaining devices in order. Extra devices are left unused.

    Raises:
      DeviceBindingError: fewer devices than the spec has GPUs (with how to get
        more fake CPU devices), or a process that lacks the devices its nodes need.
    """
    import jax
    devices = list(jax.devices() if devices is None else devices)
    need = cluster.num_devices
    if need > len(devices):
        raise DeviceBindingError(
            f"cluster {cluster.name!r} has {need} GPUs but only {len(devices)} JAX devices "
            f"exist. To emulate it on CPU, start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} or call "
            f"jax.config.update('jax_num_cpu_devices', {need}) before JAX initialises; "
            f"or bind a smaller cluster; or, for a job that lost devices, "
            f"hetshard.jit(..., elastic=True) plans again on the {len(devices)} there are "
            f"(docs/elastic.md).")
    free = {d.process_index: [] for d in devices}
    for d in devices:
        free[d.process_index].append(d)
    chosen: list = [None] * need
    # Groups pinned to processes first, so unpinned groups cannot take their devices.
    order = sorted(cluster.groups, key=lambda g: g.processes is None)
    for g in order:
        ids = list(cluster.group_device_ids(g.name))
        for node in range(g.nodes):
            node_ids = ids[node * g.gpus_per_node:(node + 1) * g.gpus_per_node]
            if g.processes is not None:
                proc = g.processes[node]
                pool = free.get(proc, [])
                if len(pool) < g.gpus_per_node:
                    raise DeviceBindingError(
                        f"cluster {cluster.name!r}: group {g.name!r} node {node} is pinned "
                        f"to process {proc}, which has {len(pool)} free devices but the node "
                        f"needs {g.gpus_per_node} (processes with devices: {sorted(free)})")
                for i in node_ids:
                    chosen[i] = pool.pop(0)
            else:
                for i in node_ids:
                    proc = next(p for p in sorted(free) if free[p])
                    chosen[i] = free[proc].pop(0)
    return BoundCluster(cluster, tuple(chosen))
