"""Sailor's measured runs as hetshard plans: the clusters they ran on and their plans.

``experiments/data/sailor-validation.json`` holds 36 measured iteration times of plans
Sailor (Strati et al., SOSP'25) ran: on a mixed RTX-3090 / RTX-2080 Ti / Titan RTX
cluster at MIT (nodes of 8 GPUs) and on GH200 nodes of CSCS's Alps (4 per node). A
plan is a list of stages, each a set of data-parallel replicas, each replica a node's
GPUs at a tensor degree (replicas of one stage may sit on different GPU types). As
hetshard plans it, replica ``i`` of every stage forms pipeline ``i`` (each stage has the
same number of replicas), with the global batch split equally, as Sailor's runtime
splits it; gradients are summed over the pipelines that hold each layer.

The clusters' networks are the measured fits the validation file carries (MIT: about
2.9 GB/s between Titan RTX and RTX 2080 Ti nodes, 0.115 GB/s to and between the RTX
3090 nodes and between nodes of different types at 8 GPUs); GH200 nodes use the
catalog's NVLink and 4 x 200 Gb/s Slingshot.
"""

from __future__ import annotations

import json
import os

from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster import Cluster

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
VALIDATION = os.path.join(DATA, "sailor-validation.json")
PROFILES = os.path.join(DATA, "profiles", "sailor-profiles.json")

# The zoo's spec of each model (OPT ties its embeddings; GPT-Neo too), at Sailor's
# sequence length 2048, float32.
MODELS = {
    "OPT-350": "gpt:layers=24,hidden=1024,heads=16,vocab=50272,seq=2048,pos=learned,"
               "norm=layernorm,mlp=gelu,tied=true,dtype=float32",
    "GPT-Neo-2.7": "gpt:layers=32,hidden=2560,heads=20,vocab=50257,seq=2048,pos=learned,"
                   "norm=layernorm,mlp=gelu,tied=true,dtype=float32",
}
GPUS = {"RTX-3090": "RTX-3090", "RTX-2080": "RTX-2080Ti", "Titan-RTX": "TITAN-RTX",
        "GH-96": "GH200-96GB"}


def spec_for(row: dict) -> str:
    """The zoo spec of the model a row ran: its architecture from MODELS, its sizes from
    the row's own ``model_config`` (Sailor's training config: GPT-Neo-2.7 ran with 32
    heads and a 128,256-token vocabulary, not the published checkpoint's 20 and 50,257)."""
    cfg = row["model_config"]
    sizes = {"layers": cfg["num_layers"], "hidden": cfg["hidden_size"], "heads": cfg["heads"],
             "vocab": cfg["vocab_size"], "seq": cfg["sequence_length"]}
    kind, _, rest = MODELS[row["model"]].partition(":")
    items = dict(item.split("=", 1) for item in rest.split(","))
    items.update({k: str(v) for k, v in sizes.items()})
    return kind + ":" + ",".join(f"{k}={v}" for k, v in items.items())


def load() -> dict:
    with open(VALIDATION) as f:
        return json.load(f)


def _group_gbs(fits: dict, gpu: str) -> float:
    """A node type's bandwidth to its own kind (8-GPU transfers), GB/s."""
    fit = fits.get(f"{gpu} x8 -> {gpu} x8")
    return fit["max_Bps"] / 1e9


def cluster_for(row: dict, data: dict) -> Cluster:
    """One group per GPU type, as many nodes as the plan's replicas use."""
    nodes: dict[str, int] = {}
    for stage in row["stages"]:
        for rep in stage["replicas"]:
            for n in rep["nodes"]:
                nodes[n["gpu"]] = nodes.get(n["gpu"], 0) + 1
    shapes = data["node_shapes"]
    fits = data["mit_network_inter_node_fits"]
    groups, cross = [], []
    for gpu, count in nodes.items():
        g = {"name": gpu.lower(), "gpu": GPUS[gpu], "nodes": count,
             "gpus_per_node": shapes[gpu]["gpus_per_node"]}
        if gpu != "GH-96":
            g["inter_node_gbs"] = _group_gbs(fits, gpu)
        groups.append(g)
    for a in nodes:
        for b in nodes:
            if a != b and f"{a} x8 -> {b} x8" in fits:
                cross.append(fits[f"{a} x8 -> {b} x8"]["max_Bps"] / 1e9)
    spec = {"name": f"sailor-{row['id'].split('/')[-2]}", "groups": groups,
            "inter_group_gbs": min(cross) if cross else 25.0}
    return Cluster.load(spec)


def plan_for(row: dict, cluster: Cluster) -> Plan:
    """Pipeline i runs replica i of every stage; each replica on its own node."""
    used: dict[str, int] = {}  # next free node per group

    def devices_of(rep) -> tuple[int, ...]:
        (node,) = rep["nodes"]
        group = node["gpu"].lower()
        k = used.get(group, 0)
        used[group] = k + 1
        ids = list(cluster.group_device_ids(group))
        per = cluster.group(group).gpus_per_node
        return tuple(ids[k * per:k * per + node["gpus"]])

    dps = {stage["dp"] for stage in row["stages"]}
    if len(dps) != 1:
        raise ValueError(f"{row['id']}: stages with different replica counts {sorted(dps)}")
    dp = dps.pop()
    placed = [[devices_of(rep) for rep in stage["replicas"]] for stage in row["stages"]]
    share = row["global_batch"] // dp
    micro = max(1, share // row["mbs"])
    pipes = []
    for i in range(dp):
        stages = []
        for stage, devs in zip(row["stages"], placed, strict=True):
            rep = stage["replicas"][i]
            first, last = stage["layers_first_last"]
            gpu = GPUS[rep["nodes"][0]["gpu"]]
            stages.append(Stage(first, last + 1, devs[i], gpu,
                                (("data", len(devs[i]) // rep["tp"]), ("tensor", rep["tp"]))))
        pipes.append(Pipeline(tuple(stages), share, row["mbs"], micro))
    # Sailor's runtime reduces the gradients after the pipeline's flush (its simulator
    # adds the all-reduce to the pipeline time; the validation rows time it apart as
    # ``red_grads``): no overlap with the last backward.
    return Plan(row["model"], cluster.to_dict(), share * dp, 2048, tuple(pipes),
                grad_sync_overlap=False, dtype="float32", attention="reference",
                distributed_optimizer=False)
