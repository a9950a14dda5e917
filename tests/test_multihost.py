"""2 processes x 4 fake CPU devices under ``hetshard launch`` (jax.distributed + gloo)."""

import io
import json
import os
import subprocess
import sys
import time

import pytest

from hetshard.distributed import DistributedError, launch

WORKER = os.path.join(os.path.dirname(__file__), "multihost", "worker.py")


def _launch(mode, timeout="20", grace_s=60, nprocs=2, devices=4):
    out = io.StringIO()
    env = dict(os.environ, HETSHARD_TIMEOUT_S=timeout)
    old = os.environ.copy()
    os.environ.update(env)
    try:
        rc = launch(nprocs, devices, [sys.executable, WORKER, mode], out=out,
                    grace_s=grace_s)
        return rc, out.getvalue(), time.time()
    finally:
        os.environ.clear()
        os.environ.update(old)


def _since_failure(text, ended):
    """Seconds from the failing rank's FAILING_AT line to the launcher's return.

    Start-up (two JAX imports, distributed init) is not counted: on 2 loaded cores it alone
    can take longer than the timeout, and the property is how fast a failure ends the job.
    """
    stamps = [float(line.split("FAILING_AT ", 1)[1]) for line in text.splitlines()
              if "] FAILING_AT " in line]
    assert len(stamps) == 1, text[-3000:]
    return ended - stamps[0]


def _lines(text, tag):
    return {line.split("]")[0] + "]": json.loads(line.split(tag, 1)[1])
            for line in text.splitlines() if f"] {tag} " in line}


@pytest.mark.slow
def test_data_parallel_across_processes_matches_one_device():
    rc, text, _ = _launch("dp")
    assert rc == 0, text[-3000:]
    losses, ref = _lines(text, "LOSSES"), _lines(text, "REF")
    assert set(losses) == {"[0]", "[1]"}
    for rank in losses:
        assert losses[rank] == pytest.approx(ref[rank], rel=1e-5)
    # Discovery: one group of CPU "GPUs", one node per process.
    # Without plan=: process 0's plan is every process's (a planner cut by its time
    # limit on a loaded machine can plan otherwise in another process), same losses.
    assert _lines(text, "FIRST") == {"[0]": "process 0 xxxxx", "[1]": "process 0 xxxxx"}
    planned = _lines(text, "PLANNED")
    assert planned["[0]"]["plan"] == planned["[1]"]["plan"]
    for rank in planned:
        assert planned[rank]["losses"] == pytest.approx(ref[rank], rel=1e-5)
    clusters = _lines(text, "CLUSTER")
    assert clusters["[0]"] == clusters["[1]"] == [["cpu", 2, 4, [0, 1]]]


@pytest.mark.slow
def test_user_programs_run_a_pipeline_across_processes():
    # Models written in the tests, not from models/: each process runs one stage.
    rc, text, _ = _launch("user", timeout="60")
    assert rc == 0, text[-4000:]
    got = _scenarios(text)
    for name in ("transformer", "functional"):
        for rank in ("[0]", "[1]"):
            assert got["LOSSES", name, rank] == pytest.approx(got["REF", name, "[0]"],
                                                             rel=1e-5), (name, rank)


@pytest.fixture(scope="module")
def pipelines_run():
    """One launch runs every pipeline scenario of tests/multihost/worker.py."""
    rc, text, _ = _launch("pipelines", timeout="60")
    assert rc == 0, text[-4000:]
    return _scenarios(text), text


def _scenarios(text) -> dict:
    """``(tag, scenario, rank) -> payload`` of the workers' LOSSES and REF lines."""
    got = {}
    for line in text.splitlines():
        for tag in ("LOSSES", "REF"):
            if f"] {tag} " in line:
                rank = line.split("]")[0] + "]"
                name, payload = line.split(f"{tag} ", 1)[1].split(" ", 1)
                got[tag, name, rank] = json.loads(payload)
    return got


def _check_scenario(got, name):
    want = got["REF", name, "[0]"]
    for rank in ("[0]", "[1]"):
        info = got["LOSSES", name, rank]
        assert info["losses"] == pytest.approx(want, rel=1e-5), (name, rank)
        # Each process compiled and ran only the stages on its own devices.
        assert info["mine"] and info["own_compiled"] >= 1
        assert info["foreign_compiled"] == 0
        me = int(rank[1])
        for pi, si in info["mine"]:
            assert me in info["procs"][pi][si]
    return got["LOSSES", name, "[0]"]["procs"]


@pytest.mark.slow
def test_two_stage_pipeline_with_one_stage_per_process(pipelines_run):
    got, _ = pipelines_run
    assert _check_scenario(got, "pp2") == [[[0], [1]]]


@pytest.mark.slow
def test_pipeline_stage_whose_mesh_spans_both_processes(pipelines_run):
    got, _ = pipelines_run
    assert _check_scenario(got, "span") == [[[0], [0, 1], [1]]]


