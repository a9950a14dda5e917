"""Cluster specs: groups of identical nodes, and the links between them.

A cluster is a tuple of :class:`Group`\\ s. A group is ``nodes`` nodes of
``gpus_per_node`` GPUs of one type. Bandwidths are GB/s in one direction:
``intra_node_gbs`` per GPU inside a node, ``inter_node_gbs`` per node between
nodes of the group, ``inter_group_gbs`` per node between groups. Device ids are
global and dense: group by group in spec order, node-major within a group.
The file format is documented in ``docs/cluster-spec.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hetshard.cluster.binding import BoundCluster, bind
from hetshard.cluster.catalog import (
    CATALOG,
    DeviceType,
    device_type,
    device_type_for_kind,
    device_type_from_dict,
)
from hetshard.cluster.fabric import DEFAULT_FABRIC, FABRICS, Fabric, fabric_from
from hetshard.cluster.presets import PRESETS, preset_spec
from hetshard.errors import SpecError, SpecParseError, UnknownNameError, check_positive
from hetshard.fileio import parse_json, read_text, write_atomic

_TOP_FIELDS = {"name": True, "groups": True, "inter_group_gbs": False,
               "inter_group_fabric": False}
# The largest cluster a spec may describe: the planner's searches and simulations
# stay within their time limit up to this size (docs/cluster-spec.md).
MAX_DEVICES = 131_072
_GROUP_FIELDS = {"name": True, "gpu": True, "nodes": True, "gpus_per_node": True,
                 "intra_node_gbs": False, "inter_node_gbs": False, "processes": False,
                 "fabric": False, "host_link_gbs": False, "host_memory_gb": False}


@dataclasses.dataclass(frozen=True)
class Group:
    """``nodes`` identical nodes of ``gpus_per_node`` GPUs of type ``gpu``.

    ``processes`` optionally names the ``jax.distributed`` process index of each
    node (multi-host runs); ``None`` means "bind in device order".
    """

    name: str
    gpu: DeviceType
    nodes: int
    gpus_per_node: int
    intra_node_gbs: float
    inter_node_gbs: float
    processes: tuple[int, ...] | None = None
    # The network between its nodes (``hetshard.cluster.fabric``): what share of
    # ``inter_node_gbs`` a collective gets by size and node count.
    fabric: Fabric = FABRICS[DEFAULT_FABRIC]
    # Each GPU's link to host memory, GB/s one direction with every GPU of the node
    # streaming, and each node's host memory in GB (None: the GPU type's usual server,
    # ``DeviceType.host_link_gbs`` and ``host_memory_gb`` per GPU): what plans that
    # offload state or activations to the host move and hold.
    host_link_gbs: float | None = None
    host_memory_gb: float | None = None

    @property
    def num_devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def host_link(self) -> float:
        """GB/s one direction between one GPU and its host's memory."""
        return self.host_link_gbs if self.host_link_gbs is not None else \
            self.gpu.host_link_gbs

    @property
    def host_memory_bytes(self) -> float:
        """Host memory of one node, bytes."""
        gb = self.host_memory_gb if self.host_memory_gb is not None else \
            self.gpu.host_memory_gb * self.gpus_per_node
        return gb * 1e9


