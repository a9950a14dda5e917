"""One pipeline's forward and backward passes over its micro-batches, task by task.

Every process walks the same schedule (``hetshard.sim.schedule.schedule_walk``: the walk
the simulator prices), runs its own stages' tasks and joins the transfers into or out
of them, so every pair of processes issues its cross-process collectives in the same
order. A forward sends each stage's boundary values to the stages that read them (a
value is dropped once its last reader has it); a backward sends the cotangents back;
under ZB-H1 a backward runs as B (the input's cotangent, sent at once) and W (the
weights' gradients, later). Gradients accumulate per stage over micro-batches; the loss
outputs accumulate weighted by each micro-batch's weight (``LossSamples.piece_weights``: its
share of the global batch, 1 for a sum over the samples, its share of the count for a
masked mean), the loss's cotangent seeded with it.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hetshard.collectives import here, put, takes_part, transfer
from hetshard.layout import activation_sharding
from hetshard.runtime import stage_fns
from hetshard.sim.schedule import schedule_walk


def samples_per_micro_batch(pipeline) -> int:
    """Samples in one micro-batch of the pipeline (the plan's ``micro_batch_size`` is per
    data-parallel replica of a stage)."""
    return pipeline.batch_share // pipeline.num_micro_batches


class PipelineWalk:
    """Pipeline ``pi`` of ``runner`` (a ``PipelineRunner``) through one step on
    ``batch_leaves[start:start + batch share]``; the loss's cotangent is seeded with
    the loss scale times the micro-batch's weight (``weights[mb][0]``; gradients come
    back scaled); ``scale``: a number, or per stage the scale on its devices (a device
    scalar: the loss scale is never read on the host).
    :meth:`run` returns (per stage, parameter leaf -> its gradient, None where another
    process holds it; the loss outputs on the loss stage)."""

    def __init__(self, runner, pi: int, batch_leaves, start: int, scale, weights):
        pipeline = runner.plan.pipelines[pi]
        self.runner, self.pi, self.pipeline = runner, pi, pipeline
        self.runs = runner.runs[pi]
        self.stages = runner.splits[pi].stages
        self.batch_leaves, self.start = batch_leaves, start
        self.scales = list(scale) if isinstance(scale, (list, tuple)) else \
            [scale] * len(self.runs)
        self.n, self.m = len(self.runs), pipeline.num_micro_batches
        self.mbs = samples_per_micro_batch(pipeline)
        # Per micro-batch, each loss output's weight (``LossSamples.piece_weights`` over the
        # whole batch's pieces): a mean's pieces weigh their share of the global batch,
        # a sum's 1, a masked mean's their share of its count; the loss's cotangent is
        # seeded with its weight.
        self.mb_weights = weights
        self.summed = runner.summed
        self.seq_len = runner.plan.seq_len
        self.zbh1 = pipeline.schedule == "zbh1"
        self.producer: dict = {}  # boundary value -> the stage sending it
        readers: dict = {}
        for st in self.stages:
            for v in st.sends:
                self.producer[v] = st.index
            for v in st.recvs:
                readers[v] = readers.get(v, 0) + 1
        m = self.m
        # Per micro-batch: reads each sent value still has (dropped at none), the values
        # sent forward, the cotangents sent back.
        self.unread = [dict(readers) for _ in range(m)]
        self.values: list[dict] = [{} for _ in range(m)]
        self.cts: list[dict] = [{} for _ in range(m)]
        self.vjps: dict = {}  # (stage, micro-batch) -> the forward's vjp
        self.pending: dict = {}  # ZB-H1: (stage, micro-batch) -> what its W pass reads
        self.acc: list = [None] * self.n  # per stage: parameter gradients so far
        # loss output position -> its pieces (micro-batch -> value), summed weighted at
        # the end (one program, not one a micro-batch) or joined (per-sample outputs)
        self.loss_acc: dict = {}

    def run(self):
        task = {"F": self.forward, "B": self.backward, "W": self.weights}
        p = self.pipeline
        for s, kind, mb in schedule_walk(p.schedule, self.n, self.m, p.virtual_stages,
                                         p.extra_warmup):
            task[kind](s, mb)
        return self.results()

    def results(self):
        """After every task ran (:meth:`run`, or a walk driving :meth:`forward` and
        :meth:`backward` itself): (per stage, parameter leaf -> gradient; the loss
        outputs on the loss stage)."""
        for s, run in enumerate(self.runs):
            if run.here:  # uneven experts' gradients back to their stored layout
                self.acc[s] = run.fwd.give_back(self.acc[s])
            run.fwd.release()  # the step's casts (the vjps that read them are gone)
        return self._tied_gradients(), self._outputs()

    # ---- transfers and timing --------------------------------------------------------
    def _act(self, v, mesh):
        return activation_sharding(v.aval.shape, mesh, self.mbs, self.seq_len)

    def _move(self, variables, src: int, dst: int, have):
        """Moves activations (or cotangents) of ``variables`` from stage ``src`` to
        stage ``dst``; ``have`` gives the source values (read only where src runs)."""
        a, b = self.runs[src], self.runs[dst]
        srcs = [self._act(v, a.mesh) for v in variables]
        dsts = [self._act(v, b.mesh) for v in variables]
        if not variables or not takes_part(srcs[0], dsts[0]):
            return None
        return transfer(have() if a.here else None, [v.aval for v in variables], srcs, dsts)

    def _clocked(self, s: int, f):
        """``f()``; timed (to its results) when the step is timed, plus any delay
        injected for stage ``s`` (``PipelineRunner.clock``, ``delays``)."""
        runner, key = self.runner, (self.pi, s)
        if runner.clock is None:
            return f()
        t0 = time.perf_counter()
        out = jax.block_until_ready(f())
        if runner.delays.get(key):
            time.sleep(runner.delays[key])
        runner.clock[key] = runner.clock.get(key, 0.0) + time.perf_counter() - t0
        return out

    # ---- the three tasks ---------------------------------------------------------------
    def forward(self, s: int, mb: int) -> None:
        run, st = self.runs[s], self.runs[s].program
        values, unread = self.values[mb], self.unread[mb]
        by_producer: dict[int, list] = {}
        for v in st.recvs:
            by_producer.setdefault(self.producer[v], []).append(v)
        recvd = {}
        for p, vs in by_producer.items():
            got = self._move(vs, p, s, lambda vs=vs: [values[v] for v in vs])
            if got is not None:
                recvd.update(zip(vs, got, strict=True))
            for v in vs:
                unread[v] -= 1
                if not unread[v]:
                    values.pop(v, None)
        if not run.here:
            return
        lo, mbs, leaves = self.start + mb * self.mbs, self.mbs, self.batch_leaves
        view = self.runner.views[self.pi][s]
        batch = [put(np.asarray(leaves[i][lo:lo + mbs])
                                if isinstance(leaves[i], np.ndarray) else leaves[i][lo:lo + mbs],
                                activation_sharding((mbs, *np.shape(leaves[i])[1:]), run.mesh,
                                                    mbs, self.seq_len))
                 for i in st.batch]
        fo, oo, vjp = self._clocked(s, lambda: run.fwd([view[i] for i in st.params],
                                                       [view[i] for i in st.frozen], batch,
                                                       [recvd[v] for v in st.recvs]))
        self.vjps[s, mb] = vjp
        outs = [None] * len(st.sends)
        for j, x in zip(st.diff_sends, fo, strict=True):
            outs[j] = x
        rest = iter(oo)
        for j in range(len(st.sends)):
            if outs[j] is None:
                outs[j] = next(rest)
        for j, (v, x) in enumerate(zip(st.sends, outs, strict=True)):
            if unread.get(v):
                values[v] = x
            if j in st.outputs:
                self.loss_acc.setdefault(st.outputs[j], {})[mb] = x

    def backward(self, s: int, mb: int) -> None:
        run, st = self.runs[s], self.runs[s].program
        cts = self.cts[mb]
        rc = None
        if run.here:
            incoming = []
            for j in st.diff_sends:
                parts = cts.pop(st.sends[j], [])
                incoming.append(functools.reduce(jnp.add, parts) if parts else None)
            seeds = ([float(self.mb_weights[mb][0]) if st.outputs.get(j) == 0 else None
                      for j in st.diff_sends], self.scales[s])
            if self.zbh1 and not st.diff_recvs:
                # ZB-H1 on a stage with no input cotangent to send (the first): its whole
                # backward runs as W, as the simulator times it, so nothing computed in B
                # waits for W.
                self.pending[s, mb] = (self.vjps.pop((s, mb)), incoming, seeds)
                rc = []
            elif self.zbh1:  # the input's cotangent now, the weights' at the W pass
                vjp = self.vjps.pop((s, mb))
                rc, seeded, carried = self._clocked(
                    s, lambda: run.bwd_input(vjp, incoming, seeds))
                self.pending[s, mb] = (vjp, seeded, carried)
            else:
                self.acc[s], rc = self._clocked(
                    s, lambda: run.bwd(self.vjps.pop((s, mb)), incoming, seeds, self.acc[s]))
            rc = dict(zip((st.recvs[i] for i in st.diff_recvs), rc, strict=True))
        by_producer: dict[int, list] = {}
        for i in st.diff_recvs:
            by_producer.setdefault(self.producer[st.recvs[i]], []).append(st.recvs[i])
        for p, vs in by_producer.items():
            got = self._move(vs, s, p, lambda vs=vs: [rc[v] for v in vs])
            if got is not None:
                for v, c in zip(vs, got, strict=True):
                    cts.setdefault(v, []).append(c)

    def weights(self, s: int, mb: int) -> None:
        run = self.runs[s]
        if not run.here:
            return
        if run.program.diff_recvs:
            self.acc[s] = self._clocked(
                s, lambda: run.bwd_weight(*self.pending.pop((s, mb)), self.acc[s]))
        else:
            self.acc[s], _ = self._clocked(
                s, lambda: run.bwd(*self.pending.pop((s, mb)), self.acc[s]))

    # ---- after the walk ----------------------------------------------------------------
    def _tied_gradients(self) -> list[dict]:
        """Per stage, parameter leaf -> gradient, the gradients of read copies (tied
        parameters) added at the stage that owns them."""
        runs, runner = self.runs, self.runner
        grads = [dict(zip(runs[s].program.params, self.acc[s], strict=True)) if runs[s].here
                 else dict.fromkeys(runs[s].program.params) for s in range(self.n)]
        owner = runner.owner[self.pi]
        for s in range(self.n):
            for i in list(runs[s].program.params):
                o = owner.get(i, s)
                if o == s:
                    continue
                g = grads[s].pop(i)
                src, dst = runs[s].shardings[i], runs[o].shardings[i]
                moved = (transfer([g] if runs[s].here else None, [runner.state_avals[i]],
                                  [src], [dst]) if takes_part(src, dst) else None)
                if runs[o].here:
                    held = grads[o].get(i)
                    grads[o][i] = moved[0] if held is None else stage_fns.add(held, moved[0])
                else:
                    grads[o].setdefault(i, None)
        return grads

    def _outputs(self) -> list:
        """The loss outputs, every one moved to the loss stage (some may be computed
        before it)."""
        runs, runner = self.runs, self.runner
        avals = runner.program.samples.outputs_for(runner.loss_out_avals, self.pipeline.batch_share)
        loss_stage = runner.loss_stage[self.pi]
        outputs = [self.loss_acc.get(k) for k in range(len(avals))]
        for k, pieces in enumerate(outputs):
            if pieces is not None and k not in runner.per_sample:
                mbs = sorted(pieces)
                outputs[k] = stage_fns.weighted_sum(
                    [pieces[mb] for mb in mbs], [self.mb_weights[mb][k] for mb in mbs],
                    bool(self.summed and self.summed[k]))
        home = NamedSharding(runs[loss_stage].mesh, PartitionSpec())
        for st in self.stages:
            for k in set(st.outputs.values()) & set(runner.per_sample):
                if outputs[k] is not None:  # the micro-batches' pieces, in their order
                    outputs[k] = stage_fns.joined(
                        [outputs[k][mb] for mb in sorted(outputs[k])], runner.per_sample[k],
                        NamedSharding(runs[st.index].mesh, PartitionSpec()))
        for st in self.stages:
            if st.index == loss_stage or not st.outputs:
                continue
            pos = sorted(st.outputs.values())
            src = NamedSharding(runs[st.index].mesh, PartitionSpec())
            if takes_part(src, home):
                got = transfer([outputs[k] for k in pos] if here(src) else None,
                               [avals[k] for k in pos], [src] * len(pos), [home] * len(pos))
                for k, x in zip(pos, got or [None] * len(pos), strict=True):
                    outputs[k] = x
        return outputs
