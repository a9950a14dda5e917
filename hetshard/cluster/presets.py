"""Named cluster presets: homogeneous DGX systems and published heterogeneous testbeds.

Homogeneous ``dgx-a100-80gb-x{N}`` and ``dgx-h100-x{N}`` (N a multiple of 8,
8..3072): 8 GPUs per node on NVSwitch, 8x 200 Gb/s HDR InfiniBand per node
(A100; Narayanan et al. 2021, §5.1: the Selene setup behind Megatron-LM's
scaling table) or 8x 400 Gb/s NDR (DGX H100 datasheet).

The heterogeneous presets reproduce the GPU mixes of published experiments.
Where a paper gives no node shape or network figure, the choice made here is
stated in the preset's description, so results are never mistaken for the
paper's exact testbed.
"""

from __future__ import annotations

import re

from hetshard.errors import SpecError, UnknownNameError


def _g(name, gpu, nodes, gpn, intra=None, inter=None):
    d = {"name": name, "gpu": gpu, "nodes": nodes, "gpus_per_node": gpn}
    if intra is not None:
        d["intra_node_gbs"] = intra
    if inter is not None:
        d["inter_node_gbs"] = inter
    return d


_HETERO: dict[str, tuple[dict, str]] = {
    "a100-v100": ({"groups": [_g("fast", "A100-80GB", 2, 8, 300, 200),
                              _g("slow", "V100-16GB", 4, 4, 150, 12.5)],
                   "inter_group_gbs": 12.5},
                  "the example of docs/cluster-spec.md: 16x A100-80GB + 16x V100-16GB"),
    "amp-t4-v100": ({"groups": [_g("v100", "V100-16GB", 3, 4, 150, 1.25),
                                _g("t4", "T4", 1, 4, 16, 6.25)],
                     "inter_group_gbs": 1.25},
                    "AMP (Li et al., NeurIPS'22) heterogeneous setting: 4 nodes of 4 GPUs, "
                    "three p3.8xlarge (4x V100-16GB, NVLink, 10 Gb/s between nodes) and one "
                    "g4dn.12xlarge (4x T4, PCIe, 50 Gb/s NIC), as AMP's repository sets it"),
    "metis-a100-t4": ({"groups": [_g("a100", "A100-40GB", 2, 8, 300, 25),
                                  _g("t4", "T4", 4, 4, 16, 6.25)],
                       "inter_group_gbs": 6.25},
                      "GPU mix of Metis (Um et al., ATC'24) §6: A100 + T4; node shapes "
                      "(2x8 A100, 4x4 T4) and 200/50 Gb/s networks are ours"),
    "metis-4types": ({"groups": [_g("a100", "A100-40GB", 1, 8, 300, 25),
                                 _g("v100", "V100-16GB", 2, 4, 150, 12.5),
                                 _g("p100", "P100-16GB", 2, 4, 80, 12.5),
                                 _g("t4", "T4", 2, 4, 16, 6.25)],
                      "inter_group_gbs": 6.25},
                     "GPU mix of Metis (ATC'24) §6: V100 + P100 + T4 + A100; node shapes and "
                     "networks are ours"),
    "flashflex-consumer": ({"groups": [_g("rtx4090", "RTX-4090", 1, 8, 32, 1.25),
                                       _g("rtx3090", "RTX-3090", 1, 8, 32, 1.25),
                                       _g("rtx3080ti", "RTX-3080Ti", 1, 8, 32, 1.25)],
                            "inter_group_gbs": 1.25},
                           "GPU mix of FlashFlex (Yan et al. 2024): RTX 3080Ti + 3090 + 4090 "
                           "over PCIe without RDMA; 8 GPUs per node and 10 GbE are ours"),
    "sailor-a100-v100": ({"groups": [{**_g("a100", "A100-40GB", 4, 4, 300, 6.04),
                                      "fabric": "gcp-a2-a100x4"},
                                     {**_g("v100", "V100-16GB", 4, 4, 150, 5.79),
                                      "fabric": "gcp-n1-v100x4"}],
                          "inter_group_gbs": 5.79, "inter_group_fabric": "gcp-n1-v100x4"},
                         "GPU mix of Sailor (Strati et al. 2025): GCP A100-40GB + V100-16GB, "
                         "4 nodes of each (a2-highgpu-4g, n1 with 4 V100); networks as "
                         "Sailor measured them in us-central1-a (its repository's fits)"),
    "h100-a100-v100-x8": ({"groups": [_g("h100", "H100-80GB", 1, 2),
                                      _g("a100", "A100-80GB", 1, 2),
                                      _g("v100", "V100-32GB", 1, 4)],
                           "inter_group_gbs": 12.5},
                          "8-GPU three-generation mix (2x H100, 2x A100, 4x V100) that the "
                          "quickstart binds to 8 fake CPU devices"),
    "h100-a100-v100-x32": ({"groups": [_g("h100", "H100-80GB", 1, 8),
                                       _g("a100", "A100-80GB", 1, 8),
                                       _g("v100", "V100-32GB", 2, 8, 150, 12.5)],
                            "inter_group_gbs": 12.5},
                           "32-GPU three-generation mix the quickstart plans for: a DGX H100 "
                           "node, a DGX A100 node and two 8-GPU V100 nodes (NVLink, 100 "
                           "Gb/s); 100 Gb/s between groups"),
    "mix3-x256": ({"groups": [_g("h100", "H100-80GB", 8, 8),
                              _g("a100", "A100-80GB", 12, 8),
                              _g("a100-40", "A100-40GB", 12, 8)],
                   "inter_group_gbs": 50.0},
                  "planner benchmark: 256 GPUs of 3 types (64 H100, 96 A100-80GB, "
                  "96 A100-40GB), 400 Gb/s between groups"),
    "mix4-x1024": ({"groups": [_g("h100", "H100-80GB", 32, 8),
                               _g("a100", "A100-80GB", 32, 8),
                               _g("a100-40", "A100-40GB", 32, 8),
                               _g("v100", "V100-32GB", 32, 8, 150, 50)],
                    "inter_group_gbs": 50.0},
                   "planner benchmark: 1024 GPUs of 4 types, 256 each"),
    "a100-v100-x16": ({"groups": [_g("a100", "A100-80GB", 1, 8),
                                  _g("v100", "V100-32GB", 1, 8)],
                       "inter_group_gbs": 12.5},
                      "planner benchmark: 16 GPUs of 2 types, one DGX node of each"),
}

