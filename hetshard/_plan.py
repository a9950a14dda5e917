"""The Plan: the one contract between the planner, the simulator and the runtime.

A plan for one step of global batch ``B`` (see DESIGN.md, "The plan model"):
``pipelines`` are data-parallel replicas, possibly different from each other,
each with a ``batch_share`` (shares sum to B), micro-batch size and count, and
``stages``: contiguous layer ranges on submeshes of one GPU type with a named
mesh shape. With ``virtual_stages = v > 1`` a pipeline's ``p * v`` stages run on
``p`` submeshes, stage ``j`` on the submesh of stage ``j mod p`` (interleaved
pipelining, as Megatron-LM's virtual pipeline stages). ``grad_sync`` (derived from the
pipelines) says which devices sum which layers' gradients, ``grad_sync_overlap``
whether that sum streams during the last backward; ``context`` gives per-device sequence chunks;
``predicted`` and ``solver`` record what the simulator and solver said. Plans
serialise to versioned JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from hetshard.cluster.spec import Cluster
from hetshard.errors import SpecError
from hetshard.fileio import parse_json, read_text, write_atomic
from hetshard.offload import check_offload
from hetshard.remat import check_remat

SCHEMA_VERSION = 16
# Versions this hetshard reads: 1 lacks ``Pipeline.virtual_stages`` (read as 1), 1 and 2
# lack ``Plan.distributed_optimizer`` (read as False); 4 adds the "zbh1" schedule, 5
# ``Stage.remat_layers`` (absent: the remat covers the whole stage), 6
# ``Plan.split_blocks`` (absent: layers are whole blocks), 7 ``Plan.tp_overlap``
# (absent: no collective matmuls, as those plans ran), 8 ``Plan.fingerprint`` (absent:
# the plan names no traced program, and is run on any program whose layers it covers), 9
# ``Plan.gpu_dtypes`` (absent: every stage computes in ``dtype``), 10 ``Stage.activations``
# (before, activation layouts were ``Stage.shardings`` entries named "activation:<layer>";
# they load into ``activations``), 11 ``Plan.grad_sync_overlap`` (before, ``grad_sync``
# entries, derived from the pipelines, each with an ``overlap`` flag: they load as the
# flags' conjunction; since 11 ``Plan.grad_sync`` is derived, not stored), 12
# ``Context.shard_state`` (absent: the state is replicated over the context axis), 13
# ``attention`` "auto" and "cudnn", "auto" the default (absent before 13: "flash", the
# default those plans ran), 14 the named remat policies (``hetshard.remat.POLICIES``), 15
# ``Stage.offload`` (absent: nothing offloaded to host memory), 16 the ``expert`` mesh axis,
# ``Stage.experts`` (absent: experts split evenly) and ``Plan.capacity_factor`` (absent:
# dropless).
READS_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16)
_ACTIVATION_PREFIX = "activation:"  # schema <= 9
MESH_AXES = ("data", "fsdp", "expert", "tensor", "context")
# A stage's batch splits over these, in order (hetshard.layout): the ``expert`` ranks hold
# different experts and, outside the mixture-of-experts layers, different samples (as
# MaxText's and Megatron-Core's expert parallelism carve it out of data parallelism).
BATCH_AXES = ("data", "fsdp", "expert")
SCHEDULES = ("1f1b", "gpipe", "zbh1")
# ``Plan.attention``'s values, as ``hetshard.kernel_choice.IMPLEMENTATIONS`` (which decides
# what each runs); here for what reads plans without JAX (``hetshard --help``).
ATTENTION_IMPLEMENTATIONS = ("auto", "cudnn", "flash", "reference")
DTYPES = ("bfloat16", "float16", "float32")  # compute dtypes the cost model prices


@dataclasses.dataclass(frozen=True)
class Stage:
    """Layers ``[start, end)`` on ``devices`` (cluster device ids, one GPU type)."""

    start: int
    end: int
    devices: tuple[int, ...]
    gpu: str
    mesh_shape: tuple[tuple[str, int], ...]  # ordered (axis, size); product == len(devices)
    remat: str = "none"
    # The remat covers the stage's first ``remat_layers`` layers, each recomputed on its
    # own (None: all of them); the others keep their activations.
    remat_layers: int | None = None
    # (parameter path, PartitionSpec entries) of the stage's weights
    shardings: tuple[tuple[str, tuple], ...] = ()
    # (layer name, PartitionSpec entries) of the activation the stage's last layer hands
    # on (its batch over the data axes); empty: the runtime's default layout
    activations: tuple[tuple[str, tuple], ...] = ()
    # What the stage keeps in host memory (``hetshard.offload.OFFLOADS``): its optimizer
    # state between steps, the values its remat keeps between forward and backward
    offload: tuple[str, ...] = ()
    # Experts held per rank of the ``expert`` axis (contiguous runs of the stacked expert
    # axis, in rank order; uneven where ranks differ); empty: an even split
    experts: tuple[int, ...] = ()
    predicted_fwd_s: float = 0.0
    predicted_bwd_s: float = 0.0
    predicted_memory_bytes: float = 0.0

    def axis(self, name: str) -> int:
        return dict(self.mesh_shape).get(name, 1)

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Stages in order; ``micro_batch_size`` counts samples per data way of the first
    stage, so a micro-batch holds ``micro_batch_size * data_ways(stages[0])`` samples;
    any stage may have other data ways dividing that (Metis-style: a slow GPU type can
    run more data ways of fewer samples each; see ``stage_micro_batch`` otherwise)."""

    stages: tuple[Stage, ...]
    batch_share: int
    micro_batch_size: int
    num_micro_batches: int
    schedule: str = "1f1b"
    virtual_stages: int = 1  # stages per submesh (interleaved when > 1)
    # 1F1B: per submesh, forwards it runs ahead beyond the schedule's warm-up (empty: none)
    extra_warmup: tuple[int, ...] = ()

    @property
    def samples_per_micro_batch(self) -> int:
        return self.micro_batch_size * data_ways(self.stages[0])

    def stage_micro_batch(self, j: int) -> int:
        """Samples per data way of stage ``j`` (its per-device micro-batch). Data ways
        that do not divide the micro-batch each run all of it (the runtime replicates
        it over them, as plans of schema 2 could ask)."""
        samples, ways = self.samples_per_micro_batch, data_ways(self.stages[j])
        return samples // ways if samples % ways == 0 else samples

    @property
    def num_workers(self) -> int:
        """Submeshes the pipeline runs on (``len(stages) / virtual_stages``)."""
        return len(self.stages) // max(1, self.virtual_stages)

    def worker_of(self, stage: int) -> int:
        return stage % self.num_workers

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for s in self.stages[:self.num_workers] for d in s.devices)