@pytest.mark.slow
def test_zero_bubble_pipeline_across_processes(pipelines_run):
    got, _ = pipelines_run
    assert _check_scenario(got, "span_zb") == [[[0], [0, 1], [1]]]
    assert all(got["LOSSES", "span_zb", r]["zb_compiled"] >= 1 for r in ("[0]", "[1]"))
    # the spanning stage's momentum lives in both processes' host memory (offload)
    assert all(got["LOSSES", "span_zb", r]["host_leaves"] >= 1 for r in ("[0]", "[1]"))
    assert all(got["LOSSES", name, r]["host_leaves"] == 0 for name in ("span", "pp2")
               for r in ("[0]", "[1]"))
    assert all(got["LOSSES", "span", r]["zb_compiled"] == 0 for r in ("[0]", "[1]"))


@pytest.mark.slow
def test_uneven_pipelines_5_3_in_different_processes(pipelines_run):
    got, _ = pipelines_run
    assert _check_scenario(got, "pipes") == [[[0], [0]], [[1], [1]]]
    # Congruent single-stage pipelines: the gradient psum spans the two processes.
    assert _check_scenario(got, "pipes_eq") == [[[0]], [[1]]]


@pytest.mark.slow
def test_mllm_vision_encoder_in_the_other_process_on_a_spec_pinned_binding(pipelines_run):
    got, text = pipelines_run
    # The spec pins its "h100" group (ids 0-3) to process 1 and "v100" (4-7) to process 0.
    assert _lines(text, "BOUND") == {"[0]": [1, 1, 1, 1, 0, 0, 0, 0],
                                     "[1]": [1, 1, 1, 1, 0, 0, 0, 0]}
    # Vision encoder (stage 0) on process 0, the language model and loss on process 1.
    assert _check_scenario(got, "mllm") == [[[0], [1]]]
    errors = [line for line in text.splitlines() if "] BINDERR " in line]
    assert len(errors) == 2
    assert all("pinned to process 0, which has 0 free devices" in e for e in errors)


def _idle_outputs(text, nprocs):
    """Per scenario of worker.py's ``idle`` mode: every process's losses equal one
    device's; returns which processes ran a part of the plan."""
    got = _scenarios(text)
    ranks = [f"[{r}]" for r in range(nprocs)]
    runs = {}
    for (tag, name, rank), info in got.items():
        if tag != "LOSSES":
            continue
        assert info["losses"] == pytest.approx(got["REF", name, "[0]"], rel=1e-5), \
            (name, rank)
        runs.setdefault(name, set())
        if info["runs"]:
            runs[name].add(rank)
    assert all({r for (t, n, r) in got if t == "LOSSES" and n == name} == set(ranks)
               for name in runs)
    return runs


@pytest.mark.slow
def test_a_plan_that_leaves_a_process_idle_runs_on_every_process():
    # 2 processes x 4 devices: plans entirely in process 0, or entirely in process 1;
    # the idle process runs nothing and still returns the step's loss.
    rc, text, _ = _launch("idle", timeout="60")
    assert rc == 0, text[-4000:]
    runs = _idle_outputs(text, 2)
    assert runs == {"single_p0": {"[0]"}, "pipe_p0": {"[0]"}, "single_p1": {"[1]"},
                    "planned": {"[0]"}}
    # The planner's own plan on a cluster whose fastest GPUs are process 0's.
    planned = _scenarios(text)["LOSSES", "planned", "[1]"]
    assert planned["used"] == [0] and not planned["runs"], planned


@pytest.mark.slow
def test_three_processes_with_a_stage_split_across_two_and_one_idle():
    rc, text, _ = _launch("idle", timeout="60", nprocs=3, devices=2)
    assert rc == 0, text[-4000:]
    assert _idle_outputs(text, 3) == {"span_single": {"[0]", "[1]"},
                                      "span_pipe": {"[0]", "[1]"},
                                      "pipe_p12": {"[1]", "[2]"}}


def test_processes_that_disagree_get_an_error_on_every_process():
    rc, text, _ = _launch("fingerprint")
    assert rc == 0, text[-3000:]
    mismatch = [line for line in text.splitlines() if "MISMATCH" in line]
    assert {line[:3] for line in mismatch} == {"[0]", "[1]"}
    assert all("disagree on the test value" in line for line in mismatch)


def test_a_dead_process_stops_the_survivor_within_the_timeout():
    rc, text, ended = _launch("die", timeout="5")
    assert rc == 3  # the first failure's exit code
    assert "process 1 exited with 3" in text
    assert "unhealthy" in text and "[0]" in text  # the survivor names the missing task
    assert _since_failure(text, ended) < 5 + 20  # heartbeat timeout and teardown, no hang


