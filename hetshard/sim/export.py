"""Exports of a simulated step: Chrome trace JSON (opens in Perfetto) and a PNG timeline."""

from __future__ import annotations

import json
import os

from hetshard.sim.simulator import SimResult

# task kind -> (colour, legend label); B is the whole backward except under ZB-H1
_KINDS = {"F": ("#4c72b0", "forward"), "B": ("#dd8452", "backward (ZB-H1: input grads)"),
          "W": ("#da8bc3", "weight grads (ZB-H1)"), "sync": ("#55a868", "grad sync"),
          "opt": ("#8172b3", "optimizer"),
          "gather": ("#937860", "parameter all-gather (ZeRO-1)"),
          "send": ("#8c8c8c", "tied weight's gradient / update")}


def chrome_trace(result: SimResult) -> dict:
    """Trace Event Format: one process per pipeline, one thread per submesh (its stages'
    tasks; one stage per submesh unless interleaved), times in us."""
    events = []
    for t in result.tasks:
        name = t.kind if t.micro_batch < 0 else f"{t.kind}{t.micro_batch}"
        if t.stage != t.worker:
            name += f" s{t.stage}"
        events.append({"name": name, "cat": t.kind, "ph": "X", "pid": t.pipeline,
                       "tid": t.worker, "ts": t.start_s * 1e6,
                       "dur": max(t.end_s - t.start_s, 0.0) * 1e6,
                       "args": {"micro_batch": t.micro_batch, "stage": t.stage}})
    pipes = sorted({t.pipeline for t in result.tasks})
    for p in pipes:
        events.append({"name": "process_name", "ph": "M", "pid": p,
                       "args": {"name": f"pipeline {p}"}})
        for w in sorted({t.worker for t in result.tasks if t.pipeline == p}):
            events.append({"name": "thread_name", "ph": "M", "pid": p, "tid": w,
                           "args": {"name": f"submesh {w}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SimResult, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(result), f)


def write_timeline_png(result: SimResult, path: str | os.PathLike, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted({(t.pipeline, t.worker) for t in result.tasks})
    index = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 1.5))
    for t in result.tasks:
        y = index[(t.pipeline, t.worker)]
        ax.barh(y, (t.end_s - t.start_s) * 1e3, left=t.start_s * 1e3, height=0.8,
                color=_KINDS[t.kind][0], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"p{p} w{w}" for p, w in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"step {result.step_time_s * 1e3:.1f} ms, "
                          f"bubble {result.bubble_fraction:.1%}")
    shown = [k for k in _KINDS if any(t.kind == k for t in result.tasks)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=_KINDS[k][0]) for k in shown]
    ax.legend(handles, [_KINDS[k][1] for k in shown], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
