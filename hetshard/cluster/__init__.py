"""Clusters: GPU catalog, specs, presets and binding onto JAX devices."""

from hetshard.cluster.binding import BoundCluster, bind
from hetshard.cluster.catalog import CATALOG, DeviceType, device_type
from hetshard.cluster.presets import PRESETS
from hetshard.cluster.spec import Cluster, DeviceSlot, Group, preset

__all__ = ["CATALOG", "BoundCluster", "Cluster", "DeviceSlot", "DeviceType", "Group",
           "PRESETS", "bind", "device_type", "preset"]