@dataclasses.dataclass(frozen=True)
class GradSync:
    """Layers ``[start, end)``: gradients summed over ``devices`` (every stage holding
    them), each holding pipeline weighted by its share of the batch (``weights``)."""

    start: int
    end: int
    devices: tuple[int, ...]
    weights: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Context:
    degree: int = 1
    chunk_lengths: tuple[int, ...] = ()
    zigzag: bool = True
    # The state (weights, optimizer moments) sharded over the context axis too: the
    # sharding FSDP gives a leaf spans ``fsdp x context`` (ZeRO-3 over every device of
    # the stage but its tensor ranks, as Megatron-LM's distributed optimizer spans its
    # data and context groups); else replicated over ``context``.
    shard_state: bool = False


@dataclasses.dataclass(frozen=True)
class Predicted:
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    tflops_per_gpu: float = 0.0
    mfu: float = 0.0
    bubble_fraction: float = 0.0
    peak_memory_bytes: float = 0.0
    fits: bool = True
    upper_bound_tokens_per_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class SolverStats:
    wall_time_s: float = 0.0
    status: str = "fixed"
    gap: float = 0.0


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str
    # The cluster the plan is for (a spec dict is read as one; None or {}: not said)
    cluster: Cluster | None
    global_batch: int
    seq_len: int
    pipelines: tuple[Pipeline, ...]
    # The gradient sum of each stage streams in buckets from the start of its last
    # backward (PyTorch DDP's and Megatron-LM's overlap), else it starts once every
    # holder's backward is done (the simulator prices either).
    grad_sync_overlap: bool = True
    context: Context = Context()
    dtype: str = "bfloat16"
    fsdp: bool = False
    # ZeRO-1 (Megatron-LM's distributed optimizer): every stage's optimizer state is
    # sharded over its data axis; gradients are reduce-scattered, each data way updates
    # its shard, and the updated parameters are all-gathered.
    distributed_optimizer: bool = False
    # The attention implementation (``hetshard.kernel_choice``): "auto" (per stage's
    # devices and call, the fastest that computes it: cuDNN, the flash kernel, XLA),
    # "cudnn", "flash" (Pallas kernel) or "reference" (XLA, O(S^2) memory).
    attention: str = "auto"
    # Layers are block halves (attention, MLP): stage boundaries may fall inside a block,
    # and every layer index (stages, grad_sync, remat_layers) counts halves.
    split_blocks: bool = False
    # Tensor-parallel stages run their matmuls as collective matmuls (the sequence-
    # parallel reduce-scatters and all-gathers overlapped with the matmul blocks).
    tp_overlap: bool = False
    # The traced program the plan was made for (``hetshard.Program.fingerprint``: its
    # loss's equations, state and batch shapes); "" for a plan written by hand.
    fingerprint: str = ""
    # GPU types whose stages compute in another dtype than ``dtype``: (type, dtype) pairs,
    # e.g. (("V100", "float16"),) for a bfloat16 program on a cluster with V100s, which
    # have no bfloat16 tensor cores. Such a stage runs its matmuls and attention in that
    # dtype (its other values keep the program's), and the runtime scales the loss
    # dynamically while any stage computes in float16.
    gpu_dtypes: tuple[tuple[str, str], ...] = ()
    # Expert parallelism's token exchange for dropless mixture-of-experts layers: None
    # sends every routed token (exact; buffers sized for the worst case); a factor c > 0
    # sends at most c * (tokens * top_k / expert ranks) rows to each rank and drops the
    # rest (MaxText's and GShard's capacity factor): less memory and traffic, not exact
    capacity_factor: float | None = None
    predicted: Predicted = Predicted()
    solver: SolverStats = SolverStats()
    version: int = SCHEMA_VERSION

    def __post_init__(self):
        if isinstance(self.cluster, Mapping):
            object.__setattr__(self, "cluster", Cluster.from_dict(
                self.cluster, source="plan.cluster") if self.cluster else None)
        elif self.cluster is not None and not isinstance(self.cluster, Cluster):
            raise SpecError("cluster", type(self.cluster).__name__,
                            "a Cluster, a cluster spec (dict) or None")
        validate(self)

    @functools.cached_property
    def grad_sync(self) -> tuple[GradSync, ...]:
        """Per layer interval, the devices holding it and each holding pipeline's batch
        weight: derived from the pipelines (:func:`grad_sync_for`), never stored, so a
        plan changed in code or by hand cannot carry a stale one."""
        return grad_sync_for(self.pipelines, self.global_batch)

    # ---- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON values (its cluster as the spec ``Cluster.to_dict`` writes;
        ``{}`` when the plan names none)."""
        d = dataclasses.asdict(self)
        d["cluster"] = self.cluster.to_dict() if self.cluster is not None else {}
        return _to_jsonable(d)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def what_runs(self) -> str:
        """The plan's JSON without the solver's statistics (its wall time differs from
        run to run) and the predictions (a pinned plan is re-priced where it runs): what
        processes must agree on before running it."""
        d = self.to_dict()
        d.pop("solver")
        d.pop("predicted")
        for p in d["pipelines"]:
            for st in p["stages"]:
                for k in [k for k in st if k.startswith("predicted_")]:
                    del st[k]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "plan") -> Plan:
        if not isinstance(d, dict):
            raise SpecError("plan", type(d).__name__, "a JSON object", where=source)
        if "version" not in d and isinstance(d.get("plan"), dict) and "version" in d["plan"]:
            # ``hetshard simulate --json`` and ``hetshard plan --json`` write the plan
            # under "plan", next to their predictions: it pins as it is.
            d = d["plan"]
        if d.get("version") not in READS_VERSIONS:
            raise SpecError("version", d.get("version"),
                            f"one of {READS_VERSIONS} (this hetshard's plan schemas)",
                            where=source)
        try:
            # Older versions read unchanged: the fields they lack take their defaults
            # (one virtual stage, no distributed optimizer, ...); before 10, activation
            # layouts move out of ``shardings``.
            if d["version"] < 13 and "attention" not in d:
                d = {**d, "attention": "flash"}
            if d["version"] < 10:
                d = _split_activations(d)
            if d["version"] < 11:
                d = _overlap_flag(d)
            elif "grad_sync" in d:
                raise SpecError("grad_sync", "given", "no such field since plan schema 11 "
                                "(it is derived from the pipelines; grad_sync_overlap says "
                                "whether the sum overlaps the last backward)")
            return _from(cls, {**d, "version": SCHEMA_VERSION})
        except SpecError as e:
            if e.where or type(e) is not SpecError:
                raise
            raise SpecError(e.field, e.value, e.accepted, where=source) from None
        except (TypeError, KeyError, AttributeError) as e:
            raise SpecError("plan", "malformed", f"a plan of schema {SCHEMA_VERSION} ({e})",
                            where=source) from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "plan JSON") -> Plan:
        return cls.from_dict(parse_json(text, source), source=source)

    def save(self, path: str | os.PathLike) -> None:
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        return cls.from_json(read_text(path, "plan"), source=str(path))

    # ---- views -----------------------------------------------------------------------
    def stage_dtype(self, stage: Stage) -> str:
        """The dtype ``stage`` computes its matmuls in: its GPU type's entry of
        ``gpu_dtypes``, else the plan's ``dtype`` (a stage spanning types: theirs when
        they agree)."""
        return stage_dtype(stage.gpu, self.dtype, self.gpu_dtypes)

    def context_chunks(self, stage: Stage) -> tuple[int, ...]:
        """The sequence chunk each of ``stage``'s context ranks attends when they are
        uneven (``context.chunk_lengths``, for a stage of that context degree), else ()."""
        chunks = self.context.chunk_lengths
        if stage.axis("context") != len(chunks) or len(set(chunks)) < 2:
            return ()
        return tuple(chunks)

    @property
    def loss_scaled(self) -> bool:
        """Whether the runtime scales the loss: some stage computes in float16 where the
        program does not."""
        return self.dtype != "float16" and any(d == "float16" for _, d in self.gpu_dtypes)

    @property
    def num_devices(self) -> int:
        return sum(len(p.devices) for p in self.pipelines)

    def summary(self) -> str:
        """The plan on one line: pipelines, their stages' GPU types and meshes, the
        prediction."""
        pipes = []
        for p in self.pipelines:
            stages = " | ".join(
                f"{s.gpu} " + ("x".join(f"{a}{n}" for a, n in s.mesh_shape if n > 1) or "1")
                for s in p.stages[:p.num_workers])
            pipes.append(f"[{stages}] {p.num_micro_batches} micro-batches of "
                         f"{p.samples_per_micro_batch}")
        pr = self.predicted
        bound = (f" ({pr.tokens_per_s / pr.upper_bound_tokens_per_s:.0%} of the bound)"
                 if pr.upper_bound_tokens_per_s else "")
        return (f"{len(self.pipelines)} pipeline(s) {', '.join(pipes)}; predicted "
                f"{pr.tokens_per_s:,.0f} {self.unit}/s{bound}, step "
                f"{seconds(pr.step_time_s)}")

    @property
    def unit(self) -> str:
        """What the throughput counts: tokens, or samples for a model without a sequence
        (a ViT's images, seq_len 1)."""
        return "tokens" if self.seq_len > 1 else "samples"

    def stage_attention(self, stage: Stage) -> str:
        """The attention implementation ``stage`` runs on its GPU type: the plan's, or
        ``auto``'s choice there for a causal call in the stage's dtype (a call of another
        pattern can take another; ``hetshard.kernel_choice``); ``auto`` for a plan
        without its cluster."""
        if self.attention != "auto" or self.cluster is None:
            return self.attention
        from hetshard.kernel_choice import Hardware, Pattern, choose
        types = {g.gpu.name: g.gpu for g in self.cluster.groups}
        chosen = {choose(Hardware.of_type(types[n]), Pattern(dtype=self.stage_dtype(stage)))
                  for n in stage.gpu.split("+")}
        return "/".join(sorted(chosen))

    def explain(self) -> str:
        """A readable table of the plan."""
        seq = f", seq {self.seq_len}" if self.seq_len > 1 else " samples"
        lines = [f"plan for {self.model}: global batch {self.global_batch}{seq}, "
                 f"{self.num_devices} devices, dtype {self.dtype}"
                 + "".join(f", {g} in {d}" for g, d in self.gpu_dtypes)
                 + (" (loss scaled)" if self.loss_scaled else "")
                 + f", attention {self.attention} (per stage: attn, where the "
                   f"program has any)"
                 + (", FSDP" if self.fsdp else "")
                 + (", layers are block halves (attention, MLP)" if self.split_blocks else "")
                 + (", distributed optimizer" if self.distributed_optimizer else "")
                 + (f", expert exchange capacity {self.capacity_factor:g} (tokens past it "
                    f"dropped)" if self.capacity_factor is not None else "")]
        stages = [s for p in self.pipelines for s in p.stages]
        t_unit, t_scale = _unit(max(max(s.predicted_fwd_s, s.predicted_bwd_s)
                                    for s in stages), _TIME_UNITS)
        m_unit, m_scale = _unit(max(s.predicted_memory_bytes for s in stages), _BYTE_UNITS)
        # columns as wide as their widest entry (a named remat policy, a 3-axis mesh)
        rw = max(9, *(len(_remat_text(s)) for s in stages))
        mw = max(22, *(len(_mesh_text(s)) for s in stages))
        dw = max(16, *(len(_ranges(s.devices)) for s in stages))
        gw = max(10, *(len(s.gpu) for s in stages))
        hdr = (f"{'pipe':>4} {'stage':>5} {'gpu':>{gw}} {'layers':>9} {'mesh':>{mw}} "
               f"{'devices':>{dw}} {'mbs':>4} {'remat':>{rw}} {'attn':>9} {'fwd ' + t_unit:>8} "
               f"{'bwd ' + t_unit:>8} {'mem ' + m_unit:>7}")
        lines.append(hdr)
        for i, p in enumerate(self.pipelines):
            inter = (f", interleaved: {p.virtual_stages} stages per submesh"
                     if p.virtual_stages > 1 else "")
            if any(p.extra_warmup):
                inter += f", extra warm-up {list(p.extra_warmup)}"
            lines.append(f"  pipeline {i}: batch share {p.batch_share}, {p.num_micro_batches} "
                         f"micro-batches of {p.samples_per_micro_batch} samples, "
                         f"{p.schedule}{inter}")
            for j, s in enumerate(p.stages):
                mesh, devs = _mesh_text(s), _ranges(s.devices)
                lines.append(f"{i:>4} {j:>5} {s.gpu:>{gw}} {f'{s.start}-{s.end - 1}':>9} "
                             f"{mesh:>{mw}} {devs:>{dw}} {p.stage_micro_batch(j):>4} "
                             f"{_remat_text(s):>{rw}} {self.stage_attention(s):>9} "
                             f"{s.predicted_fwd_s / t_scale:>8.2f} "
                             f"{s.predicted_bwd_s / t_scale:>8.2f} "
                             f"{s.predicted_memory_bytes / m_scale:>7.2f}")
        shared = [g for g in self.grad_sync if len(g.weights) > 1]
        when = "during" if self.grad_sync_overlap else "after"
        lines.append("gradient sync " + (
            "across pipelines: " + "; ".join(
                f"layers {g.start}-{g.end - 1} over {len(g.devices)} devices weighted "
                + "/".join(f"{w:.3g}" for w in g.weights) for g in shared)
            if shared else "within each stage's data ways" if any(
                data_ways(s) > 1 for p in self.pipelines for s in p.stages)
            else "not needed (one device per stage, one pipeline)")
            + ("" if not self.grad_sync else f", {when} the last backward"))
        pr = self.predicted
        lines.append(f"predicted: step {seconds(pr.step_time_s)}, {pr.tokens_per_s:,.0f} "
                     f"{self.unit}/s, {pr.tflops_per_gpu:.3g} TFLOP/s per GPU, MFU {pr.mfu:.1%}, "
                     f"bubble {pr.bubble_fraction:.1%}, peak memory "
                     f"{nbytes(pr.peak_memory_bytes)}, fits={pr.fits}")
        if pr.upper_bound_tokens_per_s:
            lines.append(f"upper bound {pr.upper_bound_tokens_per_s:,.0f} {self.unit}/s "
                         f"({pr.tokens_per_s / pr.upper_bound_tokens_per_s:.1%} reached)")
        sv = self.solver
        lines.append(f"solver: {sv.status}, {sv.wall_time_s:.2f} s, gap {sv.gap:.1%}")
        return "\n".join(lines)


_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))
_BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0))


