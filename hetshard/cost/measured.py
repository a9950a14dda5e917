"""Measured per-layer times: profile-driven pricing, as Sailor, AMP and Metis price plans.

A measured profile holds, per GPU type, the forward and backward time of a model's layer
roles -- ``embedding`` (everything before the first block), ``block`` (one block of the
repeated stack), ``head`` (everything after the last block: final norm, logits, loss) --
keyed by tensor-parallel degree, micro-batch size and sequence length, and optionally the
optimizer update's time per layer. The cost model (``hetshard.cost.stage``) uses a
measured number wherever one exists for the GPU, role and tensor degree, interpolating
over micro-batch sizes and scaling to other sequence lengths by the roofline's ratio; it
falls back to the roofline elsewhere. A profile applies only to the model it was measured
on: its ``model`` description gives a block's forward flops, which must be the program's
within 5%.

Three formats load as they are (:func:`load_profiles`):

* hetshard's own (``"format": "hetshard-profile"``, ``docs/profile-format.md``), which
  ``hetshard profile --model`` writes on the local backend
  (``hetshard.cost.layer_profiler``);
* AMP's published per-layer forward times (``forward_s[gpu]["tp<k>"]`` per layer entry,
  micro-batch 1; AMP prices a backward as twice the forward, here the roofline's ratio);
* Sailor's per-layer profiles (``profiles[model][gpu][mbs][tp][layer] = [forward,
  backward, update]``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from typing import Any

from hetshard.errors import SpecError
from hetshard.fileio import parse_json, read_text, write_atomic

PROFILE_FORMAT = "hetshard-profile"
ROLES = ("embedding", "block", "head")
# External files' GPU names -> the catalog's.
GPU_ALIASES = {"V100-16": "V100-16GB", "V100-32": "V100-32GB", "A100-40": "A100-40GB",
               "A100-80": "A100-80GB", "GH-96": "GH200-96GB", "Titan-RTX": "TITAN-RTX",
               "RTX-2080": "RTX-2080Ti", "H100": "H100-80GB"}
# How close a program's block must be to the measured one (forward flops) to use it.
MATCH_TOLERANCE = 0.05


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of one layer on one GPU: forward, backward (None: not measured) and the
    optimizer update of its parameters (None: not measured)."""

    forward_s: float
    backward_s: float | None = None
    update_s: float | None = None


@dataclasses.dataclass(frozen=True)
class MeasuredProfile:
    """Per GPU type, per role, ``(tp, micro_batch, seq) -> Timing`` (see the module
    docstring); ``model`` describes what was measured (``hidden``, ``ffn``, ``seq``,
    ``layers``, ``heads``, ``kv_heads``, ``mlp`` (``"gated"`` for SwiGLU), ``vocab``,
    ``dtype``)."""

    source: str
    model: dict
    gpus: dict[str, dict[str, dict[tuple[int, int, int], Timing]]]
    name: str = ""

    def block_flops(self, seq: int | None = None) -> float:
        """Forward flops of one measured block at one sample of ``seq`` tokens (default:
        the measured length): GPT-style attention projections, MLP, attention products."""
        s = self.model["seq"] if seq is None else seq
        if "hidden" not in self.model:
            # Measured on a program (``hetshard profile --model``): its block's forward
            # flops at the measured length, scaled in proportion to other lengths.
            return float(self.model["block_forward_flops"]) * s / self.model["seq"]
        h = self.model["hidden"]
        f = self.model.get("ffn") or 4 * h
        heads = self.model.get("heads") or 1
        kv = (self.model.get("kv_heads") or heads) / heads  # grouped-query K/V share
        mlp = 3 if self.model.get("mlp") == "gated" else 2
        return 2.0 * s * ((2 + 2 * kv) * h * h + mlp * h * f) + 4.0 * s * s * h

    def matches_at(self, block_forward_flops: float, seq: int) -> bool:
        """Whether a program's block (its forward flops at one sample of ``seq`` tokens)
        is the measured one."""
        return abs(block_forward_flops / self.block_flops(seq) - 1) <= MATCH_TOLERANCE

    def timing(self, gpu: str, role: str, tp: int, mbs: int) -> tuple[Timing, int, int] | None:
        """The measured timing for ``gpu``/``role`` at tensor degree ``tp``, interpolated
        (or extrapolated from the two nearest sizes) to micro-batch ``mbs``; with the
        tensor degree and sequence it was measured at (the nearest tensor degree when
        ``tp`` was not measured). None when the GPU or role was not measured."""
        table = self.gpus.get(gpu, {}).get(role)
        if not table:
            return None
        tps = sorted({k[0] for k in table})
        near_tp = min(tps, key=lambda t: (abs(math.log2(t) - math.log2(tp)), t))
        points = sorted((k[1], v) for k, v in table.items() if k[0] == near_tp)
        seq = next(k[2] for k in table if k[0] == near_tp)
        return _interpolate(points, mbs), near_tp, seq

    def to_dict(self) -> dict:
        gpus = {}
        for gpu, roles in self.gpus.items():
            gpus[gpu] = {role: [{"tp": tp, "micro_batch": mbs, "seq": seq,
                                 "forward_s": t.forward_s, "backward_s": t.backward_s,
                                 "update_s": t.update_s}
                                for (tp, mbs, seq), t in sorted(table.items())]
                         for role, table in roles.items()}
        return {"format": PROFILE_FORMAT, "version": 1, "source": self.source,
                "name": self.name, "model": self.model, "gpus": gpus}

    def save(self, path) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=1))


