"""Faults survived, for real: SIGTERM to a training process, a vLLM server killed mid-run, a failing checkpoint write,
and TRL's classes left untouched once a DPPOTrainer is done (docs/faults.md). The asynchronous trainer's preemption and
dead server run `examples/train_dapo_math_async.py` itself, against the real CPU vLLM server it starts."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from dppo_trl.hardening.checkpoints import checkpoint_step, scan_checkpoints
from dppo_trl.hardening.preemption import PREEMPTED_EXIT_CODE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "fault_train.py")
ASYNC_SCRIPT = os.path.join(ROOT, "tests", "scripts", "fault_train_async.py")
WAIT = 600  # seconds: bound on any wait (a loaded shared machine is slow); the runs finish far sooner
# Stated bounds (docs/faults.md) from the strike to the process's exit, for the asynchronous example on the bundled
# tiny model: SIGTERM → 3 s grace + the rest of the optimizer step + the save + stopping TRL's rollout worker (≤ 20 s)
# and the server the example started (≤ 40 s); a killed server → the rest of the step (its weight sync fails at once)
# + stopping the worker. Both with room for a loaded 2-core machine.
ASYNC_PREEMPTION_EXIT_BOUND = 180
ASYNC_DEAD_SERVER_EXIT_BOUND = 180


def _env(**extra) -> dict:
    # The repository (this checkout's library), tests/ (`trainer_setup`, which the training script imports) and
    # examples/ (the asynchronous example and its `dapo_math` package).
    paths = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), **extra)


def _launch(args: list[str], log_path: str, script: str = SCRIPT, **env) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, script, *args],
            env=_env(**env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _wait_for_line(proc: subprocess.Popen, log_path: str, line: str) -> None:
    deadline = time.monotonic() + WAIT
    while line not in _read(log_path):
        if proc.poll() is not None:
            pytest.fail(f"training exited with {proc.returncode} before {line!r}:\n{_read(log_path)[-4000:]}")
        if time.monotonic() > deadline:
            _kill(proc)
            pytest.fail(f"no {line!r} after {WAIT} s:\n{_read(log_path)[-4000:]}")
        time.sleep(0.5)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


def _finish(proc: subprocess.Popen, log_path: str) -> int:
    try:
        return proc.wait(WAIT)
    except subprocess.TimeoutExpired:
        _kill(proc)
        pytest.fail(f"training still running {WAIT} s later:\n{_read(log_path)[-4000:]}")


@pytest.mark.parametrize("generation", ["transformers", "colocate"])
def test_sigterm_saves_a_complete_checkpoint_and_exits_143(generation, tiny_model_dir, tmp_path, free_port):
    out, result = tmp_path / "run", tmp_path / "result.json"
    args = ["--model", tiny_model_dir, "--output_dir", str(out), "--output_json", str(result)]
    args += ["--generation", generation]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port)}
    log = str(tmp_path / "train.log")
    proc = _launch(args + ["--max_steps", "500"], log, **env)
    try:
        _wait_for_line(proc, log, "STEP 2\n")
        proc.send_signal(signal.SIGTERM)
        code = _finish(proc, log)
    finally:
        _kill(proc)
    text = _read(log)
    assert code == PREEMPTED_EXIT_CODE, text[-4000:]
    assert not result.exists()  # the script's "training finished" code never ran
    complete, incomplete = scan_checkpoints(str(out))
    assert len(complete) == 1 and not incomplete, (complete, incomplete)
    checkpoint = complete[0]
    assert f"preempted (SIGTERM): stopped after saving the complete checkpoint {checkpoint}" in text
    assert f"--resume_from_checkpoint {checkpoint}" in text
    assert not os.path.exists(out / "model.safetensors")

    # The checkpoint resumes: the run continues from its step to the end.
    step = checkpoint_step(checkpoint)
    resumed_log = str(tmp_path / "resume.log")
    proc = _launch(args + ["--max_steps", str(step + 2), "--resume_from_checkpoint", checkpoint], resumed_log, **env)
    try:
        code = _finish(proc, resumed_log)
    finally:
        _kill(proc)
    assert code == 0, _read(resumed_log)[-4000:]
    with open(result) as f:
        resumed = json.load(f)
    assert resumed["global_step"] == step + 2
    assert resumed["steps"] == list(range(1, step + 3))  # the checkpoint's history, then the two new steps
    # Inside a generation batch (2 optimizer steps here) the resume says it is not exact; on a boundary it is silent.
    assert ("Resuming at step" in _read(resumed_log)) == (step % 2 == 1)


def _trl_symbols() -> dict:
    import torch
    import trl.generation.vllm_generation as vllm_generation

    return {
        "LLM": vllm_generation.LLM,
        "VLLMClient": vllm_generation.VLLMClient,
        "sync_weights": vllm_generation.VLLMGeneration.sync_weights,
        "set_num_threads": torch.set_num_threads,
        "num_threads": torch.get_num_threads(),
    }


def test_colocate_patches_stay_inside_their_trainer(tiny_model_dir, tmp_path, master_port, monkeypatch):
    """A CPU-colocate DPPOTrainer trains, then a plain GRPOTrainer in the same process sees TRL untouched."""
    from trainer_setup import byte_mean_reward, make_trainer, prompt_dataset
    from trl import GRPOConfig, GRPOTrainer

    from dppo_trl.backends.cpu.platform import is_vllm_cpu_platform

    if not is_vllm_cpu_platform():
        pytest.skip("needs vLLM's CPU platform")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = _trl_symbols()
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path / "dppo",
        reward_funcs=byte_mean_reward,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.05,
        max_steps=1,
    )
    during = _trl_symbols()
    assert {k: during[k] for k in ("LLM", "sync_weights", "set_num_threads")} == {
        k: before[k] for k in ("LLM", "sync_weights", "set_num_threads")
    }
    assert "sync_weights" in vars(trainer.vllm_generation)  # the CPU sync is bound to this trainer's instance only
    trainer.train()
    assert trainer.state.global_step == 1
    assert _trl_symbols() == before

    plain = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=byte_mean_reward,
        args=GRPOConfig(
            output_dir=str(tmp_path / "grpo"),
            use_cpu=True,
            report_to="none",
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=4,
            max_steps=1,
        ),
        train_dataset=prompt_dataset(),
    )
    plain.train()
    assert _trl_symbols() == before
    del trainer


def test_failing_write_during_a_save_keeps_the_previous_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    """Disk full while checkpoint-2 is written: the error names the path, the staged folder stays incomplete, and
    checkpoint-1 still resumes."""
    import errno

    import torch
    from trainer_setup import byte_mean_reward, make_trainer

    from dppo_trl.hardening.checkpoints import latest_complete_checkpoint

    out = tmp_path / "run"
    config = dict(reward_funcs=byte_mean_reward, save_strategy="steps", save_steps=1, steps_per_generation=1)
    real_save = torch.save

    def save_until_full(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and "checkpoint-2" in str(f):
            with open(f, "wb") as partial:
                partial.write(b"\0" * 16)  # a partial file, as a full disk leaves
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_full)
    trainer = make_trainer(tiny_model_dir, out, max_steps=3, **config)
    with pytest.raises(OSError, match="No space left on device") as info:
        trainer.train()
    assert info.value.errno == errno.ENOSPC
    message = str(info.value)
    assert str(out / "checkpoint-2") in message and str(out / "_incomplete-checkpoint-2") in message
    assert f"the last complete checkpoint is {out / 'checkpoint-1'}" in message
    complete, incomplete = scan_checkpoints(str(out))
    assert [os.path.basename(p) for p in complete] == ["checkpoint-1"]
    assert [os.path.basename(p) for p in incomplete] == ["_incomplete-checkpoint-2"]
    monkeypatch.setattr(torch, "save", real_save)

    resumed = make_trainer(tiny_model_dir, out, max_steps=2, **config)
    resumed.train(resume_from_checkpoint=latest_complete_checkpoint(str(out)))
    assert resumed.state.global_step == 2
    complete, incomplete = scan_checkpoints(str(out))
    assert [os.path.basename(p) for p in complete] == ["checkpoint-1", "checkpoint-2"] and not incomplete


def test_killed_vllm_server_stops_training_with_the_resume_command(tmp_path, master_port, monkeypatch):
    """Server mode: a DPPOTrainer in this process leaves TRL's `VLLMClient` untouched after training; then a training
    subprocess loses its server mid-run and exits non-zero naming the server and the resume command."""
    from server_setup import API_KEY, TINY_MODEL, start_server, stop_server, wait_healthy
    from trainer_setup import byte_mean_reward, make_trainer

    server = start_server(str(tmp_path / "server.log"))
    try:
        if not wait_healthy(server):
            pytest.skip("the vLLM server's port was taken")
        monkeypatch.setenv("VLLM_API_KEY", API_KEY)
        before = _trl_symbols()
        trainer = make_trainer(
            TINY_MODEL,
            tmp_path / "inproc",
            reward_funcs=byte_mean_reward,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_host="127.0.0.1",
            vllm_server_port=server.port,
            vllm_server_timeout=60,
            max_steps=1,
        )
        assert trainer.vllm_generation.vllm_client.file_sync
        trainer.train()
        assert _trl_symbols() == before

        out, log = tmp_path / "run", str(tmp_path / "train.log")
        args = ["--model", TINY_MODEL, "--output_dir", str(out), "--output_json", str(tmp_path / "r.json")]
        args += ["--generation", "server", "--server_port", str(server.port), "--save_steps", "2"]
        proc = _launch(args + ["--max_steps", "500"], log, VLLM_API_KEY=API_KEY)
        try:
            _wait_for_line(proc, log, "STEP 3\n")
            stop_server(server.proc)  # SIGTERM to the server's process group; SIGKILL if it lingers
            code = _finish(proc, log)
        finally:
            _kill(proc)
    finally:
        stop_server(server.proc)
    text = _read(log)
    assert code != 0, text[-4000:]
    assert f"The vLLM server at {server.base_url} stopped answering" in text, text[-4000:]
    complete, incomplete = scan_checkpoints(str(out))
    assert complete and not incomplete, (complete, incomplete)
    assert f"--resume_from_checkpoint {complete[-1]}" in text


@pytest.mark.slow
def test_killed_rank_ends_the_other_rank(tiny_model_dir, tmp_path):
    """torchrun, 2 gloo ranks: SIGKILL rank 1 mid-run; rank 0 does not hang (torchrun stops it, and a collective
    waiting on a hung peer ends after `ddp_timeout`, set small here), and the launcher exits non-zero."""
    from conftest import get_free_port

    out, log = tmp_path / "run", str(tmp_path / "train.log")
    args = ["--model", tiny_model_dir, "--output_dir", str(out), "--output_json", str(tmp_path / "r.json")]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(get_free_port()), SCRIPT, *args, "--max_steps", "500", "--ddp_timeout", "30"]
    env = _env()
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    with open(log, "w") as f:
        proc = subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        _wait_for_line(proc, log, "STEP 2\n")
        # Both ranks write to one log, so a line may hold another rank's output too: match the markers anywhere.
        pids = dict(re.findall(r"RANK (\d+) PID (\d+)", _read(log)))
        os.kill(int(pids["1"]), signal.SIGKILL)
        code = _finish(proc, log)
    finally:
        _kill(proc)
    assert code != 0, _read(log)[-4000:]
    with pytest.raises(ProcessLookupError):
        os.kill(int(pids["0"]), 0)  # the surviving rank is gone too


# ---------------------------------------------------------------------------------------------------------------------
# The asynchronous trainer (AsyncDPPOTrainer), through examples/train_dapo_math_async.py and its own CPU server
# ---------------------------------------------------------------------------------------------------------------------
ASYNC_ARGS = ["--eval_dataset", "none", "--per_device_train_batch_size", "16", "--max_completion_length", "8"]


def _example_server(output_dir) -> tuple[int, int]:
    """`(pid, port)` of the server the example started (its log is `vllm_server.log` in the output folder)."""
    path = os.path.join(output_dir, "vllm_server.log")
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        text = _read(path) if os.path.exists(path) else ""
        pid, port = re.search(r"Started server process \[(\d+)\]", text), re.search(r"--port (\d+)", text)
        if pid and port:
            return int(pid.group(1)), int(port.group(1))
        time.sleep(0.5)
    pytest.fail(f"no server pid/port in {path}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_server(pid: int) -> None:
    # The example starts the server in its own session (it is the session leader): stop all of it.
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _finish_within(proc: subprocess.Popen, log_path: str, bound: float) -> tuple[int, float]:
    start = time.monotonic()
    try:
        code = proc.wait(bound)
    except subprocess.TimeoutExpired:
        _kill(proc)
        pytest.fail(f"still running {bound} s after the strike (the stated bound):\n{_read(log_path)[-4000:]}")
    return code, time.monotonic() - start


def test_async_sigterm_exits_143_with_a_checkpoint_and_resumes_from_latest(tmp_path):
    """SIGTERM to the asynchronous example under `--enable_jit_checkpoint` after 6 steps: exit 143 within the stated
    bound, one complete checkpoint and no final model, the server it started is stopped; `--resume_from_checkpoint
    latest` continues from that checkpoint to the end."""
    from dppo_trl.hardening.preemption import PREEMPTED_EXIT_CODE

    out, log = tmp_path / "run", str(tmp_path / "train.log")
    args = ["--output_dir", str(out), "--enable_jit_checkpoint", "true", "--save_steps", "4", *ASYNC_ARGS]
    proc = _launch(args + ["--max_steps", "500"], log, script=ASYNC_SCRIPT)
    server_pid = None
    try:
        _wait_for_line(proc, log, "STEP 6\n")
        server_pid, _ = _example_server(out)
        proc.send_signal(signal.SIGTERM)
        code, elapsed = _finish_within(proc, log, ASYNC_PREEMPTION_EXIT_BOUND)
        print(f"async SIGTERM → exit {code} after {elapsed:.1f} s")
        text = _read(log)
        assert code == PREEMPTED_EXIT_CODE, text[-4000:]
        assert not _alive(server_pid), "the example's vLLM server outlived it"
    finally:
        _kill(proc)
        if server_pid is not None:
            _kill_server(server_pid)
    complete, incomplete = scan_checkpoints(str(out))
    assert len(complete) == 1 and not incomplete, (complete, incomplete)
    checkpoint = complete[0]
    step = checkpoint_step(checkpoint)
    assert step >= 6
    assert os.path.exists(os.path.join(checkpoint, "rollout_state.json"))  # TRL's worker position, staged too
    assert f"preempted (SIGTERM): stopped after saving the complete checkpoint {checkpoint}" in text
    assert f"--resume_from_checkpoint {checkpoint}" in text
    assert not os.path.exists(out / "model.safetensors")  # no "final" model written as if training had finished

    resumed_log = str(tmp_path / "resume.log")
    args = ["--output_dir", str(out), "--resume_from_checkpoint", "latest", *ASYNC_ARGS]
    proc = _launch(args + ["--max_steps", str(step + 2)], resumed_log, script=ASYNC_SCRIPT)
    try:
        code = _finish(proc, resumed_log)
    finally:
        _kill(proc)
    text = _read(resumed_log)
    assert code == 0, text[-4000:]
    assert f"Resuming from the newest complete checkpoint: {checkpoint}" in text
    assert re.findall(r"STEP (\d+)", text) == [str(step + 1), str(step + 2)]  # continues, does not restart
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["steps"] == step + 2  # the checkpoint's logged steps, then the two new ones
    assert os.path.exists(out / "model.safetensors")


def test_async_dead_server_stops_training_with_the_named_error(tmp_path):
    """The server the asynchronous example started is killed mid-run: the example exits non-zero within the stated
    bound with `VLLMServerError`, naming the server and what to resume from."""
    out, log = tmp_path / "run", str(tmp_path / "train.log")
    args = ["--output_dir", str(out), *ASYNC_ARGS]
    proc = _launch(args + ["--max_steps", "500"], log, script=ASYNC_SCRIPT)
    server_pid = None
    try:
        _wait_for_line(proc, log, "STEP 2\n")
        server_pid, port = _example_server(out)
        _kill_server(server_pid)
        code, elapsed = _finish_within(proc, log, ASYNC_DEAD_SERVER_EXIT_BOUND)
        print(f"async dead server → exit {code} after {elapsed:.1f} s")
    finally:
        _kill(proc)
        if server_pid is not None:
            _kill_server(server_pid)
    text = _read(log)
    assert code != 0, text[-4000:]
    assert "VLLMServerError" in text, text[-4000:]
    assert f"The vLLM server at http://127.0.0.1:{port} stopped answering" in text, text[-4000:]
    assert "no checkpoint was saved" in text  # save_strategy "no" in the example's CPU run
