"""vLLM server mode on the CPU build, for real: `python -m dppo_trl.backends.cpu.vllm_server` in its own process, trainers on 1 and 2
ranks syncing weights through `dppo_trl.backends.cpu.weight_sync`'s file path, and the shrunk multi-node server recipe.

One server (the bundled tiny model, with an API key and `--max-logprobs 8`) serves the whole module: every trainer
pushes its own weights before its first generation (`_last_loaded_step = -1`), so runs do not leak into each other.
"""

import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
import requests
import torch
from conftest import get_free_port
from forward_count import count_generation_passes
from server_setup import (
    API_KEY,
    ROOT,
    SERVER_MAX_LOGPROBS,
    TINY_MODEL,
    Server,
    running_server,
    subprocess_env,
)
from trainer_setup import (
    byte_mean_reward,
    frozen_base_changes,
    logged,
    make_trainer,
    math_prompt_dataset,
    merged_reference,
)

from dppo_trl.trainers.dppo_trainer import BEHAVIOR_LOGPS, BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS, BEHAVIOR_VALID

SERVER_RECIPE = os.path.join(ROOT, "examples", "recipes", "qwen3_8b_base_dapo_math_server.yaml")
TRAIN_SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_vllm_server.py")
FRESH_MISMATCH = 1e-4  # |π − μ| right after a sync, fp32 on both sides


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    with running_server(str(tmp_path_factory.mktemp("vllm_server"))) as server:
        yield server


@pytest.fixture
def trainer_env(monkeypatch, tmp_path):
    """The trainer sends the server's key; weight files go to a private temp root the test can inspect."""
    monkeypatch.setenv("VLLM_API_KEY", API_KEY)
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _server_config(server: Server, **overrides) -> dict:
    values = dict(
        use_vllm=True,
        vllm_mode="server",
        vllm_server_host="127.0.0.1",
        vllm_server_port=server.port,
        vllm_server_timeout=30,
    )
    values.update(overrides)
    return values


def _spy_reloads(trainer) -> list:
    """Record, for every `/collective_rpc` reload, the weights path and whether the file existed at that moment."""
    client = trainer.vllm_generation.vllm_client
    original = client._post
    seen = []

    def post(url, **kwargs):
        if url.endswith("/collective_rpc"):
            path = kwargs["json"]["kwargs"]["weights_path"]
            seen.append((path, os.path.exists(os.path.join(path, "model.safetensors"))))
        return original(url, **kwargs)

    client._post = post
    return seen


def _spy_generation_batches(trainer) -> list:
    original = trainer._generate_and_score_completions
    batches = []

    def generate_and_score(inputs):
        output = original(inputs)
        batches.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in output.items()})
        return output

    trainer._generate_and_score_completions = generate_and_score
    return batches


def _fresh_and_stale(history: list[dict], steps_per_generation: int) -> tuple[list[float], list[float]]:
    """`dppo/mismatch_abs_max` at the first step of each generation batch, and at the later ones."""
    entries = [e for e in history if "dppo/mismatch_abs_max" in e]
    fresh = [e["dppo/mismatch_abs_max"] for e in entries if (e["step"] - 1) % steps_per_generation == 0]
    stale = [e["dppo/mismatch_abs_max"] for e in entries if (e["step"] - 1) % steps_per_generation != 0]
    return fresh, stale


def _assert_synced_and_moving(history: list[dict], steps_per_generation: int) -> None:
    fresh, stale = _fresh_and_stale(history, steps_per_generation)
    print(f"dppo/mismatch_abs_max fresh after sync {fresh}, between syncs {stale}")
    assert len(fresh) >= 2 and stale, history
    # Each generation starts from the trainer's current weights...
    assert max(fresh) <= FRESH_MISMATCH, fresh
    # ...although the policy moved away from the server's copy in between: without the sync the next fresh step
    # would see at least this much. The largest between-sync step shows it; any single one may barely move (a
    # micro-batch whose groups all share one reward has zero advantages: CI saw 8.9e-4 next to 0.82).
    assert max(stale) > 10 * FRESH_MISMATCH, stale
    # The weight-sync check (raising, `small_config`) ran at each generation's first step, and only there.
    for entry in (e for e in history if "dppo/mismatch_abs_max" in e):
        if (entry["step"] - 1) % steps_per_generation == 0:
            assert entry["dppo/sync_mismatch"] <= FRESH_MISMATCH, entry
        else:
            assert "dppo/sync_mismatch" not in entry, entry
    for key in ("loss", "dppo/mask_ratio", "dppo/divergence_mean", "dppo/ratio_max", "dppo/mismatch_abs_max"):
        values = [e[key] for e in history if key in e]
        assert values and all(math.isfinite(v) for v in values), key
    assert all(e.get("dppo/invalid_behavior_logps", 0) == 0 for e in history)


