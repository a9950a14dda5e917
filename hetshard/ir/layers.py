"""Layers found in a traced loss: which top-level equation belongs to which layer.

The planner prices layers and the runtime cuts pipeline stages between them, so both call
:func:`discover` on the same forward jaxpr (the loss of one micro-batch, traced on flat
state and batch leaves) and get the same answer. Three sources, in order:

1. **Named scopes.** Where the program names its blocks with ``jax.named_scope`` (an
   indexed family such as ``decoder/layer_0``, ``decoder/layer_1``, or ``block3``), the
   scope at the depth of that family is the layer; equations outside every scope join the
   nearest scoped equation before them (the loss joins the head), or after them at the
   start.
2. **Repeated structure.** Otherwise each equation gets a canonical signature
   (primitive, operand and result shapes and dtypes, parameters, nested bodies by the
   same rule) and the longest tandem repeats of signatures are the blocks: a Python loop
   over blocks or an ``nnx.List`` traces to one block's equations ``k`` times in a row.
   Of the ``p`` rotations of a repeat, the cut is placed where the fewest bytes of
   activations cross it (the residual stream between two blocks). Repeats are searched
   again before and after each one found (a two-tower model has two stacks), and inside
   one whose period repeats a finer pattern over most of its work: a model run twice
   (a distillation's teacher of the student's architecture, DPO's reference model)
   gives each run's blocks as layers, not the two whole runs. Only equations that read
   the batch count as work, so the layers are the same at every micro-batch size.
3. **Cost.** A stretch that repeats nothing (the embedding, a CNN's stem, a whole
   non-repeating model) is cut into layers of balanced flops, each cut at the point near
   its target with the fewest crossing bytes (Alpa's layer construction, Zheng et al.
   OSDI'22 §5.1: balanced compute, small activations at the cuts).

Layers of identical signature share a ``kind``: the cost model prices a kind once.
With ``split_blocks`` every layer of a kind that repeats is cut in two halves at its own
smallest crossing (after a transformer block's attention residual, where only the
residual stream is live), so a pipeline stage boundary may fall inside a block.

Scanned stacks (``nnx.scan``, ``lax.scan`` over stacked weights) are unrolled first
(:func:`unroll_scans`), so each iteration is a block of its own and a stack can be cut
between stages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from jax.extend import core as ext

from hetshard.errors import LayerDiscoveryError

# A named-scope component that indexes a family of blocks: layer_3, block3, h.3, 3.
_INDEXED = re.compile(r"^(?P<family>.*?)[_.\-]?(?P<i>\d+)$")
# The flops share below which a repeated pattern is not a block (a run of identical
# elementwise equations, say).
_MIN_BLOCK_SHARE = 0.002
# A repeat whose period repeats a finer pattern over this share of its flops is a run of
# whole models (each run's blocks are the layers): a block's own repeated projections (q,
# k, v of one shape) stay well under it.
_NESTED_SHARE = 0.7
# A stretch without repeats is cut into pieces of about a block's flops, at most this many.
MAX_COST_LAYERS = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layering:
    """Layers of a traced loss.

    ``names[k]`` and ``kinds[k]`` name layer ``k`` and its structural class (layers of one
    kind have identical equations, so identical costs); ``eqn_layer[i]`` is the layer of
    top-level equation ``i``, non-decreasing; ``stacks[k]`` is the index of the run of
    same-kind blocks layer ``k`` belongs to (-1 for a layer that repeats nothing) and
    ``positions[k]`` its index in that run; ``source`` says how they were found
    (``scopes``, ``structure``, ``cost`` or ``single``).
    """

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    eqn_layer: tuple[int, ...]
    stacks: tuple[int, ...]
    positions: tuple[int, ...]
    source: str
    split_blocks: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def equations(self, k: int) -> range:
        """Top-level equation indices of layer ``k`` (contiguous)."""
        first = self.eqn_layer.index(k)
        last = len(self.eqn_layer) - 1 - self.eqn_layer[::-1].index(k)
        return range(first, last + 1)

    def whole(self) -> Layering:
        """The layering with each block's halves merged back (itself when not split)."""
        if not self.split_blocks:
            return self
        names, kinds, stacks, positions, index = [], [], [], [], []
        for name, kind, s, p in zip(self.names, self.kinds, self.stacks, self.positions,
                                    strict=True):
            if s >= 0 and name.endswith("/half_1"):
                index.append(len(names) - 1)
                continue
            if s >= 0 and name.endswith("/half_0"):
                name, kind, p = name[:-len("/half_0")], kind[:-len("/0")], p // 2
            names.append(name)
            kinds.append(kind)
            stacks.append(s)
            positions.append(p)
            index.append(len(names) - 1)
        eqn_layer = tuple(index[k] for k in self.eqn_layer)
        return Layering(names=tuple(names), kinds=tuple(kinds), eqn_layer=eqn_layer,
                        stacks=tuple(stacks), positions=tuple(positions),
                        source=self.source, split_blocks=False)

    def describe(self) -> str:
        blocks = sum(1 for s in self.stacks if s >= 0)
        kinds = len(set(self.kinds))
        return (f"{self.num_layers} layers from {self.source} ({blocks} in repeated stacks, "
                f"{kinds} distinct kinds)")


