"""MPMD execution of any plan: pipelines of stages, each stage on its own submesh.

What one step does (``PipelineRunner.step``):

1. Each pipeline takes its batch share, cut into micro-batches.
2. Stage programs (``hetshard.rewrite.pipeline``) run forward and backward per
   micro-batch under the pipeline's schedule (1F1B, GPipe, interleaved 1F1B, or ZB-H1,
   whose backward runs as a B and a W pass: ``hetshard.rewrite.backward``), each jitted on its
   stage's mesh; activations go forward and cotangents back to the receiving stage's
   sharding (``hetshard.collectives.transfer``); each backward is seeded with ``mbs / global_batch``
   so the summed gradients are the global-batch mean gradient (the loss must be a mean
   over samples); gradients accumulate per stage over micro-batches.
3. A parameter read by several stages of a pipeline (tied embeddings) has its
   gradients added at the stage that owns it; across pipelines the owners' gradients
   are summed (``hetshard.collectives``: a ``shard_map`` all-reduce when the holders'
   meshes are congruent, transfers otherwise). A stage whose GPU type computes in
   another dtype (``Plan.gpu_dtypes``) runs under an autocast, and while one computes in
   float16 the loss is scaled dynamically (``hetshard.runtime.precision``).
4. Each stage applies the user's step (the optimizer update) to the state it owns, on
   its own submesh: the step is traced with the gradients and loss provided to
   ``hetshard.value_and_grad`` and every leaf the stage does not hold filled with zeros,
   which is exact because the step was checked to be separable (``_ownership``): every
   updated leaf reads only its own state, its own parameters' gradients, the loss and
   shared leaves (step counters), never another stage's. Shared leaves are kept on
   every stage and updated identically everywhere.

Dispatch is asynchronous: the host enqueues every task of the step in schedule order
and only the caller's loss check waits for the result.

Across ``jax.distributed`` processes every process walks the same schedule: it runs the
tasks of the stages on its devices (a stage whose mesh spans processes runs on each of
them) and joins each transfer into or out of them, so every pair of processes issues
its cross-process collectives in the same order. The state handed back holds real
arrays for the leaves this process's stages own and data-less global arrays for the
others.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetshard.autodiff import all_finite, entered
from hetshard.collectives import (
    congruent,
    empty,
    here,
    sum_across,
    sum_across_collective,
    takes_part,
    transfer,
)
from hetshard.errors import HetshardError, SpecError
from hetshard.ir.dependencies import output_dependencies
from hetshard.ir.program import Program
from hetshard.plan import Plan
from hetshard.rewrite.backward import input_backward, weight_backward
from hetshard.rewrite.pipeline import StageSplitError, remat_wrap, split_stages
from hetshard.rewrite.spmd import stage_sequence_layouts
from hetshard.runtime.precision import DynamicLossScale, stage_autocast
from hetshard.runtime.spmd import leaf_spec, mesh_of
from hetshard.sim.schedule import schedule_walk

_all_finite = jax.jit(all_finite)


class PipelineSetupError(HetshardError, ValueError):
    """The step cannot run under this plan's pipelines (the message says why and what
    would work)."""


def _batch_axes(mesh: Mesh) -> tuple:
    return tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)


def activation_sharding(shape, mesh: Mesh, mbs: int, seq_len: int | None = None
                        ) -> NamedSharding:
    """Micro-batch values are split over the stage's data axes when their leading
    dimension is the micro-batch and divides evenly, and replicated otherwise; on a stage
    with a ``context`` axis, values ``[micro-batch, seq_len, ...]`` (token arrays,
    boundary activations) are also split along their sequence over it."""
    axes = _batch_axes(mesh)
    ways = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    batch = axes if axes and len(shape) and shape[0] == mbs and mbs % ways == 0 else None
    cp = mesh.shape.get("context", 1)
    if cp > 1 and seq_len and len(shape) >= 2 and shape[0] == mbs and \
            shape[1] == seq_len and seq_len % cp == 0:
        return NamedSharding(mesh, PartitionSpec(batch, "context"))
    return NamedSharding(mesh, PartitionSpec(batch) if batch else PartitionSpec())


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


@dataclasses.dataclass
class _StageRun:
    """One (pipeline, stage): its program, mesh, jitted functions and the state it holds."""

    program: object
    mesh: Mesh
    remat: str
    owned: list[int]  # state leaves it updates
    local: list[int]  # state leaves it holds: owned + shared + read copies
    shardings: dict  # state leaf -> NamedSharding on this mesh
    here: bool = True  # this process holds a device of the mesh (runs its tasks)
    fwd: Callable = None
    bwd: Callable = None
    bwd_input: Callable = None  # ZB-H1's B pass
    bwd_weight: Callable = None  # ZB-H1's W pass
    apply: Callable = None


class PipelineRunner:
    """Runs a step under ``plan`` (see the module docstring); ``program`` is the step with
    its arguments (``hetshard.ir.program.Program``)."""

    def __init__(self, plan: Plan, devices, program: Program):
        if program.call is None:
            raise PipelineSetupError("pipeline plans need a step that calls "
                                     "hetshard.value_and_grad (or plan with max_stages=1)")
        self.plan, self.program = plan, program
        self.state_tree, self.paths = program.state_tree, program.paths
        self.state_avals = program.state_avals
        self.batch_tree, self.batch_avals = program.batch_tree, program.batch_avals
        self.global_batch = program.global_batch
        self._check_batch()
        self.grad_index = list(program.diff)
        self.diff = sorted(set(self.grad_index))
        self.splits = [self._split(p) for p in plan.pipelines]
        self.meshes = [[mesh_of(s, devices) for s in p.stages] for p in plan.pipelines]
        self.loss_out_avals = None
        self._ownership()
        self.runs = [[self._stage_run(pi, si) for si in range(len(p.stages))]
                     for pi, p in enumerate(plan.pipelines)]
        if not any(r.here for row in self.runs for r in row):
            raise PipelineSetupError(
                f"process {jax.process_index()} holds no device of the plan's stages; in a "
                f"multi-process job every process must run at least one stage (plan for "
                f"Cluster.from_jax_devices() or bind the spec's groups to every process)")
        # The stage computing the loss, per pipeline (the outputs' home).
        self.loss_stage = [max(st.index for st in split.stages if st.outputs)
                           for split in self.splits]
        self.views = None  # per (pipeline, stage): leaf -> array
        self.published: list | None = None
        # float16 stages: the loss scale (None: gradients unscaled)
        self.loss_scale = DynamicLossScale() if plan.loss_scaled else None
        # Per (pipeline, stage), seconds busy in the last step when timed (``timing``),
        # and injected delays per task (a straggler stand-in on fake devices).
        self.clock: dict | None = None
        self.delays: dict = {}

    def state_of(self, others):
        """The step's non-batch arguments as flat state (what ``step`` takes)."""
        return nnx.state(others) if self.program.kind == "nnx" else others

    # ---- set-up ----------------------------------------------------------------------
    def _check_batch(self):
        plan, b = self.plan, self.global_batch
        if plan.global_batch != b:
            raise SpecError("batch", f"leading dimension {b}",
                            f"the plan's global batch {plan.global_batch} "
                            f"(pipeline shares {[p.batch_share for p in plan.pipelines]})",
                            where="hetshard.jit")
        for p in plan.pipelines:
            if p.batch_share % p.num_micro_batches:
                raise SpecError("plan.pipelines", f"batch share {p.batch_share}",
                                f"a multiple of its {p.num_micro_batches} micro-batches")

    def _split(self, pipeline):
        mbs = _samples_per_micro_batch(pipeline)
        mb_avals = self.program.batch_at(mbs)
        ranges = [(s.start, s.end) for s in pipeline.stages]
        try:
            return split_stages(self.program.loss_flat, self.state_avals, mb_avals, ranges,
                                self.diff, attention=self.plan.attention,
                                split_blocks=self.plan.split_blocks)
        except StageSplitError as e:
            raise PipelineSetupError(str(e)) from None

    def _apply_fn(self):
        """The user's step as a function of flat leaves, value_and_grad provided:
        ``(outputs, new state leaves)``. An NNX step's state is its objects after the
        step; a pytree step's is read from its outputs (``Program.state_outputs``), and
        ``outputs`` are its other output leaves."""
        program = self.program

        def apply(state_leaves, grad_leaves, loss_leaves, batch_leaves):
            grads = program.gradient_tree(grad_leaves)
            value = jax.tree.unflatten(self._loss_tree, loss_leaves)
            with entered(mode="provide", provided=(value, grads)):
                out, objs = program.call_step(state_leaves, batch_leaves)
            if program.kind == "nnx":
                return out, program.updated_state(objs)
            _, outputs = program.state_outputs()
            leaves = jax.tree.leaves(out)
            new = [state_leaves[i] if m is None else leaves[m] for i, m in enumerate(outputs)]
            taken = {m for m in outputs if m is not None}
            return [x for k, x in enumerate(leaves) if k not in taken], new
        return apply

    def full_output(self, out, new_state_leaves):
        """A pytree step's whole output: its other outputs with the new state put back."""
        if self.program.kind == "nnx":
            return out
        tree, outputs = self.program.state_outputs()
        leaves: list = [None] * tree.num_leaves
        for i, m in enumerate(outputs):
            if m is not None:
                leaves[m] = new_state_leaves[i]
        it = iter(out)
        leaves = [next(it) if x is None else x for x in leaves]
        return jax.tree.unflatten(tree, leaves)

    def _ownership(self):
        """Which stage of each pipeline updates which state leaf (module docstring, 4)."""
        closed = self.splits[0].closed
        self._loss_tree = self.splits[0].out_tree
        loss_avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                      for v in closed.jaxpr.outvars]
        self.loss_out_avals = loss_avals
        grad_avals = [self.state_avals[i] for i in self.grad_index]
        apply = self._apply_fn()
        traced, out_shape = jax.make_jaxpr(apply, return_shape=True)(
            self.state_avals, grad_avals, loss_avals, self.batch_avals)
        self._out_tree = jax.tree.structure(out_shape[0])
        n_out = len(jax.tree.leaves(out_shape[0]))
        if len(jax.tree.leaves(out_shape[1])) != len(self.state_avals):
            raise PipelineSetupError("the step changes the structure of its state")
        deps = output_dependencies(traced)
        ns, ng, nl = len(self.state_avals), len(grad_avals), len(loss_avals)
        grad_of = {ns + k: self.grad_index[k] for k in range(ng)}
        batch_inputs = set(range(ns + ng + nl, ns + ng + nl + len(self.batch_avals)))
        loss_inputs = set(range(ns + ng, ns + ng + nl))
        new = deps[n_out:]
        for i, d in enumerate(new):
            if d & batch_inputs:
                raise PipelineSetupError(
                    f"the step updates {self.paths[i]} from the batch outside "
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
                    f"{self._input_name(bad[0], ns, grad_of)} (not only the loss); under a "
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
        self.shared = sorted(shared)
        self.owner = []  # per pipeline: state leaf -> stage
        for split in self.splits:
            first: dict[int, int] = {}
            for st in split.stages:
                for i in st.params + st.frozen:
                    first.setdefault(i, st.index)
            owner = {}
            for members in comps.values():
                stages = {first[i] for i in members if i in first and i in set(self.diff)}
                if len(stages) > 1:
                    names = sorted({self.paths[i] for i in members if i in first})[:3]
                    raise PipelineSetupError(
                        f"the optimizer update couples parameters of pipeline stages "
                        f"{sorted(stages)} (e.g. {names}); a global-norm clip or another "
                        f"cross-parameter transform needs all gradients in one place. Use a "
                        f"per-parameter optimizer or a single-stage plan (max_stages=1)")
                readers = [first[i] for i in members if i in first]
                stage = min(stages) if stages else (min(readers) if readers else 0)
                for i in members:
                    owner[i] = stage
            self.owner.append(owner)

    def _input_name(self, j, ns, grad_of):
        if j < ns:
            return self.paths[j]
        if j in grad_of:
            return f"the gradient of {self.paths[grad_of[j]]}"
        return f"input {j}"

    def _stage_run(self, pi, si) -> _StageRun:
        pipeline = self.plan.pipelines[pi]
        stage, program = pipeline.stages[si], self.splits[pi].stages[si]
        mesh = self.meshes[pi][si]
        owned = sorted(i for i, s in self.owner[pi].items() if s == si)
        local = sorted(set(owned) | set(self.shared) | set(program.params) |
                       set(program.frozen))
        specs = {name: tuple(spec) for name, spec in stage.shardings}
        # ZeRO-1: leaves that are not parameters (the optimizer's state) split over data.
        zero1 = self.plan.distributed_optimizer
        params = set(self.grad_index)
        shardings = {i: NamedSharding(mesh, leaf_spec(
            self.paths[i], self.state_avals[i].shape, specs, mesh,
            shard_data=zero1 and i not in params)) for i in local}
        run = _StageRun(program, mesh, stage.remat, owned, local, shardings,
                        here=here(NamedSharding(mesh, PartitionSpec())))
        # Sequence parallelism inside the stage (as the simulator prices its memory); a
        # context axis splits the sequence instead (not combined, as on SPMD stages).
        invars = self.splits[pi].closed.jaxpr.invars
        layouts = {} if stage.axis("context") > 1 else stage_sequence_layouts(
            self.splits[pi].closed, program.eqns,
            {invars[i]: tuple(shardings[i].spec) for i in program.params + program.frozen},
            mesh, overlap=self.plan.tp_overlap)
        run.fwd = _Forward(functools.partial(_forward, program, stage.remat,
                                             stage.remat_layers, mesh, layouts,
                                             stage_autocast(self.plan, stage),
                                             self.plan.context_chunks(stage) or None),
                           program.cast_params)
        run.bwd = jax.jit(functools.partial(_backward, program))
        run.bwd_input = jax.jit(functools.partial(_backward_input, program))
        run.bwd_weight = jax.jit(functools.partial(_backward_weight, program))
        run.apply = jax.jit(self._stage_apply(run, pi))
        return run

    def _stage_apply(self, run: _StageRun, pi: int):
        apply = self._apply_fn()
        owned, shared = run.owned, self.shared
        grad_pos = {i: k for k, i in enumerate(self.grad_index)}
        owned_params = [i for i in owned if i in grad_pos]

        def fn(owned_vals, shared_vals, grad_vals, loss_leaves, inv_scale):
            leaves = [jnp.zeros(a.shape, a.dtype) for a in self.state_avals]
            for i, v in zip(owned, owned_vals, strict=True):
                leaves[i] = v
            for i, v in zip(shared, shared_vals, strict=True):
                leaves[i] = v
            grads = [jnp.zeros(self.state_avals[i].shape, self.state_avals[i].dtype)
                     for i in self.grad_index]
            for i, g in zip(owned_params, grad_vals, strict=True):
                grads[grad_pos[i]] = g * jnp.asarray(inv_scale, g.dtype)  # loss scale
            batch = [jnp.zeros(a.shape, a.dtype) for a in self.batch_avals]
            out, new = apply(leaves, grads, loss_leaves, batch)
            # The state keeps its layout across steps (under ZeRO-1 the update runs on
            # each data way's optimizer shard and the parameters are all-gathered).
            keep = [jax.lax.with_sharding_constraint(new[i], run.shardings[i])
                    for i in owned + shared]
            return out, keep[:len(owned)], keep[len(owned):]
        run.owned_params = owned_params
        return fn

    # ---- state -----------------------------------------------------------------------
    def _distribute(self, leaves):
        self.views = []
        for stages in self.runs:
            self.views.append([
                {i: jax.device_put(leaves[i], run.shardings[i]) for i in run.local}
                if run.here else None for run in stages])

    def _publish(self, views) -> list:
        """Per state leaf, the array this process hands back to the caller: the owning
        stage's copy from the first pipeline that runs it here, else a copy another
        stage here holds (kept equal to the owner's), else a view without local data of
        the owner's copy in another process."""
        published = []
        for i, aval in enumerate(self.state_avals):
            found = None
            for pi, stages in enumerate(self.runs):
                o = self.owner[pi].get(i)
                if o is not None and stages[o].here:
                    found = views[pi][o][i]
                    break
            if found is None:
                found = next((views[pi][si][i] for pi, stages in enumerate(self.runs)
                              for si, run in enumerate(stages)
                              if run.here and i in run.local), None)
            if found is None:
                o = self.owner[0].get(i, 0)
                found = empty(aval, self.runs[0][o].shardings[i])
            published.append(found)
        return published

    # ---- one step --------------------------------------------------------------------
    def step(self, state, batch, may_apply) -> object:
        """One step on every process (each runs the tasks of its own stages and joins
        the transfers that touch them); returns (the step's output, the new state or
        None when ``may_apply(output, finite, loss)`` refused the update: ``finite`` says
        whether the loss and every gradient are finite, on every process)."""
        if self.clock is not None:
            self.clock = {}
        leaves = jax.tree.leaves(state)
        if self.published is None or len(leaves) != len(self.published) or any(
                a is not b for a, b in zip(leaves, self.published, strict=True)):
            self._distribute(leaves)
        batch_leaves = jax.tree.leaves(batch)
        grads, losses = [], []
        start = 0
        scale = self.loss_scale.scale if self.loss_scale is not None else 1.0
        for pi, p in enumerate(self.plan.pipelines):
            g, loss = self._run_pipeline(pi, p, batch_leaves, start, scale)
            grads.append(g)
            losses.append(loss)
            start += p.batch_share
        grads = self._sync(grads)
        loss = self._combine_losses(losses)
        new_views, out = [], None
        for pi, stages in enumerate(self.runs):
            row = []
            for si, run in enumerate(stages):
                lv = self._loss_to(loss, run.mesh)
                if not run.here:
                    row.append(None)
                    continue
                view = self.views[pi][si]
                o, owned, shared = run.apply([view[i] for i in run.owned],
                                             [view[i] for i in self.shared],
                                             [grads[pi][si][i] for i in run.owned_params], lv,
                                             1.0 / scale)
                if out is None:
                    out = o
                new = dict(view)
                new.update(zip(run.owned, owned, strict=True))
                new.update(zip(self.shared, shared, strict=True))
                row.append(new)
            new_views.append(row)
        grads_ok, loss_ok = self._finite(grads, loss)
        if self.loss_scale is not None and self.loss_scale.overflowed(grads_ok, loss_ok):
            return self.full_output(out, leaves), None  # skipped, at a smaller scale
        if not may_apply(out, grads_ok and loss_ok, self._loss_value(loss)):
            # The update is refused: a pytree step's output carries the state it had.
            return self.full_output(out, leaves), None
        # Read copies (tied weights, frozen leaves held elsewhere) follow their owners.
        for pi, stages in enumerate(self.runs):
            for si, run in enumerate(stages):
                moves: dict[int, list[int]] = {}
                for i in run.local:
                    o = self.owner[pi].get(i)
                    if o is not None and o != si:
                        moves.setdefault(o, []).append(i)
                for o, idx in moves.items():
                    home = stages[o]
                    srcs = [home.shardings[i] for i in idx]
                    dsts = [run.shardings[i] for i in idx]
                    if not takes_part(srcs[0], dsts[0]):
                        continue
                    got = transfer([new_views[pi][o][i] for i in idx] if home.here else None,
                                   [self.state_avals[i] for i in idx], srcs, dsts)
                    if got is not None:
                        new_views[pi][si].update(zip(idx, got, strict=True))
        self.views = new_views
        self.published = self._publish(new_views)
        return (self.full_output(out, self.published),
                jax.tree.unflatten(self.state_tree, self.published))

    def _run_pipeline(self, pi, pipeline, batch_leaves, start, scale=1.0):
        """Every process walks the same schedule; it runs its own stages' tasks and joins
        the transfers into or out of them; the loss's cotangent is seeded with ``scale``
        times the micro-batch's weight (gradients come back scaled)."""
        runs = self.runs[pi]
        n, m = len(runs), pipeline.num_micro_batches
        mbs = _samples_per_micro_batch(pipeline)
        weight = mbs / self.global_batch
        producer, readers = {}, {}
        for st in self.splits[pi].stages:
            for v in st.sends:
                producer[v] = st.index
            for v in st.recvs:
                readers[v] = readers.get(v, 0) + 1
        unread = [dict(readers) for _ in range(m)]  # a sent value is dropped once read
        values: list[dict] = [{} for _ in range(m)]
        cts: list[dict] = [{} for _ in range(m)]
        vjps: dict = {}
        acc: list = [None] * n
        loss_acc: dict = {}

        def act(v, mesh):
            return activation_sharding(v.aval.shape, mesh, mbs, self.plan.seq_len)

        def move(variables, src, dst, have):
            """Moves activations (or cotangents) of ``variables`` from stage ``src`` to
            stage ``dst``; ``have`` gives the source values (read only where src runs)."""
            a, b = runs[src], runs[dst]
            srcs = [act(v, a.mesh) for v in variables]
            dsts = [act(v, b.mesh) for v in variables]
            if not variables or not takes_part(srcs[0], dsts[0]):
                return None
            return transfer(have() if a.here else None,
                            [v.aval for v in variables], srcs, dsts)

        def clocked(s, f):
            """``f()``; timed (to its results) when the step is timed, plus any delay
            injected for stage ``s``."""
            if self.clock is None:
                return f()
            t0 = time.perf_counter()
            out = jax.block_until_ready(f())
            if self.delays.get((pi, s)):
                time.sleep(self.delays[pi, s])
            self.clock[pi, s] = self.clock.get((pi, s), 0.0) + time.perf_counter() - t0
            return out

        def forward(s, mb):
            run, st = runs[s], runs[s].program
            by_producer: dict[int, list] = {}
            for v in st.recvs:
                by_producer.setdefault(producer[v], []).append(v)
            recvd = {}
            for p, vs in by_producer.items():
                got = move(vs, p, s, lambda vs=vs: [values[mb][v] for v in vs])
                if got is not None:
                    recvd.update(zip(vs, got, strict=True))
                for v in vs:
                    unread[mb][v] -= 1
                    if not unread[mb][v]:
                        values[mb].pop(v, None)
            if not run.here:
                return
            lo = start + mb * mbs
            view = self.views[pi][s]
            batch = [jax.device_put(np.asarray(batch_leaves[i][lo:lo + mbs])
                                    if isinstance(batch_leaves[i], np.ndarray)
                                    else batch_leaves[i][lo:lo + mbs],
                                    activation_sharding(
                                        (mbs, *np.shape(batch_leaves[i])[1:]), run.mesh, mbs,
                                        self.plan.seq_len))
                     for i in st.batch]
            fo, oo, vjp = clocked(s, lambda: run.fwd([view[i] for i in st.params],
                                                     [view[i] for i in st.frozen], batch,
                                                     [recvd[v] for v in st.recvs]))
            vjps[s, mb] = vjp
            outs = [None] * len(st.sends)
            for j, x in zip(st.diff_sends, fo, strict=True):
                outs[j] = x
            rest = iter(oo)
            for j in range(len(st.sends)):
                if outs[j] is None:
                    outs[j] = next(rest)
            for j, (v, x) in enumerate(zip(st.sends, outs, strict=True)):
                if unread[mb].get(v):
                    values[mb][v] = x
                if j in st.outputs:
                    pos = st.outputs[j]
                    loss_acc[pos] = _accumulate(loss_acc.get(pos), x, weight)

        def backward(s, mb):
            run, st = runs[s], runs[s].program
            rc = None
            if run.here:
                incoming = []
                for j in st.diff_sends:
                    parts = cts[mb].pop(st.sends[j], [])
                    incoming.append(functools.reduce(jnp.add, parts) if parts else None)
                seeds = [weight * scale if st.outputs.get(j) == 0 else None
                         for j in st.diff_sends]
                if split and not st.diff_recvs:
                    # ZB-H1 on a stage with no input cotangent to send (the first): its
                    # whole backward runs as W, as the simulator times it, so nothing
                    # computed in B waits for W.
                    pending[s, mb] = (vjps.pop((s, mb)), incoming, seeds)
                    rc = []
                elif split:  # ZB-H1: the input's cotangent now, the weights' at the W pass
                    vjp = vjps.pop((s, mb))
                    rc, seeded, carried = clocked(
                        s, lambda: run.bwd_input(vjp, incoming, seeds))
                    pending[s, mb] = (vjp, seeded, carried)
                else:
                    acc[s], rc = clocked(s, lambda: run.bwd(vjps.pop((s, mb)), incoming,
                                                            seeds, acc[s]))
                rc = dict(zip((st.recvs[i] for i in st.diff_recvs), rc, strict=True))
            by_producer: dict[int, list] = {}
            for i in st.diff_recvs:
                by_producer.setdefault(producer[st.recvs[i]], []).append(st.recvs[i])
            for p, vs in by_producer.items():
                got = move(vs, s, p, lambda vs=vs: [rc[v] for v in vs])
                if got is not None:
                    for v, c in zip(vs, got, strict=True):
                        cts[mb].setdefault(v, []).append(c)

        def weights(s, mb):
            if not runs[s].here:
                return
            if runs[s].program.diff_recvs:
                acc[s] = clocked(s, lambda: runs[s].bwd_weight(*pending.pop((s, mb)), acc[s]))
            else:
                acc[s], _ = clocked(s, lambda: runs[s].bwd(*pending.pop((s, mb)), acc[s]))

        split = pipeline.schedule == "zbh1"
        pending: dict = {}
        task = {"F": forward, "B": backward, "W": weights}
        for s, kind, mb in schedule_walk(pipeline.schedule, n, m, pipeline.virtual_stages,
                                         pipeline.extra_warmup):
            task[kind](s, mb)
        for run in runs:
            run.fwd.release()  # the step's casts (the vjps that read them are gone)
        # Tied parameters: gradients of read copies go to the owning stage.
        grads = [dict(zip(runs[s].program.params, acc[s], strict=True)) if runs[s].here
                 else dict.fromkeys(runs[s].program.params) for s in range(n)]
        owner = self.owner[pi]
        for s in range(n):
            for i in list(runs[s].program.params):
                o = owner.get(i, s)
                if o == s:
                    continue
                g = grads[s].pop(i)
                src, dst = runs[s].shardings[i], runs[o].shardings[i]
                moved = (transfer([g] if runs[s].here else None, [self.state_avals[i]],
                                  [src], [dst]) if takes_part(src, dst) else None)
                if runs[o].here:
                    held = grads[o].get(i)
                    grads[o][i] = moved[0] if held is None else _add(held, moved[0])
                else:
                    grads[o].setdefault(i, None)
        outputs = [loss_acc.get(k) for k in range(len(self.loss_out_avals))]
        home = NamedSharding(runs[self.loss_stage[pi]].mesh, PartitionSpec())
        for st in self.splits[pi].stages:  # outputs computed before the loss stage
            if st.index == self.loss_stage[pi] or not st.outputs:
                continue
            pos = sorted(st.outputs.values())
            src = NamedSharding(runs[st.index].mesh, PartitionSpec())
            if takes_part(src, home):
                got = transfer([outputs[k] for k in pos] if here(src) else None,
                               [self.loss_out_avals[k] for k in pos],
                               [src] * len(pos), [home] * len(pos))
                for k, x in zip(pos, got or [None] * len(pos), strict=True):
                    outputs[k] = x
        return grads, outputs

    def _sync(self, grads):
        """Sums each parameter's gradient over the pipelines (module docstring, 3)."""
        if len(grads) == 1:
            return grads
        groups: dict = {}
        for i in self.diff:
            holders = tuple(self.owner[pi].get(i, 0) for pi in range(len(grads)))
            if all(i in grads[pi][s] for pi, s in enumerate(holders)):
                groups.setdefault(holders, []).append(i)
        for holders, leaves in groups.items():
            runs = [self.runs[pi][s] for pi, s in enumerate(holders)]
            if not any(r.here for r in runs):
                continue
            copies = [[grads[pi][s][i] for i in leaves] if runs[pi].here else None
                      for pi, s in enumerate(holders)]
            layouts = [[r.shardings[i] for i in leaves] for r in runs]
            avals = [self.state_avals[i] for i in leaves]
            fast = [j for j in range(len(leaves)) if congruent([lay[j] for lay in layouts])]
            slow = [j for j in range(len(leaves)) if j not in set(fast)]
            for idx, fn in ((fast, sum_across_collective), (slow, sum_across)):
                if not idx:
                    continue
                summed = fn([None if c is None else [c[j] for j in idx] for c in copies],
                            [[lay[j] for j in idx] for lay in layouts], [avals[j] for j in idx])
                for pi, s in enumerate(holders):
                    if summed[pi] is not None:
                        for j, x in zip(idx, summed[pi], strict=True):
                            grads[pi][s][leaves[j]] = x
        return grads

    def _loss_home(self, pi: int) -> NamedSharding:
        return NamedSharding(self.runs[pi][self.loss_stage[pi]].mesh, PartitionSpec())

    def _finite(self, grads, loss) -> tuple[bool, bool]:
        """Whether every gradient, and the combined loss, are finite (all processes
        agree: each checks the stages it runs)."""
        flags = [_all_finite(list(grads[pi][si].values()))
                 for pi, stages in enumerate(self.runs) for si, run in enumerate(stages)
                 if run.here and grads[pi][si]]
        ok = np.asarray([all(bool(f) for f in flags),
                         loss is None or bool(_all_finite(loss[:1]))])
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            ok = np.all(multihost_utils.process_allgather(ok), axis=0)
        return bool(ok[0]), bool(ok[1])

    def _loss_value(self, loss) -> float:
        """The combined loss as one number (NaN in a process without it)."""
        if loss is None:
            return float("nan")
        x = loss[0]
        x = x.addressable_data(0) if isinstance(x, jax.Array) else x  # replicated
        return float(np.mean(np.asarray(x, np.float32)))

    def _combine_losses(self, losses):
        """The loss outputs summed over pipelines, on pipeline 0's loss stage (None in a
        process without it)."""
        avals, home = self.loss_out_avals, self._loss_home(0)
        total = list(losses[0]) if here(home) else None
        for pi in range(1, len(losses)):
            src = self._loss_home(pi)
            if not takes_part(src, home):
                continue
            moved = transfer(list(losses[pi]) if here(src) else None, avals,
                             [src] * len(avals), [home] * len(avals))
            if total is not None:
                total = [_add(a, b) for a, b in zip(total, moved, strict=True)]
        return total

    def _loss_to(self, loss, mesh):
        """The combined loss replicated on ``mesh`` (None where this process lacks it)."""
        home, dst = self._loss_home(0), NamedSharding(mesh, PartitionSpec())
        if not takes_part(home, dst):
            return None
        k = len(self.loss_out_avals)
        return transfer(loss, self.loss_out_avals, [home] * k, [dst] * k)


def _samples_per_micro_batch(pipeline) -> int:
    """Samples in one micro-batch of the pipeline (the plan's ``micro_batch_size`` is per
    data-parallel replica of a stage)."""
    return pipeline.batch_share // pipeline.num_micro_batches


# ---- jitted stage functions -----------------------------------------------------------

def _forward(program, remat, remat_layers, mesh, layouts, autocast, chunks, params, frozen,
             batch, recvs):
    """The stage's forward on its ``mesh`` with its sequence-parallel ``layouts``,
    ``autocast`` (``stage_autocast``) and uneven context ``chunks`` for attention
    (``Plan.context_chunks``); under a remat each of its first ``remat_layers`` layers
    (None: all) is checkpointed on its own, so the backward recomputes one layer at a
    time."""
    wrap = remat_wrap(remat)
    return program.forward(params, frozen, batch, recvs,
                           remat=None if wrap is None else (wrap, remat_layers), mesh=mesh,
                           constrain=layouts, autocast=autocast, chunk_lengths=chunks)


class _Forward:
    """A stage's jitted forward whose vjp holds no copies of the stage's parameters.

    A jitted function's outputs are new buffers even when they are its inputs, so a
    vjp returned from ``jax.jit`` would hold a copy of every parameter its backward
    reads as is (what ``jax.checkpoint`` saves of a layer, a matmul's weight read
    without a cast): one per micro-batch in flight. Those residuals are left out of the
    jitted outputs and put back from the caller's arrays. Which residuals they are is
    fixed by the arguments' shapes and dtypes, read when the function is traced for
    them. Parameters the stage
    reads only through a cast (``casts``: position -> dtype; the compute-dtype copy of
    a float32 weight) are cast once per step, outside, so the micro-batches' vjps share
    that copy instead of keeping one each (their gradients come back in the cast dtype;
    ``_backward`` converts them back, as the cast's transpose would)."""

    def __init__(self, fn, casts: dict | None = None):
        self.fn = fn
        self.casts = dict(casts or {})
        # per argument signature: (vjp treedef, per vjp leaf: the parameter's index or None)
        self.layouts: dict = {}
        self.jitted = jax.jit(self._traced)
        self._cast = jax.jit(lambda xs: [x.astype(self.casts[k]) for k, x in xs.items()])
        self._held = ((), {})  # (the step's parameter arrays that were cast, the casts)

    def _cast_once(self, params) -> list:
        if not self.casts:
            return params
        src = tuple(params[k] for k in sorted(self.casts))
        held, casts = self._held
        if len(held) != len(src) or any(a is not b for a, b in zip(held, src, strict=True)):
            casts = self._cast({k: params[k] for k in sorted(self.casts)})
            casts = dict(zip(sorted(self.casts), casts, strict=True))
            self._held = (src, casts)
        return [casts.get(k, p) for k, p in enumerate(params)]

    def _traced(self, params, frozen, batch, recvs):
        float_outs, other, vjp = self.fn(params, frozen, batch, recvs)
        leaves, tree = jax.tree.flatten(vjp)
        index = {id(p): k for k, p in enumerate(params)}
        where = [index.get(id(x)) for x in leaves]
        self.layouts[_signature(params, frozen, batch, recvs)] = (tree, where)
        return float_outs, other, [x for x, k in zip(leaves, where, strict=True) if k is None]

    def release(self) -> None:
        self._held = ((), {})

    def _cache_size(self) -> int:
        """Compilations of the forward (as ``jax.jit``'s)."""
        return self.jitted._cache_size()

    def __call__(self, params, frozen, batch, recvs):
        params = self._cast_once(params)
        float_outs, other, rest = self.jitted(params, frozen, batch, recvs)
        tree, where = self.layouts[_signature(params, frozen, batch, recvs)]
        rest = iter(rest)
        leaves = [next(rest) if k is None else params[k] for k in where]
        return float_outs, other, jax.tree.unflatten(tree, leaves)


def _signature(*args) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args))


