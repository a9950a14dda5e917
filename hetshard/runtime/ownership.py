"""Which pipeline stage updates which state leaf: the optimizer step checked separable.

Each stage applies the user's step to the state it owns, on its own submesh, with every
leaf it does not hold filled with zeros. That is exact only when every updated leaf
reads nothing but its own state, its own parameters' gradients, the loss and shared
leaves (step counters, updated identically everywhere): :func:`ownership` traces the
step's update once (its gradients and loss provided) and follows the dependencies of
each new leaf (``hetshard.ir.dependencies``). Leaves updated together (a parameter and
its optimizer moments) go to the first stage reading the parameter. An update coupled
across stages through small reductions only (a global-norm clip) runs with the stages
trading those (``hetshard.runtime.exchange``); any other coupled update across stages is
a :class:`PipelineSetupError` naming the leaves, and :func:`pipeline_obstacle` tells the
planner so before it plans.
"""

from __future__ import annotations

import dataclasses

import jax

from hetshard.errors import PipelineSetupError
from hetshard.ir.dependencies import output_dependencies
from hetshard.runtime.exchange import SMALL, CouplingError, Exchange, plan_exchange


@dataclasses.dataclass(frozen=True)
class Ownership:
    shared: list[int]  # state leaves every stage keeps and updates identically
    owner: list[dict[int, int]]  # per pipeline: state leaf -> the stage that updates it
    out_tree: object  # the step's outputs' treedef (besides the state)
    # per pipeline: the small values its stages trade in the update (None: nothing)
    exchanges: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Update:
    """The update's data flow: leaves kept and updated identically everywhere, the
    groups of state leaves updated together, and what stops a pipeline outright."""

    shared: set[int]
    comps: list[list[int]]
    output_problem: str | None


def _update_flow(deps, n_out: int, ns: int, grad_index, nl: int, nb: int, paths) -> _Update:
    """``deps``: per output of the traced update (its outputs, then each state leaf's new
    value), the inputs it reads: state (``ns``), gradients (of ``grad_index``), loss
    (``nl``) and batch (``nb``) leaves, in that order."""
    ng = len(grad_index)
    grad_of = {ns + k: grad_index[k] for k in range(ng)}
    # The loss's outputs and the batch's leaves the update reads reach every stage whole
    # (``Program.update_batch_reads``): what reads only them and shared state is shared.
    given = set(range(ns + ng, ns + ng + nl + nb))
    new = deps[n_out:]
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
        bad = [j for j in d if not (j in given or (j < ns and j in shared))]
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
    return _Update(shared, list(comps.values()), output_problem)


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
    ns, nl, nb = len(state_avals), len(loss_avals), len(batch_avals)
    flow = _update_flow(output_dependencies(traced), n_out, ns, grad_index, nl, nb, paths)
    staged = any(len(split.stages) > 1 for split in splits)
    try:
        if flow.output_problem and staged:
            raise PipelineSetupError(flow.output_problem)  # one stage owns every leaf
        owners = [_owner(flow, split, paths, diff) for split in splits]
        return Ownership(sorted(flow.shared), owners, out_tree, [None] * len(splits))
    except PipelineSetupError as err:
        # Coupled through small values only (a global-norm clip)? Then the stages trade
        # those (hetshard.runtime.exchange); else the first reason stands.
        if not staged:
            raise
        cut = _update_flow(output_dependencies(traced, small=SMALL), n_out, ns, grad_index,
                           nl, nb, paths)
        if cut.output_problem:
            raise
        try:
            owners = [_owner(cut, split, paths, diff) for split in splits]
            exchanges = [_exchange(traced, cut, owner, grad_index, n_out, ns, nl, nb)
                         if len(split.stages) > 1 else None
                         for owner, split in zip(owners, splits, strict=True)]
        except (PipelineSetupError, CouplingError):
            raise err from None
        exchanges = [e if e is not None and e.rounds else None for e in exchanges]
        if jax.process_count() > 1 and any(e is not None for e in exchanges):
            raise PipelineSetupError(f"{err} (stages trading the update's small values "
                                     f"run in one process only)") from None
        return Ownership(sorted(cut.shared), owners, out_tree, exchanges)


