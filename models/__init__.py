"""hetshard's model zoo: Flax NNX GPT/LLaMA, ViT and LLaVA-style MLLM.

``resolve(name_or_spec)`` turns a preset name or a textual spec into a frozen
config; ``build`` makes a real model; ``abstract`` makes a shape-only model
(``nnx.eval_shape``: no weight memory) for planning huge sizes.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from .gpt import GPT, GPTConfig
from .mllm import MLLM, MLLMConfig
from .presets import PRESETS, PUBLISHED_PARAMS
from .spec import parse_model_spec
from .vit import ViT, ViTConfig

ModelConfig = GPTConfig | ViTConfig | MLLMConfig
_MODULES = {GPTConfig: GPT, ViTConfig: ViT, MLLMConfig: MLLM}


def resolve(model: str | ModelConfig) -> ModelConfig:
    """A config from a preset name, a ``family:key=value`` spec, or a config itself."""
    if isinstance(model, (GPTConfig, ViTConfig, MLLMConfig)):
        return model
    from hetshard import SpecError, UnknownNameError
    if not isinstance(model, str):
        raise SpecError("model", model, "a preset name, a 'family:key=value' spec or a config")
    if ":" in model:
        return parse_model_spec(model)
    if model not in PRESETS:
        raise UnknownNameError("model", model, PRESETS)
    return PRESETS[model]


def build(model: str | ModelConfig, *, rngs: nnx.Rngs | int = 0):
    """A real (materialised) NNX model for ``model``."""
    config = resolve(model)
    if isinstance(rngs, int):
        rngs = nnx.Rngs(rngs)
    return _MODULES[type(config)](config, rngs=rngs)


def abstract(model: str | ModelConfig):
    """A shape-only NNX model: every parameter is a ``jax.ShapeDtypeStruct``.

    Blocks past a stack's first distinct ones (a mixture of experts' leading dense
    blocks) are identical, so those are traced with ``nnx.eval_shape`` and the last
    replicated. Tracing every block instead costs time quadratic in depth (each RNG
    draw inspects the whole growing jaxpr): 57 s for gpt-175b against well under a
    second this way.
    """
    config = resolve(model)

    def distinct(cfg) -> int:
        return 1 + (getattr(cfg, "dense_layers", 0) if getattr(cfg, "experts", 0) else 0)
    if isinstance(config, MLLMConfig):
        one = dataclasses.replace(
            config, vision=dataclasses.replace(config.vision, layers=distinct(config.vision)),
            text=dataclasses.replace(config.text, layers=distinct(config.text)))
    else:
        one = dataclasses.replace(config, layers=distinct(config))
    m = nnx.eval_shape(lambda: _MODULES[type(config)](one, rngs=nnx.Rngs(0)))
    stacks = ([(m.vision, config.vision), (m.text, config.text)]
              if isinstance(config, MLLMConfig) else [(m, config)])
    for module, cfg in stacks:
        first = list(module.layers)
        module.layers = nnx.List(first + [nnx.clone(first[-1])
                                          for _ in range(cfg.layers - len(first))])
        module.config = cfg
    m.config = config
    return m


def param_count(model) -> int:
    """Parameters of a model instance (real or abstract), counted from its state."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


from . import steps  # noqa: E402 (the zoo's train steps use the model classes above)
from .steps import example_batch, loss_of, profile, program, train_step  # noqa: E402

__all__ = ["GPT", "GPTConfig", "MLLM", "MLLMConfig", "ViT", "ViTConfig", "PRESETS",
           "PUBLISHED_PARAMS", "ModelConfig", "abstract", "build", "param_count", "resolve",
           "parse_model_spec", "example_batch", "loss_of", "profile", "program", "steps",
           "train_step"]
