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
(``HetshardJit.apply_grads``).
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

from hetshard.autodiff import all_finite, entered, is_graph
from hetshard.collectives import replicated
from hetshard.errors import HetshardError, SpecError
from hetshard.ir.program import Program, path_string
from hetshard.layout import batch_sharding, stage_mesh, state_shardings
from hetshard.plan import Plan
from hetshard.rewrite import swap_attention
from hetshard.rewrite.spmd import constrain_layers
from hetshard.runtime import stage_fns
from hetshard.runtime.pipeline import PipelineRunner
from hetshard.runtime.precision import DynamicLossScale, stage_autocast

NAN_POLICIES = ("skip", "apply", "raise")


class PlanNotExecutableError(HetshardError, ValueError):
    """The plan cannot run this step (the message says why and what would)."""


class NonFiniteLossError(HetshardError, FloatingPointError):
    """The step's loss or gradients are not finite (``nan_policy="raise"``)."""


class Executable(Protocol):
    """A plan compiled for one step's shapes (see the module docstring)."""

    plan: Plan
    program: Program

    def run(self, others: tuple, batch) -> Any:
        """One step: the output; the NNX objects among ``others`` updated."""

    def state_shardings(self):
        """Per state leaf (as the program flattens the state), where the step keeps it."""

    def time(self, on: bool, delays: dict) -> None:
        """Times each stage's tasks from the next step (``HetshardJit.time_stages``)."""

    def stage_times(self) -> dict | None:
        """(pipeline, stage) -> seconds busy in the last timed step, or None."""


class Guard:
    """What a step does with its loss and gradients once computed: checks them in-graph
    (:meth:`health`), then applies the update, skips it or raises (``nan_policy``); a
    loss-scaled step whose gradients overflow under a finite loss is skipped and its
    scale lowered. ``loss_output``: where the step's output holds its loss."""

    def __init__(self, nan_policy: str = "skip", loss_output: str | int | None = None):
        if nan_policy not in NAN_POLICIES:
            raise SpecError("nan_policy", nan_policy, f"one of {NAN_POLICIES}")
        if loss_output is not None and (isinstance(loss_output, bool) or not isinstance(
                loss_output, (str, int))):
            raise SpecError("loss_output", loss_output,
                            "a path in the step's output (str) or a tuple position (int)",
                            where="hetshard.jit")
        self.nan_policy, self.loss_output = nan_policy, loss_output
        self.warned_vg = False  # the plain-nnx.value_and_grad warning, given once
        self.warned: set[str] = set()  # the planner's restrictions, each said once

    def health(self, program: Program, out, new_state, finite, value):
        """(whether the step's loss and gradients are finite, its loss) in-graph: the
        loss and gradients ``hetshard.value_and_grad`` computed (``finite``, ``value``),
        the output at ``loss_output`` and, for a step without ``hetshard.value_and_grad``,
        the state it returns (a non-finite gradient shows there)."""
        ok = jnp.asarray(True) if finite is None else finite
        found = find_loss(out, self.loss_output)
        if found is not None:
            ok = ok & all_finite(found)
        if finite is None:
            ok = ok & all_finite(new_state if program.kind == "nnx"
                                 else _state_in_output(program, out))
        loss = value if value is not None else found
        return ok, (jnp.float32(jnp.nan) if loss is None else _scalar(loss))

    def may_apply(self, finite, loss) -> bool:
        """True when the step's update may be applied (``nan_policy``)."""
        if bool(finite):
            return True
        what = (f"non-finite loss {float(loss)}" if not np.isfinite(float(loss))
                else f"non-finite gradients (loss {float(loss)})" if not np.isnan(float(loss))
                else "non-finite loss or gradients")
        if self.nan_policy == "raise":
            raise NonFiniteLossError(f"the step's {what} (nan_policy='raise')")
        if self.nan_policy == "skip":
            warnings.warn(f"{what}: the step was not applied (nan_policy='skip')",
                          stacklevel=5)
            return False
        warnings.warn(f"{what} (applied: nan_policy='apply')", stacklevel=5)
        return True

    def finish(self, program: Program, out, new_state, ok, loss, others, state,
               loss_scale: DynamicLossScale | None = None):
        """The step's output once its update was computed: the NNX objects among
        ``others`` updated to ``new_state``, unless ``ok`` is false (``nan_policy``; a
        loss-scaled step's overflow lowers the scale), when a pytree step's output
        carries the ``state`` it was given."""
        if _overflowed(loss_scale, ok, loss) or not self.may_apply(ok, loss):
            return _withheld(program, out, jax.tree.leaves(state))
        if new_state is not None:
            update_objects(others, new_state)
        return out

    def settle(self, program: Program, out, new_state, provided, others, state,
               loss_scale: DynamicLossScale | None = None):
        """:meth:`finish` for an update run on ``provided`` value and gradients (checked
        here: they were computed elsewhere)."""
        value, grads = provided
        value = value[0] if program.call.has_aux else value
        ok, loss = self.health(program, out, new_state, _all_finite_jit((value, grads)),
                               value)
        return self.finish(program, out, new_state, ok, loss, others, state, loss_scale)


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
        program.summed_outputs, program.normalized_outputs  # noqa: B018
        program.per_sample_outputs  # noqa: B018
        program.update_batch_reads  # noqa: B018
    why = program.sample_coupling if cuts else None
    gap = program.sample_gap if cuts and not why else None
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
        return PipelineStep(plan, program, PipelineRunner(plan, devices, program), guard)
    if len(plan.pipelines) == 1:
        return SpmdStep.compile(plan, devices, program, others, batch, guard)
    return SharesStep.compile(plan, devices, program, others, batch, guard)


