"""`dppo_trl.trainers.trl116.grpo.aggregate_per_token_loss` is GRPOTrainer's own aggregation, pinned against its real loss.

The μ-KL term (`DPPOConfig.mu_kl_coef`) is added after the parent's loss with this function, so it must normalise
exactly as `GRPOTrainer._compute_loss` normalises its policy term, for every supported `loss_type`, with gradient
accumulation, `steps_per_generation` and eval mode. On-policy (no `old_per_token_logps`), β = 0 and per-token
advantages `A`, the parent's per-token loss is exactly `−A`, so its loss is the aggregation of `−A`.
"""

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from dppo_dev.tiny_models import build_byte_tokenizer
from dppo_trl.trainers.config import SUPPORTED_LOSS_TYPES
from dppo_trl.trainers.trl116.grpo import aggregate_per_token_loss

MAX_LEN = 6


@pytest.fixture(scope="module")
def grpo_trainer(tiny_model_dir, tmp_path_factory):
    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("grpo")),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=MAX_LEN,
    )
    return GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+2="]}),
        processing_class=build_byte_tokenizer(),
    )


@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
@pytest.mark.parametrize(
    ("training", "accumulation", "steps_per_generation"), [(True, 1, 1), (True, 3, 2), (False, 3, 2)]
)
def test_aggregation_equals_grpo_trainers_loss(grpo_trainer, loss_type, training, accumulation, steps_per_generation):
    trainer = grpo_trainer
    trainer.loss_type = loss_type
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.args.steps_per_generation = steps_per_generation
    trainer.model.train(training)
    g = torch.Generator().manual_seed(0)
    batch = 4
    completion_mask = torch.ones(batch, MAX_LEN, dtype=torch.long)
    completion_mask[1, 3:] = 0
    completion_mask[2, 1:] = 0
    advantages = torch.randn(batch, MAX_LEN, generator=g)  # per-token: every token's weight is visible
    inputs = {
        "prompt_ids": torch.randint(0, 256, (batch, 3), generator=g),
        "prompt_mask": torch.ones(batch, 3, dtype=torch.long),
        "completion_ids": torch.randint(0, 256, (batch, MAX_LEN), generator=g),
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": torch.tensor(37.0),  # a generation batch larger than this micro-batch
    }
    with torch.no_grad():
        got = trainer._compute_loss(trainer.model, inputs)
    want = aggregate_per_token_loss(
        -advantages,
        completion_mask,
        loss_type,
        max_completion_length=trainer.max_completion_length,
        num_items_in_batch=inputs["num_items_in_batch"],
        num_processes=trainer.accelerator.num_processes,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps_per_generation,
        training=training,
    )
    assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
