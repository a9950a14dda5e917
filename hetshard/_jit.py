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

import contextlib
import dataclasses
import functools
import os
import sys
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hetshard import cache
from hetshard._plan import Plan
from hetshard._version import __version__
from hetshard.autodiff import is_graph
from hetshard.cluster.spec import Cluster
from hetshard.collectives import put
from hetshard.cost.calibration import DEFAULT
from hetshard.cost.profile import profile_program
from hetshard.distributed import agree, from_first
from hetshard.errors import (
    HetshardError,
    SpecError,
    StepTraceError,
)
from hetshard.ir.program import (
    BATCH_REDUCTIONS,
    Program,
    batch_of,
    batch_positions,
    check_batch,
    path_string,
)
from hetshard.layout import batch_sharding, leaf_spec, stage_mesh, state_shardings
from hetshard.meshes import no_ambient_mesh, untyped
from hetshard.runtime.executable import (  # noqa: F401 (the errors: re-exported)
    Executable,
    PlanNotExecutableError,
    capturing,
    compile_plan,
    providing,
    rewriting,
    settled,
    step_state,
    update_objects,
)
from hetshard.runtime.guard import (  # noqa: F401 (re-exported)
    NAN_POLICIES,
    Carry,
    Guard,
    NonFiniteLossError,
    branches,
    find_loss,
)
from hetshard.runtime.ownership import pipeline_obstacle
from hetshard.solver import PlannerOptions, make_plan
from hetshard.solver.shardings import expert_shardings, fill_missing_shardings


@contextlib.contextmanager
def _tracing(step, batch, where: str):
    """Re-raises an exception from the user's own code, while hetshard traces the step,
    as a StepTraceError naming the step and the batch's shapes (hetshard's own errors and
    failures inside hetshard pass unchanged)."""
    try:
        yield
    except HetshardError:
        raise
    except Exception as e:
        if not _raised_in_user_code(e):
            raise
        shapes = {path_string(p) or "batch": tuple(np.shape(x)) for p, x in
                  jax.tree_util.tree_flatten_with_path(batch)[0]}
        name = getattr(step, "__qualname__", type(step).__name__)
        raise StepTraceError(
            f"{where}: the step {name!r} raised while hetshard traced it with batch shapes "
            f"{shapes}: {type(e).__name__}: {e} (the step must run on these arguments "
            f"under jax.jit; the traceback above is the step's)") from e


_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep
                   for m in (jax, nnx, np, __import__("hetshard")))


