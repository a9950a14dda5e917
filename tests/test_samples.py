"""hetshard.ir.samples: which losses can be cut per micro-batch and batch share."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hetshard.ir.samples import (
    batch_shaped_draw,
    denominator,
    mixed_power_outputs,
    normalized_outputs,
    per_sample_outputs,
    sample_coupling,
    summed_outputs,
    unfollowed,
)

B, S, D = 4, 6, 8
W = jax.ShapeDtypeStruct((D, D), jnp.float32)
X = jax.ShapeDtypeStruct((B, S, D), jnp.float32)
M = jax.ShapeDtypeStruct((B, S), jnp.float32)


def _coupling(loss, *batch):
    closed = jax.make_jaxpr(loss)(W, *batch)
    return sample_coupling(closed, range(1, 1 + len(batch)))


def _per_token_mean(w, x):
    h = jax.nn.softmax(x @ w, axis=-1)  # over features: per sample
    h = jnp.sort(h, axis=1)  # along the sequence: per sample
    return jnp.mean((h - x) ** 2)


def _merged_rows(w, x):
    rows = x.reshape(B * S, D) @ w  # sample-major rows
    return jnp.mean(jnp.tanh(rows.reshape(B, S, D)).sum(axis=(1, 2)))


def _masked_mean(w, x, m):
    per_token = jnp.sum((x @ w) ** 2, axis=-1)
    return jnp.sum(per_token * m) / jnp.sum(m)  # a ratio of batch sums


def _per_token_normalised(w, x, m):
    per_token = jnp.sum((x @ w) ** 2, axis=-1)
    return jnp.sum(per_token * m / jnp.maximum(m.sum(), 1.0))  # the batch's token count


def _softmax_over_batch(w, x):
    score = (x @ w).sum(axis=(1, 2))
    return -jnp.mean(jax.nn.log_softmax(score, axis=0))


def _scaled_by_activations(w, x):
    h = x @ w
    return jnp.mean(h / h.sum())  # a sum that reads the parameters: not a count


def _batch_statistics(w, x):
    h = x @ w
    mu = h.mean(axis=(0, 1))
    return jnp.mean((h - mu) ** 2 / (h.var(axis=(0, 1)) + 1e-5))


def _in_batch_negatives(w, x):
    q = x.mean(axis=1) @ w
    k = x.max(axis=1)
    logits = q @ k.T  # every sample against every other
    return -jnp.mean(jax.nn.log_softmax(logits, axis=-1).diagonal())


def _running_sum(w, x):
    return jnp.mean(jnp.cumsum(x @ w, axis=0))


def _first_sample(w, x):
    return jnp.mean(x[:1] @ w)


def _max_metric(w, x):
    y = x @ w
    return jnp.mean(y ** 2), jnp.max(y)


def _pooled(w, x):
    h = (x @ w)[..., None]  # [B, S, D, 1]: pooled over the sequence and features
    return jnp.mean(nnx.max_pool(nnx.avg_pool(h, (2, 2), (2, 2)), (3, 2), (3, 2)))


def _routed(w, x):
    top, _ = jax.lax.top_k(jax.nn.softmax(x @ w, axis=-1), 2)  # a router's top 2 experts
    padded = jnp.zeros((B, S + 1, 2)).at[:, 1:].set(top)  # x.at[].set into a new array
    return jnp.mean(padded.at[:, 0].add(1.0))


def _top_samples(w, x):
    return jnp.mean(jax.lax.top_k(jnp.swapaxes(x @ w, 0, 2), 2)[0])  # the 2 top samples


def _pooled_over_samples(w, x):
    return jnp.mean(jax.lax.reduce_window(x @ w, 0.0, jax.lax.add, (2, 1, 1), (1, 1, 1),
                                          "VALID"))


def _rematted(w, x):  # nnx.remat / jax.checkpoint around per-sample work
    return jnp.mean(jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x))


def _loop_over_samples(w, x):
    def body(i, acc):
        return 0.5 * acc + jnp.sum(x[i] @ w)  # sequential across samples
    return jax.lax.fori_loop(0, B, body, jnp.float32(0))


@pytest.mark.parametrize("loss, batch", [(_per_token_mean, (X,)), (_merged_rows, (X,)),
                                         (_pooled, (X,)), (_routed, (X,)),
                                         (_masked_mean, (X, M)),
                                         (_per_token_normalised, (X, M)),
                                         (_rematted, (X,))])
def test_losses_that_treat_samples_one_by_one_pass(loss, batch):
    assert _coupling(loss, *batch) is None
    # the analysis followed every equation (it gives no answer where it cannot)
    closed = jax.make_jaxpr(loss)(W, *batch)
    assert per_sample_outputs(closed, range(1, 1 + len(batch))) == {}


@pytest.mark.parametrize("loss", [_batch_statistics, _in_batch_negatives, _running_sum,
                                  _first_sample, _softmax_over_batch, _pooled_over_samples,
                                  _top_samples,
                                  _scaled_by_activations])
def test_losses_that_mix_samples_are_named(loss):
    why = _coupling(loss, X)
    assert why is not None and "mixes samples" in why
    assert "test_samples.py" in why  # where, in the user's code


def test_an_output_that_is_a_maximum_over_the_batch_is_named():
    assert "output 1 of the loss is a maximum over the batch" in _coupling(_max_metric, X)


def test_what_the_analysis_cannot_follow_gets_no_answer_never_a_false_alarm():
    # A loop over the samples mixes them, but the analysis does not look inside loops:
    # no alarm, but where it stopped is told (a plan cutting the batch warns with it).
    assert _coupling(_loop_over_samples, X) is None
    closed = jax.make_jaxpr(_loop_over_samples)(W, X)
    assert per_sample_outputs(closed, [1]) is None
    where = unfollowed(closed, [1])
    assert where.startswith("scan") and "test_samples.py" in where  # fori_loop
    assert unfollowed(jax.make_jaxpr(_per_token_mean)(W, X), [1]) is None


def _normalized(loss, n=B):
    """(the loss's masked-mean divisors' paths, its jaxpr at ``n`` samples)."""
    def at(k):
        return jax.make_jaxpr(loss)(W, jax.ShapeDtypeStruct((k, S, D), jnp.float32),
                                    jax.ShapeDtypeStruct((k, S), jnp.float32))
    return normalized_outputs(at(2), at(4), 2.0, (1, 2)), at(n)


@jax.jit
def _jitted_masked_mean(per_token, m):
    return (per_token * m).sum() / m.sum()


def _masked_forms(w, x, m):
    t = jnp.sum((x @ w) ** 2, axis=-1)
    decay = 1e-3 * jnp.sum(w ** 2)  # reads no sample: adds to every piece alike
    return (_masked_mean(w, x, m) + decay, _per_token_normalised(w, x, m),
            jnp.mean(t, where=m > 0), _jitted_masked_mean(t, m),
            -(-jnp.sum(t * m) * 0.5) / jnp.maximum(jnp.sum(m), 1.0))


def _not_masked_means(w, x, m):
    t = jnp.sum((x @ w) ** 2, axis=-1)
    per_sample = (t * m).sum(axis=1) / m.sum(axis=1)  # normalised per sample: a mean
    return (jnp.mean(per_sample),
            _masked_mean(w, x, m) + jnp.mean(t),  # two weightings in one output
            jnp.exp(_masked_mean(w, x, m)),  # not linear in the pieces
            jnp.sum(t * m),  # a sum
            jnp.sum(t * m) / jnp.sum(t))  # divided by a sum that reads the parameters


def test_a_masked_mean_is_found_with_the_count_that_divides_it():
    paths, closed = _normalized(_masked_forms)
    assert all(p is not None for p in paths)
    m = np.zeros((5, S), np.float32)
    m[0, :2] = 1
    m[3, :] = 1  # 8 tokens counted, samples 1, 2 and 4 none
    paths5, closed5 = _normalized(_masked_forms, 5)
    assert paths5 == paths  # the same path at any batch size
    for p in paths:
        count = denominator(closed5, p, [None, np.zeros((5, S, D), np.float32), m])
        assert float(count) == 8.0  # the mask's sum (before its floor at 1)


def test_outputs_that_are_not_masked_means_have_no_count():
    assert _normalized(_not_masked_means)[0] == [None] * 5


def _mixed_powers(w, x, m):
    t = jnp.sum((x @ w) ** 2, axis=-1)
    decay = 1e-3 * jnp.sum(w ** 2)  # reads no sample
    return (jnp.sum(t) + decay,  # a sum plus a penalty: mixed
            0.01 * jnp.sum(t) + jnp.mean(t),  # a sum plus a mean: mixed
            jnp.stack([jnp.sum(t), jnp.mean(t)]),  # one output, two weightings: mixed
            jnp.mean(t) + decay,  # a mean plus a penalty: averaged exactly
            jnp.sum(t) + 1e-8,  # a sum plus a literal (an epsilon): a sum
            jnp.sum(t * m) / jnp.sum(m) + decay,  # a masked mean plus a penalty
            jnp.sum(t) / 1000.0)  # a sum over a constant: a sum


def test_an_output_adding_a_sum_to_a_mean_or_a_penalty_is_found():
    """Such an output's pieces can be neither added nor averaged: sample_coupling-like
    refusal material. Means plus penalties, sums plus epsilons, masked means plus
    penalties are not such outputs."""
    def at(k):
        return jax.make_jaxpr(_mixed_powers)(W, jax.ShapeDtypeStruct((k, S, D), jnp.float32),
                                             jax.ShapeDtypeStruct((k, S), jnp.float32))
    assert mixed_power_outputs(at(2), at(4), 2.0, (1, 2)) == [0, 1, 2]
    # Sums stacked into one vector (metrics returned as one array) stay a sum.
    def stacked(w, x, m):
        t = jnp.sum((x @ w) ** 2, axis=-1)
        return jnp.stack([jnp.sum(t), jnp.sum(t * m)]), jnp.stack([t.mean(), m.mean()])
    two = [jax.make_jaxpr(stacked)(W, jax.ShapeDtypeStruct((k, S, D), jnp.float32),
                                   jax.ShapeDtypeStruct((k, S), jnp.float32)) for k in (2, 4)]
    assert summed_outputs(*two, 2.0, (1, 2)) == [True, False]
    assert mixed_power_outputs(*two, 2.0, (1, 2)) == []


def _load_balance(w, x):
    """A mixture-of-experts load-balancing loss: the fraction of tokens routed to each
    expert times its mean router probability, both over the batch."""
    probs = jax.nn.softmax(x @ w, axis=-1)
    routed = jnp.mean(jax.nn.one_hot(jnp.argmax(probs, -1), D), axis=(0, 1))
    return jnp.mean(probs ** 2) + D * jnp.sum(routed * jnp.mean(probs, axis=(0, 1)))


def _load_balance_dot(w, x):
    probs = jax.nn.softmax(x @ w, axis=-1)
    return D * jnp.dot(jnp.mean(probs, axis=(0, 1)), jnp.mean(probs ** 2, axis=(0, 1)))


def _perplexity(w, x):
    loss = jnp.mean((x @ w) ** 2)
    return loss, jnp.exp(loss)


def _root_mean_square(w, x):
    return jnp.sqrt(jnp.mean((x @ w) ** 2))


def _inverse(w, x):
    return 1.0 / jnp.mean((x @ w) ** 2)


def _hinged(w, x):
    return jnp.maximum(jnp.mean(x @ w), 0.0)


@pytest.mark.parametrize("loss, output", [(_load_balance, 0), (_load_balance_dot, 0),
                                          (_perplexity, 1), (_root_mean_square, 0),
                                          (_inverse, 0), (_hinged, 0)])
def test_non_linear_functions_of_batch_reductions_are_named(loss, output):
    """Each piece of a cut batch would take the function of its own samples' means:
    averaged, the pieces' values (and gradients) are not the whole batch's. Before, such
    outputs were averaged with no word (a load-balancing loss under a 2-stage pipeline
    trained to other losses than nnx.jit)."""
    why = _coupling(loss, X)
    assert why is not None and f"output {output} of the loss puts values reduced" in why
    assert "test_samples.py" in why  # the line where the function is applied


def _guarded(w, x, m):
    t = jnp.sum((x @ w) ** 2, axis=-1)
    loss = jnp.sum(t * m) / jnp.maximum(jnp.sum(m), 1.0)
    return (jnp.where(jnp.isfinite(loss), loss, 0.0),  # a NaN guard
            jnp.sum(t, axis=0).mean())  # positions' sums over the samples, averaged


def test_guards_counts_and_sums_of_sums_are_not_non_linear():
    """A NaN guard on a masked mean and a sum over the samples reduced again (a sum: the
    pieces are added; it was averaged before) are cut exactly."""
    assert _coupling(_guarded, X, M) is None
    two = [jax.make_jaxpr(_guarded)(W, jax.ShapeDtypeStruct((k, S, D), jnp.float32),
                                    jax.ShapeDtypeStruct((k, S), jnp.float32)) for k in (2, 4)]
    assert summed_outputs(*two, 2.0, (1, 2)) == [False, True]


def test_random_values_drawn_in_the_batchs_shape_from_a_key_are_found():
    """Noise drawn from a key argument in the batch's shape (a diffusion step's) differs
    between a cut batch's pieces and the whole batch's rows; per-sample keys in the
    batch, draws that are not batch-shaped, and positions (``jnp.arange`` over the
    samples) do not."""
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)

    def found(loss, *batch):
        def at(k):
            shaped = [jax.ShapeDtypeStruct((k, *b.shape[1:]), b.dtype) for b in batch]
            return jax.make_jaxpr(loss)(W, key, *shaped)
        return batch_shaped_draw(at(2), at(4), range(2, 2 + len(batch)))

    def noised(w, k, x):
        noise = jax.random.normal(k, x.shape)
        return jnp.mean(((x + noise) @ w - noise) ** 2)

    def per_sample_keys(w, k, x, keys):
        noise = jax.vmap(lambda kk: jax.random.normal(kk, x.shape[1:]))(keys)
        return jnp.mean(((x + noise) @ w) ** 2)

    def fixed_shape(w, k, x):  # one draw for every sample: the same in every piece
        return jnp.mean((x @ (w + jax.random.normal(k, w.shape))) ** 2)

    def positions(w, k, x):
        rows = (x @ w).sum(axis=(1, 2))
        return jnp.mean(rows[jnp.arange(x.shape[0])])

    assert "draws random values shaped by the batch" in found(noised, X)
    keys = jax.ShapeDtypeStruct((B,), jax.random.key(0).dtype)
    assert found(per_sample_keys, X, keys) is None
    assert found(fixed_shape, X) is None
    assert found(positions, X) is None
