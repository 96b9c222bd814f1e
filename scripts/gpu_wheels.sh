#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on a GPU machine that cannot reach PyPI, into DIR (default
# .gpu_wheels/, git-ignored): the pinned list scripts/gpu_wheels.txt as manylinux x86_64 / pure-Python wheels for one
# CPython version, plus the dppo-trl wheel built from this checkout. Writes DIR/manifest.json and DIR/requirements.txt
# (scripts/gpu_manifest.py) and fails if DIR exceeds 64 MiB (what travels to the GPU machine).
#
#   scripts/gpu_wheels.sh [DIR] [--python 3.12]      # run where pip reaches PyPI; PYTHON picks the pip to use
#   scripts/gpu_wheels.sh --no-download DIR          # only the dppo-trl wheel and the manifest (no network)
#   scripts/gpu_wheels.sh --refresh DIR              # after a change: replace only the dppo-trl wheel (no network),
#                                                    # keep the downloaded wheels, rewrite the manifest
#
# The dppo-trl wheel is written by `scripts/gpu_manifest.py wheel` with the standard library, so any Python 3 builds
# it (a bare one has no setuptools, or one without `bdist_wheel`); `scripts/gpu_check.sh --dry-run` runs the
# `--no-download` form with its PYTHON. The downloads need PyPI and a pip; nothing is built or fetched for the build.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=.gpu_wheels
TARGET_PY=3.12  # the lent H100/H200 image's python3 (see docs/recipes.md, "GPU checks")
DOWNLOAD=1
REFRESH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) TARGET_PY="$2"; shift 2 ;;
    --no-download) DOWNLOAD=0; shift ;;
    --refresh) REFRESH=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) DIR="$1"; shift ;;
  esac
done
PYTHON="${PYTHON:-python3}"
ABI="cp${TARGET_PY/./}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

if [ "$REFRESH" = 1 ]; then
  # The dppo-trl wheel is always named dppo_trl-<version>, so a folder built before a change would install old code
  # (scripts/gpu_check.sh refuses it): rebuild just that wheel, for the Python the manifest records.
  "$PYTHON" scripts/gpu_manifest.py refresh "$DIR"
  du -sh "$DIR"
  exit 0
fi

mkdir -p "$DIR"
rm -f "$DIR"/*.whl "$DIR/manifest.json" "$DIR/requirements.txt"  # one version of each package, nothing stale

if [ "$DOWNLOAD" = 1 ]; then
  platforms=()
  for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
  done
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${platforms[@]}" \
    --python-version "$TARGET_PY" --implementation cp --abi "$ABI" --abi abi3 --abi none \
    -d "$DIR" -r scripts/gpu_wheels.txt
fi
# The package itself (pure Python), from this checkout, by the standard library: no build backend to install or fetch.
"$PYTHON" scripts/gpu_manifest.py wheel "$DIR"

"$PYTHON" scripts/gpu_manifest.py write "$DIR" --python "$TARGET_PY"
du -sh "$DIR"
