"""Training losses for the zoo's models, written as per-sample means.

A loss that is a mean over samples of per-sample values gives, for any split of the batch
into micro-batches or pipeline shares weighted by their sample counts, exactly the
global-batch loss and gradient: what hetshard's pipelines need (see the README). Plain
token means over a whole batch are not of that form when rows carry different numbers of
target tokens.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax


def text_loss(model, batch):
    """Next-token cross-entropy of a GPT/LLaMA model, every position a target."""
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def mllm_loss(model, batch):
    """Cross-entropy of the MLLM over its text targets: each row's masked mean (rows
    without targets count zero), averaged over rows."""
    logits = model(batch["tokens"], batch["images"], batch["image_index"],
                   positions_bs=batch["positions"], segment_ids_bs=batch["segment_ids"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"]
    return ((ce * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1)).mean()


def packed_text_loss(model, batch):
    """Next-token cross-entropy of a GPT/LLaMA model over packed rows
    (``hetshard.data.packed_arrays``): each row's ``loss_weight``-weighted sum, averaged
    over rows; with weights for the batch's target count, the token mean of the samples
    trained one by one."""
    logits = model(batch["tokens"], positions_bs=batch["positions"],
                   segment_ids_bs=batch["segment_ids"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return (ce * batch["loss_weight"]).sum(-1).mean()


def packed_mllm_loss(model, batch):
    """Cross-entropy of the MLLM over packed multimodal rows
    (``hetshard.data.packed_arrays`` of multimodal samples): each row's
    ``loss_weight``-weighted sum over its text targets, averaged over rows; with weights
    for the batch's target count, the token mean of the samples trained one by one."""
    logits = model(batch["tokens"], batch["images"], batch["image_index"],
                   positions_bs=batch["positions"], segment_ids_bs=batch["segment_ids"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return (ce * batch["loss_weight"]).sum(-1).mean()
