"""A plan compiled for one step's argument shapes: an :class:`Executable`.

``hetshard.jit`` traces the step (a :class:`hetshard.Program`), plans it, then
:func:`compile_plan` gives one of three executables behind one protocol,
``run(others, batch) -> the step's output`` (``others``: the step's non-batch arguments,
whose NNX objects are updated in place unless the :class:`Guard` refuses the update):

* :class:`SpmdStep`: one pipeline of one stage, one jitted SPMD program on the stage's
  submesh (the SPMD rewrite applies the plan's layouts before autodiff);
* :class:`SharesStep`: several single-stage pipelines with (uneven) batch shares: each
  computes the value and gradients of its share on its submesh, the runtime combines
  them weighted by share and applies the update once;
* :class:`PipelineStep`: pipeline stages run task by task
  (``hetshard.runtime.pipeline.PipelineRunner``).

What a step does with a non-finite loss or gradients (``nan_policy``, the loss scale's
overflow) is the :class:`Guard`'s, shared by all three and by the micro-step path
(``MicroSteps.apply_grads``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hetshard._plan import Plan
from hetshard.autodiff import all_finite, entered, is_graph
from hetshard.collectives import deliver, empty, here, idle_processes, put, replicated
from hetshard.errors import HetshardError, PlanNotExecutableError  # noqa: F401 (re-exported)
from hetshard.ir.program import Program
from hetshard.layout import (
    at_home,
    batch_sharding,
    on_device,
    on_device_sharding,
    stage_mesh,
    state_shardings,
)
from hetshard.rewrite import swap_attention
from hetshard.rewrite.spmd import constrain_layers
from hetshard.runtime.guard import (  # noqa: F401 (re-exported)
    NAN_POLICIES,
    Carry,
    Guard,
    NonFiniteLossError,
    branches,
    donates,
    find_loss,
)
from hetshard.runtime.pipeline import PipelineRunner
from hetshard.runtime.precision import DynamicLossScale, stage_autocast


class Executable(Protocol):
    """A plan compiled for one step's shapes (see the module docstring)."""

    plan: Plan
    program: Program

    def run(self, others: tuple, batch) -> Any:
        """One step, dispatched: the output (device arrays, not waited for); the NNX
        objects among ``others`` updated."""

    def state_shardings(self):
        """Per state leaf (as the program flattens the state), where the step keeps it."""

    def time(self, on: bool, delays: dict) -> None:
        """Times each stage's tasks from the next step (``HetshardJit.time_stages``)."""

    def stage_times(self) -> dict | None:
        """(pipeline, stage) -> seconds busy in the last timed step, or None."""


def compile_plan(plan: Plan, devices, program: Program, others: tuple, batch,
                 guard: Guard) -> Executable:
    """The executable for ``plan`` (its devices: ``devices[i]`` for cluster id ``i``)
    and the step's arguments of these shapes."""
    # Across processes every multi-pipeline plan runs as MPMD: each process runs only
    # its own pipelines' programs.
    multi_stage = any(len(p.stages) != 1 for p in plan.pipelines) or (
        jax.process_count() > 1 and len(plan.pipelines) > 1)
    if (multi_stage or len(plan.pipelines) > 1) and program.call is None:
        raise PlanNotExecutableError(
            f"this plan has {[len(p.stages) for p in plan.pipelines]} stages per "
            f"pipeline; pipeline plans and several pipelines need a step whose "
            f"loss call can be cut per micro-batch, and "
            f"{program.call_error} (or plan with max_stages=1 and max_pipelines=1)")
    if plan.gpu_dtypes and program.call is None:
        raise PlanNotExecutableError(
            f"plan.gpu_dtypes={[list(e) for e in plan.gpu_dtypes]}: stages computing "
            f"in another dtype need a step whose loss call hetshard sees "
            f"(it scales the loss), and {program.call_error}")
    cuts = multi_stage or len(plan.pipelines) > 1
    if cuts:
        # traced now, not between a step's tasks
        program.samples.summed_outputs, program.samples.normalized_outputs  # noqa: B018
        program.samples.per_sample_outputs  # noqa: B018
        program.update_batch_reads  # noqa: B018
    why = program.samples.coupling if cuts else None
    gap = program.samples.gap if cuts and not why else None
    if gap and gap not in guard.warned:
        guard.warned.add(gap)
        warnings.warn(f"hetshard could not follow how the loss treats its samples at "
                      f"{gap}: this plan cuts the batch into pieces (micro-batches, batch "
                      f"shares) and weighs each piece's loss outputs by its share of the "
                      f"samples, as for a mean over them; a loss that sums over the "
                      f"samples, or mixes them there, would differ from one device's",
                      stacklevel=3)
    if why and why not in guard.warned:
        guard.warned.add(why)
        warnings.warn(f"{why}: this plan cuts the batch into pieces (micro-batches, "
                      f"batch shares), each computing those values on its own samples, "
                      f"so the step differs from one device's (the planner, unpinned, "
                      f"keeps such a step to one single-stage pipeline)", stacklevel=3)
    if multi_stage:
        return PipelineStep(plan, program, PipelineRunner(plan, devices, program, guard),
                            guard)
    if len(plan.pipelines) == 1:
        return SpmdStep.compile(plan, devices, program, others, batch, guard)
    return SharesStep.compile(plan, devices, program, others, batch, guard)


