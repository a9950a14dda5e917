"""How a train step's arguments flatten to leaves and come back: the runtime's and the
tracer's tree plumbing, apart from what the step computes.

A :class:`StepTrees` is made once per :class:`hetshard.Program`: the step's non-batch
arguments (NNX objects, split to a graph and a state, or pytrees) flatten to state
leaves, the batch (one argument or several) to batch leaves. Both the program's own
tracing and the runtime's execution walk rebuild the step's arguments through it.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from hetshard.autodiff import LossCall, is_graph


@dataclasses.dataclass(frozen=True, eq=False)
class StepTrees:
    """The step's argument structure.

    ``kind``: ``"nnx"`` (NNX objects among the non-batch arguments: ``graphdef`` is
    their graph) or ``"tree"`` (pytrees); ``state_tree``/``batch_tree``: the treedefs of
    the flat state and batch leaves; ``batch_positions``: where the batch sits among the
    step's arguments; ``batch_avals``: the batch leaves' shapes at the traced size."""

    kind: str
    graphdef: object
    state_tree: object
    batch_tree: object
    batch_positions: tuple[int, ...]
    batch_avals: tuple[jax.ShapeDtypeStruct, ...]

    def merge(self, state_leaves) -> list:
        """The step's non-batch arguments rebuilt from flat state leaves."""
        tree = jax.tree.unflatten(self.state_tree, list(state_leaves))
        return list(nnx.merge(self.graphdef, tree) if self.kind == "nnx" else tree)

    @staticmethod
    def updated_state(objs) -> list:
        """Flat state leaves of NNX objects after the step changed them."""
        return jax.tree.leaves(nnx.state(tuple(objs)))

    def batch(self, batch_leaves):
        """The batch (as the step takes it) from flat batch leaves."""
        return jax.tree.unflatten(self.batch_tree, list(batch_leaves))

    def batch_at(self, mbs: int) -> list[jax.ShapeDtypeStruct]:
        """Batch leaf avals with ``mbs`` samples."""
        return [jax.ShapeDtypeStruct((mbs, *a.shape[1:]), a.dtype) for a in self.batch_avals]

    def batch_of(self, args):
        """The batch among the step's ``args``: the argument, or the tuple of them."""
        return batch_of(args, self.batch_positions)

    def with_batch(self, objs: list, batch) -> list:
        """``objs`` (the step's other arguments) with ``batch`` put at its positions."""
        pos = self.batch_positions
        for i, b in zip(pos, (batch,) if len(pos) == 1 else batch, strict=True):
            objs.insert(i, b)
        return objs

    def without_batch(self, objs: list) -> list:
        """The step's arguments ``objs`` without the batch."""
        for i in reversed(self.batch_positions):
            del objs[i]
        return objs

    def call(self, step, state_leaves, batch_leaves):
        """``step(*args)`` on flat leaves; returns (output, the objects after the step)."""
        objs = self.merge(state_leaves)
        out = step(*self.with_batch(objs, self.batch(batch_leaves)))
        return out, self.without_batch(objs)

    def gradients(self, call: LossCall, state_avals, grad_leaves):
        """Gradients in the structure the step's loss call (``call``) returns them."""
        kind, *rest = call.differentiated
        if kind == "state":
            return jax.tree.unflatten(rest[0], list(grad_leaves))
        target = self.merge(state_avals)[rest[0]]
        tree = (nnx.state(target, call.wrt) if self.kind == "nnx" and is_graph(target)
                else target)
        return jax.tree.unflatten(jax.tree.structure(tree), list(grad_leaves))


def batch_of(args, positions: tuple[int, ...]):
    """The batch among a step's ``args`` at ``positions`` (``batch_positions``): the
    argument, or the tuple of them."""
    return args[positions[0]] if len(positions) == 1 else tuple(args[i] for i in positions)
