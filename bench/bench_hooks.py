"""Benchmark: what kvflow's hot-path hooks cost vLLM's thread, per call.

    python bench/bench_hooks.py

Through the real `KVFlowConnector` methods on a `WorkerEngine` with an `fs` transport
(no engine running), per call, median of 5 runs of 200,000 calls (20,000 for the step
with saves). Writes bench/results/hooks.json.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import record

BLOCK = 128


def hot_path_us(iterations: int = 200_000) -> dict[str, float]:
    """Per-call cost of the hooks vLLM calls every layer / step, through the real adapter."""
    import torch

    from kvflow.config import KVFlowConfig
    from kvflow.engine.metadata import SaveSpec, WorkerPlan
    from kvflow.engine.worker import WorkerEngine
    from kvflow.observe.events import EventBus, Origin
    from kvflow.runtime import Runtime
    from kvflow.testing.layouts import make_layout
    from kvflow.transport import TransportContext
    from kvflow_fs import FsOptions, FsTransport
    from kvflow_vllm.connector import KVFlowConnector
    from kvflow_vllm.connector.worker import KVFlowWorker
    from kvflow_vllm.groups import Pending

    tmp = tempfile.mkdtemp(prefix="kvflow-hot-")
    layout = make_layout(num_layers=4, num_blocks=64, block_size=BLOCK)
    cfg = KVFlowConfig()
    rt = Runtime("bench-hot")
    ctx = TransportContext("bench", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"])
    transport = FsTransport(FsOptions(path=tmp, max_gb=0), ctx)
    rt.call(transport.open, timeout=10)
    worker = WorkerEngine(
        config=cfg, transport=transport, runtime=rt, bus=EventBus(Origin("b", "worker"))
    )
    worker.register(layout)
    # the adapter's front and worker side, on this engine; no vLLM engine runs
    side = KVFlowWorker.__new__(KVFlowWorker)
    side.config, side.workers, side._exporter = cfg, [worker], None
    side._layer_index = {n: (worker, i) for i, n in enumerate(layout.names)}
    side._sending, side._receiving = Pending(), Pending()
    conn = KVFlowConnector.__new__(KVFlowConnector)
    conn.worker_side, conn.scheduler_side = side, None  # no context: these hooks read none
    kv = torch.zeros(1)
    name = layout.names[1]

    def per_call(fn: object, n: int = iterations) -> float:
        f = fn  # type: ignore[assignment]
        samples = []
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                f()  # type: ignore[operator]
            samples.append((time.perf_counter_ns() - t0) / n / 1e3)
        return statistics.median(samples)

    out = {}
    worker.bind(WorkerPlan(step=1))
    out["save_kv_layer (step saves nothing)"] = per_call(lambda: conn.save_kv_layer(name, kv, None))
    out["wait_for_layer_load (layer already there)"] = per_call(
        lambda: conn.wait_for_layer_load(name)
    )
    out["get_finished (nothing new)"] = per_call(lambda: conn.get_finished(set()))
    # a step with a save: save_kv_layer hands one event to the trio loop
    worker.bind(WorkerPlan(step=2, saves=[SaveSpec("r", ["ab" * 16], [1], [BLOCK])]))
    out["save_kv_layer (step with saves)"] = per_call(
        lambda: conn.save_kv_layer(name, kv, None), 20_000
    )
    conn.wait_for_save()  # end the step: the save runs and finishes
    worker.close(5.0)
    return out


def main() -> int:
    meta = record.start()
    print("hot-path hooks (us per call, median of 5 runs):")
    hot = hot_path_us()
    for k, v in hot.items():
        print(f"  {k:<45} {v:8.2f}")
    out = Path(__file__).parent / "results" / "hooks.json"
    record.save(out, {"hot_path_us": hot}, meta)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