@dataclasses.dataclass
class SpmdStep:
    """A single-pipeline, single-stage plan: one jitted SPMD step, the non-finite policy
    and loss scale decided inside it (``hetshard.runtime.guard``)."""

    plan: Plan
    program: Program
    step: Any  # (state, batch, halted, scale state) -> (out, new state, halted, scale, report)
    shardings: Any  # state
    batch_shardings: Any
    guard: Guard
    carry: Carry
    used_vg: list  # [whether the step's differentiation was seen], set when traced
    mesh: Any = None
    idle: tuple = ()  # the job's processes holding no device of the stage

    @property
    def loss_scale(self) -> DynamicLossScale | None:
        return self.carry.loss_scale

    @classmethod
    def compile(cls, plan: Plan, devices, program: Program, others, batch,
                guard: Guard) -> SpmdStep:
        mesh = stage_mesh(plan, devices)
        b_shard = batch_sharding(batch, plan, mesh)
        if program.kind == "tree" and plan.distributed_optimizer:
            raise PlanNotExecutableError(
                "plan.distributed_optimizer is true but the step takes plain pytrees, "
                "whose optimizer state cannot be told from the parameters; pass NNX "
                "objects (nnx.Optimizer) or a plan with distributed_optimizer false")
        if program.kind == "tree" and "optimizer" in plan.pipelines[0].stages[0].offload:
            raise PlanNotExecutableError(
                "the plan's stage offloads the optimizer state but the step takes plain "
                "pytrees, whose optimizer state cannot be told from the parameters; pass "
                "NNX objects (nnx.Optimizer) or a plan whose stage offload leaves out "
                "'optimizer'")
        s_shard = state_shardings(step_state(program, others), plan, mesh)
        rep = NamedSharding(mesh, PartitionSpec())
        carry = Carry(loss_scale=_loss_scale(plan)).place(rep)
        used_vg: list = []

        # Leaves a stage offloads live in host memory between steps: the step computes
        # on device copies and puts the new values back (``hetshard.offload``).
        s_dev = jax.tree.map(on_device_sharding, s_shard)

        def pure(state, batch, halted, scale_state):
            scale = scale_state["scale"] if carry.loss_scale is not None else None
            state = jax.tree.map(on_device, state, s_shard)
            old = jax.tree.leaves(state)

            def body(state, batch):
                with entered(used=False, finite=None, value=None, loss_scale=scale) as ctx:
                    out, objs = call_step(program, state, batch)
                    used_vg[:] = [bool(ctx.used)]  # known when traced: nothing read later
                    finite, value = ctx.finite, ctx.value
                new = None
                if program.kind == "nnx":
                    new = jax.lax.with_sharding_constraint(nnx.state(tuple(objs)), s_dev)
                return (out, new, *guard.health(program, out, new, finite, value))
            out, new, *rest = guard.run(program, body, (state, batch), old, halted,
                                        scale_state, carry.loss_scale, branch)
            if new is not None:
                new = jax.tree.map(at_home, new, s_shard)
            return (out, new, *rest)
        platform = mesh.devices.flat[0].platform
        branch = branches(mesh.devices.flat)
        donate = donates(program.kind, guard.nan_policy, platform)
        jitted = jax.jit(rewriting(pure, plan, mesh), in_shardings=(s_shard, b_shard, rep,
                                                                       rep),
                         donate_argnums=(0,) if donate else ())
        return cls(plan, program, jitted, s_shard, b_shard, guard, carry, used_vg, mesh,
                   idle_processes([mesh]))

    def run(self, others, batch):
        program = self.program
        if self.idle and not here(NamedSharding(self.mesh, PartitionSpec())):
            return self._run_idle(others)
        batch = put(batch, self.batch_shardings)
        state = put(step_state(program, others), self.shardings)
        out, new_state, halted, scale_state, report = self.step(state, batch,
                                                                *self.carry.values())
        self.carry.take(halted, scale_state)
        if self.idle:
            hand_over(program, out, report, self.mesh, self.idle, self.carry.loss_scale)
        self.guard.record(report, self.carry)
        if program.kind == "nnx" and not self.used_vg[0] and not self.guard.warned_vg \
                and program.changes_parameters:  # (an evaluation step differentiates none)
            self.guard.warned_vg = True
            warnings.warn("the step's differentiation was not seen by hetshard (a transform "
                          "made outside the step and passed in, or called from a helper "
                          "in another module that imported it by name): hetshard restricts "
                          "itself to single-stage plans for it (call nnx.value_and_grad "
                          "or hetshard.value_and_grad in the step)", stacklevel=4)
        if new_state is not None:  # (a refused update's new state is the old one)
            update_objects(others, new_state)
        return out

    def _run_idle(self, others):
        """The step in a process holding none of the stage's devices: nothing runs here;
        the outputs arrive from the stage (:func:`hand_over`), the state becomes views
        without local data of the stage's (as a pipeline's stages elsewhere are)."""
        program = self.program
        views = [empty(a, s) for a, s in zip(program.state_avals,
                                             jax.tree.leaves(self.shardings), strict=True)]
        out, report = hand_over(program, None, None, self.mesh, self.idle,
                                self.carry.loss_scale, views)
        self.guard.record(report, self.carry)
        if program.kind == "nnx":
            update_objects(others, jax.tree.unflatten(program.trees.state_tree, views))
        return out

    def state_shardings(self):
        return self.shardings

    def time(self, on: bool, delays: dict) -> None:
        pass  # one SPMD stage: nothing to compare its time against

    def stage_times(self) -> dict | None:
        return None