def test_a_raising_rank_is_named_with_its_traceback_and_the_job_ends_in_time():
    # One rank raises while the other waits for it in a collective: the job ends within
    # the timeout of its failure, with the raising rank's exit status and its traceback
    # shown as the cause before anything the survivor printed while it was stopped.
    rc, text, ended = _launch("raise", timeout="5", grace_s=None)
    assert rc == 1, text[-3000:]
    assert _since_failure(text, ended) < 5 + 10, text[-3000:]
    cause = text.index("process 1 failed first (exit status 1); the cause, its traceback:")
    assert "[1] ValueError: rank one broke" in text[cause:]
    assert "[1] Traceback (most recent call last)" in text[cause:]
    held = text.find("held back")
    assert held == -1 or held > text.index("ValueError: rank one broke", cause)


def test_a_killed_rank_ends_the_job_with_a_signal_status():
    rc, text, ended = _launch("kill", timeout="5", grace_s=None)
    assert rc == 128 + 9, text[-3000:]
    assert "process 1 failed first (exit status 137) without a Python traceback" in text
    assert _since_failure(text, ended) < 5 + 10, text[-3000:]


def test_a_missing_executable_is_refused_before_anything_starts():
    out = io.StringIO()
    with pytest.raises(DistributedError, match="command='no-such-program-x' is invalid"):
        launch(2, 1, ["no-such-program-x", "arg"], out=out)
    assert out.getvalue() == ""
    res = subprocess.run([sys.executable, "-m", "hetshard", "launch", "--nprocs", "2", "--",
                          "./missing-script.sh"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "missing-script.sh" in res.stderr
    assert "Traceback" not in res.stderr


def test_launch_cli_prefixes_output_and_returns_the_first_failure():
    cmd = [sys.executable, "-m", "hetshard", "launch", "--nprocs", "2", "--", sys.executable,
           "-c", "import os,sys; r=int(os.environ['HETSHARD_PROCESS_ID']); print('hi', r); "
           "sys.exit(5 if r == 1 else 0)"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 5
    assert "[0] hi 0" in res.stdout and "[1] hi 1" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "hetshard", "launch", "--nprocs", "0", "--",
                          "true"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nprocs=0" in bad.stderr


def test_init_distributed_is_a_no_op_in_one_process_and_checks_its_environment(monkeypatch):
    from hetshard import distributed as hd
    for var in ("HETSHARD_COORDINATOR", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE",
                "KUBERNETES_SERVICE_HOST", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    assert hd.init_distributed() is False
    monkeypatch.setenv("HETSHARD_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("HETSHARD_NUM_PROCESSES", "two")
    with pytest.raises(DistributedError, match="HETSHARD_NUM_PROCESSES"):
        hd.init_distributed()
    monkeypatch.setenv("HETSHARD_TIMEOUT_S", "-3")
    with pytest.raises(DistributedError, match="HETSHARD_TIMEOUT_S"):
        hd.timeout_s()


ELASTIC_WORKER = os.path.join(os.path.dirname(__file__), "multihost", "elastic_worker.py")


@pytest.mark.slow
def test_a_killed_process_restarts_and_the_run_resumes_from_its_checkpoint(tmp_path):
    """2 processes checkpoint every 2 steps; process 1 is killed after step 3; the
    launcher restarts both (--max-restarts 1), which restore step 2 into their plan and
    go on: every step's loss equals one device's, one step was done twice."""
    import numpy as np
    import optax
    from flax import nnx

    import hetshard_models as models
    from hetshard_models import data, losses, steps
    out = io.StringIO()
    old = os.environ.copy()
    os.environ["HETSHARD_TIMEOUT_S"] = "5"
    try:
        rc = launch(2, 2, [sys.executable, ELASTIC_WORKER, str(tmp_path / "ckpt"), "6", "2",
                           "3"], out=out, grace_s=10, max_restarts=1)
    finally:
        os.environ.clear()
        os.environ.update(old)
    text = out.getvalue()
    assert rc == 0, text[-3000:]
    assert "restarting all 2 processes (restart 1 of 1)" in text
    assert "[0] RESUMED 2 restart 1" in text
    got = {}
    for line in text.splitlines():
        if line.startswith("[0] LOSS "):
            _, _, i, loss = line.split()
            got.setdefault(int(i), []).append(float(loss))
    assert sorted(got) == list(range(6)) and len(got[2]) == 2  # step 2 ran before the kill
    rng = np.random.default_rng(0)
    batches = [data.text_batch(rng, 8, 32, 128) for _ in range(6)]
    model = models.build("gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32", rngs=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    step = nnx.jit(steps.train_step(losses.text_loss))
    want = [float(step(model, opt, b)) for b in batches]
    for i, seen in got.items():
        assert seen == pytest.approx([want[i]] * len(seen), rel=1e-5), (i, seen, want[i])


def test_launch_refuses_a_negative_restart_count():
    with pytest.raises(DistributedError, match="max-restarts"):
        launch(1, 1, [sys.executable, "-c", "pass"], max_restarts=-1)
