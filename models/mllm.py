"""LLaVA-style multimodal model: ViT -> projector -> decoder (Liu et al. 2023).

Image features (patch tokens, class token dropped) are projected to the
decoder's width and placed among the text tokens wherever ``image_index`` says.
Several samples may be packed into one row: ``segment_ids`` keeps their
attention apart and ``positions`` restart at each sample, so a packed sample's
logits are exactly those it would get alone (tests check this).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hetshard import SpecError
from hetshard.data import IMAGE_TOKEN  # one image-feature slot in a sample's tokens

from .gpt import GPT, GPTConfig
from .vit import ViT, ViTConfig

PROJECTORS = ("mlp", "linear")


@dataclasses.dataclass(frozen=True)
class MLLMConfig:
    """A vision encoder, a projector (``mlp``: LLaVA-1.5's 2-layer GELU MLP) and a decoder."""

    vision: ViTConfig
    text: GPTConfig
    projector: str = "mlp"
    name: str = "mllm"

    family = "mllm"

    def __post_init__(self):
        where = f"model {self.name!r}"
        if not isinstance(self.vision, ViTConfig):
            raise SpecError("vision", self.vision, "a ViTConfig", where=where)
        if not isinstance(self.text, GPTConfig):
            raise SpecError("text", self.text, "a GPTConfig", where=where)
        if self.projector not in PROJECTORS:
            raise SpecError("projector", self.projector, f"one of {PROJECTORS}", where=where)
        if self.vision.num_classes:
            raise SpecError("vision.num_classes", self.vision.num_classes,
                            "0 (the encoder feeds features, not class logits)", where=where)

    @property
    def image_tokens(self) -> int:
        """Decoder positions one image occupies (its patch count)."""
        return self.vision.num_patches

    @property
    def seq(self) -> int:
        return self.text.seq

    def num_params(self) -> int:
        dv, d = self.vision.hidden, self.text.hidden
        proj = dv * d + d + (d * d + d if self.projector == "mlp" else 0)
        return self.vision.num_params() + proj + self.text.num_params()


class Projector(nnx.Module):
    def __init__(self, in_dim: int, out_dim: int, *, kind: str, dtype, param_dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc1 = nnx.Linear(in_dim, out_dim, **kw)
        self.fc2 = nnx.Linear(out_dim, out_dim, **kw) if kind == "mlp" else None

    def __call__(self, x):
        x = self.fc1(x)
        if self.fc2 is not None:
            x = self.fc2(nnx.gelu(x, approximate=False))
        return x


class MLLM(nnx.Module):
    """Multimodal decoder.

    Call with:
      tokens_bs: int [batch, seq]; entries at image slots are ignored.
      images: [batch, images_per_row, H, W, C].
      image_index_bs: int32 [batch, seq]; -1 for a text token, else the index of
        the image-feature token placed there among the row's
        ``images_per_row * image_tokens`` projected features.
      positions_bs, segment_ids_bs: optional int32 [batch, seq] for packing.
    Returns float32 logits [batch, seq, vocab].
    """

    def __init__(self, config: MLLMConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.vision = ViT(config.vision, rngs=rngs)
        self.projector = Projector(config.vision.hidden, config.text.hidden,
                                   kind=config.projector, dtype=jnp.dtype(config.text.dtype),
                                   param_dtype=jnp.dtype(config.text.param_dtype), rngs=rngs)
        self.text = GPT(config.text, rngs=rngs)

    def encode_images(self, images):
        """[b, n, H, W, C] -> projected features [b, n * image_tokens, hidden]."""
        b, n = images.shape[:2]
        feats = self.vision(images.reshape(b * n, *images.shape[2:]))
        if self.config.vision.cls_token:
            feats = feats[:, 1:]
        with jax.named_scope("projector"):
            feats = self.projector(feats)
        return feats.reshape(b, n * feats.shape[1], feats.shape[2])

    def __call__(self, tokens_bs, images, image_index_bs, *, positions_bs=None,
                 segment_ids_bs=None):
        if images.ndim != 5:
            raise SpecError("images.shape", tuple(images.shape),
                            "[batch, images_per_row, H, W, C]", where="MLLM")
        if image_index_bs.shape != tokens_bs.shape:
            raise SpecError("image_index.shape", tuple(image_index_bs.shape),
                            f"the tokens' shape {tuple(tokens_bs.shape)}", where="MLLM")
        img_bnd = self.encode_images(images)
        with jax.named_scope("decoder/embed"):
            is_image = image_index_bs >= 0
            x = self.text.embed_tokens(jnp.where(is_image, 0, tokens_bs))
            idx = jnp.clip(image_index_bs, 0, img_bnd.shape[1] - 1)
            placed = jnp.take_along_axis(img_bnd, idx[..., None], axis=1).astype(x.dtype)
            x = jnp.where(is_image[..., None], placed, x)
        return self.text.decode(x, positions_bs=positions_bs, segment_ids_bs=segment_ids_bs)


def pack(samples: Sequence[dict], *, config: MLLMConfig, seq_len: int, images_per_row: int,
         rows: int | None = None) -> dict[str, np.ndarray]:
    """Packs variable-length multimodal samples into fixed rows (first fit, in order).

    Each sample is ``{"tokens": int array [n], "images": [k, H, W, C]}`` whose
    tokens hold ``k * image_tokens`` entries equal to ``IMAGE_TOKEN``, one run
    per image in order. Returns numpy arrays with a leading ``rows`` dimension:
    ``tokens``, ``images``, ``image_index``, ``segment_ids`` (1, 2, ... per
    sample; 0 for padding), ``positions`` (restarting per sample), ``targets``
    (next token) and ``loss_mask`` (1 where the next token is text of the same
    sample).

    Raises:
      SpecError: a sample longer than ``seq_len``, with more images than
        ``images_per_row``, whose image slots do not match its images, or more
        rows needed than ``rows``.
    """
    v = config.vision
    per_image = config.image_tokens
    placed: list[list[int]] = []
    fill: list[tuple[int, int]] = []  # (tokens used, images used) per row
    for i, s in enumerate(samples):
        toks = np.asarray(s["tokens"])
        imgs = np.asarray(s["images"]).reshape(-1, v.image, v.image, v.channels)
        slots = int((toks == IMAGE_TOKEN).sum())
        if slots != len(imgs) * per_image:
            raise SpecError(f"samples[{i}].tokens", f"{slots} image slots",
                            f"{len(imgs)} images x {per_image} slots = {len(imgs) * per_image}")
        if len(toks) > seq_len:
            raise SpecError(f"samples[{i}].tokens", f"length {len(toks)}",
                            f"at most seq_len={seq_len} tokens")
        if len(imgs) > images_per_row:
            raise SpecError(f"samples[{i}].images", f"{len(imgs)} images",
                            f"at most images_per_row={images_per_row}")
        for r, (used, used_img) in enumerate(fill):
            if used + len(toks) <= seq_len and used_img + len(imgs) <= images_per_row:
                placed[r].append(i)
                fill[r] = (used + len(toks), used_img + len(imgs))
                break
        else:
            placed.append([i])
            fill.append((len(toks), len(imgs)))
    n_rows = len(placed) if rows is None else rows
    if len(placed) > n_rows:
        raise SpecError("rows", rows, f"at least {len(placed)} rows for these samples")
    out = {
        "tokens": np.zeros((n_rows, seq_len), np.int32),
        "images": np.zeros((n_rows, images_per_row, v.image, v.image, v.channels), np.float32),
        "image_index": np.full((n_rows, seq_len), -1, np.int32),
        "segment_ids": np.zeros((n_rows, seq_len), np.int32),
        "positions": np.zeros((n_rows, seq_len), np.int32),
        "targets": np.zeros((n_rows, seq_len), np.int32),
        "loss_mask": np.zeros((n_rows, seq_len), np.float32),
    }
    for r, members in enumerate(placed):
        at, img_at = 0, 0
        for seg, i in enumerate(members, start=1):
            toks = np.asarray(samples[i]["tokens"]).astype(np.int32)
            imgs = np.asarray(samples[i]["images"]).reshape(-1, v.image, v.image, v.channels)
            n = len(toks)
            sl = slice(at, at + n)
            is_img = toks == IMAGE_TOKEN
            out["tokens"][r, sl] = np.where(is_img, 0, toks)
            out["images"][r, img_at:img_at + len(imgs)] = imgs
            idx = np.full(n, -1, np.int32)
            idx[is_img] = img_at * per_image + np.arange(int(is_img.sum()))
            out["image_index"][r, sl] = idx
            out["segment_ids"][r, sl] = seg
            out["positions"][r, sl] = np.arange(n)
            out["targets"][r, at:at + n - 1] = np.where(is_img, 0, toks)[1:]
            out["loss_mask"][r, at:at + n - 1] = (~is_img[1:]).astype(np.float32)
            at += n
            img_at += len(imgs)
    return out
