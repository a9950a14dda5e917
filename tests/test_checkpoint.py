"""hetshard.checkpoint: save/restore round trips across plan kinds and device counts
(training resumed under another plan equals one uninterrupted device), a crash mid-save,
corruption, how many are kept, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import hetshard
import hetshard_models as models
from hetshard._plan import Pipeline, Plan, Stage
from hetshard.checkpoint import CheckpointCorruptError, Checkpointer
from hetshard.cluster import Cluster
from hetshard.errors import SpecError
from hetshard_models import data, losses, steps

MODEL = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=32"
CLUSTER = {"name": "a100-x8", "groups": [{"name": "a", "gpu": "A100-80GB", "nodes": 1,
                                          "gpus_per_node": 8}]}
A = "A100-80GB"


def _plan(*pipelines):
    return Plan(MODEL, Cluster.load(CLUSTER).to_dict(), 8, 32, tuple(pipelines),
                attention="reference")


SPMD8 = _plan(Pipeline((Stage(0, 6, tuple(range(8)), A, (("data", 8),)),), 8, 1, 1))
PIPE6 = _plan(Pipeline((Stage(0, 3, (0, 1), A, (("data", 2),)),
                        Stage(3, 6, (2, 3, 4, 5), A, (("data", 4),))), 8, 2, 2))
PIPE4 = _plan(Pipeline((Stage(0, 2, (6,), A, (("data", 1),)),
                        Stage(2, 4, (7,), A, (("data", 1),)),
                        Stage(4, 6, (4, 5), A, (("data", 2),))), 8, 2, 4))


def _batches(n=4):
    rng = np.random.default_rng(0)
    return [data.text_batch(rng, 8, 32, 128) for _ in range(n)]


def _fresh(seed=0):
    model = models.build(MODEL, rngs=seed)
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


STEP = steps.train_step(losses.text_loss)


def _reference(batches):
    model, opt = _fresh()
    step = nnx.jit(STEP)
    return [float(step(model, opt, b)) for b in batches]


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(SPMD8, PIPE6), (PIPE6, PIPE4)],
                         ids=["spmd8-to-pipeline6", "pipeline6-to-pipeline4"])
def test_resumed_under_another_plan_equals_one_uninterrupted_device(tmp_path, before, after):
    batches = _batches()
    want = _reference(batches)
    model, opt = _fresh()
    first = hetshard.jit(STEP, cluster=CLUSTER, plan=before, quiet=True)
    got = [float(first(model, opt, b)) for b in batches[:2]]
    ck = Checkpointer(tmp_path, keep=2)
    ck.save(2, (model, opt), data_position={"batch": 2}, plan=first.plan)
    ck.wait()
    del model, opt, first

    model, opt = _fresh(seed=7)  # other weights: the restore must replace them all
    second = hetshard.jit(STEP, cluster=CLUSTER, plan=after, quiet=True)
    where = second.state_shardings(model, opt, batches[2])
    info = ck.restore((model, opt), shardings=where)
    assert info.step == 2 and info.data_position == {"batch": 2}
    assert info.plan.what_runs() == before.what_runs()
    used = set(d.id for p in after.pipelines for st in p.stages for d in
               [jax.devices()[i] for i in st.devices])
    # every restored array lives where the new plan keeps it, on its devices only
    for x, s in zip(jax.tree.leaves(nnx.to_pure_dict(nnx.state((model, opt)))),
                    jax.tree.leaves(where, is_leaf=lambda s: isinstance(
                        s, jax.sharding.Sharding)), strict=True):
        assert x.sharding == s
        assert {d.id for d in x.sharding.device_set} <= used
    got += [float(second(model, opt, b)) for b in batches[2:]]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def _saved(tmp_path, steps_=(1, 2), keep=3):
    model, opt = _fresh()
    ck = Checkpointer(tmp_path, keep=keep)
    for s in steps_:
        nnx.update(model, jax.tree.map(lambda x, s=s: x + s, nnx.state(model, nnx.Param)))
        ck.save(s, (model, opt), data_position=s)
    ck.wait()
    return ck, model, opt


def test_newest_checkpoints_are_kept(tmp_path):
    ck, _, _ = _saved(tmp_path, steps_=(1, 2, 3, 4), keep=2)
    assert ck.steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]


def test_a_corrupted_checkpoint_is_detected_and_the_previous_one_used(tmp_path):
    ck, model, opt = _saved(tmp_path)
    want = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    newest = os.path.join(tmp_path, "2")
    victim = max((os.path.join(d, f) for d, _, fs in os.walk(newest) for f in fs
                  if "manifest" not in f), key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        f.write(b"\x00garbage\xff")
    with pytest.raises(CheckpointCorruptError) as e:
        ck.restore((model, opt), step=2)
    assert e.value.step == 2 and os.path.relpath(victim, newest) == e.value.path
    fresh, fresh_opt = _fresh(seed=3)
    with pytest.warns(UserWarning, match="step 2 is corrupt"):
        info = ck.restore((fresh, fresh_opt))
    assert info.step == 1 and info.skipped == (2,)
    # Every checkpoint corrupt: one sentence naming the directory and the steps.
    victim1 = max((os.path.join(d, f) for d, _, fs in os.walk(os.path.join(tmp_path, "1"))
                   for f in fs if "manifest" not in f), key=os.path.getsize)
    with open(victim1, "r+b") as f:
        f.write(b"\x00garbage\xff")
    with pytest.warns(UserWarning), pytest.raises(CheckpointCorruptError) as e:
        ck.restore(_fresh(seed=4))
    assert str(e.value) == (f"no checkpoint in {tmp_path} can be restored: steps 2, 1 are "
                            f"each corrupt or unreadable (the warnings above say how)")
    got = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(fresh, nnx.Param)))
    # step 1 is step 2's weights less 2 (what _saved added for step 2)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w - 2, rtol=1e-6, atol=1e-6)


_CRASH = textwrap.dedent("""
    import os, signal, sys
    import optax
    from flax import nnx
    import hetshard_models as models
    import orbax.checkpoint._src.path.atomicity as atomicity
    from hetshard.checkpoint import Checkpointer

    model = models.build("{model}", rngs=0)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    ck = Checkpointer(sys.argv[1])
    ck.save(1, (model, opt), data_position=1)
    ck.wait()

    async def die(self, *a, **k):  # every array written, the rename not yet done
        os.kill(os.getpid(), signal.SIGKILL)
    atomicity.AtomicRenameTemporaryPath.finalize = die
    ck.save(2, (model, opt), data_position=2)
    ck.wait()
