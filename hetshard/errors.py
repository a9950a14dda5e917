"""The errors and warnings hetshard raises, all in one place (``hetshard`` exports them;
the modules that raise them import them from here).

Every error a user can trigger is a subclass of :class:`HetshardError`, and
also of the builtin exception a Python programmer would expect (``ValueError``
for a bad value, ``KeyError``-like lookups are ``ValueError`` too, because the
value, not the mapping, is what is wrong). Messages name the field, the value
and what would be accepted.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class HetshardError(Exception):
    """Base class of every error hetshard raises on purpose."""


class SpecError(HetshardError, ValueError):
    """A field of a user-supplied spec (cluster, model, plan, flag) is invalid.

    Attributes:
      field: dotted path of the offending field, e.g. ``groups[1].nodes``.
      value: the value that was given.
      accepted: a short description of what would have been accepted.
    """

    def __init__(self, field: str, value: Any, accepted: str, *, where: str = ""):
        self.field = field
        self.value = value
        self.accepted = accepted
        self.where = where
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{field}={value!r} is invalid; expected {accepted}")


class UnknownNameError(SpecError):
    """A name (GPU type, preset, model) is not in the catalog it was looked up in."""

    def __init__(self, field: str, value: str, known: Iterable[str], *, where: str = ""):
        known = sorted(known)
        close = difflib.get_close_matches(str(value), known, n=3, cutoff=0.5)
        if not close:
            lowered = {k.lower(): k for k in known}
            close = [lowered[k] for k in difflib.get_close_matches(
                str(value).lower(), list(lowered), n=3, cutoff=0.5)]
        # Names the value begins (an "H100" means one of the H100 types) come first.
        begun = [k for k in known if k.lower().startswith(str(value).lower())]
        close = (begun + [k for k in close if k not in begun])[:max(3, min(len(begun), 5))]
        self.suggestions = close
        hint = f"did you mean {', '.join(close)}? " if close else ""
        accepted = f"one of {len(known)} known names ({hint}known: {', '.join(known)})"
        super().__init__(field, value, accepted, where=where)


class SpecParseError(HetshardError, ValueError):
    """A spec file or string could not be parsed at all (syntax, not values)."""

    def __init__(self, source: str, message: str, *, line: int | None = None):
        self.source = source
        self.line = line
        where = f"{source}, line {line}" if line is not None else source
        super().__init__(f"cannot parse {where}: {message}")


class PlanNotExecutableError(HetshardError, ValueError):
    """The plan cannot run this step (the message says why and what would)."""


class DeviceBindingError(HetshardError, RuntimeError):
    """A cluster spec cannot be mapped onto the JAX devices that exist."""


class PipelineSetupError(HetshardError, ValueError):
    """The step cannot run under this plan's pipelines (the message says why and what
    would work)."""


class NonFiniteLossError(HetshardError, FloatingPointError):
    """The step's loss or gradients are not finite (``nan_policy="raise"``)."""


class CouplingError(HetshardError, ValueError):
    """A large value of one stage is read by another stage's update."""


class StepTraceError(HetshardError, RuntimeError):
    """The user's step (or its model) raised while hetshard traced it on the arguments it
    was called with; the step's own exception is chained as the cause."""


class StragglerWarning(UserWarning):
    """A straggler was found and a new plan made (the message says which, and the gain)."""


class NoFeasiblePlanError(HetshardError, ValueError):
    """No plan in the search space fits the cluster's memory (or divides the batch)."""


class PlannerTimeLimitWarning(UserWarning):
    """The time limit cut the search: the plan is the best found, with its gap."""


class PlannerMemoryWarning(UserWarning):
    """The plan, priced under its solved parameter layouts, no longer fits memory."""


class LayerDiscoveryError(HetshardError, ValueError):
    """The program's layers cannot be found, or do not match the plan's."""


class CheckpointError(HetshardError, RuntimeError):
    """A checkpoint could not be saved or restored."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files differ from what was saved (``step``, ``path``)."""

    def __init__(self, step: int, path: str, why: str, message: str | None = None):
        self.step, self.path = step, path
        super().__init__(message or f"checkpoint step {step} is corrupt: {path}: {why}")


class LossCallError(HetshardError, ValueError):
    """The step's ``hetshard.value_and_grad`` call cannot be cut per micro-batch (the
    message says why and what would work)."""


class PrecisionWarning(UserWarning):
    """Some GPUs of the cluster lack tensor cores for the compute dtype and are priced
    (and run) at a slower rate."""


class DistributedError(HetshardError, RuntimeError):
    """Processes that disagree, never arrive or die."""


class StageSplitError(HetshardError, ValueError):
    """The loss cannot be split at the plan's layer boundaries."""


def check_positive(field: str, value: Any, *, integer: bool = False, where: str = "") -> Any:
    """Returns ``value`` if it is a positive number (an int when ``integer``), else raises."""
    kind = "a positive integer" if integer else "a positive number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(field, value, kind, where=where)
    if integer and not isinstance(value, int):
        raise SpecError(field, value, kind, where=where)
    if not value > 0 or value != value or value == float("inf"):
        raise SpecError(field, value, kind, where=where)
    return value