@dataclasses.dataclass
class _Share:
    """One pipeline of a :class:`SharesStep`: its batch share, submesh, layouts and the
    jitted capture of its value and gradients."""

    size: int
    mesh: Any
    shardings: Any  # state
    batch_shardings: Any
    capture: Any


@dataclasses.dataclass
class SharesStep:
    """Several single-stage pipelines with batch shares (see the module docstring)."""

    plan: Plan
    program: Program
    shares: list[_Share]
    apply: Any  # jitted (state, reads, provided, halted, scale) -> guarded (see SpmdStep)
    guard: Guard
    carry: Carry
    timing: tuple = (False, {})  # (on, injected delays per (pipeline, 0))
    clock: dict | None = None

    @property
    def loss_scale(self) -> DynamicLossScale | None:
        return self.carry.loss_scale

    @classmethod
    def compile(cls, plan: Plan, devices, program: Program, others, batch,
                guard: Guard) -> SharesStep:
        state = step_state(program, others)
        capture = capturing(program)
        shares = []
        for p in plan.pipelines:
            sub = dataclasses.replace(plan, pipelines=(p,), global_batch=p.batch_share)
            mesh = stage_mesh(sub, devices)
            s_shard = state_shardings(state, sub, mesh)
            b_shard = batch_sharding(jax.tree.map(lambda x, n=p.batch_share: x[:n], batch),
                                     sub, mesh)
            # Each pipeline's loss with its stage's layouts and remat (the SPMD rewrite),
            # on device copies of what its stage keeps in host memory (the step's own
            # update runs there too before its gradients are taken out).
            scaled = (NamedSharding(mesh, PartitionSpec()),) if plan.loss_scaled else ()

            def on_devices(state, *rest, s_shard=s_shard):
                return capture(jax.tree.map(on_device, state, s_shard), *rest)
            cap = jax.jit(rewriting(on_devices, sub, mesh), in_shardings=(s_shard, b_shard,
                                                                            *scaled))
            shares.append(_Share(p.batch_share, mesh, s_shard, b_shard, cap))
        # The combined update is applied once, on the first pipeline's devices; the next
        # step hands every pipeline a copy of the updated state.
        carry = Carry(loss_scale=_loss_scale(plan)).place(
            NamedSharding(shares[0].mesh, PartitionSpec()))
        platform = shares[0].mesh.devices.flat[0].platform
        apply = combining(program, settled(program, guard, carry, providing_whole(program),
                                           branches(shares[0].mesh.devices.flat),
                                           shares[0].shardings))
        return cls(plan, program, shares, jax.jit(apply, donate_argnums=(0,) if donates(
            program.kind, guard.nan_policy, platform) else ()), guard, carry)

    def run(self, others, batch):
        program = self.program
        state = step_state(program, others)
        start, results, states = 0, [], []
        halted, scale_state = self.carry.values()
        timed, delays = self.timing
        clock = {}
        for pi, share in enumerate(self.shares):
            part = jax.tree.map(lambda x, a=start, n=share.size: x[a:a + n], batch)
            st = put(state, share.shardings)
            bt = put(part, share.batch_shardings)
            # (the loss scale, kept on the first share's devices, copied to each)
            scale = (jax.device_put(scale_state["scale"], NamedSharding(
                share.mesh, PartitionSpec())),) if self.loss_scale else ()
            t0 = time.perf_counter()
            results.append(share.capture(st, bt, *scale))  # asynchronous on each submesh
            if timed:  # time_stages: each pipeline to its results, plus an injected delay
                jax.block_until_ready(results[-1])
                time.sleep(delays.get((pi, 0), 0.0))
                clock[pi, 0] = time.perf_counter() - t0
            states.append(st)
            start += share.size
        self.clock = clock if timed else None
        # Weighted sum on the first pipeline's devices: the global-batch mean gradient
        # (``LossSamples.piece_weights``: a loss output that sums over the samples adds its
        # pieces, and a summed loss's gradients; a masked mean's weigh their shares of
        # its count; an integer output that does not sum is the first share's; a
        # per-sample output's pieces are concatenated in the batch's order).
        home = NamedSharding(self.shares[0].mesh, PartitionSpec())
        bounds = np.cumsum([0] + [s.size for s in self.shares])
        weights = program.samples.piece_weights(jax.tree.leaves(batch),
                                        list(zip(bounds[:-1], bounds[1:], strict=True)))
        reads = [replicated(leaf, self.shares[0].mesh) for i, leaf in
                 enumerate(jax.tree.leaves(batch)) if i in set(program.update_batch_reads)]
        # One program on the first pipeline's devices combines the shares and applies
        # the update: a few dispatches a step, not one a gradient leaf.
        out, new_state, halted, scale_state, report = self.apply(
            states[0], reads, put(results, home), np.asarray(weights, np.float32), halted,
            scale_state)
        self.carry.take(halted, scale_state)
        self.guard.record(report, self.carry)
        if new_state is not None:
            update_objects(others, new_state)
        return out

    def state_shardings(self):
        return self.shares[0].shardings

    def time(self, on: bool, delays: dict) -> None:
        self.timing = (bool(on), dict(delays))

    def stage_times(self) -> dict | None:
        return dict(self.clock) if self.clock else None