def _unit(value: float, units) -> tuple[str, float]:
    """The largest unit in which ``value`` is at least 1 (the smallest unit below)."""
    for name, scale in units:
        if value >= scale:
            return name, scale
    return units[-1]


def seconds(t: float) -> str:
    """``t`` seconds in the unit that fits: ``1.25 s``, ``31.2 ms``, ``85 us``."""
    name, scale = _unit(t, _TIME_UNITS)
    return f"{t / scale:.3g} {name}"


def nbytes(n: float) -> str:
    """``n`` bytes in the unit that fits (decimal): ``81.6 GB``, ``3.2 MB``."""
    name, scale = _unit(n, _BYTE_UNITS)
    return f"{n / scale:.3g} {name}"


def grad_sync_for(pipes, global_batch: int) -> tuple[GradSync, ...]:
    """For each layer interval, the devices holding it and each pipeline's batch weight."""
    cuts = sorted({b for p in pipes for s in p.stages for b in (s.start, s.end)})
    out = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        devices, weights = [], []
        for p in pipes:
            for s in p.stages:
                if s.start <= a and s.end >= b:
                    devices += list(s.devices)
                    weights.append(p.batch_share / global_batch)
        if len(devices) > 1:
            out.append(GradSync(a, b, tuple(devices), tuple(weights)))
    return tuple(out)


