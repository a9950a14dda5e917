"""Two models as a user would write them, for the planner benchmark and the docs'
``--model file.py:factory`` example. Nothing here comes from ``models/`` or
``hetshard.nn``: plain Flax NNX, einsum attention, no named scopes.

Each factory follows hetshard's factory protocol (``hetshard.factory``): it takes the
command line's ``seq_len`` and ``dtype`` and returns ``(step, args)``, shape-only
(``nnx.eval_shape``), so a multi-billion-parameter model plans without weights::

    hetshard plan --model experiments/user_models.py:gpt_noscope --cluster a100-v100-x16 \\
        --global-batch 256
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import hetshard


def _lm_loss(model, batch):
    logits = model(batch["tokens"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _adamw_step(model, optimizer, batch):
    loss, grads = hetshard.value_and_grad(_lm_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def _args(make_model, batch: int, seq_len: int):
    model = nnx.eval_shape(make_model)
    opt = nnx.eval_shape(lambda m: nnx.Optimizer(m, optax.adamw(3e-4), wrt=nnx.Param), model)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    return model, opt, {"tokens": tokens, "targets": tokens}


# ---- a GPT-style model written out by hand, no scopes ------------------------------------

class Attention(nnx.Module):
    def __init__(self, d, heads, dtype, rngs):
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        b, s, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, s, 3, self.heads, d // self.heads), 3, 2)
        q, k, v = (t[:, :, 0] for t in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((s, s), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9).astype(jnp.float32), -1)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)
        return self.out(y.reshape(b, s, d))


class GPTBlock(nnx.Module):
    def __init__(self, d, heads, dtype, rngs):
        self.norm1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.attn = Attention(d, heads, dtype, rngs)
        self.norm2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.fc = nnx.Linear(d, 4 * d, dtype=dtype, rngs=rngs)
        self.proj = nnx.Linear(4 * d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.proj(jax.nn.gelu(self.fc(self.norm2(x))))


class GPTNoScope(nnx.Module):
    def __init__(self, vocab, seq, d, heads, layers, dtype, rngs):
        self.tok = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)
        self.pos = nnx.Embed(seq, d, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([GPTBlock(d, heads, dtype, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def gpt_noscope(seq_len: int = 2048, dtype: str = "bfloat16", batch: int = 8):
    """A GPT-2.7B-shaped model (32 blocks of width 2560, 32 heads, vocab 50257)."""
    make = lambda: GPTNoScope(50257, seq_len, 2560, 32, 32, dtype, nnx.Rngs(0))  # noqa: E731
    return _adamw_step, _args(make, batch, seq_len)


# ---- a LLaMA-style model whose blocks are stacked and scanned ----------------------------

def _rope(x, theta=10000.0):
    b, s, h, d = x.shape
    freq = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angle = jnp.arange(s, dtype=jnp.float32)[:, None] * freq[None]
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    x1, x2 = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.reshape(b, s, h, d).astype(x.dtype)


class LlamaBlock(nnx.Module):
    def __init__(self, d, heads, kv_heads, ffn, dtype, rngs):
        self.heads, self.kv_heads, self.dh = heads, kv_heads, d // heads
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)  # noqa
        self.norm1, self.norm2 = (nnx.RMSNorm(d, dtype=dtype, rngs=rngs) for _ in range(2))
        self.q, self.k, self.v = lin(d, d), lin(d, kv_heads * self.dh), lin(d, kv_heads * self.dh)
        self.o = lin(d, d)
        self.gate, self.up, self.down = lin(d, ffn), lin(d, ffn), lin(ffn, d)

    def __call__(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q = _rope(self.q(h).reshape(b, s, self.heads, self.dh))
        k = _rope(self.k(h).reshape(b, s, self.kv_heads, self.dh))
        v = self.v(h).reshape(b, s, self.kv_heads, self.dh)
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.dh)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, s, d)
        x = x + self.o(y)
        h = self.norm2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class LlamaScanned(nnx.Module):
    def __init__(self, vocab, d, heads, kv_heads, ffn, layers, dtype, rngs):
        self.embed = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return LlamaBlock(d, heads, kv_heads, ffn, dtype, rngs)
        self.blocks = blocks(rngs)
        self.norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)
        return self.head(self.norm(run(self.embed(tokens), self.blocks)))


def llama_scanned(seq_len: int = 2048, dtype: str = "bfloat16", batch: int = 8):
    """A LLaMA-2-70B-shaped model (80 blocks of width 8192, 64 heads, 8 key/value heads,
    ffn 28672, vocab 32000), its blocks stacked and run by ``nnx.scan``."""
    make = lambda: LlamaScanned(32000, 8192, 64, 8, 28672, 80, dtype,  # noqa: E731
                                nnx.Rngs(0))
    return _adamw_step, _args(make, batch, seq_len)