@dataclasses.dataclass
class PipelineStep:
    """A pipeline plan run stage by stage (``hetshard.runtime.pipeline``)."""

    plan: Plan
    program: Program
    runner: PipelineRunner
    guard: Guard

    def run(self, others, batch):
        runner = self.runner
        out, new_state = runner.step(runner.state_of(others), batch)
        report = runner.report
        if runner.idle:
            home = runner.loss_home(0)
            out, report = hand_over(self.program, out, report, home.mesh, runner.idle,
                                    runner.loss_scale, runner.published)
        if report is not None:
            self.guard.record(report, runner.carry)
        if self.program.kind == "nnx":
            update_objects(others, new_state)
        return out

    def state_shardings(self):
        runner = self.runner
        leaves = [runner.runs[0][runner.owner[0].get(i, 0)].shardings[i]
                  for i in range(len(runner.state_avals))]
        return jax.tree.unflatten(self.program.trees.state_tree, leaves)

    def time(self, on: bool, delays: dict) -> None:
        self.runner.clock = {} if on else None
        self.runner.delays = dict(delays)

    def stage_times(self) -> dict | None:
        return dict(self.runner.clock) if self.runner.clock else None


# ---- the step as a function of its state ------------------------------------------------

def rewriting(fn, plan: Plan, mesh=None):
    """``fn`` run with ``hetshard.value_and_grad`` rewriting the loss as the plan says:
    its attention choice and, given the stage ``mesh`` of a single-stage plan, its
    layer-boundary layouts (``hetshard.rewrite.spmd``), applied before differentiating
    (rewrites precede autodiff)."""
    if mesh is not None:
        stage = plan.pipelines[0].stages[0]

        def rewrite(loss):
            return constrain_layers(loss, mesh, stage, attention=plan.attention,
                                    split_blocks=plan.split_blocks,
                                    tp_overlap=plan.tp_overlap, zigzag=plan.context.zigzag,
                                    capacity_factor=plan.capacity_factor,
                                    autocast=stage_autocast(plan, stage),
                                    chunk_lengths=plan.context_chunks(stage) or None,
                                    sequence=plan.seq_len)
    elif plan.attention in (None, "reference"):
        rewrite = None
    else:

        def rewrite(loss):
            return swap_attention(loss, plan.attention)

    @functools.wraps(fn)
    def wrapped(*args):
        with entered(rewrite=rewrite):
            return fn(*args)
    return wrapped


