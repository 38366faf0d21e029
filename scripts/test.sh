#!/usr/bin/env bash
# Fresh machine -> test results, on two ComfyUI hosts (what CI runs):
#   current  ComfyUI v0.33.0 (scripts/current_host.sh: .host/current/ComfyUI and its venv .host/current/venv,
#            or $COMFYUI_PATH): the whole suite, slow tier included;
#   0.3.75   ComfyUI 0.3.75, the compatibility host (scripts/setup.sh: .host/ComfyUI and .venv): the fast tier
#            (-m 'not slow or frontend': with the browser test that opens every example in its own frontend),
#            the example workflow end to end (tests/test_e2e.py) among it.
# Where the current host cannot be had (no ../shared, no COMFYUI_PATH, no GitHub) the 0.3.75 host runs alone
# and the summary says the current-host tier was skipped and why.
# Arguments go to every pytest run (after the 0.3.75 run's -m, so a -m given here wins there).
# PIPETRAINER_HOSTS="current" or "0.3.75" runs one host only.
# Two pytest-xdist workers, one test file each at a time (module fixtures are built once): the heavy
# tests are process trees that keep about one core busy, so two files side by side use a 2-core CI
# machine fully. PYTEST_WORKERS=0 runs everything in this process, as before.
# Exits non-zero when a host's set-up or any pytest run fails; a run that selects no test (pytest's exit 5,
# e.g. -k matching nothing on one host) is reported and fails the script only when no run tested anything.
set -euo pipefail
cd "$(dirname "$0")/.."
hosts=" ${PIPETRAINER_HOSTS:-current 0.3.75} "
workers=(-n "${PYTEST_WORKERS:-2}" --dist loadfile)
summary=()
failed=0
tested=0

run_pytest() {  # label python comfyui-root pytest-args...
  local label=$1 python=$2 root=$3 rc=0 start=$SECONDS
  shift 3
  echo
  echo "=== pytest on ComfyUI $label: COMFYUI_PATH=$root, $python ==="
  COMFYUI_PATH=$root "$python" -m pytest "${workers[@]}" "$@" || rc=$?
  local took="$((SECONDS - start)) s"
  case $rc in
    0) tested=1; summary+=("ComfyUI $label: pytest passed ($took)") ;;
    5) summary+=("ComfyUI $label: pytest selected no test ($took)") ;;
    *) tested=1; failed=1; summary+=("ComfyUI $label: pytest FAILED with exit code $rc ($took)") ;;
  esac
}

# Both hosts are set up side by side (downloads and fixture builds overlap); each one's output is printed whole
# once it is done, and a failed set-up's last lines are repeated in the summary, where a CI log's tail shows them.
logs=$(mktemp -d)
setup_started=$SECONDS
if [[ $hosts == *" 0.3.75 "* ]]; then
  ( rc=0; env -u COMFYUI_PATH PIPETRAINER_FLUX=1 bash scripts/setup.sh >"$logs/0.3.75.log" 2>&1 || rc=$?
    echo "$rc $((SECONDS - setup_started))" >"$logs/0.3.75.rc" ) &
fi
if [[ $hosts == *" current "* ]]; then
  ( rc=0; PIPETRAINER_FLUX=1 bash scripts/current_host.sh >"$logs/current.out" 2>"$logs/current.log" || rc=$?
    echo "$rc $((SECONDS - setup_started))" >"$logs/current.rc" ) &
fi
wait

setup_failed() {  # label log
  failed=1
  summary+=("$1: set-up FAILED; its last lines:")
  while IFS= read -r line; do summary+=("    $line"); done < <(grep -v "^WARNING: Location" "$2" | tail -n 25)
}

compat_ready=0
if [ -f "$logs/0.3.75.rc" ]; then
  echo "=== set-up of ComfyUI 0.3.75 (scripts/setup.sh) ==="
  grep -v "^WARNING: Location" "$logs/0.3.75.log" || true
  read -r rc took <"$logs/0.3.75.rc"
  if [ "$rc" = 0 ]; then
    compat_ready=1
    summary+=("ComfyUI 0.3.75: set up ($took s)")
  else
    setup_failed "ComfyUI 0.3.75 (exit code $rc)" "$logs/0.3.75.log"
  fi
fi

current_root=
if [ -f "$logs/current.rc" ]; then
  echo "=== set-up of the current ComfyUI (scripts/current_host.sh) ==="
  grep -v "^WARNING: Location" "$logs/current.log" || true
  read -r rc took <"$logs/current.rc"
  out=$(cat "$logs/current.out")
  case $rc in
    0) current_root=$out; summary+=("ComfyUI current: set up ($took s)") ;;
    3) summary+=("ComfyUI current: tier SKIPPED: $out") ;;
    *) setup_failed "ComfyUI current (exit code $rc)" "$logs/current.log" ;;
  esac
fi

# The two venvs hold the same torch wheel (about 6 GB each): one copy on disk (devkit/disk.py says why).
if [ -n "$current_root" ] && [ "$compat_ready" = 1 ]; then
  summary+=("venvs: $(.venv/bin/python scripts/pt.py link-duplicates .venv .host/current/venv || echo 'link-duplicates failed')")
fi

# This pack's bytecode, compiled once (each training rank, server and launcher imports a few hundred of its modules,
# and with PYTHONDONTWRITEBYTECODE set, as on these machines, nothing would keep what they compile).
for python in .host/current/venv/bin/python .venv/bin/python; do
  if [ -x "$python" ]; then
    "$python" -m compileall -q -j 0 __init__.py nodes training patches devkit tests bench scripts >/dev/null || true
    break
  fi
done

if [ -n "$current_root" ]; then
  version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$current_root/comfyui_version.py")
  scope=", whole suite"
  [ $# = 0 ] || scope=""
  run_pytest "$version (current host$scope)" .host/current/venv/bin/python "$current_root" "$@"
fi
if [ "$compat_ready" = 1 ]; then
  run_pytest "0.3.75 (compatibility host, fast tier)" .venv/bin/python "$PWD/.host/ComfyUI" -m "not slow or frontend" "$@"
fi

echo
echo "=== summary ==="
printf '%s\n' "${summary[@]}"
if [ "$failed" = 1 ]; then
  exit 1
fi
if [ "$tested" = 0 ]; then
  echo "no pytest run selected any test"
  exit 5
fi
