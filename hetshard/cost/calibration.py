"""Efficiency factors that turn datasheet peaks into attainable rates.

``matmul_eff`` scales peak FLOP/s for large GEMMs (smaller ones lose more to tile and
wave quantization: ``hetshard.cost.stage.matmul_shape_eff``), ``memory_eff`` scales HBM
bandwidth for the non-matmul (memory-bound) kernels, ``fusion`` multiplies the bytes of
the fused kernels the cost model forms as XLA does (``OpGraph.kernels``: each reads its
inputs and writes its outputs once), ``kernel_launch_s`` is added per kernel,
and ``comm_eff`` scales link bandwidths (NCCL bus bandwidth vs line rate).

Defaults: 0.8 of HBM bandwidth for streaming kernels, fused kernels' bytes as they are
(fusion 1.0), 1 us per kernel (all set before any comparison with measurements), and for
large GEMMs the GPU type's catalog ``matmul_eff`` (fitted per architecture on documented
measured rows: ``hetshard.cluster.catalog``; experiments/cost_model_accuracy.py reports
every other row held out), else 0.75 of peak. Every GPU type uses these unless a
calibration file (``hetshard profile``) says otherwise. ``comm_eff`` 0.8: nccl-tests all-reduce
bus bandwidth on DGX A100 reaches ~230 of 300 GB/s NVLink per direction.
Latencies: ~10 us per NVLink hop and ~20 us per network hop (nccl-tests
small-message all-reduce times, order of magnitude).
"""

from __future__ import annotations

import dataclasses
import json
import os

from hetshard.cost.measured import is_profile, load_profiles
from hetshard.errors import SpecError, check_positive
from hetshard.fileio import parse_json, read_text, write_atomic

# Version 2: ``fusion`` multiplies the bytes of the fused kernels the cost model forms
# (``OpGraph.kernels``), where version 1's was the fraction of unfused bytes; and
# ``kernel_launch_s``.
VERSION = 2
V1_FUSION = 0.2


# Large GEMMs' share of the peak where neither a calibration nor the GPU type's catalog
# entry gives one (cuBLAS on A100/H100 reaches 70-80% of dense peak on large shapes).
MATMUL_EFF = 0.75


