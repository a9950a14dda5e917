"""Pipeline schedules: each submesh's task order, the global walk the simulator prices
and the runtime dispatches, one pipeline's timing, and 1F1B's steady state.

Stage ``s`` of a pipeline of ``n = p * v`` stages runs on submesh ``s mod p``. GPipe runs
every forward, then every backward; 1F1B alternates after a warm-up; with ``v > 1``
stages per submesh, Megatron-LM's interleaved 1F1B (Narayanan et al., SC'21, sec.
2.2). ``steady_period`` prices 1F1B's steady state exactly (the maximum cycle mean of
its timed event graph; Baccelli et al., "Synchronization and Linearity", 1992, ch. 3)
and ``best_warmup`` the extra warm-up that minimises it within memory.
"""

from __future__ import annotations

import functools

import numpy as np


def worker_order(schedule: str, p: int, w: int, m: int, v: int = 1,
                 extra: tuple[int, ...] = ()) -> list[tuple[str, int, int]]:
    """``(kind, stage, micro_batch)`` in the order submesh ``w`` of ``p`` runs its tasks
    when each submesh holds ``v`` stages (stage ``c * p + w`` is its c-th).

    GPipe: every forward, then every backward. 1F1B with ``v = 1``: ``p - w - 1``
    warm-up forwards, then one forward / one backward, then the cool-down backwards.
    Interleaved 1F1B (``v > 1``, Megatron-LM's schedule): forwards go through the
    submesh's stages in groups of ``p`` micro-batches (stage ``w`` for micro-batches
    0..p-1, then stage ``p + w`` for the same ones, ...; when ``p`` does not divide ``m``
    the last group is smaller), backwards likewise from the last stage down, with
    ``2 (p - w - 1) + (v - 1) p`` warm-up forwards, more where a smaller last group would
    otherwise deadlock (``interleaved_warmups``). Under 1F1B ``extra[w]`` more warm-up
    forwards on submesh w keep more micro-batches in flight, so that transfers slower
    than compute no longer stall the loop each micro-batch makes from w to the last stage
    and back, for their activations' memory (warm-up counts must not grow along the
    pipeline).
    """
    if schedule == "zbh1":
        return list(_zero_bubble(p, m, tuple(extra))[w])
    if v == 1:
        fwds = [(w, i) for i in range(m)]
        warm = p - w - 1
        return _order(schedule, fwds, fwds, warm + (extra[w] if extra else 0))
    warm = interleaved_warmups(p, m, v)[w] if schedule == "1f1b" else 0
    return _order(schedule, _chunked(p, w, m, v, False), _chunked(p, w, m, v, True),
                  warm + (extra[w] if extra else 0))


