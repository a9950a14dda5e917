"""What a step does with a non-finite loss or gradients, decided on the device.

A step never reads a device value on the host (DESIGN.md, runtime principles): the
``nan_policy`` and the dynamic loss scale are applied inside the compiled programs, as
``optax.apply_if_finite`` does it. Each step computes, next to its update:

* ``ok``: its loss and every gradient are finite;
* ``overflow``: a loss-scaled step's gradients overflowed under a finite loss (the scale
  is halved and the step skipped; ``hetshard.runtime.precision``);
* ``apply``: whether its update is kept; a refused step leaves the state bit-identical.
  On GPUs every state leaf is ``where(apply, new, old)``, which XLA folds into the
  update's own fusions (they read the old value anyway). On CPU devices that occupy
  every core, the update itself runs in the true branch of a ``lax.cond`` on ``apply``
  and the false branch returns the old state (:meth:`Guard.run`, :func:`branches`).

What the host says about it (a warning, ``NonFiniteLossError``, the loss scale's log
line) comes later, without waiting: each step's small report (``ok``, ``overflow``, the
loss) is queued, and :meth:`Guard.poll` reads the reports of the steps that have
finished (``jax.Array.is_ready``) at the start of the next call of the step, in order.
:meth:`Guard.poll` with ``block=True`` (``HetshardJit.wait``) waits for them all.

``nan_policy="raise"``: a non-finite step, and every step dispatched after it, keep the
state as it was before it (a flag carried from step to step on the device,
``halted``); ``NonFiniteLossError`` is raised by the first call of the step (or of
``HetshardJit.wait``) made after the non-finite step finished. The error resets the
flag: a caller who catches it trains on from the state before the bad step.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as ext

from hetshard.autodiff import all_finite
from hetshard.errors import (
    NonFiniteLossError,
    SpecError,
)
from hetshard.ir.interpret import eval_equations, needed_equations
from hetshard.ir.program import Program, path_string
from hetshard.runtime.precision import DynamicLossScale, log

NAN_POLICIES = ("skip", "apply", "raise")


def donates(kind: str, nan_policy: str, platform: str) -> bool:
    """Whether a step's update donates the state it rewrites (a single stage's whole
    step, the batch shares' combined update, a pipeline stage's update of the leaves it
    owns unless it keeps some in host memory: ``hetshard.runtime.executable``,
    ``hetshard.runtime.pipeline``): the update is
    written over it, as MaxText's train step does, so the step holds one copy of the
    parameters and optimizer state; the objects get the new arrays. A pytree step's
    arguments are the caller's, whose references stay valid: never.

    On GPUs (any accelerator), under every ``nan_policy``: the old state the guard falls
    back on is read in the update's own fusions, and a second copy of the state is what
    decides whether a model fits. On CPU only under ``"apply"``: there each state leaf's
    ``where(apply, new, old)`` reads the old optimizer moments in two fusions (XLA
    recomputes a moment's new value in the parameter's update and in the moment's own
    select), so donating them made XLA copy every moment first, the 8-device benchmark's
    step 1.24x slower (``experiments/runtime_overhead.py``), for a peak 18% lower
    (``experiments/memory_fit.py``). The simulator prices the same choice
    (``hetshard.sim.simulator.update_kind``)."""
    return kind == "nnx" and (nan_policy == "apply" or platform != "cpu")


@dataclasses.dataclass
class Carry:
    """What a compiled step hands to the next on the device: ``halted`` (a non-finite
    step under ``nan_policy="raise"`` not yet reported) and, for a loss-scaled plan, the
    loss scale's state (``DynamicLossScale.state``). Host (numpy) values until the first
    step places them."""

    halted: Any = dataclasses.field(default_factory=lambda: np.bool_(False))
    loss_scale: DynamicLossScale | None = None

    def values(self) -> tuple:
        """(halted, loss-scale state or {}) as the compiled step takes them."""
        return self.halted, ({} if self.loss_scale is None else self.loss_scale.state)

    def take(self, halted, scale_state) -> None:
        """Keeps what a step returned, for the next."""
        self.halted = halted
        if self.loss_scale is not None:
            self.loss_scale.state = scale_state

    def reset(self) -> None:
        """Clears ``halted`` (after its error was raised), where it is kept."""
        old = self.halted
        self.halted = jax.device_put(np.bool_(False), old.sharding) \
            if isinstance(old, jax.Array) else np.bool_(False)

    def place(self, sharding) -> Carry:
        """Puts the host values on the devices of ``sharding`` (where the step that
        decides keeps them: the step then sees the same types every call)."""
        self.halted = jax.device_put(self.halted, sharding)
        if self.loss_scale is not None:
            self.loss_scale.state = jax.device_put(self.loss_scale.state, sharding)
        return self


def branches(devices) -> bool:
    """Whether a step on ``devices`` (the devices its program runs on) keeps or refuses
    its update with a ``lax.cond`` whose true branch computes it (:meth:`Guard.run`),
    else with a select per state leaf. Accelerators select: XLA folds the select into
    the update's fusions, and a branch would make the device wait while the host reads
    its flag. CPU devices branch where they are at least as many as this process's cores:
    there XLA's CPU fusions recompute each optimizer moment in the parameter's select and
    in its own (``experiments/runtime_overhead.py``, 8 devices on 2 cores: selects 1.22x
    ``nnx.jit``'s step, the branch 1.10x). With fewer devices than cores the branch costs
    more than the selects (1 device: 1.12x against 1.03x): XLA runs a branch's fusions one
    after another, where the step's own fusions spread over the idle cores."""
    devices = list(devices)
    if devices[0].platform != "cpu":
        return False
    local = sum(d.process_index == jax.process_index() for d in devices)
    return local >= _cores()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


def branched(body, args: tuple, keep, decide):
    """In-graph: ``body(*args)`` (a pytree) with some of its leaves computed in the true
    branch of a ``lax.cond``. ``keep(shapes)`` (``shapes``: the output's, as
    ``jax.eval_shape`` gives it) names them: ``(positions among the output's leaves,
    their values when refused)``. ``decide(values)`` (the output's leaves, None at those
    positions) gives the cond's flag. ``body``'s jaxpr is split: the equations the other
    leaves need (and those with side effects) run first; the equations only the kept
    leaves need run in the branch, given the values they read from before; the false
    branch returns the refused values."""
    closed, shapes = jax.make_jaxpr(body, return_shape=True)(*args)
    tree = jax.tree.structure(shapes)
    kept, olds = keep(shapes)
    jaxpr = closed.jaxpr
    kept_set = set(kept)
    rest = [v for k, v in enumerate(jaxpr.outvars) if k not in kept_set]
    before = needed_equations(jaxpr, rest, effects=True)
    done = set(before)
    update = [i for i in needed_equations(jaxpr, [jaxpr.outvars[k] for k in kept])
              if i not in done]
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, jax.tree.leaves(args), strict=True))
    eval_equations(jaxpr, env, None, indices=before)

    def read(e, v):
        return v.val if isinstance(v, ext.Literal) else e[v]

    values = [None if k in kept_set else read(env, v) for k, v in enumerate(jaxpr.outvars)]
    flag = decide(values)
    made = {v for i in update for v in jaxpr.eqns[i].outvars}
    crossing = list(dict.fromkeys(
        v for v in [*(v for i in update for v in jaxpr.eqns[i].invars),
                    *(jaxpr.outvars[k] for k in kept)]
        if not isinstance(v, ext.Literal) and v not in made))

    def computed(vals, _):
        e = dict(zip(crossing, vals, strict=True))
        eval_equations(jaxpr, e, None, indices=update)
        return [read(e, jaxpr.outvars[k]) for k in kept]

    def refused(_, old):
        return [jnp.asarray(o).astype(jaxpr.outvars[k].aval.dtype)
                for k, o in zip(kept, old, strict=True)]

    got = jax.lax.cond(flag, computed, refused, [env[v] for v in crossing], list(olds))
    for k, x in zip(kept, got, strict=True):
        values[k] = x
    return jax.tree.unflatten(tree, values)


