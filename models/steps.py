"""The zoo's train steps: an ordinary NNX + optax step per family, as a user writes one.

hetshard plans the program it is given, so the zoo is planned the way any model is: a
step decorated (or passed to ``hetshard.plan``) with its model, an ``nnx.Optimizer`` and
a batch. :func:`program` builds that program shape-only (``models.abstract``: no weight
memory, so gpt-175b plans in seconds); :func:`profile` is its cost profile, which the
command line, the experiments and the tests price plans with.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import hetshard
from hetshard import SpecError

from . import losses
from .gpt import GPTConfig
from .mllm import MLLMConfig
from .vit import ViTConfig


def with_dtype(config, dtype: str | None):
    """The config with compute dtype ``dtype`` (parameters keep their param_dtype)."""
    if dtype is None:
        return config
    if isinstance(config, MLLMConfig):
        return dataclasses.replace(config, vision=dataclasses.replace(config.vision, dtype=dtype),
                                   text=dataclasses.replace(config.text, dtype=dtype))
    return dataclasses.replace(config, dtype=dtype)


def vit_loss(model, batch):
    """A stand-in objective for the bare encoder: the mean square of its outputs."""
    return jnp.mean(jnp.square(model(batch["images"]).astype(jnp.float32)))


def loss_of(config):
    """The training loss of ``config``'s family (``models.losses``)."""
    if isinstance(config, ViTConfig):
        return vit_loss
    if isinstance(config, MLLMConfig):
        return losses.mllm_loss
    return losses.text_loss


def train_step(loss):
    """``step(model, optimizer, batch) -> loss``: ``hetshard.value_and_grad`` of ``loss``
    and the optimizer's update, as in Flax's NNX examples."""
    def step(model, optimizer, batch):
        value, grads = hetshard.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return value
    step.__qualname__ = f"train_step({loss.__name__})"
    return step


def check_seq_len(config, seq_len: int) -> None:
    """A sequence the model can take: any length with rotary positions, at most the
    preset's ``seq`` with learned ones.

    Raises:
      SpecError: naming ``seq_len``.
    """
    text = config.text if isinstance(config, MLLMConfig) else config
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise SpecError("seq_len", seq_len, "a positive integer")
    if isinstance(text, GPTConfig) and text.pos == "learned" and seq_len > text.seq:
        raise SpecError("seq_len", seq_len,
                        f"at most {text.seq} for {text.name!r}: its positions are learned "
                        f"embeddings of {text.seq} rows (rotary models take any length)")


def example_batch(config, batch: int, seq_len: int | None = None) -> dict:
    """ShapeDtypeStructs of a batch of ``batch`` samples for ``config``'s family."""
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    if isinstance(config, ViTConfig):
        return {"images": jax.ShapeDtypeStruct((batch, config.image, config.image,
                                                config.channels), jnp.float32)}
    text = config.text if isinstance(config, MLLMConfig) else config
    seq_len = text.seq if seq_len is None else seq_len
    check_seq_len(config, seq_len)
    b = {"tokens": i32(batch, seq_len), "targets": i32(batch, seq_len)}
    if isinstance(config, MLLMConfig):
        v = config.vision
        b.update(images=jax.ShapeDtypeStruct((batch, 1, v.image, v.image, v.channels),
                                             jnp.float32),
                 image_index=i32(batch, seq_len), positions=i32(batch, seq_len),
                 segment_ids=i32(batch, seq_len),
                 loss_mask=jax.ShapeDtypeStruct((batch, seq_len), jnp.float32))
    return b


def program_args(model, *, batch: int = 8, seq_len: int | None = None,
                 dtype: str | None = None, optimizer: optax.GradientTransformation | None
                 = None):
    """``(step, (model, optimizer, batch))`` for a zoo model, shape-only."""
    from . import abstract, resolve  # (the package's own, defined after this module)
    config = with_dtype(resolve(model), dtype)
    m = abstract(config)
    tx = optimizer if optimizer is not None else optax.adamw(1e-4)
    opt = nnx.eval_shape(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param), m)
    return train_step(loss_of(config)), (m, opt, example_batch(config, batch, seq_len))


@functools.lru_cache(maxsize=32)
def program(model, *, batch: int = 8, seq_len: int | None = None,
            dtype: str | None = None) -> hetshard.Program:
    """The zoo model's train step (AdamW) as a :class:`hetshard.Program`, shape-only."""
    from . import resolve
    config = with_dtype(resolve(model), dtype)
    step, args = program_args(config, batch=batch, seq_len=seq_len)
    return hetshard.Program(step, args, name=model if isinstance(model, str) else config.name)


@functools.lru_cache(maxsize=32)
def profile(model, seq_len: int | None = None, dtype: str | None = "bfloat16",
            split_blocks: bool = False):
    """The cost profile of the zoo model's train step (``hetshard`` prices plans with
    it)."""
    return hetshard.profile_program(program(model, seq_len=seq_len, dtype=dtype),
                                    split_blocks)


def make_plan(model, cluster, *, global_batch: int, seq_len: int | None = None,
              dtype: str | None = "bfloat16", options=None, calibration=None,
              shardings: bool = True):
    """``hetshard.plan`` of the zoo model's train step (``program``); ``options``: a
    ``PlannerOptions``."""
    extra = {} if options is None else {"options": options}
    return hetshard.plan(program(model, seq_len=seq_len, dtype=dtype), cluster=cluster,
                         global_batch=global_batch, calibration=calibration,
                         shardings=shardings, **extra)