def _ranges(ids) -> str:
    ids = list(ids)
    if not ids:
        return "-"
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return ",".join(map(str, ids))


def stage_dtype(gpu: str, dtype: str, gpu_dtypes) -> str:
    """The compute dtype of a stage on ``gpu`` (a catalog name, or names joined by "+"
    for a stage spanning types) under a plan's ``dtype`` and ``gpu_dtypes``."""
    table = dict(gpu_dtypes)
    found = {table.get(g, dtype) for g in gpu.split("+")}
    return found.pop() if len(found) == 1 else dtype


def _count(value, field: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(field, value, "a positive integer" if minimum == 1
                        else f"an integer >= {minimum}")


def _check_types(plan: Plan) -> None:
    """Every count an integer in range, every device list a list of distinct device ids
    within the plan's cluster, the dtype one hetshard computes in."""
    _count(plan.global_batch, "global_batch")
    _count(plan.seq_len, "seq_len")
    if plan.dtype not in DTYPES:
        raise SpecError("dtype", plan.dtype, f"one of {DTYPES}")
    if not isinstance(plan.gpu_dtypes, tuple) or any(
            not isinstance(e, tuple) or len(e) != 2 or not isinstance(e[0], str)
            for e in plan.gpu_dtypes):
        raise SpecError("gpu_dtypes", plan.gpu_dtypes, "a list of [GPU type, dtype] pairs")
    if len({g for g, _ in plan.gpu_dtypes}) != len(plan.gpu_dtypes):
        raise SpecError("gpu_dtypes", [list(e) for e in plan.gpu_dtypes],
                        "each GPU type at most once")
    for gpu, dt in plan.gpu_dtypes:
        if dt not in DTYPES:
            raise SpecError(f"gpu_dtypes[{gpu}]", dt, f"one of {DTYPES}")
    total = _cluster_devices(plan.cluster)
    if not isinstance(plan.pipelines, tuple):
        raise SpecError("pipelines", plan.pipelines, "a list of pipelines")
    for i, p in enumerate(plan.pipelines):
        at = f"pipelines[{i}]"
        for name in ("batch_share", "micro_batch_size", "num_micro_batches"):
            _count(getattr(p, name), f"{at}.{name}")
        if not isinstance(p.stages, tuple):
            raise SpecError(f"{at}.stages", p.stages, "a list of stages")
        for j, st in enumerate(p.stages):
            where = f"{at}.stages[{j}]"
            _count(st.start, f"{where}.start", 0)
            _count(st.end, f"{where}.end")
            if not isinstance(st.gpu, str):
                raise SpecError(f"{where}.gpu", st.gpu, "a GPU type name")
            devs = st.devices
            if not isinstance(devs, tuple) or not devs or any(
                    isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devs):
                raise SpecError(f"{where}.devices", devs,
                                "a non-empty list of device ids (integers >= 0), e.g. "
                                "[0, 1, 2, 3]")
            if len(set(devs)) != len(devs):
                dup = sorted({d for d in devs if devs.count(d) > 1})
                raise SpecError(f"{where}.devices", list(devs),
                                f"distinct device ids ({dup} repeated)")
            if total is not None and max(devs) >= total:
                raise SpecError(f"{where}.devices", max(devs),
                                f"device ids below the plan's cluster's {total} devices")
            if not isinstance(st.mesh_shape, tuple) or any(
                    not isinstance(a, tuple) or len(a) != 2 or not isinstance(a[1], int)
                    or isinstance(a[1], bool) or a[1] < 1 for a in st.mesh_shape):
                raise SpecError(f"{where}.mesh_shape", st.mesh_shape,
                                "a list of [axis, size] pairs with positive sizes")
            for field in ("shardings", "activations"):
                entries = getattr(st, field)
                if not isinstance(entries, tuple) or any(
                        not isinstance(e, tuple) or len(e) != 2 or not isinstance(e[0], str)
                        or not isinstance(e[1], tuple) for e in entries):
                    raise SpecError(f"{where}.{field}", entries,
                                    "a list of [name, [axis or null, ...]] pairs")
            bad = [n for n, _ in st.shardings if n.startswith(_ACTIVATION_PREFIX)]
            if bad:
                raise SpecError(f"{where}.shardings", bad[0],
                                "parameter paths (activation layouts go in "
                                f"{where}.activations, since plan schema 10)")


def _check_attention(plan: Plan) -> None:
    """An explicit implementation must run on every stage's GPU type in its dtype."""
    from hetshard.kernel_choice import IMPLEMENTATIONS, check_types
    if plan.attention not in IMPLEMENTATIONS:
        raise SpecError("attention", plan.attention, f"one of {IMPLEMENTATIONS}")
    if plan.cluster is None or plan.attention == "auto":
        return
    types = {g.gpu.name: g.gpu for g in plan.cluster.groups}
    for p in plan.pipelines:
        for st in p.stages:
            for name in st.gpu.split("+"):
                if name in types:
                    check_types(plan.attention, [types[name]],
                                {name: plan.stage_dtype(st)})


def _check_gpus(plan: Plan) -> None:
    """Each stage's ``gpu`` names the GPU types its devices are in the plan's cluster
    (joined by ``+``, sorted, for a stage over several): a plan that says V100 for
    devices the cluster binds to H100s would be priced as one and shown as the other."""
    if plan.cluster is None:
        return
    for i, p in enumerate(plan.pipelines):
        for j, st in enumerate(p.stages):
            names = sorted({plan.cluster.gpu_of(d).name for d in st.devices})
            if set(st.gpu.split("+")) != set(names):
                raise SpecError(f"pipelines[{i}].stages[{j}].gpu", st.gpu,
                                f"{'+'.join(names)!r}, the GPU type of its devices "
                                f"{_ranges(st.devices)} in the plan's cluster "
                                f"{plan.cluster.name!r}")


def _cluster_devices(cluster: Cluster | None) -> int | None:
    """The device count of a plan's cluster (None where the plan names none)."""
    return None if cluster is None else cluster.num_devices


def validate(plan: Plan) -> None:
    """Structural checks every plan must pass (the planner's output and loaded JSON)."""
    if not plan.pipelines:
        raise SpecError("pipelines", [], "at least one pipeline")
    _check_types(plan)
    _check_gpus(plan)
    _check_attention(plan)
    for name in ("fsdp", "distributed_optimizer", "split_blocks", "tp_overlap",
                 "grad_sync_overlap"):
        if not isinstance(getattr(plan, name), bool):
            raise SpecError(name, getattr(plan, name), "true or false")
    if not isinstance(plan.context.shard_state, bool):
        raise SpecError("context.shard_state", plan.context.shard_state, "true or false")
    c = plan.capacity_factor
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or
                          not math.isfinite(c) or c <= 0):
        raise SpecError("capacity_factor", c, "null (dropless) or a number > 0")
    shares = sum(p.batch_share for p in plan.pipelines)
    if shares != plan.global_batch:
        raise SpecError("pipelines[*].batch_share", shares,
                        f"shares summing to global_batch={plan.global_batch}")
    seen: set[int] = set()
    for i, p in enumerate(plan.pipelines):
        if p.schedule not in SCHEDULES:
            raise SpecError(f"pipelines[{i}].schedule", p.schedule, f"one of {SCHEDULES}")
        if p.schedule == "zbh1" and p.virtual_stages != 1:
            raise SpecError(f"pipelines[{i}].schedule", p.schedule,
                            "1f1b or gpipe with virtual_stages > 1 (ZB-H1 runs one stage "
                            "per submesh)")
        if not p.stages or p.stages[0].start != 0:
            raise SpecError(f"pipelines[{i}].stages[0].start",
                            p.stages[0].start if p.stages else None, "0")
        _check_virtual(p, i)
        for j, s in enumerate(p.stages):
            if j and s.start != p.stages[j - 1].end:
                raise SpecError(f"pipelines[{i}].stages[{j}].start", s.start,
                                f"the previous stage's end {p.stages[j - 1].end} (contiguous)")
            if s.end <= s.start:
                raise SpecError(f"pipelines[{i}].stages[{j}].end", s.end, f"> start {s.start}")
            _check_remat(s, f"pipelines[{i}].stages[{j}]")
            size = 1
            for axis, n in s.mesh_shape:
                if axis not in MESH_AXES:
                    raise SpecError(f"pipelines[{i}].stages[{j}].mesh_shape", axis,
                                    f"axes among {MESH_AXES}")
                size *= n
            if size != len(s.devices):
                raise SpecError(f"pipelines[{i}].stages[{j}].mesh_shape", s.mesh_shape,
                                f"a shape whose product is its {len(s.devices)} devices")
            _check_experts(s, f"pipelines[{i}].stages[{j}]")
            if j >= p.num_workers:
                continue  # a later virtual stage on stage j mod p's submesh (checked above)
            dup = seen.intersection(s.devices)
            if dup:
                raise SpecError(f"pipelines[{i}].stages[{j}].devices", sorted(dup)[:4],
                                "devices used by no other stage")
            seen.update(s.devices)
        if p.samples_per_micro_batch * p.num_micro_batches != p.batch_share:
            raise SpecError(f"pipelines[{i}].batch_share", p.batch_share,
                            f"micro_batch_size*num_micro_batches*data = "
                            f"{p.micro_batch_size}*{p.num_micro_batches}*"
                            f"{data_ways(p.stages[0])}")
    ends = {p.stages[-1].end for p in plan.pipelines}
    if len(ends) != 1:
        raise SpecError("pipelines[*].stages[-1].end", sorted(ends),
                        "every pipeline covering the same layers")


