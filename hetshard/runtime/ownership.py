"""Which pipeline stage updates which state leaf: the optimizer step checked separable.

Each stage applies the user's step to the state it owns, on its own submesh, with every
leaf it does not hold filled with zeros. That is exact only when every updated leaf
reads nothing but its own state, its own parameters' gradients, the loss and shared
leaves (step counters, updated identically everywhere): :func:`ownership` traces the
step's update once (its gradients and loss provided) and follows the dependencies of
each new leaf (``hetshard.ir.dependencies``). Leaves updated together (a parameter and
its optimizer moments) go to the first stage reading the parameter; a coupled update
across stages (a global-norm clip) is a :class:`PipelineSetupError` naming the leaves.
"""

from __future__ import annotations

import dataclasses

import jax

from hetshard.errors import HetshardError
from hetshard.ir.dependencies import output_dependencies


class PipelineSetupError(HetshardError, ValueError):
    """The step cannot run under this plan's pipelines (the message says why and what
    would work)."""


@dataclasses.dataclass(frozen=True)
class Ownership:
    shared: list[int]  # state leaves every stage keeps and updates identically
    owner: list[dict[int, int]]  # per pipeline: state leaf -> the stage that updates it
    out_tree: object  # the step's outputs' treedef (besides the state)


def ownership(apply, state_avals, grad_index, loss_avals, batch_avals, paths, diff,
              splits) -> Ownership:
    """The stage owning each state leaf per pipeline (``splits``: each pipeline's
    ``rewrite.pipeline`` split); ``apply(state, grads, loss, batch) -> (outputs, new
    state)`` is the user's step with its gradients and loss provided."""
    grad_avals = [state_avals[i] for i in grad_index]
    traced, out_shape = jax.make_jaxpr(apply, return_shape=True)(
        state_avals, grad_avals, loss_avals, batch_avals)
    out_tree = jax.tree.structure(out_shape[0])
    n_out = len(jax.tree.leaves(out_shape[0]))
    if len(jax.tree.leaves(out_shape[1])) != len(state_avals):
        raise PipelineSetupError("the step changes the structure of its state")
    deps = output_dependencies(traced)
    ns, ng, nl = len(state_avals), len(grad_avals), len(loss_avals)
    grad_of = {ns + k: grad_index[k] for k in range(ng)}
    batch_inputs = set(range(ns + ng + nl, ns + ng + nl + len(batch_avals)))
    loss_inputs = set(range(ns + ng, ns + ng + nl))
    new = deps[n_out:]
    for i, d in enumerate(new):
        if d & batch_inputs:
            raise PipelineSetupError(
                f"the step updates {paths[i]} from the batch outside "
                f"hetshard.value_and_grad; pipeline plans need the batch used only "
                f"by the loss")
    shared = {i for i, d in enumerate(new) if not (d & set(grad_of))}
    changed = True
    while changed:
        changed = False
        for i in list(shared):
            if any(j < ns and j not in shared for j in new[i]):
                shared.discard(i)
                changed = True
    for k, d in enumerate(deps[:n_out]):
        bad = [j for j in d if not (j in loss_inputs or (j < ns and j in shared))]
        if bad:
            raise PipelineSetupError(
                f"output {k} of the step reads "
                f"{_input_name(paths, bad[0], ns, grad_of)} (not only the loss); under a "
                f"pipeline plan the step may return the loss and aux of "
                f"hetshard.value_and_grad, and values of shared scalars")
    uf = _UnionFind()
    for i, d in enumerate(new):
        if i in shared:
            continue
        uf.find(i)
        for j in d:
            if j < ns and j not in shared:
                uf.union(i, j)
            elif j in grad_of:
                uf.union(i, grad_of[j])
    comps: dict = {}
    for i in range(ns):
        if i not in shared:
            comps.setdefault(uf.find(i), []).append(i)
    shared = sorted(shared)
    owners = []  # per pipeline: state leaf -> stage
    for split in splits:
        first: dict[int, int] = {}
        for st in split.stages:
            for i in st.params + st.frozen:
                first.setdefault(i, st.index)
        owner = {}
        for members in comps.values():
            stages = {first[i] for i in members if i in first and i in set(diff)}
            if len(stages) > 1:
                names = sorted({paths[i] for i in members if i in first})[:3]
                raise PipelineSetupError(
                    f"the optimizer update couples parameters of pipeline stages "
                    f"{sorted(stages)} (e.g. {names}); a global-norm clip or another "
                    f"cross-parameter transform needs all gradients in one place. Use a "
                    f"per-parameter optimizer or a single-stage plan (max_stages=1)")
            readers = [first[i] for i in members if i in first]
            stage = min(stages) if stages else (min(readers) if readers else 0)
            for i in members:
                owner[i] = stage
        owners.append(owner)
    return Ownership(shared, owners, out_tree)


class _UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b):
        self.parent[self.find(a)] = self.find(b)


def _input_name(paths, j, ns, grad_of) -> str:
    if j < ns:
        return paths[j]
    if j in grad_of:
        return f"the gradient of {paths[grad_of[j]]}"
    return f"input {j}"
