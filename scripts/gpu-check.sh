#!/usr/bin/env bash
# The GPU suite in one command, on a machine with an NVIDIA GPU and kvflow installed
# (bash scripts/install.sh): every CUDA test (CUDA IPC, NIXL VRAM, host staging of a
# device cache, real vLLM GPU engines with fs and zmq P/D on vLLM's default KV layout and
# on HND) and the GPU benchmarks (CUDA IPC pulls, host staging against pinned copies),
# then a summary. Logs: docs/gpu-runs/DATE-GPU/ (GPU_RUN_DIR overrides; e.g.
# docs/gpu-runs/2026-11-27-h200/), results files: bench/results/.
#
#     bash scripts/gpu-check.sh                 # tests + benchmarks, 3 runs each
#     bash scripts/gpu-check.sh --quick         # tests + each benchmark once, full size
#     bash scripts/gpu-check.sh --no-engines    # where vLLM is not installed: no engine tests
#
# Exit status 0 only if every step passed and no CUDA test was skipped; without vLLM the
# engine tests are a failed step unless --no-engines says to leave them out.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
QUICK=() ENGINES=1
for arg in "$@"; do
    case $arg in
        --quick) QUICK=(--quick) ;;
        --no-engines) ENGINES=0 ;;
        *) echo "gpu-check: unknown argument $arg (--quick, --no-engines)" >&2; exit 2 ;;
    esac
done

if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu-check: no CUDA device here (torch.cuda.is_available() is False)" >&2
    exit 2
fi
"$PY" -c "import torch, triton; print('gpu-check:', torch.cuda.get_device_name(), \
'torch', torch.__version__, 'triton', triton.__version__)"
HAVE_VLLM=1
"$PY" -c "import vllm; print('gpu-check: vllm', vllm.__version__)" || HAVE_VLLM=0
gpu=$("$PY" -c "import torch; print(torch.cuda.get_device_name())")
gpu=$(tr 'A-Z' 'a-z' <<<"$gpu" | sed -E 's/^nvidia //; s/[^a-z0-9]+/-/g; s/^-+|-+$//g')
OUT=${GPU_RUN_DIR:-docs/gpu-runs/$(date -u +%F)-$gpu}
mkdir -p "$OUT"
echo "gpu-check: logs in $OUT"

names=() results=()
step() {  # step NAME CMD...: run, log to $OUT/gpu-check-NAME.log, record the outcome
    local name=$1 log="$OUT/gpu-check-$1.log"
    shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]} outcome=pass
    if ((rc != 0)); then
        outcome="FAIL (exit $rc)"
    elif grep -qE "[0-9]+ skipped" "$log"; then
        outcome="FAIL (CUDA tests skipped: $(grep -oE '[0-9]+ skipped' "$log" | tail -1))"
    fi
    names+=("$name") results+=("$outcome")
}

step tests "$PY" -m pytest -q -rs -m '' \
    tests/gpu/test_zmq_cuda.py tests/gpu/test_nixl_cuda.py tests/gpu/test_hetero_cuda.py \
    tests/gpu/test_staging_cuda.py tests/transports/test_staging.py
if ((ENGINES)) && ((HAVE_VLLM)); then
    step engines "$PY" -m pytest -q -rs -m '' \
        tests/gpu/test_hidden_states_cuda.py tests/gpu/test_gpu_engine.py
elif ((ENGINES)); then
    names+=(engines) results+=("FAIL (no vLLM here: install it, or --no-engines)")
else
    names+=(engines) results+=("left out (--no-engines)")
fi
RUNS=(--runs 3)
((${#QUICK[@]})) && RUNS=()  # --quick: each benchmark at full size, once
step bench_cuda_ipc "$PY" bench/bench_cuda_ipc.py --phases "${RUNS[@]}"  # and where a pull's time goes
step bench_cuda_ipc_hnd "$PY" bench/bench_cuda_ipc.py --consumer-layout LBHNC "${RUNS[@]}"
((${#QUICK[@]})) || step bench_cuda_ipc_layerwise "$PY" bench/bench_cuda_ipc.py --layerwise "${RUNS[@]}"
step bench_staging "$PY" bench/bench_staging_cuda.py

echo
echo "gpu-check summary"
failed=0
for i in "${!names[@]}"; do
    printf '  %-16s %s\n' "${names[$i]}" "${results[$i]}"
    [[ "${results[$i]}" == pass || "${results[$i]}" == "left out (--no-engines)" ]] || failed=1
done
exit $failed
