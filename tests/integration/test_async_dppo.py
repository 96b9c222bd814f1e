"""Asynchronous DPPO (`AsyncDPPOTrainer` on TRL's experimental `AsyncGRPOTrainer`), for real on CPU, without a server.

The config's refusals; the loss seam's gradient against the parent's own loss (same normalisation); the tree-attention
choice in the trainer; the sampling version through TRL's own queue dataset, planner and collator into the loss; the
model card; the policy version on two real ranks. The runs against a real vLLM server are in test_async_server.py,
which imports this module's builders.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import get_free_port
from datasets import Dataset
from trainer_setup import PROMPTS, byte_mean_reward

from dppo_trl.backends.cpu.async_cpu import FileWeightTransfer, cpu_peak_flops, cpu_tree_attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MODEL = os.path.join(ROOT, "examples", "tiny_math_model")
SERVER_START_TIMEOUT = 900
FRESH_MISMATCH = 1e-4  # |π − μ| of an up-to-date sample, fp32 on both sides


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------


def _config(tmp_path, **overrides):
    from dppo_trl import AsyncDPPOConfig

    values = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        logging_steps=1,
        token_budget=0,
        vllm_server_timeout=SERVER_START_TIMEOUT,
    )
    values.update(overrides)
    return AsyncDPPOConfig(**values)


def test_config_shares_dppo_fields_and_validation(tmp_path):
    from dppo_trl import DPPOConfig

    config = _config(tmp_path, divergence="binary_kl")
    assert (config.delta_low, config.delta_high, config.ratio_cap) == (0.05, 0.05, DPPOConfig.ratio_cap)
    for field in ("divergence", "delta_low", "ratio_cap", "mu_kl_coef", "trust_region"):
        assert config.__dataclass_fields__[field].metadata == DPPOConfig.__dataclass_fields__[field].metadata
    with pytest.raises(ValueError, match="ratio_cap must be finite"):
        _config(tmp_path, ratio_cap=0.5)
    assert (
        _config(tmp_path, divergence="topk_tv", divergence_top_k=5).trust_region_spec().uses_top_k
    )  # top-K runs asynchronously too
    with pytest.raises(ValueError, match="anchor='behavior'"):
        _config(tmp_path, anchor="recompute")
    with pytest.raises(ValueError, match="needs π_old"):
        _config(tmp_path, trust_region="minirl")


# ---------------------------------------------------------------------------------------------------------------------
# The loss seam against the parent's own loss
# ---------------------------------------------------------------------------------------------------------------------


def _tokenizer():
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    # TRL's rollout worker parses responses with a response template; the tiny model's ChatML template is not one TRL
    # recognises, and its plain-text answers parse the same under Qwen3's.
    tokenizer.response_template = qwen3_template
    return tokenizer


def _dataset() -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})


def _batch(trainer, versions: list[int]):
    from trl.experimental.async_grpo.packing import TreeRow

    from dppo_trl.trainers.async_dppo_trainer import SampleMetrics, SampleVersionCollator

    torch.manual_seed(0)
    row = TreeRow()
    for i, version in enumerate(versions):
        ids = torch.tensor([5, 6, 7, 8 + i, 9 + i, 10 + i])
        row.add(
            {
                "input_ids": ids,
                "completion_mask": torch.tensor([0, 0, 0, 1, 1, 1]),
                "old_log_probs": torch.tensor([0.0, 0.0, 0.0, -4.0, -5.5, -3.0]) + 0.3 * i,
                "advantage": [1.0, -1.0, 0.5][i % 3],
                "group_id": i,
                "metrics": SampleMetrics({}, model_version=version),
            }
        )
    return SampleVersionCollator(trainer.processing_class.pad_token_id)([[row]])


class _Recorder:
    """Records each loss call's (π, μ, staleness): the `LossInputs` the trainer builds (`_loss_inputs`)."""

    def __init__(self):
        self.calls = []


def _recording_trainer(recorder: _Recorder):
    from dppo_trl import AsyncDPPOTrainer

    class RecordingTrainer(AsyncDPPOTrainer):
        def _loss_inputs(self, inputs, forward):
            loss_inputs = super()._loss_inputs(inputs, forward)
            recorder.calls.append(
                (loss_inputs.pi_logps.detach().clone(), loss_inputs.mu_logps.clone(), loss_inputs.staleness.clone())
            )
            return loss_inputs

    return RecordingTrainer


