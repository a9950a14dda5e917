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
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from hetshard.collectives import here, takes_part, transfer
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
    return x if x.sharding == sharding else jax.device_put(x, sharding)


def mixed_step(runners: Sequence[PipelineRunner], batches: Sequence,
               order: Sequence[tuple[int, int]], state, may_apply):
    """One step of ``runners``' passes (one runner a shape; ``batches[k]`` the batch of
    pass ``k``, its micro-batches in its plan's order) walked together, micro-batch
    ``order[g] = (pass, micro-batch)`` ``g``-th into the pipeline; returns what
    ``PipelineRunner.step`` returns (the lead runner applies the update)."""
    check_passes(runners)
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
        weights = r.program.piece_weights(
            bl, [(k * mbs, (k + 1) * mbs) for k in range(p.num_micro_batches)])
        walks.append(PipelineWalk(r, 0, bl, 0, 1.0, weights))
    seen = sorted(order)
    want = sorted((k, j) for k, r in enumerate(runners)
                  for j in range(r.plan.pipelines[0].num_micro_batches))
    if seen != want:
        raise PipelineSetupError(f"the order names every pass's micro-batches once "
                                 f"({len(want)}), not {len(order)} entries")
    for s, kind, g in schedule_walk("1f1b", len(lead.runs[0]), len(order)):
        k, j = order[g]
        (walks[k].forward if kind == "F" else walks[k].backward)(s, j)
    results = [w.results() for w in walks]
    # The passes' gradients, and loss outputs, added on the lead's stages.
    grads, loss = results[0]
    home = lead.runs[0]
    for r, (g, out) in zip(runners[1:], results[1:], strict=True):
        for si, (mine, theirs) in enumerate(zip(grads, g, strict=True)):
            run = home[si]
            for i, x in theirs.items():
                src, dst = r.runs[0][si].shardings[i], run.shardings[i]
                if not takes_part(src, dst):
                    continue
                got = transfer([x] if r.runs[0][si].here else None,
                               [lead.state_avals[i]], [src], [dst])
                if run.here:
                    mine[i] = got[0] if mine.get(i) is None else stage_fns.add(mine[i], got[0])
        loss = _added(lead, r, loss, out)
    return lead.finish([grads], [loss], 1.0,
                       jax.tree.leaves(batches[0]), leaves, may_apply)


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