@dataclasses.dataclass(frozen=True)
class DeviceSlot:
    """One GPU of a cluster spec: its global id, group, node within the group, index in node."""

    id: int
    group: str
    node: int
    local: int


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A (possibly heterogeneous) cluster. Build with :meth:`load`."""

    name: str
    groups: tuple[Group, ...]
    inter_group_gbs: float
    inter_group_fabric: Fabric = FABRICS[DEFAULT_FABRIC]

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return sum(g.num_devices for g in self.groups)

    @property
    def device_types(self) -> tuple[DeviceType, ...]:
        seen: dict[str, DeviceType] = {}
        for g in self.groups:
            seen.setdefault(g.gpu.name, g.gpu)
        return tuple(seen.values())

    @property
    def is_homogeneous(self) -> bool:
        return len(self.device_types) == 1

    def group(self, name: str) -> Group:
        g = self._by_name.get(name)
        if g is not None:
            return g
        raise UnknownNameError("group", name, [g.name for g in self.groups],
                               where=f"cluster {self.name!r}")

    @functools.cached_property
    def _by_name(self) -> dict[str, Group]:
        return {g.name: g for g in self.groups}

    def slots(self) -> list[DeviceSlot]:
        """Every GPU of the spec in global id order (computed once per cluster)."""
        return list(self._slots)

    @functools.cached_property
    def _slots(self) -> tuple[DeviceSlot, ...]:
        out, i = [], 0
        for g in self.groups:
            for node in range(g.nodes):
                for local in range(g.gpus_per_node):
                    out.append(DeviceSlot(i, g.name, node, local))
                    i += 1
        return tuple(out)

    def slot(self, device_id: int) -> DeviceSlot:
        return self._slots[device_id]

    def gpu_of(self, device_id: int) -> DeviceType:
        """The GPU type of device ``device_id``."""
        return self._by_name[self._slots[device_id].group].gpu

    def group_device_ids(self, name: str) -> range:
        start = 0
        for g in self.groups:
            if g.name == name:
                return range(start, start + g.num_devices)
            start += g.num_devices
        raise UnknownNameError("group", name, [g.name for g in self.groups],
                               where=f"cluster {self.name!r}")

    def shrunk(self, num_devices: int) -> Cluster:
        """The cluster of this spec's first ``num_devices`` GPUs in device-id order (what
        is left when the last ones are gone): whole nodes kept, a node cut short becomes
        a group of its own (``<group>-partial``), later groups dropped.

        Raises:
          SpecError: ``num_devices`` not between 1 and this cluster's count.
        """
        if isinstance(num_devices, bool) or not isinstance(num_devices, int) or not (
                1 <= num_devices <= self.num_devices):
            raise SpecError("num_devices", num_devices,
                            f"1 to the cluster's {self.num_devices} devices")
        left, groups = num_devices, []
        for g in self.groups:
            if left <= 0:
                break
            whole = min(g.nodes, left // g.gpus_per_node)
            if whole:
                groups.append(dataclasses.replace(
                    g, nodes=whole, processes=g.processes[:whole] if g.processes else None))
                left -= whole * g.gpus_per_node
            if whole < g.nodes and 0 < left < g.gpus_per_node:
                groups.append(dataclasses.replace(
                    g, name=f"{g.name}-partial", nodes=1, gpus_per_node=left,
                    processes=(g.processes[whole],) if g.processes else None))
                left = 0
        return dataclasses.replace(self, name=f"{self.name}-first{num_devices}",
                                   groups=tuple(groups))

    def peak_flops(self, dtype: str = "bfloat16") -> float:
        """Aggregate peak FLOP/s of every GPU in the cluster."""
        return sum(g.num_devices * g.gpu.peak_flops(dtype) for g in self.groups)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def load(cls, source: str | os.PathLike | Mapping | Cluster) -> Cluster:
        """A cluster from a preset name, a JSON/TOML file path, JSON text or a dict."""
        if isinstance(source, Cluster):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        if isinstance(source, os.PathLike):
            return cls.from_file(source)
        if not isinstance(source, str):
            raise SpecError("cluster", source, "a preset name, a path, JSON text, a dict "
                            "or a Cluster")
        if source.lstrip().startswith("{"):
            return cls.from_json(source)
        if source in PRESETS or re.fullmatch(r"(dgx|p5|a3mega)-[a-z0-9-]+-x\d+", source):
            return preset(source)
        if os.path.exists(source) or source.endswith((".json", ".toml")):
            return cls.from_file(source)
        raise UnknownNameError("cluster", source, list(PRESETS) + ["<path>.json",
                               "<path>.toml"], where="Cluster.load")

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Cluster:
        path = Path(path)
        text = read_text(path, "cluster")
        if path.suffix == ".toml":
            return cls.from_toml(text, source=str(path))
        return cls.from_json(text, source=str(path))

    @classmethod
    def from_json(cls, text: str, *, source: str = "cluster JSON") -> Cluster:
        return cls.from_dict(parse_json(text, source), source=source)

    @classmethod
    def from_toml(cls, text: str, *, source: str = "cluster TOML") -> Cluster:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            m = re.search(r"line (\d+)", str(e))
            raise SpecParseError(source, str(e), line=int(m.group(1)) if m else None) from None
        return cls.from_dict(data, source=source)

    @classmethod
    def from_dict(cls, data: Mapping, *, source: str = "cluster spec") -> Cluster:
        if not isinstance(data, Mapping):
            raise SpecError("(top level)", type(data).__name__, "an object with 'name' and "
                            "'groups'", where=source)
        _check_fields(data, _TOP_FIELDS, "", source)
        name = data["name"]
        if not isinstance(name, str) or not name:
            raise SpecError("name", name, "a non-empty string", where=source)
        groups_in = data["groups"]
        if not isinstance(groups_in, list) or not groups_in:
            raise SpecError("groups", groups_in, "a non-empty list of groups (an empty "
                            "cluster has nothing to run on)", where=source)
        groups: list[Group] = []
        for i, g in enumerate(groups_in):
            groups.append(_group_from_dict(g, f"groups[{i}]", source))
        names = [g.name for g in groups]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise SpecError(f"groups[{i}].name", n, "a group name not used by another "
                                "group", where=source)
        total = sum(g.num_devices for g in groups)
        if total > MAX_DEVICES:
            raise SpecError("groups[*].nodes*gpus_per_node", total,
                            f"at most {MAX_DEVICES:,} GPUs in all (the cluster size hetshard "
                            f"plans within its time limit)", where=source)
        if "inter_group_gbs" in data:
            inter_group = check_positive("inter_group_gbs", data["inter_group_gbs"],
                                         where=source)
        else:
            inter_group = min(g.inter_node_gbs for g in groups)
        fabric = fabric_from(data.get("inter_group_fabric", DEFAULT_FABRIC),
                             "inter_group_fabric", source)
        return cls(name=name, groups=tuple(groups), inter_group_gbs=float(inter_group),
                   inter_group_fabric=fabric)

    @classmethod
    def from_jax_devices(cls, devices=None, *, name: str = "local") -> Cluster:
        """The cluster of the given (default: all) JAX devices, across processes.

        Devices are grouped by (``device_kind``, devices per process): each
        process is one node. ``device_kind`` maps to the catalog; an unknown
        kind raises :class:`UnknownNameError`.
        """
        import jax

        devices = list(jax.devices() if devices is None else devices)
        if not devices:
            raise SpecError("devices", devices, "at least one JAX device")
        per_proc: dict[tuple[str, int], int] = {}
        for d in devices:
            key = (d.device_kind, d.process_index)
            per_proc[key] = per_proc.get(key, 0) + 1
        shapes: dict[tuple[str, int], list[int]] = {}
        for (kind, proc), count in sorted(per_proc.items(), key=lambda kv: kv[0][1]):
            shapes.setdefault((kind, count), []).append(proc)
        groups = []
        for (kind, count), procs in shapes.items():
            t = device_type_for_kind(kind)
            gname = t.name.lower() if sum(1 for k in shapes if k[0] == kind) == 1 \
                else f"{t.name.lower()}-{count}"
            groups.append(Group(gname, t, len(procs), count, t.intra_node_gbs,
                                t.inter_node_gbs, tuple(procs)))
        return cls(name, tuple(groups), min(g.inter_node_gbs for g in groups))

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        groups = []
        for g in self.groups:
            gpu: Any = g.gpu.name
            if CATALOG.get(g.gpu.name) != g.gpu:
                gpu = {k: v for k, v in g.gpu.to_dict().items()
                       if k not in ("device_kinds", "source") and v is not None}
            d = {"name": g.name, "gpu": gpu, "nodes": g.nodes, "gpus_per_node": g.gpus_per_node,
                 "intra_node_gbs": g.intra_node_gbs, "inter_node_gbs": g.inter_node_gbs}
            if g.processes is not None:
                d["processes"] = list(g.processes)
            if g.fabric != FABRICS[DEFAULT_FABRIC]:
                d["fabric"] = _fabric_value(g.fabric)
            for key in ("host_link_gbs", "host_memory_gb"):
                if getattr(g, key) is not None:
                    d[key] = getattr(g, key)
            groups.append(d)
        out = {"name": self.name, "groups": groups, "inter_group_gbs": self.inter_group_gbs}
        if self.inter_group_fabric != FABRICS[DEFAULT_FABRIC]:
            out["inter_group_fabric"] = _fabric_value(self.inter_group_fabric)
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_toml(self) -> str:
        d = self.to_dict()
        lines = [f"name = {_toml_value(d['name'])}",
                 f"inter_group_gbs = {_toml_value(d['inter_group_gbs'])}"]
        if "inter_group_fabric" in d:
            lines.append(f"inter_group_fabric = {_toml_value(d['inter_group_fabric'])}")
        for g in d["groups"]:
            lines += ["", "[[groups]]"] + [f"{k} = {_toml_value(v)}" for k, v in g.items()]
        return "\n".join(lines) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        """Writes the spec as TOML (``.toml``) or JSON (anything else), atomically."""
        path = Path(path)
        write_atomic(path, self.to_toml() if path.suffix == ".toml" else self.to_json())

    def bind(self, devices=None) -> BoundCluster:
        """Maps this spec's GPUs onto JAX devices; see :func:`hetshard.cluster.bind`."""
        return bind(self, devices)


