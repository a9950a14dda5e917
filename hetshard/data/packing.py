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
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from hetshard.errors import SpecError


class Row(NamedTuple):
    """One packed row: ``bucket`` slots, the samples (indices into the batch) in order,
    ``bucket - sum of their lengths`` slots of padding at the end. (A named tuple: a
    batch plan holds hundreds, built in the per-batch planner's few milliseconds.)"""

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


@dataclasses.dataclass(frozen=True)
class Packing:
    """Rows as arrays (what the per-batch planner prices; ``rows()`` gives the
    :class:`Row` objects): row ``r`` is ``bucket[r]`` slots holding ``counts[r]`` samples,
    the next ones of ``samples`` (their names) and ``lengths`` (row by row, in order)."""

    bucket: np.ndarray
    counts: np.ndarray
    samples: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, rows: Sequence[Row]) -> Packing:
        return cls(np.array([r.bucket for r in rows], np.int64),
                   np.array([len(r.samples) for r in rows], np.int64),
                   np.array([i for r in rows for i in r.samples], np.int64),
                   np.array([n for r in rows for n in r.lengths], np.int64))

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)

    def used(self) -> np.ndarray:
        out = np.zeros(self.counts.size, np.int64)
        filled = self.counts > 0
        out[filled] = np.add.reduceat(self.lengths, self.starts[filled])
        return out

    def regroup(self, bucket: np.ndarray, parts: np.ndarray, src: np.ndarray) -> Packing:
        """New rows: row ``k`` is ``bucket[k]`` slots holding, in order, the samples of
        the next ``parts[k]`` rows of this packing listed in ``src``."""
        first = np.concatenate([[0], np.cumsum(parts)[:-1]]).astype(np.int64)
        idx = ranges(self.starts[src], self.counts[src])
        counts = np.add.reduceat(self.counts[src], first) if src.size else \
            np.zeros(0, np.int64)
        return Packing(np.asarray(bucket, np.int64), counts, self.samples[idx],
                       self.lengths[idx])

    def rows(self) -> tuple[Row, ...]:
        ends = np.cumsum(self.counts).tolist()
        names, sizes = self.samples.tolist(), self.lengths.tolist()
        return tuple(Row(w, tuple(names[a - c:a]), tuple(sizes[a - c:a]))
                     for w, c, a in zip(self.bucket.tolist(), self.counts.tolist(), ends,
                                        strict=True))


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices ``starts[k] .. starts[k] + counts[k] - 1`` for every k, concatenated."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, np.int64)
    ends = np.cumsum(counts)
    base = np.repeat(starts - (ends - counts), counts)
    return base + np.arange(total, dtype=np.int64)


def check_lengths(lengths, where: str = "lengths", least: int = 1,
                  unit: str = "tokens") -> np.ndarray:
    """``lengths`` as a 1-D int64 array of whole counts of ``unit``, each at least
    ``least`` (1: an empty sample cannot be trained on).

    Raises:
      SpecError: naming the first bad entry (not a whole number, a bool, too large for
        int64, or below ``least``) or the shape.
    """
    noun = f"a non-empty 1-D sequence of {unit[:-1]} counts, one per sample"
    try:
        arr = np.asarray(lengths)
    except (TypeError, ValueError):  # ragged nesting
        raise SpecError(where, type(lengths).__name__, noun) from None
    if arr.ndim != 1 or arr.size == 0:
        raise SpecError(where, f"shape {arr.shape}", noun)
    if not isinstance(lengths, np.ndarray):  # numpy turns a bool among ints into 0 or 1
        i = next((i for i, x in enumerate(lengths) if isinstance(x, (bool, np.bool_))), None)
        if i is not None:
            raise SpecError(f"{where}[{i}]", lengths[i], f"a whole number of {unit}")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        values = arr.tolist() if isinstance(lengths, np.ndarray) else list(lengths)
        for i, x in enumerate(values):
            if not _whole_count(x):
                raise SpecError(f"{where}[{i}]", x, f"a whole number of {unit}")
        arr = np.asarray(values, dtype=np.int64)
    bad = np.flatnonzero(arr < least)
    if bad.size:
        raise SpecError(f"{where}[{int(bad[0])}]", int(arr[bad[0]]),
                        "a positive token count (an empty sample cannot be trained on)"
                        if least == 1 else f"a whole number of {unit}, at least {least}")
    return arr.astype(np.int64)


