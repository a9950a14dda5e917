"""Packing variable-length samples into rows of a few fixed lengths (buckets).

A row is ``bucket`` token slots holding whole samples one after another; each sample is
a segment (its own segment id, positions restarting at 0), so attention never crosses
samples (the flash kernel masks by segment id and skips key blocks of other segments)
and the rest of the model is per token. Rows come in a small fixed set of lengths, so a
compiled program is reused for every batch whose rows have that length.

Packing is best-fit decreasing (Johnson 1974): samples longest first, each into the open
row with the least room that still takes it, else into a new row of the smallest bucket
that holds it. Short samples thereby fill what long ones leave of their rows.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

from hetshard.errors import SpecError


@dataclasses.dataclass(frozen=True)
class Row:
    """One packed row: ``bucket`` slots, the samples (indices into the batch) in order,
    ``bucket - sum of their lengths`` slots of padding at the end."""

    bucket: int
    samples: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def used(self) -> int:
        return sum(self.lengths)

    @property
    def squares(self) -> int:
        """Sum of the samples' squared lengths: what causal attention over the row costs
        (up to a constant) when blocks of other segments are skipped."""
        return sum(n * n for n in self.lengths)


def check_lengths(lengths, where: str = "lengths") -> np.ndarray:
    """``lengths`` as a 1-D int64 array of positive token counts.

    Raises:
      SpecError: naming the first bad entry.
    """
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.size == 0:
        raise SpecError(where, f"shape {arr.shape}", "a non-empty 1-D sequence of token "
                        "counts, one per sample")
    if not np.issubdtype(arr.dtype, np.integer):
        bad = next((i for i, x in enumerate(arr.tolist())
                    if isinstance(x, bool) or not float(x).is_integer()), None)
        if bad is not None:
            raise SpecError(f"{where}[{bad}]", arr.tolist()[bad], "a whole number of tokens")
        arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        raise SpecError(f"{where}[{int(bad[0])}]", int(arr[bad[0]]),
                        "a positive token count (an empty sample cannot be trained on)")
    return arr.astype(np.int64)


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    b = tuple(buckets)
    if not b or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1
                    for x in b) or list(b) != sorted(set(b)):
        raise SpecError("buckets", list(b), "increasing positive row lengths")
    return tuple(int(x) for x in b)


def geometric_buckets(smallest: int, largest: int, count: int) -> tuple[int, ...]:
    """At most ``count`` row lengths from ``smallest`` to ``largest`` (both powers-of-two
    multiples of ``smallest``), spaced evenly on a log scale: 4K..32K in 4 buckets is
    4K, 8K, 16K, 32K; 4K..128K in 4 is 4K, 16K, 64K, 128K."""
    if smallest < 1 or largest < smallest or count < 1:
        raise SpecError("buckets", (smallest, largest, count),
                        "1 <= smallest <= largest and a positive count")
    steps = max(0, int(np.ceil(np.log2(largest / smallest))))
    if count == 1 or steps == 0:
        return (largest,)
    picks = sorted({round(i * steps / (count - 1)) for i in range(count)})
    out = sorted({min(largest, smallest * 2 ** p) for p in picks})
    if out[-1] != largest:
        out[-1] = largest
    return tuple(out)


def pack(lengths, buckets: Sequence[int], *, order: str = "best-fit",
         ids: Sequence[int] | None = None) -> tuple[Row, ...]:
    """Rows holding every sample of ``lengths`` exactly once (``ids``: what the rows
    call the samples; default their positions in ``lengths``).

    ``order="best-fit"``: best-fit decreasing (see the module docstring).
    ``order="sequential"``: samples in the given order, each appended to the last row
    while it fits, else a new row of the largest bucket (Megatron-LM's concatenation,
    without splitting documents across rows).

    Raises:
      SpecError: a sample longer than the largest bucket, naming it and the buckets.
    """
    lengths = check_lengths(lengths)
    buckets = check_buckets(buckets)
    top = buckets[-1]
    over = np.flatnonzero(lengths > top)
    if over.size:
        i = int(over[0])
        raise SpecError(f"lengths[{i}]", int(lengths[i]),
                        f"at most the largest bucket, {top} tokens (buckets {list(buckets)}; "
                        f"truncate or split longer samples, or add a bucket)")
    if order == "sequential":
        rows: list[list] = []
        room = 0
        names = range(lengths.size) if ids is None else list(ids)
        for i, n in enumerate(lengths.tolist()):
            if not rows or n > room:
                rows.append([top, [], []])
                room = top
            rows[-1][1].append(names[i])
            rows[-1][2].append(n)
            room -= n
        return tuple(Row(b, tuple(s), tuple(n)) for b, s, n in rows)
    if order != "best-fit":
        raise SpecError("order", order, "'best-fit' or 'sequential'")
    widths: list[int] = []
    # Open rows as ``room * SHIFT + row`` in increasing order: one integer per row keeps
    # the search a bisection over ints (the least room that takes n is the first key at
    # or above n * SHIFT), the row with the lower index first among equal rooms.
    shift = 1 << max(1, lengths.size.bit_length())
    rooms: list[int] = []
    find, insort = bisect.bisect_left, bisect.insort
    order = np.argsort(-lengths, kind="stable")
    row_of = []  # per sample in that order
    for n in lengths[order].tolist():
        need = n * shift
        at = find(rooms, need)
        if at < len(rooms):
            key = rooms.pop(at) - need  # the room left, same row
            row_of.append(key & (shift - 1))
        else:
            r = len(widths)
            width = buckets[find(buckets, n)]
            widths.append(width)
            row_of.append(r)
            key = (width - n) * shift + r
        if key >= shift:  # room left
            insort(rooms, key)
    # each row's samples in the order they went in (longest first)
    by_row = np.argsort(np.asarray(row_of, np.int64), kind="stable")
    taken = order[by_row]
    cuts = np.cumsum(np.bincount(np.asarray(row_of, np.int64), minlength=len(widths)))[:-1]
    names_of = taken.tolist()
    if ids is not None:
        names = list(ids)
        names_of = [names[i] for i in names_of]
    sizes_of = lengths[taken].tolist()
    out = []
    lo = 0
    for w, hi in zip(widths, cuts.tolist() + [lengths.size], strict=True):
        out.append(Row(w, tuple(names_of[lo:hi]), tuple(sizes_of[lo:hi])))
        lo = hi
    return tuple(out)


def packed_arrays(samples: Sequence, rows: Sequence[Row], *, pad_id: int = 0,
                  targets: Sequence | None = None, target_tokens: int | None = None
                  ) -> dict[str, np.ndarray]:
    """The arrays of ``rows`` (all of one bucket) for a model taking packed sequences:
    ``tokens``, ``targets``, ``positions`` (restarting at 0 per sample), ``segment_ids``
    (1, 2, ... per sample in its row; padding 0) and ``loss_weight`` (1 on every target
    token, 0 on padding and on each sample's last token when ``targets`` is None, where
    the targets are the next tokens).

    ``samples``: 1-D integer token arrays, indexed as the rows' sample indices.
    ``target_tokens``: the global batch's target count (over every bucket's rows). Given,
    each weight is ``rows / target_tokens``, so the mean over rows of each row's weighted
    token losses is the global batch's token mean: a per-row loss, which any split of the
    rows into micro-batches, pipelines or calls of one bucket at a time sums exactly
    (``models.losses.packed_text_loss``).

    Raises:
      SpecError: rows of several buckets, or a row that does not match its samples.
    """
    if not rows:
        raise SpecError("rows", [], "at least one row")
    widths = {r.bucket for r in rows}
    if len(widths) != 1:
        raise SpecError("rows", f"buckets {sorted(widths)}", "rows of one bucket (one "
                        "array shape); call packed_arrays once per bucket")
    width = widths.pop()
    shape = (len(rows), width)
    out = {"tokens": np.full(shape, pad_id, np.int32), "targets": np.zeros(shape, np.int32),
           "positions": np.zeros(shape, np.int32), "segment_ids": np.zeros(shape, np.int32),
           "loss_weight": np.zeros(shape, np.float32)}
    for r, row in enumerate(rows):
        at = 0
        for seg, (i, n) in enumerate(zip(row.samples, row.lengths, strict=True), start=1):
            tok = np.asarray(samples[i]).reshape(-1)
            if tok.shape[0] != n:
                raise SpecError(f"samples[{i}]", f"{tok.shape[0]} tokens",
                                f"the {n} tokens the packing was made for")
            out["tokens"][r, at:at + n] = tok
            if targets is None:
                out["targets"][r, at:at + n - 1] = tok[1:]
                out["loss_weight"][r, at:at + n - 1] = 1.0
            else:
                out["targets"][r, at:at + n] = np.asarray(targets[i]).reshape(-1)
                out["loss_weight"][r, at:at + n] = 1.0
            out["positions"][r, at:at + n] = np.arange(n)
            out["segment_ids"][r, at:at + n] = seg
            at += n
    if target_tokens is not None:
        if isinstance(target_tokens, bool) or not isinstance(target_tokens, (int, np.integer)) \
                or target_tokens < out["loss_weight"].sum():
            raise SpecError("target_tokens", target_tokens,
                            f"the batch's target count, at least these rows' "
                            f"{int(out['loss_weight'].sum())}")
        out["loss_weight"] *= len(rows) / target_tokens
    return out
