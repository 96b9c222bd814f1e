#!/usr/bin/env bash
# Every GPU check of dppo-trl in one command, on a CUDA machine that cannot reach PyPI:
#
#   scripts/gpu_check.sh OUT_DIR            # on the GPU machine, with the wheel folder built by scripts/gpu_wheels.sh
#   scripts/gpu_check.sh --dry-run OUT_DIR  # anywhere, no CUDA: the same install and every command, on CPU
#
# Steps (real run): check the wheel folder against its manifest, its dppo-trl wheel against this checkout (a wheel
# built before a change would test old code: refused, naming the fix), and the machine against what the wheels expect;
# select the test files holding `gpu`-marked tests (none is a failure); install the wheels with
# `PYTHON -m pip install --no-index --no-deps --target SITE` (a temporary folder) and run everything with
# `PYTHONPATH=SITE:<checkout>:<checkout>/examples` and PYTHON itself, so the machine's CUDA torch and triton are used
# even when PYTHON is a virtual environment (a venv made from it with --system-site-packages would see the base
# interpreter's packages instead); check that torch imports from the machine and every installed wheel's package
# from SITE; run the `gpu`-marked tests; benchmarks/topk_memory.py at V = 151,936 in bf16 on CUDA (the trainer's
# top-K path, design A, naive full logits and the two binary paths); benchmarks/gpu_train.py (a ~100M-parameter
# Qwen3-shaped model, transformers generation, binary_tv and topk_tv, use_liger_kernel off and on).
# The dry run installs and imports the same way (no CUDA needed), builds the dppo-trl wheel with PYTHON as
# scripts/gpu_wheels.sh does, collects the selected tests refusing any import of this project's that neither the
# wheels nor the machine provide (`gpu_manifest.py pytest`), checks the benchmarks' command lines, and checks that
# benchmarks/gpu_train.py exits non-zero when its run fails. Every step is bounded below 600 s (the lent machine's
# limit per command). OUT_DIR/gpu_check.json (one object: each step's exit code, seconds and output; "finished" once
# all ran) is rewritten after every step, so a run killed midway keeps what it measured; OUT_DIR/gpu_check.log holds
# everything printed. Exit code 0 only if every step passed.
#
# Environment: GPU_WHEELS_DIR (default .gpu_wheels; wheels for PYTHON's version), PYTHON (default python3: the
# machine's CUDA PyTorch, with pip).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

DRY=0
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) OUT="$1"; shift ;;
  esac
done
if [ -z "$OUT" ]; then
  echo "usage: scripts/gpu_check.sh [--dry-run] OUT_DIR" >&2
  exit 2
fi
WHEELS="${GPU_WHEELS_DIR:-.gpu_wheels}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
PARTS="$(mktemp -d)"
trap 'rm -rf "$PARTS"' EXIT
SITE="$PARTS/site"  # the installed wheels: a few seconds to install, so never kept between runs
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# The tests' offline settings (tests/conftest.py sets them too); nothing is fetched from the Hub.
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
if ! PY_VERSION="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"; then
  echo "gpu_check: PYTHON=$PYTHON does not run; set PYTHON to the machine's CUDA PyTorch interpreter" >&2
  exit 2
fi
# Everything after the install runs as PYTHON with the wheels first on the path; the checkout is there for `dppo_dev`
# and `dapo_math` (not in the wheel). `-P` keeps `-m pytest` and `-c` from putting the checkout's own dppo_trl ahead
# of the wheel's (Python >= 3.11, which TRL 1.16 needs anyway).
RUN=(env PYTHONPATH="$SITE:$PWD:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON")
TOPK_ARGS=(--device cuda --dtype bfloat16 --vocab 151936 --hidden 4096 --n-tokens 8192 --k 20 --repeats 3)

# The JSON report, rewritten after every step (`report`) and once more at the end (`report final`): each step's exit
# code, seconds and output (parsed when it is JSON); "finished" and "ok" only once every step has run.
cat >"$PARTS/report.py" <<'PY'
import json, os, sys
parts, target, dry, final = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "final"
steps = {}
names = {f.split(".")[0] for f in os.listdir(parts) if f.endswith(".rc")}
for name in sorted(names, key=lambda n: os.path.getmtime(os.path.join(parts, n + ".rc"))):
    read = lambda ext: open(os.path.join(parts, f"{name}.{ext}")).read().strip() if os.path.exists(os.path.join(parts, f"{name}.{ext}")) else ""
    out = read("out")
    try:
        parsed = json.loads(out)
    except ValueError:
        parsed = out.splitlines()[-20:]
    steps[name] = {"rc": int(read("rc")), "seconds": int(read("s") or 0), "output": parsed}
junit = os.path.join(parts, "junit.xml")
if os.path.exists(junit) and "gpu_tests" in steps:
    import xml.etree.ElementTree as ET
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    steps["gpu_tests"]["junit"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
ok = final and bool(steps) and all(s["rc"] == 0 for s in steps.values())
if not dry and "gpu_train" in steps:
    ok = ok and isinstance(steps["gpu_train"]["output"], dict) and steps["gpu_train"]["output"].get("ok", False)
if not dry and "gpu_tests" in steps:
    ok = ok and steps["gpu_tests"].get("junit", {}).get("skipped", 1) == 0  # a skipped gpu test did not run
tmp = target + ".tmp"
with open(tmp, "w") as f:
    json.dump({"dry_run": dry, "finished": final, "ok": ok, "steps": steps}, f, indent=1)
os.replace(tmp, target)  # a reader never sees half a report
if final:
    print(f"gpu_check: {'ok' if ok else 'FAILED'} -> {target}")
    sys.exit(0 if ok else 1)
PY
report() { "$PYTHON" "$PARTS/report.py" "$PARTS" "$OUT/gpu_check.json" "$DRY" "${1:-partial}"; }

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
  report
  return 0
}