def whole(x) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_count(name: str, value, least: int) -> None:
    """``value`` a whole number at least ``least``, else a SpecError naming ``name``."""
    if not whole(value) or value < least:
        raise SpecError(name, value, f"a whole number, at least {least}")


def _whole_count(x) -> bool:
    """A whole number (an integer, or a float with no fraction) that fits int64."""
    if isinstance(x, np.generic) and not isinstance(x, np.bool_):
        x = x.item()
    if isinstance(x, float):
        return bool(np.isfinite(x)) and x.is_integer() and -2 ** 62 < x < 2 ** 62
    return whole(x) and -2 ** 62 < x < 2 ** 62


def check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    b = tuple(buckets)
    if not b or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1
                    for x in b) or list(b) != sorted(set(b)):
        raise SpecError("buckets", list(b), "increasing positive row lengths")
    return tuple(int(x) for x in b)


def geometric_buckets(smallest: int, largest: int, count: int) -> tuple[int, ...]:
    """At most ``count`` row lengths from ``smallest`` to ``largest`` (both powers-of-two
    multiples of ``smallest``), spaced evenly on a log scale: 4K..32K in 4 buckets is
    4K, 8K, 16K, 32K; 4K..128K in 4 is 4K, 16K, 32K, 128K."""
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
         ids: Sequence[int] | None = None, images=None,
         images_per_row: int | Mapping[int, int] | None = None) -> tuple[Row, ...]:
    """Rows holding every sample of ``lengths`` exactly once (``ids``: what the rows
    call the samples; default their positions in ``lengths``).

    ``order="best-fit"``: best-fit decreasing (see the module docstring).
    ``order="sequential"``: samples in the given order, each appended to the last row
    while it fits, else a new row of the largest bucket (Megatron-LM's concatenation,
    without splitting documents across rows).

    Multimodal samples: ``images`` per sample (their tokens counted in ``lengths``) and
    ``images_per_row``, the images a row of each bucket holds (one count for every
    bucket, or a mapping bucket -> count): a row's image dimension is part of its
    compiled shape, so no row takes more; a sample goes to the smallest bucket holding
    both its tokens and its images.

    Raises:
      SpecError: a sample longer than the largest bucket, or with more images than any
        bucket that holds it takes, naming it and the buckets.
    """
    lengths = check_lengths(lengths)
    buckets = check_buckets(buckets)
    caps = None
    if images is not None:
        images = check_images(images, lengths)
        caps = image_caps(buckets, images_per_row)
        check_fits(lengths, images, buckets, caps)
    top = buckets[-1]
    over = np.flatnonzero(lengths > top)
    if over.size:
        i = int(over[0])
        raise SpecError(f"lengths[{i}]", int(lengths[i]),
                        f"at most the largest bucket, {top} tokens (buckets {list(buckets)}; "
                        f"truncate or split longer samples, or add a bucket)")
    if order == "sequential":
        return sequential(lengths, top, ids, images, None if caps is None else caps[-1])
    if order != "best-fit":
        raise SpecError("order", order, "'best-fit' or 'sequential'")
    if images is not None:
        return best_fit_images(lengths, images, buckets, caps, ids).rows()
    return best_fit(lengths, buckets, ids).rows()


