#!/usr/bin/env bash
# The current ComfyUI test host, next to the pinned 0.3.75 one of scripts/setup.sh: ComfyUI v0.33.0 (master
# of 2026-08-22, commit 783545f) with a venv of its own, .host/current/venv, from requirements-current.lock
# (see requirements-current.in for why it cannot share .venv), scripts/torchaudio_stub.py as its torchaudio,
# this pack linked into its custom_nodes and the tiny fixtures in its models folder.
# Where the ComfyUI tree comes from, the first that applies:
#   1. $COMFYUI_PATH, used as it is (whatever version it is);
#   2. ../shared/hosts/comfyui-0.33.0-783545f.tar.xz beside this checkout (CI has it), unpacked into
#      .host/current/ComfyUI;
#   3. a clone of ComfyUI's repository at 783545f into .host/current/ComfyUI, where GitHub can be reached.
# Prints the ComfyUI folder as its only line on stdout (everything else goes to stderr). When none of the
# three can be had it prints why instead and exits 3, so scripts/test.sh can say the tier was skipped.
# Idempotent: a second run only checks (a stamp in the tree and one in the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
exec 3>&1 1>&2
VERSION=0.33.0
COMMIT=783545f
TARBALL=${COMFYUI_TARBALL:-../shared/hosts/comfyui-$VERSION-$COMMIT.tar.xz}
GIT_URL=${COMFYUI_GIT_URL:-https://github.com/comfyanonymous/ComfyUI}
PYTHON=${PYTHON:-python3}
HOST=$PWD/.host/current

if [ -n "${COMFYUI_PATH:-}" ]; then
  if [ ! -f "$COMFYUI_PATH/main.py" ]; then
    echo "COMFYUI_PATH=$COMFYUI_PATH has no main.py: point it at a ComfyUI checkout" >&2
    exit 1
  fi
  root=$(cd "$COMFYUI_PATH" && pwd)
else
  root=$HOST/ComfyUI
  source_id="ComfyUI $VERSION $COMMIT"
  if [ "$(cat "$root/.pipetrainer-source" 2>/dev/null)" != "$source_id" ]; then
    staging=$root.building
    rm -rf "$root" "$staging"  # a link inside (custom_nodes/ComfyUI-PipeTrainer) is removed, not followed
    mkdir -p "$HOST"
    if [ -f "$TARBALL" ]; then
      echo "current host: unpacking $TARBALL"
      mkdir -p "$staging"
      tar -xJf "$TARBALL" -C "$staging" --strip-components=1
    else
      echo "current host: no $TARBALL; cloning $GIT_URL at $COMMIT"
      if ! GIT_TERMINAL_PROMPT=0 timeout 900 git clone -q --filter=blob:none --no-checkout "$GIT_URL" "$staging" \
          || ! git -C "$staging" -c advice.detachedHead=false checkout -q "$COMMIT"; then
        rm -rf "$staging"
        echo "no ComfyUI $VERSION: COMFYUI_PATH is not set, there is no $TARBALL and $GIT_URL could not be cloned" \
             "at $COMMIT" >&3
        exit 3
      fi
    fi
    if ! grep -q "\"$VERSION\"" "$staging/comfyui_version.py"; then
      echo "the ComfyUI tree from $TARBALL / $GIT_URL is not version $VERSION" >&2
      exit 1
    fi
    echo "$source_id" > "$staging/.pipetrainer-source"
    mv "$staging" "$root"
  fi
fi

venv=$HOST/venv
if [ ! -x "$venv/bin/python" ]; then
  "$PYTHON" -m venv "$venv"
fi
stamp=$venv/.pipetrainer-lock
want=$(cat requirements-current.lock scripts/torchaudio_stub.py | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "current host: installing requirements-current.lock into $venv"
  # once more after a pause: a registry hiccup should not cost a CI run
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r requirements-current.lock \
    || { echo "pip install failed; retrying once in 20 s"; sleep 20;
         "$venv/bin/python" -m pip install -q --disable-pip-version-check -r requirements-current.lock; }
  purelib=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$purelib/torchaudio"
  cp scripts/torchaudio_stub.py "$purelib/torchaudio/__init__.py"
  echo "$want" > "$stamp"
fi
# Bytecode for the ComfyUI tree (unpacked, not pip-installed, so it has none), compiled once here: with
# PYTHONDONTWRITEBYTECODE set (as on these machines) every process would otherwise compile the ~1000 modules it
# imports at each start. A file that does not compile is left to the import that needs it to report.
"$venv/bin/python" -m compileall -q -j 0 "$root" >/dev/null || true
COMFYUI_PATH=$root "$venv/bin/python" scripts/pt.py fixtures ${PIPETRAINER_FLUX:+--flux} >&2
echo "$root" >&3
