#!/usr/bin/env bash
# Fresh machine -> test results: set up (incl. the Flux-min fixture for the slow tier), then pytest.
# Two pytest-xdist workers, one test file each at a time (module fixtures are built once): the heavy
# tests are process trees that keep about one core busy, so two files side by side use a 2-core CI
# machine fully. PYTEST_WORKERS=0 runs everything in this process, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
PIPETRAINER_FLUX=1 bash scripts/setup.sh
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
