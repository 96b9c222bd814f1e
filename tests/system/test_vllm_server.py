"""vLLM server mode on the CPU build, for real: `python -m dppo_trl.backends.cpu.vllm_server` in its own process, trainers on 1 and 2
ranks syncing weights through `dppo_trl.backends.cpu.weight_sync`'s file path, and the shrunk multi-node server recipe.

One server (the bundled tiny model, with an API key and `--max-logprobs 8`) serves the whole module: every trainer
pushes its own weights before its first generation (`_last_loaded_step = -1`), so runs do not leak into each other.
"""

import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import requests
import torch
from conftest import get_free_port
from forward_count import count_generation_passes
from trainer_setup import (
    byte_mean_reward,
    frozen_base_changes,
    logged,
    make_trainer,
    math_prompt_dataset,
    merged_reference,
)

from dppo_trl.backends.cpu.vllm_server import WORKER_EXTENSION, build_server_command
from dppo_trl.trainers.dppo_trainer import BEHAVIOR_LOGPS, BEHAVIOR_TOPK_IDS, BEHAVIOR_TOPK_LOGPS, BEHAVIOR_VALID

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MODEL = os.path.join(ROOT, "examples", "tiny_math_model")
SERVER_RECIPE = os.path.join(ROOT, "examples", "recipes", "qwen3_8b_base_dapo_math_server.yaml")
TRAIN_SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_vllm_server.py")
API_KEY = "dppo-test-key"
SERVER_MAX_LOGPROBS = 8
SERVER_START_TIMEOUT = 900  # seconds; ~1 min alone, several under a loaded shared machine
FRESH_MISMATCH = 1e-4  # |π − μ| right after a sync, fp32 on both sides


def _subprocess_env(**extra) -> dict:
    # The repository (this checkout's library) and tests/ (`trainer_setup`, which the training script imports).
    paths = [ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), **extra)


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server and the engine processes it spawned (they share its session)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