# ---- signatures, flops, liveness ---------------------------------------------------

def _aval_sig(v) -> tuple:
    aval = v.aval
    return (tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", "")))


_SIG_CACHE: dict[int, tuple[str, object]] = {}


def _jaxpr_sig(j) -> str:
    """A canonical hash of a (closed) jaxpr's equations."""
    inner = getattr(j, "jaxpr", j)
    hit = _SIG_CACHE.get(id(inner))
    if hit is not None and hit[1] is inner:
        return hit[0]
    h = hashlib.blake2b(digest_size=12)
    for eqn in inner.eqns:
        h.update(eqn_signature(eqn).encode())
    out = h.hexdigest()
    _SIG_CACHE[id(inner)] = (out, inner)
    return out


def _param_sig(value) -> str:
    if hasattr(value, "eqns") or hasattr(getattr(value, "jaxpr", None), "eqns"):
        return _jaxpr_sig(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_param_sig(v) for v in value) + ")"
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__name__", type(value).__name__)
    return repr(value)


# Where a slice starts says which block of a stacked weight it reads, not what the block
# does: two blocks of an unrolled scan differ only there.
_POSITIONS = {"slice": ("start_indices", "limit_indices")}


def _literal_sig(v) -> str:
    val = v.val
    if isinstance(val, (int, np.integer)) and not isinstance(val, bool):
        return f"int:{np.asarray(val).dtype}"  # an index, as above
    return f"lit:{val!r}"


def eqn_signature(eqn) -> str:
    """Primitive, operand and result avals, parameters (bodies hashed): equal for the
    same equation in two identical blocks (slice positions and integer literals, which
    pick a block's slice of a stacked weight, are left out)."""
    ins = ",".join(repr(_aval_sig(v)) if isinstance(v, ext.Var) else _literal_sig(v)
                   for v in eqn.invars)
    outs = ",".join(repr(_aval_sig(v)) for v in eqn.outvars)
    skip = ("name_stack", "source_info", *_POSITIONS.get(eqn.primitive.name, ()))
    params = ";".join(f"{k}={_param_sig(v)}" for k, v in sorted(eqn.params.items())
                      if k not in skip)
    return f"{eqn.primitive.name}[{params}]({ins})->({outs})"


def _nbytes(v) -> float:
    aval = v.aval
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0.0
    return float(math.prod(getattr(aval, "shape", ())) * dtype.itemsize)


def _bodies(eqn):
    """(body jaxpr, multiplicity) of an equation with nested jaxprs."""
    name = eqn.primitive.name
    if name == "scan":
        return [(eqn.params["jaxpr"], float(eqn.params["length"]))]
    if name == "cond":
        return [(max(eqn.params["branches"], key=lambda b: len(getattr(b, "jaxpr", b).eqns)),
                 1.0)]
    if name == "while":
        return [(eqn.params["body_jaxpr"], 1.0)]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params and hasattr(getattr(eqn.params[key], "jaxpr",
                                                 eqn.params[key]), "eqns"):
            return [(eqn.params[key], 1.0)]
    return []


def eqn_flops(eqn) -> float:
    """Approximate flops of one equation (matmuls and convolutions exactly, other
    equations one per output element; bodies of calls and loops included)."""
    bodies = _bodies(eqn)
    if bodies:
        return sum(mult * sum(eqn_flops(e) for e in getattr(b, "jaxpr", b).eqns)
                   for b, mult in bodies)
    name = eqn.primitive.name
    out = sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * out * math.prod(lhs[d] for d in lc)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        dn = eqn.params["dimension_numbers"]
        spatial = [rhs[d] for d in dn.rhs_spec[2:]] if dn is not None else list(rhs[2:])
        in_ch = rhs[dn.rhs_spec[1]] if dn is not None else rhs[1]
        return 2.0 * out * in_ch * math.prod(spatial)
    return float(out)


def _live_bytes(jaxpr) -> np.ndarray:
    """``live[c]``: bytes of values computed before equation ``c`` and read at or after it
    (the activations a cut before ``c`` hands on; inputs and constants are not counted)."""
    n = len(jaxpr.eqns)
    last: dict = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, ext.Var):
                last[v] = i
    for v in jaxpr.outvars:
        if isinstance(v, ext.Var):
            last[v] = n
    diff = np.zeros(n + 2)
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            u = last.get(v)
            if u is not None and u > i:
                b = _nbytes(v)
                diff[i + 1] += b
                diff[u + 1] -= b
    return np.cumsum(diff)[: n + 1]


