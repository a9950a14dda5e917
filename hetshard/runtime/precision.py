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

import dataclasses
import logging

import jax.numpy as jnp
import numpy as np

from hetshard.plan import Plan

log = logging.getLogger("hetshard")


def stage_autocast(plan: Plan, stage) -> tuple[np.dtype, np.dtype] | None:
    """(the program's dtype, the stage's compute dtype) when they differ, else None."""
    dt = plan.stage_dtype(stage)
    if dt == plan.dtype:
        return None
    return np.dtype(jnp.dtype(plan.dtype)), np.dtype(jnp.dtype(dt))


@dataclasses.dataclass
class DynamicLossScale:
    """The loss scale ``S`` and its schedule (see the module docstring)."""

    scale: float = 2.0 ** 15
    growth_interval: int = 2000
    factor: float = 2.0
    min_scale: float = 1.0
    good_steps: int = 0
    overflows: int = 0

    def overflowed(self, grads_finite: bool, loss_finite: bool) -> bool:
        """Updates ``S`` after a step; True when the step's gradients overflowed under a
        finite loss and it is to be skipped (``S`` halved). A non-finite loss, or an
        overflow at the smallest scale, is not the scale's doing: False, and the
        caller's non-finite policy decides."""
        if grads_finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.factor
                self.good_steps = 0
            return False
        self.good_steps = 0
        if not loss_finite or self.scale / self.factor < self.min_scale:
            return False
        self.scale /= self.factor
        self.overflows += 1
        log.info("hetshard: float16 gradients overflowed; step skipped, loss scale now %g",
                 self.scale)
        return True
