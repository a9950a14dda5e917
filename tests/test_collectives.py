"""Collectives priced as they run at scale (issue 54): bandwidth by message size, node
count and fabric; measured collective profiles in cluster specs; a gradient sync that
only the backward after each bucket hides."""

import math

import pytest

from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster import Cluster
from hetshard.cluster.fabric import FABRICS, fabric_from
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.comm import COMBINE_BYTES, buckets, collective_time, topology
from hetshard.errors import SpecError
from hetshard.sim.simulator import simulate
from hetshard_models import profile as profile_model


def _nodes(n, fabric, *, gpn=8, intra=450.0, inter=400.0, gpu="H100-80GB"):
    return Cluster.load({"name": f"{fabric}-{n}", "groups": [
        {"name": "g", "gpu": gpu, "nodes": n, "gpus_per_node": gpn, "intra_node_gbs": intra,
         "inter_node_gbs": inter, "fabric": fabric}]})


def _node_rate(cluster, nbytes):
    """What each node's network carries per second in an all-reduce of ``nbytes`` a GPU
    over the whole cluster (the hierarchical all-reduce moves 2(k-1)/k of the buffer
    across each node's cards)."""
    topo = topology(cluster, range(cluster.num_devices))
    k = topo.nodes
    t = collective_time("all_reduce", nbytes, topo, DEFAULT, cluster.groups[0].gpu.name)
    return 2 * (k - 1) / k * nbytes / t


def test_an_all_reduce_on_efa_falls_with_node_count_as_its_source_measured():
    """NVIDIA/nccl#235 (p3dn, 100 Gb/s EFA): 80 Gb/s on 2 nodes, 50-60 Gb/s from 8 to 32
    nodes; aws/aws-ofi-nccl#19: 70% and 60% of InfiniBand at 8 and 16 nodes. Nodes
    whose NVLink is far faster than the card, so the network sets the pace."""
    size = 1 << 30
    rate = {n: _node_rate(_nodes(n, "efa", gpu="V100-32GB", intra=10_000, inter=12.5), size)
            for n in (2, 8, 16, 32, 64)}
    assert rate[2] == pytest.approx(10e9, rel=0.02)  # 80 Gb/s
    for n in (8, 16, 32):
        assert 6.2e9 <= rate[n] <= 8.3e9, (n, rate[n])  # 50-66 Gb/s
    assert rate[2] > rate[8] > rate[16] > rate[32] > rate[64]
    # one node: NVLink only, far above any node count's network rate
    one = _nodes(1, "efa", gpu="V100-32GB", intra=150, inter=12.5)
    t1 = collective_time("all_reduce", size, topology(one, range(8)), DEFAULT, "V100-32GB")
    assert 2 * 7 / 8 * size / t1 > 10 * rate[2]


def test_an_all_reduce_on_infiniband_stays_within_nvidias_figures_at_any_scale():
    """NVIDIA/nccl-tests#290: 46-48 GB/s of bus bandwidth per 400 Gb/s NDR card."""
    for n in (2, 8, 64):
        per_card = _node_rate(_nodes(n, "infiniband", intra=100_000), 8 << 30) / 8
        assert 46e9 <= per_card <= 48e9, (n, per_card)


def test_small_buffers_get_a_smaller_share_of_the_network():
    c = _nodes(4, "infiniband", intra=100_000)
    rates = [_node_rate(c, b) for b in (256 << 10, 2 << 20, 64 << 20, 1 << 30)]
    assert rates == sorted(rates) and rates[0] < 0.2 * rates[-1]
    # NVIDIA/nccl-tests#232 (2 nodes, NDR): 18.5, 27.2, 36.2, 39.9 GB/s at 2, 4, 8, 16 MiB
    # against 41.3 at 32 MiB; the curve's shares relative to 32 MiB within 0.1 of those.
    ib = FABRICS["infiniband"]
    for mib, busbw in ((2, 18.53), (4, 27.16), (8, 36.24), (16, 39.90)):
        got = ib.share(2, mib << 20) / ib.share(2, 32 << 20)
        assert got == pytest.approx(busbw / 41.31, abs=0.1), mib


def test_a_measured_collective_profile_prices_the_cluster_as_measured():
    """GCP A3 Mega (nccl-tests, 2 nodes x 8 H100): 297.86 GB/s bus bandwidth at 1 GiB,
    32.18 at 16 MiB, 99.74 at 64 MiB."""
    c = Cluster.load("a3mega-h100-x16")
    topo = topology(c, range(16))
    for size, busbw in ((1 << 30, 297.86), (16 << 20, 32.18), (64 << 20, 99.74)):
        t = collective_time("all_reduce", size, topo, DEFAULT, "H100-80GB")
        assert 2 * 15 / 16 * size / t == pytest.approx(busbw * 1e9, rel=1e-9)
    # between measured sizes: log-interpolated, so between its neighbours
    t = collective_time("all_reduce", 32 << 20, topo, DEFAULT, "H100-80GB")
    assert 32.18e9 < 2 * 15 / 16 * (32 << 20) / t < 99.74e9