def _mesh_text(s: Stage) -> str:
    """``data=2xexpert=4``, with an uneven placement's experts per rank: ``expert=2[3,1]``."""
    return "x".join(f"{a}={n}" + (f"[{','.join(map(str, s.experts))}]"
                                  if a == "expert" and s.experts else "")
                    for a, n in s.mesh_shape)


def _remat_text(s: Stage) -> str:
    """``full`` or, for a remat of some of the stage's layers, ``full 5/9``."""
    k = s.remat_layers
    text = s.remat if k is None or k == s.num_layers else f"{s.remat} {k}/{s.num_layers}"
    return text + "".join(" +" + ("opt" if o == "optimizer" else "act") for o in s.offload)


def _check_remat(s: Stage, where: str) -> None:
    check_remat(s.remat, f"{where}.remat")
    if check_offload(s.offload, s.remat, f"{where}.offload") != s.offload:
        raise SpecError(f"{where}.offload", list(s.offload),
                        "its names in the order of hetshard.offload.OFFLOADS")
    k = s.remat_layers
    if k is None:
        return
    if s.remat == "none":
        raise SpecError(f"{where}.remat_layers", k, "null when remat is none")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= s.num_layers:
        raise SpecError(f"{where}.remat_layers", k,
                        f"null or a count of the stage's layers, 1 to {s.num_layers}")


