"""Synthetic data sets with learnable structure, for tests and the quickstart.

Tokens follow a fixed affine recurrence ``t[i+1] = (a * t[i] + c) mod vocab``
from a random start, so a model can drive the loss well below ``log(vocab)``
in a few dozen steps; images are noise whose mean encodes the first text token,
so the vision path carries signal too.
"""

from __future__ import annotations

import numpy as np

from .mllm import IMAGE_TOKEN, MLLMConfig, pack


def _sequence(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    out = np.empty(n, np.int64)
    out[0] = rng.integers(1, vocab)
    for i in range(1, n):
        out[i] = (5 * out[i - 1] + 3) % vocab
    return out


def text_batch(rng: np.random.Generator, batch: int, seq: int, vocab: int) -> dict:
    """``{"tokens", "targets"}`` int32 [batch, seq]: next-token prediction."""
    rows = np.stack([_sequence(rng, seq + 1, vocab) for _ in range(batch)])
    return {"tokens": rows[:, :-1].astype(np.int32), "targets": rows[:, 1:].astype(np.int32)}


def mllm_samples(rng: np.random.Generator, n: int, config: MLLMConfig, *,
                 text_len: tuple[int, int] = (6, 16), max_images: int = 1) -> list[dict]:
    """``n`` samples ``{"tokens", "images"}`` with 0..max_images images each (see ``pack``)."""
    v, vocab = config.vision, config.text.vocab
    samples = []
    for _ in range(n):
        k = int(rng.integers(0, max_images + 1))
        text = _sequence(rng, int(rng.integers(*text_len)), vocab)
        images = (rng.normal(size=(k, v.image, v.image, v.channels)) +
                  text[0] / vocab).astype(np.float32)
        slots = [IMAGE_TOKEN] * (k * config.image_tokens)
        samples.append({"tokens": np.concatenate([text[:1], slots, text[1:]]).astype(np.int64),
                        "images": images})
    return samples


def mllm_batch(rng: np.random.Generator, rows: int, config: MLLMConfig, *, seq_len: int,
               images_per_row: int = 2) -> dict:
    """A packed batch of exactly ``rows`` rows (samples drawn until the rows are full)."""
    samples: list[dict] = []
    while True:
        cand = samples + mllm_samples(rng, 1, config, max_images=1)
        try:
            pack(cand, config=config, seq_len=seq_len, images_per_row=images_per_row,
                 rows=rows)
        except ValueError:
            break
        samples = cand
    return pack(samples, config=config, seq_len=seq_len, images_per_row=images_per_row,
                rows=rows)