@dataclasses.dataclass(frozen=True)
class Efficiency:
    # None: the GPU type's catalog ``matmul_eff`` (fitted per architecture), else
    # MATMUL_EFF; a calibration's measured value wins.
    matmul_eff: float | None = None
    memory_eff: float = 0.8
    fusion: float = 1.0
    comm_eff: float = 0.8
    intra_latency_s: float = 10e-6
    inter_latency_s: float = 20e-6
    # Attention's products (inside hetshard_attention, forward and backward) as a
    # fraction of peak, counting the products the kernel computes (a causal flash kernel
    # skips the masked half of the scores). None: the catalog's FlashAttention-2 rate for
    # the GPU type where published (``hetshard.cost.stage.attention_rate``);
    # ``hetshard profile`` measures it.
    attention_eff: float | None = None
    # A transfer hidden behind compute still slows it by this fraction of its time (its
    # kernels take SMs and memory bandwidth): FSDP's per-layer gathers behind the layer
    # before. An assumption, not a measurement (a calibration file can replace it).
    overlap_interference: float = 0.2
    # The same for a collective matmul's ring steps (``tp_overlap``), which also split
    # each matmul in ``tp`` smaller ones and copy the shards into the ring's buffers.
    # Fitted on torchtitan's Llama 3 70B FSDP 32 x TP 8 pair (asynchronous over vanilla
    # TP: 1.092x measured on H100s; experiments/cost_model_accuracy.py fits it again),
    # with the vanilla rows' sequence-parallel copies priced (most of that speed-up is
    # those copies gone: the overlap itself gains little); checked on the 8B rows it was
    # not fitted on (asynchronous 8B: -3.0%; 0.57 without the copies gave -10.4%).
    tp_overlap_interference: float = 0.78
    # What each kernel adds to its roofline time: the launch and the switch between
    # back-to-back kernels. NVIDIA's CUDA Graphs blog (Gray 2019) measured a 2.9 us kernel
    # at 3.8 us per launch when queued on a stream (3.4 us from a graph): ~1 us.
    kernel_launch_s: float = 1e-6
    # The host's time to dispatch one task of a step (a stage's forward or backward of a
    # micro-batch with its transfers, a stage's update, a single-stage step): a step
    # cannot run faster than its busiest host dispatches it (``hetshard.sim.simulator``,
    # ``host_time_s``). Measured by experiments/runtime_overhead.py (``host_per_task``:
    # a two-stage pipeline of a model with almost no work, 8 micro-batches) on the CPU
    # backend: 2.8-4.9 ms a task under ZB-H1, 3.9-5.5 ms under 1F1B over three runs; on CPU
    # a cheap program runs inside its dispatch, so this is an upper bound there, and the
    # GPU figure is still to be measured with the same script (a calibration file can
    # replace it).
    host_task_s: float = 3e-3
    # The share of a GPU's host link (``DeviceType.host_link_gbs``, the PCIe slot's
    # one-direction rate) that pinned-memory copies reach: CUDA's bandwidthTest commonly
    # reports ~12-13 GB/s of PCIe Gen3 x16's 15.75, ~25 of Gen4's 31.5. An assumption
    # from those commonly reported figures, not measured here (a calibration file can
    # replace it).
    host_link_eff: float = 0.8

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                check_positive(f.name, getattr(self, f.name), where="calibration")

    def matmul(self, gpu) -> float:
        """Large GEMMs' share of ``gpu``'s peak (a ``DeviceType``): this calibration's,
        else the GPU type's catalog value, else MATMUL_EFF."""
        if self.matmul_eff is not None:
            return self.matmul_eff
        return gpu.matmul_eff if gpu.matmul_eff is not None else MATMUL_EFF


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Per GPU type efficiencies (types not listed use ``default``), and measured
    per-layer profiles (``hetshard.cost.measured``), which the cost model prefers
    wherever one covers the model, GPU and tensor degree."""

    default: Efficiency = Efficiency()
    per_type: tuple[tuple[str, Efficiency], ...] = ()
    source: str = "built-in defaults"
    measured: tuple = ()  # MeasuredProfile

    def measured_for(self, block_forward_flops: float, seq: int):
        """The measured profile whose block is the program's (its forward flops at one
        sample of ``seq`` tokens), or None."""
        for m in self.measured:
            if m.matches_at(block_forward_flops, seq):
                return m
        return None

    def combined(self, other: Calibration) -> Calibration:
        """Both calibrations: ``other``'s efficiencies override, profiles from both."""
        per = dict(self.per_type)
        per.update(dict(other.per_type))
        # A measured profile on its own carries the built-in efficiencies: keep ours.
        default = self.default if other.measured and not other.per_type else other.default
        return Calibration(default=default, per_type=tuple(per.items()),
                           source=f"{self.source} + {other.source}",
                           measured=self.measured + other.measured)

    def for_type(self, name: str) -> Efficiency:
        for n, e in self.per_type:
            if n == name:
                return e
        return self.default

    def with_type(self, name: str, eff: Efficiency) -> Calibration:
        rest = tuple((n, e) for n, e in self.per_type if n != name)
        return dataclasses.replace(self, per_type=rest + ((name, eff),))

    def to_dict(self) -> dict:
        return {"version": VERSION, "source": self.source,
                "default": dataclasses.asdict(self.default),
                "per_type": {n: dataclasses.asdict(e) for n, e in self.per_type}}

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "calibration") -> Calibration:
        if not isinstance(d, dict) or d.get("version") not in (1, VERSION):
            raise SpecError("version", d.get("version") if isinstance(d, dict) else d,
                            f"1 or {VERSION} (a hetshard calibration file)", where=source)
        fields = {f.name for f in dataclasses.fields(Efficiency)}

        def eff(x, where):
            extra = set(x) - fields
            if extra:
                raise SpecError(f"{where}.{sorted(extra)[0]}", x[sorted(extra)[0]],
                                f"only {sorted(fields)}", where=source)
            if d["version"] == 1 and "fusion" in x:
                # Version 1's fusion was the fraction of unfused bytes reaching HBM; only
                # its default (0.2) was ever written, which version 2's fused kernels
                # replace. Another value has no version 2 equivalent.
                if x["fusion"] != V1_FUSION:
                    raise SpecError(f"{where}.fusion", x["fusion"],
                                    f"{V1_FUSION} in a version 1 file (the fraction of "
                                    "unfused bytes, replaced by fused kernels); write a "
                                    f"version {VERSION} file, whose fusion multiplies the "
                                    "fused kernels' bytes (default 1.0)", where=source)
                x = {k: v for k, v in x.items() if k != "fusion"}
            return Efficiency(**x)
        return cls(default=eff(d.get("default", {}), "default"),
                   per_type=tuple((n, eff(e, n)) for n, e in d.get("per_type", {}).items()),
                   source=d.get("source", source))

    def save(self, path: str | os.PathLike) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        """A calibration file (``hetshard profile``'s efficiencies) or a measured
        per-layer profile (hetshard's, AMP's or Sailor's: ``hetshard.cost.measured``),
        the latter with the built-in efficiencies for what it does not cover."""
        data = parse_json(read_text(path, "calibration"), str(path))
        if is_profile(data):
            return cls(default=Efficiency(), source=str(path),
                       measured=tuple(load_profiles(data)))
        return cls.from_dict(data, source=str(path))

    @classmethod
    def load_all(cls, paths) -> Calibration:
        """Several files (``--calibration A --calibration B``), later ones overriding
        earlier efficiencies; every measured profile kept."""
        out = None
        for p in paths:
            cal = cls.load(p)
            out = cal if out is None else out.combined(cal)
        return out if out is not None else DEFAULT


DEFAULT = Calibration(default=Efficiency(), source="built-in defaults")
