#!/usr/bin/env bash
# kvflow as its users get it. Makes a fresh virtualenv with vLLM, builds the sdists of
# kvflow and kvflow-redis from this checkout and each wheel from its sdist (`python -m
# build`, isolated, as pip builds from an index), installs the wheels non-editable, and
# checks them from a directory outside the repository (scripts/check_installed.py: every
# module imports from the virtualenv, `kvflow --version`, `kvflow transports`, `kvflow
# demo`: a cold and a warm vLLM engine over `fs`, identical tokens, every token loaded).
#
#   bash scripts/check-wheel.sh [--only venv|wheels|check] [WORKDIR]
#
# The three steps run in that order; --only runs one on a WORKDIR the earlier ones made
# (CI makes the virtualenv while it installs and lints). WORKDIR: a new temporary directory.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
only=""
if [ "${1:-}" = --only ]; then only=$2; shift 2; fi
work=${1:-$(mktemp -d)}
mkdir -p "$work"
PY=${PYTHON:-python3}
venv="$work/venv"
step() { [ -z "$only" ] || [ "$only" = "$1" ]; }

if step venv; then
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  PYTHON="$venv/bin/python" bash "$repo/scripts/install.sh" --vllm-only
  echo "check-wheel: vLLM installed in a fresh virtualenv, $venv"
fi
version=$("$PY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$repo/pyproject.toml")
if step wheels; then
  rm -rf "$work/dist"
  for project in "$repo" "$repo/plugins/kvflow_redis"; do
    "$PY" -m build --outdir "$work/dist" "$project" >"$work/build.log" 2>&1 \
      || { tail -30 "$work/build.log" >&2; exit 1; }
  done
  ls "$work/dist"
  "$venv/bin/python" -m pip uninstall -y -q kvflow kvflow-redis 2>/dev/null || true  # a rerun
  "$venv/bin/python" -m pip install --disable-pip-version-check -q \
    "$work/dist/kvflow-$version-py3-none-any.whl[nixl,testing]" \
    "$work/dist/kvflow_redis-$version-py3-none-any.whl"
  echo "check-wheel: kvflow $version and kvflow-redis installed from their wheels"
fi
if step check; then
  mkdir -p "$work/outside"
  cp "$repo/scripts/check_installed.py" "$work/outside/"
  cd "$work/outside"  # nothing here imports the source tree
  "$venv/bin/python" check_installed.py --version "$version"
fi
