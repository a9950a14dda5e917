"""One planner family: what both per-batch planners do with a batch's samples, and the
plans they return.

Both planners (``hetshard.data.planner`` on data-parallel GPU groups,
``hetshard.data.pipelines`` on pipelines of stages) share a batch out among *owners*
that work in parallel, and differ only in how an owner prices a packing of its rows. An
owner is priced through an object (the groups' ``_Pricer``, the pipelines' ``_Stages``)
that says

* ``name``, ``buckets`` (its row lengths), ``step_s`` (its update), ``image_caps``
  (images a row of each bucket holds) and ``merging`` (the group whose micro-steps
  ``fill_steps`` merges a bucket's part-empty last micro-step by);
* ``compose(packing, images, in_order=False, **effort)``: the packing's rows as priced
  micro-steps, in the order they run, and the owner's time for them, update included
  (``in_order``: the rows as they come, for the static baselines). Each micro-step it
  returns becomes the plan's :class:`MicroStep` with ``.micro_step(rows)``.

On that, this module drafts one owner's plan of its samples (:func:`draft`: packed
best-fit decreasing, a bucket's part-empty micro-step merged up where that prices
faster), places a batch over the owners (:func:`place`: longest processing time first,
re-run with each owner's priced-over-estimated time while the step falls) and builds the
static baselines (:func:`static`: padded rows or Megatron-LM's concatenated rows, shared
in proportion to the owners' speeds). Each planner adds its own search after the
placement (moves between groups; the micro-batches' order on a pipeline).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from hetshard.data.packing import Packing, Row, best_fit, best_fit_images, fill_steps, sequential
from hetshard.data.search import lpt_placement, proportional_shares


@dataclasses.dataclass(frozen=True)
class MicroStep:
    bucket: int
    degree: int
    rows: tuple[Row, ...]  # at most devices // degree; the rest of the slots are padding
    time_s: float


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    group: str
    samples: tuple[int, ...]
    steps: tuple[MicroStep, ...]
    time_s: float  # micro-steps plus the group's step_s
    images: int = 0


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    method: str
    groups: tuple[GroupPlan, ...]
    step_time_s: float
    tokens: int
    bound_s: float | None
    planning_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s

    @property
    def gap(self) -> float | None:
        return None if not self.bound_s else self.step_time_s / self.bound_s - 1.0

    @property
    def shapes(self) -> tuple[tuple[str, int], ...]:
        """(group, bucket) of every compiled micro-step shape."""
        return tuple(sorted({(g.group, s.bucket) for g in self.groups for s in g.steps}))


@dataclasses.dataclass(frozen=True)
class Draft:
    """An owner's plan while placements are compared: its samples (indices into the
    batch), their packing (None: no samples), its priced micro-steps in the order they
    run, its time (update included) and its images."""

    name: str
    samples: np.ndarray
    packing: Packing | None
    steps: list
    time_s: float
    images: int = 0

    def plan(self) -> GroupPlan:
        if self.packing is None:
            return GroupPlan(self.name, (), (), self.time_s)
        rows = self.packing.rows()
        return GroupPlan(self.name, tuple(self.samples.tolist()),
                         tuple(s.micro_step(rows) for s in self.steps), self.time_s,
                         self.images)


def _images(images: np.ndarray | None, samples: np.ndarray) -> int:
    return int(images[samples].sum()) if images is not None and samples.size else 0


def draft(owner, samples: np.ndarray, lengths: np.ndarray, images: np.ndarray | None,
          **effort) -> Draft:
    """``owner``'s plan of ``samples`` (of a batch of ``lengths`` tokens and ``images``
    per sample): packed best-fit decreasing into its buckets and composed; where
    ``fill_steps`` merges a bucket's part-empty last micro-step's rows up into the next
    bucket, that packing is composed too and kept only where it prices faster (merging
    saves that micro-step, but where the bucket above had no micro-step with room it
    opens one, on a longer ring or under a dearer remat)."""
    if samples.size == 0:
        return Draft(owner.name, samples, None, [], owner.step_s)
    buckets = owner.buckets
    if images is None:
        packed = best_fit(lengths[samples], buckets, samples)
    else:
        packed = best_fit_images(lengths[samples], images[samples], buckets,
                                 owner.image_caps, samples)
    steps, t = owner.compose(packed, images, **effort)
    chosen = packed
    merged = fill_steps(owner.merging, packed, buckets, images)
    if merged.bucket.size != packed.bucket.size or (merged.bucket != packed.bucket).any():
        other, t_other = owner.compose(merged, images, **effort)
        if t_other < t:
            chosen, steps, t = merged, other, t_other
    return Draft(owner.name, samples, chosen, steps, t, _images(images, samples))


class Placement(NamedTuple):
    """A batch's placement while the search compares them: the step time it prices,
    each owner's samples, and each owner's draft."""

    time_s: float
    parts: list
    drafts: tuple


def place(drafting: Callable[[int, np.ndarray], Draft], costs: np.ndarray, n: np.ndarray,
          step_s: Sequence[float], rounds: int) -> Placement:
    """The placement rounds: each sample to an owner longest processing time first
    (``lpt_placement`` on ``costs[owner, sample]`` seconds over ``n[owner]`` parallel
    workers), every owner's samples drafted (``drafting(owner, samples)``), then again
    with each owner's estimate scaled by its priced time over it, until the priced step
    stops falling or the relative speeds stop changing; at most ``rounds`` placements.
    A round stops drafting as soon as one owner prices no better than the best step so
    far (whatever the others price, that placement loses)."""
    owners = len(n)
    scale = np.ones(owners)
    best = None
    for _ in range(rounds):
        where = lpt_placement(costs, n, scale)
        parts = [np.flatnonzero(where == k) for k in range(owners)]
        seen: list[Draft] = []
        for k in range(owners):
            seen.append(drafting(k, parts[k]))
            if best is not None and seen[-1].time_s >= best.time_s:
                break
        worst = max(d.time_s for d in seen)
        if best is not None and worst >= best.time_s:
            break
        best = Placement(worst, parts, tuple(seen))
        est = np.array([costs[k, parts[k]].sum() / n[k] * scale[k] if parts[k].size
                        else 0.0 for k in range(owners)])
        priced = np.array([d.time_s - step_s[k] for k, d in enumerate(seen)])
        new = np.where(est > 0, scale * priced / np.maximum(est, 1e-30), scale)
        if np.allclose(new / new.max(), scale / scale.max(), rtol=0.01):
            break  # the same relative speeds: the same placement
        scale = new
    return best


def static(method: str, owners: Sequence, speeds: np.ndarray, lengths: np.ndarray,
           images: np.ndarray | None, top: int, slots: int | None) -> list[Draft]:
    """The static baselines' drafts: ``"pad"`` (each sample alone in a row of ``top``
    tokens) or ``"fixed-cp"`` (Megatron-LM: the samples concatenated in order into rows of
    ``top`` tokens, at most ``slots`` images a row), the rows shared out in order in
    proportion to the owners' ``speeds`` (largest remainders), each owner's run as they
    come."""
    if method == "pad":
        rows = tuple(Row(top, (i,), (int(x),)) for i, x in enumerate(lengths.tolist()))
    else:
        rows = sequential(lengths, top, None, images, slots)
    bounds = np.concatenate([[0], np.cumsum(proportional_shares(len(rows), speeds))])
    out = []
    for k, owner in enumerate(owners):
        mine = rows[bounds[k]:bounds[k + 1]]
        if not mine:
            out.append(Draft(owner.name, np.zeros(0, np.int64), None, [], owner.step_s))
            continue
        packing = Packing.of(mine)
        steps, t = owner.compose(packing, images, in_order=True)
        samples = np.asarray([i for r in mine for i in r.samples], np.int64)
        out.append(Draft(owner.name, samples, packing, steps, t, _images(images, samples)))
    return out