# --- the real server ------------------------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow
def test_server_serves_dppo_settings_and_guards_v1_with_the_key(server):
    info = requests.get(server.base_url + "/server_info", params={"config_format": "json"}, timeout=30).json()
    model_config = info["vllm_config"]["model_config"]
    assert model_config["logprobs_mode"] == "processed_logprobs"
    assert model_config["max_logprobs"] == SERVER_MAX_LOGPROBS
    assert model_config["dtype"] in ("float32", "torch.float32")
    assert requests.get(server.base_url + "/v1/models", timeout=30).status_code == 401
    ok = requests.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert ok.status_code == 200


@pytest.mark.vllm
@pytest.mark.slow
def test_check_vllm_server_rejects_k_above_max_logprobs(server, trainer_env, tmp_path):
    with pytest.raises(ValueError, match="--max-logprobs 8"):
        make_trainer(TINY_MODEL, tmp_path, divergence="topk_tv", divergence_top_k=16, **_server_config(server))


def _server_prompt_logprobs(server: Server, sequence: list[int], k: int) -> list[dict[int, float]]:
    """The server's own log-probs of every token of `sequence` given its prefix: `{token id: logprob}` per position,
    the token itself plus the top `k`."""
    model = requests.get(
        server.base_url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    ).json()["data"][0]["id"]
    body = {"model": model, "prompt": [sequence], "max_tokens": 1, "prompt_logprobs": k, "temperature": 1.0}
    choice = server.post("/v1/completions", json=body)["choices"][0]
    return [
        {int(tid): entry["logprob"] for tid, entry in position.items()} if position else {}
        for position in choice["prompt_logprobs"]
    ]


def _assert_mu_matches_server(server: Server, batch: dict, k: int | None) -> int:
    """μ of a generation batch (sampled token and, for top-K, the other K) against the server's own scoring."""
    checked = 0
    for row in range(batch["completion_ids"].size(0)):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        valid = batch["completion_mask"][row].bool() & batch[BEHAVIOR_VALID][row]
        completion = batch["completion_ids"][row][batch["completion_mask"][row].bool()].tolist()
        scored = _server_prompt_logprobs(server, prompt + completion, k or 0)[len(prompt) :]
        for t, token in enumerate(completion):
            if not valid[t]:
                continue
            assert batch[BEHAVIOR_LOGPS][row, t].item() == pytest.approx(scored[t][token], abs=FRESH_MISMATCH)
            if k:
                ids = batch[BEHAVIOR_TOPK_IDS][row, t, 1:].tolist()
                logps = batch[BEHAVIOR_TOPK_LOGPS][row, t, 1:].tolist()
                others = {tid: lp for tid, lp in scored[t].items() if tid != token}
                top_others = dict(sorted(others.items(), key=lambda item: -item[1])[:k])
                got = {tid: lp for tid, lp in zip(ids, logps) if tid >= 0}
                assert set(got) == set(top_others) or len(got) == len(top_others) - 1, (got, top_others)
                for tid, lp in got.items():
                    assert lp == pytest.approx(scored[t][tid], abs=FRESH_MISMATCH)
            checked += 1
    return checked


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("divergence", ["binary_tv", "topk_tv"])
def test_one_rank_trains_against_the_server(server, trainer_env, tmp_path, divergence):
    k = 4 if divergence.startswith("topk") else None
    trainer = make_trainer(
        TINY_MODEL,
        tmp_path,
        reward_funcs=byte_mean_reward,
        divergence=divergence,
        divergence_top_k=k or 20,
        max_steps=4,
        steps_per_generation=2,
        **_server_config(server),
    )
    client = trainer.vllm_generation.vllm_client
    assert type(client).__name__ == "CPUWeightSyncVLLMClient" and client.file_sync
    assert client.communicator is None  # no NCCL group on a CPU trainer
    reloads = _spy_reloads(trainer)
    batches = _spy_generation_batches(trainer)
    trainer.train()

    _assert_synced_and_moving(trainer.state.log_history, steps_per_generation=2)
    # One reload per generation, each from a file that existed then, in a fresh directory removed afterwards.
    assert len(reloads) == len(batches) == 2 and all(existed for _, existed in reloads)
    assert len({path for path, _ in reloads}) == 2
    assert all(os.path.dirname(path) == str(trainer_env) for path, _ in reloads)
    assert os.listdir(trainer_env) == []
    # The server still holds the weights of the last generation (syncs happen only before generating): μ as the
    # trainer received it over HTTP is what the server itself computes for the same tokens.
    assert _assert_mu_matches_server(server, batches[-1], k) > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_lora_in_bf16_reaches_the_server_merged_and_leaves_the_base(server, trainer_env, tmp_path):
    """LoRA on bf16 weights: every file sync (one per step, and one more after training) carries the adapter merged
    out of place, so the frozen base is the checkpoint's bit for bit, and the (fp32) server then holds the trained
    model's merged weights rounded once to bf16."""
    from peft import LoraConfig

    trainer = make_trainer(
        TINY_MODEL,
        tmp_path,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        reward_funcs=byte_mean_reward,
        max_steps=2,
        bf16=True,
        model_init_kwargs={"dtype": "bfloat16"},
        **_server_config(server),
    )
    reloads = _spy_reloads(trainer)
    trainer.train()
    trainer.vllm_generation.sync_weights()
    assert trainer._merges_lora_out_of_place and len(reloads) == 3
    assert frozen_base_changes(trainer.model, TINY_MODEL)[0] == []
    sequence = trainer.processing_class("What is 2+3? The answer is 5.")["input_ids"]
    scored = _server_prompt_logprobs(server, sequence, 0)
    with torch.no_grad():
        logps = torch.log_softmax(merged_reference(trainer.model, TINY_MODEL)(torch.tensor([sequence])).logits[0], -1)
    errors = [abs(scored[t][sequence[t]] - logps[t - 1, sequence[t]].item()) for t in range(1, len(sequence))]
    assert max(errors) <= FRESH_MISMATCH, errors


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("divergence", ["binary_tv", "topk_tv"])
def test_server_mu_needs_no_policy_pass(server, trainer_env, tmp_path, divergence):
    """spg 2 > GA 1 and num_iterations 2: TRL would recompute π_old while generating; DPPO anchors on μ instead."""
    trainer = make_trainer(
        TINY_MODEL,
        tmp_path,
        divergence=divergence,
        divergence_top_k=4,
        max_steps=2,
        steps_per_generation=2,
        num_iterations=2,
        **_server_config(server),
    )
    with count_generation_passes() as passes:
        trainer.train()
    assert passes.batches == [[]]  # one generation batch (it serves spg · num_iterations = 4 steps), no pass
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


