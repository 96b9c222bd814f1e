#!/usr/bin/env bash
# The fast lane: lint, format and type checks, seconds instead of the suite's minutes. Run after scripts/setup.sh;
# .ci/run runs it before the test suite, and .pre-commit-config.yaml runs the same ruff checks on each commit.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DPPO_VENV:-.venv}"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/python" -m mypy
echo "lint lane: ruff check, ruff format --check and mypy passed"
