#!/usr/bin/env bash
# Creates the virtual environment VENV (default .venv, relative to the repository root) unless a working
# one with pip is already there. Safe with any python3 a fresh machine may offer:
# - the interpreter is PYTHON (default: the python3 on PATH: Debian's, pyenv's shim, or an active venv's);
#   inside a venv its base interpreter creates the new one, so .venv never hangs off another venv;
# - every call runs isolated (-I): neither the working directory nor PYTHONPATH can shadow the standard
#   library (a repository folder named `operator/` once broke `python -m venv` that way);
# - Debian ships ensurepip, which venv needs for pip, separately (python3.X-venv): it is installed with
#   apt when missing, and a half-made venv from an earlier failed attempt is replaced.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if "$VENV/bin/python" -I -m pip --version >/dev/null 2>&1; then
  exit 0
fi

if ! "$PY" -I -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "[setup] $PY is not Python 3.11 or newer; set PYTHON to one that is" >&2
  exit 1
fi
# What venv itself uses: the interpreter below any venv, so the new one does not depend on the old one.
base=$("$PY" -I -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')

if ! "$base" -I -c 'import ensurepip' 2>/dev/null; then
  version=$("$base" -I -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  if [[ $base == /usr/* ]] && command -v apt-get >/dev/null; then
    echo "[setup] $base lacks ensurepip: installing python$version-venv (Debian package)"
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "python$version-venv" >/dev/null
  else
    echo "[setup] $base has no ensurepip, which venv needs; use another interpreter (PYTHON=...)" >&2
    exit 1
  fi
fi

echo "[setup] creating $VENV with $base"
"$base" -I -m venv --clear "$VENV"
