"""MPMD execution of any plan: pipelines of stages, each stage on its own submesh.

What one step does (``PipelineRunner.step``):

1. Each pipeline takes its batch share, cut into micro-batches.
2. Stage programs (``hetshard.rewrite.pipeline``) run forward and backward per
   micro-batch under the pipeline's schedule (1F1B, GPipe, interleaved 1F1B, or ZB-H1,
   whose backward runs as a B and a W pass: ``hetshard.rewrite.backward``), each jitted on its
   stage's mesh; activations go forward and cotangents back to the receiving stage's
   sharding (``hetshard.collectives.transfer``); each backward is seeded with
   ``mbs / global_batch`` so the summed gradients are the global-batch mean gradient
   (a loss that is a sum over the samples, ``LossSamples.summed_outputs``, is seeded with 1:
   the pieces' gradients add); gradients accumulate per stage over micro-batches.
3. A parameter read by several stages of a pipeline (tied embeddings) has its
   gradients added at the stage that owns it; across pipelines the owners' gradients
   are summed (``hetshard.collectives``: a ``shard_map`` all-reduce when the holders'
   meshes are congruent, transfers otherwise). A stage whose GPU type computes in
   another dtype (``Plan.gpu_dtypes``) runs under an autocast, and while one computes in
   float16 the loss is scaled dynamically (``hetshard.runtime.precision``).
4. Each stage applies the user's step (the optimizer update) to the state it owns, on
   its own submesh: the step is traced with the gradients and loss provided to
   ``hetshard.value_and_grad`` and every leaf the stage does not hold filled with zeros,
   which is exact because the step was checked to be separable
   (``hetshard.runtime.ownership``): every updated leaf reads only its own state, its
   own parameters' gradients, the loss, shared leaves (step counters) and small values
   of other stages, which the stages trade first (a global-norm clip's squared norms:
   ``hetshard.runtime.exchange``). Shared leaves are kept on every stage and updated
   identically everywhere.

Dispatch is asynchronous and nothing waits: the host enqueues every task of the step in
schedule order; every stage's gradients are checked where they are and the non-finite
policy decided on pipeline 0's loss stage (``hetshard.runtime.guard``), its verdict sent
to every stage, each of which keeps its old values where the update is refused.

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
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetshard._plan import Plan
from hetshard.autodiff import all_finite, entered
from hetshard.collectives import (
    congruent,
    empty,
    here,
    idle_processes,
    put,
    replicated,
    sum_across,
    sum_across_collective,
    takes_part,
    transfer,
)
from hetshard.collectives.experts import brought_experts
from hetshard.errors import SpecError
from hetshard.ir.program import Program
from hetshard.layout import at_home, home, leaf_spec, mesh_of, on_device
from hetshard.rewrite.experts import brought, expert_layouts, prelaid_weights
from hetshard.rewrite.pipeline import StageSplitError, remat_wrap, split_stages
from hetshard.rewrite.spmd import stage_sequence_layouts
from hetshard.runtime import stage_fns
from hetshard.runtime.exchange import evaluate
from hetshard.runtime.guard import Carry, Guard, branched, branches, donates, scalar
from hetshard.runtime.ownership import PipelineSetupError, ownership
from hetshard.runtime.precision import DynamicLossScale, stage_autocast
from hetshard.runtime.walk import PipelineWalk, samples_per_micro_batch

_all_finite = jax.jit(all_finite)


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
    apply: Callable = None  # the optimizer update of the leaves it owns
    branch: bool = False  # the update refused by a branch, not selects (guard.branches)
    rounds: list = dataclasses.field(default_factory=list)  # its values to trade, by round
    owned_params: list[int] = dataclasses.field(default_factory=list)  # owned, with gradients


class PipelineRunner:
    """Runs a step under ``plan`` (see the module docstring); ``program`` is the step with
    its arguments (``hetshard.ir.program.Program``)."""

    def __init__(self, plan: Plan, devices, program: Program, guard: Guard):
        if program.call is None:
            raise PipelineSetupError("pipeline plans need a step that calls "
                                     "a loss call (or plan with max_stages=1)")
        self.plan, self.program, self.guard = plan, program, guard
        self.state_tree, self.paths = program.trees.state_tree, program.paths
        self.state_avals = program.state_avals
        self.batch_tree, self.batch_avals = program.trees.batch_tree, program.batch_avals
        self.global_batch = program.global_batch
        self._check_batch()
        self.grad_index = list(program.diff)
        # the loss outputs that sum over the samples: their pieces add (not averaged)
        self.summed = program.samples.summed_outputs
        # the loss outputs holding a value per sample: their pieces are concatenated
        self.per_sample = program.samples.per_sample_outputs
        program.samples.normalized_outputs, program.update_batch_reads  # noqa: B018 (traced now)
        self.diff = sorted(set(self.grad_index))
        self.splits = [self._split(p) for p in plan.pipelines]
        self.meshes = [[mesh_of(s, devices) for s in p.stages] for p in plan.pipelines]
        self.loss_out_avals = None
        self._ownership()
        self.runs = [[self._stage_run(pi, si) for si in range(len(p.stages))]
                     for pi, p in enumerate(plan.pipelines)]
        # The job's processes holding no stage: they run no task and get the step's
        # outputs from pipeline 0's loss stage (``hetshard.runtime.executable.hand_over``).
        self.idle = idle_processes([r.mesh for row in self.runs for r in row])
        # The stage computing the loss, per pipeline (the outputs' home).
        self.loss_stage = [max(st.index for st in split.stages if st.outputs)
                           for split in self.splits]
        self.views = None  # per (pipeline, stage): leaf -> array
        self.published: list | None = None
        # The non-finite policy, decided on the device on pipeline 0's loss stage (where
        # the carry lives: the loss scale of float16 plans, raise's flag); the last
        # step's report (``Guard.record``) and verdict (what every stage applied on):
        # ``self.guard``.
        self.carry = Carry(loss_scale=DynamicLossScale() if plan.loss_scaled else None)
        self.report: dict | None = None
        self.verdict: list | None = None
        self._decide = jax.jit(self._decision)
        # Per (pipeline, stage), seconds busy in the last step when timed (``timing``),
        # and injected delays per task (a straggler stand-in on fake devices).
        self.clock: dict | None = None
        self.delays: dict = {}

    @property
    def loss_scale(self) -> DynamicLossScale | None:
        """float16 stages: the loss scale (None: gradients unscaled)."""
        return self.carry.loss_scale

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
        mbs = samples_per_micro_batch(pipeline)
        mb_avals = self.program.trees.batch_at(mbs)
        ranges = [(s.start, s.end) for s in pipeline.stages]
        try:
            return split_stages(self.program.loss_flat, self.state_avals, mb_avals, ranges,
                                self.diff, attention=self.plan.attention,
                                split_blocks=self.plan.split_blocks,
                                sequence=self.plan.seq_len)
        except StageSplitError as e:
            raise PipelineSetupError(str(e)) from None

    def _apply_fn(self):
        """The user's step as a function of flat leaves, value_and_grad provided:
        ``(outputs, new state leaves)``. An NNX step's state is its objects after the
        step; a pytree step's is read from its outputs (``Program.state_outputs``), and
        ``outputs`` are its other output leaves."""
        program = self.program

        def apply(state_leaves, grad_leaves, loss_leaves, batch_leaves):
            grads = program.trees.gradients(program.call, program.state_avals, grad_leaves)
            value = jax.tree.unflatten(self._loss_tree, loss_leaves)
            with entered(mode="provide", provided=(value, grads)):
                out, objs = program.call_step(state_leaves, batch_leaves)
            if program.kind == "nnx":
                return out, program.trees.updated_state(objs)
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
        self._loss_tree = self.splits[0].out_tree
        self.loss_out_avals = self.program.samples.outputs_for(
            [v.aval for v in self.splits[0].closed.jaxpr.outvars], self.global_batch)
        found = ownership(self._apply_fn(), self.state_avals, self.grad_index,
                          self.loss_out_avals, self.batch_avals, self.paths, self.diff,
                          self.splits)
        self._out_tree, self.shared, self.owner = found.out_tree, found.shared, found.owner
        self.exchanges = found.exchanges


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
        # ``Stage.offload`` "optimizer": the leaves only the update reads (no parameter,
        # nothing the forward reads) live in host memory between steps.
        host = set(owned) - params - set(program.params) - set(program.frozen) \
            if "optimizer" in stage.offload else set()
        shardings = {i: home(NamedSharding(mesh, leaf_spec(
            self.paths[i], self.state_avals[i].shape, specs, mesh,
            shard_data=zero1 and i not in params,
            over_context=self.plan.context.shard_state)), i in host)
            for i in local}
        run = _StageRun(program, mesh, stage.remat, owned, local, shardings,
                        here=here(NamedSharding(mesh, PartitionSpec())))
        # Sequence parallelism inside the stage (as the simulator prices its memory); a
        # context axis splits the sequence instead (not combined, as on SPMD stages).
        invars = self.splits[pi].closed.jaxpr.invars
        layouts = {} if stage.axis("context") > 1 else stage_sequence_layouts(
            self.splits[pi].closed, program.eqns,
            {invars[i]: tuple(shardings[i].spec) for i in program.params + program.frozen},
            mesh, overlap=self.plan.tp_overlap)
        where = f"pipelines[{pi}].stages[{si}]"
        prelaid = prelaid_weights(self.splits[pi].closed, program, mesh, stage, where)
        layouts.update(expert_layouts(self.splits[pi].closed, program.eqns, mesh, stage,
                                      self.plan.capacity_factor, where,
                                      frozenset(w for _, w in prelaid.values())))
        prelaid = dict(sorted(prelaid.items()))  # (the order the forward takes them in)
        run.fwd = stage_fns.Forward(functools.partial(stage_fns.stage_forward, program,
                                             remat_wrap(stage.remat, stage.offload,
                                                        checkpoint_none=True),
                                             stage.remat_layers, mesh, layouts,
                                             stage_autocast(self.plan, stage),
                                             self.plan.context_chunks(stage) or None,
                                             extra_keys=tuple(brought(w) for _, w in
                                                              prelaid.values())),
                           program.cast_params,
                           {k: brought_experts(counts, mesh)
                            for k, (counts, _) in prelaid.items()})
        run.bwd = jax.jit(functools.partial(stage_fns.backward, program))
        run.bwd_input = jax.jit(functools.partial(stage_fns.backward_input, program))
        run.bwd_weight = jax.jit(functools.partial(stage_fns.backward_weight, program))
        # The update writes over the leaves the stage owns where the runtime donates
        # (``hetshard.runtime.guard.donates``), unless the stage keeps some in host
        # memory.
        donate = donates(self.program.kind, self.guard.nan_policy,
                         mesh.devices.flat[0].platform) and not stage.offload
        run.branch = branches(mesh.devices.flat)
        run.apply = jax.jit(self._stage_apply(run, pi, si),
                            donate_argnums=(0,) if donate else ())
        ex = self.exchanges[pi]
        if ex is not None:
            run.rounds = [jax.jit(self._stage_apply(run, pi, si, r))
                          for r in range(len(ex.rounds))]
        return run

    def _stage_apply(self, run: _StageRun, pi: int, si: int, round_: int | None = None):
        """The stage's update of the leaves it owns (every other leaf zero). Where the
        stages trade small values (``hetshard.runtime.exchange``), the update is the
        traced one evaluated with the values published so far put in; ``round_``: the
        function giving this stage's values of that round instead."""
        apply = self._apply_fn()
        owned, shared = run.owned, self.shared
        grad_pos = {i: k for k, i in enumerate(self.grad_index)}
        owned_params = [i for i in owned if i in grad_pos]
        ex = self.exchanges[pi]

        reads = self.program.update_batch_reads

        def fn(owned_vals, shared_vals, grad_vals, loss_leaves, scale, published=(),
               batch_vals=(), apply_flag=True):
            leaves = [jnp.zeros(a.shape, a.dtype) for a in self.state_avals]
            owned_vals = [on_device(v, run.shardings[i]) for i, v in zip(owned, owned_vals,
                                                                          strict=True)]
            shared_vals = [on_device(v, run.shardings[i]) for i, v in zip(shared, shared_vals,
                                                                           strict=True)]
            for i, v in zip(owned, owned_vals, strict=True):
                leaves[i] = v
            for i, v in zip(shared, shared_vals, strict=True):
                leaves[i] = v
            grads = [jnp.zeros(self.state_avals[i].shape, self.state_avals[i].dtype)
                     for i in self.grad_index]
            for i, g in zip(owned_params, grad_vals, strict=True):
                grads[grad_pos[i]] = g * (1 / jnp.asarray(scale, jnp.float32)).astype(
                    g.dtype)  # the loss scale
            # The whole batch's leaves the step reads besides its loss call; zeros for
            # the others (nothing reads them).
            batch = [jnp.zeros(a.shape, a.dtype) for a in self.batch_avals]
            for i, v in zip(reads, batch_vals, strict=True):
                batch[i] = v
            if ex is not None and round_ is not None:
                j = ex.closed.jaxpr
                known = dict(zip(ex.published_before(round_), published, strict=True))
                mine = [v for v, st in ex.rounds[round_] if st == si]
                return evaluate(j, ex.closed.consts, [*leaves, *grads, *loss_leaves,
                                                      *batch], known, mine)

            def update(leaves, grads, loss_leaves, batch, published):
                if ex is None:
                    out, new = apply(leaves, grads, loss_leaves, batch)
                else:
                    j = ex.closed.jaxpr
                    known = dict(zip(ex.published_before(len(ex.rounds)), published,
                                     strict=True))
                    flat = evaluate(j, ex.closed.consts,
                                    [*leaves, *grads, *loss_leaves, *batch], known,
                                    j.outvars)
                    n_out = self._out_tree.num_leaves
                    out = jax.tree.unflatten(self._out_tree, flat[:n_out])
                    new = flat[n_out:]
                return out, [new[i] for i in owned + shared]
            # The state keeps its layout across steps (under ZeRO-1 the update runs on
            # each data way's optimizer shard and the parameters are all-gathered).
            # A step the guard refuses keeps the old values (decided on the device):
            # its new values in a branch where the devices branch
            # (``hetshard.runtime.guard.branches``), else a select per leaf.
            olds = [*owned_vals, *shared_vals]
            args = (leaves, grads, loss_leaves, batch, list(published))
            if isinstance(apply_flag, bool) or not run.branch:
                out, new = update(*args)
                new = [jnp.where(apply_flag, n, o) for n, o in zip(new, olds, strict=True)]
            else:
                def keep(shapes):
                    n_out = len(jax.tree.leaves(shapes[0]))
                    return list(range(n_out, n_out + len(olds))), olds
                out, new = branched(update, args, keep, lambda values: apply_flag)
            keep = [at_home(n, run.shardings[i])
                    for i, n in zip(owned + shared, new, strict=True)]
            return out, keep[:len(owned)], keep[len(owned):]
        run.owned_params = owned_params
        return fn

    # ---- state -----------------------------------------------------------------------
    def _distribute(self, leaves):
        self.views = []
        for stages in self.runs:
            self.views.append([
                {i: put(leaves[i], run.shardings[i]) for i in run.local}
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
    def step(self, state, batch) -> object:
        """One step on every process (each runs the tasks of its own stages and joins
        the transfers that touch them), dispatched without waiting for the devices;
        returns (the step's output, the new state: the old values where the guard
        refused the update, decided on the device; ``report``: what it decided)."""
        leaves = self.prepare(state)
        batch_leaves = jax.tree.leaves(batch)
        grads, losses = [], []
        start = 0
        scales = self._scales()
        pieces = []
        for p in self.plan.pipelines:
            mbs = samples_per_micro_batch(p)
            pieces += [(start + k * mbs, start + (k + 1) * mbs)
                       for k in range(p.num_micro_batches)]
            start += p.batch_share
        weights = self.program.samples.piece_weights(batch_leaves, pieces)
        start = 0
        for pi, p in enumerate(self.plan.pipelines):
            rows = weights[:p.num_micro_batches]
            weights = weights[p.num_micro_batches:]
            g, loss = PipelineWalk(self, pi, batch_leaves, start, scales[pi], rows).run()
            grads.append(g)
            losses.append(loss)
            start += p.batch_share
        return self.finish(grads, losses, scales, batch_leaves, leaves)

    def prepare(self, state) -> list:
        """The state's leaves, put on the stages (again only where they changed since
        the last step): what a step starts from."""
        if self.clock is not None:
            self.clock = {}
        leaves = jax.tree.leaves(state)
        if self.published is None or len(leaves) != len(self.published) or any(
                a is not b for a, b in zip(leaves, self.published, strict=True)):
            self._distribute(leaves)
        return leaves

    def finish(self, grads, losses, scales, batch_leaves, leaves, verdict=None):
        """The rest of a step once its pipelines have walked: ``grads`` (per pipeline,
        per stage, leaf -> gradient) summed over pipelines, ``losses`` combined, the
        update applied where the guard keeps it (see :meth:`step`); ``scales``: per
        pipeline and stage, the loss scale its backward passes were seeded with.
        ``verdict``: another runner's (``self.verdict``) to apply on instead of deciding
        here (the passes of one step, ``hetshard.runtime.mixed``)."""
        grads = self._sync(grads)
        loss = self._combine_losses(losses)
        flags = self._verdict(grads, loss, verdict)
        new_views, out = [], None
        for pi, stages in enumerate(self.runs):
            row = []
            traded = self._trade(pi, stages, grads, loss, scales[pi], batch_leaves)
            for si, run in enumerate(stages):
                lv = self._loss_to(loss, run.mesh)
                if not run.here:
                    row.append(None)
                    continue
                view = self.views[pi][si]
                o, owned, shared = run.apply([view[i] for i in run.owned],
                                             [view[i] for i in self.shared],
                                             [grads[pi][si][i] for i in run.owned_params], lv,
                                             scales[pi][si], self._to(traded, run.mesh),
                                             batch_vals=self._batch_on(batch_leaves, run.mesh),
                                             apply_flag=flags[pi][si])
                if out is None or (pi, si) == (0, self.loss_stage[0]):
                    out = o  # (the loss stage's where this process holds it: the
                    # outputs idle processes are sent)
                new = dict(view)
                new.update(zip(run.owned, owned, strict=True))
                new.update(zip(self.shared, shared, strict=True))
                row.append(new)
            new_views.append(row)
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


    def _trade(self, pi: int, stages, grads, loss, scales, batch_leaves) -> list:
        """The small values pipeline ``pi``'s stages trade in the update, in round order
        (``hetshard.runtime.exchange``; one process holds every stage)."""
        ex = self.exchanges[pi]
        if ex is None:
            return []
        values: list = []
        for r, entries in enumerate(ex.rounds):
            got: dict = {}
            for si, run in enumerate(stages):
                mine = [v for v, st in entries if st == si]
                if not mine:
                    continue
                view = self.views[pi][si]
                vals = run.rounds[r]([view[i] for i in run.owned],
                                     [view[i] for i in self.shared],
                                     [grads[pi][si][i] for i in run.owned_params],
                                     self._loss_to(loss, run.mesh), scales[si],
                                     self._to(values, run.mesh),
                                     batch_vals=self._batch_on(batch_leaves, run.mesh))
                got.update(zip(mine, vals, strict=True))
            values += [got[v] for v, _ in entries]
        return values

    def _batch_on(self, batch_leaves, mesh) -> list:
        """The batch leaves the step reads besides its loss call
        (``Program.update_batch_reads``), whole, replicated on ``mesh``."""
        return [replicated(batch_leaves[i], mesh) for i in self.program.update_batch_reads]

    @staticmethod
    def _to(values, mesh) -> list:
        home = NamedSharding(mesh, PartitionSpec())
        return [put(v, home) for v in values]

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

    def loss_home(self, pi: int) -> NamedSharding:
        """Where pipeline ``pi``'s loss outputs are (its loss stage, replicated)."""
        return NamedSharding(self.runs[pi][self.loss_stage[pi]].mesh, PartitionSpec())

    # ---- the guard, on the device -------------------------------------------------
    def _scales(self) -> list:
        """Per pipeline and stage, the loss scale on the stage's devices (1.0 for plans
        that scale nothing): the carry's, on pipeline 0's loss stage, sent to each."""
        if self.loss_scale is None:
            return [[1.0] * len(stages) for stages in self.runs]
        home = self.loss_home(0)
        if not isinstance(self.loss_scale.state["scale"], jax.Array):  # the first step
            self.loss_scale.state = jax.device_put(self.loss_scale.state, home)
        scale = self.loss_scale.state["scale"]
        aval = jax.ShapeDtypeStruct((), jnp.float32)
        out = []
        for stages in self.runs:
            row = []
            for run in stages:
                dst = NamedSharding(run.mesh, PartitionSpec())
                got = transfer([scale] if here(home) else None, [aval], [home], [dst]) \
                    if takes_part(home, dst) else None
                row.append(None if got is None else got[0])
            out.append(row)
        return out

    def _decision(self, flags, loss, halted, scale_state):
        ok = functools.reduce(jnp.logical_and, flags, jnp.asarray(True))
        value = jnp.float32(jnp.nan) if loss is None else scalar(loss)
        apply, halted, scale_state, report = self.guard.decide(
            ok, value, halted, scale_state, self.loss_scale)
        return apply, halted, scale_state, report

    def _verdict(self, grads, loss, given=None) -> list:
        """Per pipeline and stage, whether the step's update is kept, on the stage's
        devices (None where this process runs no part of it): every stage's gradients
        checked where they are, the flags and the loss brought to pipeline 0's loss
        stage, decided there (``Guard.decide``: the loss scale advanced, raise's flag
        carried) and the answer sent to every stage. Nothing is read on the host; the
        report is queued (``report``). ``given``: another runner's verdict, applied."""
        home = self.loss_home(0)
        flag_aval = jax.ShapeDtypeStruct((), jnp.bool_)
        if given is None:
            flags = []
            for pi, stages in enumerate(self.runs):
                for si, run in enumerate(stages):
                    if not grads[pi][si]:
                        continue
                    src = NamedSharding(run.mesh, PartitionSpec())
                    if not takes_part(src, home):
                        continue
                    mine = [jax.device_put(_all_finite(list(grads[pi][si].values())), src)] \
                        if run.here else None
                    got = transfer(mine, [flag_aval], [src], [home])
                    if got is not None:
                        flags.append(got[0])
            if here(home):
                # (the carry is already there but for a step's first pass or a carry
                # handed over from another runner: HetshardJit.run_passes)
                carried = jax.device_put(self.carry.values(), home)
                apply, halted, scale_state, report = self._decide(
                    flags, None if loss is None else loss[0], *carried)
                self.carry.take(halted, scale_state)
                given = (home, [report["applied"], report["ok"], report["overflow"],
                                report["loss"], *([report["scale"]] if "scale" in report
                                                  else [])])
            else:
                given = (home, None)
        src, bundle = given
        self.verdict = given
        avals = [flag_aval, flag_aval, flag_aval, jax.ShapeDtypeStruct((), jnp.float32)]
        if self.loss_scale is not None:
            avals.append(jax.ShapeDtypeStruct((), jnp.float32))
        out, self.report = [], None
        for pi, stages in enumerate(self.runs):
            row = []
            for si, run in enumerate(stages):
                dst = NamedSharding(run.mesh, PartitionSpec())
                got = transfer(bundle if here(src) else None, avals, [src] * len(avals),
                               [dst] * len(avals)) if takes_part(src, dst) else None
                row.append(None if got is None else got[0])
                # (the loss stage's where this process holds it, as for the outputs)
                if got is not None and (self.report is None or
                                        (pi, si) == (0, self.loss_stage[0])):
                    keys = ["applied", "ok", "overflow", "loss", "scale"]
                    self.report = dict(zip(keys, got, strict=False))
            out.append(row)
        return out

    def _combine_losses(self, losses):
        """The loss outputs summed over pipelines, on pipeline 0's loss stage (None in a
        process without it)."""
        home, n = self.loss_home(0), len(self.loss_out_avals)
        total = list(losses[0]) if here(home) else None
        for pi in range(1, len(losses)):
            src = self.loss_home(pi)
            if not takes_part(src, home):
                continue
            avals = self.program.samples.outputs_for(self.loss_out_avals,
                                             self.plan.pipelines[pi].batch_share)
            moved = transfer(list(losses[pi]) if here(src) else None, avals,
                             [src] * n, [home] * n)
            if total is not None:  # (the pipelines hold the batch's shares in order)
                total = [stage_fns.joined([a, b], self.per_sample[k], home)
                         if k in self.per_sample else stage_fns.add(a, b)
                         for k, (a, b) in enumerate(zip(total, moved, strict=True))]
        return total

    def _loss_to(self, loss, mesh):
        """The combined loss replicated on ``mesh`` (None where this process lacks it)."""
        home, dst = self.loss_home(0), NamedSharding(mesh, PartitionSpec())
        if not takes_part(home, dst):
            return None
        k = len(self.loss_out_avals)
        return transfer(loss, self.loss_out_avals, [home] * k, [dst] * k)