class Server:
    def __init__(self, port: int, proc: subprocess.Popen, log_path: str):
        self.port, self.proc, self.log_path = port, proc, log_path
        self.base_url = f"http://127.0.0.1:{port}"

    def log_tail(self, lines: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def post(self, path: str, **kwargs) -> dict:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        response = requests.post(self.base_url + path, headers=headers, timeout=120, **kwargs)
        assert response.status_code == 200, response.text
        return response.json()


def _start_server(log_path: str) -> Server:
    port = get_free_port()
    command = [sys.executable, "-m", "dppo_trl.backends.cpu.vllm_server", "--model", TINY_MODEL, "--port", str(port)]
    command += ["--max-logprobs", str(SERVER_MAX_LOGPROBS), "--max-model-len", "256"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command,
            env=_subprocess_env(VLLM_API_KEY=API_KEY),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
    return Server(port, proc, log_path)


def _wait_healthy(server: Server) -> bool:
    """True once `/health` answers; False if the server exited because its port was taken meanwhile."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while True:
        if server.proc.poll() is not None:
            if "Address already in use" in server.log_tail():
                return False
            pytest.fail(f"vLLM server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if requests.get(server.base_url + "/health", timeout=5).status_code == 200:
                return True
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"vLLM server not healthy after {SERVER_START_TIMEOUT} s:\n{server.log_tail()}")
        time.sleep(2)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    log_dir = tmp_path_factory.mktemp("vllm_server")
    # The port is checked free, but another process on a shared machine can take it before vLLM binds: retry then.
    for attempt in range(3):
        server = _start_server(str(log_dir / f"server{attempt}.log"))
        try:
            if _wait_healthy(server):
                break
        except BaseException:
            _stop(server.proc)
            raise
    else:
        pytest.fail("vLLM server could not bind a free port in 3 attempts")
    try:
        yield server
    finally:
        _stop(server.proc)


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


# --- launcher (no server) -------------------------------------------------------------------------------------------
def test_launcher_binds_localhost_with_trl_flags(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    command, env = build_server_command(["--model", "m", "--port", "9001", "--max-model-len", "128"])
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    for part in (
        "--host 127.0.0.1",
        "--port 9001",
        "--logprobs-mode processed_logprobs",
        "--max-logprobs -1",
        "--dtype float32",
        "--enforce-eager",
        "--kv-cache-memory-bytes 67108864",
        "--max-model-len 128",  # unknown options reach vLLM unchanged
    ):
        assert part in joined, part
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_API_KEY" not in env


def test_launcher_key_goes_through_the_environment_and_wide_bind_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="dppo_trl.backends.cpu.vllm_server"):
        command, env = build_server_command(["--model", "m", "--api-key", "s3cret", "--host", "0.0.0.0"])
    assert env["VLLM_API_KEY"] == "s3cret" and "s3cret" not in command
    assert "--host 0.0.0.0" in " ".join(command)
    assert "development endpoints" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dppo_trl.backends.cpu.vllm_server"):
        build_server_command(["--model", "m", "--host", "::1"])
    assert not caplog.text


def test_launcher_refuses_to_change_what_dppo_needs():
    # Raw log-probs are not the distribution the server samples from, so they cannot be μ.
    with pytest.raises(SystemExit, match="--logprobs-mode"):
        build_server_command(["--model", "m", "--max-model-len", "64", "--logprobs-mode=raw_logprobs"])
    with pytest.raises(SystemExit, match="kv-cache-memory-bytes"):
        build_server_command(["--model", "m", "--kv-cache-memory-bytes", "0"])


def test_worker_extension_is_what_the_launcher_names():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.cpu_worker import CPUWorker

    from dppo_trl.backends.cpu.weight_sync import SERVER_RELOAD_METHOD, WeightReloadExtension

    assert resolve_obj_by_qualname(WORKER_EXTENSION) is WeightReloadExtension
    assert callable(getattr(WeightReloadExtension, SERVER_RELOAD_METHOD))
    assert not hasattr(CPUWorker, SERVER_RELOAD_METHOD)  # vLLM refuses extensions that shadow worker attributes


@pytest.mark.vllm
@pytest.mark.slow
def test_file_reload_refreshes_a_tied_head(tiny_tied_model_dir, master_port, monkeypatch):
    """The worker side of the file sync on a real engine with a tied LM head (vLLM's plain `reload_weights` leaves
    it stale); `/collective_rpc` is replaced by the engine's in-process `collective_rpc` of the same method name."""
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from dppo_trl.backends.cpu.weight_sync import reload_server_weights_from_file

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    llm = LLM(
        model=tiny_tied_model_dir,
        distributed_executor_backend="external_launcher",
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
        max_model_len=64,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_tied_model_dir, dtype=torch.float32)
    assert model.config.tie_word_embeddings
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)

    def max_error() -> float:
        outputs = llm.generate(["hello", "1+2="], SamplingParams(max_tokens=6, logprobs=5, temperature=1.0, seed=0))
        worst = 0.0
        for output in outputs:
            completion = output.outputs[0]
            ids = torch.tensor([list(output.prompt_token_ids) + list(completion.token_ids)])
            with torch.no_grad():
                logps = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            start = len(output.prompt_token_ids) - 1
            for pos, entries in enumerate(completion.logprobs):
                for token_id, logprob in entries.items():
                    worst = max(worst, abs(logps[start + pos, token_id].item() - logprob.logprob))
        return worst

    class InProcessServer:
        base_url = ""

        def _post(self, url, json):
            assert url == "/collective_rpc"
            return llm.collective_rpc(json["method"], kwargs=json["kwargs"])

    assert max_error() > 1e-2  # the engine still serves the saved weights
    # `named_parameters` yields the tied weight once, as TRL's iterator does.
    assert reload_server_weights_from_file(InProcessServer(), model.named_parameters()) == len(
        list(model.named_parameters())
    )
    llm.reset_prefix_cache()
    assert max_error() <= FRESH_MISMATCH


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
    env = _subprocess_env(VLLM_API_KEY=API_KEY, TMPDIR=str(weights_root), OMP_NUM_THREADS="1")
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
