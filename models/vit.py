"""Vision Transformer encoder (Dosovitskiy et al. 2021) in Flax NNX.

Images [batch, height, width, channels] are cut into non-overlapping
``patch x patch`` squares, projected linearly (the same as a stride-``patch``
convolution), optionally prefixed by a class token, given learned positions
and run through pre-norm blocks under ``jax.named_scope("vision/layer_{i}")``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from hetshard import SpecError

from .layers import Block, block_params, make_norm, norm_params, positive_int, run_layers


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Shape of a ViT encoder. ``num_classes=0`` means no classification head."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    patch: int
    image: int
    channels: int = 3
    cls_token: bool = True
    num_classes: int = 0
    eps: float = 1e-6
    dtype: str = "float32"
    param_dtype: str = "float32"
    name: str = "vit"

    family = "vit"

    def __post_init__(self):
        where = f"model {self.name!r}"
        for f in ("layers", "hidden", "heads", "ffn", "patch", "image", "channels"):
            positive_int(f, getattr(self, f), where)
        if self.hidden % self.heads:
            raise SpecError("hidden", self.hidden, f"a multiple of heads={self.heads}", where=where)
        if self.image % self.patch:
            raise SpecError("patch", self.patch, f"a divisor of image={self.image}", where=where)
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) \
                or self.num_classes < 0:
            raise SpecError("num_classes", self.num_classes, "an integer >= 0", where=where)

    @property
    def num_patches(self) -> int:
        return (self.image // self.patch) ** 2

    @property
    def seq(self) -> int:
        """Tokens per image seen by the blocks (patches plus the class token)."""
        return self.num_patches + int(self.cls_token)

    @property
    def patch_dim(self) -> int:
        return self.patch * self.patch * self.channels

    def num_params(self) -> int:
        n = self.patch_dim * self.hidden + self.hidden  # patch projection + bias
        n += self.seq * self.hidden + (self.hidden if self.cls_token else 0)
        n += self.layers * block_params(self.hidden, self.heads, self.heads, self.ffn,
                                        norm="layernorm", mlp="gelu", bias=True)
        n += norm_params("layernorm", self.hidden, True)
        if self.num_classes:
            n += self.hidden * self.num_classes + self.num_classes
        return n


def patchify(images_bhwc, patch: int):
    """[b, H, W, C] -> [b, (H/p)*(W/p), p*p*C], patches in row-major order."""
    b, h, w, c = images_bhwc.shape
    x = images_bhwc.reshape(b, h // patch, patch, w // patch, patch, c)
    x = x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // patch) * (w // patch), patch * patch * c)


class ViT(nnx.Module):
    """ViT encoder. Returns [batch, seq, hidden] features (after the final norm),
    or [batch, num_classes] logits from the class token when ``num_classes > 0``."""

    def __init__(self, config: ViTConfig, *, rngs: nnx.Rngs):
        self.config = c = config
        dtype, pdtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        self.patch_embed = nnx.Linear(c.patch_dim, c.hidden, dtype=dtype, param_dtype=pdtype,
                                      rngs=rngs)
        init = nnx.initializers.normal(0.02)
        self.cls = (nnx.Param(init(rngs.params(), (1, 1, c.hidden), pdtype))
                    if c.cls_token else None)
        self.pos_embed = nnx.Param(init(rngs.params(), (1, c.seq, c.hidden), pdtype))
        self.layers = nnx.List([
            Block(c.hidden, c.heads, c.heads, c.ffn, norm="layernorm", mlp="gelu", bias=True,
                  eps=c.eps, rope_theta=None, dtype=dtype, param_dtype=pdtype, rngs=rngs)
            for _ in range(c.layers)])
        self.final_norm = make_norm("layernorm", c.hidden, eps=c.eps, bias=True, dtype=dtype,
                                    param_dtype=pdtype, rngs=rngs)
        self.head = (nnx.Linear(c.hidden, c.num_classes, dtype=dtype, param_dtype=pdtype,
                                rngs=rngs) if c.num_classes else None)

    def __call__(self, images_bhwc):
        c = self.config
        expected = (c.image, c.image, c.channels)
        if images_bhwc.ndim != 4 or tuple(images_bhwc.shape[1:]) != expected:
            raise SpecError("images.shape", tuple(images_bhwc.shape),
                            f"[batch, {c.image}, {c.image}, {c.channels}]", where="ViT")
        with jax.named_scope("vision/embed"):
            x = self.patch_embed(patchify(images_bhwc, c.patch))
            if self.cls is not None:
                cls = jnp.broadcast_to(self.cls[...].astype(x.dtype), (x.shape[0], 1, c.hidden))
                x = jnp.concatenate([cls, x], axis=1)
            x = x + self.pos_embed[...].astype(x.dtype)
        x = run_layers(self.layers, x, "vision", causal=False)
        with jax.named_scope("vision/head"):
            x = self.final_norm(x)
            if self.head is not None:
                return self.head(x[:, 0]).astype(jnp.float32)
        return x
