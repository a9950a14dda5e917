"""A step assembled from micro-steps of other shapes: the runtime's per-batch doors.

``hetshard.data`` runs one training step as several pieces, each with its own batch
shape and plan (buckets of packed rows, groups of GPUs): the value and gradients of
each piece under its plan (:meth:`MicroSteps.grads_under`), summed and applied once
(:meth:`MicroSteps.apply_grads`), or pipeline passes of different shapes walked as one
pipeline (:meth:`MicroSteps.run_passes`). A ``@hetshard.jit`` step holds one
:class:`MicroSteps` (``HetshardJit.micro_steps``), which shares the step's function,
non-finite policy and devices; the data runners reach it through
``hetshard.data.runner.micro_steps(step)``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from hetshard._plan import Plan
from hetshard.collectives import put
from hetshard.errors import SpecError
from hetshard.ir.program import Program, batch_positions, path_string, user_errors
from hetshard.ir.trees import batch_of
from hetshard.layout import batch_sharding, leaf_spec, stage_mesh, state_shardings
from hetshard.meshes import no_ambient_mesh, untyped
from hetshard.runtime.executable import (
    PlanNotExecutableError,
    capturing,
    providing,
    rewriting,
    settled,
    step_state,
    update_objects,
)
from hetshard.runtime.guard import Carry, Guard, branches


def split_args(args, batch_argnums, where: str = "hetshard.jit"):
    """(the batch's positions among a step's ``args``, the batch, the other
    arguments)."""
    if not args:
        raise SpecError("args", "()", "the step's arguments, the batch among them",
                        where=where)
    pos = batch_positions(args, batch_argnums)
    return (pos, batch_of(with_untyped(args, pos), pos),
            tuple(a for i, a in enumerate(args) if i not in pos))


def with_untyped(args, pos) -> tuple:
    """``args`` with the batch arguments (at ``pos``) free of typed mesh axes."""
    return tuple(untyped(a) if i in pos else a for i, a in enumerate(args))


def _laid_as_state(fn, plan: Plan, mesh, state, batch):
    """Per output leaf of ``fn(state, batch)`` (a value and gradients), the layout
    ``leaf_spec`` gives a state leaf of its path and shape under ``plan``: each gradient
    as its parameter, a scalar value replicated."""
    specs = {name: tuple(e) for name, e in plan.pipelines[0].stages[0].shardings}
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, leaf_spec(
            path_string(p), x.shape, specs, mesh,
            over_context=plan.context.shard_state)),
        jax.eval_shape(fn, state, batch))


def _same_arrays(refs, objects) -> bool:
    """Whether ``objects`` hold exactly the arrays ``refs`` (weak references) name."""
    leaves = jax.tree.leaves(objects)
    return len(refs) == len(leaves) and all(
        r() is x for r, x in zip(refs, leaves, strict=True))


@dataclasses.dataclass(frozen=True)
class _Placed:
    """The step's state as last placed on one device set (``MicroSteps._state_on``):
    weak references to the arrays it was placed from, the layout, and the copy."""

    sources: tuple
    shardings: object
    state: object


class MicroSteps:
    """The per-batch doors of one ``@hetshard.jit`` step (see the module docstring).

    Args:
      fn: the step.
      batch_argnums, batch_reductions: the step's (``hetshard.jit``'s).
      guard: the step's non-finite policy (shared with its whole steps).
      signature: what programs are cached by (the step's argument signatures).
      devices: the cluster's bound devices, asked when a plan is first compiled (a
        re-plan on another cluster binds anew).
    """

    def __init__(self, fn, batch_argnums, batch_reductions: str, guard: Guard,
                 signature: Callable, devices: Callable[[], list]):
        self.fn = fn
        self.batch_argnums = batch_argnums
        self.batch_reductions = batch_reductions
        self.guard = guard
        self._signature = signature
        self.devices = devices
        self._programs: dict = {}  # traced programs per argument signature
        self._captures: dict = {}  # grads_under: (signature, plan) -> compiled
        self._apply: dict = {}  # apply_grads: signature -> compiled update
        # grads_under: the state as last placed on a device set, with weak references to
        # the arrays it was placed from (reused while the objects hold those arrays)
        self._placed: dict[tuple, _Placed] = {}
        self._passes: dict = {}  # (args' signature, plan) -> PipelineRunner (run_passes)
        # the non-finite policy's flag of steps made of micro-steps or passes (on the
        # devices that decide it: apply_grads's home, run_passes' first loss stage)
        self._carry = Carry()

    def program_for(self, *args) -> Program:
        """The traced step for arguments of these shapes (cached by their signature)."""
        return self._program(args, self._signature(args))

    def _program(self, args, sig: str) -> Program:
        got = self._programs.get(sig)
        if got is None:
            pos, batch, _ = split_args(args, self.batch_argnums)
            args = with_untyped(args, pos)
            with user_errors(self.fn, batch, "hetshard.jit"):
                got = Program(self.fn, args, batch_argnums=pos,
                              batch_reductions=self.batch_reductions)
            if got.call is None:
                raise PlanNotExecutableError(
                    f"micro-steps need a step whose loss call hetshard sees, and "
                    f"{got.call_error}")
            self._programs[sig] = got
        return got

    def grads_under(self, plan: Plan, *args):
        """``(value, gradients)`` of the step's ``hetshard.value_and_grad`` loss on
        ``args`` run under ``plan`` (one pipeline of one stage: its devices, data,
        tensor and context axes), left on the plan's mesh; nothing is updated. Compiled
        once per plan and argument shapes. Summed over micro-steps and handed to
        :meth:`apply_grads`, this is one step made of batches of different shapes
        (``hetshard.data.run_batch_plan``)."""
        if len(plan.pipelines) != 1 or len(plan.pipelines[0].stages) != 1:
            raise PlanNotExecutableError("grads_under takes a plan of one pipeline of one "
                                         f"stage, not {[len(p.stages) for p in plan.pipelines]}")
        with no_ambient_mesh():
            sig = self._signature(args)
            program = self._program(args, sig)
            _, batch, others = split_args(args, self.batch_argnums)
            key = (sig, plan.what_runs())
            got = self._captures.get(key)
            if got is None:
                n = program.layering(2, plan.split_blocks).num_layers
                st = plan.pipelines[0].stages[0]
                if (st.start, st.end) != (0, n):
                    raise SpecError("plan.pipelines[0].stages[0]", (st.start, st.end),
                                    f"the program's layers (0, {n})", where="grads_under")
                mesh = stage_mesh(plan, self.devices())
                s_shard = state_shardings(step_state(program, others), plan, mesh)
                b_shard = batch_sharding(batch, plan, mesh)
                fn = rewriting(capturing(program), plan, mesh)
                # Gradients laid out as their parameters (reduce-scattered): left to
                # XLA, some come back whole on every device (all-reduced).
                out = _laid_as_state(fn, plan, mesh, step_state(program, others), batch)
                got = (jax.jit(fn, in_shardings=(s_shard, b_shard), out_shardings=out),
                       s_shard, b_shard)
                self._captures[key] = got
            f, s_shard, b_shard = got
            return f(self._state_on(program, others, s_shard),
                     put(batch, b_shard))

    def _state_on(self, program: Program, others, shardings):
        """The step's state (``step_state``) placed on ``shardings``: placed once and
        reused while the objects hold the same arrays (a step's micro-steps on one group
        read one copy: neither the NNX graph walk nor the transfer again); one placement
        kept a device set (the group's copy of the state), replaced when the arrays or
        the layout change, dropped when the step's update is applied (``apply_grads``)."""
        leaves = jax.tree.leaves(others)
        mine = jax.tree.leaves(shardings)
        if not mine or not all(isinstance(x, jax.Array) for x in leaves):
            # (numpy leaves can change in place: placed every call)
            return put(step_state(program, others), shardings)
        where = tuple(sorted(d.id for d in mine[0].mesh.devices.flat))
        hit = self._placed.get(where)
        if hit is not None and hit.shardings is shardings and \
                _same_arrays(hit.sources, others):
            return hit.state
        self._placed.pop(where, None)  # the old copy goes before the new one is made
        placed = put(step_state(program, others), shardings)
        self._placed[where] = _Placed(tuple(weakref.ref(x) for x in leaves), shardings,
                                      placed)
        return placed

    def apply_grads(self, value_and_grads, *args):
        """Runs the step on ``args`` with ``hetshard.value_and_grad`` returning
        ``value_and_grads`` (e.g. the sum of :meth:`grads_under` over a batch's
        micro-steps) instead of computing them: the update is applied to the NNX objects
        (skipped, with the step's ``nan_policy``, when they are not finite); returns the
        step's output."""
        self.guard.poll()
        placed, self._placed = self._placed, {}  # the step's micro-steps are done
        with no_ambient_mesh():
            sig = self._signature(args)
            program = self._program(args, sig)
            _, batch, others = split_args(args, self.batch_argnums)
            leaf = jax.tree.leaves(value_and_grads)[0]
            home = NamedSharding(leaf.sharding.mesh, PartitionSpec()) \
                if isinstance(leaf.sharding, NamedSharding) else leaf.sharding
            # Gradients already on the home devices keep their layout (sharded as the
            # state a micro-step held); the state is the copy the micro-steps on these
            # devices read, where they read the arrays the objects hold now.
            ids = {d.id for d in home.device_set}

            def keep(x):
                sh = getattr(x, "sharding", None)
                return sh if isinstance(sh, NamedSharding) and \
                    {d.id for d in sh.device_set} == ids else home
            provided = put(value_and_grads, jax.tree.map(keep, value_and_grads))
            hit = placed.get(tuple(sorted(ids)))
            state = hit.state if hit is not None and _same_arrays(hit.sources, others) \
                else put(step_state(program, others), home)
            if sig not in self._apply:
                self._apply[sig] = jax.jit(settled(
                    program, self.guard, self._carry, providing(program),
                    branches(home.device_set)))
            # (the carry follows the home devices: async, and free where it is already)
            halted = jax.device_put(self._carry.halted, home)
            out, new_state, halted, _, report = self._apply[sig](
                state, put(batch, home), provided, halted, {})
            self._carry.take(halted, {})
            self.guard.record(report, self._carry)
            if new_state is not None:
                update_objects(others, new_state)
            return out

    def run_passes(self, passes, order):
        """One step made of pipeline passes of different batch shapes, walked as one
        pipeline (``hetshard.runtime.mixed``): ``passes`` lists ``(plan, args)``, each a
        plan of one pipeline on the same stages and the step's arguments with that pass's
        batch (its micro-batches in order); ``order`` lists ``(pass, micro-batch)`` in the
        order they enter the pipeline. The passes' gradients and loss outputs add up (the
        batches weighted for it: ``hetshard.data.packed_arrays(target_tokens=)``), the
        update is applied once, on the NNX objects of the first pass's arguments (skipped,
        with the step's ``nan_policy``, when not finite); returns the step's output. A
        (plan, shape) pair compiles once (``hetshard.data.run_pipeline_batch_plan``)."""
        from hetshard.runtime.mixed import mixed_step
        from hetshard.runtime.pipeline import PipelineRunner
        if not passes:
            raise SpecError("passes", [], "at least one (plan, args) pass",
                            where="run_passes")
        self.guard.poll()
        with no_ambient_mesh():
            runners, batches = [], []
            for plan, args in passes:
                sig = self._signature(args)
                program = self._program(args, sig)
                key = (sig, plan.what_runs())
                runner = self._passes.get(key)
                if runner is None:
                    runner = PipelineRunner(plan, self.devices(), program, self.guard)
                    self._passes[key] = runner
                runners.append(runner)
                batches.append(split_args(args, self.batch_argnums)[1])
            _, _, others = split_args(passes[0][1], self.batch_argnums)
            lead = runners[0]
            lead.carry = self._carry  # the step's flag, whichever runner decides
            out, new_state = mixed_step(runners, batches, order, lead.state_of(others))
            self.guard.record(lead.report, self._carry)
            if lead.program.kind == "nnx":
                update_objects(others, new_state)
            return out
