"""Several real processes: 2 data-parallel ranks (gloo) and DeepSpeed ZeRO-3 on 2 ranks, on CPU.

Each test launches `tests/scripts/multiprocess_train.py` with torchrun or `accelerate launch` (2 ranks, fresh ports)
and reads back the JSON each rank writes: the trainer's logged metrics (already reduced over ranks), the rank's own
per-token sums recorded through `DPPOTrainer.trust_region_observers`, and parameter checksums.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import get_free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "scripts" / "multiprocess_train.py"
ZERO3_CPU = REPO / "examples" / "recipes" / "accelerate" / "zero3_cpu.yaml"
WORLD = 2
# Generous: the machine is shared and each rank imports torch, TRL and vLLM. A hung collective is caught earlier by
# the script's own watchdog, which prints every rank's stack.
TIMEOUT_S = 900
FRESH_MISMATCH_MAX = 1e-4  # |π − μ| on the first step after a weight sync, fp32 engine and trainer

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO), str(REPO / "examples"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # The launcher hands out rank variables and the rendezvous port; stale ones from this process must not leak in.
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return env


def _launch(launcher: list[str], out: Path, *script_args: str) -> list[dict]:
    cmd = [*launcher, str(SCRIPT), "--out", str(out), "--watchdog", str(TIMEOUT_S - 60), *script_args]
    # Own session, so a timeout can stop the launcher and both ranks together.
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {TIMEOUT_S}s:\n{output[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{output[-6000:]}"
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    assert [r["rank"] for r in results] == list(range(WORLD))
    return results


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_port", _port()]


def _accelerate(*options: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", *options, "--main_process_port", _port()]


def _port() -> str:
    return str(get_free_port())


def _step_logs(result: dict) -> dict[int, dict]:
    """Logged training metrics by optimizer step (1-based), without the final summary entry."""
    return {e["step"]: e for e in result["log_history"] if "loss" in e}


def _local_by_step(result: dict) -> dict[int, dict]:
    """This rank's per-loss-call sums by optimizer step (the observer sees `global_step` before the update)."""
    records = [r for r in result["local"] if r["mode"] == "train"]
    by_step = {r["global_step"] + 1: r for r in records}
    assert len(by_step) == len(records), "expected one loss call per optimizer step (GA=1)"
    return by_step


def _reduced(result: dict) -> dict[int, dict]:
    return {
        step: {k: v for k, v in entry.items() if k.startswith(("dppo/", "reward", "completions/")) or k == "loss"}
        for step, entry in _step_logs(result).items()
    }


def _assert_finite_dppo_metrics(result: dict, steps: int) -> None:
    logs = _step_logs(result)
    assert sorted(logs) == list(range(1, steps + 1))
    for step, entry in logs.items():
        dppo = {k: v for k, v in entry.items() if k.startswith("dppo/")}
        assert {"dppo/mask_ratio", "dppo/divergence_mean", "dppo/mismatch_abs_max"} <= dppo.keys(), step
        assert all(math.isfinite(v) for v in dppo.values()), (step, dppo)
        assert math.isfinite(entry["loss"]), step


def _assert_ranks_agree_and_trained(results: list[dict]) -> None:
    first = results[0]
    for other in results[1:]:
        assert other["params"] == first["params"], "parameters differ between ranks after training"
        # Every rank logs the same reduced metrics (timings are per rank).
        assert _reduced(other) == _reduced(first)
    changed = [name for name, value in first["params"].items() if value != first["params_before"][name]]
    assert changed, "no parameter changed: the reward gave no advantage signal"


def _assert_fresh_mismatch(results: list[dict], steps_per_generation: int) -> None:
    """On every rank, the first step after each generation sees π ≈ μ: the sync reached that rank's engine."""
    for result in results:
        fresh = {s: r for s, r in _local_by_step(result).items() if (s - 1) % steps_per_generation == 0}
        assert len(fresh) >= 2, "need a sync after training, not only the initial weights"
        for step, record in fresh.items():
            assert record["mismatch_abs_max"] <= FRESH_MISMATCH_MAX, (result["rank"], step, record)
        # The weight-sync check (raising, `multiprocess_train.py`) ran on exactly these steps, over both ranks' fresh
        # tokens: with one loss call per step that is the step's reduced mean |π − μ|.
        for step, entry in _step_logs(result).items():
            if (step - 1) % steps_per_generation == 0:
                assert entry["dppo/sync_mismatch"] == pytest.approx(entry["dppo/mismatch_abs_mean"], rel=1e-5), step
            else:
                assert "dppo/sync_mismatch" not in entry, step


def test_two_ranks_transformers_generation(tmp_path, tiny_model_dir):
    """`accelerate launch --multi_gpu --num_processes 2` with `use_cpu`: gloo data parallel, both ranks contribute."""
    results = _launch(_accelerate("--multi_gpu", "--num_processes", str(WORLD)), tmp_path, "--model", tiny_model_dir)
    for result in results:
        assert (result["world_size"], result["distributed_type"], result["backend"]) == (
            WORLD,
            "DistributedType.MULTI_CPU",
            "gloo",
        )
        _assert_finite_dppo_metrics(result, steps=2)
    _assert_ranks_agree_and_trained(results)

    locals_ = [_local_by_step(r) for r in results]
    for step, entry in _step_logs(results[0]).items():
        per_rank = [local[step]["tokens"] for local in locals_]
        assert all(n > 0 for n in per_rank), (step, per_rank)
        # TRL's gathered mean completion length covers every rank's rows (4 per rank): both ranks contributed.
        assert entry["completions/mean_length"] == pytest.approx(sum(per_rank) / (4 * WORLD)), step