def _grad(trainer, compute, batch) -> torch.Tensor:
    trainer.model.zero_grad()
    with cpu_tree_attention():
        loss = compute(trainer.model, dict(batch))
    loss.backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def test_loss_seam_gradient_matches_parent(tmp_path):
    """With `trust_region='pg_is'` (w = π/μ) and the parent's clip opened, DPPO's term and the parent's PPO surrogate
    are the same function: equal gradients pin the seam and the normalisation. The staleness reaches the metrics."""
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    from dppo_trl import AsyncDPPOTrainer

    url = "http://127.0.0.1:1"  # never contacted: nothing here starts training
    ours = AsyncDPPOTrainer(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=_config(tmp_path / "a", trust_region="pg_is", vllm_server_base_url=url, max_staleness=3),
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
    )
    parent_args = AsyncGRPOConfig(
        **{k: v for k, v in _config(tmp_path / "b").to_dict().items() if k in AsyncGRPOConfig.__dataclass_fields__}
    )
    parent_args.output_dir, parent_args.epsilon, parent_args.epsilon_high = str(tmp_path / "b"), 1e9, 1e9
    with cpu_peak_flops():
        parent = AsyncGRPOTrainer(
            model=TINY_MODEL,
            reward_funcs=byte_mean_reward,
            args=parent_args,
            train_dataset=_dataset(),
            processing_class=_tokenizer(),
            weight_transfer=FileWeightTransfer(VLLMClient(url)),
        )
    parent.model.load_state_dict(ours.model.state_dict())
    ours.model_version = 3
    # Set by the training loop; 2 checks the accumulation scaling too.
    ours.current_gradient_accumulation_steps = parent.current_gradient_accumulation_steps = 2
    batch = _batch(ours, versions=[3, 2, 0])
    grad_ours = _grad(ours, ours.compute_loss, batch)
    grad_parent = _grad(parent, parent.compute_loss, {k: v for k, v in batch.items() if k != "dppo_sample_version"})
    torch.testing.assert_close(grad_ours, grad_parent, atol=1e-6, rtol=1e-4)
    metrics = ours._metrics["train"]
    assert {"dppo/staleness_0/mask_ratio", "dppo/staleness_1/mask_ratio", "dppo/staleness_3/mask_ratio"} <= set(
        metrics
    )
    assert "dppo/staleness_2/mask_ratio" not in metrics
    assert not any(key.startswith("clip_ratio/") for key in metrics)


# ---------------------------------------------------------------------------------------------------------------------
# The tree-attention choice in the trainer
# ---------------------------------------------------------------------------------------------------------------------


def _trainer(tmp_path, **overrides):
    from dppo_trl import AsyncDPPOTrainer

    return AsyncDPPOTrainer(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=_config(tmp_path, vllm_server_base_url="http://127.0.0.1:1", **overrides),  # never contacted
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
    )


def _step_gradient(trainer, batch) -> torch.Tensor:
    """One `training_step` (TRL's: forward, backward) from zero gradients, under gradient checkpointing."""
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    trainer.training_step(trainer.model, dict(batch), None)
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def test_default_tree_attention_on_cpu_trains_like_the_reference_under_gradient_checkpointing(tmp_path, caplog):
    """The default ("auto") on CPU is SDPA, said in exactly one log line; a training step with gradient checkpointing
    (whose backward reruns the forward, outside the loss) gives the gradient of the float32 plain-PyTorch attention,
    and TRL's FA3 registration is back afterwards."""
    from transformers import AttentionInterface
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, tree_attention

    from dppo_trl.kernels.tree_attention import tree_attention_sdpa

    with caplog.at_level("INFO", logger="dppo_trl.trainers.async_dppo_trainer"):
        ours = _trainer(tmp_path / "sdpa", gradient_checkpointing=True)
    lines = [r.getMessage() for r in caplog.records if "Tree attention" in r.getMessage()]
    assert lines == ["Tree attention: sdpa (tree_attention='auto': FlashAttention-3 needs a CUDA device, not cpu)."]
    assert ours.tree_attention_choice.function is tree_attention_sdpa
    reference = _trainer(tmp_path / "eager", gradient_checkpointing=True, tree_attention="eager")
    reference.model.load_state_dict(ours.model.state_dict())
    for trainer in (ours, reference):
        trainer.model.gradient_checkpointing_enable()  # as Trainer.train does for `gradient_checkpointing=True`
        assert trainer.model.is_gradient_checkpointing
    batch = _batch(ours, versions=[0, 0, 0])
    grad_ours, grad_reference = _step_gradient(ours, batch), _step_gradient(reference, batch)
    assert grad_ours.abs().max() > 0
    torch.testing.assert_close(grad_ours, grad_reference, atol=1e-6, rtol=1e-4)
    assert AttentionInterface._global_mapping[TREE_ATTENTION] is tree_attention


