#!/usr/bin/env bash
# Check kvflow's vLLM adapter against another vLLM version's Python code on this machine:
# that version's sources are installed without their dependencies into a directory of
# their own and imported next to the installed (CPU) torch; harnesses built on vLLM's own
# objects (its Scheduler, its runners' connector wrappers, its create_kv_cache_views,
# the snapshot of its connector contract, its KV event publisher and events, which
# `kvflow proxy --route prefix` reads) then drive kvflow. No GPU kernel runs.
#
#     bash scripts/check-vllm.sh 0.33.0
#
# CI runs it for every tested version that is not the installed one (docs/vllm-versions.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
version=${1:?usage: bash scripts/check-vllm.sh VERSION (e.g. 0.33.0)}
target=${KVFLOW_VLLM_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvflow/vllm-$version}
if [ ! -f "$target/vllm/__init__.py" ]; then
  rm -rf "$target.tmp"
  "$PY" -m pip --disable-pip-version-check -q install --no-deps --target "$target.tmp" \
    "vllm==$version"
  mv "$target.tmp" "$target"
fi
got=$(PYTHONPATH="$target" "$PY" -c "import vllm; print(vllm.__version__)")
[ "$got" = "$version" ] || { echo "check-vllm: imported vLLM $got, not $version" >&2; exit 1; }
echo "check-vllm: kvflow against vLLM $got's Python code ($target)"
modules=(tests/connector/test_vllm_versions.py tests/connector/test_gpu_layouts.py
  tests/connector/test_adapter.py tests/connector/test_vllm_scheduler.py
  tests/pd/test_vllm_scheduler_pd.py tests/connector/test_vllm_runner.py
  tests/connector/test_hidden_states_io.py tests/pd/test_topology.py tests/pd/test_pp.py
  tests/route/test_index.py tests/route/test_feeds.py)
report=$(mktemp)
trap 'rm -f "$report"' EXIT
PYTHONPATH="$target" "$PY" -m pytest -q -p no:cacheprovider -m '' -rs \
  --junitxml="$report" "${modules[@]}"
# Every module must run: a module whose import fails under this vLLM (importorskip)
# would otherwise pass as skips (scripts/skips.py).
"$PY" scripts/skips.py "$report" "${modules[@]}"