def check_images(images, lengths: np.ndarray) -> np.ndarray:
    """``images`` as int64 counts, one per sample of ``lengths``, each at least 0.

    Raises:
      SpecError: naming the first bad entry or the count mismatch.
    """
    arr = check_lengths(images, "images", least=0, unit="images")
    if arr.shape != lengths.shape:
        raise SpecError("images", f"{arr.size} counts", f"one per sample ({lengths.size})")
    return arr


def image_caps(buckets: tuple[int, ...], images_per_row) -> tuple[int, ...]:
    """Images a row of each bucket holds, from one count or a mapping bucket -> count.

    Raises:
      SpecError: a missing bucket or a count that is not a whole number at least 0.
    """
    if images_per_row is None:
        raise SpecError("images_per_row", None, "the images a row of each bucket holds, "
                        "with images")
    if isinstance(images_per_row, Mapping):
        missing = [b for b in buckets if b not in images_per_row]
        if missing:
            raise SpecError("images_per_row", dict(images_per_row),
                            f"a count for every bucket (missing {missing})")
        caps = tuple(images_per_row[b] for b in buckets)
    else:
        caps = (images_per_row,) * len(buckets)
    for b, c in zip(buckets, caps, strict=True):
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0:
            raise SpecError(f"images_per_row[{b}]", c, "a whole number of images, at least 0")
    return tuple(int(c) for c in caps)


def check_fits(lengths: np.ndarray, images: np.ndarray, buckets: tuple[int, ...],
               caps: tuple[int, ...]) -> None:
    """Every sample has a bucket holding its tokens and its images.

    Raises:
      SpecError: naming the first sample that has none.
    """
    # the most images a bucket at least as long as each sample holds
    most = np.maximum.accumulate(np.asarray(caps[::-1]))[::-1]
    at = np.searchsorted(np.asarray(buckets), lengths)
    fits = at < len(buckets)
    bad = np.flatnonzero(fits & (images > most[np.minimum(at, len(buckets) - 1)]))
    if bad.size:
        i = int(bad[0])
        raise SpecError(f"images[{i}]", int(images[i]),
                        f"at most {int(most[at[i]])} images, the most a row of buckets "
                        f"{list(buckets)} of at least {int(lengths[i])} tokens holds "
                        f"(images per row {list(caps)})")


def sequential(lengths: np.ndarray, top: int, ids=None, images: np.ndarray | None = None,
               cap: int | None = None) -> tuple[Row, ...]:
    """Megatron-LM's concatenation (see :func:`pack`): rows of ``top`` tokens, a new one
    where a sample's tokens (or its images, beyond ``cap`` a row) do not fit."""
    rows: list[list] = []
    room = room_img = 0
    names = range(lengths.size) if ids is None else list(ids)
    counts = images.tolist() if images is not None else [0] * lengths.size
    cap = 0 if cap is None else cap
    for i, (n, k) in enumerate(zip(lengths.tolist(), counts, strict=True)):
        if not rows or n > room or k > room_img:
            rows.append([top, [], []])
            room, room_img = top, cap
        rows[-1][1].append(names[i])
        rows[-1][2].append(n)
        room -= n
        room_img -= k
    return tuple(Row(b, tuple(s), tuple(n)) for b, s, n in rows)


