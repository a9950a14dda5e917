"""Transformer building blocks shared by the decoder (GPT/LLaMA) and ViT.

Every attention op goes through :func:`hetshard.nn.attention` so hetshard's
attention rewrite can find it. Arrays carry shape suffixes where it helps:
``x_bsd`` is [batch, seq, hidden].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hetshard import SpecError
from hetshard import nn as hnn

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")


def positive_int(field: str, value, where: str) -> int:
    """``value`` if it is a positive int (a config's sizes), else a SpecError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(field, value, "a positive integer", where=where)
    return value


def make_norm(kind: str, dim: int, *, eps: float, bias: bool, dtype, param_dtype, rngs):
    if kind == "layernorm":
        return nnx.LayerNorm(dim, epsilon=eps, use_bias=bias, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)
    return nnx.RMSNorm(dim, epsilon=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def norm_params(kind: str, dim: int, bias: bool) -> int:
    return dim * (2 if kind == "layernorm" and bias else 1)


def rope(x_bshd, positions_bs, theta: float):
    """Rotary position embedding (Su et al. 2021), rotating channel halves (GPT-NeoX/LLaMA)."""
    d = x_bshd.shape[-1]
    freqs = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    angles = positions_bs[..., None].astype(jnp.float32) * freqs  # [b, s, d/2]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x_bshd.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bshd.dtype)


class Attention(nnx.Module):
    """Multi-head or grouped-query self-attention with optional rotary positions."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, *, bias: bool,
                 rope_theta: float | None, dtype, param_dtype, rngs: nnx.Rngs):
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim = hidden // heads
        self.rope_theta = rope_theta
        kw = dict(use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(hidden, heads * self.head_dim, **kw)
        self.k_proj = nnx.Linear(hidden, kv_heads * self.head_dim, **kw)
        self.v_proj = nnx.Linear(hidden, kv_heads * self.head_dim, **kw)
        self.o_proj = nnx.Linear(heads * self.head_dim, hidden, **kw)

    def __call__(self, x_bsd, *, causal: bool, positions_bs=None, segment_ids_bs=None):
        b, s, _ = x_bsd.shape
        q = self.q_proj(x_bsd).reshape(b, s, self.heads, self.head_dim)
        k = self.k_proj(x_bsd).reshape(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x_bsd).reshape(b, s, self.kv_heads, self.head_dim)
        if self.rope_theta is not None:
            if positions_bs is None:
                positions_bs = jnp.broadcast_to(jnp.arange(s), (b, s))
            q = rope(q, positions_bs, self.rope_theta)
            k = rope(k, positions_bs, self.rope_theta)
        out = hnn.attention(q, k, v, causal=causal, segment_ids=segment_ids_bs)
        return self.o_proj(out.reshape(b, s, self.heads * self.head_dim))


class MLP(nnx.Module):
    """GELU MLP (GPT, ViT) or SwiGLU (LLaMA; Shazeer 2020)."""

    def __init__(self, hidden: int, ffn: int, *, kind: str, bias: bool, dtype,
                 param_dtype, rngs: nnx.Rngs):
        self.kind = kind
        kw = dict(use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.up = nnx.Linear(hidden, ffn, **kw)
        self.gate = nnx.Linear(hidden, ffn, **kw) if kind == "swiglu" else None
        self.down = nnx.Linear(ffn, hidden, **kw)

    def __call__(self, x_bsd):
        if self.kind == "swiglu":
            h = nnx.silu(self.gate(x_bsd)) * self.up(x_bsd)
        else:
            h = nnx.gelu(self.up(x_bsd), approximate=True)
        return self.down(h)


class MoE(nnx.Module):
    """A dropless mixture-of-experts feed-forward layer (Mixtral, DeepSeekMoE): a router
    (no bias), softmax over the experts, the ``top_k`` kept and renormalized; experts of
    ``expert_ffn`` units stacked on a leading axis, the tokens sorted by expert and
    computed with grouped matmuls (``jax.lax.ragged_dot``), put back and weighted by
    their gates; ``shared`` always-on experts (DeepSeekMoE's) as one dense MLP of
    ``shared * expert_ffn`` units."""

    def __init__(self, hidden: int, expert_ffn: int, experts: int, top_k: int, shared: int,
                 *, kind: str, dtype, param_dtype, rngs: nnx.Rngs):
        self.kind, self.experts, self.top_k, self.dtype = kind, experts, top_k, dtype
        self.router = nnx.Linear(hidden, experts, use_bias=False, dtype=dtype,
                                 param_dtype=param_dtype, rngs=rngs)
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=0)

        def stack(d_in, d_out):
            return nnx.Param(init(rngs.params(), (experts, d_in, d_out), param_dtype))
        self.up = stack(hidden, expert_ffn)
        self.gate = stack(hidden, expert_ffn) if kind == "swiglu" else None
        self.down = stack(expert_ffn, hidden)
        self.shared = (MLP(hidden, shared * expert_ffn, kind=kind, bias=False, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs) if shared else None)

    def __call__(self, x_bsd):
        b, s, d = x_bsd.shape
        t = x_bsd.reshape(b * s, d)
        probs = jax.nn.softmax(self.router(t).astype(jnp.float32), axis=-1)
        gates, idx = jax.lax.top_k(probs, self.top_k)
        gates = gates / gates.sum(-1, keepdims=True)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat)
        sizes = jnp.bincount(flat, length=self.experts).astype(jnp.int32)
        rows = t[order // self.top_k]
        up = jax.lax.ragged_dot(rows, self.up[...].astype(self.dtype), sizes)
        if self.kind == "swiglu":
            h = nnx.silu(jax.lax.ragged_dot(rows, self.gate[...].astype(self.dtype),
                                            sizes)) * up
        else:
            h = nnx.gelu(up, approximate=True)
        y = jax.lax.ragged_dot(h, self.down[...].astype(self.dtype), sizes)
        out = jnp.zeros((b * s * self.top_k, d), y.dtype).at[order].set(y)
        out = (out.reshape(b * s, self.top_k, d) *
               gates[..., None].astype(y.dtype)).sum(1).reshape(b, s, d)
        return out if self.shared is None else out + self.shared(x_bsd)


def moe_params(hidden: int, expert_ffn: int, experts: int, shared: int, mlp: str) -> int:
    """Closed-form parameter count of one :class:`MoE` (checked against NNX in tests)."""
    n_in = 3 if mlp == "swiglu" else 2
    return hidden * experts + (experts + shared) * n_in * hidden * expert_ffn


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); ``moe``
    (``(expert_ffn, experts, top_k, shared)``): a :class:`MoE` in place of the MLP."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, *, norm: str,
                 mlp: str, bias: bool, eps: float, rope_theta: float | None, dtype,
                 param_dtype, rngs: nnx.Rngs, moe: tuple | None = None):
        nkw = dict(eps=eps, bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attn_norm = make_norm(norm, hidden, **nkw)
        self.attn = Attention(hidden, heads, kv_heads, bias=bias, rope_theta=rope_theta,
                              dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp_norm = make_norm(norm, hidden, **nkw)
        self.mlp = (MLP(hidden, ffn, kind=mlp, bias=bias, dtype=dtype,
                        param_dtype=param_dtype, rngs=rngs) if moe is None else
                    MoE(hidden, *moe, kind=mlp, dtype=dtype, param_dtype=param_dtype,
                        rngs=rngs))

    def __call__(self, x_bsd, *, causal: bool, positions_bs=None, segment_ids_bs=None):
        # Each residual branch under its own scope: the halves a stage boundary may fall
        # between when plans split blocks.
        with jax.named_scope("attn"):
            x_bsd = x_bsd + self.attn(self.attn_norm(x_bsd), causal=causal,
                                      positions_bs=positions_bs,
                                      segment_ids_bs=segment_ids_bs)
        with jax.named_scope("mlp"):
            return x_bsd + self.mlp(self.mlp_norm(x_bsd))


def block_params(hidden: int, heads: int, kv_heads: int, ffn: int, *, norm: str, mlp: str,
                 bias: bool) -> int:
    """Closed-form parameter count of one :class:`Block` (checked against NNX in tests)."""
    hd = hidden // heads
    q, kv = heads * hd, kv_heads * hd
    attn = hidden * q + 2 * hidden * kv + q * hidden + (q + 2 * kv + hidden if bias else 0)
    n_in = 3 if mlp == "swiglu" else 2
    mlp_p = n_in * hidden * ffn + ((n_in - 1) * ffn + hidden if bias else 0)
    return attn + mlp_p + 2 * norm_params(norm, hidden, bias)


def run_layers(layers, x_bsd, scope: str, **kwargs):
    """Runs ``layers`` in order, each under ``jax.named_scope(f"{scope}/layer_{i}")``.

    The scope names are the layer boundaries hetshard's tracer reads back from
    the jaxpr (forward: ``jvp(decoder/layer_7)``; backward: ``transpose(jvp(...))``).
    """
    for i, layer in enumerate(layers):
        with jax.named_scope(f"{scope}/layer_{i}"):
            x_bsd = layer(x_bsd, **kwargs)
    return x_bsd
