"""Context parallelism across GPU generations: context groups that span GPU types.

A long sequence (32K to 1M tokens) is split over a stage's ``context`` axis; every
layer but attention is sequence-local, and attention runs as a ring that passes K/V
chunks around the group (``hetshard.kernels.ring_attention``; zigzag for causal
masks, which gives each rank's pair of pieces causal work in proportion to its length).
On a cluster that mixes GPU generations, a context group can span types, as HexiSeq
(uneven context and head parallelism over H100 + A100) does: each device attends a chunk
of the sequence sized to its speed, so the fast and the slow devices finish together
instead of the fast ones waiting. Here the chunks are uneven for attention only (the
runtime's ring pads each to the longest, ``hetshard.rewrite.attention._ring_on_mesh``);
the layers around it keep an even split, which any traced program runs unchanged. At
long sequences attention is most of the work (at 128K tokens about 5x a llama-7b
block's matmuls).

``mixed_context_plans`` builds such plans: one pipeline over all the cluster's devices,
``pp`` stages of equal block counts, each stage ``data x context x tensor``, every
context group holding the same share of every GPU type (``tp`` GPUs of one node per
context rank), chunk lengths from each type's priced times for the stage
(``balanced_shares``: every rank's even-split time plus its share of attention equal;
``speed_chunks``: multiples of ``CHUNK_GRANULE``).
With ``chunks="equal"`` the same layouts get equal chunks (Megatron-LM's context
parallelism on a mixed group: the slowest type paces it), the baseline the uneven ones
are measured against. The simulator prices a stage with uneven chunks per GPU type,
each type's attention time scaled by its largest chunk over the equal one, every device
holding the longest chunk's attention inputs (``hetshard.sim.simulator``). The planner
adds these plans to its candidates for long sequences (``PlannerOptions.mixed_context``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from hetshard._plan import Context, Pipeline, Plan, Stage, stage_dtype
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT, Calibration
from hetshard.cost.profile import ModelProfile
from hetshard.cost.stage import stage_cost
from hetshard.errors import SpecError
from hetshard.solver.options import planned_gpu_dtypes
from hetshard.solver.uniform import stage_bounds

# Chunk lengths are multiples of this (the flash kernel's block, and the zigzag's two
# halves per rank).
CHUNK_GRANULE = 256


def speed_chunks(seq_len: int, speeds: Sequence[float], granule: int = CHUNK_GRANULE
                 ) -> tuple[int, ...]:
    """Per context rank, a chunk length in proportion to its ``speeds`` entry: multiples
    of ``granule`` (each at least one), summing to ``seq_len`` (largest remainders)."""
    if seq_len % granule or seq_len // granule < len(speeds):
        raise SpecError("seq_len", seq_len, f"a multiple of {granule} with at least "
                        f"{len(speeds)} of them (one per context rank)")
    if any(not s > 0 for s in speeds):
        raise SpecError("speeds", list(speeds), "positive numbers")
    units = seq_len // granule
    total = float(sum(speeds))
    ideal = [units * s / total for s in speeds]
    base = [max(1, math.floor(x)) for x in ideal]
    while sum(base) > units:  # the floor of one forced some up: take from the largest
        base[base.index(max(base))] -= 1
    order = sorted(range(len(speeds)), key=lambda i: base[i] - ideal[i])
    for i in itertools.islice(itertools.cycle(order), units - sum(base)):
        base[i] += 1
    return tuple(b * granule for b in base)


def balanced_shares(times: Sequence[tuple[float, float]]) -> list[float]:
    """Per context rank, its share of the sequence's attention (they average 1) so that
    every rank finishes together: rank r takes ``other_r + share_r * attention_r`` (its
    time for the layers around attention, which keep an even split, and for attention
    at an equal chunk). Ranks that would need a negative share get a minimal one."""
    shares = [1.0] * len(times)
    if any(not att > 0 for _, att in times):
        return shares  # no attention to redistribute
    active = list(range(len(times)))
    while active:
        inv = sum(1.0 / times[r][1] for r in active)
        total = len(times) - (len(times) - len(active)) * 1e-3
        level = (total + sum(times[r][0] / times[r][1] for r in active)) / inv
        shares = [1e-3] * len(times)
        for r in active:
            shares[r] = (level - times[r][0]) / times[r][1]
        low = [r for r in active if shares[r] <= 1e-3]
        if not low:
            return shares
        active = [r for r in active if r not in low]
    return [1.0] * len(times)


def _blocks_of(cluster: Cluster, tp: int) -> dict[str, list[tuple[int, ...]]]:
    """Per group: its devices in blocks of ``tp`` (one node each), node by node."""
    out = {}
    for g in cluster.groups:
        ids = list(cluster.group_device_ids(g.name))
        out[g.name] = [tuple(ids[i:i + tp]) for i in range(0, len(ids), tp)]
    return out


def mixed_context_plans(model: str, profile: ModelProfile, cluster: Cluster, *,
                        global_batch: int, seq_len: int, opts, cal: Calibration = DEFAULT,
                        chunks: str = "speed", granule: int = CHUNK_GRANULE) -> list[Plan]:
    """Plans whose stages hold context groups spanning every GPU type of ``cluster`` (see
    the module docstring): per tensor degree, stage count, data ways and context degree
    of ``opts`` (``PlannerOptions``) that share every group's blocks out evenly, per
    micro-batch size and remat; ``chunks`` "speed" (balanced on each type's priced
    times, multiples of ``granule`` tokens) or "equal"."""
    if chunks not in ("speed", "equal"):
        raise SpecError("chunks", chunks, "speed or equal")
    if len(cluster.groups) < 2 or seq_len < opts.context_min_seq:
        return []
    heads = profile.tensor_divisor
    gpu_dtypes = planned_gpu_dtypes(profile, cluster, opts)
    blocks_total = len(profile.block_indices())
    plans = []
    for tp in opts.tp_options:
        if heads % tp or any(g.gpus_per_node % tp for g in cluster.groups):
            continue
        blocks = _blocks_of(cluster, tp)
        common = math.gcd(*[len(b) for b in blocks.values()])
        for k in (k for k in range(1, common + 1) if common % k == 0):
            per = {name: len(b) // k for name, b in blocks.items()}  # per context group
            cp = sum(per.values())
            if cp not in opts.cp_options or seq_len % (2 * cp):
                continue
            for pp in (p for p in range(1, k + 1) if k % p == 0 and blocks_total % p == 0):
                dp = k // pp
                plans += _layouts(model, profile, cluster, global_batch, seq_len, opts, cal,
                                  chunks, tp, cp, pp, dp, blocks, per, gpu_dtypes, granule)
    return plans


def _layouts(model, profile, cluster, global_batch, seq_len, opts, cal, chunks, tp, cp, pp,
             dp, blocks, per, gpu_dtypes, granule) -> list[Plan]:
    bounds = stage_bounds(profile, pp)
    names = list(per)
    stages_devices, rank_types = [], None
    for s in range(pp):
        devices = []
        for d in range(dp):
            q = s * dp + d
            ranks = [blk for name in names for blk in blocks[name][q * per[name]:
                                                                     (q + 1) * per[name]]]
            if rank_types is None:
                rank_types = [cluster.gpu_of(blk[0]) for blk in ranks]
            devices += [dev for blk in ranks for dev in blk]
        stages_devices.append(tuple(devices))
    gpu = "+".join(sorted({t.name for t in rank_types}))
    mesh = (("data", dp), ("context", cp), ("tensor", tp))
    plans = []
    for mbs, remat in itertools.product(opts.mbs_options, opts.remat_options):
        if global_batch % (dp * mbs):
            continue
        if chunks == "equal":
            lengths = (seq_len // cp,) * cp
        else:
            # Each type's attention and other time for the largest stage at equal chunks.
            a, b = max(bounds, key=lambda r: r[1] - r[0])
            times = {}
            for t in {t.name: t for t in rank_types}.values():
                c = stage_cost(profile, a, b, t, tp=tp, cp=cp, dp=dp, mbs=mbs, remat=remat,
                               attention=opts.attention, cal=cal,
                               dtype=stage_dtype(t.name, profile.dtype, gpu_dtypes))
                att = c.attention_fwd_s + c.attention_bwd_s
                times[t.name] = (c.fwd_s + c.bwd_s - att, att)
            lengths = speed_chunks(seq_len, balanced_shares([times[t.name]
                                                             for t in rank_types]), granule)
        stages = tuple(Stage(lo, hi, devs, gpu, mesh, remat)
                       for (lo, hi), devs in zip(bounds, stages_devices, strict=True))
        pipe = Pipeline(stages, global_batch, mbs, global_batch // (dp * mbs), opts.schedule)
        plans.append(Plan(model=model, cluster=cluster, global_batch=global_batch,
                          seq_len=seq_len, pipelines=(pipe,),
                          context=Context(cp, lengths, True), dtype=profile.dtype,
                          distributed_optimizer=opts.distributed_optimizer is not False,
                          attention=opts.attention, split_blocks=profile.split_blocks,
                          tp_overlap=opts.tp_overlap, fingerprint=profile.fingerprint,
                          gpu_dtypes=gpu_dtypes))
    return plans