def best_fit_images(lengths: np.ndarray, images: np.ndarray, buckets: tuple[int, ...],
                    caps: tuple[int, ...], ids: Sequence[int] | None = None) -> Packing:
    """Best-fit decreasing of checked multimodal samples: longest first, each into the
    open row with the least token room that takes it and has room for its images, else
    into a new row of the smallest bucket holding its tokens and its images (samples
    checked by :func:`check_fits`)."""
    widths: list[int] = []
    img_room: list[int] = []
    bits = max(1, lengths.size.bit_length())
    shift, mask = 1 << bits, (1 << bits) - 1
    # Open rows as room * shift + row, increasing (see best_fit): those with image room
    # in ``rooms``, those whose image slots are full (text only) in ``full``. Where images
    # bind, most open rows are full of images: a sample with images searches only
    # ``rooms``, one without takes the better of the two lists' first fits (the same
    # row one list searched in order would give).
    rooms: list[int] = []
    full: list[int] = []
    find, insort = bisect.bisect_left, bisect.insort
    order = np.argsort(-lengths, kind="stable")
    row_of = np.empty(lengths.size, np.int64)
    for j, (n, k) in enumerate(zip(lengths[order].tolist(), images[order].tolist(),
                                   strict=True)):
        need = n * shift
        at = find(rooms, need)
        source = rooms
        if k:
            end = len(rooms)
            while at < end and img_room[rooms[at] & mask] < k:
                at += 1
        else:
            at_full = find(full, need)
            if at_full < len(full) and (at == len(rooms) or full[at_full] < rooms[at]):
                source, at = full, at_full
        if at < len(source):
            key = source.pop(at) - need
            r = key & mask
        else:
            r = len(widths)
            b = find(buckets, n)
            while caps[b] < k:
                b += 1
            widths.append(buckets[b])
            img_room.append(caps[b])
            key = (buckets[b] - n) * shift + r
        img_room[r] -= k
        row_of[j] = r
        if key >= shift:
            insort(rooms if img_room[r] else full, key)
    taken = order[np.argsort(row_of, kind="stable")]
    names = taken if ids is None else np.asarray(ids)[taken]
    return Packing(np.asarray(widths, np.int64),
                   np.bincount(row_of, minlength=len(widths)).astype(np.int64),
                   names, lengths[taken])


