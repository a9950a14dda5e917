"""Efficiency factors that turn datasheet peaks into attainable rates.

``matmul_eff`` scales peak FLOP/s, ``memory_eff`` scales HBM bandwidth for the
non-matmul (memory-bound) equations, ``fusion`` is the fraction of those
equations' unfused bytes that reach HBM once XLA fuses elementwise chains,
and ``comm_eff`` scales link bandwidths (NCCL bus bandwidth vs line rate).

Defaults were chosen before any comparison with measurements: 0.75 of peak for
large bf16 GEMMs (cuBLAS on A100/H100 reaches 70-80% of dense peak on large
shapes), 0.8 of HBM bandwidth for streaming kernels, and 20% of unfused bytes
surviving XLA fusion. experiments/cost_model_accuracy.py measures them against
Megatron-LM's published A100 figures (every row held out) and also fits the
A100 factors on a documented subset; every GPU type uses these defaults unless a
calibration file (``hetshard profile``) says otherwise. ``comm_eff`` 0.8: nccl-tests all-reduce
bus bandwidth on DGX A100 reaches ~230 of 300 GB/s NVLink per direction.
Latencies: ~10 us per NVLink hop and ~20 us per network hop (nccl-tests
small-message all-reduce times, order of magnitude).
"""

from __future__ import annotations

import dataclasses
import json
import os

from hetshard.errors import SpecError, check_positive
from hetshard.fileio import parse_json, read_text, write_atomic


@dataclasses.dataclass(frozen=True)
class Efficiency:
    matmul_eff: float = 0.75
    memory_eff: float = 0.8
    fusion: float = 0.2
    comm_eff: float = 0.8
    intra_latency_s: float = 10e-6
    inter_latency_s: float = 20e-6
    # Attention's products (inside hetshard_attention, forward and backward) as a
    # fraction of peak, counting the products the kernel computes (a causal flash kernel
    # skips the masked half of the scores). None: the catalog's FlashAttention-2 rate for
    # the GPU type where published (``hetshard.cost.stage.attention_rate``);
    # ``hetshard profile`` measures it.
    attention_eff: float | None = None
    # A transfer a collective matmul hides behind matmuls still slows them by this
    # fraction of its time (its kernels take SMs and memory bandwidth). An assumption,
    # set before the planner benchmark was run with it, not a measurement: a GPU run of
    # experiments/tp_overlap_whatif.py's rows should replace it (a calibration file can).
    overlap_interference: float = 0.2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                check_positive(f.name, getattr(self, f.name), where="calibration")

    @property
    def attention(self) -> float:
        return self.matmul_eff if self.attention_eff is None else self.attention_eff


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
        return {"version": 1, "source": self.source,
                "default": dataclasses.asdict(self.default),
                "per_type": {n: dataclasses.asdict(e) for n, e in self.per_type}}

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "calibration") -> Calibration:
        if not isinstance(d, dict) or d.get("version") != 1:
            raise SpecError("version", d.get("version") if isinstance(d, dict) else d,
                            "1 (a hetshard calibration file)", where=source)
        fields = {f.name for f in dataclasses.fields(Efficiency)}

        def eff(x, where):
            extra = set(x) - fields
            if extra:
                raise SpecError(f"{where}.{sorted(extra)[0]}", x[sorted(extra)[0]],
                                f"only {sorted(fields)}", where=source)
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
        from hetshard.cost.measured import is_profile, load_profiles
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