def _check_experts(s: Stage, where: str) -> None:
    """``Stage.experts``: empty, or a count per rank of an expert axis of more than one."""
    e = s.experts
    if not isinstance(e, tuple):
        raise SpecError(f"{where}.experts", e, "a list of expert counts")
    if not e:
        return
    n = s.axis("expert")
    if n < 2 or len(e) != n or any(isinstance(x, bool) or not isinstance(x, int) or x < 0
                                   for x in e) or not sum(e):
        raise SpecError(f"{where}.experts", list(e),
                        f"empty (an even split), or one count >= 0 per rank of the "
                        f"stage's expert axis ({n})" + ("" if n > 1 else
                                                          ": the stage has no expert axis"))


def _check_virtual(p: Pipeline, i: int) -> None:
    """Interleaved pipelines: ``p * v`` stages, stage j on stage (j mod p)'s submesh."""
    v = p.virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SpecError(f"pipelines[{i}].virtual_stages", v, "a positive integer")
    if v > 1:
        n = len(p.stages)
        if n % v or n // v < 2:
            raise SpecError(f"pipelines[{i}].virtual_stages", v,
                            f"a divisor of the pipeline's {n} stages leaving at least 2 "
                            f"submeshes")
        w = n // v
        for j in range(w, n):
            a, b = p.stages[j % w], p.stages[j]
            if (a.devices, a.mesh_shape, a.gpu) != (b.devices, b.mesh_shape, b.gpu):
                raise SpecError(f"pipelines[{i}].stages[{j}].devices", list(b.devices),
                                f"stage {j % w}'s devices {list(a.devices)}, mesh and GPU "
                                f"(virtual stage {j // w} of submesh {j % w})")
    _check_warmup(p, i)


