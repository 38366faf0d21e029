#!/usr/bin/env bash
# Fresh machine -> test results: set up (incl. the Flux-min fixture for the slow tier), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PIPETRAINER_FLUX=1 bash scripts/setup.sh
.venv/bin/python -m pytest "$@"
