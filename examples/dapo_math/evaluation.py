"""Periodic avg@k evaluation on math benchmarks (AIME 2024/2025 style) during GRPO/DPPO training.

`MathEvalCallback` samples `k` completions per problem at the training sampling settings, scores them with a rule
reward (`accuracy_reward` by default) and logs, through the trainer's own `log`, one metric per benchmark:

- `eval/<name>/avg@<k>`: mean accuracy over all problems and samples (the paper's AIME metric is avg@32);
- `eval/<name>/pass@<k>`: fraction of problems solved by at least one sample;
- `eval/<name>/mean_length`: mean completion length in tokens.

Generation reuses the trainer's vLLM engine (`trainer.vllm_generation`, colocate or server) when it has one, so the
evaluation sees the exact sampler RL sees; otherwise it uses `generate` on the unwrapped policy.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import Trainer, TrainerCallback

from dapo_math.rewards import accuracy_reward

__all__ = ["MathEvalCallback"]


class MathEvalCallback(TrainerCallback):
    """Evaluate avg@k on one or more `prompt`/`ground_truth` datasets every `eval_steps` optimizer steps.

    Args:
        trainer: the `GRPOTrainer`/`DPPOTrainer` to evaluate; the callback registers nothing itself, call
            `trainer.add_callback(callback)`.
        datasets: `{name: Dataset}`, e.g. `{"aime24": load_aime("aime24")}`; rows need `prompt` and `ground_truth`.
        num_samples: `k`, completions per problem.
        eval_steps: evaluate when `global_step % eval_steps == 0`; `None` or 0 evaluates only at the start/end.
        eval_on_start: also evaluate before the first step (the baseline of the curve).
        eval_on_end: also evaluate after the last step (unless that step was just evaluated).
        reward_func: `(completions, ground_truth, **kw) -> list[float]`, 1.0 = correct.
        batch_size: prompts per `generate` call on the HF path (vLLM takes everything at once).
        generation_config: sampling settings of the HF path; default: the trainer's own (`GRPOTrainer` has one; a
            trainer without one, such as `AsyncDPPOTrainer`, must pass it).
        generation_attn_implementation: attention used while the HF path generates, restored afterwards
            (`AsyncDPPOTrainer` trains with packed tree attention, which cannot run `generate`); default: the model's.
    """

    def __init__(
        self,
        trainer,
        datasets: Mapping[str, Dataset],
        num_samples: int = 4,
        eval_steps: int | None = None,
        eval_on_start: bool = True,
        eval_on_end: bool = True,
        reward_func: Callable[..., list[float]] = accuracy_reward,
        batch_size: int = 64,
        generation_config=None,
        generation_attn_implementation: str | None = None,
    ):
        self.trainer = trainer
        self.datasets = dict(datasets)
        self.num_samples = num_samples
        self.eval_steps = eval_steps
        self.eval_on_start = eval_on_start
        self.eval_on_end = eval_on_end
        self.reward_func = reward_func
        self.batch_size = batch_size
        self.generation_config = generation_config
        self.generation_attn_implementation = generation_attn_implementation
        self.history: list[dict] = []  # every evaluation, with its step
        self._last_eval_step: int | None = None

    @property
    def latest(self) -> dict[str, float]:
        """Metrics of the most recent evaluation (empty before the first one)."""
        return {k: v for k, v in self.history[-1].items() if k != "step"} if self.history else {}

    # --- TrainerCallback hooks -------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if self.eval_on_start:
            self.evaluate()

    def on_step_end(self, args, state, control, **kwargs):
        if self.eval_steps and state.global_step % self.eval_steps == 0:
            self.evaluate()

    def on_train_end(self, args, state, control, **kwargs):
        if self.eval_on_end and self._last_eval_step != state.global_step:
            self.evaluate()

    # --- evaluation ------------------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Run every benchmark now, log the metrics through the trainer and return them."""
        trainer = self.trainer
        model = trainer.model
        was_training = model.training
        metrics: dict[str, float] = {}
        model.eval()  # no dropout while sampling
        try:
            for name, dataset in self.datasets.items():
                metrics.update(self._evaluate_dataset(name, dataset))
        finally:
            model.train(was_training)
        step = trainer.state.global_step
        self._last_eval_step = step
        self.history.append({"step": step, **metrics})
        # Through the base Trainer: GRPOTrainer.log would also flush (and clear) the train metrics it is averaging
        # until the next logging step, and re-print its completion samples. Logging resets `should_log`, which
        # would swallow a train log due at this very step, so it is restored.
        should_log = trainer.control.should_log
        Trainer.log(trainer, dict(metrics))
        trainer.control.should_log = should_log
        return metrics

    def _evaluate_dataset(self, name: str, dataset: Dataset) -> dict[str, float]:
        trainer = self.trainer
        accelerator = trainer.accelerator
        k = self.num_samples
        n = len(dataset)
        # Equal-sized shards per process (padded with row 0): vLLM server mode and gathers expect the same count.
        per_rank = math.ceil(n / accelerator.num_processes)
        start = accelerator.process_index * per_rank
        indices = [i if i < n else 0 for i in range(start, start + per_rank)]
        valid = [i < n for i in range(start, start + per_rank)]
        rows = dataset.select(indices) if indices else dataset.select([])
        prompts, truths = list(rows["prompt"]), list(rows["ground_truth"])

        completions, lengths = self._generate(prompts, k)
        rewards = self.reward_func(
            completions=completions, ground_truth=[t for t in truths for _ in range(k)], prompts=None
        )
        local = [
            (sum(rewards[j * k : (j + 1) * k]), max(rewards[j * k : (j + 1) * k]), sum(lengths[j * k : (j + 1) * k]))
            for j in range(len(prompts))
            if valid[j]
        ]
        results = gather_object(local) if accelerator.num_processes > 1 else local
        total = max(len(results), 1)
        return {
            f"eval/{name}/avg@{k}": sum(r[0] for r in results) / (total * k),
            f"eval/{name}/pass@{k}": sum(1.0 for r in results if r[1] > 0) / total,
            f"eval/{name}/mean_length": sum(r[2] for r in results) / (total * k),
        }

    def _prompt_ids(self, prompts: list) -> list[list[int]]:
        tokenizer = getattr(self.trainer.processing_class, "tokenizer", self.trainer.processing_class)
        template_kwargs = getattr(self.trainer.args, "chat_template_kwargs", None) or {}
        ids = []
        for prompt in prompts:
            if isinstance(prompt, str):
                text = prompt
            else:
                text = tokenizer.apply_chat_template(
                    prompt, add_generation_prompt=True, tokenize=False, **template_kwargs
                )
            ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids

    def _generate(self, prompts: list, k: int) -> tuple[list, list[int]]:
        """k completions per prompt (prompt-major), as conversational messages if prompts are, plus token lengths."""
        trainer = self.trainer
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        prompt_ids = self._prompt_ids(prompts)
        vllm_generation = getattr(trainer, "vllm_generation", None) if getattr(trainer, "use_vllm", False) else None
        if vllm_generation is not None:
            completion_ids = self._generate_vllm(vllm_generation, prompt_ids, k)
        else:
            completion_ids = self._generate_hf(prompt_ids, k)
        eos_ids = set(getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id])
        cleaned = []
        for ids in completion_ids:
            ids = list(ids)
            cut = next((i for i, t in enumerate(ids) if t in eos_ids), len(ids))
            cleaned.append(ids[:cut])
        texts = tokenizer.batch_decode(cleaned, skip_special_tokens=True)
        conversational = bool(prompts) and not isinstance(prompts[0], str)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        return completions, [len(ids) for ids in cleaned]

    def _generate_vllm(self, vllm_generation, prompt_ids: list[list[int]], k: int) -> list[list[int]]:
        trainer = self.trainer
        # Training syncs weights lazily right before its next generation; evaluate the current weights instead.
        if trainer.state.global_step != getattr(trainer, "_last_loaded_step", None):
            vllm_generation.sync_weights()
            trainer._last_loaded_step = trainer.state.global_step
        # TRL's prompt-repetition contract (the one its own training batches follow): the caller repeats each prompt
        # `num_generations` times. Colocate samples once per entry; server mode keeps every k-th entry and asks the
        # server for k samples of each. Either way the result is k completions per problem, prompt-major.
        repeated = [ids for ids in prompt_ids for _ in range(k)]
        _, completion_ids, _, _ = vllm_generation.generate(prompts=repeated, images=None, num_generations=k)
        if len(completion_ids) != len(repeated):
            raise RuntimeError(
                f"vLLM returned {len(completion_ids)} completions for {len(prompt_ids)} problems x {k} samples; TRL's "
                "`VLLMGeneration.generate` contract changed (see tests/trl_contract.py)."
            )
        return [list(c) for c in completion_ids]

    @torch.no_grad()
    def _generate_hf(self, prompt_ids: list[list[int]], k: int) -> list[list[int]]:
        from trl.models import unwrap_model_for_generation

        trainer = self.trainer
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        generation_config = self.generation_config or getattr(trainer, "generation_config", None)
        expanded = [ids for ids in prompt_ids for _ in range(k)]
        outputs: list[list[int]] = []
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=getattr(trainer.args, "ds3_gather_for_generation", True),
            ) as unwrapped,
            _attention(unwrapped, self.generation_attn_implementation),
        ):
            device = next(unwrapped.parameters()).device
            for i in range(0, len(expanded), self.batch_size * k):
                chunk = expanded[i : i + self.batch_size * k]
                width = max(len(ids) for ids in chunk)
                input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(ids)) + ids for ids in chunk])
                attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk])
                out = unwrapped.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    generation_config=generation_config,
                )
                outputs += out[:, width:].cpu().tolist()
        return outputs