def _interpolate(points: list[tuple[int, Timing]], mbs: int) -> Timing:
    """Piecewise-linear in the micro-batch size between measured sizes; beyond them, the
    line through the two nearest (a single size: proportional to the micro-batch)."""
    if len(points) == 1:
        (b0, t0), = points
        r = mbs / b0
        return Timing(t0.forward_s * r, None if t0.backward_s is None else t0.backward_s * r,
                      t0.update_s)
    sizes = [b for b, _ in points]
    if mbs <= sizes[0]:
        (b0, t0), (b1, t1) = points[0], points[1]
    elif mbs >= sizes[-1]:
        (b0, t0), (b1, t1) = points[-2], points[-1]
    else:
        i = next(i for i, b in enumerate(sizes) if b >= mbs)
        (b0, t0), (b1, t1) = points[i - 1], points[i]
        if b1 == mbs:
            return t1

    def line(a, b):
        if a is None or b is None:
            return None
        return max(0.0, a + (b - a) * (mbs - b0) / (b1 - b0))
    fwd = line(t0.forward_s, t1.forward_s)
    # Below the smallest size a line can reach zero; a layer is never faster than at the
    # smallest size scaled down in proportion.
    floor = t0.forward_s * mbs / b0 if mbs < b0 else 0.0
    return Timing(max(fwd, floor), line(t0.backward_s, t1.backward_s),
                  t0.update_s if t0.update_s is not None else t1.update_s)


# ---- loading ---------------------------------------------------------------------------

def load_profiles(source: str | os.PathLike | dict, model: str | None = None
                  ) -> list[MeasuredProfile]:
    """The measured profiles in a file (or parsed JSON): hetshard's format, AMP's or
    Sailor's (one profile per model; ``model`` picks one of Sailor's by name).

    Raises:
      SpecError: a file of none of these formats, or naming no usable timing.
    """
    where = str(source) if not isinstance(source, dict) else "profile"
    if isinstance(source, dict):
        data = source
    else:
        data = parse_json(read_text(source, "profile"), where)
    if not isinstance(data, dict):
        raise SpecError("profile", type(data).__name__, "a JSON object", where=where)
    if data.get("format") == PROFILE_FORMAT:
        return [_native(data, where)]
    if "forward_s" in data and "entries" in data:
        return [_amp(data, where)]
    if "profiles" in data and "layout" in data:
        return _sailor(data, where, model)
    raise SpecError("profile", where, f"a {PROFILE_FORMAT!r} file, AMP's per-layer "
                    f"forward times or Sailor's per-layer profiles", where=where)


def is_profile(data: Any) -> bool:
    """Whether parsed JSON is a measured profile (as opposed to a calibration)."""
    return isinstance(data, dict) and (data.get("format") == PROFILE_FORMAT or (
        "forward_s" in data and "entries" in data) or ("profiles" in data and
                                                        "layout" in data))


def _gpu(name: str) -> str:
    return GPU_ALIASES.get(name, name)


def _native(data: dict, where: str) -> MeasuredProfile:
    if data.get("version") != 1:
        raise SpecError("version", data.get("version"), "1", where=where)
    model = data.get("model")
    if not isinstance(model, dict) or "seq" not in model or not (
            "hidden" in model or "block_forward_flops" in model):
        raise SpecError("model", model, "an object with seq and hidden (a GPT-style block's "
                        "width) or block_forward_flops (what was measured)", where=where)
    gpus: dict = {}
    for gpu, roles in data.get("gpus", {}).items():
        for role, rows in roles.items():
            if role not in ROLES:
                raise SpecError(f"gpus.{gpu}.{role}", role, f"one of {ROLES}", where=where)
            for i, row in enumerate(rows):
                try:
                    key = (int(row["tp"]), int(row["micro_batch"]), int(row["seq"]))
                    t = Timing(float(row["forward_s"]),
                               None if row.get("backward_s") is None else
                               float(row["backward_s"]),
                               None if row.get("update_s") is None else float(row["update_s"]))
                except (KeyError, TypeError, ValueError) as e:
                    raise SpecError(f"gpus.{gpu}.{role}[{i}]", row,
                                    "tp, micro_batch, seq, forward_s (seconds) and optional "
                                    f"backward_s, update_s ({e})", where=where) from None
                if t.forward_s <= 0:
                    raise SpecError(f"gpus.{gpu}.{role}[{i}].forward_s", t.forward_s,
                                    "a positive time in seconds", where=where)
                gpus.setdefault(_gpu(gpu), {}).setdefault(role, {})[key] = t
    if not gpus:
        raise SpecError("gpus", {}, "at least one GPU's timings", where=where)
    return MeasuredProfile(str(data.get("source", where)), dict(model), gpus,
                           str(data.get("name", "")))