def capturing(program: Program):
    """``capture(state, batch, *scale)``: the value and gradients the step's
    ``hetshard.value_and_grad`` computes (``scale``: the loss scale of loss-scaled plans)."""
    def capture(state, batch, *scale):
        with entered(mode="capture", captured=None, used=False,
                     loss_scale=scale[0] if scale else None) as ctx:
            call_step(program, state, batch)
            if ctx.captured is None:
                raise PlanNotExecutableError(
                    "plans with several pipelines or micro-steps need the step's loss "
                    "call (hetshard.value_and_grad, or nnx/jax value_and_grad or grad "
                    "called in the step); it found none")
            return ctx.captured
    return capture


def providing(program: Program):
    """``apply(state, batch, provided)``: the step run with ``hetshard.value_and_grad``
    returning ``provided``; (output, new NNX state or None)."""
    def apply(state, batch, provided):
        with entered(mode="provide", provided=provided):
            out, objs = call_step(program, state, batch)
        return out, (nnx.state(tuple(objs)) if program.kind == "nnx" else None)
    return apply


def providing_whole(program: Program):
    """``apply(state, read_leaves, provided)``: :func:`providing` on the whole batch's
    shapes, given only the batch leaves the step reads besides its loss call
    (``Program.update_batch_reads``, whole); zeros stand for the others."""
    apply = providing(program)
    reads = program.update_batch_reads

    def whole(state, read_leaves, provided):
        leaves = [jnp.zeros(a.shape, a.dtype) for a in program.batch_avals]
        for i, x in zip(reads, read_leaves, strict=True):
            leaves[i] = x
        return apply(state, jax.tree.unflatten(program.trees.batch_tree, leaves), provided)
    return whole


def combining(program: Program, apply):
    """``apply`` (:func:`settled`) given the pipelines' values and gradients of their
    batch shares, ``results``, combined first, in the same program: the global batch's
    (``weights[share, output]``, ``LossSamples.piece_weights``: a loss output that sums
    over the samples adds its pieces, and a summed loss's gradients; a mean's and a
    masked mean's pieces weigh their shares of the samples or the count; an integer
    output that does not sum is the first share's; a per-sample output's pieces are
    concatenated in the batch's order)."""
    summed, per_sample = program.samples.summed_outputs, program.samples.per_sample_outputs

    def fn(state, reads, results, weights, halted, scale_state):
        values = grads = tree = None
        for j, (value, g) in enumerate(results):
            leaves, tree = jax.tree.flatten(value)
            leaves = [x if (summed and summed[k]) or k in per_sample else
                      (x * weights[j, k].astype(x.dtype)
                       if jnp.issubdtype(x.dtype, jnp.inexact) else
                       (x if values is None else jnp.zeros_like(x)))
                      for k, x in enumerate(leaves)]
            g = jax.tree.map(lambda a, j=j: a * weights[j, 0].astype(a.dtype), g)
            if values is None:
                values, grads = leaves, g
                continue
            values = [jnp.concatenate([a, x], per_sample[k]) if k in per_sample else a + x
                      for k, (a, x) in enumerate(zip(values, leaves, strict=True))]
            grads = jax.tree.map(jnp.add, grads, g)
        combined = (jax.tree.unflatten(tree, values), grads)
        return apply(state, reads, combined, halted, scale_state)
    return fn


