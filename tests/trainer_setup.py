"""Builders shared by the end-to-end trainer tests: a tiny prompt set, a reward with signal, a small DPPOConfig."""

from __future__ import annotations

import json
import os

import torch
from datasets import Dataset

from dppo_dev.tiny_models import build_byte_tokenizer
from dppo_trl import DPPOConfig, DPPOTrainer

PROMPTS = ["1+1=", "2+3=", "4+4=", "5+1=", "7+2=", "3+3=", "6+2=", "8+1="]


def ascii_reward(completions, **kwargs) -> list[float]:
    """Fraction of ASCII characters: a random byte-level model gets varied rewards, so advantages are non-zero."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(ord(ch) < 128 for ch in t) / max(len(t), 1) for t in texts]


def byte_mean_reward(completions, **kwargs) -> list[float]:
    """Mean byte value: continuous, so even a model whose completions are all ASCII (the bundled tiny math model) gets
    rewards that differ within a group, hence non-zero advantages and a moving policy."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(t.encode()) / (255.0 * max(len(t.encode()), 1)) for t in texts]


def prompt_dataset(conversational: bool = False) -> Dataset:
    if conversational:
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    return Dataset.from_dict({"prompt": PROMPTS})


def math_prompt_dataset(n: int = 8) -> Dataset:
    """The bundled tiny math model's own kind of prompt (examples/data/tiny_math, its chat template): questions it
    answers in a few dozen tokens from a peaked distribution, so truncated sampling keeps few tokens."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "data", "tiny_math")
    with open(os.path.join(path, "train.jsonl")) as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    return Dataset.from_dict({"prompt": [row["prompt"] for row in rows]})


def small_config(output_dir, **overrides) -> DPPOConfig:
    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        seed=0,
        # Every trainer test checks each weight sync and fails if one trips: a clean run never does.
        sync_mismatch_action="raise",
    )
    values.update(overrides)
    return DPPOConfig(**values)


def make_trainer(
    model, output_dir, peft_config=None, dataset=None, eval_dataset=None, reward_funcs=ascii_reward, **config
) -> DPPOTrainer:
    return DPPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=small_config(output_dir, **config),
        train_dataset=dataset if dataset is not None else prompt_dataset(),
        eval_dataset=eval_dataset,
        processing_class=build_byte_tokenizer(),
        peft_config=peft_config,
    )


def snapshot_trainable(trainer: DPPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def changed_parameters(trainer: DPPOTrainer, before: dict[str, torch.Tensor]) -> list[str]:
    params = dict(trainer.model.named_parameters())
    return [n for n, old in before.items() if not torch.equal(params[n].detach(), old)]


def logged(trainer: DPPOTrainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def record_first_generation(trainer: DPPOTrainer) -> list:
    """Records the first generation batch with the trainer's own log-softmax at its completion tokens, taken before
    the first update (the engine's weights are then the trainer's): `[(output, logp)]` once `train()` has run."""
    original = trainer._generate_and_score_completions
    first: list = []

    def generate_and_score(inputs):
        output = original(inputs)
        if not first:
            with torch.no_grad():
                ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
                attn = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
                width = output["completion_ids"].size(1)
                logits = trainer.model(input_ids=ids, attention_mask=attn).logits[:, -width - 1 : -1].float()
            first.append((output, torch.log_softmax(logits, -1)))
        return output

    trainer._generate_and_score_completions = generate_and_score
    return first


def frozen_base_changes(model, checkpoint: str) -> tuple[list[str], int]:
    """A PEFT model's frozen tensors (everything but its adapters, `modules_to_save` copies included) against the
    checkpoint loaded in the same dtype: `(names of those that differ, number compared)`. Names as vLLM knows them."""
    from transformers import AutoModelForCausalLM

    from dppo_trl.weights.stream import vllm_weight_name

    frozen = {}
    for raw, param in model.named_parameters():
        name = vllm_weight_name(raw, model.prefix)
        if name is not None and not param.requires_grad:
            frozen[name] = param.detach()
    dtype = next(iter(frozen.values())).dtype
    reference = dict(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).named_parameters())
    assert frozen.keys() <= reference.keys(), sorted(frozen.keys() - reference.keys())
    changed = [name for name, tensor in frozen.items() if not torch.equal(tensor.cpu(), reference[name].detach())]
    return changed, len(frozen)


def merged_reference(model, checkpoint: str) -> torch.nn.Module:
    """A PEFT model's merged weights as an fp32 engine holds them after a sync: PEFT's merge in float64, rounded once
    to the weights' dtype, loaded into the checkpoint's model computing in float32 (SDPA attention; buffers such as
    RoPE's frequencies are the checkpoint's own)."""
    import copy

    from transformers import AutoModelForCausalLM

    dtype = model.get_base_model().dtype
    merged = copy.deepcopy(model).to(torch.float64).merge_and_unload()
    weights = {name: param.detach().to(dtype).float() for name, param in merged.named_parameters()}
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa")
    missing, unexpected = reference.load_state_dict(weights, strict=False)
    assert not unexpected and all(name == "lm_head.weight" for name in missing), (missing, unexpected)
    return reference.eval()
