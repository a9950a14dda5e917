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


@dataclasses.dataclass(frozen=True)
class _Update:
    """The update's data flow: leaves kept and updated identically everywhere, the
    groups of state leaves updated together, and what stops a pipeline outright."""

    shared: set[int]
    comps: list[list[int]]
    batch_problem: str | None
    output_problem: str | None


def _update_flow(deps, n_out: int, ns: int, grad_index, nl: int, nb: int, paths) -> _Update:
    """``deps``: per output of the traced update (its outputs, then each state leaf's new
    value), the inputs it reads: state (``ns``), gradients (of ``grad_index``), loss
    (``nl``) and batch (``nb``) leaves, in that order."""
    ng = len(grad_index)
    grad_of = {ns + k: grad_index[k] for k in range(ng)}
    batch_inputs = set(range(ns + ng + nl, ns + ng + nl + nb))
    loss_inputs = set(range(ns + ng, ns + ng + nl))
    new = deps[n_out:]
    batch_problem = next((
        f"the step updates {paths[i]} from the batch outside hetshard.value_and_grad; "
        f"pipeline plans need the batch used only by the loss"
        for i, d in enumerate(new) if d & batch_inputs), None)
    shared = {i for i, d in enumerate(new) if not (d & set(grad_of))}
    changed = True
    while changed:
        changed = False
        for i in list(shared):
            if any(j < ns and j not in shared for j in new[i]):
                shared.discard(i)
                changed = True
    output_problem = None
    for k, d in enumerate(deps[:n_out]):
        bad = [j for j in d if not (j in loss_inputs or (j < ns and j in shared))]
        if bad:
            output_problem = (
                f"output {k} of the step reads {_input_name(paths, bad[0], ns, grad_of)} "
                f"(not only the loss); under a pipeline plan the step may return the loss "
                f"and aux of hetshard.value_and_grad, and values of shared scalars")
            break
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
    return _Update(shared, list(comps.values()), batch_problem, output_problem)


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
    flow = _update_flow(output_dependencies(traced), n_out, len(state_avals), grad_index,
                        len(loss_avals), len(batch_avals), paths)
    if flow.batch_problem:
        raise PipelineSetupError(flow.batch_problem)
    if flow.output_problem and any(len(split.stages) > 1 for split in splits):
        raise PipelineSetupError(flow.output_problem)  # one stage owns every leaf
    owners = []  # per pipeline: state leaf -> stage
    for split in splits:
        first: dict[int, int] = {}
        for st in split.stages:
            for i in st.params + st.frozen:
                first.setdefault(i, st.index)
        owner = {}
        for members in flow.comps:
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
    return Ownership(sorted(flow.shared), owners, out_tree)


def pipeline_obstacle(program) -> tuple[str, bool] | None:
    """Why plans with several pipeline stages cannot run ``program``'s step, and whether
    plans with several (single-stage) pipelines cannot either; None when both can. Its
    update couples parameters that different layers read (a global-norm clip: every
    stage would need every gradient), or it returns something computed from the
    gradients of several layers: single-stage pipelines only. It updates state from the
    batch outside the loss: one pipeline only. Checked on the program before planning,
    so that the planner keeps to plans that run it."""
    if program.call is None:
        return None  # such steps are planned single-stage already
    deps = output_dependencies(program.update_jaxpr())
    ns = len(program.state_avals)
    nl = len(jax.tree.leaves(program.loss_jaxpr(2)[1]))
    nb = len(program.batch_at(program.global_batch))
    if program.kind == "nnx":  # its outputs, then the new state
        outs, new = list(deps[:len(deps) - ns]), list(deps[len(deps) - ns:])
    else:  # a pytree step returns its new state among its outputs
        _, mapping = program.state_outputs()
        taken = {m for m in mapping if m is not None}
        outs = [d for k, d in enumerate(deps) if k not in taken]
        new = [deps[m] if m is not None else frozenset({i}) for i, m in enumerate(mapping)]
    flow = _update_flow(outs + new, len(outs), ns, program.diff, nl, nb, program.paths)
    if flow.batch_problem:
        return flow.batch_problem, True
    if flow.output_problem:
        return flow.output_problem, False
    layer_of: dict[int, int] = {}
    for k, leaves in enumerate(program.layer_params(2)):
        for i in leaves:
            layer_of.setdefault(i, k)
    diff = set(program.diff)
    for members in flow.comps:
        layers = {layer_of[i] for i in members if i in diff and i in layer_of}
        if len(layers) > 1:
            names = sorted(program.paths[i] for i in members if i in diff)[:3]
            return (f"its optimizer update couples parameters of different layers (e.g. "
                    f"{names}: a global-norm clip or another cross-parameter transform "
                    f"needs every gradient in one place)", False)
    return None


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