def test_explicit_fa3_that_cannot_run_fails_before_the_model_is_built(tmp_path):
    """No CUDA here, so TRL's kernel cannot run: the error names the fix, and comes before the model is loaded (the
    model path does not exist, and that is not what fails)."""
    from dppo_trl import AsyncDPPOTrainer

    with pytest.raises(RuntimeError, match=r"tree_attention='fa3' cannot run: .*To fix: install the `kernels`"):
        AsyncDPPOTrainer(
            model=str(tmp_path / "no-such-model"),
            reward_funcs=byte_mean_reward,
            args=_config(tmp_path, tree_attention="fa3", vllm_server_base_url="http://127.0.0.1:1"),
            train_dataset=_dataset(),
        )


# ---------------------------------------------------------------------------------------------------------------------
# The sampling version: queue → TRL's dataset and planner → collator → loss, with TRL's own classes
# ---------------------------------------------------------------------------------------------------------------------


class _QueueWorker:
    """An in-process rollout worker (TRL's `RolloutWorkerProtocol`, the documented way to inject one): the test puts
    `RolloutSample`s on its `rollout_buffer`. Reading `check_health` (TRL's dataloader construction does) records which
    classes TRL's module names point to at that moment."""

    def __init__(self):
        import queue

        self.rollout_buffer = queue.Queue()
        self.metrics_queue = queue.Queue()
        self.symbols_seen: list[tuple[type, type]] = []

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        pass

    @property
    def check_health(self):
        from trl.experimental.async_grpo import async_grpo_trainer

        self.symbols_seen.append((async_grpo_trainer.RolloutQueueDataset, async_grpo_trainer.DataCollatorForRollout))
        return lambda stale_after_s: None


def _rollout_sample(version: int, index: int, advantage: float):
    import numpy as np
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    ids = np.array([5, 6, 7, 8 + index, 9 + index, 10 + index])
    return RolloutSample(
        prompt=[],
        completion=[],
        input_ids=ids,
        completion_mask=np.array([0, 0, 0, 1, 1, 1]),
        old_log_probs=np.array([0.0, 0.0, 0.0, -4.0, -5.5, -3.0]) + 0.1 * index,
        advantage=advantage,
        model_version=version,
        group_id=index,
        metrics={"reward": float(index)},
    )


def test_sample_version_reaches_the_loss_through_trls_classes(tmp_path):
    """No TRL module name is swapped while the dataloader is built; the dataset, planner and collator are TRL's
    classes (the collator a subclass built explicitly); each sample's version reaches the batch and the loss's
    staleness, and not TRL's aggregated metrics."""
    from trl.experimental.async_grpo import async_grpo_trainer
    from trl.experimental.async_grpo.async_grpo_trainer import (
        DataCollatorForRollout,
        FixedCountBatcher,
        RolloutQueueDataset,
    )

    from dppo_trl.trainers.async_dppo_trainer import SAMPLE_VERSION, SampleVersionCollator, SampleVersionQueue

    recorder = _Recorder()
    worker = _QueueWorker()
    trainer = _recording_trainer(recorder)(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=_config(tmp_path, vllm_server_base_url="http://127.0.0.1:1", max_staleness=3),
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
        rollout_worker=worker,
    )
    trainer.model_version = 3
    trainer.current_gradient_accumulation_steps = 1
    # Two micro-batches of 4 (accelerate fetches one ahead). The advantage encodes the version (A = version + 0.5):
    # it travels TRL's own path into the batch, the version travels DPPO's.
    versions = [3, 2, 0, 1, 3, 3, 2, 3]
    for i, version in enumerate(versions):
        worker.rollout_buffer.put(_rollout_sample(version, i, advantage=version + 0.5))

    loader = trainer.get_train_dataloader()
    assert worker.symbols_seen == [(RolloutQueueDataset, DataCollatorForRollout)]
    assert async_grpo_trainer.RolloutQueueDataset is RolloutQueueDataset
    assert async_grpo_trainer.DataCollatorForRollout is DataCollatorForRollout
    assert type(loader.dataset) is FixedCountBatcher
    assert type(loader.dataset.dataset) is RolloutQueueDataset
    assert type(loader.dataset.dataset.queue) is SampleVersionQueue
    assert loader.dataset.dataset.queue.queue is trainer.rollout_queue
    assert type(loader.collate_fn) is SampleVersionCollator

    batch = next(iter(loader))
    assert sorted(batch[SAMPLE_VERSION].flatten().tolist()) == sorted(versions[:4])
    metrics = trainer._metrics["train"]
    assert "reward" in metrics  # TRL aggregated the samples' own metrics ...
    assert not any("version" in key for key in metrics)  # ... and nothing of the version

    loss = trainer.compute_loss(trainer.model, batch)
    assert torch.isfinite(loss)
    (call,) = recorder.calls
    _, _, staleness = call
    selected = batch["token_index"] >= 0
    version_of_token = batch["advantages"][selected] - 0.5
    assert torch.equal(staleness, (3 - version_of_token).long())
    assert set(staleness.tolist()) == {0, 1, 2, 3}
    assert {f"dppo/staleness_{s}/mask_ratio" for s in range(4)} <= set(metrics)


