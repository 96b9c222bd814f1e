"""The bundled tiny tool-calling agent: TRL recognises its template, it starts imperfect, and rebuilding reproduces it."""

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)

from dppo_dev.tiny_agent import (
    agent_reward,
    make_agent_problems,
    multiply,
    qwen3_chat_template,
    rollout_stats,
    sample_episode_text,
    split_problems,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIR = os.path.join(ROOT, "examples", "tiny_agent_model")
DATA_DIR = os.path.join(ROOT, "examples", "data", "tiny_agent")
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 47, "b": 38}}\n</tool_call>'


def _read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_template_is_trls_qwen3_and_tool_ready(tokenizer):
    assert tokenizer.chat_template == qwen3_chat_template()
    assert supports_tool_calling(tokenizer)
    # Not prefix-preserving as shipped (Qwen3's own template), so TRL swaps in its training variant, which must exist.
    assert not is_chat_template_prefix_preserving(tokenizer)
    assert get_training_chat_template(tokenizer)
    parser = add_response_schema(AutoTokenizer.from_pretrained(MODEL_DIR))
    prompt = parser.apply_chat_template(
        [{"role": "user", "content": "What is 47*38?"}],
        tools=[multiply],
        add_generation_prompt=True,
        return_dict=False,
    )
    assert len(prompt) < 64  # the tool system prompt is one added token
    ids = parser(CALL, add_special_tokens=False)["input_ids"] + [parser.eos_token_id]
    message = parse_response(parser, ids, prefix=prompt, tools=[multiply])
    assert message["tool_calls"] == [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 47, "b": 38}}}
    ]
    broken = parser(CALL.replace("}}", "}", 1), add_special_tokens=False)["input_ids"] + [parser.eos_token_id]
    assert "tool_calls" not in parse_response(parser, broken, prefix=prompt, tools=[multiply])  # TRL's text fallback


def test_bundled_data_matches_generator():
    train, test = split_problems(make_agent_problems(), num_test=200, seed=0)
    assert _read_jsonl(os.path.join(DATA_DIR, "train.jsonl")) == train
    assert _read_jsonl(os.path.join(DATA_DIR, "test.jsonl")) == test
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    assert agent_reward([[{"role": "assistant", "content": f"Answer: {test[0]['answer']}"}]], [test[0]["answer"]]) == [
        1.0
    ]


def test_committed_agent_starts_imperfect(tokenizer):
    """Sampled like RL samples (temperature 1): it calls the tool often, but not always, and sometimes malformed."""
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    stats = rollout_stats(sample_episode_text(model, tokenizer, _read_jsonl(os.path.join(DATA_DIR, "test.jsonl"))))
    recorded = json.load(open(os.path.join(MODEL_DIR, "pretraining.json")))["test_t1"]
    assert {k: stats[k] for k in recorded} == pytest.approx(recorded, abs=1e-4)
    assert 1 < stats["mean_turns"] < 2
    assert 0 < stats["accuracy"] < 1 and 0 < stats["tool_call_rate"] < 1 and stats["malformed_rate"] > 0


@pytest.mark.slow
def test_rebuild_reproduces_committed_agent(tokenizer, tmp_path):
    """Rebuilt as a user rebuilds it (the script, in a fresh process: no state from other tests), the agent has the
    committed weights and answers the held-out problems exactly as the committed one does."""
    out = tmp_path / "model"
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "make_tiny_agent_model.py"),
            "--output_dir",
            str(out),
            "--data_dir",
            str(tmp_path / "data"),
            "--eval_problems",
            "16",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    built = AutoModelForCausalLM.from_pretrained(out)
    built_tokenizer = AutoTokenizer.from_pretrained(out)
    committed = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    assert built_tokenizer.get_vocab() == tokenizer.get_vocab()
    recorded = committed.config.transformers_version  # the release that built the committed weights
    if recorded != transformers.__version__:
        # Bit-exact weights are promised on the release that built them: the builder's SFT differs in the last bits
        # across transformers releases (5.17 and 5.24 both differ from 5.19). Elsewhere the rebuilt agent must still
        # be the agent the docs describe, sampled as RL samples it.
        torch.set_num_threads(1)
        stats = rollout_stats(
            sample_episode_text(built, built_tokenizer, _read_jsonl(os.path.join(DATA_DIR, "test.jsonl")))
        )
        assert 1 < stats["mean_turns"] < 2, stats
        assert 0 < stats["accuracy"] < 1 and 0 < stats["tool_call_rate"] < 1 and stats["malformed_rate"] > 0, stats
        return
    for (name, rebuilt), (_, saved) in zip(built.state_dict().items(), committed.state_dict().items(), strict=True):
        torch.testing.assert_close(rebuilt, saved, msg=name)
    rows = _read_jsonl(os.path.join(DATA_DIR, "test.jsonl"))[:16]
    assert sample_episode_text(built, built_tokenizer, rows, temperature=0) == sample_episode_text(
        committed, tokenizer, rows, temperature=0
    )
