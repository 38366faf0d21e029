#!/usr/bin/env bash
# Fresh machine -> trained LoRA and a sample image: set up, then run the example workflow headless.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/pt.py demo