def _owner(flow: _Update, split, paths, diff) -> dict[int, int]:
    """State leaf -> the stage updating it: each group of leaves updated together goes
    to the first stage reading its parameters."""
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
                f"{sorted(stages)} (e.g. {names}); a cross-parameter transform that "
                f"needs more than a few scalars of every stage cannot be split. Use a "
                f"per-parameter optimizer or a single-stage plan (max_stages=1)")
        readers = [first[i] for i in members if i in first]
        stage = min(stages) if stages else (min(readers) if readers else 0)
        for i in members:
            owner[i] = stage
    return owner


def _exchange(traced, flow: _Update, owner, grad_index, n_out, ns, nl, nb) -> Exchange:
    """What the stages of one pipeline trade (``plan_exchange``): inputs are their
    owners' (shared leaves, the loss and the batch everyone's); outputs must be right
    on their owners (the step's outputs and shared leaves everywhere)."""
    shared = flow.shared
    inputs = ([None if i in shared else owner[i] for i in range(ns)]
              + [owner[i] for i in grad_index] + [None] * (nl + nb))
    outputs = [None] * n_out + [None if i in shared else owner[i] for i in range(ns)]
    return plan_exchange(traced, inputs, outputs)


def pipeline_obstacle(program) -> tuple[str, bool] | None:
    """Why plans with several pipeline stages cannot run ``program``'s step, and whether
    plans with several (single-stage) pipelines cannot either; None when both can. Its
    update couples parameters that different layers read through more than a few
    scalars (a global-norm clip is fine: the stages trade the norm), or it returns such
    a value of several layers' gradients: single-stage pipelines only. Its loss mixes
    samples (batch statistics; see ``hetshard.ir.samples``): one pipeline only, which
    runs the batch whole. (State the update computes from the batch, metrics of the
    labels, is computed from the whole batch on the stage that owns it.) Checked on
    the program before planning, so that the planner keeps to plans that run it."""
    if program.call is None:
        return None  # such steps are planned single-stage already
    if program.samples.coupling:  # only the whole batch at once gives its values
        return program.samples.coupling, True
    traced = program.update_jaxpr()
    ns = len(program.state_avals)
    nl = len(jax.tree.leaves(program.loss_jaxpr(2)[1]))
    nb = len(program.trees.batch_at(program.global_batch))
    if program.kind == "nnx":  # its outputs, then the new state
        n_out, remap = len(traced.jaxpr.outvars) - ns, None
    else:  # a pytree step returns its new state among its outputs
        _, mapping = program.state_outputs()
        taken = {m for m in mapping if m is not None}
        remap = ([k for k in range(len(traced.jaxpr.outvars)) if k not in taken], mapping)
        n_out = len(remap[0])

    def flow_of(small):
        deps = output_dependencies(traced, small)
        if remap is not None:
            outs, mapping = remap
            deps = [deps[k] for k in outs] + [
                deps[m] if m is not None else frozenset({i}) for i, m in enumerate(mapping)]
        return _update_flow(deps, n_out, ns, program.diff, nl, nb, program.paths)

    flow = flow_of(None)
    layer_of: dict[int, int] = {}
    for k, leaves in enumerate(program.layer_params(2)):
        for i in leaves:
            layer_of.setdefault(i, k)
    diff = set(program.diff)

    def coupling(flow) -> str | None:
        for members in flow.comps:
            layers = {layer_of[i] for i in members if i in diff and i in layer_of}
            if len(layers) > 1:
                names = sorted(program.paths[i] for i in members if i in diff)[:3]
                return (f"its optimizer update couples parameters of different layers "
                        f"(e.g. {names}) through more than a few scalars")
        return None

    why = flow.output_problem or coupling(flow)
    if why is None:
        return None
    # Coupled through small values only: the stages trade them, in one process, when the
    # finest split (a stage per layer) can; every coarser split then can too.
    cut = flow_of(SMALL)
    if cut.output_problem or coupling(cut) or jax.process_count() > 1 or remap is not None:
        return why, False
    stage = {}
    for members in cut.comps:
        found = [layer_of[i] for i in members if i in layer_of]
        for i in members:
            stage[i] = min(found) if found else 0
    try:
        _exchange(traced, cut, stage, program.diff, n_out, ns, nl, nb)
    except CouplingError as e:
        return f"{why} ({e})", False
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
