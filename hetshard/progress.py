"""Progress of a planning run, for whoever watches it (the CLI's status line).

The planner names its phases (:func:`phase`) and the simulator counts every plan it
prices (:func:`priced`); a caller that wants to show them enters :func:`reporting` with
a callback, which then receives a :class:`Progress` at each phase and at most ten times
a second while plans are priced. Without a reporter these calls cost one context-variable
read.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Callable


@dataclasses.dataclass
class Progress:
    phase: str = "starting"
    priced: int = 0  # plans simulated so far
    best_tokens_per_s: float | None = None  # the fastest plan priced so far that fits
    started: float = dataclasses.field(default_factory=time.perf_counter)
    limit_s: float | None = None

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def line(self) -> str:
        parts = [self.phase, f"{self.priced:,} plans priced"]
        if self.best_tokens_per_s:
            parts.append(f"best {self.best_tokens_per_s:,.0f} tokens/s")
        if self.limit_s is not None:
            parts.append(f"{max(0.0, self.limit_s - self.elapsed_s):.0f} s of "
                         f"{self.limit_s:g} s left")
        return ", ".join(parts)


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("hetshard_progress", default=None)
_EVERY_S = 0.1


@contextlib.contextmanager
def reporting(callback: Callable[[Progress], None], limit_s: float | None = None):
    """Sends the planning run's progress inside the block to ``callback``."""
    state = Progress(limit_s=limit_s)
    token = _CURRENT.set([state, callback, 0.0])
    try:
        yield state
    finally:
        _CURRENT.reset(token)


def phase(name: str) -> None:
    """The planner entered phase ``name``."""
    cur = _CURRENT.get()
    if cur is not None:
        cur[0].phase = name
        cur[2] = time.perf_counter()
        cur[1](cur[0])


def priced(tokens_per_s: float, fits: bool) -> None:
    """One plan was simulated."""
    cur = _CURRENT.get()
    if cur is None:
        return
    state = cur[0]
    state.priced += 1
    if fits and tokens_per_s > (state.best_tokens_per_s or 0.0):
        state.best_tokens_per_s = tokens_per_s
    now = time.perf_counter()
    if now - cur[2] >= _EVERY_S:
        cur[2] = now
        cur[1](state)