def _check_warmup(p: Pipeline, i: int) -> None:
    """Extra warm-up: 1F1B without virtual stages, one count per submesh, and warm-up
    forwards (``p - w - 1 + extra[w]``) that never grow along the pipeline (else the
    schedule could deadlock)."""
    k = p.extra_warmup
    if not k:
        return
    n = len(p.stages)
    ok = (p.schedule in ("1f1b", "zbh1") and p.virtual_stages == 1 and len(k) == n and
          all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in k))
    if ok:
        warm = [n - w - 1 + e for w, e in enumerate(k)]
        ok = all(a >= b for a, b in zip(warm, warm[1:], strict=False))
    if not ok:
        raise SpecError(f"pipelines[{i}].extra_warmup", list(k),
                        f"empty, or (1f1b or zbh1 without virtual stages) one non-negative "
                        f"count per submesh ({n}) keeping the warm-up forwards (p - w - 1 + "
                        f"extra[w]) from growing along the pipeline (that would deadlock)")


def data_ways(s: Stage) -> int:
    """Data-parallel ways inside a stage (the product of its ``BATCH_AXES``)."""
    return math.prod(s.axis(a) for a in BATCH_AXES)


def named_spec(specs, path: str, rank: int | None = None) -> tuple | None:
    """The entries ``specs`` (``Stage.shardings`` pairs or a dict of them) give parameter
    ``path``: the longest name that is the path or ends it (``.../name``), of ``rank``
    entries where given; None where no name matches."""
    best = None
    for name, entries in (specs.items() if isinstance(specs, Mapping) else specs):
        if (path == name or path.endswith("/" + name)) and (
                rank is None or len(entries) == rank) and (
                best is None or len(name) > len(best[0])):
            best = (name, tuple(entries))
    return None if best is None else best[1]


