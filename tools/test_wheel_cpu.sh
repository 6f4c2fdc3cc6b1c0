#!/usr/bin/env bash
# Test a built wheel (tools/build_wheel.sh; CPU-only or CUDA, either imports and runs without a GPU) against the
# oldest and newest supported torch, on the CPU: for each torch version a fresh venv gets that torch and the
# wheel with its [test] extras from the package registry, then the pytest suite runs against the INSTALLED wheel
# (from a scratch directory, checked to import attnres from the venv's site-packages, never the source tree).
#
#   tools/test_wheel_cpu.sh dist/attnres-0.1.0-cp311-cp311-manylinux_2_34_x86_64.whl            # torch 2.7.0 and 2.15.0
#   TORCH_VERSIONS="2.13.0" tools/test_wheel_cpu.sh dist/attnres-….whl
#
# Environment: PYTHON (the interpreter the wheel was built for; default python3), TORCH_VERSIONS (default
# "2.7.0 2.15.0": the oldest torch the package works with, and the newest release on PyPI when this was written;
# 2.4 fails at import, 2.5 and 2.6 under torch.compile), VENV_ROOT (default /tmp/attnres-wheel-venvs: one venv
# per torch version, rebuilt each run; the pytest logs land there too), FIND_LINKS (directories of
# pre-downloaded wheels, e.g. torch's; space-separated), PYTEST_ARGS (default "-q -n 2"). PyPI's torch wheels
# for Linux are CUDA builds (several GB with their nvidia-* dependencies); they run on the CPU like the CPU
# builds, except that torch.device(0) then means cuda:0: tests/ops/test_plan.py::
# test_plan_accepts_every_device_form_it_did expects a CPU build of torch on a machine without a GPU, and fails.
# Where pip's configuration caps torch (this development machine: /etc/xdg/pip/constraints.txt, torch<=2.14.1),
# run with PIP_CONSTRAINT=/dev/null for 2.15.0.
# This is a script to run by hand, not part of CI (two torch downloads and two full test runs).
set -euo pipefail
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ $# -eq 1 ] || { echo "usage: tools/test_wheel_cpu.sh WHEEL" >&2; exit 2; }
WHEEL=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
PYTHON=${PYTHON:-python3}
TORCH_VERSIONS=${TORCH_VERSIONS:-2.7.0 2.15.0}
VENV_ROOT=${VENV_ROOT:-/tmp/attnres-wheel-venvs}
read -r -a pytest_args <<<"${PYTEST_ARGS:--q -n 2}"
find_links=()
for dir in ${FIND_LINKS:-}; do find_links+=(--find-links "$dir"); done
log() { printf '[test_wheel_cpu] %s\n' "$*" >&2; }

# Run from a scratch directory: neither the repository root nor python/ is on sys.path.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cd "$scratch"

results=()
status=0
for torch_version in $TORCH_VERSIONS; do
  venv=$VENV_ROOT/torch-$torch_version
  log "== torch $torch_version: venv $venv"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  py=$venv/bin/python
  "$py" -m pip install -q ${find_links[@]+"${find_links[@]}"} "torch==$torch_version"
  # The wheel with its dependencies (numpy; torch>=2.4 is already satisfied) and the test extras.
  "$py" -m pip install -q ${find_links[@]+"${find_links[@]}"} "$WHEEL[test]"
  "$py" -m pip check >&2 || true
  if ! "$py" - "$venv" <<'PY'
import sys, sysconfig
import torch, attnres
venv = sys.argv[1]
site = sysconfig.get_paths()["purelib"]
assert attnres.__file__.startswith(site), f"attnres imported from {attnres.__file__}, not {site}"
assert attnres._C.__file__.startswith(site), attnres._C.__file__
print(f"[test_wheel_cpu] python {sys.version.split()[0]}, torch {torch.__version__}, attnres {attnres.__version__} "
      f"from {attnres.__file__}: {attnres.backend_info()}", file=sys.stderr)
PY
  then
    results+=("torch $torch_version: FAILED (import attnres)"); status=1
    continue
  fi
  # -p no:cacheprovider: nothing written into the source tree; the repository's tests, the installed package.
  start=$(date +%s)
  if "$py" -m pytest -p no:cacheprovider "${pytest_args[@]}" "$REPO_ROOT/tests" 2>&1 | tee "$VENV_ROOT/pytest-torch-$torch_version.log" | tail -5; then
    outcome=passed
  else
    outcome=FAILED; status=1
  fi
  results+=("torch $torch_version: $outcome ($(($(date +%s) - start)) s; $(tail -1 "$VENV_ROOT/pytest-torch-$torch_version.log"))")
done
for r in "${results[@]}"; do log "$r"; done
exit $status
