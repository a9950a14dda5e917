"""Abstract train steps of the zoo's models, traced without weight memory.

``trace_train_step(config, micro_batch=b, seq_len=s)`` builds the model with
``models.abstract``, an AdamW state with ``jax.eval_shape``, an abstract batch,
and traces one step (loss, ``jax.value_and_grad``, optimizer update) to an
:class:`OpGraph`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import models
from hetshard.errors import SpecError
from hetshard.ir.graph import OpGraph
from hetshard.ir.trace import trace
from models import MLLMConfig, ViTConfig


def with_dtype(config, dtype: str):
    """The config with compute dtype ``dtype`` (parameters stay in their param_dtype)."""
    if isinstance(config, MLLMConfig):
        return dataclasses.replace(config, vision=dataclasses.replace(config.vision, dtype=dtype),
                                   text=dataclasses.replace(config.text, dtype=dtype))
    return dataclasses.replace(config, dtype=dtype)


def with_layers(config, layers: int):
    """The config with at most ``layers`` blocks in each stack."""
    if isinstance(config, MLLMConfig):
        return dataclasses.replace(
            config,
            vision=dataclasses.replace(config.vision, layers=min(layers, config.vision.layers)),
            text=dataclasses.replace(config.text, layers=min(layers, config.text.layers)))
    return dataclasses.replace(config, layers=min(layers, config.layers))


def abstract_batch(config, micro_batch: int, seq_len: int) -> dict:
    """ShapeDtypeStructs of one micro-batch for ``config``'s family."""
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    if isinstance(config, ViTConfig):
        return {"images": jax.ShapeDtypeStruct((micro_batch, config.image, config.image,
                                                config.channels), jnp.float32)}
    text = config.text if isinstance(config, MLLMConfig) else config
    if seq_len > text.seq:
        raise SpecError("seq_len", seq_len, f"at most the model's seq={text.seq}")
    b = {"tokens": i32(micro_batch, seq_len), "targets": i32(micro_batch, seq_len)}
    if isinstance(config, MLLMConfig):
        v = config.vision
        b.update(images=jax.ShapeDtypeStruct((micro_batch, 1, v.image, v.image, v.channels),
                                             jnp.float32),
                 image_index=i32(micro_batch, seq_len), positions=i32(micro_batch, seq_len),
                 segment_ids=i32(micro_batch, seq_len),
                 loss_mask=jax.ShapeDtypeStruct((micro_batch, seq_len), jnp.float32))
    return b


def model_loss(model, batch):
    """The training loss each family is traced (and trained) with."""
    config = model.config
    if isinstance(config, ViTConfig):
        out = model(batch["images"])
        return jnp.mean(jnp.square(out.astype(jnp.float32)))
    if isinstance(config, MLLMConfig):
        logits = model(batch["tokens"], batch["images"], batch["image_index"],
                       positions_bs=batch["positions"], segment_ids_bs=batch["segment_ids"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return (ce * batch["loss_mask"]).sum() / jnp.maximum(batch["loss_mask"].sum(), 1.0)
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def param_paths(config) -> list[str]:
    """Names of the model's parameters, in the order ``trace_train_step`` passes them
    (``layers/3/attn/q_proj/kernel``; MLLMs prefix ``vision/`` or ``text/``)."""
    model = models.abstract(models.resolve(config))
    params = nnx.state(model, nnx.Param)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    names = []
    for path, _ in flat:
        parts = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        names.append("/".join(p for p in parts if p not in (".value", "value")))
    return names


def trace_train_step(config, *, micro_batch: int, seq_len: int, dtype: str | None = None,
                     optimizer: optax.GradientTransformation | None = None,
                     split_blocks: bool = False) -> OpGraph:
    """Traces one AdamW train step of ``config`` on one micro-batch (``split_blocks``:
    layers are block halves)."""
    config = models.resolve(config)
    if dtype is not None:
        config = with_dtype(config, dtype)
    tx = optimizer or optax.adamw(1e-4)
    model = models.abstract(config)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = jax.eval_shape(tx.init, params)
    batch = abstract_batch(config, micro_batch, seq_len)

    def step(params, opt_state, batch):
        def loss_of(p):
            return model_loss(nnx.merge(graphdef, p, rest), batch)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state

    return trace(step, params, opt_state, batch, param_argnum=0, opt_state_argnum=1,
                 split_blocks=split_blocks)
