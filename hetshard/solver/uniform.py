"""Uniform Megatron-style plans: ``dp x tp x pp (x cp)`` over the whole cluster.

This is what ``hetshard simulate --fix`` prices and what the uniform baselines
build on. Devices are laid out pipeline-stage-major, then data, context and
tensor (innermost, so tensor-parallel groups stay inside a node when they fit),
as Megatron-LM orders its ranks. Blocks are split evenly across stages; the
embedding joins the first stage and the head the last. A stage whose devices mix
GPU types runs at the slowest type's pace (one SPMD program). With ``vpp = v > 1``
the blocks are split into ``pp * v`` stages, stage ``j`` on submesh ``j mod pp``
(Megatron-LM's interleaved schedule; micro-batches a multiple of ``pp``).

``layers=7,8*14,7`` gives each of the ``pp * vpp`` stages its number of blocks (Llama 3
405B's 126 blocks on 16 stages, one fewer on the first and the last, which also hold
the embedding and the head). Without it, blocks that ``pp * vpp`` does not divide are
spread one more to the stages farthest from the ends.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hetshard._plan import SCHEDULES, Pipeline, Plan, Stage
from hetshard.cluster.spec import Cluster
from hetshard.cost.profile import ModelProfile
from hetshard.errors import SpecError, check_positive
from hetshard.offload import check_offload
from hetshard.remat import check_remat
from hetshard.solver.options import data_axes

FIX_KEYS = {"dp": int, "tp": int, "pp": int, "cp": int, "fsdp": bool, "mbs": int,
            "remat": str, "schedule": str, "vpp": int, "zero1": bool, "tp_overlap": bool,
            "layers": tuple, "hsdp": int, "offload": "names", "ep": int,
            "capacity": float}
_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclasses.dataclass(frozen=True)
class Fix:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    fsdp: bool = False
    mbs: int = 1
    remat: str = "none"
    schedule: str = "1f1b"
    vpp: int = 1  # virtual stages per pipeline submesh (interleaved schedule when > 1)
    zero1: bool = False  # the distributed optimizer: optimizer state sharded over dp
    tp_overlap: bool = False  # collective matmuls on tensor-parallel stages
    layers: tuple[int, ...] = ()  # blocks per stage, pp * vpp of them (empty: as even as can be)
    hsdp: int = 0  # hybrid sharding: FSDP inside groups of this many data ways (0: none)
    # What every stage keeps in host memory (``hetshard.offload``): "optimizer",
    # "activations" or both as "optimizer+activations"; empty: nothing
    offload: tuple[str, ...] = ()
    # expert parallelism: ``ep`` of the ``dp`` data ways hold different experts (an
    # ``expert`` axis on every stage holding a mixture-of-experts layer; 1: none), the
    # exchange's capacity factor (0: dropless)
    ep: int = 1
    capacity: float = 0.0


def parse_fix(text: str) -> Fix:
    """Parses ``dp=8,tp=1,pp=1,fsdp=true,mbs=6,remat=none``."""
    kw: dict = {}
    key = None
    for item in filter(None, (t.strip() for t in text.split(","))):
        if "=" not in item and key == "layers":  # layers=7,8,8: the list goes on
            kw["layers"] += _counts(item)
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise SpecError("--fix", item, "key=value items")
        if key not in FIX_KEYS:
            raise SpecError(f"--fix {key}", value, f"a key among {sorted(FIX_KEYS)}")
        if key in kw:
            raise SpecError(f"--fix {key}", value, "each key once (contradictory values)")
        kind = FIX_KEYS[key]
        value = value.strip()
        if kind is int:
            try:
                kw[key] = int(value)
            except ValueError:
                raise SpecError(f"--fix {key}", value, "a positive integer") from None
            if kw[key] < 1:
                raise SpecError(f"--fix {key}", value, "a positive integer")
        elif kind is float:
            try:
                kw[key] = float(value)
            except ValueError:
                raise SpecError(f"--fix {key}", value, "a number > 0") from None
            if not kw[key] > 0 or kw[key] == float("inf"):
                raise SpecError(f"--fix {key}", value, "a number > 0 (the exchange's "
                                "capacity factor; leave it out for dropless)")
        elif kind is tuple:
            kw[key] = _counts(value)
        elif kind == "names":
            kw[key] = tuple(v.strip() for v in value.split("+") if v.strip() and
                            v.strip() != "none")
        elif kind is bool:
            if value.lower() not in _BOOL:
                raise SpecError(f"--fix {key}", value, "true or false")
            kw[key] = _BOOL[value.lower()]
        else:
            kw[key] = value
    fix = Fix(**kw)
    check_remat(fix.remat, "--fix remat")
    offload = check_offload(fix.offload, fix.remat, "--fix offload")
    fix = dataclasses.replace(fix, offload=offload)
    if fix.schedule not in SCHEDULES:
        raise SpecError("--fix schedule", fix.schedule, f"one of {SCHEDULES}")
    if fix.schedule == "zbh1" and fix.vpp > 1:
        raise SpecError("--fix schedule", fix.schedule, "1f1b or gpipe with vpp > 1 (ZB-H1 runs "
                        "one stage per submesh)")
    if fix.hsdp and fix.fsdp:
        raise SpecError("--fix hsdp", fix.hsdp, "no hsdp with fsdp=true (fsdp=true shards "
                        "over every data way; hsdp=k inside groups of k of them)")
    if fix.ep > 1 and (fix.fsdp or fix.hsdp):
        raise SpecError("--fix ep", fix.ep, "1 with fsdp or hsdp (expert ranks hold "
                        "different experts; FSDP shards every parameter over the data ways)")
    if fix.zero1 and fix.fsdp:
        raise SpecError("--fix zero1", True, "false with fsdp=true (FSDP already shards the "
                        "optimizer state, and the parameters)")
    return fix


def _counts(text: str) -> tuple[int, ...]:
    """``8`` or ``8*14`` (14 stages of 8 blocks) as a tuple of block counts."""
    n, star, times = text.strip().partition("*")
    try:
        counts = (int(n),) * (int(times) if star else 1)
    except ValueError:
        raise SpecError("--fix layers", text, "block counts per stage, e.g. 7,8*14,7 "
                        "(positive integers, N*k for k stages of N)") from None
    if not counts or min(counts) < 1:
        raise SpecError("--fix layers", text, "positive block counts (every stage holds at "
                        "least one block; N*k with k >= 1)")
    return counts


def spread(blocks: int, stages: int, field: str = "--fix pp") -> tuple[int, ...]:
    """``blocks`` over ``stages`` as evenly as can be: the remainder one more each to the
    stages farthest from the pipeline's ends (the first and last also hold the embedding
    and the head)."""
    if stages > blocks:
        raise SpecError(field, stages, f"at most the model's {blocks} blocks (a stage "
                        f"holds at least one)")
    counts = [blocks // stages] * stages
    middle = sorted(range(stages), key=lambda s: (-min(s, stages - 1 - s), s))
    for s in middle[:blocks % stages]:
        counts[s] += 1
    return tuple(counts)


def stage_bounds(profile: ModelProfile, pp: int, counts: tuple[int, ...] = (),
                 field: str = "--fix pp") -> list[tuple[int, int]]:
    """Layer ranges of ``pp`` stages holding ``counts`` blocks each (default: as even as
    can be, :func:`spread`)."""
    blocks = profile.block_indices()
    if not counts:
        counts = spread(len(blocks), pp, field)
    if len(counts) != pp:
        raise SpecError("--fix layers", ",".join(map(str, counts)),
                        f"{pp} block counts, one per stage ({field.split()[-1]})")
    if sum(counts) != len(blocks):
        raise SpecError("--fix layers", ",".join(map(str, counts)),
                        f"block counts summing to the model's {len(blocks)} blocks "
                        f"(they sum to {sum(counts)})")
    firsts = np.cumsum((0,) + tuple(counts))[:-1]
    starts = [0] + [blocks[int(k)] for k in firsts[1:]]
    # Non-block layers just before a stage's first block belong to that stage.
    for k in range(1, pp):
        j = starts[k]
        while j - 1 > starts[k - 1] and j - 1 not in set(blocks):
            j -= 1
        starts[k] = j
    return list(zip(starts, starts[1:] + [profile.num_layers], strict=True))


def uniform_plan(model: str, profile: ModelProfile, cluster: Cluster, *, global_batch: int,
                 seq_len: int, fix: Fix, attention: str = "flash",
                 gpu_dtypes: tuple = ()) -> Plan:
    """The uniform plan ``fix`` describes on ``cluster`` (errors name what does not divide);
    ``gpu_dtypes``: the plan's compute dtypes per GPU type (``Plan.gpu_dtypes``)."""
    check_positive("--global-batch", global_batch, integer=True)
    n = fix.dp * fix.tp * fix.pp * fix.cp
    if n != cluster.num_devices:
        raise SpecError("--fix", f"dp*tp*pp*cp={n}",
                        f"a product equal to the cluster's {cluster.num_devices} GPUs")
    if global_batch % (fix.dp * fix.mbs):
        valid = [fix.dp * fix.mbs * k for k in range(1, 5)]
        raise SpecError("--global-batch", global_batch,
                        f"a multiple of dp*mbs={fix.dp * fix.mbs} (e.g. {valid})")
    if seq_len % fix.cp:
        raise SpecError("--seq-len", seq_len, f"a multiple of cp={fix.cp}")
    if fix.hsdp and fix.dp % fix.hsdp:
        raise SpecError("--fix hsdp", fix.hsdp,
                        f"a divisor of dp={fix.dp} (FSDP inside groups of hsdp data ways, "
                        f"data parallelism across the dp/hsdp groups), e.g. "
                        f"{[k for k in range(2, fix.dp + 1) if fix.dp % k == 0][:4]}")
    if fix.ep > 1 and fix.dp % fix.ep:
        raise SpecError("--fix ep", fix.ep,
                        f"a divisor of dp={fix.dp} (expert ranks are data ways), e.g. "
                        f"{[k for k in range(2, fix.dp + 1) if fix.dp % k == 0][:4]}")
    experts = sorted({layer.experts for layer in profile.layers if layer.experts})
    if fix.ep > 1 and not experts:
        raise SpecError("--fix ep", fix.ep, "1: the model has no mixture-of-experts layer")
    if fix.ep > 1 and any(n % fix.ep for n in experts):
        raise SpecError("--fix ep", fix.ep, f"a divisor of the model's {experts[0]} experts")
    heads = profile.heads or 1
    if heads % fix.tp:
        raise SpecError("--fix tp", fix.tp, f"a divisor of the model's {heads} heads")
    m = global_batch // (fix.dp * fix.mbs)
    if fix.vpp > 1 and (fix.pp == 1 or m % fix.pp):
        raise SpecError("--fix vpp", fix.vpp,
                        f"1 unless pp > 1 and the {m} micro-batches (global batch / (dp*mbs)) "
                        f"are a multiple of pp={fix.pp} (interleaved schedules take "
                        f"micro-batches in groups of pp)")
    bounds = stage_bounds(profile, fix.pp * fix.vpp, fix.layers,
                          "--fix pp" if fix.vpp == 1 else "--fix pp*vpp")
    per_stage = fix.dp * fix.cp * fix.tp
    stages = []
    for s, (a, b) in enumerate(bounds):
        w = s % fix.pp
        devices = tuple(range(w * per_stage, (w + 1) * per_stage))
        gpus = sorted({cluster.gpu_of(d).name for d in devices})
        holds = any(layer.experts for layer in profile.layers[a:b])
        data = ((("data", fix.dp // fix.hsdp), ("fsdp", fix.hsdp)) if fix.hsdp else
                data_axes(fix.dp, 1, fix.ep if holds else 1) if not fix.fsdp else
                (("fsdp", fix.dp),))
        mesh = (*data, ("context", fix.cp), ("tensor", fix.tp))
        stages.append(Stage(start=a, end=b, devices=devices, gpu="+".join(gpus),
                            mesh_shape=mesh, remat=fix.remat, offload=fix.offload))
    pipe = Pipeline(stages=tuple(stages), batch_share=global_batch, micro_batch_size=fix.mbs,
                    num_micro_batches=m, schedule=fix.schedule, virtual_stages=fix.vpp)
    return Plan(model=model, cluster=cluster, global_batch=global_batch,
                seq_len=seq_len, pipelines=(pipe,), dtype=profile.dtype, fsdp=fix.fsdp,
                distributed_optimizer=fix.zero1, attention=attention,
                split_blocks=profile.split_blocks, tp_overlap=fix.tp_overlap,
                fingerprint=profile.fingerprint, gpu_dtypes=tuple(gpu_dtypes),
                capacity_factor=fix.capacity or None)