def best_fit(lengths: np.ndarray, buckets: tuple[int, ...],
             ids: Sequence[int] | None = None) -> Packing:
    """Best-fit decreasing of checked ``lengths`` into ``buckets`` (see :func:`pack`),
    as arrays."""
    widths: list[int] = []
    # Open rows as ``room * SHIFT + row`` in increasing order: one integer per row keeps
    # the search a bisection over ints (the least room that takes n is the first key at
    # or above n * SHIFT), the row with the lower index first among equal rooms.
    bits = max(1, lengths.size.bit_length())
    shift, mask = 1 << bits, (1 << bits) - 1
    rooms: list[int] = []
    find, insort = bisect.bisect_left, bisect.insort
    order = np.argsort(-lengths, kind="stable")
    srt = lengths[order]
    # Equal lengths come in runs; a run fills the row that takes its first sample
    # while it has room (that row stays the least room that fits), so it is placed
    # a row at a time, as one sample at a time would place it.
    cut = np.flatnonzero(srt[1:] != srt[:-1]) + 1
    run_at = np.concatenate([[0], cut])
    run_n = np.diff(np.concatenate([run_at, [srt.size]]))
    row_of: list[int] = []  # per sample in that order
    for n, c in zip(srt[run_at].tolist(), run_n.tolist(), strict=True):
        need = n * shift
        if c == 1:  # most runs: one sample
            at = find(rooms, need)
            if at < len(rooms):
                key = rooms.pop(at) - need
                row_of.append(key & mask)
            else:
                r = len(widths)
                width = buckets[find(buckets, n)]
                widths.append(width)
                row_of.append(r)
                key = (width - n) * shift + r
            if key >= shift:
                insort(rooms, key)
            continue
        while c:
            at = find(rooms, need)
            if at < len(rooms):
                key = rooms.pop(at)
                r = key & mask
                q = min(c, (key >> bits) // n)
                key -= q * need  # the room left, same row
            else:
                r = len(widths)
                width = buckets[find(buckets, n)]
                widths.append(width)
                q = min(c, width // n)
                key = (width - q * n) * shift + r
            if q == 1:
                row_of.append(r)
            else:
                row_of += [r] * q
            c -= q
            if key >= shift:  # room left
                insort(rooms, key)
    # each row's samples in the order they went in (longest first)
    rows = np.asarray(row_of, np.int64)
    taken = order[np.argsort(rows, kind="stable")]
    names = taken if ids is None else np.asarray(ids)[taken]
    return Packing(np.asarray(widths, np.int64),
                   np.bincount(rows, minlength=len(widths)).astype(np.int64),
                   names, lengths[taken])


IMAGE_TOKEN = -1  # a multimodal sample's token id for one image-feature slot


def packed_arrays(samples: Sequence, rows: Sequence[Row], *, pad_id: int = 0,
                  targets: Sequence | None = None, target_tokens: int | None = None,
                  images_per_row: int | None = None, image_tokens: int | None = None,
                  image_token: int = IMAGE_TOKEN) -> dict[str, np.ndarray]:
    """The arrays of ``rows`` (all of one bucket) for a model taking packed sequences:
    ``tokens``, ``targets``, ``positions`` (restarting at 0 per sample), ``segment_ids``
    (1, 2, ... per sample in its row; padding 0) and ``loss_weight`` (1 on every target
    token, 0 on padding and on each sample's last token when ``targets`` is None, where
    the targets are the next tokens).

    ``samples``: 1-D integer token arrays, indexed as the rows' sample indices; or, for a
    multimodal model, mappings ``{"tokens": [n], "images": [k, H, W, C]}`` whose tokens
    hold one run of ``image_tokens`` entries ``image_token`` per image (the image's
    feature slots). Then the arrays also hold ``images`` [rows, images_per_row, H, W,
    C] (each row's images in order, zero padding) and ``image_index`` (per token: -1
    for text, else the index of its feature among the row's ``images_per_row *
    image_tokens`` features), ``tokens`` hold ``pad_id`` at image slots, and only text
    targets weigh.

    ``target_tokens``: the global batch's target count (over every bucket's rows,
    ``target_count``). Given, each weight is ``rows / target_tokens``, so the mean over
    rows of each row's weighted token losses is the global batch's token mean: a
    per-row loss, which any split of the rows into micro-batches, pipelines or calls of
    one bucket at a time sums exactly (``models.losses.packed_text_loss``,
    ``models.losses.packed_mllm_loss``).

    Raises:
      SpecError: rows of several buckets, a row that does not match its samples, a
        malformed multimodal sample, or a row with more images than ``images_per_row``.
    """
    if not rows:
        raise SpecError("rows", [], "at least one row")
    widths = {r.bucket for r in rows}
    if len(widths) != 1:
        raise SpecError("rows", f"buckets {sorted(widths)}", "rows of one bucket (one "
                        "array shape); call packed_arrays once per bucket")
    width = widths.pop()
    for r, row in enumerate(rows):
        bad = next((i for i in row.samples if not whole(i) or not 0 <= i < len(samples)),
                   None)
        if bad is not None or len(row.samples) != len(row.lengths):
            raise SpecError(f"rows[{r}].samples", list(row.samples),
                            f"indices of the {len(samples)} samples, one length each")
    shape = (len(rows), width)
    out = {"tokens": np.full(shape, pad_id, np.int32), "targets": np.zeros(shape, np.int32),
           "positions": np.zeros(shape, np.int32), "segment_ids": np.zeros(shape, np.int32),
           "loss_weight": np.zeros(shape, np.float32)}
    multimodal = isinstance(samples[rows[0].samples[0]] if rows[0].samples else samples[0],
                            Mapping)
    if multimodal:
        if isinstance(images_per_row, bool) or not isinstance(images_per_row, (int, np.integer)) \
                or images_per_row < 0:
            raise SpecError("images_per_row", images_per_row, "a whole number of images a "
                            "row holds, at least 0 (multimodal samples)")
        if isinstance(image_tokens, bool) or not isinstance(image_tokens, (int, np.integer)) \
                or image_tokens < 1:
            raise SpecError("image_tokens", image_tokens, "the positive count of token "
                            "slots an image takes (multimodal samples)")
        per_image = int(image_tokens)
        image_shape, dtype = _image_layout(samples, [i for r in rows for i in r.samples] or [0])
        out["images"] = np.zeros((len(rows), images_per_row) + image_shape, dtype)
        out["image_index"] = np.full(shape, -1, np.int32)
    for r, row in enumerate(rows):
        at = img_at = 0
        for seg, (i, n) in enumerate(zip(row.samples, row.lengths, strict=True), start=1):
            tok, imgs = _sample(samples, i, multimodal)
            if tok.shape[0] != n:
                raise SpecError(f"samples[{i}]", f"{tok.shape[0]} tokens",
                                f"the {n} tokens the packing was made for")
            text = np.ones(n, bool)
            if multimodal:
                text = tok != image_token
                slots = n - int(text.sum())
                if slots != len(imgs) * per_image:
                    raise SpecError(f"samples[{i}].tokens", f"{slots} image slots",
                                    f"{len(imgs)} images x {per_image} slots")
                if img_at + len(imgs) > images_per_row:
                    raise SpecError(f"rows[{r}]", f"{img_at + len(imgs)} images",
                                    f"at most images_per_row={images_per_row}")
                out["images"][r, img_at:img_at + len(imgs)] = imgs
                out["image_index"][r, at:at + n][~text] = img_at * per_image + np.arange(slots)
                tok = np.where(text, tok, pad_id)
                img_at += len(imgs)
            out["tokens"][r, at:at + n] = tok
            if targets is None:
                out["targets"][r, at:at + n - 1] = tok[1:]
                out["loss_weight"][r, at:at + n - 1] = text[1:]
            else:
                out["targets"][r, at:at + n] = np.asarray(targets[i]).reshape(-1)
                out["loss_weight"][r, at:at + n] = text
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


def target_count(samples: Sequence, image_token: int = IMAGE_TOKEN) -> int:
    """The next-token targets of ``samples`` (as :func:`packed_arrays` takes them): every
    token but each sample's first, and for multimodal samples only text tokens."""
    total = 0
    for i in range(len(samples)):
        multimodal = isinstance(samples[i], Mapping)
        tok, _ = _sample(samples, i, multimodal)
        total += int((tok[1:] != image_token).sum()) if multimodal else max(0, tok.size - 1)
    return total


def _sample(samples: Sequence, i: int, multimodal: bool):
    """(tokens, images or None) of sample ``i``, checked."""
    s = samples[i]
    if not multimodal:
        if isinstance(s, Mapping):
            raise SpecError(f"samples[{i}]", "a mapping", "a token array, as the other "
                            "samples of these rows")
        return np.asarray(s).reshape(-1), None
    if not isinstance(s, Mapping) or "tokens" not in s or "images" not in s:
        raise SpecError(f"samples[{i}]", type(s).__name__,
                        "a mapping with 'tokens' and 'images', as the other samples")
    imgs = np.asarray(s["images"])
    if imgs.ndim != 4:
        raise SpecError(f"samples[{i}].images", f"shape {imgs.shape}",
                        "[images, H, W, C] (0 images: shape [0, H, W, C])")
    return np.asarray(s["tokens"]).reshape(-1), imgs


def _image_layout(samples: Sequence, which: Sequence[int]):
    """(image shape, dtype) of the images of samples ``which``, which must share the
    shape."""
    shape = dtype = None
    for i in which:
        _, imgs = _sample(samples, i, True)
        if shape is None:
            shape, dtype = imgs.shape[1:], imgs.dtype
        elif imgs.shape[1:] != shape:
            raise SpecError(f"samples[{i}].images", f"image shape {imgs.shape[1:]}",
                            f"the other samples' {shape}")
    return tuple(shape), (dtype if np.issubdtype(dtype, np.floating) else np.float32)


def fill_steps(g, p: Packing, buckets: Sequence[int],
               images: np.ndarray | None = None) -> Packing:
    """Rows re-bucketed for ``g`` (a ``GroupCost``, or a pipeline's stand-in: its ``n``,
    ``degree``, ``slots``, ``longest`` and ``images_of``) so that at most the largest
    bucket ends in a part-empty micro-step: from the smallest bucket up, the rows a
    bucket's last micro-step would hold short of full are merged, ``next / bucket`` at a
    time, into rows of the next bucket (the same device slots, one context degree up),
    as packing them there would have. Not into a bucket whose rows hold more slots per
    device (rows over every device under the long remat): there the merged row costs
    more than the idle devices it would fill; nor where a merged row would take more
    images than a row of the next bucket holds."""
    used = p.used()
    img = None
    if images is not None:
        img = np.zeros(p.counts.size, np.int64)
        filled = p.counts > 0
        img[filled] = np.add.reduceat(images[p.samples], p.starts[filled])
    out_bucket, out_parts, out_src = [], [], []
    # Rows merged up from the bucket below, after the bucket's own rows: tokens used,
    # images, how many of the packing's rows each holds, and those rows in order.
    none = np.zeros(0, np.int64)
    carry_fill, carry_img, carry_size, carry_members = none, none, none, none
    for i, b in enumerate(buckets):
        own = np.flatnonzero(p.bucket == b)
        size = np.concatenate([np.ones(own.size, np.int64), carry_size])
        members = np.concatenate([own, carry_members])
        fill = np.concatenate([used[own], carry_fill])
        pics = None if img is None else np.concatenate([img[own], carry_img])
        start = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64)
        nxt = buckets[i + 1] if i + 1 < len(buckets) else None
        extra = fill.size % max(1, g.n // g.degree(b))
        carry_fill, carry_img, carry_size, carry_members = none, none, none, none
        order = np.arange(fill.size)
        if not (nxt is None or not extra or nxt > g.longest or g.slots(nxt) > g.slots(b)):
            # the least-filled rows move up, next / bucket of them per new row
            by_fill = np.argsort(-fill, kind="stable")
            moving = by_fill[fill.size - extra:]
            first = np.arange(0, moving.size, nxt // b)
            if pics is None or np.add.reduceat(pics[moving], first).max() <= g.images_of(nxt):
                order = by_fill[:fill.size - extra]
                carry_fill = np.add.reduceat(fill[moving], first)
                carry_img = none if pics is None else np.add.reduceat(pics[moving], first)
                carry_size = np.add.reduceat(size[moving], first)
                carry_members = members[ranges(start[moving], size[moving])]
        out_bucket.append(np.full(order.size, b, np.int64))
        out_parts.append(size[order])
        out_src.append(members[ranges(start[order], size[order])])
    return p.regroup(np.concatenate(out_bucket), np.concatenate(out_parts),
                     np.concatenate(out_src))


def image_slots(buckets: tuple[int, ...], image_tokens: int,
                 images_per_row: Mapping[int, int] | None) -> tuple[int, ...]:
    """Checked ``images_per_row`` as counts per bucket (empty: the default)."""
    if images_per_row is None:
        return ()
    if not image_tokens:
        raise SpecError("images_per_row", dict(images_per_row),
                        "None without a vision encoder (group_costs(vision=, image_tokens=))")
    if not isinstance(images_per_row, Mapping) or set(images_per_row) - set(buckets):
        raise SpecError("images_per_row", images_per_row,
                        f"a mapping from the buckets {list(buckets)} to image counts")
    out = []
    for b in buckets:
        c = images_per_row.get(b, b // image_tokens)
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or \
                not 0 <= c <= b // image_tokens:
            raise SpecError(f"images_per_row[{b}]", c,
                            f"0 to {b // image_tokens} (the images of {image_tokens} tokens "
                            f"a {b}-token row holds)")
        out.append(int(c))
    return tuple(out)
