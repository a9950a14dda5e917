"""Per-GPU compute dtypes at run time: the autocast of a stage and dynamic loss scaling.

A plan's ``gpu_dtypes`` can have the stages on some GPU types compute in another dtype
than the program's (float16 on V100 and T4 under a bfloat16 program: they have no
bfloat16 tensor cores). Such a stage is evaluated with an autocast
(``hetshard.rewrite.attention.eval_equations``): its matmuls and attention take their
operands in that dtype and accumulate in float32; the values between them keep the
program's dtype, so the stage's sends, and the other stages, are unchanged.

float16 has 5 exponent bits: small gradients underflow to zero. While any stage computes
in float16 (``Plan.loss_scaled``), the runtime scales the loss by ``S`` before the
backward pass (the seed of the loss's cotangent) and the gradients by ``1/S`` before the
update, with ``S`` adjusted as mixed-precision trainers do (Micikevicius et al.,
"Mixed Precision Training", ICLR 2018; the schedule of ``torch.amp.GradScaler`` and
Megatron-LM's ``DynamicGradScaler``): a step whose scaled gradients overflow is skipped
and ``S`` halved; after ``growth_interval`` finite steps in a row ``S`` doubles.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from hetshard._plan import Plan

log = logging.getLogger("hetshard")


def stage_autocast(plan: Plan, stage) -> tuple[np.dtype, np.dtype] | None:
    """(the program's dtype, the stage's compute dtype) when they differ, else None."""
    dt = plan.stage_dtype(stage)
    if dt == plan.dtype:
        return None
    return np.dtype(jnp.dtype(plan.dtype)), np.dtype(jnp.dtype(dt))


class DynamicLossScale:
    """The loss scale ``S`` and its schedule (see the module docstring). Its ``state``
    (the scale, the finite steps in a row, the overflows so far) lives on the device and
    is advanced inside the compiled step (:meth:`next`), so no step reads it on the
    host; ``scale``, ``good_steps`` and ``overflows`` read it (waiting for the step that
    computed it), for inspection."""

    def __init__(self, scale: float = 2.0 ** 15, growth_interval: int = 2000,
                 factor: float = 2.0, min_scale: float = 1.0):
        self.growth_interval, self.factor, self.min_scale = growth_interval, factor, min_scale
        self.state = {"scale": np.float32(scale), "good": np.int32(0),
                      "overflows": np.int32(0)}

    @property
    def scale(self) -> float:
        return float(np.asarray(self.state["scale"]))

    @scale.setter
    def scale(self, value: float) -> None:
        old = self.state["scale"]
        new = np.float32(value)
        self.state = {**self.state, "scale": jax.device_put(new, old.sharding)
                      if isinstance(old, jax.Array) else new}

    @property
    def good_steps(self) -> int:
        return int(np.asarray(self.state["good"]))

    @property
    def overflows(self) -> int:
        return int(np.asarray(self.state["overflows"]))

    def next(self, state: dict, grads_finite, loss_finite):
        """In-graph: (the state after a step, whether the step's gradients overflowed
        under a finite loss and it is to be skipped, ``S`` halved). After
        ``growth_interval`` finite steps in a row ``S`` doubles. A non-finite loss, or an
        overflow at the smallest scale, is not the scale's doing: no overflow, and the
        caller's non-finite policy decides."""
        scale, good = state["scale"], state["good"]
        grads_finite, loss_finite = jnp.asarray(grads_finite), jnp.asarray(loss_finite)
        overflow = ~grads_finite & loss_finite & (scale / self.factor >= self.min_scale)
        good = jnp.where(grads_finite, good + 1, 0).astype(jnp.int32)
        grow = good >= self.growth_interval
        scale = jnp.where(overflow, scale / self.factor,
                          jnp.where(grow, scale * self.factor, scale)).astype(jnp.float32)
        good = jnp.where(grow, 0, good).astype(jnp.int32)
        overflows = (state["overflows"] + overflow.astype(jnp.int32)).astype(jnp.int32)
        return {"scale": scale, "good": good, "overflows": overflows}, overflow

    def overflowed(self, grads_finite: bool, loss_finite: bool) -> bool:
        """:meth:`next` run now on the host's values: advances ``state``, True when the
        step is to be skipped (a convenience for inspection and tests; compiled steps call
        :meth:`next`)."""
        self.state, overflow = self.next(self.state, grads_finite, loss_finite)
        if bool(overflow):
            log.info("hetshard: float16 gradients overflowed; step skipped, loss scale "
                     "now %g", self.scale)
        return bool(overflow)
