"""Every command in the fenced ```bash blocks of README.md and docs/*.md runs as printed, or says why it cannot here.

Each command (continuation lines joined, comments dropped, normalised with `shlex`) has one entry in `DECISIONS`:

- `Run(shrink)`: run here, from the repository root, with the environment a user has after the README's set-up (the
  venv's python, no PYTHONPATH), after these rewrites and nothing else:
  - `bash scripts/setup.sh && ` is dropped: it is the set-up this test already runs under;
  - `.venv/bin/NAME` is NAME of the venv running the test (a fresh clone's `.venv` in CI);
  - output paths (`outputs/...`, `/tmp/...`, `--output-dir`/`--output_dir`/`--output` values) move under one temporary folder,
    shared by all the commands, so a later command reads what an earlier one wrote (`compare_runs.py` reads the
    README's two training runs), exactly as on a fresh clone;
  - `shrink` is appended (argparse: the last value wins): the size of each command family, e.g. `--max_steps 2` for
    the training script and `--quick` for the sanity benchmark.
  A benchmark's stdout must be exactly one JSON object.
- `Covered(test)`: runs, shrunk, in another module of the suite (named), which this test checks mentions the script.
- `CannotRun(reason)`: GPU-only, needs the Hub or a network install, or runs for hours.

A command added to the docs without an entry here fails `test_every_documented_command_has_a_decision`.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
# Options whose value is a path the command writes: moved under the test's temporary folder, never the repository.
OUTPUT_OPTIONS = ("--output-dir", "--output_dir", "--output")


@dataclass(frozen=True)
class Run:
    shrink: tuple[str, ...] = ()


@dataclass(frozen=True)
class Covered:
    test: str


@dataclass(frozen=True)
class CannotRun:
    reason: str


GPU = "GPU-only: DeepSpeed ZeRO-3 on 8 GPUs with vLLM on CUDA and a Qwen3 model from the Hub"
TRAIN_SHRINK = ("--max_steps", "2", "--math_eval_datasets", "none")
TOPK_SHRINK = ("--n-tokens", "128", "--hidden", "32", "--vocab", "16384")

DECISIONS = {
    # README.md
    "bash scripts/setup.sh && .venv/bin/accelerate launch examples/train_dapo_math.py": Run(
        (*TRAIN_SHRINK, "--output_dir", "outputs/tiny-math-dppo")  # the script's default output folder
    ),
    "bash scripts/setup.sh && bash scripts/lint.sh && .venv/bin/python -m pytest -q && bash scripts/vllm_lane.sh 0.28.0": (
        CannotRun("the whole suite, this test among it")
    ),
    ".venv/bin/python examples/train_dapo_math.py --trust_region grpo_clip --output_dir outputs/tiny-math-grpo-clip": Run(
        TRAIN_SHRINK
    ),
    ".venv/bin/python examples/compare_runs.py outputs/tiny-math-dppo outputs/tiny-math-grpo-clip": Run(),
    "pip install dppo-trl": CannotRun("a PyPI install into the user's environment (not released yet)"),
    "pip install dppo-trl[vllm]": CannotRun("a PyPI install of CUDA vLLM (GPU)"),
    "pip install dppo-trl[liger]": CannotRun("a PyPI install of Liger (CUDA only)"),
    "pip install .": CannotRun(
        "an install into the user's environment; tests/meta/test_package.py builds the same wheel"
    ),
    "pip install -e .[test,examples]": CannotRun("an install into the user's environment; scripts/setup.sh runs it"),
    "pip install --no-deps -e ./dev": CannotRun("an install into the user's environment; scripts/setup.sh runs it"),
    # The `dppo-trl` command: tests/integration/test_async_server.py runs the server-mode forms shrunk (2 steps) against
    # its module's server (started by `dppo-trl vllm-serve`), so the demo runs there in server mode and train-async
    # uses that server instead of starting one (the example's async command below starts one through the same
    # `dppo_trl.cli.server`); tests/system/test_cli_accelerate.py runs the 2-process form; tests/unit/test_cli.py checks that
    # the no-argument demos parse to the tiny recipe's and the async example's settings.
    ".venv/bin/dppo-trl train --config examples/recipes/tiny_math_cpu.yaml --output_dir outputs/tiny-math-cli": Covered(
        "tests/integration/test_async_server.py"
    ),
    ".venv/bin/dppo-trl train --accelerate_config multi_gpu --num_processes 2 --main_process_port 29601 "
    "--model_name_or_path examples/tiny_math_model --dataset_name "
    "examples/data/tiny_math/train.jsonl --reward_funcs dapo_math.rewards.accuracy_reward --use_vllm false "
    "--output_dir outputs/tiny-math-cli-ddp": Covered("tests/system/test_cli_accelerate.py"),
    ".venv/bin/dppo-trl train-async --output_dir outputs/tiny-math-cli-async": Covered(
        "tests/integration/test_async_server.py"
    ),
    ".venv/bin/dppo-trl vllm-serve --model examples/tiny_math_model --port 8000": Run(("--dry-run",)),
    ".venv/bin/python benchmarks/step_time.py": Covered("tests/system/test_benchmarks.py"),
    ".venv/bin/python benchmarks/topk_capture.py": Covered("tests/system/test_benchmarks.py"),
    ".venv/bin/python benchmarks/async_vs_sync.py": Covered("tests/system/test_benchmarks.py"),
    ".venv/bin/python benchmarks/async_topk_cost.py": Covered("tests/system/test_benchmarks.py"),
    ".venv/bin/python benchmarks/tree_attention.py": Covered("tests/system/test_benchmarks.py"),
    ".venv/bin/python benchmarks/memory_plan.py --recipe examples/recipes/qwen3_30b_a3b_base_lora_dapo_math.yaml": Covered(
        "tests/system/test_benchmarks.py"
    ),
    # Its sabotage (`EngineReloadSabotage`) and trainer runs, two steps, in the test against the same engine.
    ".venv/bin/python benchmarks/sync_mismatch.py": Covered("tests/integration/test_sync_sabotage.py"),
    # docs/recipes.md
    ".venv/bin/python examples/train_dapo_math.py --save_strategy steps --save_steps 25 --output_dir outputs/run1": Run(
        (*TRAIN_SHRINK, "--save_steps", "2")
    ),
    ".venv/bin/python examples/train_dapo_math.py --save_strategy steps --save_steps 25 --output_dir outputs/run1 "
    "--resume_from_checkpoint latest": Run((*TRAIN_SHRINK, "--save_steps", "2")),
    ".venv/bin/python examples/train_dapo_math.py --output_dir outputs/tiny-math-dppo-python": Covered(
        "tests/system/test_default_run.py"
    ),
    ".venv/bin/dppo-trl train --output_dir outputs/tiny-math-dppo-cli": Covered(
        "tests/integration/test_async_server.py"
    ),
    "dppo-trl train --config examples/recipes/qwen3_8b_base_dapo_math.yaml --accelerate_config "
    "examples/recipes/accelerate/zero3.yaml": CannotRun(GPU),
    "dppo-trl train --config examples/recipes/qwen3_30b_a3b_base_lora_dapo_math.yaml --accelerate_config "
    "examples/recipes/accelerate/zero3.yaml": CannotRun(GPU),
    "dppo-trl vllm-serve --model Qwen/Qwen3-8B-Base --data_parallel_size 8 --max_model_len 10240": CannotRun(
        "GPU-only: TRL's server (what `dppo-trl vllm-serve` runs on a GPU) needs CUDA vLLM, 8 GPUs and the Hub"
    ),
    "dppo-trl train --accelerate_config examples/recipes/accelerate/zero3_multinode.yaml --machine_rank $NODE_RANK "
    "--main_process_ip $MAIN_NODE_IP --config examples/recipes/qwen3_8b_base_dapo_math_server.yaml "
    "--vllm_server_host $VLLM_NODE_IP": CannotRun("GPU-only: two 8-GPU training nodes and a vLLM node"),
    ".venv/bin/dppo-trl train --use_vllm --vllm_mode server --vllm_server_host 127.0.0.1 --vllm_server_port 8000 "
    "--output_dir outputs/tiny-math-server-cli": Covered("tests/integration/test_async_server.py"),
    "accelerate launch --config_file examples/recipes/accelerate/zero3.yaml examples/train_dapo_math.py "
    "--config examples/recipes/qwen3_8b_base_dapo_math.yaml": CannotRun(GPU),
    "accelerate launch --config_file examples/recipes/accelerate/zero3.yaml examples/train_dapo_math.py "
    "--config examples/recipes/qwen3_30b_a3b_base_lora_dapo_math.yaml": CannotRun(GPU),
    "trl vllm-serve --model Qwen/Qwen3-8B-Base --data_parallel_size 8 --max_model_len 10240": CannotRun(
        "GPU-only: TRL's server needs the CUDA `vllm` distribution, 8 GPUs and the Hub"
    ),
    "accelerate launch --config_file examples/recipes/accelerate/zero3_multinode.yaml --machine_rank $NODE_RANK "
    "--main_process_ip $MAIN_NODE_IP examples/train_dapo_math.py --config "
    "examples/recipes/qwen3_8b_base_dapo_math_server.yaml --vllm_server_host $VLLM_NODE_IP": CannotRun(
        "GPU-only: two 8-GPU training nodes and a vLLM node"
    ),
    ".venv/bin/python -m dppo_trl.backends.cpu.vllm_server --model examples/tiny_math_model --port 8000": Run(
        ("--dry-run",)
    ),
    ".venv/bin/python examples/train_dapo_math.py --use_vllm --vllm_mode server --vllm_server_host 127.0.0.1 "
    "--vllm_server_port 8000 --output_dir outputs/tiny-math-server": Covered("tests/system/test_vllm_server.py"),
    ".venv/bin/torchrun --nproc_per_node 2 --master_port 29511 examples/train_dapo_math.py --use_vllm --vllm_mode "
    "server --vllm_server_host 127.0.0.1 --vllm_server_port 8000 --output_dir outputs/tiny-math-server-2ranks": Covered(
        "tests/system/test_vllm_server.py"
    ),
    ".venv/bin/torchrun --nproc_per_node 2 --master_port 29601 examples/train_dapo_math.py "
    "--output_dir outputs/tiny-math-ddp-torchrun": Covered("tests/system/test_multiprocess.py"),
    ".venv/bin/accelerate launch --multi_gpu --num_processes 2 --main_process_port 29601 examples/train_dapo_math.py "
    "--output_dir outputs/tiny-math-ddp-accelerate": Covered("tests/system/test_multiprocess.py"),
    ".venv/bin/accelerate launch --config_file examples/recipes/accelerate/zero3_cpu.yaml --main_process_port 29601 "
    "examples/train_dapo_math.py --use_cpu false --ddp_backend gloo --output_dir outputs/tiny-math-zero3": Covered(
        "tests/system/test_multiprocess.py"
    ),
    "scripts/gpu_wheels.sh [DIR] [--python 3.12]": CannotRun(
        "downloads the GPU machine's wheels from PyPI (network); tests/system/test_gpu_check.py checks the script offline"
    ),
    "scripts/gpu_wheels.sh --refresh DIR": Covered("tests/system/test_gpu_check.py"),
    "scripts/gpu_check.sh OUT_DIR": CannotRun("GPU-only: installs the wheels and runs the CUDA checks"),
    "scripts/gpu_check.sh --dry-run OUT_DIR": Covered("tests/system/test_gpu_check.py"),
    # docs/results.md
    ".venv/bin/python benchmarks/sanity/run.py --output-dir benchmarks/sanity/results": CannotRun(
        "about 10 minutes on 2 cores (the committed results); its --quick form is run below"
    ),
    ".venv/bin/python benchmarks/sanity/run.py --learning-rate 2e-3 --steps 96 --output-dir "
    "benchmarks/sanity/results/lr2e-3": Run(("--quick",)),
    ".venv/bin/python benchmarks/sanity/run.py --quick --output-dir /tmp/sanity-quick": Covered(
        "tests/system/test_sanity_benchmark.py"
    ),
    ".venv/bin/python benchmarks/sanity/sweep.py": CannotRun("hours: 7 methods x 4 mismatch levels x 3 seeds"),
    ".venv/bin/python benchmarks/sanity/sweep.py --quick --output-dir /tmp/sweep": Covered(
        "tests/system/test_mismatch_sweep.py"
    ),
    ".venv/bin/python benchmarks/sanity/sweep.py --levels none,noise=0.3 --methods "
    "dppo_tv,dppo_kl,grpo_clip,clip_higher,pg_is --seeds 5,6,7,8,9,10,11,12,13,14,15,16,17,18,19 --output-dir "
    "benchmarks/sanity/results/mismatch_seeds --port-base 36000": CannotRun(
        "150 runs, about 30 minutes of 2 cores (the committed results); the sweep's --quick form is covered"
    ),
    ".venv/bin/python benchmarks/sanity/sweep.py --levels kv=fp8_e5m2 --methods "
    "dppo_tv,dppo_kl,grpo_clip,clip_higher,pg_is --seeds 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19 "
    "--output-dir benchmarks/sanity/results/mismatch_engine --port-base 36200": CannotRun(
        "100 runs, about 25 minutes of 2 cores (the committed results); the sweep's --quick form is covered"
    ),
    ".venv/bin/python benchmarks/sanity/compare.py --sweeps benchmarks/sanity/results/mismatch_sweep/sweep.json "
    "benchmarks/sanity/results/mismatch_seeds/sweep.json --levels none,noise=0.3 --output-dir "
    "benchmarks/sanity/results/mismatch_seeds": Run(),
    ".venv/bin/python benchmarks/sanity/compare.py --sweeps benchmarks/sanity/results/mismatch_sweep/sweep.json "
    "benchmarks/sanity/results/mismatch_seeds/sweep.json benchmarks/sanity/results/mismatch_engine/sweep.json "
    "--levels none,kv=fp8_e5m2 --test-levels kv=fp8_e5m2 --output-dir benchmarks/sanity/results/mismatch_engine": Run(),
    ".venv/bin/python benchmarks/sanity/sweep.py --levels none,noise=0.3 --methods dppo_tv,grpo_clip,clip_higher "
    "--seeds 20-99 --workers 1 --threads 1 --resume --output-dir benchmarks/sanity/results/mismatch_seeds100 "
    "--port-base 36000": CannotRun(
        "480 runs, hours of 2 cores (issue 27's study, run in chunks); resuming from the record is covered by "
        "tests/system/test_mismatch_sweep.py::test_resume_from_the_committed_record"
    ),
    ".venv/bin/python benchmarks/sanity/sweep.py --levels none,noise=0.3 --methods dppo_tv,grpo_clip,clip_higher "
    "--seeds 20-99 --output-dir benchmarks/sanity/results/mismatch_seeds100 --reaggregate": Covered(
        "tests/system/test_mismatch_sweep.py"
    ),
    ".venv/bin/python benchmarks/sanity/compare.py --sweeps benchmarks/sanity/results/mismatch_sweep/sweep.json "
    "benchmarks/sanity/results/mismatch_seeds/sweep.json benchmarks/sanity/results/mismatch_seeds100/runs.jsonl "
    "--levels none,noise=0.3 --methods dppo_tv,grpo_clip,clip_higher --against grpo_clip,clip_higher --secondary '' "
    "--target-seeds 100 --seed-blocks 0-19,20-99 --output-dir benchmarks/sanity/results/mismatch_seeds100": Run(),
    ".venv/bin/python scripts/make_tiny_math_bpe_model.py": CannotRun(
        "7 minutes of SFT on 1 core (the committed examples/tiny_math_bpe_model); tests/unit/test_tiny_bpe.py trains its "
        "tokenizer shrunk and checks the committed build"
    ),
    ".venv/bin/python benchmarks/sanity/token_tail.py --output benchmarks/sanity/results/token_tail.json": Run(
        ("--problems", "2", "--samples", "2")
    ),
    ".venv/bin/python benchmarks/sanity/sweep.py --model examples/tiny_math_bpe_model --levels noise=0.3 --methods "
    "dppo_tv,grpo_clip,clip_higher --seeds 0-39 --workers 1 --threads 1 --resume --output-dir "
    "benchmarks/sanity/results/bpe_seeds40 --port-base 36000": CannotRun(
        "120 runs, about an hour of 2 cores (issue 27's second study, run in chunks); the sweep's --quick form is "
        "covered"
    ),
    ".venv/bin/python benchmarks/sanity/compare.py --sweeps benchmarks/sanity/results/bpe_seeds40/runs.jsonl "
    "--levels noise=0.3 --methods dppo_tv,grpo_clip,clip_higher --against grpo_clip,clip_higher --secondary '' "
    "--target-seeds 40 --output-dir benchmarks/sanity/results/bpe_seeds40": Run(),
    ".venv/bin/python benchmarks/sanity/fig6_vocab.py --compare "
    "'bytes (259)=benchmarks/sanity/results/mismatch_seeds100/compare.json' --compare "
    "'BPE (8,192)=benchmarks/sanity/results/bpe_seeds40/compare.json' --level noise=0.3 --output-dir "
    "benchmarks/sanity/results/fig6_vocab": Run(),
    # docs/async.md
    ".venv/bin/python examples/train_dapo_math_async.py": Run(
        ("--max_steps", "2", "--eval_num_samples", "1", "--output_dir", "outputs/tiny-math-async-dppo")
    ),
    ".venv/bin/dppo-trl train-async --output_dir outputs/tiny-math-async-cli": Covered(
        "tests/integration/test_async_server.py"
    ),
    # docs/agents.md
    ".venv/bin/python scripts/make_tiny_agent_model.py": Covered("tests/unit/test_tiny_agent.py"),
    ".venv/bin/python examples/train_tool_agent.py": Covered("tests/system/test_tool_agent_example.py"),
    ".venv/bin/python examples/train_tool_agent.py --divergence binary_tv": Run(
        (
            "--max_steps",
            "2",
            "--steps_per_generation",
            "1",
            "--eval_problems",
            "4",
            "--output_dir",
            "outputs/agent-bin",
        )
    ),
    ".venv/bin/python examples/train_tool_agent.py --async": Run(
        ("--max_steps", "2", "--eval_problems", "4", "--output_dir", "outputs/tool-agent-async-dppo")
    ),
    "python examples/train_tool_agent.py --config examples/recipes/agents/qwen3_1.7b_calculator_agent.yaml": CannotRun(
        "GPU-only and unverified: Qwen3-1.7B from the Hub; tests/system/test_tool_agent_example.py parses the recipe"
    ),
    # docs/topk_memory.md
    ".venv/bin/python -m pytest tests/unit/test_topk_logps.py tests/unit/test_topk_reference.py -q": Run(
        ("--collect-only",)
    ),
    ".venv/bin/python benchmarks/topk_memory.py": Run(TOPK_SHRINK),
    ".venv/bin/python benchmarks/topk_memory.py --frozen-weight": Run(TOPK_SHRINK),
    ".venv/bin/python benchmarks/topk_memory.py --n-tokens 4096 --variants naive,topk_fused,binary_fused": Run(
        TOPK_SHRINK
    ),
    ".venv/bin/python benchmarks/topk_memory.py --variants '' --paired 3": Run((*TOPK_SHRINK, "--paired", "1")),
    ".venv/bin/python benchmarks/topk_memory.py --variants binary_trl,kept_set --repeats 2": Run(TOPK_SHRINK),
    ".venv/bin/python benchmarks/topk_memory.py --variants binary_trl,kept_set --repeats 2 --frozen-weight": Run(
        TOPK_SHRINK
    ),
    "python benchmarks/topk_memory.py --device cuda --dtype bfloat16 --vocab 151936 --hidden 4096 --n-tokens 8192 "
    "--repeats 3": CannotRun("GPU-only (CUDA); scripts/gpu_check.sh runs it"),
}


def _normalised(argv: list[str]) -> str:
    # Words as the shell passes them, one space apart; only an empty argument keeps its quotes.
    return " ".join(shlex.quote(a) if not a or " " in a else a for a in argv)


def documented_commands() -> list[tuple[str, str]]:
    """(file, normalised command) for every command of every fenced bash block, in document order."""
    out = []
    for path in DOCS:
        blocks = re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", path.read_text(), flags=re.S | re.M)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                argv = shlex.split(line, comments=True)
                if argv:
                    out.append((path.relative_to(REPO_ROOT).as_posix(), _normalised(argv)))
    return out


def test_every_documented_command_has_a_decision():
    commands = documented_commands()
    assert commands, "no fenced bash block found"
    missing = [f"{file}: {command!r}" for file, command in commands if command not in DECISIONS]
    assert not missing, "add each to DECISIONS (run, covered, or why it cannot run here):\n" + "\n".join(missing)
    stale = set(DECISIONS) - {command for _, command in commands}
    assert not stale, f"DECISIONS for commands no longer in the docs: {sorted(stale)}"


def test_cpu_commands_use_the_setups_venv():
    # A bare `python` is the system's (ModuleNotFoundError after the README's set-up): CPU commands name the venv.
    for _, command in documented_commands():
        if isinstance(DECISIONS.get(command), Run | Covered):
            first = shlex.split(command.removeprefix("bash scripts/setup.sh && "))[0]
            assert first.startswith((".venv/bin/", "scripts/")), command


def test_covering_tests_exist_and_run_the_script():
    for command, decision in DECISIONS.items():
        if isinstance(decision, Covered):
            text = (REPO_ROOT / decision.test).read_text()
            argv = shlex.split(command)
            if Path(argv[0]).name == "dppo-trl":
                # The console script: the covering test runs it with the same subcommand.
                assert "DPPO_TRL" in text and f'"{argv[1]}"' in text, (decision.test, argv[1])
                continue
            script = next((a for a in argv if a.endswith(".py")), None)
            # The multi-process launches run the tests' own training script with the same launchers and configs.
            if script and "multiprocess" not in decision.test and "vllm_server" not in decision.test:
                assert Path(script).name in text or Path(script).stem in text, (decision.test, script)


def test_files_named_in_the_docs_exist():
    # Commands' scripts and configs, and the Markdown files the docs cite, are in the repository.
    missing = []
    for file, command in documented_commands():
        for arg in shlex.split(command):
            if re.fullmatch(r"(examples|benchmarks|scripts|tests)/[\w./-]+\.(py|yaml|sh)", arg):
                if not (REPO_ROOT / arg).exists():
                    missing.append(f"{file}: {arg}")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    names = {Path(line).name for line in tracked.splitlines()} | {line for line in tracked.splitlines()}
    for path in DOCS:
        # Links and backticked names; a bare name may be any tracked file (`tables.md` is the benchmark's output).
        for name in re.findall(r"[`(]([\w./-]+\.md)\b", path.read_text()):
            if name not in names and (path.parent / name).resolve().relative_to(REPO_ROOT).as_posix() not in names:
                missing.append(f"{path.relative_to(REPO_ROOT)}: {name}")
    assert not missing, missing


def _rewrite(command: str, decision: Run, workdir: Path) -> list[str]:
    argv = shlex.split(command.removeprefix("bash scripts/setup.sh && "))
    if argv[0].startswith(".venv/bin/"):
        argv[0] = str(VENV_BIN / argv[0].removeprefix(".venv/bin/"))
    out = []
    for i, arg in enumerate(argv):
        # Never the program: a clone under /tmp has its venv there too.
        is_output = i > 0 and argv[i - 1] in OUTPUT_OPTIONS
        if i > 0 and (is_output or arg.startswith(("outputs/", "/tmp/"))):
            arg = str(workdir / arg.lstrip("/"))
        out.append(arg)
    shrink = list(decision.shrink)
    for i, arg in enumerate(shrink):
        if i > 0 and shrink[i - 1] in OUTPUT_OPTIONS:
            shrink[i] = str(workdir / arg)
    return out + shrink


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.no_lane
def test_documented_commands_run(tmp_path):
    from conftest import get_free_port

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    failures, done = [], set()
    for file, command in documented_commands():
        decision = DECISIONS[command]
        if not isinstance(decision, Run) or command in done:
            continue
        done.add(command)
        argv = _rewrite(command, decision, tmp_path)
        # A port of the test's own for the colocated engine's process group (never TRL's 29500 fallback).
        run_env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()))
        proc = subprocess.run(argv, cwd=REPO_ROOT, env=run_env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            failures.append(
                f"{file}: {command}\n  ran {shlex.join(argv)}\n  exit {proc.returncode}\n{proc.stderr[-3000:]}"
            )
            continue
        if "benchmarks/" in command:
            try:
                report = json.loads(proc.stdout)
                assert isinstance(report, dict)
            except (ValueError, AssertionError):
                failures.append(f"{file}: {command}\n  stdout is not one JSON object:\n{proc.stdout[:1500]}")
                continue
            if report.get("failed") or report.get("failed_runs"):
                failures.append(
                    f"{file}: {command}\n  reports failures: {report.get('failed') or report['failed_runs']}"
                )
    assert not failures, "\n\n".join(failures)
    # What the later commands read was written by the earlier ones.
    assert (tmp_path / "outputs" / "compare_runs.png").exists()
    assert (tmp_path / "outputs" / "run1" / "checkpoint-2").is_dir()