@dataclasses.dataclass
class SpmdStep:
    """A single-pipeline, single-stage plan: one jitted SPMD step."""

    plan: Plan
    program: Program
    step: Any  # (state, batch, loss scale) -> (output, new NNX state, used_vg, (ok, loss))
    shardings: Any  # state
    batch_shardings: Any
    guard: Guard
    loss_scale: DynamicLossScale | None  # float16 stages (Plan.loss_scaled)

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
        s_shard = state_shardings(step_state(program, others), plan, mesh)

        def pure(state, batch, *scale):  # the loss scale: loss-scaled plans only
            with entered(used=False, finite=None, value=None,
                         loss_scale=scale[0] if scale else None) as ctx:
                out, objs = call_step(program, state, batch)
                used = jnp.asarray(bool(ctx.used))
                finite, value = ctx.finite, ctx.value
            new = None
            if program.kind == "nnx":
                new = jax.lax.with_sharding_constraint(nnx.state(tuple(objs)), s_shard)
            return out, new, used, guard.health(program, out, new, finite, value)
        scaled = (NamedSharding(mesh, PartitionSpec()),) if plan.loss_scaled else ()
        jitted = jax.jit(rewriting(pure, plan, mesh), in_shardings=(s_shard, b_shard, *scaled))
        return cls(plan, program, jitted, s_shard, b_shard, guard, _loss_scale(plan))

    def run(self, others, batch):
        program = self.program
        batch = jax.device_put(batch, self.batch_shardings)
        state = jax.device_put(step_state(program, others), self.shardings)
        scale = (np.float32(self.loss_scale.scale),) if self.loss_scale else ()
        out, new_state, used_vg, (ok, loss) = self.step(state, batch, *scale)
        if program.kind == "nnx" and not bool(used_vg) and not self.guard.warned_vg \
                and program.changes_parameters:  # (an evaluation step differentiates none)
            self.guard.warned_vg = True
            warnings.warn("the step's differentiation was not seen by hetshard (a transform "
                          "made outside the step and passed in, or called from a helper "
                          "in another module that imported it by name): hetshard restricts "
                          "itself to single-stage plans for it (call nnx.value_and_grad "
                          "or hetshard.value_and_grad in the step)", stacklevel=4)
        return self.guard.finish(program, out, new_state, ok, loss, others, state,
                                 self.loss_scale)

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
    apply: Any  # jitted (state, batch, provided) -> (output, new NNX state)
    guard: Guard
    loss_scale: DynamicLossScale | None
    timing: tuple = (False, {})  # (on, injected delays per (pipeline, 0))
    clock: dict | None = None

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
            # Each pipeline's loss with its stage's layouts and remat (the SPMD rewrite).
            scaled = (NamedSharding(mesh, PartitionSpec()),) if plan.loss_scaled else ()
            cap = jax.jit(rewriting(capture, sub, mesh), in_shardings=(s_shard, b_shard,
                                                                         *scaled))
            shares.append(_Share(p.batch_share, mesh, s_shard, b_shard, cap))
        # The combined update is applied once, on the first pipeline's devices; the next
        # step hands every pipeline a copy of the updated state.
        return cls(plan, program, shares, jax.jit(providing_whole(program)), guard,
                   _loss_scale(plan))

    def run(self, others, batch):
        program = self.program
        state = step_state(program, others)
        start, results, states = 0, [], []
        scale = (np.float32(self.loss_scale.scale),) if self.loss_scale else ()
        timed, delays = self.timing
        clock = {}
        for pi, share in enumerate(self.shares):
            part = jax.tree.map(lambda x, a=start, n=share.size: x[a:a + n], batch)
            st = jax.device_put(state, share.shardings)
            bt = jax.device_put(part, share.batch_shardings)
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
        # (``Program.piece_weights``: a loss output that sums over the samples adds its
        # pieces, and a summed loss's gradients; a masked mean's weigh their shares of
        # its count; an integer output that does not sum is the first share's; a
        # per-sample output's pieces are concatenated in the batch's order).
        home = NamedSharding(self.shares[0].mesh, PartitionSpec())
        summed, per_sample = program.summed_outputs, program.per_sample_outputs
        bounds = np.cumsum([0] + [s.size for s in self.shares])
        weights = program.piece_weights(jax.tree.leaves(batch),
                                        list(zip(bounds[:-1], bounds[1:], strict=True)))
        values = grads = tree = None
        for res, w in zip(results, weights, strict=True):
            value, g = jax.device_put(res, home)
            leaves, tree = jax.tree.flatten(value)
            leaves = [x if (summed and summed[k]) or k in per_sample else
                      (x * float(w[k]) if jnp.issubdtype(x.dtype, jnp.inexact) else
                       (x if values is None else jnp.zeros_like(x)))
                      for k, x in enumerate(leaves)]
            g = jax.tree.map(lambda a, w=float(w[0]): a * w, g)
            if values is None:
                values, grads = leaves, g
                continue
            values = [stage_fns.joined([a, x], per_sample[k], home) if k in per_sample
                      else a + x for k, (a, x) in enumerate(zip(values, leaves, strict=True))]
            grads = jax.tree.map(jnp.add, grads, g)
        combined = (jax.tree.unflatten(tree, values), grads)
        reads = [replicated(leaf, self.shares[0].mesh) for i, leaf in
                 enumerate(jax.tree.leaves(batch)) if i in set(program.update_batch_reads)]
        out, new_state = self.apply(states[0], reads, combined)
        return self.guard.settle(program, out, new_state, combined, others, state,
                                 self.loss_scale)

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

        def may_apply(out, finite, loss) -> bool:
            return self.guard.may_apply(finite, loss)
        out, new_state = runner.step(runner.state_of(others), batch, may_apply)
        if new_state is not None and self.program.kind == "nnx":
            update_objects(others, new_state)
        return out

    def state_shardings(self):
        runner = self.runner
        leaves = [runner.runs[0][runner.owner[0].get(i, 0)].shardings[i]
                  for i in range(len(runner.state_avals))]
        return jax.tree.unflatten(self.program.state_tree, leaves)

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
        return apply(state, jax.tree.unflatten(program.batch_tree, leaves), provided)
    return whole


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
        objs = list(nnx.merge(program.graphdef, state))
    else:
        objs = list(state)
    out = program.step(*program.with_batch(objs, batch))
    return out, program.without_batch(objs)


