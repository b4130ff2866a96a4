"""kvflow's scheduler-side cost against the requests an engine holds (issue 50, item 4).

    python bench/bench_sched_scale.py            # 1, 64, 512 and 4096 requests (~3 min)
    python bench/bench_sched_scale.py --quick    # 1, 64 and 512

vLLM calls a connector's scheduler side on its scheduler thread, which every request
waits on. This drives vLLM's real `Scheduler` with `KVFlowConnector` (`fs` store, an
empty one: every lookup a miss, every prompt saved) through N requests at once, each a
prompt of 64 tokens (4 blocks of 16) and 8 output tokens, all running together
(`max_num_seqs` N), and times each call vLLM makes into the connector, every call kept:

- `get_num_new_matched_tokens` (each waiting request, each step it waits),
  `update_state_after_alloc`, `build_connector_meta` (once a step; apart, the steps
  that run all N, none new), `request_finished_all_groups`; in batches whose lookups
  were answered before the steps began, so all N run together;
- the lookups in flight: from the first request added to the step that schedules the
  last of them, the harness stepping as vLLM's engine core does (a step, and 1 ms of
  sleep after one that computed nothing, while requests wait for their lookups);
  against the same with every lookup a miss at once (the store not asked), batches of
  both alternating;
- kvflow's memory per request (`tracemalloc`, kvflow's own files only, in a second run
  of the same steps, so its cost stays out of the timings).

The worker plays no part (tests/support/vllm_scheduler.py's harness reports its saves
done at once). Each size's medians and p99s are written, and every sample (as each
value and its count); `python bench/run.py --render` renders them into
docs/benchmarks.md, with a plot on log axes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import record  # bench/record.py
import trio

from kvflow_fs import FsTransport

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.vllm_scheduler import (  # noqa: E402
    Harness,
    fs_config,
    make_harness,
    make_request,
    prompt_of,
)

PROMPT = 64
OUTPUT = 8
BLOCK = 16
CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta")
DECODE = "build_connector_meta, all running"
"""`build_connector_meta` of the steps that schedule every request and none new."""
FINISH = "request_finished_all_groups"
"""vLLM calls it for a connector that supports its hybrid allocator (kvflow does)."""
OUT = ROOT / "bench" / "results" / "sched-scale.json"


class Timed:
    """Each call vLLM makes into `h`'s connector, timed while `on` (seconds by method
    name; `DECODE`: `build_connector_meta` of the steps that schedule all `n` requests
    and none new)."""

    def __init__(self, h: Harness, n: int) -> None:
        self.on = False
        self.samples: dict[str, list[float]] = {name: [] for name in (*CALLS, DECODE, FINISH)}
        conn = h.connector
        for name in (*CALLS, FINISH):
            setattr(conn, name, self._wrap(name, getattr(conn, name), n))

    def _wrap(self, name: str, call: Callable[..., Any], n: int) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(*args)
            finally:
                if self.on:
                    took = time.perf_counter() - t0
                    self.samples[name].append(took)
                    so = args[0]
                    if name == "build_connector_meta" and _all_running(so, n):
                        self.samples[DECODE].append(took)

        return timed


def _all_running(so: Any, n: int) -> bool:
    """Whether the step `so` schedules `n` requests, none of them new."""
    return len(so.num_scheduled_tokens) == n and not so.scheduled_new_reqs


def _no_lookups(h: Harness) -> Callable[[], None]:
    """Every kvflow lookup a miss at once, without asking the store (the baseline of
    the requests' admission); returns what undoes it."""
    sched = h.kvflow_sched
    sched._start_lookup = lambda req, st: None  # type: ignore[method-assign]
    sched.lookup = lambda req, num_computed: 0  # type: ignore[method-assign]
    return lambda: [vars(sched).pop(k) for k in ("_start_lookup", "lookup")] and None


def _harness(store: Path, n: int) -> Harness:
    cfg = fs_config(store, max_num_batched_tokens=max(256, n * PROMPT))
    cfg.scheduler_config.max_num_seqs = n
    blocks = n * (-(-(PROMPT + OUTPUT) // BLOCK)) + 2  # every request's, and the null block
    h = make_harness(cfg, blocks)
    h._check_plan = lambda step: None  # type: ignore[method-assign]  # the harness's own
    h._check_running = lambda when: None  # type: ignore[method-assign]  # checks, O(N) a step
    step = h.step

    def step_kept_not(**kwargs: Any) -> Any:  # the harness keeps every step it ran: their
        out = step(**kwargs)  # outputs would grow each garbage collection's work
        h.steps.clear()
        return out

    h.step = step_kept_not  # type: ignore[method-assign]
    trio.run(_worker_opens, h)
    return h


async def _worker_opens(h: Harness) -> None:
    """The store as the engine's worker leaves it when it opens (its scan marks the
    shards the namespace holds, kvflow_fs._shards): the harness has no worker."""
    t = h.kvflow_sched.transport
    assert isinstance(t, FsTransport)
    worker = FsTransport(t.options, dataclasses.replace(t.context, role="worker"))
    await worker.open()
    await worker.usage.chores_done()
    await worker.aclose()


def _run(h: Harness, n: int, seed: int, together: bool) -> float:
    """N requests through `h` from arrival to their end; returns how long after the
    first arrived the last was first scheduled. `together`: the steps start once every
    lookup is answered, so every prompt is scheduled in one step and N run together."""
    reqs = [
        make_request(f"r{seed}-{i}", prompt_of(seed * 100_000 + i, PROMPT), max_tokens=OUTPUT)
        for i in range(n)
    ]
    t0 = time.perf_counter()
    for r in reqs:
        h.scheduler.add_request(r)
    if together:
        h.lookups.wait([r.request_id for r in reqs], timeout=600)
    waiting, admitted = {r.request_id for r in reqs}, 0.0
    deadline = t0 + 600
    while h.scheduler.has_requests():
        assert time.perf_counter() < deadline, "the requests never ended"
        step = h.step(send_lent=True)
        if waiting:
            waiting -= set(step.output.num_scheduled_tokens)
            admitted = time.perf_counter() - t0
        if not step.output.total_num_scheduled_tokens:
            time.sleep(0.001)  # as vLLM's engine core does while requests wait for kvflow
    h.drain(send_lent=True)
    return admitted


def _memory(store: Path, n: int) -> int:
    """kvflow's bytes (its own files' allocations) per request, all N running."""
    h = _harness(store, n)
    try:
        reqs = [
            make_request(f"m{i}", prompt_of(7_000_000 + i, PROMPT), max_tokens=OUTPUT)
            for i in range(n)
        ]
        kvflow = str(ROOT / "kvflow") + "/*"
        plugin = str(ROOT / "plugins" / "kvflow_vllm") + "/*"
        filters = [tracemalloc.Filter(True, kvflow), tracemalloc.Filter(True, plugin)]
        tracemalloc.start()
        before = tracemalloc.take_snapshot().filter_traces(filters)
        for r in reqs:
            h.scheduler.add_request(r)
        h.lookups.wait([r.request_id for r in reqs], timeout=600)
        h.step(send_lent=True)  # every prompt scheduled: all running
        after = tracemalloc.take_snapshot().filter_traces(filters)
        tracemalloc.stop()
        grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
        while h.scheduler.has_requests():
            h.step(send_lent=True)
        h.drain(send_lent=True)
        return grown // n
    finally:
        h.close()


def _counted(seconds: list[float]) -> dict[str, list[float]]:
    """Every sample, as each value (µs, to 0.1) and how many times it came: a size's
    tens of thousands of calls in a few hundred numbers."""
    counts = Counter(round(1e6 * x, 1) for x in seconds)
    values = sorted(counts)
    return {"us": values, "count": [counts[v] for v in values]}


def _figures(seconds: list[float]) -> dict[str, float]:
    s = sorted(seconds)
    return {
        "calls": len(s),
        "median_us": 1e6 * statistics.median(s),
        "p99_us": 1e6 * s[min(len(s) - 1, int(0.99 * len(s)))],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", help="requests at once (default 1 64 512 4096)")
    ap.add_argument("--quick", action="store_true", help="1, 64 and 512 requests")
    ap.add_argument("--repeats", type=int, default=3, help="runs per size (a new batch each)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    sizes = args.sizes or ([1, 64, 512] if args.quick else [1, 64, 512, 4096])
    meta = record.start()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvflow-sched-scale-") as tmp:
        for n in sizes:
            lookups: list[float] = []
            none: list[float] = []
            h = _harness(Path(tmp) / f"kv-{n}", n)
            timed = Timed(h, n)
            seed = 0
            try:
                _run(h, n, seed, together=False)  # warm: first calls, the store's directories
                for r in range(args.repeats):  # new prompts each: misses, and saves
                    for mode in ("kvflow", "none") if r % 2 == 0 else ("none", "kvflow"):
                        seed += 1
                        gc.collect()  # each batch starts with the same garbage: none
                        undo = _no_lookups(h) if mode == "none" else None
                        (none if undo else lookups).append(_run(h, n, seed, together=False))
                        if undo:
                            undo()
                    timed.on, seed = True, seed + 1
                    _run(h, n, seed, together=True)
                    timed.on = False
            finally:
                h.close()
            row: dict[str, Any] = {
                "requests": n,
                "calls": {name: _figures(s) for name, s in timed.samples.items()},
                "admitted_s": statistics.median(lookups),
                "admitted_no_lookups_s": statistics.median(none),
                "admitted_samples_s": {"kvflow": lookups, "no lookups": none},
                "memory_per_request": _memory(Path(tmp) / f"mem-{n}", n),
                "samples_us": {k: _counted(v) for k, v in timed.samples.items()},
            }
            rows.append(row)
            said = ", ".join(f"{k} {c['median_us']:.1f}" for k, c in row["calls"].items())
            print(
                f"{n:5d} requests: median us: {said}; all scheduled after "
                f"{row['admitted_s'] * 1e3:.0f} ms ({row['admitted_no_lookups_s'] * 1e3:.0f} "
                f"without lookups); {row['memory_per_request']} B a request",
                flush=True,
            )
    data = {"prompt_tokens": PROMPT, "output_tokens": OUTPUT, "repeats": args.repeats, "rows": rows}
    record.save(args.out, data, meta, extra=["tests/support/vllm_scheduler.py"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
