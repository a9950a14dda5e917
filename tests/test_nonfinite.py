"""A step with a non-finite loss or gradient is caught whatever it returns (issue 23, 1):
``nan_policy`` skips, applies or raises on every plan kind, NNX and pytree steps alike."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import user_models
from flax import nnx

import hetshard
from hetshard._plan import Pipeline, Plan, Stage
from hetshard.cluster import Cluster
from hetshard.errors import NonFiniteLossError, SpecError
from hetshard.runtime.guard import find_loss

CLUSTER = "h100-a100-v100-x8"  # 2 H100, 2 A100, 4 V100


def _plan(program, stages):
    """Global batch 8: one stage on the four V100s, or two (H100s | V100s) in 2
    micro-batches."""
    n = program.layering(2).num_layers
    if stages == 1:
        st = (Stage(0, n, (4, 5, 6, 7), "V100-32GB", (("data", 4),)),)
        pipe = Pipeline(st, 8, 1, 2)
    else:
        st = (Stage(0, n // 2, (0, 1), "H100-80GB", (("data", 2),)),
              Stage(n // 2, n, (4, 5, 6, 7), "V100-32GB", (("data", 4),)))
        pipe = Pipeline(st, 8, 2, 2)
    return Plan(program.name, Cluster.load(CLUSTER).to_dict(), 8, program.seq_len, (pipe,),
                dtype=program.dtype, attention="reference")


def _poisoned(model, batch, how):
    """The tiny LM's loss with a NaN loss (``how="loss"``) or a finite loss whose gradient
    is NaN (``how="grad"``: d sqrt(x)/dx at 0 is infinite, times 0); ``"none"``: as it
    is."""
    loss = user_models.lm_loss(model, batch)
    w = model.head.kernel[...]
    if how == "loss":
        return loss * jnp.nan
    if how == "none":
        return loss
    return loss + 0.0 * jnp.sqrt(jnp.sum(w * 0.0))


def _nnx_step(how):
    def step(model, optimizer, batch):
        loss, grads = hetshard.value_and_grad(lambda m, b: _poisoned(m, b, how))(model, batch)
        optimizer.update(model, grads)
        return {"acc": jnp.float32(0.5), "loss": loss}  # the loss is not the first leaf
    return step


def _tiny():
    model = user_models.make_transformer()[1][0]
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batch = user_models._text_batches(np.random.default_rng(0))[0]
    return model, opt, batch


def _params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.fixture(params=["branch", "select"])
def guard_path(request, monkeypatch):
    """The two ways a step keeps or refuses its update (``hetshard.runtime.guard.branches``
    picks one by the devices): the update in a ``lax.cond``'s true branch, or a select
    per state leaf; each test taking this fixture runs under both."""
    import hetshard.runtime.executable as hexe
    import hetshard.runtime.micro_steps as hmicro
    import hetshard.runtime.pipeline as hpipe
    branch = request.param == "branch"
    for module in (hexe, hpipe, hmicro):
        monkeypatch.setattr(module, "branches", lambda devices: branch)
    return request.param


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("how", ["loss", "grad"])
def test_dict_output_nan_is_skipped_and_weights_kept(stages, how, guard_path):
    model, opt, batch = _tiny()
    step = _nnx_step(how)
    before = _params(model)
    plan = _plan(hetshard.Program(step, (model, opt, batch)), stages)
    jitted = hetshard.jit(step, cluster=CLUSTER, plan=plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jitted(model, opt, batch)
        assert not [w for w in caught if "not applied" in str(w.message)]  # (not waited)
        jitted.wait()
    said = [str(w.message) for w in caught if "not applied" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert ("gradients" in said[0]) == (how == "grad")
    assert np.isfinite(float(out["loss"])) == (how == "grad")
    for a, b in zip(_params(model), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(x).all() for x in _params(model))


def _jitted(how, **kw):
    model, opt, batch = _tiny()
    step = _nnx_step(how)
    plan = _plan(hetshard.Program(step, (model, opt, batch)), 1)
    return hetshard.jit(step, cluster=CLUSTER, plan=plan, **kw), (model, opt, batch)


def _compiled_text(jitted, args) -> str:
    from hetshard.runtime.executable import put, step_state
    entry = next(iter(jitted._compiled.values()))
    state = put(step_state(entry.program, args[:2]), entry.shardings)
    return entry.step.lower(state, put(args[2], entry.batch_shardings),
                            *entry.carry.values()).compile().as_text()


def test_the_update_runs_in_a_branch_and_matches_the_selects(monkeypatch):
    """A finite step's new weights are the same whether the update runs in the cond's
    true branch or beside selects, and the branch's program does hold the optimizer's
    update inside its conditional (no select per state leaf outside it)."""
    import hetshard.runtime.executable as hexe
    got, texts = {}, {}
    for branch in (True, False):
        monkeypatch.setattr(hexe, "branches", lambda devices, b=branch: b)
        model, opt, batch = _tiny()
        step = _nnx_step("none")
        plan = _plan(hetshard.Program(step, (model, opt, batch)), 1)
        jitted = hetshard.jit(step, cluster=CLUSTER, plan=plan)
        for _ in range(2):
            jitted(model, opt, batch)
        jitted.wait()
        got[branch] = _params(model)
        texts[branch] = _compiled_text(jitted, (model, opt, batch))
    for a, b in zip(got[True], got[False], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert any(not np.array_equal(a, b) for a, b in zip(got[True], _params(_tiny()[0]),
                                                         strict=True))  # (it trained)
    entry = texts[True][texts[True].index("ENTRY"):]
    assert " conditional(" in entry
    n_state = len(jax.tree.leaves(nnx.state(_tiny()[:2])))
    selects = lambda t: t.count(" select(")  # noqa: E731
    assert selects(texts[False]) - selects(texts[True]) >= n_state // 2


def test_raise_names_the_gradients():
    jitted, args = _jitted("grad", nan_policy="raise")
    jitted(*args)  # dispatched: the error comes once the step has finished
    with pytest.raises(NonFiniteLossError, match="non-finite gradients"):
        jitted.wait()


def test_apply_policy_applies_and_warns():
    jitted, args = _jitted("loss", nan_policy="apply")
    with pytest.warns(UserWarning, match="applied: nan_policy='apply'"):
        jitted(*args)
        jitted.wait()
    assert not all(np.isfinite(x).all() for x in _params(args[0]))


@pytest.mark.parametrize("marked", [True, False])
def test_pytree_step_gets_its_own_state_back(marked, guard_path):
    # A functional step (params dict, optax.lion) returning (params, opt_state, metrics):
    # skipped, it returns the state it was given. Without hetshard.value_and_grad the
    # NaN shows in the new parameters, which are checked.
    params = user_models.init_params(jax.random.key(0))
    tx = optax.lion(1e-3)
    vg = hetshard.value_and_grad if marked else jax.value_and_grad

    def step(params, opt_state, batch):
        loss, grads = vg(lambda p, b: user_models.functional_loss(p, b) * jnp.nan)(params,
                                                                                  batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    batch = user_models._text_batches(np.random.default_rng(0))[0]
    opt_state = tx.init(params)
    plan = _plan(hetshard.Program(step, (params, opt_state, batch)), 1)
    jitted = hetshard.jit(step, cluster=CLUSTER, plan=plan)
    with pytest.warns(UserWarning, match="not applied"):
        new_params, new_state, metrics = jitted(params, opt_state, batch)
        jitted.wait()
    assert np.isnan(float(metrics["loss"]))
    for a, b in zip(jax.tree.leaves((new_params, new_state)),
                    jax.tree.leaves((params, opt_state)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_loss_output_names_the_loss_and_a_wrong_path_is_refused_before_planning():
    out = {"metrics": {"loss": jnp.float32(1.0), "acc": jnp.float32(0.1)}, "aux": (1.0,)}
    assert float(find_loss(out, "metrics/loss")) == 1.0
    assert float(find_loss(out)) == 1.0  # the one leaf named loss
    assert float(find_loss((jnp.float32(2.0), {"w": jnp.ones(3)}), 0)) == 2.0
    assert find_loss({"a": jnp.float32(1.0), "b": jnp.float32(2.0)}) is None
    model, opt, batch = _tiny()
    step = _nnx_step("loss")
    # No plan is pinned: a wrong path must be refused before the planner runs.
    jitted = hetshard.jit(step, cluster=CLUSTER, loss_output="metrics/loss", time_limit_s=1)
    with pytest.raises(SpecError, match=r"loss_output.*among \['acc', 'loss'\]"):
        jitted(model, opt, batch)
    with pytest.raises(SpecError, match="loss_output"):
        hetshard.jit(step, cluster=CLUSTER, loss_output=1.5)
