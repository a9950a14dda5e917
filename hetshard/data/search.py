"""The search parts both per-batch planners share: the starting placement and the lower
bound no placement beats.

Both planners place a batch's samples on resources that work in parallel (a group's
devices, or a pipeline's stages) and finish a step when the busiest has done its work
and its update. Split the samples fractionally and forget padding, rings and pipeline
fill, and the least step time left is a linear program (:func:`fractional_bound`);
``hetshard.data.lower_bound`` (groups) and ``hetshard.data.pipeline_bound``
(pipelines) are it on their costs. :func:`lpt_placement` is where both searches
start: each sample, longest first, to the owner where it ends earliest;
:func:`proportional_shares` splits rows by speed for both planners' static baselines.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def fractional_bound(costs: np.ndarray, owner: Sequence[int], scale: Sequence[float],
                     step_s: Sequence[float]) -> float:
    """The least T such that the samples, each split fractionally over the owners
    (``x[o, i] >= 0``, summing to 1 over ``o``), keep every resource ``r`` within
    ``sum_i costs[r, i] * x[owner[r], i] <= scale[r] * (T - step_s[r])``.

    ``costs`` is ``[resource, sample]`` seconds (``inf``: the owner cannot take the
    sample); ``owner[r]`` the placement unit resource ``r`` belongs to (a group owns one
    resource, its devices: ``scale`` their count; a pipeline owns its stages, each
    ``scale`` 1). Solved with OR-tools' GLOP; NaN where it finds no optimum (a sample
    no owner can take).
    """
    from ortools.linear_solver import pywraplp
    costs = np.asarray(costs, np.float64)
    owners = sorted(set(owner))
    solver = pywraplp.Solver.CreateSolver("GLOP")
    inf = solver.infinity()
    t = solver.NumVar(0.0, inf, "T")
    # Built coefficient by coefficient (the expression API is slower to build than GLOP
    # is to solve on batches of thousands of samples).
    loads = []
    for r in range(costs.shape[0]):
        c = solver.Constraint(-inf, -float(scale[r]) * float(step_s[r]))
        c.SetCoefficient(t, -float(scale[r]))
        loads.append(c)
    of = {o: [r for r in range(costs.shape[0]) if owner[r] == o] for o in owners}
    finite = np.isfinite(costs)
    for i in range(costs.shape[1]):
        one = solver.Constraint(1.0, 1.0)
        for o in owners:
            if not all(finite[r, i] for r in of[o]):
                continue
            x = solver.NumVar(0.0, 1.0, "")
            one.SetCoefficient(x, 1.0)
            for r in of[o]:
                loads[r].SetCoefficient(x, float(costs[r, i]))
    solver.Minimize(t)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return float("nan")
    return float(t.solution_value())


def lpt_placement(costs: np.ndarray, n: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The owner of each sample (``costs[owner, sample]`` seconds on ``n[owner]``
    devices, scaled by ``scale[owner]``), longest processing time first: each sample,
    longest first, to the owner where it ends earliest. The starting placement of both
    per-batch planners' local searches (groups, pipelines)."""
    per = costs * (scale / n)[:, None]
    order = np.argsort(-np.min(per, axis=0), kind="stable")
    if len(n) == 2:  # the common case, without the inner loop
        where = np.zeros(costs.shape[1], np.int64)
        second = []
        l0 = l1 = 0.0
        for i, a, b in zip(order.tolist(), per[0, order].tolist(), per[1, order].tolist(),
                           strict=True):
            e0, e1 = l0 + a, l1 + b
            if e1 < e0:
                second.append(i)
                l1 = e1
            else:
                l0 = e0
        where[second] = 1
        return where
    cols = per[:, order].T.tolist()
    load = [0.0] * len(n)
    rest = range(1, len(n))
    where = [0] * costs.shape[1]
    for i, c in zip(order.tolist(), cols, strict=True):
        k, end = 0, load[0] + c[0]
        for j in rest:
            e = load[j] + c[j]
            if e < end:
                k, end = j, e
        where[i] = k
        load[k] = end
    return np.asarray(where, np.int64)


def proportional_shares(count: int, speed: np.ndarray) -> np.ndarray:
    """How many of ``count`` equal items each owner takes in proportion to its
    ``speed``, by largest remainders (the static baselines' split of a batch's rows
    over groups or pipelines)."""
    speed = np.asarray(speed, np.float64)
    ideal = count * speed / speed.sum()
    out = np.floor(ideal).astype(int)
    for k in np.argsort(-(ideal - out))[:count - out.sum()]:
        out[k] += 1
    return out
