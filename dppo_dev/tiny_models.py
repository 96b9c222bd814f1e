"""Tiny, fully offline models for tests, demos and benchmarks.

Everything here is built from code (no Hub access, no training): a byte-level tokenizer with ChatML specials and
randomly initialised Qwen3 / Qwen3-MoE models small enough for 2 CPU cores, whose shapes the CPU build of vLLM
accepts (head_dim >= 32).
"""

from __future__ import annotations

import os
from typing import Literal

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "CHATML_TEMPLATE",
    "ENDOFTEXT_ID",
    "IM_END_ID",
    "IM_START_ID",
    "QWEN3_SIZE_PRESETS",
    "TOKENIZER_VOCAB_SIZE",
    "build_byte_tokenizer",
    "build_tiny_model",
    "save_tiny_model",
    "tiny_qwen3_config",
    "tiny_qwen3_moe_config",
]

BYTE_VOCAB_SIZE = 256
ENDOFTEXT_ID = 256
IM_START_ID = 257
IM_END_ID = 258
TOKENIZER_VOCAB_SIZE = 259

# ChatML; string content only (no tool calls). `add_generation_prompt` opens an assistant turn.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

ModelKind = Literal["qwen3", "qwen3_moe"]

# Named Qwen3 sizes for benchmarks (`tiny_qwen3_config` overrides), all loadable by vLLM's CPU backend.
QWEN3_SIZE_PRESETS = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128),
    "small": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=512),
    "medium": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1024),
}


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE tokenizer with no merges: ids 0-255 are bytes, 256-258 are ChatML specials.

    Deterministic (no training), so every process builds the identical tokenizer. Any text round-trips exactly.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Registering the specials on the backend first pins their ids to 256, 257, 258 in this order.
    backend.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    )
    tokenizer = chatml_tokenizer(backend)
    expected = {"<|endoftext|>": ENDOFTEXT_ID, "<|im_start|>": IM_START_ID, "<|im_end|>": IM_END_ID}
    actual = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in expected}
    if actual != expected:
        raise RuntimeError(f"Unexpected special-token ids {actual}, expected {expected}")
    return tokenizer


def chatml_tokenizer(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """A `tokenizers` backend as a left-padded fast tokenizer with ChatML specials and the chat template."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        truncation_side="left",
        chat_template=CHATML_TEMPLATE,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    return tokenizer


def _common_config_kwargs(vocab_size: int) -> dict:
    if vocab_size < TOKENIZER_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {TOKENIZER_VOCAB_SIZE} (the tokenizer size), got {vocab_size}")
    return {
        "vocab_size": vocab_size,
        "pad_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "bos_token_id": None,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
    }


def tiny_qwen3_config(
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    **overrides,
) -> Qwen3Config:
    """A ~100k-parameter Qwen3 config that vLLM's CPU backend loads (head_dim must be a CPU attention size >= 32).

    The model vocab defaults to the tokenizer's 259 ids; vLLM pads the LM head internally, so no padding is needed
    here. A larger `vocab_size` leaves ids >= 259 unused by the tokenizer.
    """
    kwargs = _common_config_kwargs(vocab_size)
    kwargs.update(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
    )
    kwargs.update(overrides)
    config = Qwen3Config(**kwargs)
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def tiny_qwen3_moe_config(
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    tie_word_embeddings: bool = False,
    **overrides,
) -> Qwen3MoeConfig:
    """A tiny Qwen3-MoE config (4 experts, top-2) that returns router logits, so the trainer adds an aux loss."""
    kwargs = _common_config_kwargs(vocab_size)
    kwargs.update(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=4 * moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=tie_word_embeddings,
    )
    kwargs.update(overrides)
    config = Qwen3MoeConfig(**kwargs)
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def _tiny_config(kind: ModelKind, **overrides) -> Qwen3Config | Qwen3MoeConfig:
    if kind == "qwen3":
        return tiny_qwen3_config(**overrides)
    if kind == "qwen3_moe":
        return tiny_qwen3_moe_config(**overrides)
    raise ValueError(f"Unknown tiny model kind {kind!r}; expected 'qwen3' or 'qwen3_moe'")


def build_tiny_model(
    kind: ModelKind = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Randomly initialise a tiny model (same `seed` -> same weights) and its byte tokenizer.

    `overrides` go to the config builder (e.g. `tie_word_embeddings=True`, `hidden_size=...`). The global RNG state
    is left untouched.
    """
    config = _tiny_config(kind, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=[IM_END_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID, bos_token_id=None
    )
    model.eval()
    return model, build_byte_tokenizer()


def save_tiny_model(path: str | os.PathLike, kind: ModelKind = "qwen3", seed: int = 0, **overrides) -> str:
    """Build a tiny model and write it with its tokenizer to `path`; returns the path as a string.

    vLLM colocate mode and TRL's reference model reload models by path, so in-memory models are not enough there.
    """
    model, tokenizer = build_tiny_model(kind=kind, seed=seed, **overrides)
    path = os.fspath(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
