"""The subword (BPE) tiny-math model of issue 27: its tokenizer, its size, and the committed build.

The tokenizer tests train on a shrunk corpus (seconds); the committed model's files are checked as they are.
"""

import json
import os

import pytest

from dppo_dev.tiny_bpe import SPECIAL_TOKENS, build_bpe_model, task_corpus, train_bpe_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(REPO_ROOT, "examples", "tiny_math_bpe_model")


@pytest.fixture(scope="module")
def small_tokenizer():
    return train_bpe_tokenizer(vocab_size=1024, num_random=5000, max_operand=999, seed=0)


def test_corpus_is_the_tasks_text():
    lines = list(task_corpus(num_random=3, max_operand=99, seed=0))
    assert len(lines) == 355 + 3  # every bundled problem, then the random ones
    assert lines[0].startswith("user\nWhat is 0+0? Put the final answer after 'Answer:'.\nassistant\nAnswer: 0\n")
    assert lines == list(task_corpus(num_random=3, max_operand=99, seed=0))  # seeded


def test_tokenizer_specials_template_and_round_trip(small_tokenizer):
    tok = small_tokenizer
    assert len(tok) == 1024
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.padding_side == "left"
    text = "What is 13+4? Put the final answer after 'Answer:'."
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    assert prompt == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    # Whole numbers and words are single tokens: far fewer tokens than bytes.
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text) / 2 and tok.decode(ids) == text
    assert len(tok("Answer: 17", add_special_tokens=False)["input_ids"]) == 3  # "Answer", ":", " 17"
    # Text outside the corpus still encodes (the byte alphabet is in the vocabulary).
    assert tok.decode(tok("ünïcode ✓", add_special_tokens=False)["input_ids"]) == "ünïcode ✓"


def test_model_shape(small_tokenizer):
    model = build_bpe_model(small_tokenizer, seed=0)
    config = model.config
    assert config.vocab_size == 1024 and config.tie_word_embeddings
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (64, 2, 32)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert config.pad_token_id == 0 and config.eos_token_id == 2


def test_committed_model():
    """examples/tiny_math_bpe_model: an 8,192-token vocabulary, a few MB of weights, the build's own record."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(MODEL)
    tok = AutoTokenizer.from_pretrained(MODEL)
    assert len(tok) == config.vocab_size == 8192 and config.tie_word_embeddings
    assert os.path.getsize(os.path.join(MODEL, "model.safetensors")) < 4_000_000
    with open(os.path.join(MODEL, "pretraining.json")) as f:
        summary = json.load(f)
    assert summary["vocab_size"] == 8192 and summary["num_parameters"] < 1_000_000
    assert 0 < summary["train_format_t1"] < 1  # a base model before RL: the DAPO format only part of the time