@pytest.mark.vllm
def test_two_ranks_vllm_colocate_drift_within_generation(tmp_path, tiny_model_dir):
    """torchrun, 2 ranks each with its own vLLM engine; 4 optimizer steps per generation so π drifts from μ."""
    spg, steps = 4, 8
    results = _launch(
        _torchrun(),
        tmp_path,
        "--model",
        tiny_model_dir,
        "--vllm",
        "--steps-per-generation",
        str(spg),
        "--max-steps",
        str(steps),
        # The random tiny model's token probabilities are ~1/259, so |π − μ| stays ~1e-3 after a few steps.
        "--delta",
        "1e-3",
    )
    for result in results:
        assert result["distributed_type"] == "DistributedType.MULTI_CPU" and result["world_size"] == WORLD
        _assert_finite_dppo_metrics(result, steps=steps)
    _assert_ranks_agree_and_trained(results)
    _assert_fresh_mismatch(results, spg)

    # Logged metrics are reductions of both ranks' local values, not rank 0's alone.
    logs, locals_ = _step_logs(results[0]), [_local_by_step(r) for r in results]
    rank0_alone_differs = False
    for step, entry in logs.items():
        records = [local[step] for local in locals_]
        tokens, masked = sum(r["tokens"] for r in records), sum(r["masked"] for r in records)
        assert entry["dppo/mask_ratio"] == pytest.approx(masked / tokens, rel=1e-6, abs=1e-12), step
        assert entry["dppo/mismatch_abs_max"] == pytest.approx(max(r["mismatch_abs_max"] for r in records)), step
        rank0 = records[0]["masked"] / records[0]["tokens"]
        rank0_alone_differs |= rank0 != pytest.approx(entry["dppo/mask_ratio"], rel=1e-6, abs=1e-12)
    assert rank0_alone_differs, "ranks never differed, so the reduction check proved nothing"
    # The trust region acted: some tokens were masked once π moved away from μ.
    assert any(entry["dppo/mask_ratio"] > 0 for entry in logs.values())
    assert all(entry["dppo/mask_ratio"] == 0 for step, entry in logs.items() if (step - 1) % spg == 0)


@pytest.fixture(scope="module")
def deepspeed_cpu_ops():
    """Build DeepSpeed's CPU shared-memory comm op once, in one process, before two ranks race for its build lock.

    DeepSpeed JIT-compiles it (about 90 CPU-seconds) the first time a gloo group starts; `scripts/setup.sh` does it at
    install time, so this is normally a cache hit.
    """
    pytest.importorskip("deepspeed")
    code = (
        "from deepspeed.accelerator import get_accelerator\n"
        "builder = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
        "builder is None or builder.load()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert proc.returncode == 0, (
        f"building DeepSpeed's CPU comm op failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )


@pytest.mark.vllm
def test_deepspeed_zero3_two_ranks_vllm_colocate(tmp_path, tiny_model_dir, deepspeed_cpu_ops):
    """ZeRO-3 on gloo (examples/recipes/accelerate/zero3_cpu.yaml): parameters partitioned, vLLM sync gathers them."""
    spg, steps = 4, 5  # the sync before step 5 gathers weights that ZeRO-3 has updated 4 times
    results = _launch(
        _accelerate("--config_file", str(ZERO3_CPU), "--num_processes", str(WORLD)),
        tmp_path,
        "--model",
        tiny_model_dir,
        "--zero3",
        "--vllm",
        "--steps-per-generation",
        str(spg),
        "--max-steps",
        str(steps),
    )
    for result in results:
        assert (result["world_size"], result["distributed_type"], result["backend"]) == (
            WORLD,
            "DistributedType.DEEPSPEED",
            "gloo",
        )
        zero3 = result["zero3"]
        # Every parameter is a ZeRO-3 partition: full size known (`ds_numel`), nothing materialised locally.
        assert zero3["partitioned_params"] == zero3["total_params"] > 0
        assert zero3["ds_numel"] > 0 and zero3["local_numel"] == 0
        _assert_finite_dppo_metrics(result, steps=steps)
    _assert_ranks_agree_and_trained(results)
    _assert_fresh_mismatch(results, spg)


SHARDED_LORA_SCRIPT = REPO / "tests" / "scripts" / "sharded_lora_sync.py"


def test_lora_walk_on_zero3_and_fsdp2_shards(tmp_path, deepspeed_cpu_ops):
    """The out-of-place LoRA walk the trainers sync with, on 2 gloo ranks: under ZeRO-3 it gathers one decoder layer
    (or one module outside the layers) at a time, under FSDP2 it reads `DTensor` shards with `full_tensor()`; either
    way every rank streams exactly the unsharded model's merged weights and no shard is written."""
    cmd = [*_torchrun(), str(SHARDED_LORA_SCRIPT), "--out", str(tmp_path), "--watchdog", str(TIMEOUT_S - 60)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        zero3, fsdp2 = result["zero3"], result["fsdp2"]
        assert zero3["equal"] and zero3["shards_unchanged"] and zero3["partitioned"], zero3
        # At most one gather unit at a time, well below the whole model (3 decoder layers, embeddings, head).
        assert 0 < zero3["peak_gathered_bytes"] <= zero3["largest_unit_bytes"] < zero3["model_bytes"] / 2, zero3
        assert fsdp2["equal"] and fsdp2["shards_unchanged"] and fsdp2["sharded"], fsdp2
