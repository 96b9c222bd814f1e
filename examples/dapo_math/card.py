"""The recipe section `train_dapo_math.py` appends to DPPOTrainer's model card: data, batch shape, curves, evals.

Model and data are named with the card's own rules (`dppo_trl.hardening.model_card`: Hub id, or a local name marked local, never
an absolute path). The training curves are linked by file name, relative to the card, so the image renders on the
Hub after `push_to_hub` (which uploads the output folder with the PNG in it).
"""

from __future__ import annotations

import os

from dppo_trl.hardening.model_card import base_model_for_card, dataset_for_card

CURVES_FILE = "training_curves.png"


def recipe_card_section(script_args, training_args, model_args, eval_metrics: dict) -> str:
    """Markdown for the model card: how the run was made (data, model, the batch/length shape) and its final evals."""
    schedule = training_args.lr_scheduler_type
    reward = "accuracy (math-verify)"
    if script_args.format_reward_weight:
        reward += f" + {script_args.format_reward_weight} x format"
    _, base_model = base_model_for_card(model_args.model_name_or_path)
    _, data = dataset_for_card(script_args.dataset_name)
    batch_rows = [
        ("base model", base_model),
        ("training data", f"{data or '–'} (deduplicated: {script_args.dedup})"),
        ("reward", reward),
        ("completions per device step", training_args.per_device_train_batch_size),
        ("gradient accumulation", training_args.gradient_accumulation_steps),
        ("steps per generation", training_args.steps_per_generation),
        ("max completion length", training_args.max_completion_length),
        ("top_p / top_k", f"{training_args.top_p} / {training_args.top_k}"),
        ("optimizer steps", training_args.max_steps if training_args.max_steps > 0 else "epochs"),
        ("lr schedule", f"{getattr(schedule, 'value', schedule)}, warmup {training_args.warmup_steps} steps"),
    ]
    text = "## Training recipe\n\nTrained with `examples/train_dapo_math.py` from dppo-trl.\n\n"
    text += "| setting | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in batch_rows) + "\n"
    if os.path.exists(os.path.join(training_args.output_dir, CURVES_FILE)):
        text += f"\n## Training curves\n\n![Reward and accuracy during training]({CURVES_FILE})\n"
    if eval_metrics:
        text += (
            "\n## Evaluation\n\nSampled at the training temperature; avg@k is the mean accuracy over k samples.\n\n"
        )
        text += "| metric | value |\n|---|---|\n"
        text += "\n".join(f"| {k} | {v:.4f} |" for k, v in sorted(eval_metrics.items())) + "\n"
    return text


def attach_recipe_to_model_card(trainer, section_fn, dataset_name: str | None) -> None:
    """Make every model card this trainer writes (checkpoints, `push_to_hub`) carry the recipe and eval section.

    The trainer's own `create_model_card` (TRL's template + DPPO provenance, tags, citation and settings) runs first;
    the section is appended to the README it wrote. `dataset_name` becomes the card's dataset when none is given.
    """
    original = trainer.create_model_card
    default_dataset = dataset_name

    def create_model_card(model_name=None, dataset_name=None, tags=None):
        original(model_name=model_name, dataset_name=dataset_name or default_dataset, tags=tags)
        path = os.path.join(trainer.args.output_dir, "README.md")
        if trainer.is_world_process_zero() and os.path.exists(path):
            with open(path, "a", encoding="utf-8") as card:
                card.write("\n" + section_fn())

    trainer.create_model_card = create_model_card