def _spec_field(spec: str, key: str) -> int | None:
    for part in spec.split(":", 1)[-1].split(","):
        k, _, v = part.partition("=")
        if k.strip() == key:
            return int(v)
    return None


def _amp(data: dict, where: str) -> MeasuredProfile:
    """AMP's published forward times per layer entry, micro-batch 1: the blocks' median
    per GPU and tensor degree; a ``noop`` entry (a boundary of the model's partition,
    measured apart) counts with the embedding before the blocks and with the head after
    them."""
    m = data.get("model", {})
    spec = m.get("spec", "")
    seq = int(m.get("seq") or _spec_field(spec, "seq") or 0)
    hidden = _spec_field(spec, "hidden")
    if not seq or not hidden:
        raise SpecError("model", m, "a spec with hidden and seq", where=where)
    mbs = int(m.get("micro_batch", 1))
    entries = data["entries"]
    blocks = [i for i, e in enumerate(entries) if e.startswith("block")]
    if not blocks:
        raise SpecError("entries", entries, "layer entries named block_<i>", where=where)
    gpus: dict = {}
    for gpu, per_tp in data["forward_s"].items():
        for tp_key, times in per_tp.items():
            tp = int(str(tp_key).removeprefix("tp"))
            if len(times) != len(entries):
                raise SpecError(f"forward_s.{gpu}.{tp_key}", len(times),
                                f"one time per entry ({len(entries)})", where=where)
            roles: dict[str, list[float]] = {"embedding": [], "block": [], "head": []}
            for i, (entry, t) in enumerate(zip(entries, times, strict=True)):
                role = "block" if entry.startswith("block") else (
                    "embedding" if i < blocks[0] else "head")
                roles[role].append(float(t))
            for r, ts in roles.items():
                if not ts:
                    continue
                t = statistics.median(ts) if r == "block" else sum(ts)
                gpus.setdefault(_gpu(gpu), {}).setdefault(r, {})[(tp, mbs, seq)] = Timing(t)
    model = {"hidden": hidden, "seq": seq, "layers": len(blocks),
             "heads": _spec_field(spec, "heads"), "vocab": _spec_field(spec, "vocab"),
             "ffn": _spec_field(spec, "ffn") or 4 * hidden, "dtype": m.get("dtype"),
             "spec": spec}
    return MeasuredProfile(str(data.get("source", where)), model, gpus, "amp")


_SAILOR_MODELS = {  # hidden, ffn, heads, kv heads, mlp, vocab (the file's descriptions)
    "OPT-350": (1024, 4096, 16, 16, "gelu", 50272),
    "GPT-Neo-2.7": (2560, 10240, 20, 20, "gelu", 50257),
    "LLAMA-3-8": (4096, 14336, 32, 8, "gated", 128256),
    "OPT-30": (7168, 28672, 56, 56, "gelu", 50272),
}


def _sailor(data: dict, where: str, model: str | None) -> list[MeasuredProfile]:
    """Sailor's profiles: per model, GPU, micro-batch, tensor degree and layer index,
    [forward, backward, update]; layer 0 is the embedding, the last the final norm and
    head, the others blocks (their median)."""
    seq = 2048  # "models use sequence length 2048" (the file's layers note)
    out = []
    for name, per_gpu in data["profiles"].items():
        if model is not None and name != model:
            continue
        if name not in _SAILOR_MODELS:
            continue
        hidden, ffn, heads, kv_heads, mlp, vocab = _SAILOR_MODELS[name]
        gpus: dict = {}
        layers = 0
        for gpu, per_mbs in per_gpu.items():
            for mbs, per_tp in per_mbs.items():
                for tp, per_layer in per_tp.items():
                    idx = sorted(per_layer, key=int)
                    layers = len(idx) - 2
                    key = (int(tp), int(mbs), seq)
                    timings = {int(i): Timing(*map(float, per_layer[i])) for i in idx}
                    last = int(idx[-1])
                    block = [timings[i] for i in range(1, last)]
                    g = gpus.setdefault(_gpu(gpu), {})
                    g.setdefault("embedding", {})[key] = timings[0]
                    g.setdefault("head", {})[key] = timings[last]
                    g.setdefault("block", {})[key] = Timing(
                        statistics.median(t.forward_s for t in block),
                        statistics.median(t.backward_s for t in block),
                        statistics.median(t.update_s for t in block))
        out.append(MeasuredProfile(
            str(data.get("source", where)),
            {"hidden": hidden, "ffn": ffn, "seq": seq, "layers": layers, "heads": heads,
             "kv_heads": kv_heads, "mlp": mlp, "vocab": vocab, "dtype": "float32"},
            gpus, name))
    if not out:
        raise SpecError("model", model, f"one of {sorted(_SAILOR_MODELS)}", where=where)
    return out
