"""`fs` against the size of its store: 10^4 to 10^6 chunk files (issue 50, item 1).

    python bench/bench_fs_scale.py            # 10^4, 10^5 and 10^6 files (~6 min, ~5 GB)
    python bench/bench_fs_scale.py --quick    # 10^4 and 10^5

Each size is a store whose namespace holds N chunk files of 4 KiB (filler, written
directly, each last used at its own time, all older than everything else: a real
store's files would be a chunk's full bytes, 2 MiB for Llama-3-8B's 16 tokens; the
costs here depend on how many files there are, not on their bytes, except the loads
and saves, whose own chunks are real). With
kvflow's conformance harness (a real `FsTransport`, a small layout):

- `open`: a worker's `open()` (the store's scan runs after it, in the background), and
  that scan to its end;
- `lookup` of a chunk held, and of one not held (p50 / p99);
- `save` and `load` of a one-chunk request (p50 / p99; each layer a load reads checked
  against its checksum, as `fs` does by default);
- `evict`: the store at its cap (`max_gb` just under its size), a save crosses it and
  its chore evicts one step (to 99 % of the cap): the time from the save to the end, the
  files the eviction looked at and deleted, and the peak memory of the open's scan and
  of the eviction (`tracemalloc`, in a run of their own);
- `load while evicting`: the same loads while that eviction runs.

Writes bench/results/fs-scale.json (every sample); `python bench/run.py --render`
renders it into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import record  # bench/record.py
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvflow.testing.conformance import Harness, TransportConformance  # noqa: E402
from kvflow_fs import FsOptions, FsTransport  # noqa: E402
from kvflow_fs._usage import USAGE_FILE, EvictPass  # noqa: E402
from tests.support.fs_store import Factory  # noqa: E402

FILLER = 4096
STEP = 1.001
"""The store's size over its cap for the eviction timed: a save past a store at its cap."""
SAMPLES = 100
OUT = ROOT / "bench" / "results" / "fs-scale.json"


def fill(worker: FsTransport, n: int) -> int:
    """`n` filler chunk files in `worker`'s namespace, last used one after another over
    the day before (each its own time, as a store's files are: an eviction's cutoff
    then falls among them); their bytes."""
    start = time.time() - 2 * 86_400
    payload = os.urandom(FILLER)
    made: set[str] = set()
    for i in range(n):
        old = start + 86_400 * i / n
        key = secrets.token_hex(16)
        path = worker.path(key)
        d = os.path.dirname(path)
        if d not in made:
            os.makedirs(d, exist_ok=True)
            made.add(d)
        with open(path, "wb") as f:
            f.write(payload)
        os.utime(path, (old, old))
    return n * FILLER