def _chunked(p: int, w: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """Submesh w's (stage, micro_batch) forwards (or backwards) under interleaving: per
    group of up to ``p`` micro-batches, each of its ``v`` stages in model order (backwards:
    reversed) for every micro-batch of the group."""
    chunks = range(v - 1, -1, -1) if backward else range(v)
    return [(c * p + w, i) for g in range(0, m, p) for c in chunks
            for i in range(g, min(g + p, m))]


def _order(schedule: str, fwds, bwds, warm: int) -> list[tuple[str, int, int]]:
    """GPipe: every forward, then every backward; 1F1B: ``warm`` forwards, then one
    forward / one backward, then the remaining backwards."""
    if schedule == "gpipe":
        return [("F", *t) for t in fwds] + [("B", *t) for t in bwds]
    warm = min(warm, len(fwds))
    order = [("F", *t) for t in fwds[:warm]]
    for f, b in zip(fwds[warm:], bwds, strict=False):
        order += [("F", *f), ("B", *b)]
    return order + [("B", *t) for t in bwds[len(fwds) - warm:]]


# ZB-H1's design point: a forward, a B and a W take 2 : 2 : 1 time units (the profile
# prices a gpt-6.7b block at about 2 : 3 : 1; under 1F1B's memory cap the orders of 1:1:1,
# 2:3:1 and 2:2:1 mostly coincide, and 2:2:1 simulated best where they did not).
_ZB_TIMES = {"F": 2, "B": 2, "W": 1}


@functools.lru_cache(maxsize=256)
def _zero_bubble(p: int, m: int, extra: tuple[int, ...] = ()
                 ) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24, sec. 2.1): each
    backward split into ``B`` (the input's cotangent, what the previous stage waits for)
    and ``W`` (the weights' gradients, needed only by the optimizer). Stage w holds at most
    ``p - w + extra[w]`` micro-batches whose ``W`` has not run: 1F1B's activations (and
    its extra warm-up's), plus what the pending W passes read from their B passes. The
    order is the list schedule of passes timed at the design point ``_ZB_TIMES``: a free
    stage runs a ready ``B``, else a forward memory allows, else a pending ``W``; so
    B passes travel back without waiting behind W passes, and W passes fill what 1F1B
    leaves idle at the start and the tail. Fixed by (p, m, extra) alone, the simulator
    prices and the runtime runs the same order whatever the real times."""
    cap = [p - s + (extra[s] if extra else 0) for s in range(p)]
    f_end = [[None] * m for _ in range(p)]
    b_end = [[None] * m for _ in range(p)]
    nf, nb, nw, free = [0] * p, [0] * p, [0] * p, [0] * p
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]

    def done(ends, i, t):
        return ends[i] is not None and ends[i] <= t

    t = 0
    while any(x < m for x in nw):
        for s in range(p):
            if free[s] > t:
                continue
            if nb[s] < m and done(f_end[s], nb[s], t) and (
                    s == p - 1 or done(b_end[s + 1], nb[s], t)):
                kind, i = "B", nb[s]
                b_end[s][i] = t + _ZB_TIMES["B"]
                nb[s] += 1
            elif nf[s] < m and nf[s] - nw[s] < cap[s] and (
                    s == 0 or done(f_end[s - 1], nf[s], t)):
                kind, i = "F", nf[s]
                f_end[s][i] = t + _ZB_TIMES["F"]
                nf[s] += 1
            elif nw[s] < nb[s]:
                kind, i = "W", nw[s]
                nw[s] += 1
            else:
                continue
            free[s] = t + _ZB_TIMES[kind]
            orders[s].append((kind, s, i))
        t += 1
    return tuple(tuple(o) for o in orders)


@functools.lru_cache(maxsize=256)
def interleaved_warmups(p: int, m: int, v: int) -> tuple[int, ...]:
    """Warm-up forwards per submesh of interleaved 1F1B: Megatron-LM's ``2 (p - w - 1) +
    (v - 1) p``, enough when ``p`` divides ``m``. With a smaller last group a submesh can
    reach a backward whose inputs wait on forwards queued behind it; each time the walk
    stalls so, every submesh stuck on a backward runs one more forward first (at worst all
    forwards first, which cannot stall), so the fewest extra activations are kept."""
    warm = [min(2 * (p - w - 1) + (v - 1) * p, m * v) for w in range(p)]
    fb = [(_chunked(p, w, m, v, False), _chunked(p, w, m, v, True)) for w in range(p)]
    while True:
        orders = [_order("1f1b", f, b, warm[w]) for w, (f, b) in enumerate(fb)]
        stuck = _stalled(orders, p * v, m)
        if stuck is None:
            return tuple(warm)
        for w, kind in enumerate(stuck):
            if kind == "B" and warm[w] < m * v:
                warm[w] += 1


def schedule_order(schedule: str, p: int, s: int, m: int) -> list[tuple[str, int]]:
    """The order in which stage ``s`` of ``p`` (one stage per submesh) runs its ``m``
    micro-batches."""
    return [(kind, i) for kind, _, i in worker_order(schedule, p, s, m)]


def inflight(schedule: str, p: int, s: int, m: int, extra: tuple[int, ...] = ()) -> int:
    """Micro-batches whose activations stage ``s`` holds at once (one stage per submesh)."""
    return m if schedule == "gpipe" else min(p - s + (extra[s] if extra else 0), m)


def schedule_walk(schedule: str, n: int, m: int, v: int = 1, extra: tuple[int, ...] = ()):
    """Yields ``(stage, "F"|"B", micro_batch)`` for every task of one pipeline of ``n``
    stages on ``n / v`` submeshes, each submesh in its ``worker_order`` and every task after
    those it depends on (its forward input, or the next stage's backward). The simulator
    prices tasks in this order and the runtime dispatches them in it (every process the
    same)."""
    yield from _walk(schedule, n, m, v, extra)


@functools.lru_cache(maxsize=64)
def _walk(schedule: str, n: int, m: int, v: int,
          extra: tuple[int, ...] = ()) -> tuple[tuple[int, str, int], ...]:
    p = n // v
    out: list[tuple[int, str, int]] = []
    stuck = _stalled([worker_order(schedule, p, w, m, v, extra) for w in range(p)], n, m,
                     out)
    if stuck is not None:  # cannot happen: warm-ups are chosen so that it does not
        raise RuntimeError(f"pipeline schedule deadlocked: next tasks {stuck}")
    return tuple(out)


def _stalled(orders, n: int, m: int, out: list | None = None):
    """Walks the submeshes' task ``orders`` (appending ``(stage, kind, micro_batch)`` to
    ``out`` in a dependency-respecting order); None when every task ran, else each
    submesh's next task kind ("" when it finished) where none could proceed."""
    p = len(orders)
    ptr = [0] * p
    f_done = [[False] * m for _ in range(n)]
    b_done = [[False] * m for _ in range(n)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for w in range(p):
            order = orders[w]
            while ptr[w] < len(order):
                kind, s, i = order[ptr[w]]
                if kind == "F":
                    if s and not f_done[s - 1][i]:
                        break
                    f_done[s][i] = True
                elif kind == "W":  # after its own B, which its submesh ran before it
                    pass
                else:
                    if not f_done[s][i] or (s < n - 1 and not b_done[s + 1][i]):
                        break
                    b_done[s][i] = True
                if out is not None:
                    out.append((s, kind, i))
                ptr[w] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            return [o[k][0] if k < len(o) else "" for o, k in zip(orders, ptr, strict=True)]
    return None


def run_pipeline(fwd_s, bwd_s, sends_s, m: int, schedule: str, v: int = 1,
                 extra: tuple[int, ...] = ()):
    """Runs one pipeline's micro-batches; returns (events, per-submesh finish times).

    ``fwd_s[s]``/``bwd_s[s]``: one micro-batch's forward/backward time on stage s;
    ``sends_s[s]``: transfer time between stage s and s+1 (both directions); stage s runs
    on submesh ``s mod (len(fwd_s) / v)``, one task at a time.
    Events are ``(stage, "F"|"B", micro_batch, start_s, end_s)``.
    """
    events, free, _ = time_pipeline(fwd_s, bwd_s, sends_s, m, schedule, v, extra)
    return events, free


def time_pipeline(fwd_s, bwd_s, sends_s, m: int, schedule: str, v: int = 1,
                  extra: tuple[int, ...] = (), record: bool = True, weight_s=None):
    """``run_pipeline`` plus each stage's last gradient-producing task ``(start_s,
    end_s)``; events only when ``record`` (the planner prices thousands of plans and needs
    only the times). Under ZB-H1 ``weight_s[s]`` of ``bwd_s[s]`` runs as the W pass, the
    rest as B; the first stage has no input cotangent to send, so all of its backward is
    W."""
    n = len(fwd_s)
    p = n // v
    f_end = [[0.0] * m for _ in range(n)]
    b_end = [[0.0] * m for _ in range(n)]
    last_b = [(0.0, 0.0)] * n
    free, events = [0.0] * p, []
    split = schedule == "zbh1"
    if split:
        w_s = [bwd_s[0]] + [min(bwd_s[s], weight_s[s] if weight_s is not None else 0.0)
                            for s in range(1, n)]
        b_s = [b - w for b, w in zip(bwd_s, w_s, strict=True)]
    else:
        b_s = bwd_s
    for s, kind, i in _walk(schedule, n, m, v, extra):
        w = s % p
        if kind == "F":
            ready = f_end[s - 1][i] + sends_s[s - 1] if s else 0.0
            start = free[w] if free[w] > ready else ready
            end = f_end[s][i] = free[w] = start + fwd_s[s]
        elif kind == "W":
            start = free[w]
            end = free[w] = start + w_s[s]
            last_b[s] = (start, end)
        else:
            own = f_end[s][i]
            if s == n - 1:
                ready = own
            else:
                ready = b_end[s + 1][i] + sends_s[s]
                if own > ready:
                    ready = own
            start = free[w] if free[w] > ready else ready
            end = b_end[s][i] = free[w] = start + b_s[s]
            if not split:
                last_b[s] = (start, end)
        if record:
            events.append((s, kind, i, start, end))
    return events, free, last_b


def steady_period(times, sends, extra=()) -> float:
    """The steady-state time per micro-batch of a 1F1B pipeline (one stage per submesh):
    ``times[s]`` a micro-batch's forward + backward on stage s, ``sends[s]`` the transfer
    between s and s+1, ``extra[s]`` its extra warm-up forwards.

    The schedule is a timed event graph whose period is its maximum cycle mean. Its
    cycles run from a stage s down the forwards to a stage q, turn back through q's
    backward and up the backwards to s, where the next forward of s waits for that
    backward: weight ``sum(times[s..q]) + 2 sum(sends[s..q-1])``, spanning ``q - s + 1 +
    e_s - e_q`` micro-batches (the warm-up difference). With q = s it is the stage's own
    time; with q the last stage, 1F1B's familiar round-trip bound. A slow link between
    two stages can bind on its own: only a larger warm-up before it than after it helps.
    """
    t = np.asarray(times, dtype=float)
    p = len(t)
    if p == 1:
        return float(t[0])
    e = np.asarray(extra if len(extra) else np.zeros(p), dtype=float)
    ct = np.concatenate([[0.0], np.cumsum(t)])
    cs = np.concatenate([[0.0], np.cumsum(np.asarray(sends, dtype=float))])
    s, q = np.triu_indices(p)
    weight = ct[q + 1] - ct[s] + 2 * (cs[q] - cs[s])
    span = q - s + 1 + e[s] - e[q]
    return float(np.max(weight / span))


def best_warmup(times, sends, rooms) -> tuple[float, tuple[int, ...]]:
    """(period, extra warm-up per stage) minimising ``steady_period`` with at most
    ``rooms[s]`` extra micro-batches in flight on stage s and warm-up forwards
    (``p - s - 1 + e_s``) never growing along the pipeline. For a target period the
    least warm-ups follow from the last stage back (every cycle is a difference
    constraint ``e_s - e_q >= weight / period - (q - s + 1)``); the period is bisected."""
    t = np.asarray(times, dtype=float)
    p = len(t)
    if p == 1:
        return float(t[0]), ()
    ct = np.concatenate([[0.0], np.cumsum(t)])
    cs = np.concatenate([[0.0], np.cumsum(np.asarray(sends, dtype=float))])
    idx = np.arange(p)

    def least(period: float):
        e = np.zeros(p)
        for s in range(p - 2, -1, -1):
            q = idx[s + 1:]
            w = ct[q + 1] - ct[s] + 2 * (cs[q] - cs[s])
            need = np.ceil(w / period - (q - s + 1) - 1e-9) + e[q]
            e[s] = max(0.0, e[s + 1] - 1, need.max())
            if e[s] > rooms[s]:
                return None
        return e

    # e = 0 reaches steady_period(t, sends); the slowest stage's time bounds from below.
    lo, hi = float(t.max()), steady_period(t, sends)
    e = least(lo)
    if e is None:
        while hi - lo > 1e-6 * hi:  # least(lo) infeasible, least(hi) feasible
            mid = (lo + hi) / 2
            if least(mid) is None:
                lo = mid
            else:
                hi = mid
        e = least(hi)
    return steady_period(t, sends, e), tuple(int(x) for x in e) if e.any() else ()


def warmup_rooms(memory, p: int) -> list[int]:
    """Extra micro-batches each stage of a 1F1B pipeline of ``p`` stages can hold beyond
    its ``p - s`` in flight: ``memory[s]`` is (bytes free for activations, bytes per
    micro-batch in flight); a stage keeping none is unbounded."""
    return [max(0, int(free // per) - (p - s)) if per > 0 else 1 << 20
            for s, (free, per) in enumerate(memory)]


def capped_warmup(extra, m: int) -> tuple[int, ...]:
    """``extra`` warm-up with no stage warming up beyond its ``m`` micro-batches (more
    changes nothing), () when none is left: one canonical plan per schedule."""
    p = len(extra)
    out = tuple(min(e, max(0, m - (p - s))) for s, e in enumerate(extra))
    return out if any(out) else ()


def monotone_warmup(extra) -> tuple[int, ...]:
    """``extra`` warm-up lowered where it would let a stage warm up more forwards than the
    stage before it (``p - w - 1 + extra[w]`` must not grow along the pipeline: a
    deadlock, and an invalid plan): each stage at most one more than the one before."""
    out: list[int] = []
    for e in extra:
        out.append(int(e) if not out else min(int(e), out[-1] + 1))
    return tuple(out)


def time_varied(fwd_s, bwd_s, sends_s, schedule: str = "1f1b") -> float:
    """Finish time of one pipeline whose micro-batches differ (a per-batch plan's
    micro-batches of different buckets and documents): ``fwd_s[s][i]``/``bwd_s[s][i]``
    micro-batch ``i``'s forward/backward on stage ``s`` (one stage a submesh),
    ``sends_s[s][i]`` its transfer between stage ``s`` and ``s + 1`` (both ways), every
    task in ``schedule_walk`` order, one at a time per stage."""
    n, m = len(fwd_s), len(fwd_s[0]) if fwd_s else 0
    f_end = [[0.0] * m for _ in range(n)]
    b_end = [[0.0] * m for _ in range(n)]
    free = [0.0] * n
    last = n - 1
    for s, kind, i in _walk(schedule, n, m, 1):
        if kind == "F":
            ready = f_end[s - 1][i] + sends_s[s - 1][i] if s else 0.0
            start = free[s] if free[s] > ready else ready
            f_end[s][i] = free[s] = start + fwd_s[s][i]
        else:
            ready = f_end[s][i]
            if s < last:
                after = b_end[s + 1][i] + sends_s[s][i]
                if after > ready:
                    ready = after
            start = free[s] if free[s] > ready else ready
            b_end[s][i] = free[s] = start + bwd_s[s][i]
    return max(free, default=0.0)
