"""Scalars pipeline stages exchange in the optimizer update: a global-norm clip.

Each stage applies the step's update to the state it owns with every other leaf zero
(``hetshard.runtime.pipeline``). An update that reads a value of several stages'
gradients (``optax.clip_by_global_norm``: the norm over every parameter; a gradient-norm
metric among the step's outputs) then computes it from the stage's own gradients only.
Such values are small (a norm, a sum of squares), so the stages can trade them, as
Megatron-LM all-reduces the squared norm across pipeline stages before clipping.

:func:`plan_exchange` follows the traced update equation by equation with, per value,
the set of stages whose data it holds. Where an equation reads values of two stages, its
small inputs (at most ``SMALL`` elements) are *published*: the stage holding each
computes it and hands it to every other stage, after which it counts as everyone's; a
large value of another stage left there is a real coupling (a ``PipelineSetupError``).
A published value may itself read values published before it, so publishing goes in
rounds: in round ``r`` every stage evaluates the update with the values of rounds
before ``r`` put in and hands out its values of round ``r``; a last evaluation gives
the outputs. A clip takes one round.
"""

from __future__ import annotations

import dataclasses

from jax.extend import core as ext

from hetshard.errors import (
    CouplingError,
    )
from hetshard.ir.dependencies import cond_reads, size_of
from hetshard.ir.interpret import eval_equations

SMALL = 64  # elements: what stages trade (norms, sums of squares), never tensors


@dataclasses.dataclass(frozen=True)
class Exchange:
    """``rounds[r]``: the values published in round ``r``, as (variable, stage)."""

    closed: object  # the update's ClosedJaxpr
    rounds: tuple[tuple[tuple[object, int], ...], ...]

    def published_before(self, r: int) -> list:
        return [v for k in range(r) for v, _ in self.rounds[k]]


def plan_exchange(closed, input_stages, output_stages) -> Exchange:
    """Which values the stages trade, by round (module docstring).

    ``input_stages``: per input of ``closed``, the stage whose data it is (None: the
    same on every stage: shared state, the loss, the batch). ``output_stages``: per
    output, the stage that must compute it correctly (None: every stage).

    Raises:
      CouplingError: a large value of one stage reaches another's equation or output.
    """
    jaxpr = closed.jaxpr
    owner: dict = {}  # variable -> stages whose data it holds
    level: dict = {}  # variable -> rounds that must be done before it is right
    rounds: list[list] = []
    none: frozenset = frozenset()
    for v, s in zip(jaxpr.invars, input_stages, strict=True):
        owner[v], level[v] = (none if s is None else frozenset({s})), 0
    for v in jaxpr.constvars:
        owner[v], level[v] = none, 0

    def stages_of(v):
        return none if isinstance(v, ext.Literal) else owner[v]

    def publish(v) -> None:
        (stage,) = owner[v]
        r = level[v]
        while len(rounds) <= r:
            rounds.append([])
        rounds[r].append((v, stage))
        owner[v], level[v] = none, r + 1

    def union(ins) -> frozenset:
        return frozenset().union(*(stages_of(v) for v in ins)) if ins else none

    def settle(ins, want: frozenset | None, what: str) -> frozenset:
        """The stages ``ins`` hold, made at most one (``want`` None: an equation's
        inputs) or within ``want`` (an output) by publishing small values."""
        def fine(held):
            return len(held) <= 1 if want is None else held <= want

        held = union(ins)
        if fine(held):
            return held
        for v in ins:
            s = stages_of(v)
            if s and (want is None or not s <= want) and size_of(v) <= SMALL:
                publish(v)
        held = union(ins)
        if not fine(held):
            big = next(v for v in ins if stages_of(v) and (want is None or
                                                           not stages_of(v) <= want))
            raise CouplingError(f"{what} reads a value of {size_of(big)} elements "
                                f"({big.aval.str_short()}) held by stage(s) "
                                f"{sorted(stages_of(big))}; stages trade values of at "
                                f"most {SMALL} elements")
        return held

    for eqn in jaxpr.eqns:
        what = f"a {eqn.primitive.name} of the update"
        # A cond's outputs each read the branch index and their own operands only
        # (``optax.apply_if_finite``, ``optax.MultiSteps``: every leaf's update switched
        # on one flag), so each output is settled on its own; any other equation as one.
        reads = ([[eqn.invars[j] for j in sorted(d)] for d in cond_reads(eqn)]
                 if eqn.primitive.name == "cond" else [eqn.invars] * len(eqn.outvars))
        for o, r in zip(eqn.outvars, reads, strict=True):
            ins = [v for v in r if not isinstance(v, ext.Literal)]
            owner[o] = settle(ins, None, what)
            level[o] = max((level[v] for v in ins), default=0)
    for k, (v, want) in enumerate(zip(jaxpr.outvars, output_stages, strict=True)):
        if isinstance(v, ext.Literal):
            continue
        settle([v], none if want is None else frozenset({want}), f"output {k} of the update")
    return Exchange(closed, tuple(tuple(r) for r in rounds))


def evaluate(jaxpr, consts, args, overrides: dict, wanted) -> list:
    """``wanted`` variables of ``jaxpr`` on ``args``, with the values in ``overrides``
    (variable -> value) taking the place of what the equations compute
    (``hetshard.ir.interpret.eval_equations``)."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    env.update((v, x) for v, x in overrides.items() if v in env)
    eval_equations(jaxpr, env, None, constrain={v: (lambda _, x=x: x)
                                                for v, x in overrides.items()})
    return [v.val if isinstance(v, ext.Literal) else env[v] for v in wanted]