@pytest.mark.vllm
@pytest.mark.slow
def test_truncated_sampling_compares_pi_over_the_servers_kept_set(server, trainer_env, tmp_path):
    """top_p < 1 in server mode: the kept set comes from the server's lists (N ≤ `--max-logprobs`); a fresh
    rollout's |π_kept − μ| is rounding, the full-softmax |π − μ| is not. An N above the server's limit is refused."""
    with pytest.raises(ValueError, match=f"than the vLLM server's `--max-logprobs {SERVER_MAX_LOGPROBS}`"):
        make_trainer(TINY_MODEL, tmp_path, top_p=0.95, **_server_config(server))  # N defaults to 64
    trainer = make_trainer(
        TINY_MODEL,
        tmp_path,
        dataset=math_prompt_dataset(),
        top_p=0.95,
        kept_set_logprobs=SERVER_MAX_LOGPROBS,
        max_steps=1,
        max_completion_length=32,
        **_server_config(server),
    )
    records = []
    trainer.trust_region_observers.append(records.append)
    trainer.train()
    counted = records[0]["valid"]
    assert counted.any()
    mu = records[0]["mu_logps"][counted].exp()
    kept = (records[0]["pi_logps"][counted].exp() - mu).abs().mean().item()
    full = (records[0]["pi_full_logps"][counted].exp() - mu).abs().mean().item()
    print(
        f"server top_p=0.95, N={SERVER_MAX_LOGPROBS}: |pi_kept - mu| = {kept:.3g}, |pi - mu| = {full:.3g} ({int(counted.sum())} tokens)"
    )
    assert kept < FRESH_MISMATCH and full > 100 * kept and full > 1e-3
    overflow = [
        e["dppo/kept_set_overflow_ratio"] for e in trainer.state.log_history if "dppo/kept_set_overflow_ratio" in e
    ]
    print(f"server top_p=0.95, N={SERVER_MAX_LOGPROBS}: overflow ratio {overflow}")
    assert len(overflow) == 1 and 0.0 <= overflow[0] < 1.0


