"""Communication costs on a cluster's links.

Collectives use the standard ring formulas (Thakur et al. 2005; NCCL's
"bus bandwidth" convention): for n participants and S bytes,
all-reduce moves 2(n-1)/n * S per device, all-gather and reduce-scatter
(n-1)/n * S, all-to-all (n-1)/n * S. A collective spanning several nodes is priced
hierarchically (reduce-scatter inside each node, all-reduce across nodes on 1/g of the
data, all-gather inside nodes, the two pipelined), which is what NCCL's tree/ring
hybrids achieve on multi-NIC nodes. Inside a node, bandwidths are the link's (GB/s, one
direction) scaled by the calibration's ``comm_eff``, and each ring step costs
``intra_latency_s``. Across
nodes the network's :class:`~hetshard.cluster.fabric.Fabric` decides: the share of the
line rate an all-reduce of that buffer size gets over that many nodes (or the cluster's
measured collective profile), and one latency per algorithm step, with NCCL's choice of
a ring (2(k-1) steps over k nodes) or a tree (2 log2 k) for all-reduce, whichever is
faster; all-gather and reduce-scatter run as rings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from hetshard.cluster.fabric import DEFAULT_FABRIC, FABRICS, Fabric
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import Calibration
from hetshard.errors import SpecError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# XLA combines independent all-reduces (and all-gathers, reduce-scatters) into one
# collective up to this many bytes (``kDefaultAllReduceCombineThreshold``,
# xla/service/collective_utils.h, 30 MiB): a step's gradient sync runs as buckets of at
# most this size, each paying its own latency and its size's bandwidth.
COMBINE_BYTES = 30 * 2**20


def buckets(sizes: Sequence[float]) -> list[tuple[int, float]]:
    """The collectives a gradient sync of ``sizes`` (bytes per piece, in the order the
    pieces become ready: a stage's layers last first) runs as: ``(index of the piece that
    completes the bucket, bytes)``. Consecutive pieces are combined while they stay
    within :data:`COMBINE_BYTES`; a piece beyond it runs alone, in equal parts of at
    most that size (one collective per weight, a weight above the threshold in one)."""
    out: list[tuple[int, float]] = []
    pending, last = 0.0, -1
    for i, size in enumerate(sizes):
        if size <= 0:
            continue
        if pending and pending + size > COMBINE_BYTES:
            out.append((last, pending))
            pending = 0.0
        if size > COMBINE_BYTES:
            parts = math.ceil(size / COMBINE_BYTES)
            out.extend((i, size / parts) for _ in range(parts))
            continue
        pending, last = pending + size, i
    if pending:
        out.append((last, pending))
    return out


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where a set of devices sits: GPUs per node used, nodes, and the bottleneck links."""

    n: int
    per_node: int
    nodes: int
    intra_gbs: float
    inter_gbs: float  # per node, one direction (already the min over groups crossed)
    groups: int
    fabric: Fabric = FABRICS[DEFAULT_FABRIC]  # the network crossed (between groups: theirs)


def topology(cluster: Cluster, device_ids: Sequence[int]) -> Topology:
    if not device_ids:
        raise SpecError("device_ids", list(device_ids), "at least one device")
    nodes: dict[tuple[str, int], int] = {}
    groups = set()
    for i in device_ids:
        s = cluster.slot(i)
        nodes[(s.group, s.node)] = nodes.get((s.group, s.node), 0) + 1
        groups.add(s.group)
    gs = [cluster.group(g) for g in sorted(groups)]
    inter = min(g.inter_node_gbs for g in gs)
    fabric = min(gs, key=lambda g: g.inter_node_gbs).fabric
    if len(groups) > 1:
        inter = min(inter, cluster.inter_group_gbs)
        fabric = cluster.inter_group_fabric
    return Topology(n=len(device_ids), per_node=max(nodes.values()), nodes=len(nodes),
                    intra_gbs=min(g.intra_node_gbs for g in gs), inter_gbs=inter,
                    groups=len(groups), fabric=fabric)


def _ring(volume_factor: float, nbytes: float, n: int, gbs: float, latency_s: float,
          steps: int) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return volume_factor * nbytes / (gbs * 1e9) + steps * latency_s


