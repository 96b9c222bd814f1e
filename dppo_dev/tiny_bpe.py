"""A subword (BPE) vocabulary for the tiny math task, and the Qwen3 that uses it (issue 27).

The bundled `examples/tiny_math_model` reads bytes: 259 tokens. The paper's argument about ratio clipping (§4.2,
Fig. 1) is about *low-probability* tokens in a *large* vocabulary, which a byte vocabulary barely has. This module
trains a byte-level BPE with the `tokenizers` library on the task's own text (the tiny-math prompts and both
completion formats, with operands drawn up to `max_operand` so that the merges reach thousands of whole-number
tokens, as real subword vocabularies have) and builds a Qwen3 with the bundled model's body on top of it. Everything
is seeded: the same arguments give the same tokenizer and initial weights.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

from dppo_dev.tiny_math import ANSWER_INSTRUCTION, format_completion, make_tiny_math_problems
from dppo_dev.tiny_models import chatml_tokenizer, tiny_qwen3_config

__all__ = ["SPECIAL_TOKENS", "build_bpe_model", "task_corpus", "train_bpe_tokenizer"]

# Ids 0, 1, 2 (the trainer puts special tokens first, in this order).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def task_corpus(num_random: int = 200_000, max_operand: int = 9999, seed: int = 0) -> Iterator[str]:
    """The task's text: every bundled problem, then `num_random` problems with operands up to `max_operand`.

    Each line is a prompt and both completion formats with the true answer (`Answer: <n>`, `The answer is <n>.`),
    after their chat roles.
    """
    for row in make_tiny_math_problems():
        answer = row["reward_model"]["ground_truth"]
        yield _lines(row["prompt"][0]["content"], answer)
    rng = random.Random(seed)
    for _ in range(num_random):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        if op == "-" and a < b:
            a, b = b, a
        answer = str(a + b if op == "+" else a - b)
        yield _lines(f"What is {a}{op}{b}? {ANSWER_INSTRUCTION}", answer)


def _lines(prompt: str, answer: str) -> str:
    # The chat roles as the template writes them (the specials themselves are added tokens, never merged).
    return f"user\n{prompt}\nassistant\n{format_completion(answer)}\nassistant\n{format_completion(answer, False)}"


def train_bpe_tokenizer(
    vocab_size: int = 8192, num_random: int = 200_000, max_operand: int = 9999, seed: int = 0
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `task_corpus` and wrap it as a ChatML tokenizer (eos `<|im_end|>`, left padding)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text still encodes
        show_progress=False,
    )
    backend.train_from_iterator(task_corpus(num_random, max_operand, seed), trainer)
    tokenizer = chatml_tokenizer(backend)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    if ids != [0, 1, 2]:
        raise RuntimeError(f"Unexpected special-token ids {ids}, expected [0, 1, 2]")
    return tokenizer


def build_bpe_model(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, tie_word_embeddings: bool = True, **overrides
) -> PreTrainedModel:
    """A randomly initialised Qwen3 with the bundled tiny model's body (hidden 64, 2 layers) on `tokenizer`'s vocabulary.

    Tied embeddings keep the 8k-row matrix once (about 0.5M parameters instead of 1M), so the committed weights stay
    a few MB. The global RNG state is left untouched.
    """
    pad, eos = tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = tiny_qwen3_config(
        vocab_size=len(tokenizer),
        pad_token_id=pad,
        eos_token_id=eos,
        tie_word_embeddings=tie_word_embeddings,
        **overrides,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=None)
    model.eval()
    return model
