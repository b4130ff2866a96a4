#!/usr/bin/env bash
# kvflow as its users get it. Builds the sdists of kvflow and kvflow-redis from this
# checkout and each wheel from its sdist (`python -m build`, isolated, as pip builds from
# an index), installs the wheels non-editable into a fresh virtualenv with vLLM, and checks
# them from a directory outside the repository (scripts/check_installed.py: every module
# imports from the virtualenv, `kvflow --version`, `kvflow transports`, `kvflow demo`).
#
#   bash scripts/check-wheel.sh [--build | --check] [WORKDIR]
#
# --build stops once the virtualenv holds the wheels; --check runs the checks on a
# WORKDIR --build made (CI builds while it lints). WORKDIR: a new temporary directory.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
phase=all
case "${1:-}" in --build | --check) phase=${1#--}; shift ;; esac
work=${1:-$(mktemp -d)}
PY=${PYTHON:-python3}
venv="$work/venv"
version=$("$PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$repo/pyproject.toml")

if [ "$phase" != check ]; then
  rm -rf "$work/dist" "$venv"
  mkdir -p "$work"
  "$PY" -m build --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log" >&2; exit 1; }
  "$PY" -m build --outdir "$work/dist" "$repo/plugins/kvflow_redis" >>"$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log" >&2; exit 1; }
  ls "$work/dist"
  "$PY" -m venv "$venv"
  PYTHON="$venv/bin/python" bash "$repo/scripts/install.sh" --vllm-only
  "$venv/bin/python" -m pip install --disable-pip-version-check -q \
    "$work/dist/kvflow-$version-py3-none-any.whl[nixl,testing]" \
    "$work/dist/kvflow_redis-$version-py3-none-any.whl"
  echo "check-wheel: kvflow $version and kvflow-redis installed from their wheels in $venv"
fi
if [ "$phase" != build ]; then
  mkdir -p "$work/outside"
  cp "$repo/scripts/check_installed.py" "$work/outside/"
  cd "$work/outside"  # nothing here imports the source tree
  "$venv/bin/python" check_installed.py --version "$version"
fi