# ---- named scopes ------------------------------------------------------------------

def _scope_path(eqn) -> tuple[str, ...]:
    names = [s.name for s in eqn.source_info.name_stack.stack
             if type(s).__name__ == "Scope"]
    return tuple(p for name in names for p in name.split("/") if p)


def _by_scopes(eqns) -> tuple[list[str], list[int]] | None:
    """(names, layer per equation) from an indexed family of named scopes, or None."""
    paths = [_scope_path(e) for e in eqns]
    depth = max((len(p) for p in paths), default=0)
    for d in range(1, depth + 1):
        families: dict[tuple, set[int]] = {}
        for p in paths:
            if len(p) >= d:
                m = _INDEXED.match(p[d - 1])
                if m:
                    families.setdefault((p[:d - 1], m.group("family")), set()).add(
                        int(m.group("i")))
        if any(len(ix) >= 2 for ix in families.values()):
            break
    else:
        return None
    keys = ["/".join(p[:d]) if p else "" for p in paths]
    names: list[str] = []
    tags: list[int | None] = []
    for key in keys:
        if not key:
            tags.append(None)
            continue
        if not names or names[-1] != key:
            if key in names:  # a scope re-entered later: keep the layers contiguous
                key = f"{key}#{sum(1 for n in names if n.split('#')[0] == key)}"
            names.append(key)
        tags.append(len(names) - 1)
    first = next(t for t in tags if t is not None)
    out, last = [], first
    for t in tags:
        last = last if t is None else t
        out.append(last)
    return names, out


# ---- repeated structure ------------------------------------------------------------

def _longest_run(mask: np.ndarray) -> tuple[int, int]:
    """(start, length) of the longest run of True in ``mask`` ((0, 0) if none)."""
    if not mask.any():
        return 0, 0
    m = np.concatenate(([False], mask, [False])).astype(np.int8)
    d = np.diff(m)
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    k = int(np.argmax(ends - starts))
    return int(starts[k]), int(ends[k] - starts[k])


