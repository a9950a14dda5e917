"""Named model presets with their published shapes and parameter counts.

Sources:
  [GPT3]  Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1
          (n_layers, d_model, n_heads; vocab 50257, context 2048). GPT-3 13B's
          d_model is listed as 5140; we use 5120 so heads divide it (as
          Megatron-LM and most reproductions do); GPT-3 XL (1.3B) lists 24 heads of
          128 with d_model 2048, which cannot both hold: we keep d_head=128 (16 heads).
  [MEG]   Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
          GPU Clusters Using Megatron-LM", Table 1 (39.1B: 48 layers, hidden 8192,
          64 heads, vocab 51200).
  [LLAMA] Touvron et al. 2023, "LLaMA", Table 2 (7B, 13B); vocab 32000.
  [LLAMA2] Touvron et al. 2023, "Llama 2", Table 1 and the released config
          (70B: 80 layers, 8192 hidden, 64 heads, 8 KV heads, FFN 28672).
  [VIT]   Dosovitskiy et al. 2021, ViT, Table 1 (ViT-B: 86M).
  [CLIP]  Radford et al. 2021, CLIP; ViT-L/14 image encoder at 224px (~304M).
  [LLAVA] Liu et al. 2023, "Improved Baselines with Visual Instruction Tuning"
          (LLaVA-1.5: CLIP ViT-L/14 + 2-layer MLP projector + Vicuna-7B, 7.06B).
  [MIXTRAL] Jiang et al. 2024, "Mixtral of Experts", Table 1 and the released config
          (32 layers, 4096 hidden, 32 heads, 8 KV heads, 8 experts of FFN 14336, top-2,
          vocab 32000, rope theta 1e6; 46.7B parameters, 12.9B active).
  [DSMOE] Dai et al. 2024, "DeepSeekMoE", Section 5 and the released 16B config (28
          layers, 2048 hidden, 16 heads, vocab 102400; the first layer dense with FFN
          10944; then 64 fine-grained experts of FFN 1408, top-6, and 2 shared
          experts; 16.4B parameters, 2.8B active).
"""

from __future__ import annotations

from .gpt import GPTConfig
from .mllm import MLLMConfig
from .vit import ViTConfig

_GPT3 = dict(vocab=50257, seq=2048)
_LLAMA = dict(vocab=32000, pos="rope", norm="rmsnorm", mlp="swiglu", tied=False, bias=False,
              eps=1e-6)


def _gpt(name, layers, hidden, heads, **kw):
    return GPTConfig(layers=layers, hidden=hidden, heads=heads, name=name, **{**_GPT3, **kw})


def _llama(name, layers, hidden, heads, ffn, seq, **kw):
    return GPTConfig(layers=layers, hidden=hidden, heads=heads, ffn=ffn, seq=seq, name=name,
                     **{**_LLAMA, **kw})


_VIT_L14 = ViTConfig(layers=24, hidden=1024, heads=16, ffn=4096, patch=14, image=224,
                     eps=1e-5, name="vit-l14")
_LLAMA_7B = _llama("llama-7b", 32, 4096, 32, 11008, 2048)
_LLAMA_TINY = _llama("llama-tiny", 2, 64, 4, 128, 64, kv_heads=2, vocab=256)
_VIT_TINY = ViTConfig(layers=2, hidden=32, heads=4, ffn=64, patch=4, image=16, name="vit-tiny")

PRESETS = {c.name: c for c in [
    _gpt("gpt-125m", 12, 768, 12),
    _gpt("gpt-350m", 24, 1024, 16),
    _gpt("gpt-760m", 24, 1536, 16),
    _gpt("gpt-1.3b", 24, 2048, 16),
    _gpt("gpt-2.7b", 32, 2560, 32),
    _gpt("gpt-6.7b", 32, 4096, 32),
    _gpt("gpt-13b", 40, 5120, 40),
    _gpt("gpt-39b", 48, 8192, 64, vocab=51200),
    _gpt("gpt-175b", 96, 12288, 96),
    _LLAMA_7B,
    _llama("llama-13b", 40, 5120, 40, 13824, 2048),
    _llama("llama-70b", 80, 8192, 64, 28672, 4096, kv_heads=8),
    ViTConfig(layers=12, hidden=768, heads=12, ffn=3072, patch=16, image=224, name="vit-b16"),
    _VIT_L14,
    MLLMConfig(vision=_VIT_L14, text=_LLAMA_7B, name="llava-7b"),
    _llama("mixtral-8x7b", 32, 4096, 32, 14336, 32768, kv_heads=8, rope_theta=1e6,
           experts=8, top_k=2, eps=1e-5),
    _llama("deepseekmoe-16b", 28, 2048, 16, 10944, 4096, vocab=102400, experts=64,
           top_k=6, expert_ffn=1408, shared_experts=2, dense_layers=1),
    # Tiny variants: run for real on CPU in tests and the quickstart.
    GPTConfig(layers=2, hidden=64, heads=4, vocab=256, seq=64, name="gpt-tiny"),
    _LLAMA_TINY,
    _VIT_TINY,
    MLLMConfig(vision=_VIT_TINY, text=_LLAMA_TINY, name="llava-tiny"),
    _llama("moe-tiny", 2, 64, 4, 128, 64, kv_heads=2, vocab=256, experts=4, top_k=2,
           expert_ffn=64, shared_experts=1, dense_layers=1),
]}

# Published parameter counts and where they come from (see the module docstring).
PUBLISHED_PARAMS = {
    "gpt-125m": (125e6, "GPT3"), "gpt-350m": (350e6, "GPT3"), "gpt-760m": (760e6, "GPT3"),
    "gpt-1.3b": (1.3e9, "GPT3"), "gpt-2.7b": (2.7e9, "GPT3"), "gpt-6.7b": (6.7e9, "GPT3"),
    "gpt-13b": (13.0e9, "GPT3"), "gpt-39b": (39.1e9, "MEG"), "gpt-175b": (175.0e9, "GPT3"),
    "llama-7b": (6.74e9, "LLAMA"), "llama-13b": (13.0e9, "LLAMA"),
    "llama-70b": (69.0e9, "LLAMA2"), "vit-b16": (86e6, "VIT"), "vit-l14": (304e6, "CLIP"),
    "llava-7b": (7.06e9, "LLAVA"), "mixtral-8x7b": (46.7e9, "MIXTRAL"),
    "deepseekmoe-16b": (16.4e9, "DSMOE"),
}
