"""Feedback on long work (issue 23): the planner reports its phases and the plans it
priced; @hetshard.jit says when it plans and what it chose (quiet=True: nothing); the
CLI's help starts without JAX."""

import subprocess
import sys

import numpy as np
import user_models

import hetshard
from hetshard import progress


def _step():
    step, (model, opt, batch), _ = user_models.make_transformer()
    return step, model, opt, batch


def test_planning_reports_phases_plans_priced_and_the_best_so_far():
    step, model, opt, batch = _step()
    seen = []
    with progress.reporting(lambda p: seen.append((p.phase, p.priced, p.best_tokens_per_s)),
                            limit_s=5) as state:
        plan = hetshard.plan(step, model, opt, batch, cluster="h100-a100-v100-x8",
                             time_limit_s=5)
    phases = [s[0] for s in seen]
    assert phases[0] == "tracing and pricing the program's layers"
    assert {"pricing", "local search"} <= {p.split(" ")[0] if p.startswith("pricing") else p
                                           for p in phases}
    assert state.priced > 10 and [s[1] for s in seen] == sorted(s[1] for s in seen)
    # The best reported is the best plan priced: at least the chosen plan's throughput
    # before its last re-pricing (the simulator's prediction is deterministic).
    assert state.best_tokens_per_s >= plan.predicted.tokens_per_s * (1 - 1e-9)
    assert "plans priced" in state.line() and "s of 5 s left" in state.line()


def test_jit_says_when_it_plans_and_what_it_chose(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HETSHARD_CACHE_DIR", str(tmp_path))
    from hetshard import cache
    cache.clear_memory()
    step, model, opt, batch = _step()
    jitted = hetshard.jit(step, cluster="h100-a100-v100-x8", time_limit_s=3, max_stages=1)
    assert np.isfinite(float(jitted(model, opt, batch)))
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if line.startswith("hetshard.jit:")]
    assert len(said) == 2 and "planning nnx_step" in said[0] and "up to 3 s" in said[0]
    assert said[1].startswith("hetshard.jit: planned in") and "tokens/s" in said[1]
    cache.clear_memory()
    quiet = hetshard.jit(step, cluster="h100-a100-v100-x8", time_limit_s=3, max_stages=1,
                         quiet=True)
    quiet(model, opt, batch)
    assert not [x for x in capsys.readouterr().err.splitlines() if "hetshard.jit" in x]


def test_cli_help_does_not_import_jax():
    code = ("import sys\nfrom hetshard.cli import main\ntry:\n    main(['plan', '--help'])\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in sys.modules if m in "
            "('jax', 'flax', 'numpy', 'ortools')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out