def spec_axes(entries) -> set[str]:
    """The mesh axes PartitionSpec-style ``entries`` name (each entry None, an axis name
    or a tuple of them; None entries: nothing)."""
    return {a for e in entries or () if e is not None
            for a in ((e,) if isinstance(e, str) else e)}


def _to_jsonable(x):
    if isinstance(x, dict):
        return {k: _to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_jsonable(v) for v in x]
    return x


def _tuplify(x):
    if isinstance(x, list):
        return tuple(_tuplify(v) for v in x)
    return x


def _overlap_flag(d: dict) -> dict:
    """A schema <= 10 plan dict without its ``grad_sync`` entries (hetshard derived them
    from the pipelines when it wrote them, and derives them again) and with their
    ``overlap`` flags as ``grad_sync_overlap`` (true unless one said false; their
    ``collective`` names were never read)."""
    d = dict(d)
    given = d.pop("grad_sync", [])
    if not isinstance(given, list):
        raise SpecError("grad_sync", given, "a list of {start, end, devices, weights, "
                        "collective, overlap} (plan schema <= 10)")
    d.setdefault("grad_sync_overlap", all(not isinstance(g, dict) or g.get("overlap", True)
                                          is not False for g in given))
    return d


def _split_activations(d: dict) -> dict:
    """A schema <= 9 plan dict with each stage's "activation:<layer>" shardings moved to
    ``activations`` (malformed entries are left for validation to name)."""
    def named_activation(e) -> bool:
        return isinstance(e, list) and bool(e) and isinstance(e[0], str) \
            and e[0].startswith(_ACTIVATION_PREFIX)

    def split(st):
        if not isinstance(st, dict) or not isinstance(st.get("shardings"), list):
            return st
        entries = st["shardings"]
        return {**st, "shardings": [e for e in entries if not named_activation(e)],
                "activations": [[e[0][len(_ACTIVATION_PREFIX):], *e[1:]] for e in entries
                                if named_activation(e)]}

    if not isinstance(d.get("pipelines"), list):
        return d
    return {**d, "pipelines": [
        {**p, "stages": [split(st) for st in p["stages"]]}
        if isinstance(p, dict) and isinstance(p.get("stages"), list) else p
        for p in d["pipelines"]]}


def _from(cls, d):
    kw = {}
    hints = {f.name: f for f in dataclasses.fields(cls)}
    extra = set(d) - set(hints)
    if extra:
        raise KeyError(f"unknown field {sorted(extra)[0]!r} in {cls.__name__}")
    for name, value in d.items():
        sub = {"pipelines": Pipeline, "stages": Stage}.get(name)
        if sub is not None:
            kw[name] = tuple(_from(sub, v) for v in value)
        elif name == "context":
            kw[name] = _from(Context, value)
        elif name == "predicted":
            kw[name] = _from(Predicted, value)
        elif name == "solver":
            kw[name] = _from(SolverStats, value)
        elif name == "cluster":
            kw[name] = value
        else:
            kw[name] = _tuplify(value)
    return cls(**kw)

