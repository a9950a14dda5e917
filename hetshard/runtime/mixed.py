"""One training step whose micro-batches have different shapes, walked as one pipeline:
a per-batch plan on a pipeline outer plan (``hetshard.data.pipelines``), whose
micro-batches hold rows of different buckets in the order the planner priced.

Each shape has its own :class:`~hetshard.runtime.pipeline.PipelineRunner` (its stage
programs traced at that shape, on the same stages and devices): a *pass* of that
shape's micro-batches. The passes share the state: the first pass's runner holds it on
the stages, and every other pass reads those arrays (moved only where its stage meshes
lay a leaf out differently, as a context axis does). One walk of the one-forward-one-
backward schedule over every micro-batch, in the planned order, runs each task on its
pass (``hetshard.runtime.walk.PipelineWalk``: its forward, backward, transfers). The
passes' gradients and loss outputs are then added, on the first pass's stages, and the
update is applied once (``PipelineRunner.finish``). The batch's rows are weighted for
that sum: each pass's loss is its share of the whole batch's
(``hetshard.data.packed_arrays(target_tokens=)``).

Passes on other stages are other pipelines (data-parallel replicas on their own
devices): each walks its own passes, their sums are added across pipelines (the total
on every pipeline's holder of each leaf), and each pipeline applies the update to its
own copy of the state, as ``PipelineRunner`` does for a plan of several pipelines.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from hetshard.collectives import here, put, takes_part, transfer
from hetshard.runtime import stage_fns
from hetshard.runtime.ownership import PipelineSetupError
from hetshard.runtime.pipeline import PipelineRunner
from hetshard.runtime.walk import PipelineWalk, samples_per_micro_batch
from hetshard.sim.schedule import schedule_walk


def check_passes(runners: Sequence[PipelineRunner]) -> None:
    """Passes that can share one walk: one pipeline each, the same stages (layers,
    devices) under 1F1B, no loss scaling, no per-sample loss outputs and no batch
    reads in the update (the passes' batches differ in shape).

    Raises:
      PipelineSetupError: naming what differs.
    """
    lead = runners[0]
    shape = [(st.start, st.end, st.devices) for st in lead.plan.pipelines[0].stages]
    for r in runners:
        p = r.plan.pipelines
        if len(p) != 1:
            raise PipelineSetupError(f"a step of passes runs one pipeline a pass, not "
                                     f"{len(p)}")
        if [(st.start, st.end, st.devices) for st in p[0].stages] != shape:
            raise PipelineSetupError("the passes of one step run on the same stages "
                                     "(layers and devices)")
        if p[0].schedule != "1f1b" or p[0].virtual_stages != 1:
            raise PipelineSetupError(f"a step of passes walks 1F1B, not "
                                     f"{p[0].schedule!r} x{p[0].virtual_stages}")
        if r.loss_scale is not None:
            raise PipelineSetupError("a step of passes does not scale the loss (float16 "
                                     "stages): compute in bfloat16 or float32")
        if r.per_sample or r.program.update_batch_reads:
            raise PipelineSetupError("a step of passes adds its passes' loss outputs: no "
                                     "per-sample outputs, no batch read by the update")


def _moved(x, sharding):
    return x if x.sharding == sharding else put(x, sharding)


def mixed_step(runners: Sequence[PipelineRunner], batches: Sequence,
               order: Sequence[tuple[int, int]], state):
    """One step of ``runners``' passes (one runner a shape and pipeline; ``batches[k]``
    the batch of pass ``k``, its micro-batches in its plan's order), micro-batch
    ``order[g] = (pass, micro-batch)`` entering its pipeline ``g``-th. Passes on the
    same stages are one pipeline, walked together; several pipelines (data-parallel
    replicas on their own devices) walk one after the other (JAX runs them at once), sum
    their gradients and loss outputs, and each applies the update to its own copy of the
    state. Returns what ``PipelineRunner.step`` returns (the first pipeline's)."""
    pipes: dict = {}  # stages -> the passes on them
    for k, r in enumerate(runners):
        key = tuple(st.devices for st in r.plan.pipelines[0].stages)
        pipes.setdefault(key, []).append(k)
    seen = sorted(order)
    want = sorted((k, j) for k, r in enumerate(runners)
                  for j in range(r.plan.pipelines[0].num_micro_batches))
    if seen != want:
        raise PipelineSetupError(f"the order names every pass's micro-batches once "
                                 f"({len(want)}), not {len(order)} entries")
    groups = list(pipes.values())
    for ks in groups:
        check_passes([runners[k] for k in ks])
    leads = [runners[ks[0]] for ks in groups]
    leaves = jax.tree.leaves(state)
    summed = []
    for ks in groups:
        local = {k: n for n, k in enumerate(ks)}
        mine = [(local[k], j) for k, j in order if k in local]
        summed.append(_walked([runners[k] for k in ks], [batches[k] for k in ks], mine,
                              state))
    if len(leads) > 1:
        summed = _across(leads, summed)
    # Every pipeline applies what the first decides (on the device, the verdict sent to
    # the others' stages): their sums are equal, their carries need not be.
    results = []
    for lead, (g, loss), ks in zip(leads, summed, groups, strict=True):
        results.append(lead.finish([g], [loss], [[1.0] * len(lead.runs[0])],
                                   jax.tree.leaves(batches[ks[0]]), leaves,
                                   verdict=leads[0].verdict if results else None))
    for lead in leads[1:]:  # its copy equals the first's: the caller holds the first's
        lead.published = leads[0].published
    return results[0]


def _walked(runners: Sequence[PipelineRunner], batches: Sequence,
            order: Sequence[tuple[int, int]], state):
    """One pipeline's passes walked as one: (per stage, leaf -> gradient; the loss
    outputs), the passes' sums on the first pass's stages."""
    lead = runners[0]
    leaves = lead.prepare(state)
    for r in runners[1:]:  # the other passes read the lead's copies
        r.views = [[{i: _moved(lead.views[0][si][i] if i in lead.views[0][si]
                               else leaves[i], run.shardings[i]) for i in run.local}
                    if run.here else None for si, run in enumerate(r.runs[0])]]
    walks = []
    for r, batch in zip(runners, batches, strict=True):
        bl = jax.tree.leaves(batch)
        p = r.plan.pipelines[0]
        mbs = samples_per_micro_batch(p)
        weights = r.program.samples.piece_weights(
            bl, [(k * mbs, (k + 1) * mbs) for k in range(p.num_micro_batches)])
        walks.append(PipelineWalk(r, 0, bl, 0, 1.0, weights))
    for s, kind, g in schedule_walk("1f1b", len(lead.runs[0]), len(order)):
        k, j = order[g]
        (walks[k].forward if kind == "F" else walks[k].backward)(s, j)
    results = [w.results() for w in walks]
    # The passes' gradients, and loss outputs, added on the lead's stages.
    grads, loss = results[0]
    for r, (g, out) in zip(runners[1:], results[1:], strict=True):
        for si, theirs in enumerate(g):
            for i, x in theirs.items():
                _add_into(grads, si, i, lead, r, si, x)
        loss = _added(lead, r, loss, out)
    return grads, loss


def _add_into(grads, si: int, i: int, lead: PipelineRunner, r: PipelineRunner, sj: int,
              x) -> None:
    """``grads[si][i]`` (on ``lead``'s stage ``si``) plus ``x`` (leaf ``i``'s gradient
    on ``r``'s stage ``sj``)."""
    src, dst = r.runs[0][sj].shardings[i], lead.runs[0][si].shardings[i]
    if not takes_part(src, dst):
        return
    got = transfer([x] if r.runs[0][sj].here else None, [lead.state_avals[i]], [src], [dst])
    if lead.runs[0][si].here:
        held = grads[si].get(i)
        grads[si][i] = got[0] if held is None else stage_fns.add(held, got[0])


def _holder(grads, i: int) -> int:
    return next(s for s, g in enumerate(grads) if i in g)


def _across(leads: Sequence[PipelineRunner], summed: list) -> list:
    """The pipelines' gradients and loss outputs summed, the total on each pipeline's
    holder of each leaf (and its loss stage)."""
    first, (grads, loss) = leads[0], summed[0]
    for lead, (g, out) in zip(leads[1:], summed[1:], strict=True):
        for sj, theirs in enumerate(g):
            for i, x in theirs.items():
                _add_into(grads, _holder(grads, i), i, first, lead, sj, x)
        loss = _added(first, lead, loss, out)
    out = [(grads, loss)]
    for lead, (g, _) in zip(leads[1:], summed[1:], strict=True):
        total = [dict.fromkeys(d) for d in g]
        for sj, d in enumerate(g):
            for i in d:
                si = _holder(grads, i)
                src, dst = first.runs[0][si].shardings[i], lead.runs[0][sj].shardings[i]
                if takes_part(src, dst):
                    got = transfer([grads[si][i]] if first.runs[0][si].here else None,
                                   [first.state_avals[i]], [src], [dst])
                    if lead.runs[0][sj].here:
                        total[sj][i] = got[0]
        home, dst = first.loss_home(0), lead.loss_home(0)
        n = len(first.loss_out_avals)
        moved = transfer(list(loss) if loss is not None and here(home) else None,
                         list(first.loss_out_avals), [home] * n, [dst] * n) \
            if takes_part(home, dst) else None
        out.append((total, moved))
    return out


def _added(lead: PipelineRunner, r: PipelineRunner, loss, out):
    """``lead``'s loss outputs plus pass ``r``'s, on the lead's loss stage."""
    home, src = lead.loss_home(0), r.loss_home(0)
    if not takes_part(src, home):
        return loss
    n = len(lead.loss_out_avals)
    moved = transfer(list(out) if here(src) else None, list(r.loss_out_avals),
                     [src] * n, [home] * n)
    if loss is None or moved is None:
        return loss
    return [stage_fns.add(a, b) for a, b in zip(loss, moved, strict=True)]
