"""Tiny random-weight checkpoints made with transformers (no hub), for kvtier demo, the benchmarks and the tests.

Each kind is a real architecture vLLM's CPU build runs, a few layers wide enough that greedy outputs depend on
the prompt: weight matrices ~ N(0, 0.2) drawn from a seeded generator, biases 0, other vectors (norm weights)
left at their defaults. ``make(kind, root)`` writes ``root/<kind>/`` (config.json, model.safetensors) once and
returns ``(path, dtype)``: the dtype vLLM's CPU kernels need for that kind. ``make_llama(root, layers, hidden)``
is the benchmarks' Llama of any size. A checkpoint has no tokenizer unless :func:`add_tokenizer` writes one beside
it. torch and transformers are imported on first use, so importing this module costs nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

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
Builder = Callable[[], tuple[Any, Any]]  # () -> (transformers config, model class)


def llama(layers: int = 4, hidden: int = 256, max_positions: int = 2048) -> tuple[Any, Any]:
    """A Llama of ``layers`` x ``hidden``: heads of 64, ``hidden // 128`` KV heads, an MLP of ``2 x hidden``."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=64,
        architectures=["LlamaForCausalLM"],
        **{**COMMON, "max_position_embeddings": max_positions},
    ), transformers.LlamaForCausalLM


def llama_kv_bytes_per_token(layers: int, hidden: int) -> int:
    """KV bytes per token of ``llama(layers, hidden)`` in float32: K and V of ``hidden // 128`` heads of 64."""
    return 2 * max(1, hidden // 128) * 64 * 4 * layers


def gemma3() -> tuple[Any, Any]:
    """4 layers: 3 sliding (window 64) + 1 full, like Gemma-3's 5:1 pattern."""
    import transformers

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


def deepseek_v2() -> tuple[Any, Any]:
    """MLA: vLLM's CPU MLA kernels only support kv_lora_rank 512 + rope 64 (= head size 576)."""
    import transformers

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


def qwen3_next(max_positions: int | None = None) -> tuple[Any, Any]:
    """Hybrid: 3 gated-delta-net (linear attention) layers + 1 full attention layer, MoE MLPs."""
    import transformers

    common = {**COMMON, "max_position_embeddings": max_positions} if max_positions else COMMON
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
        **common,
    ), transformers.Qwen3NextForCausalLM


KINDS: dict[str, Builder] = {"llama": llama, "gemma3": gemma3, "deepseek_v2": deepseek_v2, "qwen3_next": qwen3_next}
DTYPES = {"llama": "float32", "gemma3": "float32", "deepseek_v2": "bfloat16",  # CPU MLA kernels: 16-bit only
          "qwen3_next": "bfloat16"}  # CPU gated-delta-net kernels: bf16 only


def _reinit(model: Any, seed: int) -> None:
    """Deterministic weights: matrices ~ N(0, STD) in name order from ``seed``; biases 0; other vectors kept."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * STD)
            elif name.endswith(".bias"):
                p.zero_()


def build(config: Any, model_class: Any, out: str, seed: int = SEED) -> str:
    """Construct ``model_class(config)`` in float32 (defaults drawn after ``torch.manual_seed(SEED)``), draw its
    weights from ``seed`` and save it (safetensors) under ``out``; return ``out``."""
    import torch

    torch.manual_seed(SEED)
    model = model_class(config).to(torch.float32)
    _reinit(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make(kind: str, root: str) -> tuple[str, str]:
    """``root/<kind>`` (made once) and its dtype. ``kind`` is a key of KINDS, or one with ``_w2``: the same
    config with other weights (seed + 1)."""
    base = kind.removesuffix("_w2")
    out = os.path.join(root, kind)
    if not os.path.exists(os.path.join(out, "config.json")):
        config, model_class = KINDS[base]()
        build(config, model_class, out, SEED + (kind != base))
    return out, DTYPES[base]


def make_qwen3_next(root: str) -> str:
    """The benchmarks' hybrid (:func:`qwen3_next`, bfloat16) with 8192 positions, saved as ``root/qwen3_next``."""
    config, model_class = qwen3_next(max_positions=8192)
    return build(config, model_class, os.path.join(root, "qwen3_next"))


def make_llama(root: str, layers: int, hidden: int) -> str:
    """The benchmarks' float32 Llama of ``layers`` x ``hidden`` (8192 positions), saved as ``root/llama``."""
    config, model_class = llama(layers, hidden, max_positions=8192)
    return build(config, model_class, os.path.join(root, "llama"))


def tokenizer_words(vocab_size: int = VOCAB) -> list[str]:
    """The words of :func:`add_tokenizer`'s vocabulary (after its 3 special tokens), in id order."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    return [a + b for a in syllables for b in syllables][: vocab_size - 3]


def add_tokenizer(model_dir: str, vocab_size: int = VOCAB) -> str:
    """Write a word-level tokenizer of ``vocab_size`` made-up words beside the checkpoint in ``model_dir`` (no hub):
    ``<pad>``, ``<s>``, ``</s>`` (the ids of ``COMMON``), then two-syllable words; text splits on whitespace, and
    decoding joins the words with spaces, so a reply's text encodes back to its tokens. Returns ``model_dir``."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", *tokenizer_words(vocab_size)])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<pad>", model_max_length=1 << 20)
    fast.save_pretrained(model_dir)
    return model_dir