""")


def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    r = subprocess.run([sys.executable, "-c", _CRASH.format(model=MODEL), str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    assert any(n.startswith("2") and n != "2" for n in os.listdir(tmp_path)), \
        os.listdir(tmp_path)  # the half-saved step's temporary directory
    ck = Checkpointer(tmp_path)
    assert ck.steps() == [1]
    (step, left), = ck.interrupted().items()
    assert step == 2 and os.path.isdir(left)
    model, opt = _fresh(seed=5)
    # Restoring says what the killed save left and how to remove it.
    with pytest.warns(UserWarning, match=r"interrupted save of step 2 left .* rm -r "):
        assert ck.restore((model, opt)).data_position == 1


def test_bad_input(tmp_path):
    with pytest.raises(SpecError, match="keep"):
        Checkpointer(tmp_path, keep=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpecError, match="directory"):
        Checkpointer(tmp_path / "file")
    ck = Checkpointer(tmp_path / "run")
    model, opt = _fresh()
    with pytest.raises(SpecError, match="step"):
        ck.save(-1, (model, opt))
    with pytest.raises(SpecError, match="data_position"):
        ck.save(1, (model, opt), data_position=object())
    with pytest.raises(hetshard.HetshardError, match="no checkpoint"):
        ck.restore((model, opt))


_RESUME_ON_6 = textwrap.dedent("""
    import json, sys, warnings
    import jax
    jax.config.update("jax_num_cpu_devices", 6)
    import numpy as np
    import hetshard
    from hetshard.checkpoint import Checkpointer
    from hetshard.errors import DeviceBindingError
    sys.path.insert(0, sys.argv[2])
    import test_checkpoint as t

    batches = t._batches()
    model, opt = t._fresh(seed=9)
    try:
        hetshard.jit(t.STEP, cluster=t.CLUSTER, plan=t.SPMD8, quiet=True)(model, opt, batches[2])
        refused = False
    except DeviceBindingError:
        refused = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = hetshard.jit(t.STEP, cluster=t.CLUSTER, plan=t.SPMD8, elastic=True,
                            quiet=True, time_limit_s=5)
    info = Checkpointer(sys.argv[1]).restore(
        (model, opt), shardings=step.state_shardings(model, opt, batches[2]))
    losses = [float(step(model, opt, b)) for b in batches[info.data_position:]]
    used = sorted({d for p in step.plan.pipelines for st in p.stages for d in st.devices})
    print(json.dumps({"losses": losses, "refused": refused, "cluster": step.cluster.name,
                      "devices": used, "warned": any("pinned plan" in str(w.message)
                                                     for w in caught)}))
""")


@pytest.mark.slow
def test_two_devices_lost_the_run_replans_and_resumes_from_its_checkpoint(tmp_path):
    """Train on 8 devices and checkpoint; a new process with 6 devices (two lost) and
    hetshard.jit(elastic=True) re-plans for what is left, restores into the new plan and
    continues: the losses equal one uninterrupted device's."""
    import json
    batches = _batches()
    want = _reference(batches)
    model, opt = _fresh()
    first = hetshard.jit(STEP, cluster=CLUSTER, plan=SPMD8, quiet=True)
    got = [float(first(model, opt, b)) for b in batches[:2]]
    ck = Checkpointer(tmp_path)
    ck.save(2, (model, opt), data_position=2, plan=first.plan)
    ck.close()
    r = subprocess.run([sys.executable, "-c", _RESUME_ON_6, str(tmp_path),
                        os.path.dirname(__file__)], capture_output=True, text=True,
                       timeout=900, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["refused"] and out["warned"]
    assert out["cluster"] == "a100-x8-first6" and max(out["devices"]) <= 5
    np.testing.assert_allclose(got + out["losses"], want, rtol=1e-5)