def test_a_cluster_spec_carries_its_fabric_and_profile_through_json_and_toml(tmp_path):
    profile = {"name": "ours", "measured": [[2, 1048576, 20.0], [2, 1073741824, 300.0],
                                            [8, 1073741824, 250.0]]}
    spec = {"name": "c", "groups": [{"name": "g", "gpu": "H100-80GB", "nodes": 8,
                                     "gpus_per_node": 8, "fabric": profile}],
            "inter_group_fabric": "efa"}
    c = Cluster.from_dict(spec)
    assert c.groups[0].fabric.measured[2] == (8, 1073741824.0, 250.0)
    assert c.inter_group_fabric is FABRICS["efa"]
    for name in ("c.json", "c.toml"):
        c.save(tmp_path / name)
        assert Cluster.load(str(tmp_path / name)) == c
    # 4 nodes: between the 2- and 8-node measurements at 1 GiB
    four = fabric_from(profile)
    assert 250.0 < four.measured_busbw(4, 1 << 30) < 300.0


@pytest.mark.parametrize("fabric,field", [
    ("ethernet-ish", "fabric"),
    ({"name": "x", "efficiency": 1.5, "half_bytes": 1e6}, "fabric.efficiency"),
    ({"name": "x", "efficiency": 0.9}, "fabric.half_bytes"),
    ({"name": "x", "efficiency": 0.9, "half_bytes": 1e6, "scaling": [[1, 0.9]]},
     "fabric.scaling[0]"),
    ({"name": "x", "measured": [[2, 1e6]]}, "fabric.measured[0]"),
    ({"name": "x", "measured": [[2, -1, 3.0]]}, "fabric.measured[0]"),
    ({"name": "x", "measured": "fast"}, "fabric.measured"),
    ({"name": "x", "efficiency": 0.9, "half_bytes": 1e6, "speed": 3}, "fabric.speed"),
])
def test_a_malformed_fabric_is_refused_naming_its_field(fabric, field):
    spec = {"name": "c", "groups": [{"name": "g", "gpu": "H100-80GB", "nodes": 2,
                                     "gpus_per_node": 8, "fabric": fabric}]}
    with pytest.raises(SpecError) as e:
        Cluster.from_dict(spec)
    assert e.value.field == f"groups[0].{field}"


def test_presets_name_their_fabric():
    assert Cluster.load("dgx-h100-x64").groups[0].fabric.name == "infiniband"
    assert Cluster.load("p5-h100-x512").groups[0].fabric.name == "efa"
    assert Cluster.load("a3mega-h100-x64").groups[0].fabric.name == "gcp-tcpxo"
    assert Cluster.load("sailor-a100-v100").groups[0].fabric.name == "gcp-a2-a100x4"
    assert Cluster.load("sailor-a100-v100").inter_group_fabric.name == "gcp-n1-v100x4"
    for f in FABRICS.values():
        assert f.source  # every built-in curve says where it comes from


@pytest.mark.parametrize("fabric,coeffs,cap", [
    ("gcp-a2-a100x4", (-0.03667895496478979, 0.4773282044079026, 4.5592610071684785),
     6.03591305104673),
    ("gcp-n1-v100x4", (-0.008450897567554275, 0.32345407867588116, 3.446937175278422),
     5.787468328312377)])
def test_sailors_cloud_fabrics_price_an_all_reduce_as_sailors_simulator(fabric, coeffs, cap):
    # Sailor's estimate_ar_time: a ring over N workers, 2 (N - 1) steps each sending
    # buffer / N at its fit's rate (GB/s, a quadratic in log2 of the MB sent, capped).
    def sailor(nbytes, workers):
        part = nbytes / workers
        x = math.log2(part / 1e6)
        rate = min(coeffs[0] * x * x + coeffs[1] * x + coeffs[2], cap)
        return 2 * (workers - 1) * part / (rate * 1e9)
    for nodes, nbytes in ((2, 2 ** 26), (8, 2 ** 28), (32, 2 ** 30), (8, 2 ** 24)):
        c = _nodes(nodes, fabric, gpn=4, gpu="A100-40GB", inter=cap)
        topo = topology(c, range(c.num_devices))
        got = collective_time("all_reduce", nbytes, topo, DEFAULT, "A100-40GB")
        assert got == pytest.approx(sailor(nbytes, 4 * nodes), rel=1e-3), (nodes, nbytes)
    # Small messages fall well below the cap, as Sailor measured.
    f = FABRICS[fabric]
    assert f.measured_busbw(2, 2 ** 20) < 0.55 * cap < f.measured_busbw(2, 2 ** 28)


# ---- the gradient sync's overlap ----------------------------------------------------------

