"""hetshard.ir.samples: which losses can be cut per micro-batch and batch share."""

import jax
import jax.numpy as jnp
import pytest

from hetshard.ir.samples import sample_coupling

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


def _loop_over_samples(w, x):
    def body(i, acc):
        return 0.5 * acc + jnp.sum(x[i] @ w)  # sequential across samples
    return jax.lax.fori_loop(0, B, body, jnp.float32(0))


@pytest.mark.parametrize("loss, batch", [(_per_token_mean, (X,)), (_merged_rows, (X,)),
                                         (_masked_mean, (X, M)),
                                         (_per_token_normalised, (X, M))])
def test_losses_that_treat_samples_one_by_one_pass(loss, batch):
    assert _coupling(loss, *batch) is None


@pytest.mark.parametrize("loss", [_batch_statistics, _in_batch_negatives, _running_sum,
                                  _first_sample, _softmax_over_batch,
                                  _scaled_by_activations])
def test_losses_that_mix_samples_are_named(loss):
    why = _coupling(loss, X)
    assert why is not None and "mixes samples" in why
    assert "test_samples.py" in why  # where, in the user's code


def test_an_output_that_is_a_maximum_over_the_batch_is_named():
    assert "output 1 of the loss is a maximum over the batch" in _coupling(_max_metric, X)


def test_what_the_analysis_cannot_follow_gets_no_answer_never_a_false_alarm():
    # A loop over the samples mixes them, but the analysis does not look inside loops.
    assert _coupling(_loop_over_samples, X) is None
