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

Pipeline plans need the step to call ``hetshard.value_and_grad``; for a step that does
not, the planner is restricted to single-stage plans (a warning says so once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hetshard import cache
from hetshard.autodiff import all_finite, entered, is_graph
from hetshard.cluster.spec import Cluster
from hetshard.errors import HetshardError, SpecError
from hetshard.ir.program import Program, check_batch, path_string
from hetshard.meshes import no_ambient_mesh, untyped
from hetshard.plan import Plan
from hetshard.runtime.precision import DynamicLossScale, stage_autocast
from hetshard.runtime.spmd import batch_sharding, stage_mesh, state_shardings

NAN_POLICIES = ("skip", "apply", "raise")


class PlanNotExecutableError(HetshardError, ValueError):
    """The plan needs something the step does not provide: pipeline plans and several
    pipelines need a step that calls ``hetshard.value_and_grad``."""


class NonFiniteLossError(HetshardError, FloatingPointError):
    """The step's loss was NaN or infinite (``nan_policy="raise"``)."""


class StepTraceError(HetshardError, RuntimeError):
    """The user's step (or its model) raised while hetshard traced it on the arguments it
    was called with; the step's own exception is chained as the cause."""


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


def plan(step, *args, cluster, batch_argnum: int | None = None, global_batch: int | None
         = None, calibration=None, **planner_options) -> Plan:
    """The plan ``hetshard.jit`` would run ``step(*args)`` with on ``cluster``.

    ``args`` are the step's arguments (NNX objects or pytrees, shape-only ones included:
    ``nnx.eval_shape``/``jax.ShapeDtypeStruct``, so a 175B model plans without weights);
    the batch is ``args[batch_argnum]`` (default: the last), and ``global_batch``
    defaults to its leading size. ``planner_options`` are ``PlannerOptions`` fields.

    Raises:
      SpecError: an unknown planner option, a batch without one leading size.
      NoFeasiblePlanError: nothing fits the cluster.
    """
    from hetshard.solver import PlannerOptions, make_plan
    options = _options(PlannerOptions, planner_options, "hetshard.plan")
    with no_ambient_mesh(), _tracing(step, args[-1 if batch_argnum is None else
                                              batch_argnum] if args else None,
                                      "hetshard.plan"):
        program = Program(step, args, batch_argnum=batch_argnum)
        return make_plan(program, Cluster.load(cluster), global_batch=global_batch,
                         options=_restricted(options, program), calibration=calibration)


def _options(cls, given: dict, where: str):
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise SpecError(unknown[0], given[unknown[0]],
                        f"a PlannerOptions field among {sorted(fields)}", where=where)
    return cls(**given)


def _restricted(options, program: Program):
    """Options limited to what the program can run: single-stage plans without the loss
    call; no distributed optimizer for pytree steps (their optimizer state cannot be told
    from the parameters). Per-GPU compute dtypes need the loss call (its loss is
    scaled): asking for them without it is an error."""
    if program.call is None and options.gpu_dtypes != "program":
        raise SpecError("gpu_dtypes", options.gpu_dtypes,
                        "'program' for a step without hetshard.value_and_grad (float16 "
                        "stages scale its loss; use hetshard.value_and_grad)",
                        where="hetshard.jit")
    if program.call is None and (options.max_stages != 1 or options.max_pipelines != 1):
        options = dataclasses.replace(options, max_stages=1, max_pipelines=1)
    if program.kind == "tree" and options.distributed_optimizer is not False:
        options = dataclasses.replace(options, distributed_optimizer=False)
    return options


def jit(fn=None, *, cluster, global_batch: int | None = None, batch_argnums: int | None = None,
        plan: Plan | str | None = None, nan_policy: str = "skip",
        loss_output: str | int | None = None, quiet: bool = False, elastic: bool = False,
        **planner_options):
    """Compiles ``fn`` (a train step) for ``cluster``; usable as ``@hetshard.jit(...)``.

    Args:
      cluster: a Cluster, preset name, spec path or dict; its GPUs are bound to the JAX
        devices (fake CPU devices stand in for them on CPU).
      global_batch: expected leading batch size (checked on every call).
      batch_argnums: index of the batch argument (default: the last positional one).
      plan: a Plan or a plan JSON path; skips planning (and pins the shapes).
      nan_policy: what a step with a non-finite loss or gradient does: "skip" (default:
        a warning, and the update is not applied: NNX state is left as it was, a pytree
        step's returned state is the state it was given), "apply" (a warning) or "raise"
        (``NonFiniteLossError``). The loss and gradients ``hetshard.value_and_grad``
        computed are checked whatever the step returns; so is the output at
        ``loss_output``; a step without ``hetshard.value_and_grad`` has its new state
        checked too.
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
      planner_options: PlannerOptions fields (time_limit_s, tp_options, ...).
    """
    if fn is None:
        return functools.partial(jit, cluster=cluster, global_batch=global_batch,
                                 batch_argnums=batch_argnums, plan=plan,
                                 nan_policy=nan_policy, loss_output=loss_output,
                                 quiet=quiet, elastic=elastic, **planner_options)
    return HetshardJit(fn, cluster, global_batch, batch_argnums, plan, nan_policy,
                       planner_options, loss_output, quiet, elastic)


def _rewriting(fn, plan: Plan, mesh=None):
    """``fn`` run with ``hetshard.value_and_grad`` rewriting the loss as the plan says:
    its attention choice and, given the stage ``mesh`` of a single-stage plan, its
    layer-boundary layouts (``hetshard.rewrite.spmd``), applied before differentiating
    (rewrites precede autodiff)."""
    if mesh is not None:
        from hetshard.rewrite.spmd import constrain_layers
        stage = plan.pipelines[0].stages[0]

        def rewrite(loss):
            return constrain_layers(loss, mesh, stage, attention=plan.attention,
                                    split_blocks=plan.split_blocks,
                                    tp_overlap=plan.tp_overlap, zigzag=plan.context.zigzag,
                                    autocast=stage_autocast(plan, stage),
                                    chunk_lengths=plan.context_chunks(stage) or None)
    elif plan.attention in (None, "reference"):
        rewrite = None
    else:
        from hetshard.rewrite import swap_attention

        def rewrite(loss):
            return swap_attention(loss, plan.attention)

    @functools.wraps(fn)
    def wrapped(*args):
        with entered(rewrite=rewrite):
            return fn(*args)
    return wrapped


def _signature(args) -> str:
    leaves, tree = jax.tree.flatten(jax.tree.map(
        lambda x: (tuple(np.shape(x)), str(jnp.result_type(x))) if hasattr(x, "shape")
        else x, nnx.state(args) if any(is_graph(a) for a in args) else args))
    return f"{tree}|{leaves}"


class HetshardJit:
    def __init__(self, fn, cluster, global_batch, batch_argnums, plan, nan_policy,
                 planner_options, loss_output=None, quiet=False, elastic=False):
        from hetshard.solver import PlannerOptions
        self.fn = fn
        self.cluster = Cluster.load(cluster)
        self.global_batch = global_batch
        self.batch_argnums = batch_argnums
        if nan_policy not in NAN_POLICIES:
            raise SpecError("nan_policy", nan_policy, f"one of {NAN_POLICIES}")
        self.nan_policy = nan_policy
        if loss_output is not None and (isinstance(loss_output, bool) or not isinstance(
                loss_output, (str, int))):
            raise SpecError("loss_output", loss_output,
                            "a path in the step's output (str) or a tuple position (int)",
                            where="hetshard.jit")
        self.loss_output = loss_output
        self.quiet = bool(quiet) or os.environ.get("HETSHARD_QUIET", "") not in ("", "0")
        self.options = _options(PlannerOptions, planner_options, "hetshard.jit")
        self.pinned = Plan.load(plan) if isinstance(plan, str) else plan
        self.plan: Plan | None = self.pinned
        self.elastic = bool(elastic)
        self._timing = (False, {})  # time_stages: (on, injected delays)
        self._share_clock = None
        # hetshard.data micro-steps: traced programs, captures per (shapes, plan), apply
        self._programs: dict = {}
        self._captures: dict = {}
        self._apply: dict = {}
        if self.elastic:
            self._fit_devices()
        self.program: Program | None = None
        self._compiled: dict[str, _Spmd | _Shares | _Mpmd] = {}
        self._bound = None
        self._warned_vg = False
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
            from hetshard.solver.shardings import fill_missing_shardings
            # A stage with a tensor axis and no parameter layouts gets the ones make_plan
            # would write, so it runs tensor-parallel as the simulator prices it.
            self.pinned = fill_missing_shardings(self.pinned, program, self.cluster)
            return self.pinned
        from hetshard import __version__
        from hetshard.cost.calibration import DEFAULT
        from hetshard.solver import make_plan
        options = _restricted(self.options, program)
        if program.call is None and options is not self.options and not self._warned_vg:
            self._warned_vg = True
            warnings.warn(f"the step's loss cannot be cut per micro-batch "
                          f"({program.call_error}): hetshard restricts itself to "
                          f"single-stage plans for it", stacklevel=4)
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
        # (A step whose loss cannot be cut runs whole, as one stage: its layers are not
        # what a plan addresses; a pipeline plan for it is refused after this.)
        n = program.layering(2, plan.split_blocks).num_layers if program.call else None
        ends = sorted({p.stages[-1].end for p in plan.pipelines})
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
        # hetshard's programs run on their own submeshes, outside a caller's jax.set_mesh.
        with no_ambient_mesh():
            return self._call(*args)

    def _prepare(self, args):
        """(compiled entry, non-batch arguments, batch) for ``args``: planned and
        compiled on the first call with their shapes."""
        idx = self._batch_index(args)
        batch = untyped(args[idx])
        args = (*args[:idx], batch, *args[idx + 1:])
        size = check_batch(batch)
        if self.global_batch is not None and size != self.global_batch:
            raise SpecError("batch", f"leading dimension {size}",
                            f"global_batch={self.global_batch}", where="hetshard.jit")
        others = tuple(a for i, a in enumerate(args) if i != idx)
        sig = _signature(args)
        entry = self._compiled.get(sig)
        if entry is None:
            with _tracing(self.fn, batch, "hetshard.jit"):
                program = Program(self.fn, args, batch_argnum=idx)
                if self.loss_output is not None:  # a wrong path is refused before planning
                    find_loss(program.output_shape, self.loss_output)
                plan = self._plan_for(program, size)
            if jax.process_count() > 1:  # every process must run the same plan
                from hetshard.distributed import agree
                agree(plan.what_runs(), "plan")
            if self._bound is None:
                self._bound = self.cluster.bind()
            # Across processes every multi-pipeline plan runs as MPMD: each process runs
            # only its own pipelines' programs.
            multi_stage = any(len(p.stages) != 1 for p in plan.pipelines) or (
                jax.process_count() > 1 and len(plan.pipelines) > 1)
            if (multi_stage or len(plan.pipelines) > 1) and program.call is None:
                raise PlanNotExecutableError(
                    f"this plan has {[len(p.stages) for p in plan.pipelines]} stages per "
                    f"pipeline; pipeline plans and several pipelines need a step whose "
                    f"hetshard.value_and_grad loss can be cut per micro-batch, and "
                    f"{program.call_error} (or plan with max_stages=1 and "
                    f"max_pipelines=1)")
            if plan.gpu_dtypes and program.call is None:
                raise PlanNotExecutableError(
                    f"plan.gpu_dtypes={[list(e) for e in plan.gpu_dtypes]}: stages computing "
                    f"in another dtype need a step that calls hetshard.value_and_grad "
                    f"(hetshard scales its loss), and {program.call_error}")
            if multi_stage:
                from hetshard.runtime.pipeline import PipelineRunner
                runner = PipelineRunner(plan, self._bound.devices, program)
                on, delays = self._timing
                runner.clock, runner.delays = ({} if on else None), delays
                entry = _Mpmd(runner)
            elif len(plan.pipelines) == 1:
                mesh = stage_mesh(plan, self._bound.devices)
                entry = self._compile(plan, mesh, program, others, batch)
            else:
                entry = self._compile_pipelines(plan, program, others, batch)
            self._compiled[sig] = entry
            self.plan, self.program = plan, program
        return entry, others, batch

    def _call(self, *args):
        entry, others, batch = self._prepare(args)
        if isinstance(entry, _Mpmd):
            runner = entry.runner
            out, new_state = runner.step(runner.state_of(others), batch,
                                         self._may_apply)
            if new_state is not None and runner.program.kind == "nnx":
                nnx.update(others, new_state)
            return out
        if isinstance(entry, _Shares):
            return self._run_pipelines(entry, others, batch)
        return self._run(entry, others, batch)

    def state_shardings(self, *args):
        """Where this step keeps the state of ``args`` (a step's arguments, batch
        included) under its plan: per leaf of the non-batch arguments' state (NNX: as
        ``nnx.to_pure_dict(nnx.state(objects))`` nests it), the ``NamedSharding`` the step
        hands it back in; plans and compiles for these shapes first, runs nothing. What
        ``hetshard.checkpoint.Checkpointer.restore(shardings=...)`` reads a checkpoint
        straight into."""
        with no_ambient_mesh():
            entry, others, _ = self._prepare(args)
        program = entry.program if not isinstance(entry, _Mpmd) else entry.runner.program
        if isinstance(entry, _Spmd):
            tree = entry.state_shardings
        elif isinstance(entry, _Shares):
            tree = entry.parts[0][2]
        else:
            runner = entry.runner
            leaves = [runner.runs[0][runner.owner[0].get(i, 0)].shardings[i]
                      for i in range(len(runner.state_avals))]
            tree = jax.tree.unflatten(program.state_tree, leaves)
        return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree

    # ---- a step assembled from micro-steps of other shapes (hetshard.data) --------------
    def _batch_index(self, args) -> int:
        idx = len(args) - 1 if self.batch_argnums is None else self.batch_argnums
        if isinstance(idx, bool) or not isinstance(idx, int) or not -len(args) <= idx < len(
                args):
            raise SpecError("batch_argnums", idx, f"an argument index below {len(args)}",
                            where="hetshard.jit")
        return idx % len(args)

    def _split_args(self, args):
        idx = self._batch_index(args)
        batch = untyped(args[idx])
        return idx, batch, tuple(a for i, a in enumerate(args) if i != idx)

    def program_for(self, *args) -> Program:
        """The traced step for arguments of these shapes (cached by their signature)."""
        sig = _signature(args)
        got = self._programs.get(sig)
        if got is None:
            idx, batch, _ = self._split_args(args)
            args = (*args[:idx], batch, *args[idx + 1:])
            with _tracing(self.fn, batch, "hetshard.jit"):
                got = Program(self.fn, args, batch_argnum=idx)
            if got.call is None:
                raise PlanNotExecutableError(
                    f"micro-steps need a step that calls hetshard.value_and_grad, and "
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
            program = self.program_for(*args)
            _, batch, others = self._split_args(args)
            key = (_signature(args), plan.what_runs())
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
                s_shard = state_shardings(_state(program, others), plan, mesh)
                b_shard = batch_sharding(batch, plan, mesh)
                got = (jax.jit(_rewriting(_capturing(program), plan, mesh),
                               in_shardings=(s_shard, b_shard)), s_shard, b_shard)
                self._captures[key] = got
            f, s_shard, b_shard = got
            return f(jax.device_put(_state(program, others), s_shard),
                     jax.device_put(batch, b_shard))

    def apply_grads(self, value_and_grads, *args):
        """Runs the step on ``args`` with ``hetshard.value_and_grad`` returning
        ``value_and_grads`` (e.g. the sum of :meth:`grads_under` over a batch's
        micro-steps) instead of computing them: the update is applied to the NNX objects
        (skipped, with the step's ``nan_policy``, when they are not finite); returns the
        step's output."""
        with no_ambient_mesh():
            program = self.program_for(*args)
            _, batch, others = self._split_args(args)
            leaf = jax.tree.leaves(value_and_grads)[0]
            home = NamedSharding(leaf.sharding.mesh, PartitionSpec()) \
                if isinstance(leaf.sharding, NamedSharding) else leaf.sharding
            provided = jax.device_put(value_and_grads, home)
            state = jax.device_put(_state(program, others), home)
            sig = _signature(args)
            if sig not in self._apply:
                self._apply[sig] = jax.jit(_providing(program))
            out, new_state = self._apply[sig](state, jax.device_put(batch, home), provided)
            return self._settle(program, out, new_state, provided, others, state)

    def time_stages(self, on: bool = True, delays: dict | None = None) -> None:
        """Time each pipeline stage's tasks from the next step on (``stage_times``; each
        task then waits for its results, so the pipeline no longer overlaps stages), and
        add ``delays`` ((pipeline, stage) -> seconds per task: a straggler stand-in on
        fake devices). Plans with several stages or several pipelines (a single SPMD
        stage has nothing to compare against)."""
        self._timing = (bool(on), dict(delays or {}))
        for entry in self._compiled.values():
            if isinstance(entry, _Mpmd):
                entry.runner.clock = {} if on else None
                entry.runner.delays = dict(delays or {})

    def stage_times(self) -> dict:
        """(pipeline, stage) -> seconds busy in the last timed step (``time_stages``)."""
        for entry in self._compiled.values():
            if isinstance(entry, _Mpmd) and entry.runner.plan is self.plan \
                    and entry.runner.clock:
                return dict(entry.runner.clock)
        if self._share_clock:
            return dict(self._share_clock)
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

    def _compile_pipelines(self, plan, program: Program, others, batch):
        """Several single-stage pipelines with (uneven) batch shares: each computes the
        value and gradients of its share on its submesh; the runtime combines them
        weighted by share; each then applies the same update (see value_and_grad)."""
        parts, subs = [], []
        state = _state(program, others)
        for p in plan.pipelines:
            sub = dataclasses.replace(plan, pipelines=(p,), global_batch=p.batch_share,
                                      grad_sync=())
            mesh = stage_mesh(sub, self._bound.devices)
            s_shard = state_shardings(state, sub, mesh)
            b_shard = batch_sharding(jax.tree.map(lambda x, n=p.batch_share: x[:n], batch),
                                     sub, mesh)
            parts.append((p.batch_share, mesh, s_shard, b_shard))
            subs.append(sub)

        capture, apply = _capturing(program), _providing(program)
        # Each pipeline's loss with its stage's layouts and remat (the SPMD rewrite).
        cap = [jax.jit(_rewriting(capture, sub, mesh), in_shardings=(s, b) + (
                   (NamedSharding(mesh, PartitionSpec()),) if plan.loss_scaled else ()))
               for (_, mesh, s, b), sub in zip(parts, subs, strict=True)]
        # The combined update is applied once, on the first pipeline's devices; the next
        # step hands every pipeline a copy of the updated state.
        return _Shares(parts, cap, jax.jit(apply), program, _loss_scale(plan))

    def _run_pipelines(self, entry: _Shares, others, batch):
        parts, cap, app, program = entry.parts, entry.capture, entry.apply, entry.program
        state = _state(program, others)
        total = sum(share for share, *_ in parts)
        start, results, states, batches = 0, [], [], []
        scale = (np.float32(entry.loss_scale.scale),) if entry.loss_scale else ()
        timed, delays = self._timing
        clock = {}
        for pi, ((share, _mesh, s_shard, b_shard), f) in enumerate(zip(parts, cap,
                                                                      strict=True)):
            sl = jax.tree.map(lambda x, a=start, n=share: x[a:a + n], batch)
            st = jax.device_put(state, s_shard)
            bt = jax.device_put(sl, b_shard)
            t0 = time.perf_counter()
            results.append(f(st, bt, *scale))  # dispatched asynchronously on each submesh
            if timed:  # time_stages: each pipeline to its results, plus an injected delay
                jax.block_until_ready(results[-1])
                time.sleep(delays.get((pi, 0), 0.0))
                clock[pi, 0] = time.perf_counter() - t0
            states.append(st)
            batches.append(bt)
            start += share
        self._share_clock = clock if timed else None
        # Weighted sum on the first pipeline's devices: the global-batch mean gradient.
        home = NamedSharding(parts[0][1], PartitionSpec())
        combined = None
        for (share, *_), res in zip(parts, results, strict=True):
            moved = jax.device_put(res, home)
            term = jax.tree.map(lambda x, w=share / total: x * w, moved)
            combined = term if combined is None else jax.tree.map(jnp.add, combined, term)
        out, new_state = app(states[0], batches[0], combined)
        return self._settle(program, out, new_state, combined, others, state,
                            entry.loss_scale)

    def _settle(self, program: Program, out, new_state, provided, others, state,
                loss_scale=None):
        """The step's output once its update ran on the ``provided`` value and
        gradients: the NNX objects updated, unless those are not finite (``nan_policy``;
        a loss-scaled step's overflow lowers the scale) and the state is withheld."""
        value, grads = provided
        value = value[0] if program.call.has_aux else value
        ok, loss = self._health(program, out, new_state, _all_finite_jit((value, grads)),
                                value)
        if _overflowed(loss_scale, ok, loss):
            return _withheld(program, out, jax.tree.leaves(state))
        if self._may_apply(out, ok, loss):
            if new_state is not None:
                nnx.update(others, new_state)
            return out
        return _withheld(program, out, jax.tree.leaves(state))

    def _compile(self, plan, mesh, program: Program, others, batch):
        b_shard = batch_sharding(batch, plan, mesh)
        state = _state(program, others)
        if program.kind == "tree" and plan.distributed_optimizer:
            raise PlanNotExecutableError(
                "plan.distributed_optimizer is true but the step takes plain pytrees, whose "
                "optimizer state cannot be told from the parameters; pass NNX objects "
                "(nnx.Optimizer) or a plan with distributed_optimizer false")
        s_shard = state_shardings(state, plan, mesh)

        def pure(state, batch, *scale):  # the loss scale: loss-scaled plans only
            with entered(used=False, finite=None, value=None,
                         loss_scale=scale[0] if scale else None) as ctx:
                out, objs = _call(program, state, batch)
                used = jnp.asarray(bool(ctx.used))
                finite, value = ctx.finite, ctx.value
            new = None
            if program.kind == "nnx":
                new = jax.lax.with_sharding_constraint(nnx.state(tuple(objs)), s_shard)
            return out, new, used, self._health(program, out, new, finite, value)
        scaled = (NamedSharding(mesh, PartitionSpec()),) if plan.loss_scaled else ()
        jitted = jax.jit(_rewriting(pure, plan, mesh),
                         in_shardings=(s_shard, b_shard, *scaled))
        return _Spmd(jitted, s_shard, b_shard, program, _loss_scale(plan))

    def _run(self, entry: _Spmd, others, batch):
        jitted, s_shard, b_shard = entry.step, entry.state_shardings, entry.batch_shardings
        program = entry.program
        batch = jax.device_put(batch, b_shard)
        state = jax.device_put(_state(program, others), s_shard)
        scale = (np.float32(entry.loss_scale.scale),) if entry.loss_scale else ()
        out, new_state, used_vg, (ok, loss) = jitted(state, batch, *scale)
        if program.kind == "nnx" and not bool(used_vg) and not self._warned_vg:
            self._warned_vg = True
            warnings.warn("the step uses plain nnx.value_and_grad: hetshard restricts itself "
                          "to single-stage plans for it (use hetshard.value_and_grad)",
                          stacklevel=3)
        if _overflowed(entry.loss_scale, ok, loss):
            return _withheld(program, out, jax.tree.leaves(state))
        if self._may_apply(out, ok, loss):
            if new_state is not None:
                nnx.update(others, new_state)
            return out
        return _withheld(program, out, jax.tree.leaves(state))

    def _health(self, program: Program, out, new_state, finite, value):
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

    def _may_apply(self, out, finite, loss) -> bool:
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
                          stacklevel=4)
            return False
        warnings.warn(f"{what} (applied: nan_policy='apply')", stacklevel=4)
        return True


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


class _Spmd(NamedTuple):
    """A compiled single-pipeline, single-stage plan: one jitted SPMD step."""

    step: Callable  # (state, batch, loss scale) -> (output, new NNX state, used_vg,
    #                                                (finite, loss))
    state_shardings: object
    batch_shardings: object
    program: Program
    loss_scale: DynamicLossScale | None  # float16 stages (Plan.loss_scaled)


class _Shares(NamedTuple):
    """Several single-stage pipelines with batch shares: per-share capture of the value
    and gradients on each submesh, one apply of the combined update."""

    parts: list  # (share, mesh, state shardings, batch shardings) per pipeline
    capture: list  # jitted per pipeline
    apply: Callable
    program: Program
    loss_scale: DynamicLossScale | None


class _Mpmd(NamedTuple):
    """A pipeline plan run stage by stage (``hetshard.runtime.pipeline``)."""

    runner: object


def _loss_scale(plan: Plan) -> DynamicLossScale | None:
    return DynamicLossScale() if plan.loss_scaled else None


def _overflowed(scale: DynamicLossScale | None, finite, loss) -> bool:
    """True when a loss-scaled step's gradients overflowed under a finite loss: the step
    is skipped and the scale lowered (``DynamicLossScale.overflowed``)."""
    return scale is not None and scale.overflowed(bool(finite), bool(np.isfinite(float(loss))))


def _capturing(program: Program):
    """``capture(state, batch, *scale)``: the value and gradients the step's
    ``hetshard.value_and_grad`` computes (``scale``: the loss scale of loss-scaled plans)."""
    def capture(state, batch, *scale):
        with entered(mode="capture", captured=None, used=False,
                     loss_scale=scale[0] if scale else None) as ctx:
            _call(program, state, batch)
            if ctx.captured is None:
                raise PlanNotExecutableError(
                    "plans with several pipelines or micro-steps need the step to call "
                    "hetshard.value_and_grad (it found none)")
            return ctx.captured
    return capture


def _providing(program: Program):
    """``apply(state, batch, provided)``: the step run with ``hetshard.value_and_grad``
    returning ``provided``; (output, new NNX state or None)."""
    def apply(state, batch, provided):
        with entered(mode="provide", provided=provided):
            out, objs = _call(program, state, batch)
        return out, (nnx.state(tuple(objs)) if program.kind == "nnx" else None)
    return apply


def _state(program: Program, others):
    """The step's non-batch arguments as the program flattens them: NNX state, or the
    pytrees themselves."""
    return nnx.state(others) if program.kind == "nnx" else others


def _call(program: Program, state, batch):
    """``step(*args)`` from the state ``_state`` gives; (output, objects after)."""
    if program.kind == "nnx":
        objs = list(nnx.merge(program.graphdef, state))
    else:
        objs = list(state)
    objs.insert(program.batch_index, batch)
    out = program.step(*objs)
    del objs[program.batch_index]
    return out, objs