def test_async_model_card_carries_provenance_and_dppo_settings(tmp_path):
    """The card `create_model_card` saves (and `push_to_hub` uploads) is written by the hardening DPPOTrainer uses:
    DPPO's tags, citation and settings, the base model and data named honestly (no `None`, no absolute path), the
    quick start in the model's prompt format, and the dppo-trl / vLLM versions."""
    from pathlib import Path

    import yaml

    import dppo_trl

    out = tmp_path / "tiny-async-dppo"
    trainer = _recording_trainer(_Recorder())(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=_config(out, vllm_server_base_url="http://127.0.0.1:1", max_staleness=3, divergence="binary_kl"),
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
        rollout_worker=_QueueWorker(),
    )
    trainer.create_model_card(dataset_name=str(tmp_path / "data" / "train.jsonl"), tags=["math"])
    card = (Path(out) / "README.md").read_text(encoding="utf-8")
    header = yaml.safe_load(card.split("---")[1])
    assert {"dppo", "dppo-binary-kl", "async-grpo", "trl", "math"} <= set(header["tags"])
    assert "base_model" not in header and "datasets" not in header  # local model and data: nothing to link to
    assert "fine-tuned version of the local model `tiny_math_model` on the local dataset `train.jsonl`." in card
    assert "None" not in card and str(tmp_path) not in card and ROOT not in card
    assert "qi2026rethinking" in card and "AsyncDPPO" in card
    assert 'model="tiny-async-dppo"' in card and "max_new_tokens=8" in card
    versions = card.split("### Framework versions")[1].split("##")[0]
    assert f"- dppo-trl: {dppo_trl.__version__}" in versions and "(server mode)" in versions
    section = card.split("## DPPO configuration")[1]
    for row in ("| divergence | binary_kl |", "| anchor | behavior |", "| max_staleness | 3 |"):
        assert row in section, row
    assert "| generation | vLLM (server, asynchronous) |" in section


def test_trainers_patch_no_module_symbols():
    """The trainer adapters use no `unittest.mock` and assign no attribute of an imported module (the CPU peak-FLOPs
    lookup, `dppo_trl.backends.cpu.async_cpu.cpu_peak_flops`, is outside this check: see docs/upstream.md)."""
    import ast

    trainers = os.path.join(ROOT, "dppo_trl", "trainers")
    for name in sorted(os.listdir(trainers)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(trainers, name)).read())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
                assert all("mock" not in alias.name for alias in node.names), name
            if isinstance(node, ast.ImportFrom):
                assert "mock" not in (node.module or "") and all(a.name != "mock" for a in node.names), name
                modules |= {alias.asname or alias.name for alias in node.names if alias.name.islower()}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    assert target.value.id not in modules - {"self"}, (
                        f"{name}: assigns {target.value.id}.{target.attr}"
                    )


def test_policy_version_is_read_once_per_step_on_every_rank(tmp_path):
    """Two real processes (torchrun, gloo): every rank gets the main process's `model_version`, read once per
    optimizer step (a change within the step is not seen; the next step's read sees it)."""
    import json

    port = str(get_free_port())
    script = os.path.join(ROOT, "tests", "scripts", "async_policy_version.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port, script]
    command += ["--model", TINY_MODEL, "--out", str(tmp_path), "--watchdog", "540"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [r["world_size"] for r in results] == [2, 2]
    assert [r["versions"] for r in results] == [[5, 5, 6], [5, 5, 6]]


def test_async_recipe_parses_into_the_config(tmp_path):
    """The GPU recipe's options are all fields of the script's arguments or of AsyncDPPOConfig, and validate."""
    import yaml
    from train_dapo_math_async import AsyncScriptArguments

    from dppo_trl import AsyncDPPOConfig

    with open(os.path.join(ROOT, "examples", "recipes", "async", "qwen3_1.7b_base_dapo_math_async.yaml")) as f:
        recipe = yaml.safe_load(f)
    script_fields = set(AsyncScriptArguments.__dataclass_fields__)
    config_values = {k: v for k, v in recipe.items() if k not in script_fields}
    assert set(config_values) <= set(AsyncDPPOConfig.__dataclass_fields__)
    config_values.update(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    config = AsyncDPPOConfig(**config_values)
    assert (config.divergence, config.max_staleness, config.mu_kl_coef) == ("binary_tv", 4, 0.001)
