"""Exports of a simulated step: Chrome trace JSON (opens in Perfetto) and a PNG timeline.

Each submesh gets two lanes: its compute (forward, backward, weight gradients,
optimizer) and its communication (gradient sync, ZeRO-1 all-gather, tied-weight
transfers), which overlap the compute in time and would hide it on one lane. Given the
plan, lanes are named by GPU type and the stages each submesh runs.
"""

from __future__ import annotations

import json
import os

from hetshard._plan import Plan
from hetshard.sim.simulator import SimResult

# task kind -> (colour, legend label)
_KINDS = {"F": ("#4c72b0", "forward"), "B": ("#dd8452", "backward"),
          "W": ("#da8bc3", "weight gradients (ZB-H1)"), "opt": ("#8172b3", "optimizer"),
          "sync": ("#55a868", "gradient sync"),
          "gather": ("#937860", "parameter all-gather (ZeRO-1)"),
          "send": ("#8c8c8c", "tied weight's gradient / update")}
_COMM = ("sync", "gather", "send")


def _label(kind: str, kinds: set[str]) -> str:
    if kind == "B" and "W" in kinds:
        return "backward, input gradients (ZB-H1)"
    return _KINDS[kind][1]


def _lane_names(result: SimResult, plan: Plan | None) -> dict[tuple[int, int], str]:
    """(pipeline, submesh) -> "pipeline 0 / H100-80GB x4: stages 0, 4" (or p0 w1)."""
    out = {}
    for p, w in sorted({(t.pipeline, t.worker) for t in result.tasks}):
        stages = sorted({t.stage for t in result.tasks if (t.pipeline, t.worker) == (p, w)})
        if plan is not None and p < len(plan.pipelines):
            st = plan.pipelines[p].stages[w]
            out[(p, w)] = (f"pipeline {p} / {st.gpu} x{len(st.devices)}: stage"
                           f"{'s' if len(stages) > 1 else ''} "
                           f"{', '.join(map(str, stages))}")
        else:
            out[(p, w)] = f"pipeline {p} / submesh {w}"
    return out


def chrome_trace(result: SimResult, plan: Plan | None = None) -> dict:
    """Trace Event Format: one process per pipeline, two threads per submesh (compute,
    communication: slices on one thread never overlap), times in us."""
    events = []
    names = _lane_names(result, plan)
    for t in result.tasks:
        name = t.kind if t.micro_batch < 0 else f"{t.kind}{t.micro_batch}"
        if t.stage != t.worker:
            name += f" s{t.stage}"
        events.append({"name": name, "cat": t.kind, "ph": "X", "pid": t.pipeline,
                       "tid": 2 * t.worker + (t.kind in _COMM), "ts": t.start_s * 1e6,
                       "dur": max(t.end_s - t.start_s, 0.0) * 1e6,
                       "args": {"micro_batch": t.micro_batch, "stage": t.stage}})
    for p in sorted({t.pipeline for t in result.tasks}):
        events.append({"name": "process_name", "ph": "M", "pid": p,
                       "args": {"name": f"pipeline {p}"}})
        for w in sorted({t.worker for t in result.tasks if t.pipeline == p}):
            for comm in (0, 1):
                events.append({"name": "thread_name", "ph": "M", "pid": p,
                               "tid": 2 * w + comm,
                               "args": {"name": names[(p, w)].split(" / ", 1)[1]
                                        + (" (communication)" if comm else "")}})
                events.append({"name": "thread_sort_index", "ph": "M", "pid": p,
                               "tid": 2 * w + comm, "args": {"sort_index": 2 * w + comm}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SimResult, path: str | os.PathLike,
                       plan: Plan | None = None) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(result, plan), f)


def _time_unit(seconds: float) -> tuple[str, float]:
    for name, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= 2 * scale:
            return name, scale
    return "us", 1e-6


def write_timeline_png(result: SimResult, path: str | os.PathLike, title: str = "",
                       plan: Plan | None = None) -> None:
    """One row per submesh: compute bars, with its communication in a thin band below
    them; the time axis in s, ms or us as the step's length suits; the legend below the
    plot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = _lane_names(result, plan)
    rows = list(names)
    index = {r: i for i, r in enumerate(rows)}
    unit, scale = _time_unit(result.step_time_s)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 2.2))
    for t in result.tasks:
        y = index[(t.pipeline, t.worker)]
        comm = t.kind in _COMM
        ax.barh(y + (0.3 if comm else -0.1), (t.end_s - t.start_s) / scale,
                left=t.start_s / scale, height=0.2 if comm else 0.6,
                color=_KINDS[t.kind][0], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [names[r] for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, result.step_time_s / scale)
    schedule = ""
    if plan is not None:
        schedule = ", ".join(sorted({p.schedule for p in plan.pipelines})) + ", "
    ax.set_title(title or f"{schedule}step {result.step_time_s / scale:.3g} {unit}, "
                          f"bubble {result.bubble_fraction:.1%}", fontsize=10)
    kinds = {t.kind for t in result.tasks}
    shown = [k for k in _KINDS if k in kinds]
    handles = [plt.Rectangle((0, 0), 1, 1, color=_KINDS[k][0]) for k in shown]
    ax.legend(handles, [_label(k, kinds) for k in shown], loc="upper center",
              bbox_to_anchor=(0.5, -0.5 / (0.6 * len(rows) + 2.2) - 0.12),
              ncol=min(4, len(shown)), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
