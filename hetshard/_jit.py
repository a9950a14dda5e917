"""``@hetshard.jit``: trace, plan (or load a cached plan), compile and run a train step.

The step is the user's own: any NNX model and ``nnx.Optimizer``, or pytrees (a params
dict and an optax state), and a batch. On the first call (and each new argument
signature) it is captured as a :class:`~hetshard.ir.program.Program`, planned for the
cluster (``hetshard.solver.make_plan``; the plan cache is keyed by the program's
fingerprint) and compiled. Every plan kind runs:

* one pipeline of one stage: one SPMD program on the stage's mesh (data, FSDP, tensor
  and mixed per-op shardings);
* several single-stage pipelines with uneven batch shares: each computes its share's
  value and gradients on its submesh, combined weighted by share, the update applied once;
* pipelines of several stages (MPMD): ``hetshard.runtime.pipeline`` -- stage programs on
  their own submeshes under 1F1B, per-stage optimizer updates; in a multi-process job
  (``jax.distributed``) several pipelines always take this route, each process running
  the programs of the stages on its devices.

Pipeline plans need the step's loss call (``nnx``/``jax`` ``value_and_grad`` or
``grad`` called in the step, which hetshard answers, or ``hetshard.value_and_grad``);
for a step without one it sees, the planner is restricted to single-stage plans (a
warning says so once).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hetshard import cache
from hetshard._plan import Plan
from hetshard._version import __version__
from hetshard.autodiff import is_graph
from hetshard.cluster.spec import Cluster
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.profile import profile_program
from hetshard.distributed import agree, from_first
from hetshard.errors import SpecError
from hetshard.ir.program import (
    BATCH_REDUCTIONS,
    Program,
    batch_positions,
    check_batch,
    user_errors,
)
from hetshard.ir.trees import batch_of
from hetshard.meshes import no_ambient_mesh
from hetshard.runtime.executable import Executable, PlanNotExecutableError, compile_plan
from hetshard.runtime.guard import Guard, find_loss
from hetshard.runtime.micro_steps import MicroSteps, split_args, with_untyped
from hetshard.runtime.ownership import pipeline_obstacle
from hetshard.solver import PlannerOptions, make_plan
from hetshard.solver.shardings import expert_shardings, fill_missing_shardings


def plan(step, *args, cluster, batch_argnums: int | tuple[int, ...] | None = None,
         global_batch: int | None = None, calibration=None, batch_reductions: str = "whole",
         shardings: bool = True, **planner_options) -> Plan:
    """The plan ``hetshard.jit`` would run ``step(*args)`` with on ``cluster``.

    ``args`` are the step's arguments (NNX objects or pytrees, shape-only ones included:
    ``nnx.eval_shape``/``jax.ShapeDtypeStruct``, so a 175B model plans without weights);
    the batch is ``args[batch_argnums]`` (as ``hetshard.jit``'s ``batch_argnums`` and
    ``batch_reductions``), and ``global_batch`` defaults to its leading size. ``step`` may
    instead be a :class:`hetshard.Program` (a step already traced), given without
    ``args``. ``planner_options`` are ``PlannerOptions`` fields, ``search`` (a
    ``SearchEffort`` or a mapping of its fields) and ``options`` (a whole
    ``PlannerOptions`` the other keywords change). ``shardings=False`` leaves the
    per-weight layouts unsolved (faster; ``hetshard.jit`` solves them when it runs the
    plan).

    Raises:
      SpecError: an unknown planner option, a batch without one leading size.
      NoFeasiblePlanError: nothing fits the cluster.
    """
    if "batch_argnum" in planner_options:
        raise SpecError("batch_argnum", planner_options["batch_argnum"],
                        "batch_argnums (one spelling, hetshard.jit's)", where="hetshard.plan")
    options = PlannerOptions.from_fields(planner_options, "hetshard.plan")
    if isinstance(step, Program):
        if args or batch_argnums is not None:
            raise SpecError("args", f"{len(args)} arguments, batch_argnums={batch_argnums}",
                            "none with a Program (it holds its arguments)",
                            where="hetshard.plan")
        program, batch = step, None
    else:
        batch = batch_of(args, batch_positions(args, batch_argnums, "hetshard.plan")) \
            if args else None
        program = None
    with no_ambient_mesh(), user_errors(step, batch, "hetshard.plan"):
        if program is None:
            program = Program(step, args, batch_argnums=batch_argnums,
                              batch_reductions=batch_reductions)
        options, why = _restricted(options, program)
        if why:
            warnings.warn(why, stacklevel=2)
        return make_plan(program, Cluster.load(cluster), global_batch=global_batch,
                         options=options, calibration=calibration, shardings=shardings)


def _restricted(options, program: Program) -> tuple[PlannerOptions, str | None]:
    """Options limited to what the program can run, and why (None: not limited):
    single-stage plans without the loss call, or where the step's update or outputs
    need every gradient in one place (``pipeline_obstacle``; one pipeline where the
    loss couples the batch's samples); no distributed optimizer for pytree steps (their
    optimizer state cannot be told from the parameters). Per-GPU compute dtypes need the
    loss call (its loss is scaled): asking for them without it is an error."""
    if program.call is None and options.gpu_dtypes != "program":
        raise SpecError("gpu_dtypes", options.gpu_dtypes,
                        "'program' for a step whose loss call hetshard does not see "
                        f"({program.call_error}; float16 stages scale the loss)",
                        where="hetshard.jit")
    why = None

    def single(reason: str, **limits):
        """The options kept to single stages (and pipelines), for ``reason``."""
        if options.min_stages > 1:  # asked for a pipeline this step cannot run
            raise SpecError("min_stages", options.min_stages, f"1 for this step: {reason}",
                            where="hetshard.jit")
        return dataclasses.replace(options, **limits)

    several = options.max_stages != 1 or options.max_pipelines != 1
    if program.call is None and several:
        options = single(f"the step's loss cannot be cut per micro-batch "
                         f"({program.call_error})", max_stages=1, max_pipelines=1)
        # (an evaluation step, which changes no parameter, needs no loss call: no word)
        if program.changes_parameters:
            why = (f"the step's loss cannot be cut per micro-batch ({program.call_error}): "
                   f"hetshard restricts itself to single-stage plans for it")
    elif several:
        found = pipeline_obstacle(program)
        if found is not None:
            reason, one_pipeline = found
            if one_pipeline:
                options = single(reason, max_stages=1, max_pipelines=1)
                why = f"{reason}: hetshard plans one single-stage pipeline for it"
            elif options.max_stages != 1:
                options = single(reason, max_stages=1)
                why = (f"pipeline stages cannot run this step: {reason}; hetshard plans "
                       f"single-stage pipelines for it (pass max_stages=1 to say so)")
    if program.kind == "tree" and options.distributed_optimizer is not False:
        options = dataclasses.replace(options, distributed_optimizer=False)
    return options, why


def jit(fn=None, *, cluster, global_batch: int | None = None,
        batch_argnums: int | tuple[int, ...] | None = None,
        plan: Plan | str | None = None, nan_policy: str = "skip",
        loss_output: str | int | None = None, quiet: bool = False, elastic: bool = False,
        batch_reductions: str = "whole", **planner_options):
    """Compiles ``fn`` (a train step) for ``cluster``; usable as ``@hetshard.jit(...)``.

    Args:
      cluster: a Cluster, preset name, spec path or dict; its GPUs are bound to the JAX
        devices (fake CPU devices stand in for them on CPU).
      global_batch: expected leading batch size (checked on every call).
      batch_argnums: index of the batch argument, or a tuple of them (several arguments
        make one batch). Default: the last positional argument that is not a scalar (a
        trailing RNG key or step counter is skipped), with the plain arrays
        just before it that share its leading size when it is a plain array itself
        (``step(model, optimizer, x, y)``).
      plan: a Plan or a plan JSON path; skips planning (and pins the shapes).
      nan_policy: what a step with a non-finite loss or gradient does, decided on the
        device (the call never waits for it): "skip" (default: the update is not
        applied, NNX state is left bit-identical, a pytree step's returned state is the
        state it was given; a warning), "apply" (a warning) or "raise" (the state is
        kept as before that step, and as before it through every step dispatched after
        it; ``NonFiniteLossError`` from the first call of the step, or of
        :meth:`HetshardJit.wait`, after that step has finished). Warnings likewise come
        from the first call after the step finished. The loss and gradients
        ``hetshard.value_and_grad`` computed are checked whatever the step returns; so
        is the output at ``loss_output``; a step without ``hetshard.value_and_grad`` has
        its new state checked too.
      loss_output: where the loss is in the step's output: a path such as ``"loss"`` or
        ``"metrics/loss"``, or a position in a tuple output. Default: the one output
        named ``loss``, else a scalar output or the first leaf of a tuple output.
      quiet: no line on stderr when planning starts and with the plan chosen (also
        ``HETSHARD_QUIET=1``).
      elastic: when fewer JAX devices are present than ``cluster`` has GPUs (a node
        lost, a job restarted on what is left), plan for the spec's first GPUs that are
        there (``Cluster.shrunk``) instead of failing to bind; a pinned ``plan`` that
        needs a missing device is set aside for a new plan, with a warning. Restore a
        checkpoint into the new plan with ``state_shardings`` (``hetshard.checkpoint``).
      batch_reductions: how a loss that puts values reduced over the batch through a
        non-linear function (a mixture-of-experts balance loss: the product of the
        batch's mean routing share and mean router probability per expert) is taken
        when a plan cuts the batch. ``"whole"`` (default): such a loss keeps its step to
        one single-stage pipeline, which runs the batch whole (a pinned plan that cuts
        it warns). ``"per_piece"``: each micro-batch and batch share computes those
        values from its own samples and the pieces' losses and gradients are weighted by
        their shares, as Megatron-LM and MaxText take the auxiliary loss per
        micro-batch; the step's loss is then the share-weighted mean of the pieces'
        losses, not the whole batch's (a piece's balance term sees only its own tokens).
        A loss that mixes samples otherwise (batch statistics, in-batch negatives) is
        kept whole either way.
      planner_options: PlannerOptions fields (time_limit_s, tp_options, ...), ``search``
        (a ``SearchEffort`` or a mapping of its fields) and ``options`` (a whole
        ``PlannerOptions`` those keywords change), as ``hetshard.plan`` takes them.
    """
    if fn is None:
        return functools.partial(jit, cluster=cluster, global_batch=global_batch,
                                 batch_argnums=batch_argnums, plan=plan,
                                 nan_policy=nan_policy, loss_output=loss_output,
                                 quiet=quiet, elastic=elastic,
                                 batch_reductions=batch_reductions, **planner_options)
    return HetshardJit(fn, cluster, global_batch, batch_argnums, plan, nan_policy,
                       planner_options, loss_output, quiet, elastic, batch_reductions)


def _signature(args) -> str:
    """What the step's programs are cached by: the arguments' structure (NNX objects by
    their state) and each leaf's shape and dtype. Objects of one structure and shapes
    share it."""
    leaves, tree = jax.tree.flatten(jax.tree.map(
        lambda x: (tuple(np.shape(x)), str(jnp.result_type(x))) if hasattr(x, "shape")
        else x, nnx.state(args) if any(is_graph(a) for a in args) else args))
    return f"{tree}|{leaves}"



class _Signatures:
    """:func:`_signature`, fast for arguments seen before. Reading an NNX object's state
    walks its graph (about 40 us a node: some 10 ms for a small model's and optimizer's,
    on every call of a step, every micro-step of a per-batch plan), while flattening the
    objects as pytrees (what NNX modules are) takes a few hundredths of that. So the
    signature is remembered under the pytree structure and leaf shapes: the same objects
    again, unchanged in structure and shapes, find it there; anything else (new objects,
    a graph object that is no pytree, an unhashable leaf) computes it."""

    def __init__(self, size: int = 64):
        self._seen: dict = {}
        self._size = size

    def __call__(self, args) -> str:
        leaves, tree = jax.tree.flatten(args)
        sig = []
        for x in leaves:
            if hasattr(x, "shape") and hasattr(x, "dtype"):
                sig.append((x.shape, x.dtype))
            elif is_graph(x):
                return _signature(args)
            else:
                sig.append(x)
        try:
            key = (tree, tuple(sig))
            got = self._seen.get(key)
        except TypeError:  # an unhashable leaf
            return _signature(args)
        if got is None:
            if len(self._seen) >= self._size:  # keys hold their objects: keep a few
                self._seen.clear()
            got = self._seen[key] = _signature(args)
        return got


class HetshardJit:
    def __init__(self, fn, cluster, global_batch, batch_argnums, plan, nan_policy,
                 planner_options, loss_output=None, quiet=False, elastic=False,
                 batch_reductions="whole"):
        if batch_reductions not in BATCH_REDUCTIONS:
            raise SpecError("batch_reductions", batch_reductions,
                            f"one of {BATCH_REDUCTIONS}", where="hetshard.jit")
        self.batch_reductions = batch_reductions
        self.fn = fn
        self.cluster = Cluster.load(cluster)
        self.global_batch = global_batch
        self.batch_argnums = batch_argnums
        # nan_policy, loss_output: what every executable does with a non-finite step
        self.guard = Guard(nan_policy, loss_output)
        self.quiet = bool(quiet) or os.environ.get("HETSHARD_QUIET", "") not in ("", "0")
        self.options = PlannerOptions.from_fields(planner_options, "hetshard.jit")
        self.pinned = Plan.load(plan) if isinstance(plan, str) else plan
        self.plan: Plan | None = self.pinned
        self.elastic = bool(elastic)
        self._timing = (False, {})  # time_stages: (on, injected delays)
        self._signature = _Signatures()
        # a step made of micro-steps or passes of other shapes (hetshard.data's runners)
        self.micro_steps = MicroSteps(fn, batch_argnums, batch_reductions, self.guard,
                                      self._signature, self._devices)
        if self.elastic:
            self._fit_devices()
        self.program: Program | None = None
        self._compiled: dict[str, Executable] = {}  # per argument signature
        self._bound = None
        functools.update_wrapper(self, fn)

    # ---- planning --------------------------------------------------------------------
    def _plan_for(self, program: Program, batch_size: int) -> Plan:
        if self.pinned is not None:
            if self.pinned.global_batch != batch_size:
                shares = [p.batch_share for p in self.pinned.pipelines]
                raise SpecError("batch", f"leading dimension {batch_size}",
                                f"the pinned plan's global batch {self.pinned.global_batch} "
                                f"(split {shares})", where="hetshard.jit")
            self._check_pinned(program)
            # A stage with a tensor axis and no parameter layouts gets the ones make_plan
            # would write, so it runs tensor-parallel as the simulator prices it.
            self.pinned = fill_missing_shardings(self.pinned, program, self.cluster)
            self.pinned = expert_shardings(self.pinned, program)
            if program.call is not None:  # (a step run whole has no layers to price)
                self.pinned = self._repriced(self.pinned, program)
            return self.pinned
        options, why = _restricted(self.options, program)
        if why and why not in self.guard.warned:
            self.guard.warned.add(why)
            self.guard.warned_vg |= program.call is None  # said here, not again at run
            warnings.warn(why, stacklevel=4)
        key = cache.fingerprint(program.fingerprint, str(batch_size), self.cluster.to_json(),
                                repr(options), repr(DEFAULT), __version__)
        found = cache.load(key)
        if found is not None:
            self._say(f"cached plan for {program.name} (batch {batch_size}): "
                      f"{found.summary()}")
            return found
        self._say(f"planning {program.name} for {self.cluster.name} (batch {batch_size}, "
                  f"{self.cluster.num_devices} devices; up to {options.time_limit_s:g} s; "
                  f"quiet=True hides these lines)")
        plan = make_plan(program, self.cluster, global_batch=batch_size, options=options)
        self._say(f"planned in {plan.solver.wall_time_s:.1f} s: {plan.summary()}")
        cache.store(key, plan)
        return plan

    def _fit_devices(self) -> None:
        """``elastic``: the cluster of the spec's GPUs that have a JAX device."""
        n = len(jax.devices())
        if n >= self.cluster.num_devices:
            return
        shrunk = self.cluster.shrunk(n)
        self._say(f"elastic: {n} of the {self.cluster.num_devices} devices of "
                  f"{self.cluster.name!r} are present; planning for {shrunk.name!r}")
        self.cluster = shrunk
        if self.pinned is not None and any(
                d >= n for p in self.pinned.pipelines for st in p.stages for d in st.devices):
            warnings.warn(f"hetshard.jit(elastic=True): the pinned plan needs devices "
                          f"beyond the {n} present; making a new plan for {shrunk.name!r}",
                          stacklevel=4)
            self.pinned = self.plan = None

    def _say(self, line: str) -> None:
        if not self.quiet and jax.process_index() == 0:
            print(f"hetshard.jit: {line}", file=sys.stderr, flush=True)

    def _repriced(self, plan: Plan, program: Program) -> Plan:
        """A pinned plan with its predictions priced for this program and cluster (what
        ``plan.explain()`` and ``time_stages`` compare against), not the file's: a
        hand-edited plan keeps the times of the plan it was edited from."""
        from hetshard.sim.simulator import priced
        profile = profile_program(program, plan.split_blocks)
        return priced(plan, profile, self.cluster, DEFAULT, trace=False)[0]

    def _check_pinned(self, program: Program):
        """A pinned plan made for another program, sequence length or cluster (one whose
        devices have other GPU types, or are missing, here) is an error."""
        plan = self.pinned
        made_for = Cluster.load(plan.cluster)
        n = self.cluster.num_devices
        for d in sorted({d for pipe in plan.pipelines for st in pipe.stages
                         for d in st.devices}):
            want = made_for.gpu_of(d).name
            here = self.cluster.gpu_of(d).name if d < n else None
            if here != want:
                raise SpecError(
                    "plan.cluster", made_for.name,
                    f"a plan for the cluster hetshard.jit was given ({self.cluster.name!r}); "
                    f"device {d}: {want} in the plan's cluster, "
                    + (f"{here} in {self.cluster.name!r}" if here else
                       f"missing from {self.cluster.name!r} ({n} devices)"),
                    where="hetshard.jit")
        if program.call is None and plan.fingerprint and \
                plan.fingerprint != program.model_fingerprint:
            # Without its loss call hetshard cannot tell the step's parameters and layers
            # (the fingerprint covers them): say so, not "another model".
            cuts = len(plan.pipelines) > 1 or any(len(p.stages) > 1 for p in plan.pipelines)
            raise PlanNotExecutableError(
                f"the pinned plan for {plan.model!r} "
                f"({[len(p.stages) for p in plan.pipelines]} stages per pipeline) cannot "
                f"be matched to this step: hetshard sees no loss call in it "
                f"({program.call_error}), so it cannot tell the step's parameters and "
                f"layers; "
                + ("pipeline plans and several pipelines need a loss call it can cut per "
                   "micro-batch; " if cuts else "")
                + "call nnx.value_and_grad or hetshard.value_and_grad inside the step "
                  "(a transform made outside the step and passed in is not seen)")
        # (A step whose loss cannot be cut runs whole, as one stage: its layers are not
        # what a plan addresses; a pipeline plan for it is refused after this.)
        n = program.layering(2, plan.split_blocks).num_layers if program.call else None
        ends = sorted({p.stages[-1].end for p in plan.pipelines})
        if n is not None and ends != [n] and plan.fingerprint and \
                plan.fingerprint != program.model_fingerprint:
            # the layer count differs because the plan was made for another program
            raise SpecError("plan.fingerprint", plan.fingerprint,
                            f"the fingerprint of the model it is run with "
                            f"({program.model_fingerprint}): the plan was made for another "
                            f"program ({plan.model!r}, whose layers end at {ends}; this "
                            f"one has {n})", where="hetshard.jit")
        if n is not None and ends != [n]:
            raise SpecError("plan.pipelines[*].stages[-1].end", ends,
                            f"the program's {n} layers"
                            + (" (block halves)" if plan.split_blocks else ""),
                            where="hetshard.jit")
        if program.seq_len > 1 and program.seq_len != plan.seq_len:
            raise SpecError("batch", f"sequence length {program.seq_len}",
                            f"the pinned plan's seq_len {plan.seq_len}", where="hetshard.jit")
        if plan.fingerprint and plan.fingerprint != program.model_fingerprint:
            raise SpecError("plan.fingerprint", plan.fingerprint,
                            f"the fingerprint of the model it is run with "
                            f"({program.model_fingerprint}: another model, parameter "
                            f"shapes or batch shapes than the plan's {plan.model!r})",
                            where="hetshard.jit")

    # ---- execution -------------------------------------------------------------------
    def __call__(self, *args):
        """One step, dispatched: returns as soon as the devices have its work (the
        output's arrays are not waited for), as ``jax.jit`` does. What earlier steps'
        non-finite values made of them is said here, once they have finished
        (``nan_policy``; :meth:`wait`)."""
        self.guard.poll()
        # hetshard's programs run on their own submeshes, outside a caller's jax.set_mesh.
        with no_ambient_mesh():
            entry, others, batch = self._prepare(args)
            return entry.run(others, batch)

    def wait(self) -> None:
        """Waits until every dispatched step has finished and says what their non-finite
        values made of them: a warning per non-finite step under ``nan_policy="skip"`` or
        ``"apply"``, ``NonFiniteLossError`` under ``"raise"`` (which the next call of the
        step would otherwise raise). A training loop needs none of this: each call says
        it for the steps finished by then, without waiting."""
        self.guard.poll(block=True)

    def _prepare(self, args):
        """(compiled entry, non-batch arguments, batch) for ``args``: planned and
        compiled on the first call with their shapes."""
        pos, batch, others = split_args(args, self.batch_argnums)
        args = with_untyped(args, pos)
        size = check_batch(batch)
        if self.global_batch is not None and size != self.global_batch:
            raise SpecError("batch", f"leading dimension {size}",
                            f"global_batch={self.global_batch}", where="hetshard.jit")
        sig = self._signature(args)
        entry = self._compiled.get(sig)
        if entry is None:
            with user_errors(self.fn, batch, "hetshard.jit"):
                program = Program(self.fn, args, batch_argnums=pos,
                                  batch_reductions=self.batch_reductions)
                if self.guard.loss_output is not None:  # a wrong path: refused before planning
                    find_loss(program.output_shape, self.guard.loss_output)
                plan = self._plan_for(program, size)
            if jax.process_count() > 1:  # every process must run the same plan
                if self.pinned is None:  # planned here: process 0's plan is the one
                    plan = Plan.from_json(from_first(plan.to_json()), source="process 0")
                agree(plan.what_runs(), "plan")
            entry = compile_plan(plan, self._devices(), program, others, batch, self.guard)
            if self._timing[0]:
                entry.time(*self._timing)
            self._compiled[sig] = entry
            self.plan, self.program = plan, program
        return entry, others, batch

    def _devices(self) -> list:
        """The cluster's devices, bound on first use."""
        if self._bound is None:
            self._bound = self.cluster.bind()
        return self._bound.devices

    def profile(self, *args):
        """The cost model's :class:`~hetshard.cost.profile.ModelProfile` of this step on
        arguments of these shapes (traced from the program itself): what the planner
        prices, and what ``hetshard.data.group_costs`` takes."""
        with no_ambient_mesh():
            return profile_program(self.micro_steps.program_for(*args))

    def state_shardings(self, *args):
        """Where this step keeps the state of ``args`` (a step's arguments, batch
        included) under its plan: per leaf of the non-batch arguments' state (NNX: as
        ``nnx.to_pure_dict(nnx.state(objects))`` nests it), the ``NamedSharding`` the step
        hands it back in; plans and compiles for these shapes first, runs nothing. What
        ``hetshard.checkpoint.Checkpointer.restore(shardings=...)`` reads a checkpoint
        straight into."""
        with no_ambient_mesh():
            entry, others, _ = self._prepare(args)
        tree = entry.state_shardings()
        return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree

    def time_stages(self, on: bool = True, delays: dict | None = None) -> None:
        """Time each pipeline stage's tasks from the next step on (``stage_times``; each
        task then waits for its results, so the pipeline no longer overlaps stages), and
        add ``delays`` ((pipeline, stage) -> seconds per task: a straggler stand-in on
        fake devices). Plans with several stages or several pipelines (a single SPMD
        stage has nothing to compare against)."""
        self._timing = (bool(on), dict(delays or {}))
        for entry in self._compiled.values():
            entry.time(*self._timing)

    def stage_times(self) -> dict:
        """(pipeline, stage) -> seconds busy in the last timed step (``time_stages``)."""
        for entry in self._compiled.values():
            times = entry.stage_times() if entry.plan is self.plan else None
            if times:
                return times
        raise PlanNotExecutableError("stage_times: the step has run no timed plan with "
                                     "several stages or pipelines (call time_stages(), "
                                     "then run a step)")

    def adopt(self, replan) -> None:
        """Runs ``replan.plan`` (``hetshard.elastic.StragglerMonitor``) from the next call:
        the cluster with the straggler's measured speed, the new plan pinned, entries
        compiled for the old plan dropped. The state stays in the caller's objects and
        moves to the new plan's layout at the next call."""
        self.cluster = replan.cluster
        self.pinned = self.plan = replan.plan
        self._compiled.clear()
        self._bound = None
