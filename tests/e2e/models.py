"""Tiny random-weight checkpoints for the end-to-end tests, made with transformers at test time (no hub).

Each kind is a real architecture vLLM's CPU build runs, a few layers wide enough that greedy outputs depend on
the prompt (weights ~ N(0, 0.2)). ``make(kind, root)`` writes ``root/<kind>/`` (config.json, model.safetensors)
and returns ``(path, dtype)``: the dtype vLLM's CPU kernels need for that kind.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers

SEED = 1234
STD = 0.2
VOCAB = 1024
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    initializer_range=STD,
)


def _llama() -> tuple[Any, Any]:
    return transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        architectures=["LlamaForCausalLM"],
        **COMMON,
    ), transformers.LlamaForCausalLM


def _gemma3() -> tuple[Any, Any]:
    # 4 layers: 3 sliding (window 64) + 1 full, like Gemma-3's 5:1 pattern.
    return transformers.Gemma3TextConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=64,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        architectures=["Gemma3ForCausalLM"],
        **COMMON,
    ), transformers.Gemma3ForCausalLM


def _deepseek_v2() -> tuple[Any, Any]:
    # MLA: vLLM CPU MLA kernels only support kv_lora_rank 512 + rope 64 (= head size 576).
    return transformers.DeepseekV2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=2,  # all layers dense MLP (no MoE)
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        architectures=["DeepseekV2ForCausalLM"],
        **COMMON,
    ), transformers.DeepseekV2ForCausalLM


def _qwen3_next() -> tuple[Any, Any]:
    return transformers.Qwen3NextConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        architectures=["Qwen3NextForCausalLM"],
        **COMMON,
    ), transformers.Qwen3NextForCausalLM


KINDS = {"llama": _llama, "gemma3": _gemma3, "deepseek_v2": _deepseek_v2, "qwen3_next": _qwen3_next}
DTYPES = {"llama": "float32", "gemma3": "float32", "deepseek_v2": "bfloat16",  # CPU MLA kernels: 16-bit only
          "qwen3_next": "bfloat16"}  # CPU gated-delta-net kernels: bf16 only


@torch.no_grad()
def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Deterministic weights: matrices ~ N(0, STD); biases 0; norm weights keep their defaults."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * STD)
        elif name.endswith(".bias"):
            p.zero_()


def make(kind: str, root: str) -> tuple[str, str]:
    """``kind`` is a key of KINDS, or one with ``_w2``: the same config with other weights (another seed)."""
    base = kind.removesuffix("_w2")
    out = os.path.join(root, kind)
    if not os.path.exists(os.path.join(out, "config.json")):
        cfg, cls = KINDS[base]()
        torch.manual_seed(SEED)
        model = cls(cfg).to(torch.float32)
        _reinit(model, SEED + (kind != base))
        model.save_pretrained(out, safe_serialization=True)
    return out, DTYPES[base]
