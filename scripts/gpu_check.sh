#!/usr/bin/env bash
# Every GPU check of dppo-trl in one command, on a CUDA machine that cannot reach PyPI:
#
#   scripts/gpu_check.sh OUT_DIR            # on the GPU machine, with the wheel folder built by scripts/gpu_wheels.sh
#   scripts/gpu_check.sh --dry-run OUT_DIR  # anywhere, no CUDA: checks the wheel folder and every command it would run
#
# Steps (real run): check the wheel folder against its manifest and the machine against what the wheels expect;
# install the wheels into a virtual environment on top of the machine's packages (`--system-site-packages`, so its
# CUDA torch and triton are used) with `pip install --no-index --find-links`; run the `gpu`-marked tests;
# benchmarks/topk_memory.py at V = 151,936 in bf16 on CUDA (the trainer's top-K path, design A, naive full logits and
# the two binary paths); benchmarks/gpu_train.py (a ~100M-parameter Qwen3-shaped model, transformers generation,
# binary_tv and topk_tv, use_liger_kernel off and on). Writes OUT_DIR/gpu_check.json (one object: each step's exit
# code and output) and OUT_DIR/gpu_check.log (everything printed). Exit code 0 only if every step passed.
#
# Environment: GPU_WHEELS_DIR (default .gpu_wheels), PYTHON (default python3: the machine's CUDA PyTorch),
# GPU_CHECK_VENV (default /tmp/dppo-gpu-venv). Not verified on a GPU yet: written and dry-run on a CPU-only machine.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) OUT="$1"; shift ;;
  esac
done
if [ -z "$OUT" ]; then
  echo "usage: scripts/gpu_check.sh [--dry-run] OUT_DIR" >&2
  exit 2
fi
WHEELS="${GPU_WHEELS_DIR:-.gpu_wheels}"
PYTHON="${PYTHON:-python3}"
VENV="${GPU_CHECK_VENV:-/tmp/dppo-gpu-venv}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
PARTS="$(mktemp -d)"
trap 'rm -rf "$PARTS"' EXIT
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# The tests' offline settings (tests/conftest.py sets them too); nothing is fetched from the Hub.
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false

GPU_TEST_FILES=$(grep -l "pytest.mark.gpu" tests/test_*.py | tr '\n' ' ')
TOPK_ARGS=(--device cuda --dtype bfloat16 --vocab 151936 --hidden 4096 --n-tokens 8192 --k 20 --repeats 3)

# step NAME TIMEOUT_S COMMAND...: run it, keep its stdout in $PARTS/NAME.out, its exit code in $PARTS/NAME.rc
step() {
  local name="$1" limit="$2"
  shift 2
  echo "=== $name: $*" | tee -a "$LOG"
  local start=$SECONDS
  timeout "$limit" "$@" >"$PARTS/$name.out" 2> >(tee -a "$LOG" >&2)
  local rc=$?
  cat "$PARTS/$name.out" >>"$LOG"
  echo "$rc" >"$PARTS/$name.rc"
  echo "$((SECONDS - start))" >"$PARTS/$name.s"
  echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOG"
  return 0
}

# contains NAME TEXT...: the step passes only if its output holds every TEXT
contains() {
  local name="$1"
  shift
  for text in "$@"; do
    if ! grep -q -- "$text" "$PARTS/$name.out"; then
      echo "=== $name: output lacks '$text'" | tee -a "$LOG"
      echo 1 >"$PARTS/$name.rc"
    fi
  done
}

if [ "$DRY" = 1 ]; then
  step wheels 300 "$PYTHON" scripts/gpu_manifest.py check "$WHEELS"
  step scripts_parse 60 bash -n scripts/gpu_check.sh scripts/gpu_wheels.sh
  step python_compiles 60 "$PYTHON" -m py_compile benchmarks/topk_memory.py benchmarks/gpu_train.py scripts/gpu_manifest.py
  # shellcheck disable=SC2086  # a list of file names without spaces
  step gpu_tests_collect 300 "$PYTHON" -m pytest --collect-only -q -p no:cacheprovider -m gpu $GPU_TEST_FILES
  contains gpu_tests_collect "::"
  step topk_memory_cli 120 "$PYTHON" benchmarks/topk_memory.py --help
  contains topk_memory_cli --device --dtype --vocab --variants
  step gpu_train_cli 120 "$PYTHON" benchmarks/gpu_train.py --help
  contains gpu_train_cli --size --liger --divergences
  step manifest_cli 60 "$PYTHON" scripts/gpu_manifest.py --help
else
  step cuda 120 "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
  step wheels 300 "$PYTHON" scripts/gpu_manifest.py check "$WHEELS" --python "$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
  step machine 120 "$PYTHON" scripts/gpu_manifest.py machine "$WHEELS"
  if [ "$(cat "$PARTS/cuda.rc")" = 0 ] && [ "$(cat "$PARTS/wheels.rc")" = 0 ]; then
    step venv 300 "$PYTHON" -m venv --system-site-packages "$VENV"
    step install 600 "$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.txt"
    step versions 120 "$VENV/bin/python" -c "import torch, trl, transformers, peft, accelerate, datasets, liger_kernel, dppo_trl; print(dict(torch=torch.__version__, trl=trl.__version__, transformers=transformers.__version__, peft=peft.__version__, dppo_trl=dppo_trl.__version__, gpu=torch.cuda.get_device_name()))"
    # shellcheck disable=SC2086
    step gpu_tests 900 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$PARTS/junit.xml" $GPU_TEST_FILES
    # The benchmark's helpers (`dppo_dev`, not in the wheel) from this checkout; scripts/setup.sh installs them instead.
    step topk_memory 900 env PYTHONPATH="$PWD" "$VENV/bin/python" benchmarks/topk_memory.py "${TOPK_ARGS[@]}"
    step gpu_train 1800 "$VENV/bin/python" benchmarks/gpu_train.py
  else
    echo "=== skipping the checks: no CUDA device or no valid wheel folder (see above)" | tee -a "$LOG"
  fi
fi

# One JSON object: each step's exit code, seconds and output (parsed when it is JSON).
"$PYTHON" - "$PARTS" "$OUT/gpu_check.json" "$DRY" <<'PY'
import json, os, sys
parts, target, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
steps = {}
for name in sorted({f.split(".")[0] for f in os.listdir(parts) if f.endswith(".rc")}, key=lambda n: os.path.getmtime(os.path.join(parts, n + ".rc"))):
    read = lambda ext: open(os.path.join(parts, f"{name}.{ext}")).read().strip()
    out = read("out")
    try:
        parsed = json.loads(out)
    except ValueError:
        parsed = out.splitlines()[-20:]
    steps[name] = {"rc": int(read("rc")), "seconds": int(read("s")), "output": parsed}
junit = os.path.join(parts, "junit.xml")
if os.path.exists(junit):
    import xml.etree.ElementTree as ET
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    steps["gpu_tests"]["junit"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
ok = bool(steps) and all(s["rc"] == 0 for s in steps.values())
if not dry and "gpu_train" in steps:
    ok = ok and isinstance(steps["gpu_train"]["output"], dict) and steps["gpu_train"]["output"].get("ok", False)
if not dry and "gpu_tests" in steps:
    ok = ok and steps["gpu_tests"].get("junit", {}).get("skipped", 1) == 0  # a skipped gpu test did not run
json.dump({"dry_run": dry, "ok": ok, "steps": steps}, open(target, "w"), indent=1)
print(f"gpu_check: {'ok' if ok else 'FAILED'} -> {target}")
sys.exit(0 if ok else 1)
PY