@pytest.fixture(scope="module")
def gpt():
    return profile_model("gpt:layers=8,hidden=1024,heads=16,vocab=32000,seq=1024", 1024,
                         "bfloat16")


def _dp_step(gpt, micro_batches, overlap=True):
    c = Cluster.load("dgx-a100-80gb-x16")
    n, batch = gpt.num_layers, 32 * micro_batches
    plan = Plan("gpt", c.to_dict(), batch, 1024,
                (Pipeline((Stage(0, n, tuple(range(16)), "A100-80GB", (("data", 16),)),),
                          batch, 2, micro_batches),), dtype="bfloat16",
                grad_sync_overlap=overlap)
    r = simulate(plan, gpt, c, DEFAULT)
    last_b = max(t.end_s for t in r.tasks if t.kind == "B")
    (sync,) = [t for t in r.tasks if t.kind == "sync"]
    return r, last_b, sync


def test_one_micro_batch_exposes_the_first_layers_sync_and_many_hide_it(gpt):
    r1, b1, s1 = _dp_step(gpt, 1)
    t_sync = s1.end_s - s1.start_s
    # The backward is longer than the whole sync, yet the embedding's gradients (the
    # last produced, a third of the bytes here) cross the network after it ends.
    assert b1 - (s1.start_s) > 0
    embed = gpt.layers[0].param_bytes / sum(layer.param_bytes for layer in gpt.layers)
    assert s1.end_s - b1 >= 0.99 * embed * t_sync
    # Without overlap the whole sync follows the backward.
    _, b0, s0 = _dp_step(gpt, 1, overlap=False)
    assert s0.start_s == pytest.approx(b0) and s0.end_s > s1.end_s
    # With 8 micro-batches the same exposed part is a far smaller share of the step.
    r8, b8, s8 = _dp_step(gpt, 8)
    assert (s8.end_s - b8) / r8.step_time_s < 0.25 * (s1.end_s - b1) / r1.step_time_s


def test_the_honest_overlap_never_prices_a_sync_below_its_exposed_bucket(gpt):
    """Whatever the sizes: the sync ends no earlier than the backward plus the first
    layer's share of the sync time, and no later than the backward plus the whole."""
    for mb in (1, 2, 4):
        _, b, s = _dp_step(gpt, mb)
        t_sync = s.end_s - s.start_s
        first = gpt.layers[0].param_bytes / sum(la.param_bytes for la in gpt.layers)
        assert b + first * t_sync * (1 - 1e-9) <= s.end_s <= b + t_sync * (1 + 1e-9)
        assert not math.isnan(s.end_s)


# ---- XLA's combined buckets -------------------------------------------------------------

def test_buckets_combine_small_gradients_and_split_large_ones():
    mib = 2 ** 20
    got = buckets([10 * mib, 10 * mib, 15 * mib, 0.0, 100 * mib, 1 * mib])
    # 10 + 10 combine; 15 would pass 30 MiB: a bucket of its own (then 100 MiB, in four
    # equal parts of at most 30 MiB, flushes it); the last MiB alone.
    assert got == [(1, 20 * mib), (2, 15 * mib)] + [(4, 25 * mib)] * 4 + [(5, 1 * mib)]
    assert COMBINE_BYTES == 30 * mib  # XLA's kDefaultAllReduceCombineThreshold
    assert buckets([]) == [] and buckets([5.0]) == [(0, 5.0)]


def test_a_sync_runs_as_xlas_buckets_each_paying_its_latency_and_size(gpt):
    # 16 A100s over two nodes, no overlap: the sync is the sum of one all-reduce per
    # bucket (each layer's gradients last layer first, combined up to 30 MiB), slower
    # than one all-reduce of all the bytes would be (more latency, smaller buffers).
    _, b0, s0 = _dp_step(gpt, 1, overlap=False)
    c = Cluster.load("dgx-a100-80gb-x16")
    topo = topology(c, range(16))
    total = sum(layer.param_bytes for layer in gpt.layers)
    pieces = buckets([layer.param_bytes for layer in reversed(gpt.layers)])
    assert len(pieces) > gpt.num_layers  # the embedding and head split in parts
    want = sum(collective_time("all_reduce", b, topo, DEFAULT, "A100-80GB")
               for _, b in pieces)
    assert s0.end_s - s0.start_s == pytest.approx(want)
    assert want > 1.01 * collective_time("all_reduce", total, topo, DEFAULT, "A100-80GB")
    # the simulator's runs of equal buckets are exactly those collectives, in order
    from hetshard.sim.simulator import sync_buckets
    runs = sync_buckets(gpt, 0, gpt.num_layers, total)
    expanded = [(k, b) for k, b, m in runs for _ in range(m)]
    assert [k for k, _ in expanded] == [k for k, _ in pieces]
    assert [b for _, b in expanded] == pytest.approx([b for _, b in pieces])
    assert len(runs) < len(pieces) and all(m >= 1 for _, _, m in runs)