def preset(name: str) -> Cluster:
    """Builds the preset ``name`` (see :data:`hetshard.cluster.PRESETS`; any
    ``dgx-*-x{8k}`` up to 3072)."""
    return Cluster.from_dict(preset_spec(name), source=f"preset {name!r}")


def _check_fields(data: Mapping, fields: dict[str, bool], prefix: str, source: str) -> None:
    for key in data:
        if key not in fields:
            raise SpecError(f"{prefix}{key}", data[key],
                            f"only the fields {sorted(fields)}", where=source)
    for key, required in fields.items():
        if required and key not in data:
            raise SpecError(f"{prefix}{key}", None, "a value (the field is required)",
                            where=source)


def _group_from_dict(g: Any, path: str, source: str) -> Group:
    if not isinstance(g, Mapping):
        raise SpecError(path, g, "an object with name, gpu, nodes, gpus_per_node", where=source)
    _check_fields(g, _GROUP_FIELDS, f"{path}.", source)
    name = g["name"]
    if not isinstance(name, str) or not name:
        raise SpecError(f"{path}.name", name, "a non-empty string", where=source)
    gpu_in = g["gpu"]
    try:
        if isinstance(gpu_in, Mapping):
            gpu = device_type_from_dict(gpu_in, field=f"{path}.gpu")
        elif isinstance(gpu_in, str):
            gpu = device_type(gpu_in)
        else:
            raise SpecError(f"{path}.gpu", gpu_in, "a catalog GPU name or an inline object")
    except UnknownNameError as e:
        raise UnknownNameError(f"{path}.gpu", gpu_in, CATALOG, where=source) from e
    except SpecError as e:
        raise SpecError(e.field, e.value, e.accepted, where=source) from None
    nodes = check_positive(f"{path}.nodes", g["nodes"], integer=True, where=source)
    gpn = check_positive(f"{path}.gpus_per_node", g["gpus_per_node"], integer=True, where=source)
    intra = check_positive(f"{path}.intra_node_gbs", g.get("intra_node_gbs", gpu.intra_node_gbs),
                           where=source)
    inter = check_positive(f"{path}.inter_node_gbs", g.get("inter_node_gbs", gpu.inter_node_gbs),
                           where=source)
    procs = g.get("processes")
    if procs is not None:
        if (not isinstance(procs, list) or len(procs) != nodes or
                any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in procs)):
            raise SpecError(f"{path}.processes", procs,
                            f"a list of {nodes} process indices >= 0, one per node", where=source)
        procs = tuple(procs)
    fabric = fabric_from(g.get("fabric", DEFAULT_FABRIC), f"{path}.fabric", source)
    host = {key: float(check_positive(f"{path}.{key}", g[key], where=source))
            for key in ("host_link_gbs", "host_memory_gb") if key in g}
    return Group(name, gpu, nodes, gpn, float(intra), float(inter), procs, fabric, **host)


def _fabric_value(f: Fabric) -> str | dict:
    """A fabric as a spec writes it: its name if built in, else its fields."""
    return f.name if FABRICS.get(f.name) == f else f.to_dict()


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()
                                if x is not None) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")