def collective_time(kind: str, nbytes: float, topo: Topology, cal: Calibration,
                    gpu_name: str, concurrent: int = 1) -> float:
    """Seconds for collective ``kind`` over ``topo`` of a buffer of ``nbytes`` per device
    (the full, unsharded size for all-gather outputs and reduce-scatter inputs).
    ``concurrent``: how many such collectives run at once over the same nodes (one per
    tensor rank for a tensor-parallel stage's data-parallel gradient sync): they share
    each node's network, so the part that crosses nodes takes that many times longer."""
    if kind not in COLLECTIVES:
        raise SpecError("collective", kind, f"one of {COLLECTIVES}")
    e = cal.for_type(gpu_name)
    n, g, k = topo.n, topo.per_node, topo.nodes
    intra = topo.intra_gbs * e.comm_eff
    if n <= 1 or nbytes <= 0:
        return 0.0
    if k == 1:
        if kind == "all_to_all":
            return _ring((n - 1) / n, nbytes, n, intra, e.intra_latency_s, n - 1)
        half = kind != "all_reduce"
        return _ring((1.0 if half else 2.0) * (n - 1) / n, nbytes, n, intra,
                     e.intra_latency_s, (1 if half else 2) * (n - 1))
    fab = topo.fabric
    # The ``concurrent`` rings load each node's cards as one collective of their summed
    # buffers would (nccl-tests' per-GPU buffer with every GPU of the node taking part:
    # a hierarchical all-reduce is such rings, one per local rank, on 1/g of it each), so
    # the share of the line rate is that buffer's, split among them.
    c = max(1, concurrent)
    if fab.measured and kind != "all_to_all":
        # The cluster's own nccl-tests figures: the whole collective at its measured bus
        # bandwidth (latency included), the nodes' cards shared by the rings.
        busbw = fab.measured_busbw(k, nbytes * c) * 1e9 / c
        return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * nbytes / busbw
    lat = e.inter_latency_s if fab.latency_s is None else fab.latency_s
    inter = topo.inter_gbs * fab.share(k, nbytes * c) / c
    if kind == "all_to_all":
        # The share leaving the node crosses the NIC, shared by the node's g GPUs.
        return _ring((n - g) / n * g, nbytes, n, inter, lat, n - 1)
    half = kind != "all_reduce"
    factor = 1.0 if half else 2.0
    # Inside the nodes the GPUs' links carry factor*(g-1)/g of the buffer; across nodes
    # each node moves its GPUs' 1/g-th shards over its NICs together, factor*(k-1)/k of
    # the buffer per node over inter_gbs. NCCL pipelines the two (chunks leave a node
    # while the next ones are still being reduced inside it): the slower sets the pace.
    # Latency: the node's ring steps, then NCCL's tree across nodes for an all-reduce
    # where its 2 log2 k steps beat the ring's 2 (k - 1).
    t_intra = factor * (g - 1) / g * nbytes / (intra * 1e9) if g > 1 else 0.0
    t_inter = factor * (k - 1) / k * nbytes / (inter * 1e9)
    steps = (k - 1) if half else min(2 * (k - 1), 2 * math.ceil(math.log2(k)))
    return max(t_intra, t_inter) + (1 if half else 2) * (g - 1) * e.intra_latency_s + \
        steps * lat


def p2p_time(nbytes: float, cluster: Cluster, src: Sequence[int], dst: Sequence[int],
             cal: Calibration) -> float:
    """Seconds to send an activation of ``nbytes`` (in total) from devices ``src`` to
    ``dst`` (pipeline send): same node -> NVLink/PCIe; else the nodes' NICs, or the link
    between groups."""
    if nbytes <= 0:
        return 0.0
    a = cluster.slot(src[0])
    e = cal.for_type(cluster.group(a.group).gpu.name)
    src_nodes = {(cluster.slot(d).group, cluster.slot(d).node) for d in src}
    dst_nodes = {(cluster.slot(d).group, cluster.slot(d).node) for d in dst}
    if src_nodes == dst_nodes and len(src_nodes) == 1:
        # Each of the stage's devices sends its share over its own link.
        return nbytes / len(src) / (cluster.group(a.group).intra_node_gbs * 1e9 * e.comm_eff) \
            + e.intra_latency_s
    groups = sorted({g for g, _ in src_nodes | dst_nodes})
    gbs = min(cluster.group(g).inter_node_gbs for g in groups)
    fab = min((cluster.group(g) for g in groups), key=lambda g: g.inter_node_gbs).fabric
    if len(groups) > 1:
        gbs = min(gbs, cluster.inter_group_gbs)
        fab = cluster.inter_group_fabric
    # A stage spread over several nodes sends each node's share through its own network
    # card, in parallel (as many streams as the smaller side has nodes).
    streams = min(len(src_nodes), len(dst_nodes))
    share = fab.share(2, nbytes / streams)
    if share is None:  # a measured profile: two nodes' all-reduce bus bandwidth
        share = fab.measured_busbw(2, nbytes / streams) / gbs
    lat = e.inter_latency_s if fab.latency_s is None else fab.latency_s
    return nbytes / (gbs * 1e9 * share * streams) + lat