def _select(apply, new, old_leaves: list):
    leaves, tree = jax.tree.flatten(new)
    return jax.tree.unflatten(tree, [jnp.where(apply, n, o) for n, o in
                                     zip(leaves, old_leaves, strict=True)])


class Guard:
    """A step's non-finite policy (see the module docstring): in-graph checks
    (:meth:`health`), the decision (:meth:`decide`), and the reports read later
    (:meth:`record`, :meth:`poll`). ``loss_output``: where the step's output holds its
    loss."""

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
        self.pending: collections.deque = collections.deque()  # (report, carry) in order

    # ---- in the compiled step ------------------------------------------------------
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
                                 else state_in_output(program, out))
        loss = value if value is not None else found
        return ok, (jnp.float32(jnp.nan) if loss is None else scalar(loss))

    def decide(self, ok, loss, halted, scale_state, loss_scale: DynamicLossScale | None):
        """In-graph: ``(apply, halted, scale_state, report)`` for a step whose loss and
        gradients are finite iff ``ok`` and whose loss is ``loss`` (a float32 scalar)."""
        loss_ok = jnp.isfinite(loss)
        overflow = jnp.asarray(False)
        if loss_scale is not None:
            scale_state, overflow = loss_scale.next(scale_state, ok, loss_ok)
        bad = ~ok & ~overflow  # the policy's to answer
        if self.nan_policy == "apply":
            apply = ~overflow
        elif self.nan_policy == "skip":
            apply = ok
        else:
            apply = ok & ~halted
            halted = halted | bad
        report = {"ok": ok, "overflow": overflow, "loss": loss, "applied": apply}
        if loss_scale is not None:
            report["scale"] = scale_state["scale"]
        return apply, halted, scale_state, report

    def guarded(self, program: Program, out, new_state, old_leaves: list, ok, loss,
                halted, scale_state, loss_scale):
        """In-graph: the step's output and new NNX state with the update kept only where
        :meth:`decide` applies it (every state leaf ``where(apply, new, old)``; a pytree
        step's returned state likewise); ``old_leaves``: the state's leaves as the step
        was given them, read before it ran (NNX updates its variables in place);
        ``(out, new_state, halted, scale_state, report)``."""
        apply, halted, scale_state, report = self.decide(ok, loss, halted, scale_state,
                                                         loss_scale)
        if program.kind == "nnx":
            if new_state is not None:
                new_state = _select(apply, new_state, old_leaves)
        else:
            tree, mapping = program.state_outputs()
            leaves = jax.tree.leaves(out)
            for i, m in enumerate(mapping):
                if m is not None:
                    leaves[m] = jnp.where(apply, leaves[m], old_leaves[i])
            out = jax.tree.unflatten(tree, leaves)
        return out, new_state, halted, scale_state, report

    def run(self, program: Program, body, args: tuple, old_leaves: list, halted,
            scale_state, loss_scale, branch: bool):
        """In-graph: ``body(*args)`` (the step: ``(out, new NNX state or None, ok,
        loss)``, :meth:`health` applied) with its update kept only where :meth:`decide`
        applies it; what :meth:`guarded` returns. ``branch`` (:func:`branches`): the
        equations that only the new state needs (the optimizer's update) run in the true
        branch of a ``lax.cond`` on the decision, whose false branch returns
        ``old_leaves``; the output, the checks and whatever they read run before it.
        Else every state leaf is a select (:meth:`guarded`)."""
        if not branch or (self.nan_policy == "apply" and loss_scale is None):
            out, new, ok, loss = body(*args)
            return self.guarded(program, out, new, old_leaves, ok, loss, halted,
                                scale_state, loss_scale)
        got = {}

        def keep(shapes):
            n_out = len(jax.tree.leaves(shapes[0]))
            if program.kind == "nnx":  # the new state's leaves, all kept or refused
                return list(range(n_out, n_out + len(jax.tree.leaves(shapes[1])))), \
                    list(old_leaves)
            mapping = program.state_outputs()[1]  # (a pytree step returns its state)
            return [m for m in mapping if m is not None], \
                [old_leaves[i] for i, m in enumerate(mapping) if m is not None]

        def decide(values):
            apply, *got["rest"] = self.decide(values[-2], values[-1], halted, scale_state,
                                              loss_scale)
            return apply
        out, new, _, _ = branched(body, args, keep, decide)
        return (out, new, *got["rest"])

    @staticmethod
    def report_avals(loss_scale: DynamicLossScale | None) -> dict:
        """What :meth:`decide`'s report holds, shapes only (a process that runs no part
        of the step receives it: ``hetshard.collectives.deliver``)."""
        flag, number = jax.ShapeDtypeStruct((), jnp.bool_), jax.ShapeDtypeStruct((),
                                                                               jnp.float32)
        avals = {"ok": flag, "overflow": flag, "loss": number, "applied": flag}
        if loss_scale is not None:
            avals["scale"] = number
        return avals

    # ---- on the host, later --------------------------------------------------------
    def record(self, report: dict, carry: Carry) -> None:
        """Queues a dispatched step's report (device arrays) for :meth:`poll`."""
        self.pending.append((report, carry))

    def poll(self, block: bool = False, stacklevel: int = 3) -> None:
        """Says what the finished steps' reports hold, oldest first, without waiting for
        a step still running (``block``: waits for every dispatched step). Raises
        ``NonFiniteLossError`` for a non-finite step under ``nan_policy="raise"``."""
        while self.pending:
            report, carry = self.pending[0]
            if not block and not all(_ready(x) for x in report.values()):
                return
            self.pending.popleft()
            got = {k: _host(x) for k, x in report.items()}
            if got["overflow"]:
                log.info("hetshard: float16 gradients overflowed; step skipped, loss "
                         "scale now %g", float(got["scale"]))
                continue
            if got["ok"]:
                continue
            what = _what(float(got["loss"]))
            if self.nan_policy == "raise":
                held = 0
                while self.pending and self.pending[0][1] is carry:
                    later, _ = self.pending.popleft()
                    held += not bool(_host(later["applied"]))
                carry.reset()
                raise NonFiniteLossError(
                    f"the step's {what} (nan_policy='raise'): neither that step nor the "
                    f"{held} dispatched after it changed the state, which is as it was "
                    f"before it")
            if self.nan_policy == "skip":
                warnings.warn(f"{what}: the step was not applied (nan_policy='skip')",
                              stacklevel=stacklevel)
            else:
                warnings.warn(f"{what} (applied: nan_policy='apply')",
                              stacklevel=stacklevel)


def _ready(x) -> bool:
    return x.is_ready() if isinstance(x, jax.Array) else True


def _host(x):
    """A (replicated) scalar read on the host: the first local copy."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def _what(loss: float) -> str:
    if not np.isfinite(loss):
        return f"non-finite loss {loss}"
    return f"non-finite gradients (loss {loss})"


# ---- the loss among the outputs -----------------------------------------------------------

def scalar(x) -> jax.Array:
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


def state_in_output(program: Program, out) -> list:
    """The leaves of a pytree step's output that are its new state."""
    _, mapping = program.state_outputs()
    leaves = jax.tree.leaves(out)
    return [leaves[m] for m in mapping if m is not None]
