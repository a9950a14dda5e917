"""Decoder-only transformer covering the GPT-2/3 and LLaMA families (Flax NNX).

GPT-3 style: learned positions, LayerNorm with biases, GELU MLP, tied embeddings.
LLaMA style: rotary positions, RMSNorm, SwiGLU, no biases, untied head, and
grouped-query attention (``kv_heads < heads``). Every block runs under
``jax.named_scope("decoder/layer_{i}")``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from hetshard import SpecError

from .layers import (
    MLPS,
    NORMS,
    Block,
    block_params,
    make_norm,
    moe_params,
    norm_params,
    positive_int,
    run_layers,
)

POSITIONS = ("learned", "rope")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and flavour of a decoder-only transformer.

    ``ffn`` defaults to 4*hidden for GELU and to LLaMA's rule for SwiGLU
    (2/3 * 4 * hidden rounded up to a multiple of 256). ``kv_heads`` defaults to
    ``heads`` (multi-head attention). ``seq`` is the longest sequence the model
    accepts (the size of the learned position table).

    ``experts`` > 0 makes it a mixture of experts (``models.layers.MoE``, dropless):
    every block after the first ``dense_layers`` routes each token to ``top_k`` of
    ``experts`` experts of ``expert_ffn`` units (default ``ffn``), plus
    ``shared_experts`` always-on ones (DeepSeekMoE's fine-grained and shared experts).
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int | None = None
    kv_heads: int | None = None
    pos: str = "learned"
    norm: str = "layernorm"
    mlp: str = "gelu"
    tied: bool = True
    bias: bool = True
    rope_theta: float = 10000.0
    eps: float = 1e-5
    dtype: str = "float32"
    param_dtype: str = "float32"
    name: str = "gpt"
    experts: int = 0
    top_k: int = 2
    expert_ffn: int | None = None
    shared_experts: int = 0
    dense_layers: int = 0

    family = "gpt"

    def __post_init__(self):
        where = f"model {self.name!r}"
        for f in ("layers", "hidden", "heads", "vocab", "seq"):
            positive_int(f, getattr(self, f), where)
        for f in ("ffn", "kv_heads"):
            if getattr(self, f) is not None:
                positive_int(f, getattr(self, f), where)
        if self.hidden % self.heads:
            raise SpecError("hidden", self.hidden, f"a multiple of heads={self.heads}", where=where)
        if self.heads % self.num_kv_heads:
            raise SpecError("kv_heads", self.kv_heads, f"a divisor of heads={self.heads}",
                            where=where)
        if self.experts:
            if self.experts < 2:
                raise SpecError("experts", self.experts, "0 (a dense model) or at least 2",
                                where=where)
            positive_int("top_k", self.top_k, where)
            if self.top_k > self.experts:
                raise SpecError("top_k", self.top_k, f"at most experts={self.experts}",
                                where=where)
            if self.expert_ffn is not None:
                positive_int("expert_ffn", self.expert_ffn, where)
            if self.shared_experts < 0:
                raise SpecError("shared_experts", self.shared_experts,
                                "a count of at least 0", where=where)
            if not 0 <= self.dense_layers < self.layers:
                raise SpecError("dense_layers", self.dense_layers,
                                f"0 to layers - 1 = {self.layers - 1}", where=where)
        if self.pos not in POSITIONS:
            raise SpecError("pos", self.pos, f"one of {POSITIONS}", where=where)
        if self.norm not in NORMS:
            raise SpecError("norm", self.norm, f"one of {NORMS}", where=where)
        if self.mlp not in MLPS:
            raise SpecError("mlp", self.mlp, f"one of {MLPS}", where=where)
        if self.pos == "rope" and self.head_dim % 2:
            raise SpecError("hidden", self.hidden,
                            "an even head_dim (hidden/heads) for rotary positions", where=where)
        for f in ("dtype", "param_dtype"):
            try:
                jnp.dtype(getattr(self, f))
            except TypeError:
                raise SpecError(f, getattr(self, f), "a JAX dtype name such as "
                                "'float32' or 'bfloat16'", where=where) from None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn is not None:
            return self.ffn
        if self.mlp == "swiglu":
            return -(-int(2 * 4 * self.hidden / 3) // 256) * 256
        return 4 * self.hidden

    @property
    def moe(self) -> tuple | None:
        """``(expert_ffn, experts, top_k, shared)`` of its MoE blocks, or None."""
        if not self.experts:
            return None
        return (self.expert_ffn or self.ffn_dim, self.experts, self.top_k,
                self.shared_experts)

    def num_params(self) -> int:
        """Closed-form parameter count (equal to the NNX model's; tests check)."""
        n = self.vocab * self.hidden
        if self.pos == "learned":
            n += self.seq * self.hidden
        dense = self.layers if not self.experts else self.dense_layers
        n += dense * block_params(self.hidden, self.heads, self.num_kv_heads,
                                  self.ffn_dim, norm=self.norm, mlp=self.mlp,
                                  bias=self.bias)
        if self.experts:  # a block's attention and norms, and the MoE for its MLP
            mixed = block_params(self.hidden, self.heads, self.num_kv_heads, 0,
                                 norm=self.norm, mlp=self.mlp, bias=self.bias) - \
                (self.hidden if self.bias else 0)
            mixed += moe_params(self.hidden, self.moe[0], self.experts,
                                self.shared_experts, self.mlp)
            n += (self.layers - dense) * mixed
        n += norm_params(self.norm, self.hidden, self.bias)
        if not self.tied:
            n += self.vocab * self.hidden
        return n


class GPT(nnx.Module):
    """Decoder-only language model.

    Call with ``tokens`` [batch, seq] (int) and optionally ``positions`` and
    ``segment_ids`` [batch, seq] for packed sequences; returns logits
    [batch, seq, vocab] in float32.
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        c = config
        dtype, pdtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(c.vocab, c.hidden, dtype=dtype, param_dtype=pdtype,
                               embedding_init=init, rngs=rngs)
        self.pos_embed = (nnx.Embed(c.seq, c.hidden, dtype=dtype, param_dtype=pdtype,
                                    embedding_init=init, rngs=rngs)
                          if c.pos == "learned" else None)
        self.layers = nnx.List([
            Block(c.hidden, c.heads, c.num_kv_heads, c.ffn_dim, norm=c.norm, mlp=c.mlp,
                  bias=c.bias, eps=c.eps, rope_theta=c.rope_theta if c.pos == "rope" else None,
                  dtype=dtype, param_dtype=pdtype, rngs=rngs,
                  moe=c.moe if i >= c.dense_layers else None)
            for i in range(c.layers)])
        self.final_norm = make_norm(c.norm, c.hidden, eps=c.eps, bias=c.bias, dtype=dtype,
                                    param_dtype=pdtype, rngs=rngs)
        self.lm_head = (None if c.tied else
                        nnx.Linear(c.hidden, c.vocab, use_bias=False, dtype=dtype,
                                   param_dtype=pdtype, kernel_init=init, rngs=rngs))

    def embed_tokens(self, tokens_bs):
        """Token embeddings [batch, seq, hidden] (no positions)."""
        return self.embed(tokens_bs)

    def decode(self, x_bsd, *, positions_bs=None, segment_ids_bs=None):
        """Runs the decoder stack on input embeddings; returns float32 logits."""
        b, s, _ = x_bsd.shape
        if positions_bs is None:
            positions_bs = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if self.pos_embed is not None:
            with jax.named_scope("decoder/embed"):
                x_bsd = x_bsd + self.pos_embed(positions_bs)
        x_bsd = run_layers(self.layers, x_bsd, "decoder", causal=True,
                           positions_bs=positions_bs, segment_ids_bs=segment_ids_bs)
        with jax.named_scope("decoder/head"):
            x_bsd = self.final_norm(x_bsd)
            logits = (self.embed.attend(x_bsd) if self.lm_head is None
                      else self.lm_head(x_bsd))
        return logits.astype(jnp.float32)

    def __call__(self, tokens_bs, *, positions_bs=None, segment_ids_bs=None):
        with jax.named_scope("decoder/embed"):
            x_bsd = self.embed_tokens(tokens_bs)
        return self.decode(x_bsd, positions_bs=positions_bs, segment_ids_bs=segment_ids_bs)
