"""The Hub model card carries DPPO's tags, the paper's citation and the DPPO settings (generated locally)."""

from pathlib import Path

from trainer_setup import make_trainer


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