# fail NAME MESSAGE: mark a step failed, saying why
fail() {
  echo "=== $1: $2" | tee -a "$LOG"
  echo 1 >"$PARTS/$1.rc"
  report
}

passed() { [ "$(cat "$PARTS/$1.rc")" = 0 ]; }

# contains NAME TEXT...: the step passes only if its output holds every TEXT
contains() {
  local name="$1"
  shift
  for text in "$@"; do
    grep -q -- "$text" "$PARTS/$name.out" || fail "$name" "output lacks '$text'"
  done
}

# The test files that hold a `gpu`-marked test (a decorator or a module-level `pytestmark`): exactly these run, so
# pytest never imports the vLLM test modules on a machine without vLLM. grep exits 1 when there is none.
step gpu_tests_select 60 grep -rlE --include='test_*.py' \
  '^[[:space:]]*(@pytest\.mark\.gpu\b|pytestmark[[:space:]]*=.*pytest\.mark\.gpu\b)' tests
passed gpu_tests_select || fail gpu_tests_select "no test file under tests/ holds a gpu-marked test"
mapfile -t GPU_TEST_FILES < <(sort "$PARTS/gpu_tests_select.out")

if [ "$DRY" = 1 ]; then
  step wheels 300 "$PYTHON" scripts/gpu_manifest.py check "$WHEELS" --python "$PY_VERSION"
  step scripts_parse 60 bash -n scripts/gpu_check.sh scripts/gpu_wheels.sh
  step python_compiles 60 "$PYTHON" -m py_compile benchmarks/topk_memory.py benchmarks/gpu_train.py scripts/gpu_manifest.py
  # What scripts/gpu_wheels.sh builds, with this PYTHON: it must not need setuptools, `wheel` or the network.
  step wheel_build 120 env PYTHON="$PYTHON" bash scripts/gpu_wheels.sh --no-download "$PARTS/built" --python "$PY_VERSION"
else
  step cuda 120 "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
  step wheels 300 "$PYTHON" scripts/gpu_manifest.py check "$WHEELS" --python "$PY_VERSION"
fi
# The dppo-trl wheel is always named dppo_trl-<version>: only its contents tell a wheel built before a change.
passed wheels && step wheel_fresh 120 "$PYTHON" scripts/gpu_manifest.py fresh "$WHEELS"

# The dry run goes on past a stale wheel (each of its steps checks its own class of defect); the real run does not.
if passed wheels && { [ "$DRY" = 1 ] || { passed cuda && passed wheel_fresh; }; }; then
  step machine 120 "$PYTHON" scripts/gpu_manifest.py machine "$WHEELS"
  # --no-deps: the folder holds every wheel needed (the manifest says so) and the machine provides the rest.
  step install 300 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl
  CUDA_FLAG=()
  [ "$DRY" = 1 ] || CUDA_FLAG=(--cuda)
  step imports 300 "${RUN[@]}" -P scripts/gpu_manifest.py imports "$WHEELS" "$SITE" "${CUDA_FLAG[@]}"
  if [ "$DRY" = 1 ]; then
    # Every step below runs even if one above failed: each checks its own class of defect.
    # With no file selected pytest would collect the whole suite (vLLM's tests included): not run then.
    if passed gpu_tests_select; then
      # Collected as on the machine: an import of this project's that neither the wheels nor the machine provide fails.
      step gpu_tests_collect 300 "${RUN[@]}" -P scripts/gpu_manifest.py pytest "$SITE" -- \
        --collect-only -q -p no:cacheprovider -m gpu "${GPU_TEST_FILES[@]}"
      for file in "${GPU_TEST_FILES[@]}"; do contains gpu_tests_collect "$file::"; done
    fi
    step topk_memory_cli 120 "${RUN[@]}" benchmarks/topk_memory.py --help
    contains topk_memory_cli --device --dtype --vocab --variants
    step gpu_train_cli 120 "${RUN[@]}" benchmarks/gpu_train.py --help
    contains gpu_train_cli --size --liger --divergences
    # A run that fails (here: a divergence DPPOConfig rejects) must make the benchmark exit non-zero.
    step gpu_train_fails 300 "${RUN[@]}" benchmarks/gpu_train.py --size tiny --device cpu --liger off --steps 1 \
      --divergences no_such_divergence
    if passed gpu_train_fails; then
      fail gpu_train_fails "benchmarks/gpu_train.py exited 0 although its run failed"
    else
      echo 0 >"$PARTS/gpu_train_fails.rc"
      contains gpu_train_fails '"ok": false'
    fi
  elif passed install && passed imports && passed gpu_tests_select; then
    # Bounded below the lent machine's 600 s per command (on the H100: tests 22 s, top-K memory 90 s, training 91 s).
    step gpu_tests 540 "${RUN[@]}" -P -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$PARTS/junit.xml" "${GPU_TEST_FILES[@]}"
    step topk_memory 540 "${RUN[@]}" benchmarks/topk_memory.py "${TOPK_ARGS[@]}"
    step gpu_train 540 "${RUN[@]}" benchmarks/gpu_train.py
  fi
else
  echo "=== skipping the steps that need the installed wheels: no CUDA device, no valid wheel folder or a stale dppo-trl wheel (see above)" | tee -a "$LOG"
fi

report final