async def _timed(fn: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    await fn(*args)
    return time.perf_counter() - t0


async def measure(kv: Harness, factory: Factory, n: int) -> dict[str, Any]:
    first = await kv.worker()
    assert isinstance(first, FsTransport)
    await first.usage.chores_done()
    fill(first, n)
    factory.options["max_gb"] = 1024.0  # no eviction while the store is measured
    t0 = time.perf_counter()
    worker = await kv.worker()
    assert isinstance(worker, FsTransport)
    opened = time.perf_counter() - t0
    await worker.usage.chores_done()
    scanned = time.perf_counter() - t0
    sched = await kv.scheduler()
    saves, loads, hits, misses = [], [], [], []
    held = []
    for _ in range(SAMPLES):
        chunks = kv.chunks(1)
        saves.append(await _timed(kv.save, worker, chunks))
        held.append(chunks)
    await worker.usage.chores_done()
    for chunks in held:
        hits.append(await _timed(sched.lookup, chunks.keys))
        misses.append(await _timed(sched.lookup, [secrets.token_hex(16)]))
        loads.append(await _timed(kv.load, worker, chunks))
    # a store at its cap: a save crosses it and evicts one step; loads run meanwhile
    store = sum(1 for _ in Path(worker.dir).rglob("*.kv"))
    counted = int((Path(factory.store) / USAGE_FILE).read_text())
    worker.usage.max_bytes = int(counted / STEP)
    passes: list[EvictPass] = []
    evict_pass = worker.usage._evict_pass

    def kept_pass(usage: int) -> EvictPass:
        passes.append(evict_pass(usage))
        return passes[-1]

    worker.usage._evict_pass = kept_pass  # type: ignore[method-assign]
    during: list[float] = []

    async def loads_meanwhile(cancel: trio.CancelScope) -> None:
        with cancel:
            for chunks in held:
                during.append(await _timed(kv.load, worker, chunks))

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()
        nursery.start_soon(loads_meanwhile, scope)
        await kv.save(worker, kv.chunks(1))
        await worker.usage.chores_done()
        evicted_s = time.perf_counter() - t0
        scope.cancel()
    assert passes, "no eviction"
    return {
        "files": n,
        "open_ms": 1e3 * opened,
        "scan_s": scanned - opened,
        "lookup_hit": record.p50_p99_ms(hits),
        "lookup_miss": record.p50_p99_ms(misses),
        "save": record.p50_p99_ms(saves),
        "load": record.p50_p99_ms(loads),
        "evict_s": evicted_s,
        "evict_store_files": store,
        "evict_passes": len(passes),
        "evict_looked_at": sum(p.looked_at for p in passes),
        "evict_deleted": sum(p.deleted for p in passes),
        "load_while_evicting": record.p50_p99_ms(during) if during else None,
        "samples_ms": {
            name: [round(1e3 * x, 3) for x in v]
            for name, v in (
                ("save", saves),
                ("load", loads),
                ("lookup_hit", hits),
                ("lookup_miss", misses),
                ("load_while_evicting", during),
            )
        },
    }


def memory(store: Path, n: int) -> tuple[int, int]:
    """Peak bytes Python allocated counting a store of `n` filler files
    (`StoreUsage.scan`), then evicting it one step past its cap, in this thread."""
    from kvflow.transport import TransportContext

    t = FsTransport(
        FsOptions(path=str(store), max_gb=1024.0),
        TransportContext("e", "scheduler", "mem", "tp0of1pp0", ["tp0of1pp0"]),
    )
    t.dir.mkdir(parents=True, exist_ok=True)
    fill(t, n)
    tracemalloc.start()
    t.usage.scan()
    scan = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    t.usage.max_bytes = int(n * FILLER / STEP)
    t.usage.account()
    evict = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert t.usage.evictions >= 1
    shutil.rmtree(t.dir)
    return scan, evict


async def run(sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="kvflow-fs-scale-") as tmp:
            factory = Factory(Path(tmp) / "store")
            suite = TransportConformance()
            async with suite.harness(factory, suite.build_layout(False, num_blocks=256)) as kv:
                row = await measure(kv, factory, n)
            shutil.rmtree(factory.store, ignore_errors=True)
            row["scan_peak_bytes"], row["evict_peak_bytes"] = memory(Path(tmp) / "mem", n)
        rows.append(row)
        print(
            f"{n:8d} files: open {row['open_ms']:.1f} ms, scan {row['scan_s']:.1f} s; lookup "
            f"{row['lookup_hit']['p50_ms']:.2f}/{row['lookup_hit']['p99_ms']:.2f} ms; save "
            f"{row['save']['p50_ms']:.2f}; load {row['load']['p50_ms']:.2f} "
            f"({(row['load_while_evicting'] or {}).get('p99_ms', 0):.2f} p99 evicting); "
            f"evict {row['evict_s']:.2f} s, {row['evict_deleted']} deleted, "
            f"{row['evict_looked_at']} looked at; peak MiB scan "
            f"{row['scan_peak_bytes'] / 2**20:.1f}, evict {row['evict_peak_bytes'] / 2**20:.1f}",
            flush=True,
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10^4 and 10^5 files")
    ap.add_argument("--sizes", type=int, nargs="+")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    sizes = args.sizes or ([10**4, 10**5] if args.quick else [10**4, 10**5, 10**6])
    meta = record.start()
    rows = trio.run(run, sizes)
    data = {"filler_bytes": FILLER, "samples": SAMPLES, "rows": rows}
    record.save(args.out, data, meta, extra=["tests/support/fs_store.py"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