# ---- the loss among the outputs -----------------------------------------------------------

_all_finite_jit = jax.jit(all_finite)


def _scalar(x) -> jax.Array:
    """A loss output as one float32 number (the mean of a non-scalar one)."""
    return jnp.mean(jnp.asarray(x, jnp.float32))


def find_loss(out, key: str | int | None = None, where: str = "hetshard.jit"):
    """The step's loss among its outputs: the leaf at ``key`` (a path such as ``"loss"``
    or ``"metrics/loss"``, or a position in a tuple output); by default the one leaf named
    ``loss``, else a scalar output or the first leaf of a tuple output. None: by default,
    when no output is the loss.

    Raises:
      SpecError: ``key`` names no output leaf (the message lists the paths there are).
    """
    flat = jax.tree_util.tree_flatten_with_path(out)[0]
    if key is not None:
        for path, x in flat:
            if path_string(path) == str(key):
                return x
        raise SpecError("loss_output", key, f"a path of the step's output among "
                        f"{[path_string(p) for p, _ in flat]}", where=where)
    named = [x for path, x in flat
             if path and str(getattr(path[-1], "key", getattr(path[-1], "name", ""))).lower()
             == "loss"]
    if named:
        return named[0] if len(named) == 1 else None
    if flat and not any(hasattr(k, "key") or hasattr(k, "name") for p, _ in flat for k in p):
        x = flat[0][1]
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact) and not np.ndim(x):
            return x
    return None


def _state_in_output(program: Program, out) -> list:
    """The leaves of a pytree step's output that are its new state."""
    _, mapping = program.state_outputs()
    leaves = jax.tree.leaves(out)
    return [leaves[m] for m in mapping if m is not None]


def _withheld(program: Program, out, old_state_leaves):
    """A pytree step's output with the state it returns put back to what it was given
    (the update refused); an NNX step's output as it is."""
    if program.kind == "nnx":
        return out
    tree, mapping = program.state_outputs()
    leaves = jax.tree.leaves(out)
    for i, m in enumerate(mapping):
        if m is not None:
            leaves[m] = old_state_leaves[i]
    return jax.tree.unflatten(tree, leaves)


def _loss_scale(plan: Plan) -> DynamicLossScale | None:
    return DynamicLossScale() if plan.loss_scaled else None


def _overflowed(scale: DynamicLossScale | None, finite, loss) -> bool:
    """True when a loss-scaled step's gradients overflowed under a finite loss: the step
    is skipped and the scale lowered (``DynamicLossScale.overflowed``)."""
    return scale is not None and scale.overflowed(bool(finite), bool(np.isfinite(float(loss))))