@pytest.mark.vllm
@pytest.mark.slow
def test_two_ranks_torchrun_train_against_the_server(server, tmp_path):
    out = tmp_path / "history.json"
    weights_root = tmp_path / "tmp"
    weights_root.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(get_free_port()), TRAIN_SCRIPT]
    command += ["--model", TINY_MODEL, "--port", str(server.port), "--divergence", "topk_tv", "--top_k", "4"]
    command += ["--output_json", str(out), "--output_dir", str(tmp_path / "run")]
    env = subprocess_env(VLLM_API_KEY=API_KEY, TMPDIR=str(weights_root), OMP_NUM_THREADS="1")
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["distributed_type"] == "DistributedType.MULTI_CPU"
    assert report["file_sync"]
    # Mismatch metrics are maxima over both ranks' tokens.
    _assert_synced_and_moving(report["log_history"], steps_per_generation=2)
    assert not [name for name in os.listdir(weights_root) if name.startswith("dppo-vllm-weights-")]


@pytest.mark.vllm
@pytest.mark.slow
def test_server_recipe_shrunk_trains_and_evaluates(server, trainer_env, tmp_path, example):
    """`qwen3_8b_base_dapo_math_server.yaml` with only its sizes swapped for the bundled tiny model and data."""

    data = os.path.join(ROOT, "examples", "data", "tiny_math")
    size_overrides = {
        "model_name_or_path": TINY_MODEL,
        "dtype": "float32",
        "dataset_name": os.path.join(data, "train.jsonl"),
        "math_eval_datasets": f"tiny_math_test={os.path.join(data, 'test.jsonl')}",
        "max_eval_samples": "4",
        "math_eval_steps": "2",
        "math_eval_num_samples": "3",
        "num_generations": "4",
        "per_device_train_batch_size": "8",
        "gradient_accumulation_steps": "1",
        "steps_per_generation": "8",  # the recipe's 8 optimizer steps per rollout, at GA 1
        "max_steps": "2",
        "max_completion_length": "16",
        "learning_rate": "1e-3",
        "bf16": "false",
        "use_cpu": "true",
        "gradient_checkpointing": "false",
        "logging_steps": "1",
        "save_strategy": "no",
        "log_completions": "false",
        "vllm_server_host": "127.0.0.1",
        "vllm_server_port": str(server.port),
        "vllm_server_timeout": "30",
        "output_dir": str(tmp_path / "run"),
    }
    argv = ["--config", SERVER_RECIPE]
    for key, value in size_overrides.items():
        argv += [f"--{key}", value]
    script_args, args, model_args = example.parse_args(argv)

    _, recipe, _ = example.parse_args(["--config", SERVER_RECIPE])
    kept = (
        "use_vllm",
        "vllm_mode",
        "vllm_importance_sampling_correction",
        "divergence",
        "delta_low",
        "delta_high",
        "ratio_cap",
        "anchor",
        "loss_type",
        "scale_rewards",
        "beta",
        "entropy_coef",
        "temperature",
        "top_p",
        "top_k",
        "mask_truncated_completions",
        "num_iterations",
        "lr_scheduler_type",
        "weight_decay",
        "max_grad_norm",
        "cast_lm_head_to_fp32",
    )
    for name in kept:
        assert getattr(args, name) == getattr(recipe, name), name
    assert args.vllm_mode == "server" and args.loss_type == "luspo" and args.scale_rewards == "none"
    assert args.steps_per_generation // args.gradient_accumulation_steps == (
        recipe.steps_per_generation // recipe.gradient_accumulation_steps
    )

    trainer = example.main(script_args, args, model_args)
    history = trainer.state.log_history
    assert trainer.vllm_generation.vllm_client.file_sync
    train = [e for e in history if "dppo/mismatch_abs_max" in e]
    assert [e["step"] for e in train] == [1, 2] and train[0]["dppo/mismatch_abs_max"] <= FRESH_MISMATCH
    assert all(math.isfinite(e["loss"]) for e in train)
    evals = [e for e in history if "eval/tiny_math_test/avg@3" in e]
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        assert 0.0 <= e["eval/tiny_math_test/avg@3"] <= e["eval/tiny_math_test/pass@3"] <= 1.0
        assert 0 < e["eval/tiny_math_test/mean_length"] <= args.max_completion_length

    # Server mode keeps every k-th prompt and asks for k samples of each: k distinct samples per problem come back.
    from dapo_math.data import load_aime
    from dapo_math.evaluation import MathEvalCallback

    prompts = list(load_aime(os.path.join(data, "test.jsonl"), max_samples=4)["prompt"])
    completions, lengths = MathEvalCallback(trainer, {}, num_samples=5)._generate(prompts, 5)
    assert len(completions) == len(lengths) == 4 * 5
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    assert any(len(set(texts[j * 5 : (j + 1) * 5])) > 1 for j in range(4))
    assert set(logged(trainer, "dppo/invalid_behavior_logps")) == {0.0}
