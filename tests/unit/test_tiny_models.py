import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dppo_dev.tiny_models import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    TOKENIZER_VOCAB_SIZE,
    build_byte_tokenizer,
    build_tiny_model,
    tiny_qwen3_config,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def test_tokenizer_special_ids(tokenizer):
    assert len(tokenizer) == TOKENIZER_VOCAB_SIZE
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == ENDOFTEXT_ID
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == IM_START_ID
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END_ID
    assert tokenizer.eos_token_id == IM_END_ID
    assert tokenizer.pad_token_id == ENDOFTEXT_ID
    assert tokenizer.bos_token_id is None
    assert tokenizer.padding_side == "left"
    assert tokenizer.truncation_side == "left"


@pytest.mark.parametrize("text", ["hello world", "  leading spaces", "héllo ünïcode ✓ 中文", "a\nb\tc", ""])
def test_tokenizer_round_trips_text(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte, no merges
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_is_deterministic(tokenizer):
    other = build_byte_tokenizer()
    text = "The quick brown fox <|im_end|>"
    assert other(text).input_ids == tokenizer(text).input_ids
    assert other.get_vocab() == tokenizer.get_vocab()


def test_specials_are_single_tokens_and_skippable(tokenizer):
    ids = tokenizer("<|im_start|>hi<|im_end|><|endoftext|>").input_ids
    assert len(ids) == 5
    assert ids[0] == IM_START_ID and ids[-2:] == [IM_END_ID, ENDOFTEXT_ID]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi"


def test_left_padding(tokenizer):
    batch = tokenizer(["a", "abc"], padding=True, return_tensors="pt")
    assert batch.input_ids[0].tolist()[:2] == [ENDOFTEXT_ID, ENDOFTEXT_ID]
    assert batch.attention_mask[0].tolist() == [0, 0, 1]


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    with_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_prompt == rendered + "<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tokenizer.decode(ids) == with_prompt


def test_config_shapes():
    config = tiny_qwen3_config()
    assert config.vocab_size == TOKENIZER_VOCAB_SIZE
    assert config.head_dim >= 32  # smallest head_dim vLLM's CPU attention accepts
    assert config.pad_token_id == ENDOFTEXT_ID and config.eos_token_id == IM_END_ID
    assert config.bos_token_id is None
    assert tiny_qwen3_config(hidden_size=128).hidden_size == 128


def test_model_is_deterministic_and_runs_forward():
    model, tokenizer = build_tiny_model(seed=3)
    again, _ = build_tiny_model(seed=3)
    other, _ = build_tiny_model(seed=4)
    state, state_again, state_other = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(state[k], state_again[k]) for k in state)
    assert not all(torch.equal(state[k], state_other[k]) for k in state)
    assert model.generation_config.eos_token_id == [IM_END_ID, ENDOFTEXT_ID]
    assert model.generation_config.pad_token_id == ENDOFTEXT_ID

    batch = tokenizer(["hello", "hi"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch.input_ids.shape[1], TOKENIZER_VOCAB_SIZE)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_build_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_tied_embeddings():
    model, _ = build_tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_moe_model_has_aux_loss():
    model, tokenizer = build_tiny_model(kind="qwen3_moe")
    ids = tokenizer(["hello there"], return_tensors="pt").input_ids
    out = model(input_ids=ids, labels=ids)
    assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss) and out.aux_loss > 0
    out.loss.backward()


def test_unknown_kind():
    with pytest.raises(ValueError, match="Unknown tiny model kind"):
        build_tiny_model(kind="llama")


@pytest.mark.parametrize("fixture_name", ["tiny_model_dir", "tiny_tied_model_dir", "tiny_moe_model_dir"])
def test_save_load_round_trip(fixture_name, request):
    path = request.getfixturevalue(fixture_name)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    kind = "qwen3_moe" if "moe" in fixture_name else "qwen3"
    tied = "tied" in fixture_name
    reference, _ = build_tiny_model(kind=kind, tie_word_embeddings=tied)
    ref_state = reference.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name
    assert loaded.config.tie_word_embeddings == tied
    assert loaded.generation_config.eos_token_id == [IM_END_ID, ENDOFTEXT_ID]
    assert tokenizer.eos_token_id == IM_END_ID and tokenizer.pad_token_id == ENDOFTEXT_ID
    assert tokenizer.padding_side == "left"
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_free_port_fixture_hands_out_unique_bindable_ports(free_port):
    import socket

    from conftest import get_free_port

    ports = {free_port, get_free_port(), get_free_port()}
    assert len(ports) == 3
    assert not any(29500 <= p < 29510 for p in ports)  # TRL's default candidates stay free for others
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_master_port_fixture_sets_env(master_port):
    import os

    assert os.environ["MASTER_PORT"] == str(master_port)


@pytest.mark.gpu
def test_gpu_marker_skips_without_cuda():
    # Reaching this body means a CUDA device exists; on CPU-only machines the conftest hook must skip it.
    assert torch.cuda.is_available()