# Homogeneous 8-GPU nodes, any multiple of 8 GPUs up to 3072: (GPU, intra-node GB/s,
# inter-node GB/s a node, fabric, description).
_DGX = {
    "dgx-a100-80gb": ("A100-80GB", 300, 200, "infiniband",
                      "DGX A100 80GB nodes: NVSwitch 600 GB/s bidir per GPU, 8x HDR 200 Gb/s "
                      "InfiniBand (Narayanan et al. 2021; NVIDIA DGX A100 datasheet)"),
    "dgx-h100": ("H100-80GB", 450, 400, "infiniband",
                 "DGX H100 nodes: NVSwitch 900 GB/s bidir per GPU, 8x NDR 400 Gb/s "
                 "InfiniBand (NVIDIA DGX H100 datasheet)"),
    "p5-h100": ("H100-80GB", 450, 400, "efa",
                "AWS p5.48xlarge nodes: 8 H100, NVSwitch 900 GB/s bidir per GPU, 3200 Gb/s "
                "EFA v2 (AWS EC2 P5 instance page)"),
    "a3mega-h100": ("H100-80GB", 450, 200, "gcp-tcpxo",
                    "GCP A3 Mega nodes: 8 H100, NVSwitch, 8x 200 Gb/s GPUDirect-TCPXO "
                    "(Google Cloud A3 machine types; the fabric's measured 2-node profile)"),
}
DGX_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072)

PRESETS: dict[str, str] = {name: desc for name, (_, desc) in _HETERO.items()}
for _base, (_gpu, _intra, _inter, _fabric, _desc) in _DGX.items():
    for _n in DGX_SIZES:
        PRESETS[f"{_base}-x{_n}"] = f"{_n} GPUs; {_desc}"


def preset_spec(name: str) -> dict:
    """The spec (a dict :meth:`hetshard.Cluster.from_dict` reads) of the preset ``name``
    (see :data:`PRESETS`; any ``dgx-*-x{8k}``, ``p5-h100-x{8k}`` or ``a3mega-h100-x{8k}``
    up to 3072)."""
    if name in _HETERO:
        spec, _ = _HETERO[name]
        return {"name": name, **spec}
    m = re.fullmatch(r"([a-z0-9]+-[a-z0-9-]+)-x(\d+)", name)
    if m and m.group(1) in _DGX:
        n = int(m.group(2))
        if n % 8 or not 8 <= n <= 3072:
            raise SpecError("cluster", name, f"{m.group(1)}-x{{N}} with N a multiple of 8 "
                            f"in 8..3072")
        gpu, intra, inter, fabric, _ = _DGX[m.group(1)]
        group = _g("dgx", gpu, n // 8, 8, intra, inter)
        if fabric != "infiniband":
            group["fabric"] = fabric
        return {"name": name, "groups": [group]}
    raise UnknownNameError("cluster", name, PRESETS)