def _seeded(program, incoming, seeds) -> list:
    """The sends' cotangents: what later stages sent back plus the loss's seed."""
    cts = []
    for j, ct, seed in zip(program.diff_sends, incoming, seeds, strict=True):
        aval = program.sends[j].aval
        base = jnp.zeros(aval.shape, aval.dtype) if seed is None else \
            jnp.full(aval.shape, seed, aval.dtype)
        cts.append(base if ct is None else base + ct.astype(aval.dtype))
    return cts


def _param_dtypes(program, pcts) -> list:
    """Parameter cotangents in the parameters' dtypes (those of parameters given cast,
    ``_Forward``, come in the cast dtype; converting is the cast's transpose)."""
    return [g if g.dtype == dt else g.astype(dt)
            for g, dt in zip(pcts, program.param_dtypes, strict=True)]


def _backward(program, vjp, incoming, seeds, acc):
    pcts, rcts = vjp(_seeded(program, incoming, seeds))
    pcts = _param_dtypes(program, pcts)
    if acc is not None:
        pcts = [a + g for a, g in zip(acc, pcts, strict=True)]
    return pcts, list(rcts)


def _backward_input(program, vjp, incoming, seeds):
    """ZB-H1's B: (received values' cotangents, the seeded cotangents, what W reads)."""
    cts = _seeded(program, incoming, seeds)
    rcts, carried = input_backward(vjp, cts)
    return rcts, cts, carried


def _backward_weight(program, vjp, cts, carried, acc):
    """ZB-H1's W: the parameters' cotangents, accumulated."""
    pcts = _param_dtypes(program, weight_backward(vjp, cts, carried))
    if acc is not None:
        pcts = [a + g for a, g in zip(acc, pcts, strict=True)]
    return pcts


@jax.jit
def _add(a, b):
    return a + b


@functools.partial(jax.jit, static_argnums=2)
def _weighted(acc, x, w):
    x = x * jnp.asarray(w, x.dtype)
    return x if acc is None else acc + x


def _accumulate(acc, x, w):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return _weighted(acc, x, w)
