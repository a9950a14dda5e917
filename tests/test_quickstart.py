"""The main job (experiments/quickstart.py), shortened to 3 training steps."""

import importlib.util
import json
import os

import pytest
from rich.console import Console

from hetshard._plan import Plan

_PATH = os.path.join(os.path.dirname(__file__), "..", "experiments", "quickstart.py")


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_main_job_puts_the_mixed_cluster_to_work_and_trains_its_plan(tmp_path):
    """The big plan uses more than one GPU type and beats fastest-only; the plan trained
    on the 8 fake devices spans GPU types over several stages; its losses match one
    device; everything lands in the run directory, nothing under experiments/."""
    qs = _quickstart()
    results = os.path.join(os.path.dirname(_PATH), "results")
    before = sorted(os.listdir(results))
    checks = qs.run(3, str(tmp_path), Console(file=open(os.devnull, "w")))
    assert checks == {k: True for k in checks}, checks
    assert set(checks) >= {"the big plan uses more than one GPU type", "it beats fastest-only",
                           "the trained plan spans GPU types over several stages or pipelines",
                           "every step matches one device (<= 1e-5)"}
    big = Plan.load(tmp_path / "plan.json")
    trained = Plan.load(tmp_path / "trained_plan.json")
    assert len({st.gpu for p in big.pipelines for st in p.stages}) > 1
    assert len({st.gpu for p in trained.pipelines for st in p.stages}) > 1
    assert sum(len(p.stages) for p in trained.pipelines) > 1
    assert json.loads((tmp_path / "trained_trace.json").read_text())["traceEvents"]
    for name in ("plan_schedule.png", "trained_schedule.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert sorted(os.listdir(results)) == before
