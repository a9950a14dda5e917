"""The network between nodes: how much of its line rate a collective gets, by message size
and node count.

A :class:`Fabric` describes what NCCL measures on a node-to-node network (nccl-tests'
bus bandwidth, 8 GPUs a node): the share of the line rate a large all-reduce reaches on
two nodes (``efficiency``), the buffer size at which it reaches half of that
(``half_bytes``: a transfer's fixed costs are amortised over its size), the time of one
step of the algorithm on small messages (``latency_s``), and how the bus bandwidth
falls with the node count (``scaling``: congestion and flow collisions on
Ethernet-class fabrics; none measured on InfiniBand with adaptive routing). A
``measured`` collective profile (nccl-tests' all-reduce bus bandwidth by node count and
size on the user's own cluster) replaces the curves where given.

Every built-in fabric names its source. ``hetshard.cost.comm`` turns them into times.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from hetshard.errors import SpecError, UnknownNameError


@dataclasses.dataclass(frozen=True)
class Fabric:
    name: str
    efficiency: float  # large all-reduce bus bandwidth / line rate, two nodes
    half_bytes: float  # per-GPU buffer at which two nodes reach half that bandwidth
    latency_s: float | None = None  # one algorithm step (None: the calibration's)
    # (nodes, bus bandwidth relative to two nodes), measured; log-interpolated in nodes,
    # the last doubling's ratio continued beyond the last point
    scaling: tuple[tuple[int, float], ...] = ()
    # (nodes, per-GPU buffer bytes, all-reduce bus bandwidth GB/s), nccl-tests on the
    # user's cluster (8 GPUs a node unless the cluster says otherwise)
    measured: tuple[tuple[int, float, float], ...] = ()
    source: str = ""

    def scale(self, nodes: int) -> float:
        """Bus bandwidth at ``nodes`` relative to two nodes."""
        pts = sorted(self.scaling)
        if nodes <= 2 or not pts:
            return 1.0
        x = math.log2(nodes)
        xs = [math.log2(n) for n, _ in pts]
        ys = [math.log(v) for _, v in pts]
        if x <= xs[0]:
            lo = (1.0, 0.0)  # two nodes: 1
            return math.exp(lo[1] + (ys[0] - lo[1]) * (x - lo[0]) / (xs[0] - lo[0]))
        for i in range(1, len(xs)):
            if x <= xs[i]:
                return math.exp(ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1])
                                / (xs[i] - xs[i - 1]))
        if len(xs) == 1:
            slope = ys[0] / max(xs[0] - 1.0, 1e-9)
        else:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return math.exp(ys[-1] + slope * (x - xs[-1]))

    def share(self, nodes: int, nbytes: float) -> float | None:
        """Share of the line rate an all-reduce of ``nbytes`` a GPU over ``nodes`` nodes
        gets, from the curves; None where a ``measured`` profile decides instead."""
        if self.measured:
            return None
        size = max(float(nbytes), 1.0)
        return self.efficiency * size / (size + self.half_bytes) * self.scale(nodes)

    def measured_busbw(self, nodes: int, nbytes: float) -> float:
        """All-reduce bus bandwidth (GB/s) from the ``measured`` profile: interpolated in
        log size between the two nearest sizes of the nearest node counts (log-linear in
        nodes between them), sizes beyond the measured ones clamped, node counts beyond
        them continued by ``scaling`` (flat without one)."""
        by_nodes: dict[int, list[tuple[float, float]]] = {}
        for n, b, bw in self.measured:
            by_nodes.setdefault(int(n), []).append((float(b), float(bw)))
        counts = sorted(by_nodes)

        def at(n):
            pts = sorted(by_nodes[n])
            x = math.log(max(float(nbytes), 1.0))
            if x <= math.log(pts[0][0]):
                # below the smallest size: the time floor holds (bandwidth ~ size)
                return pts[0][1] * max(float(nbytes), 1.0) / pts[0][0]
            for (b0, w0), (b1, w1) in zip(pts, pts[1:], strict=False):
                if x <= math.log(b1):
                    f = (x - math.log(b0)) / (math.log(b1) - math.log(b0))
                    return math.exp(math.log(w0) + f * (math.log(w1) - math.log(w0)))
            return pts[-1][1]
        if nodes <= counts[0]:
            return at(counts[0])
        if nodes >= counts[-1]:
            return at(counts[-1]) * self.scale(nodes) / self.scale(counts[-1])
        for n0, n1 in zip(counts, counts[1:], strict=False):
            if nodes <= n1:
                f = (math.log2(nodes) - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
                return math.exp(math.log(at(n0)) + f * (math.log(at(n1)) - math.log(at(n0))))
        return at(counts[-1])

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "efficiency": self.efficiency,
                             "half_bytes": self.half_bytes}
        if self.latency_s is not None:
            d["latency_s"] = self.latency_s
        if self.scaling:
            d["scaling"] = [list(p) for p in self.scaling]
        if self.measured:
            d["measured"] = [list(p) for p in self.measured]
        return d


# InfiniBand (HDR / NDR, GPUDirect RDMA): NVIDIA's NCCL team gives 46-48 GB/s of bus
# bandwidth per 400 Gb/s NDR NIC (NVIDIA/nccl-tests#290), 0.92-0.96 of line rate; a
# two-node H100 all-reduce over NDR reaches 18.5 / 27.2 / 36.2 / 39.9 / 41.3 GB/s at
# 2 / 4 / 8 / 16 / 32 MiB (NVIDIA/nccl-tests#232, one GPU a node, 4 NICs), half its
# large-message rate near 2 MiB. No fall with node count (adaptive routing): none given.
_IB = Fabric("infiniband", 0.94, 2 * 2**20,
             source="NVIDIA/nccl-tests#290 (46-48 GB/s per NDR NIC), #232 (size sweep)")
# AWS EFA (SRD over Ethernet): on p3dn.24xlarge (100 Gb/s EFA) NCCL reached 80 Gb/s on 2
# nodes and 50-60 Gb/s from 8 to 32 nodes (NVIDIA/nccl#235); 8 nodes gave 70% and 16
# nodes 60% of on-premise InfiniBand (aws/aws-ofi-nccl#19; InfiniBand's 0.94 of 100
# Gb/s: 66 and 56 Gb/s). Relative to 2 nodes: 8 nodes 0.78, 16 0.7, 32 0.625.
_EFA = Fabric("efa", 0.8, 2 * 2**20,
              scaling=((8, 0.78), (16, 0.7), (32, 0.625)),
              source="NVIDIA/nccl#235, aws/aws-ofi-nccl#19 (p3dn EFA, 2-32 nodes)")
# RoCE v2: no published NCCL node-count sweep at hand; InfiniBand's curves (give a
# measured profile for your cluster).
_ROCE = dataclasses.replace(_IB, name="roce",
                            source="InfiniBand's curves (no RoCE sweep published at hand)")
# GCP A3 Mega (H100, 8 x 200 Gb/s GPUDirect-TCPXO): nccl-tests all_reduce_perf on 2
# nodes x 8 GPUs, out of place (github.com/lessizzmore/create-a3mega-ztan-fork,
# ztan-NCCL-test-result): 123 us below 64 KiB, busbw 9.7 GB/s at 1 MiB, 32.2 at 16 MiB,
# 152 at 128 MiB, 298 at 1 GiB, 339 at 8 GiB.
_A3_MEGA = Fabric(
    "gcp-tcpxo", 0.85, 64 * 2**20, latency_s=60e-6,
    measured=((2, 1 << 20, 9.68), (2, 4 << 20, 21.57), (2, 16 << 20, 32.18),
              (2, 64 << 20, 99.74), (2, 128 << 20, 152.32), (2, 256 << 20, 213.19),
              (2, 512 << 20, 263.69), (2, 1 << 30, 297.86), (2, 2 << 30, 318.40),
              (2, 8 << 30, 338.82)),
    source="github.com/lessizzmore/create-a3mega-ztan-fork ztan-NCCL-test-result")



def _sailor_fit(coeffs: tuple[float, float, float], cap_bytes_s: float,
                gpus_per_node: int) -> tuple[tuple[int, float, float], ...]:
    """A ``measured`` profile from one of Sailor's point-to-point fits between two VMs
    (github.com/eth-easl/sailor, sailor/providers/multizone_bandwidths_het.json: bandwidth
    in GB/s a quadratic in log2 of the message in MB, measured with its
    profiling/networking tools, capped at the largest measured rate), read as Sailor's
    simulator reads it for an all-reduce (``estimate_ar_time``: a ring over the
    workers, each step one message of the buffer over their number): the bus bandwidth
    of a buffer of b bytes a GPU over k nodes is the fit's rate at b / (k g) bytes, g
    GPUs a node. Below 1/8 MB (the fit's curve turns down beyond its data) a message
    takes that size's time."""
    a, b, c = coeffs

    def rate(nbytes: float) -> float:  # GB/s
        mb = max(nbytes / 1e6, 0.125)
        x = math.log2(mb)
        gbs = min(a * x * x + b * x + c, cap_bytes_s / 1e9)
        return gbs * (nbytes / 1e6) / mb  # below 1/8 MB: the same time as 1/8 MB
    out = []
    for k in (2, 4, 8, 16, 32, 64, 128, 256):
        for e in range(16, 36, 2):
            out.append((k, float(2 ** e), round(rate(2 ** e / (k * gpus_per_node)), 4)))
    return tuple(out)


# Google Cloud, zone us-central1-a, VMs of 4 GPUs (a2-highgpu-4g with A100-40GB, n1 with 4
# V100-16GB): Sailor's measured fits (commit cf2c8e3); A100 VMs between themselves reach
# 6.04 GB/s, V100 VMs (and A100 to V100) 5.79 GB/s, both well below at small messages
# (4.6 and 3.4 GB/s at 1 MB, 2.8 and 2.4 at 1/8 MB). Sailor's Fig 8b clusters.
_SAILOR = "github.com/eth-easl/sailor@cf2c8e3 sailor/providers/multizone_bandwidths_het.json"
_GCP_A100 = Fabric("gcp-a2-a100x4", 1.0, 1.0, measured=_sailor_fit(
    (-0.03667895496478979, 0.4773282044079026, 4.5592610071684785), 6035913051.04673, 4),
    source=_SAILOR + " (us-central1-a, A100-40 x4 to A100-40 x4)")
_GCP_V100 = Fabric("gcp-n1-v100x4", 1.0, 1.0, measured=_sailor_fit(
    (-0.008450897567554275, 0.32345407867588116, 3.446937175278422), 5787468328.312377, 4),
    source=_SAILOR + " (us-central1-a, V100-16 x4 to V100-16 x4 and to A100-40 x4)")

FABRICS: dict[str, Fabric] = {f.name: f for f in (_IB, _EFA, _ROCE, _A3_MEGA, _GCP_A100,
                                                  _GCP_V100)}
DEFAULT_FABRIC = "infiniband"
_FIELDS = {"name", "efficiency", "half_bytes", "latency_s", "scaling", "measured"}


def fabric_from(value: Any, field: str = "fabric", where: str = "") -> Fabric:
    """A fabric from a spec value: a built-in name (:data:`FABRICS`) or an object with
    ``name``, ``efficiency``, ``half_bytes`` and optionally ``latency_s``, ``scaling``
    (``[[nodes, relative bus bandwidth], ...]``) and ``measured`` (``[[nodes, bytes,
    busbw GB/s], ...]``)."""
    if isinstance(value, Fabric):
        return value
    if isinstance(value, str):
        if value in FABRICS:
            return FABRICS[value]
        raise UnknownNameError(field, value, FABRICS, where=where)
    if not isinstance(value, Mapping):
        raise SpecError(field, value, f"a fabric name ({', '.join(FABRICS)}) or an object",
                        where=where)
    extra = sorted(set(value) - _FIELDS)
    if extra:
        raise SpecError(f"{field}.{extra[0]}", value[extra[0]], f"only the fields "
                        f"{sorted(_FIELDS)}", where=where)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError(f"{field}.name", name, "a non-empty string", where=where)
    eff = value.get("efficiency", 1.0 if "measured" in value else None)
    if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
        raise SpecError(f"{field}.efficiency", eff, "a share of the line rate in (0, 1]",
                        where=where)
    half = value.get("half_bytes", 1.0 if "measured" in value else None)
    if isinstance(half, bool) or not isinstance(half, (int, float)) or half <= 0:
        raise SpecError(f"{field}.half_bytes", half, "a positive number of bytes",
                        where=where)
    lat = value.get("latency_s")
    if lat is not None and (isinstance(lat, bool) or not isinstance(lat, (int, float))
                            or not 0 <= lat < 1):
        raise SpecError(f"{field}.latency_s", lat, "seconds in [0, 1)", where=where)
    scaling = _points(value.get("scaling", []), f"{field}.scaling", 2,
                      "[[nodes >= 2, relative bus bandwidth > 0], ...]", where)
    measured = _points(value.get("measured", []), f"{field}.measured", 3,
                       "[[nodes >= 1, bytes > 0, busbw GB/s > 0], ...]", where)
    return Fabric(name, float(eff), float(half), None if lat is None else float(lat),
                  tuple((int(n), float(v)) for n, v in scaling),
                  tuple((int(n), float(b), float(w)) for n, b, w in measured),
                  source="cluster spec")


def _points(value, field: str, width: int, accepted: str, where: str) -> list:
    if not isinstance(value, list):
        raise SpecError(field, value, accepted, where=where)
    for i, p in enumerate(value):
        ok = isinstance(p, list) and len(p) == width and all(
            not isinstance(x, bool) and isinstance(x, (int, float)) and x > 0 for x in p)
        if ok and (p[0] != int(p[0]) or p[0] < (2 if width == 2 else 1)):
            ok = False
        if not ok:
            raise SpecError(f"{field}[{i}]", p, accepted, where=where)
    return value