@contextlib.contextmanager
def _attention(model, implementation: str | None):
    """`model` with `implementation` as its attention for the block (`None`: unchanged), then its own again."""
    previous = model.config._attn_implementation
    if implementation is None or implementation == previous:
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def load_eval_sets(specs: list[str], split: str = "train", max_samples: int | None = None) -> dict[str, Dataset]:
    """`{name: Dataset}` from `--math_eval_datasets` entries (`aime24`, `name=source` or a plain source)."""
    import os

    from dapo_math.data import AIME_DATASETS, load_aime

    if [s.lower() for s in specs] == ["none"]:
        return {}
    eval_sets = {}
    for spec in specs:
        name, source = spec.split("=", 1) if "=" in spec else (spec, spec)
        if name == source and name not in AIME_DATASETS:
            name = os.path.splitext(os.path.basename(source.rstrip("/")))[0] or source
        eval_sets[name] = load_aime(source, split=split, max_samples=max_samples)
    return eval_sets


def async_eval_callback(trainer, datasets: Mapping[str, Dataset], num_samples: int, args) -> MathEvalCallback:
    """avg@k for an `AsyncDPPOTrainer`, before and after training, sampled as training samples.

    The trained policy generates with transformers (so the server's lag does not enter the score), with packed tree
    attention swapped for SDPA while it does.
    """
    from transformers import GenerationConfig

    tokenizer = trainer.processing_class
    generation_config = GenerationConfig(
        max_new_tokens=args.max_completion_length,
        do_sample=True,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return MathEvalCallback(
        trainer,
        datasets,
        num_samples=num_samples,
        generation_config=generation_config,
        generation_attn_implementation="sdpa",
    )