def _raised_in_user_code(e: BaseException) -> bool:
    """Whether a frame of ``e``'s traceback is the user's: not hetshard's, JAX's, Flax's,
    NumPy's or the standard library's."""
    stdlib = os.path.dirname(os.__file__) + os.sep
    tb = e.__traceback__
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        if not f.startswith(_LIBRARIES + (stdlib,)) and not f.startswith("<"):
            return True
        tb = tb.tb_next
    return False


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
    with no_ambient_mesh(), _tracing(step, batch, "hetshard.plan"):
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
      planner_options: PlannerOptions fields (time_limit_s, tp_options, ...).
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
    """The step's state as last placed on one device set (``HetshardJit._state_on``):
    weak references to the arrays it was placed from, the layout, and the copy."""

    sources: tuple
    shardings: object
    state: object


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
        # hetshard.data micro-steps: traced programs, captures per (shapes, plan), apply
        self._programs: dict = {}
        self._captures: dict = {}
        self._apply: dict = {}
        self._signature = _Signatures()
        # grads_under: the state as last placed on a device set, with weak references to
        # the arrays it was placed from (reused while the objects hold those arrays)
        self._placed: dict[tuple, _Placed] = {}
        self._passes: dict = {}  # (args' signature, plan) -> PipelineRunner (run_passes)
        # the non-finite policy's flag of steps made of micro-steps or passes (on the
        # devices that decide it: apply_grads's home, run_passes' first loss stage)
        self._carry = Carry()
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
        pos, batch, others = self._split_args(args)
        args = self._with_untyped(args, pos)
        size = check_batch(batch)
        if self.global_batch is not None and size != self.global_batch:
            raise SpecError("batch", f"leading dimension {size}",
                            f"global_batch={self.global_batch}", where="hetshard.jit")
        sig = self._signature(args)
        entry = self._compiled.get(sig)
        if entry is None:
            with _tracing(self.fn, batch, "hetshard.jit"):
                program = Program(self.fn, args, batch_argnums=pos,
                                  batch_reductions=self.batch_reductions)
                if self.guard.loss_output is not None:  # a wrong path: refused before planning
                    find_loss(program.output_shape, self.guard.loss_output)
                plan = self._plan_for(program, size)
            if jax.process_count() > 1:  # every process must run the same plan
                if self.pinned is None:  # planned here: process 0's plan is the one
                    plan = Plan.from_json(from_first(plan.to_json()), source="process 0")
                agree(plan.what_runs(), "plan")
            if self._bound is None:
                self._bound = self.cluster.bind()
            entry = compile_plan(plan, self._bound.devices, program, others, batch,
                                 self.guard)
            if self._timing[0]:
                entry.time(*self._timing)
            self._compiled[sig] = entry
            self.plan, self.program = plan, program
        return entry, others, batch

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

    # ---- a step assembled from micro-steps of other shapes (hetshard.data) --------------
    def _split_args(self, args):
        """(the batch's positions among ``args``, the batch, the other arguments)."""
        if not args:
            raise SpecError("args", "()", "the step's arguments, the batch among them",
                            where="hetshard.jit")
        pos = batch_positions(args, self.batch_argnums)
        return (pos, batch_of(self._with_untyped(args, pos), pos),
                tuple(a for i, a in enumerate(args) if i not in pos))

    @staticmethod
    def _with_untyped(args, pos) -> tuple:
        return tuple(untyped(a) if i in pos else a for i, a in enumerate(args))

    def program_for(self, *args) -> Program:
        """The traced step for arguments of these shapes (cached by their signature)."""
        return self._program(args, self._signature(args))

    def _program(self, args, sig: str) -> Program:
        got = self._programs.get(sig)
        if got is None:
            pos, batch, _ = self._split_args(args)
            args = self._with_untyped(args, pos)
            with _tracing(self.fn, batch, "hetshard.jit"):
                got = Program(self.fn, args, batch_argnums=pos,
                                  batch_reductions=self.batch_reductions)
            if got.call is None:
                raise PlanNotExecutableError(
                    f"micro-steps need a step whose loss call hetshard sees, and "
                    f"{got.call_error}")
            self._programs[sig] = got
        return got

    def profile(self, *args):
        """The cost model's :class:`~hetshard.cost.profile.ModelProfile` of this step on
        arguments of these shapes (traced from the program itself): what the planner
        prices, and what ``hetshard.data.group_costs`` takes."""
        with no_ambient_mesh():
            return profile_program(self.program_for(*args))

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
            _, batch, others = self._split_args(args)
            key = (sig, plan.what_runs())
            got = self._captures.get(key)
            if got is None:
                n = program.layering(2, plan.split_blocks).num_layers
                st = plan.pipelines[0].stages[0]
                if (st.start, st.end) != (0, n):
                    raise SpecError("plan.pipelines[0].stages[0]", (st.start, st.end),
                                    f"the program's layers (0, {n})", where="grads_under")
                if self._bound is None:
                    self._bound = self.cluster.bind()
                mesh = stage_mesh(plan, self._bound.devices)
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
            _, batch, others = self._split_args(args)
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
                    if self._bound is None:
                        self._bound = self.cluster.bind()
                    runner = PipelineRunner(plan, self._bound.devices, program, self.guard)
                    self._passes[key] = runner
                runners.append(runner)
                batches.append(self._split_args(args)[1])
            _, _, others = self._split_args(passes[0][1])
            lead = runners[0]
            lead.carry = self._carry  # the step's flag, whichever runner decides
            out, new_state = mixed_step(runners, batches, order, lead.state_of(others))
            self.guard.record(lead.report, self._carry)
            if lead.program.kind == "nnx":
                update_objects(others, new_state)
            return out

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