def settled(program: Program, guard: Guard, carry: Carry, apply, branch: bool,
            shardings=None):
    """``apply`` (``(state, ..., provided) -> (output, new NNX state or None)``, the step
    run on value and gradients computed elsewhere) with its ``provided`` value and
    gradients checked and the update kept only where the guard applies it:
    ``(state, ..., provided, halted, scale state) -> (output, new state, halted, scale
    state, report)``, all in-graph. ``shardings``: the state's, where some of it lives
    in host memory (``Stage.offload``): the update computes on device copies of those
    leaves and puts the new values back there."""
    def fn(state, *rest):
        *args, provided, halted, scale_state = rest
        if shardings is not None:
            state = jax.tree.map(on_device, state, shardings)
        old = jax.tree.leaves(state)

        def body(state, args, provided):
            out, new = apply(state, *args, provided)
            value, grads = provided
            value = value[0] if program.call.has_aux else value
            return (out, new, *guard.health(program, out, new, all_finite((value, grads)),
                                            value))
        out, new, *rest = guard.run(program, body, (state, args, provided), old, halted,
                                    scale_state, carry.loss_scale, branch)
        if shardings is not None and new is not None:
            new = jax.tree.map(at_home, new, shardings)
        return (out, new, *rest)
    return fn


def hand_over(program: Program, out, report, mesh, idle: tuple, loss_scale,
              views: list | None = None):
    """``(out, report)`` in every process of a job whose plan leaves the ``idle``
    processes out: the step's outputs and the guard's report, computed on ``mesh``,
    are sent to each idle process (``hetshard.collectives.deliver``), which gets them as
    one process would (``out`` and ``report`` None there; ``views``: its state leaves,
    put where a pytree step returns its new state). Every process calls it at the same
    point of the step; the others get back what they passed (those holding ``mesh``
    send theirs)."""
    shapes, tree = jax.tree.flatten(program.output_shape)
    state_at = {} if program.kind == "nnx" else {
        m: i for i, m in enumerate(program.state_outputs()[1]) if m is not None}
    passed = [k for k in range(len(shapes)) if k not in state_at]
    report_avals = Guard.report_avals(loss_scale)
    xs = None
    if out is not None and here(NamedSharding(mesh, PartitionSpec())):
        leaves = jax.tree.leaves(out)
        xs = [leaves[k] for k in passed] + [report[k] for k in report_avals]
    got = deliver(xs, [shapes[k] for k in passed] + list(report_avals.values()), mesh, idle)
    if jax.process_index() not in idle:
        return out, report
    leaves = [views[state_at[k]] if k in state_at else None for k in range(len(shapes))]
    for k, x in zip(passed, got, strict=False):
        leaves[k] = x
    return (jax.tree.unflatten(tree, leaves),
            dict(zip(report_avals, got[len(passed):], strict=True)))


def update_objects(others, new_state) -> None:
    """The NNX objects among the step's arguments ``others`` updated to ``new_state``
    (the state of the tuple ``others``); the other arguments (arrays, an RNG key) are
    values the step cannot change in place, left as they are."""
    for i, o in enumerate(others):
        if is_graph(o) and i in new_state:
            nnx.update(o, new_state[i])


def step_state(program: Program, others):
    """The step's non-batch arguments as the program flattens them: NNX state, or the
    pytrees themselves."""
    return nnx.state(others) if program.kind == "nnx" else others


def call_step(program: Program, state, batch):
    """``step(*args)`` from the state ``step_state`` gives; (output, objects after)."""
    if program.kind == "nnx":
        objs = list(nnx.merge(program.trees.graphdef, state))
    else:
        objs = list(state)
    out = program.step(*program.trees.with_batch(objs, batch))
    return out, program.trees.without_batch(objs)


def _loss_scale(plan: Plan) -> DynamicLossScale | None:
    return DynamicLossScale() if plan.loss_scaled else None