def _best_repeat(sig: np.ndarray, flops: np.ndarray, lo: int, hi: int, total: float):
    """(start, period, count) of the repeat in ``[lo, hi)`` covering most equations (the
    shortest period among equals), or None."""
    a = sig[lo:hi]
    m = len(a)
    best, most = None, 0
    cum = np.concatenate(([0.0], np.cumsum(flops)))
    for p in range(1, m // 2 + 1):
        s, r = _longest_run(a[:-p] == a[p:])
        count = r // p + 1
        if count < 2:
            continue
        start = lo + s
        if cum[start + p] - cum[start] < _MIN_BLOCK_SHARE * total:
            continue
        cover = count * p
        if cover > most:
            most, best = cover, (start, p, r)
    return best


def _rotate(start: int, period: int, run: int, live: np.ndarray) -> tuple[int, int]:
    """(first block start, block count) of a repeat whose equations are periodic over
    ``[start, start + run + period)``: the rotation keeping the most whole blocks, then
    the fewest bytes crossing the cut between two blocks, then the earliest."""
    best = least = None
    for r in range(period):
        count = (run + period - r) // period
        if count < 2:
            continue
        key = (-count, live[start + r + period], r)
        if least is None or key < least:
            least, best = key, (start + r, count)
    return best


def _cost_cuts(lo: int, hi: int, flops: np.ndarray, live: np.ndarray,
               pieces: int) -> list[int]:
    """Cut points splitting ``[lo, hi)`` into about ``pieces`` stretches of balanced
    flops, each cut at the smallest crossing within a window around its target."""
    if pieces <= 1 or hi - lo < 2:
        return []
    cum = np.cumsum(flops[lo:hi])
    total = cum[-1]
    cuts: list[int] = []
    for j in range(1, pieces):
        target = total * j / pieces
        centre = lo + int(np.searchsorted(cum, target)) + 1
        half = max(1, (hi - lo) // (4 * pieces))
        a, b = max(lo + 1, centre - half), min(hi - 1, centre + half)
        if cuts:
            a = max(a, cuts[-1] + 1)
        if a > b:
            continue
        window = np.arange(a, b + 1)
        score = live[window] + 1e-9 * np.abs(window - centre)
        cuts.append(int(window[np.argmin(score)]))
    return cuts


def _by_structure(jaxpr, sig, flops, live) -> tuple[list[tuple], str]:
    """Segments ``(lo, hi, stack, position)`` covering every equation, from repeats and
    cost cuts; and the source name."""
    n = len(jaxpr.eqns)
    total = float(flops.sum()) or 1.0
    repeats: list[tuple[int, int, int]] = []  # (first, period, count)

    cum = np.concatenate(([0.0], np.cumsum(flops)))

    def search(lo, hi):
        if hi - lo < 2:
            return
        found = _best_repeat(sig, flops, lo, hi, total)
        if found is None:
            return
        start, period, run = found
        first, count = _rotate(start, period, run, live)
        search(lo, first)
        inner = _best_repeat(sig, flops, first, first + period, total)
        if inner is not None and cum[sum(inner)] - cum[inner[0]] >= \
                _NESTED_SHARE * (cum[first + period] - cum[first]):
            # A repeat of repeats (one model run twice: a distillation's teacher beside
            # its student, DPO's reference model beside its policy): each run's blocks
            # are the layers, not the whole runs.
            for c in range(count):
                search(first + c * period, first + (c + 1) * period)
        else:
            repeats.append((first, period, count))
        search(first + period * count, hi)

    search(0, n)
    repeats.sort()
    block = max((float(flops[f:f + p].sum()) for f, p, _ in repeats), default=0.0)
    segments: list[_Part] = []

    def plain(lo, hi):
        if hi <= lo:
            return
        f = float(flops[lo:hi].sum())
        if block:
            pieces = min(MAX_COST_LAYERS, max(1, round(f / block)))
        else:
            dense = sum(1 for e in jaxpr.eqns[lo:hi]
                        if e.primitive.name in ("dot_general", "conv_general_dilated"))
            pieces = min(MAX_COST_LAYERS, max(1, dense // 2))
        bounds = [lo, *_cost_cuts(lo, hi, flops, live, pieces), hi]
        for a, b in zip(bounds, bounds[1:], strict=False):
            segments.append(_Part(a, b, -1, 0))

    at = 0
    for stack, (first, period, count) in enumerate(repeats):
        plain(at, first)
        for j in range(count):
            segments.append(_Part(first + j * period, first + (j + 1) * period, stack, j))
        at = first + period * count
    plain(at, n)
    source = "structure" if repeats else "cost"
    return segments, source


class _Part(NamedTuple):
    """A stretch of equations ``[lo, hi)``: block ``position`` of repeat ``stack``, or
    outside every repeat (``stack`` -1)."""

    lo: int
    hi: int
    stack: int
    position: int


def _merge_small(segments: list[_Part], flops: np.ndarray) -> list[_Part]:
    """Stretches outside repeats with (almost) no flops join the layer before them (the
    loss's scalar tail joins the head), or after them at the start."""
    out: list[_Part] = []
    total = float(flops.sum()) or 1.0

    def tiny(seg: _Part) -> bool:
        return seg.stack < 0 and float(flops[seg.lo:seg.hi].sum()) < 1e-4 * total
    for seg in segments:
        if tiny(seg) and out:
            if out[-1].stack < 0:
                out[-1] = out[-1]._replace(hi=seg.hi)
            else:
                out.append(seg)
            continue
        out.append(seg)
    if len(out) > 1 and tiny(out[0]) and out[1].stack < 0:
        out[1] = _Part(out[0].lo, out[1].hi, -1, 0)
        out.pop(0)
    return out


# ---- discovery ----------------------------------------------------------------------

def _reads_inputs(jaxpr, inputs: Sequence[int]) -> np.ndarray:
    """Per equation of ``jaxpr``, whether it reads (through any chain) one of the
    ``inputs`` (indices into its invars)."""
    reached = {jaxpr.invars[i] for i in inputs}
    out = np.zeros(len(jaxpr.eqns), bool)
    for k, eqn in enumerate(jaxpr.eqns):
        if any(isinstance(v, ext.Var) and v in reached for v in eqn.invars):
            out[k] = True
            reached.update(eqn.outvars)
    return out


def discover(closed, split_blocks: bool = False,
             batch_inputs: Sequence[int] | None = None) -> Layering:
    """The layers of ``closed`` (a ClosedJaxpr of a loss; see the module docstring).
    ``batch_inputs``: its invars that are batch leaves, where known. The work of
    equations that read none of them (a weight penalty over the parameters, the
    weights' casts) is then not counted in the flops that find blocks and balance cuts:
    it does not grow with the batch, so the layers are the same at every micro-batch
    size (a penalty's per-parameter terms are not a stack of blocks at small batches)."""
    jaxpr = getattr(closed, "jaxpr", closed)
    eqns = jaxpr.eqns
    n = len(eqns)
    if n == 0:
        raise LayerDiscoveryError("the loss has no equations to split into layers")
    sigs = [eqn_signature(e) for e in eqns]
    codes: dict[str, int] = {}
    sig = np.array([codes.setdefault(s, len(codes)) for s in sigs], np.int64)
    flops = np.array([eqn_flops(e) for e in eqns])
    if batch_inputs is not None:
        batch = _reads_inputs(jaxpr, batch_inputs)
        if batch.any():
            flops = np.where(batch, flops, 0.0)
    live = _live_bytes(jaxpr)
    scoped = _by_scopes(eqns)
    if scoped is not None:
        names, eqn_layer = scoped
        segments = []
        for k in range(len(names)):
            idx = [i for i, x in enumerate(eqn_layer) if x == k]
            segments.append((idx[0], idx[-1] + 1))
        kinds = [_kind(sigs[a:b]) for a, b in segments]
        stacks, positions = _stacks_of(kinds)
        source = "scopes"
    else:
        parts, source = _by_structure(jaxpr, sig, flops, live)
        parts = _merge_small(parts, flops)
        segments = [(part.lo, part.hi) for part in parts]
        kinds = [_kind(sigs[a:b]) for a, b in segments]
        stacks, positions = _stacks_of(kinds)
        if len(segments) == 1:
            source = "single"
        names = _structural_names(stacks, positions)
    if split_blocks:
        segments, names, kinds, stacks, positions = _halves(
            segments, names, kinds, stacks, positions, sigs, flops, live)
    eqn_layer = np.zeros(n, int)
    for k, (a, b) in enumerate(segments):
        eqn_layer[a:b] = k
    return Layering(names=tuple(names), kinds=tuple(kinds),
                    eqn_layer=tuple(int(x) for x in eqn_layer), stacks=tuple(stacks),
                    positions=tuple(positions), source=source, split_blocks=split_blocks)


def _kind(sigs: Sequence[str]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for s in sigs:
        h.update(s.encode())
    return h.hexdigest()


def _stacks_of(kinds: Sequence[str]) -> tuple[list[int], list[int]]:
    """Runs of two or more consecutive layers of one kind are stacks."""
    stacks, positions = [-1] * len(kinds), [0] * len(kinds)
    stack, k = 0, 0
    while k < len(kinds):
        j = k
        while j + 1 < len(kinds) and kinds[j + 1] == kinds[k]:
            j += 1
        if j > k:
            for i in range(k, j + 1):
                stacks[i], positions[i] = stack, i - k
            stack += 1
        k = j + 1
    return stacks, positions


def _structural_names(stacks, positions) -> list[str]:
    names, plain = [], 0
    for s, p in zip(stacks, positions, strict=True):
        if s >= 0:
            names.append(f"stack{s}/layer_{p}")
        else:
            names.append(f"part_{plain}")
            plain += 1
    return names


def _halves(segments, names, kinds, stacks, positions, sigs, flops, live):
    """Each layer of a stack cut in two at its smallest crossing (nearest the middle of
    its flops among equals); other layers kept whole."""
    cut_of: dict[str, int] = {}
    out_seg, out_names, out_kinds, out_stacks, out_pos = [], [], [], [], []
    for (a, b), name, kind, s, p in zip(segments, names, kinds, stacks, positions,
                                        strict=True):
        if s < 0 or b - a < 2:
            out_seg.append((a, b))
            out_names.append(name)
            out_kinds.append(kind)
            out_stacks.append(s)
            out_pos.append(p)
            continue
        if kind not in cut_of:
            cum = np.cumsum(flops[a:b])
            mid = cum[-1] / 2
            cands = np.arange(a + 1, b)
            score = [(live[c], abs(cum[c - a - 1] - mid)) for c in cands]
            cut_of[kind] = int(cands[min(range(len(cands)), key=lambda i: score[i])]) - a
        c = a + cut_of[kind]
        for h, (lo, hi) in enumerate(((a, c), (c, b))):
            out_seg.append((lo, hi))
            out_names.append(f"{name}/half_{h}")
            out_kinds.append(f"{kind}/{h}")
            out_stacks.append(s)
            out_pos.append(2 * p + h)
    return out_seg, out_names, out_kinds, out_stacks, out_pos
