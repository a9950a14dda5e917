"""How the step's loss treats its samples, asked of its traced jaxpr: whether a plan
may cut the batch (micro-batches, batch shares) and how the pieces' outputs then make
the whole batch's.

:class:`LossSamples` answers for one :class:`hetshard.Program` (``Program.samples``)
from the loss traced at 2 and 4 samples, with the analyses of
:mod:`hetshard.ir.samples`: what couples the samples (:attr:`LossSamples.coupling`),
which outputs are sums, masked means or per-sample values, and the weights of a cut
batch's pieces (:meth:`LossSamples.piece_weights`). The runtime reads these to run a
plan that cuts the batch; the planner to know whether it may.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np

from hetshard.errors import LossCallError
from hetshard.ir.samples import (
    batch_shaped_draw,
    denominator,
    equation_at,
    mixed_power_outputs,
    needed_inputs,
    normalized_outputs,
    per_sample_outputs,
    sample_coupling,
    summed_outputs,
    unfollowed,
)


class LossSamples:
    """The sample questions of one program's loss.

    Args:
      loss_jaxpr: ``n -> (closed jaxpr, output shape)``: the loss traced at ``n``
        samples on (state leaves, batch leaves); None for a step whose loss call is not
        seen (every answer is then empty: such a step runs its batch whole).
      n_state: how many state leaves come before the batch leaves.
      per_piece: ``batch_reductions="per_piece"`` (a balance loss of batch means taken
        per piece, not counted as coupling).
    """

    def __init__(self, loss_jaxpr: Callable[[int], tuple] | None, n_state: int,
                 per_piece: bool):
        self.loss_jaxpr = loss_jaxpr
        self.n_state = n_state
        self.per_piece = per_piece

    @functools.cached_property
    def coupling(self) -> str | None:
        """Why cutting the batch (micro-batches, batch shares) changes what the loss
        returns (it mixes samples, returns a maximum over the batch, draws random values
        shaped by the batch from a key not in it, or adds a sum over the samples to a
        mean or a penalty in one output: ``hetshard.ir.samples``), or None."""
        if self.loss_jaxpr is None:
            return None
        closed, _ = self.loss_jaxpr(2)
        batch = range(self.n_state, len(closed.jaxpr.invars))
        why = sample_coupling(closed, batch, per_piece=self.per_piece)
        if why:
            return why
        twin, _ = self.loss_jaxpr(4)
        drawn = batch_shaped_draw(closed, twin, batch)
        if drawn:
            return drawn
        mixed = mixed_power_outputs(closed, twin, 2.0, batch)
        if mixed:
            return (f"output {mixed[0]} of the loss adds a sum over the samples to a mean "
                    f"or to a term that reads no sample (a weight penalty): the pieces of "
                    f"a cut batch can be neither added (the other term would count once "
                    f"per piece) nor averaged (the sum would shrink); make it a mean over "
                    f"the samples (ce.mean() + penalty) or a sum alone to let the batch "
                    f"be cut")
        return None

    @functools.cached_property
    def gap(self) -> str | None:
        """Where ``hetshard.ir.samples`` could not follow how the loss treats its samples
        (a primitive and the user's line), or None: cutting the batch then weighs each
        piece's outputs by its share of the samples, as for a mean, unseen."""
        if self.loss_jaxpr is None:
            return None
        closed, _ = self.loss_jaxpr(2)
        return unfollowed(closed, range(self.n_state, len(closed.jaxpr.invars)))

    @functools.cached_property
    def summed_outputs(self) -> list[bool]:
        """Per flat output of the loss (the value, then the aux leaves), whether it is a
        sum over the samples (``ce.sum()``, a count of correct predictions) rather than a
        mean: plans that cut the batch add its pieces (and, for the loss, their
        gradients) instead of averaging them (``hetshard.ir.samples.summed_outputs``:
        read off the loss traced at 2 and 4 samples)."""
        return self._twins(summed_outputs) if self.loss_jaxpr is not None else []

    @functools.cached_property
    def normalized_outputs(self) -> list[tuple | None]:
        """Per flat output of the loss, where it is a masked mean (a sum over the
        samples divided by a count the batch alone gives: ``(ce * mask).sum() /
        mask.sum()``), the path of that count in the loss's jaxpr, else None: plans
        that cut the batch weight its pieces by their shares of the count
        (``piece_weights``; ``hetshard.ir.samples.normalized_outputs``)."""
        return self._twins(normalized_outputs) if self.loss_jaxpr is not None else []

    def _twins(self, analysis):
        """``analysis(loss at 2 samples, loss at 4, 2.0, the batch's inputs)``: what the
        loss traced at two batch sizes tells (``hetshard.ir.samples``)."""
        closed, _ = self.loss_jaxpr(2)
        twin, _ = self.loss_jaxpr(4)
        return analysis(closed, twin, 2.0, range(self.n_state, len(closed.jaxpr.invars)))

    def piece_weights(self, batch_leaves, pieces) -> np.ndarray:
        """Weights ``[piece, output]`` of the loss outputs' pieces when the global batch
        (``batch_leaves``) is cut into ``pieces`` (``(start, stop)`` sample ranges
        covering it): the whole batch's output is the weighted sum of the pieces' (and
        the loss's gradient likewise). A mean's piece weighs its share of the samples,
        a sum's 1 (``summed_outputs``), a masked mean's its share of the count
        (``normalized_outputs``; shares of the samples when the batch counts nothing)."""
        n_out = len(self.summed_outputs) or 1
        sizes = np.array([b - a for a, b in pieces], np.float64)
        w = np.repeat((sizes / sizes.sum())[:, None], n_out, axis=1)
        for k, summed in enumerate(self.summed_outputs):
            if summed:
                w[:, k] = 1.0
        normal = [(k, path) for k, path in enumerate(self.normalized_outputs) if path]
        if normal:
            counts = np.array([self._counts(batch_leaves, a, b, tuple(p for _, p in normal))
                               for a, b in pieces], np.float64)
            for j, (k, _) in enumerate(normal):
                total = counts[:, j].sum()
                if np.isfinite(total) and total != 0:
                    w[:, k] = counts[:, j] / total
        return w

    def _counts(self, batch_leaves, start: int, stop: int, paths: tuple) -> list[float]:
        """The masked means' counts (``normalized_outputs``) of samples
        ``[start, stop)``."""
        fn, used = self._count_fn(stop - start, paths)
        args = [np.asarray(batch_leaves[i][start:stop]) for i in used]
        return [float(np.sum(np.asarray(x))) for x in fn(*args)]

    @functools.lru_cache(maxsize=8)  # noqa: B019 (one program, a few piece sizes)
    def _count_fn(self, n: int, paths: tuple):
        """(jitted counts of a piece of ``n`` samples, the batch leaves they read)."""
        closed, _ = self.loss_jaxpr(n)
        ns = self.n_state
        invars = closed.jaxpr.invars
        for p in paths:
            eqn = equation_at(closed.jaxpr, p)
            if eqn is None or eqn.primitive.name != "reduce_sum":
                raise LossCallError(
                    f"the loss traced at {n} samples has another structure than at 2: "
                    f"the masked mean's count found at {p} is not there; hetshard cannot "
                    f"weight the pieces of a cut batch (plan with max_stages=1 and "
                    f"max_pipelines=1)")
        needed = set().union(*(needed_inputs(closed.jaxpr, p) for p in paths))
        used = [i - ns for i, v in enumerate(invars) if v in needed]

        def counts(*leaves):
            args = [None] * len(invars)
            for i, x in zip(used, leaves, strict=True):
                args[ns + i] = x
            return [denominator(closed, p, args) for p in paths]
        return jax.jit(counts), used

    @functools.cached_property
    def per_sample_outputs(self) -> dict[int, int]:
        """Outputs of the loss (flat: the value, then the aux leaves) that keep a value
        per sample (logits returned as aux), each with its samples' axis: plans that cut
        the batch concatenate their pieces along it, in the batch's order. Where the
        analysis (``hetshard.ir.samples``) cannot follow the loss, the outputs whose
        shape follows the batch size (traced at 2 and 4 samples)."""
        if self.loss_jaxpr is None:
            return {}
        closed, _ = self.loss_jaxpr(2)
        ns = self.n_state
        found = per_sample_outputs(closed, range(ns, len(closed.jaxpr.invars)))
        if found is not None:
            return found
        found = {}
        twin, _ = self.loss_jaxpr(4)
        for k, (a, b) in enumerate(zip(closed.jaxpr.outvars, twin.jaxpr.outvars,
                                       strict=True)):
            s2, s4 = a.aval.shape, b.aval.shape
            axes = [d for d in range(len(s2)) if (s2[d], s4[d]) == (2, 4)]
            if axes and all(s2[d] == s4[d] for d in range(len(s2)) if d != axes[0]):
                found[k] = axes[0]
        return found

    def outputs_for(self, avals, samples: int) -> list[jax.ShapeDtypeStruct]:
        """The loss's flat output ``avals`` for ``samples`` samples: a per-sample
        output's samples' axis that long (``per_sample_outputs``), the others as they
        are."""
        out = []
        for k, a in enumerate(avals):
            shape = list(a.shape)
            if k in self.per_sample_outputs:
                shape[self.per_sample_outputs[k]] = samples
            out.append(jax.ShapeDtypeStruct(tuple(shape), a.dtype))
        return out

