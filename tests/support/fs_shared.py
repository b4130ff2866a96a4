"""One engine's worker on an `fs` store that others share (issue 50, item 2), run as a
process of its own:

    python tests/support/fs_shared.py STORE MAX_GB ROUNDS SEED

It opens its worker, waits for the open's scan of the store, prints `ready` and waits
for a line on its stdin (the caller's go, once every process is ready: a scan counts
the store anew, and what other processes save or delete while it walks may be missed
or counted twice). Each round saves a new chunk (every other one the same chunk, key
and bytes, in every process, as engines given one prompt save it; the others this
process's own), then loads one of the chunks this process saved (picked at random;
another process's eviction may have deleted it) into fresh blocks and checks every
byte. Prints one JSON object: the counts (saved, loaded, not found by the lookup,
loads that failed with a `TransportError`, loads with a wrong byte), each operation's
times, how often it found the store over its cap and tried to evict (`tried`), and the
start and end of each eviction pass it ran (`time.monotonic`, one clock for every
process of the machine)."""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from kvflow.testing.conformance import ContractViolation, TransportConformance  # noqa: E402
from kvflow.transport import TransportError  # noqa: E402
from kvflow_fs._usage import EvictPass  # noqa: E402
from tests.support.fs_store import Factory, fs_worker  # noqa: E402


async def run(store: Path, max_gb: float, rounds: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    factory = Factory(store)
    factory.options["max_gb"] = max_gb
    suite = TransportConformance()
    out: dict[str, Any] = {"saved": 0, "loaded": 0, "missed": 0, "failed": 0, "wrong": 0}
    out["tried"] = 0
    times: dict[str, list[float]] = {"save": [], "lookup": [], "load": []}
    passes: list[tuple[float, float, int]] = []
    async with suite.harness(factory, suite.build_layout(False, num_blocks=2 * rounds + 8)) as kv:
        worker = await fs_worker(kv)
        sched = await kv.scheduler()
        evict_pass = worker.usage._evict_pass

        def timed_pass(usage: int) -> EvictPass:
            t0 = time.monotonic()
            done = evict_pass(usage)
            passes.append((t0, time.monotonic(), done.deleted))
            return done

        worker.usage._evict_pass = timed_pass  # type: ignore[method-assign]
        evict = worker.usage.evict

        def counted_evict(usage: int) -> None:  # a try: another process may be evicting
            out["tried"] += 1
            evict(usage)

        worker.usage.evict = counted_evict  # type: ignore[method-assign]
        await worker.usage.chores_done()
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        mine = []
        shared, own = kv._seeds, itertools.count(1_000_000 * (seed + 1))
        for i in range(rounds):
            kv._seeds = shared if i % 2 == 0 else own  # every process saves the same keys
            src = kv.chunks(1)
            t0 = time.perf_counter()
            await kv.save(worker, src)
            times["save"].append(time.perf_counter() - t0)
            out["saved"] += 1
            mine.append(src)
            pick = rng.choice(mine)
            t0 = time.perf_counter()
            found = await sched.lookup(pick.keys)
            times["lookup"].append(time.perf_counter() - t0)
            if not found:
                out["missed"] += 1
                continue
            dst, source, before = kv.destination(pick)
            job, _ = kv.load_job(dst)
            t0 = time.perf_counter()
            try:
                await worker.load(job)
            except TransportError:  # deleted since the lookup: vLLM recomputes
                out["failed"] += 1
                continue
            times["load"].append(time.perf_counter() - t0)
            try:
                kv.expect_loaded(source, before, pick, dst)
                out["loaded"] += 1
            except ContractViolation:
                out["wrong"] += 1
        await worker.usage.chores_done()
        out["evictions"] = worker.usage.evictions
        out["lock_skips"] = worker.usage.lock_skips
    out["passes"] = passes
    out["times_s"] = times
    return out


def main() -> int:
    store, max_gb, rounds, seed = sys.argv[1:]
    print(json.dumps(trio.run(run, Path(store), float(max_gb), int(rounds), int(seed))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
