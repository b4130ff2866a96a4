"""The host tier's bookkeeping against its size (issue 50, item 3).

    python bench/bench_tier_scale.py            # 10^3 to 10^6 slots, both policies (~2 min)
    python bench/bench_tier_scale.py --quick    # up to 10^5

`kvflow.tiers.HostCache` keeps an index of which chunk each slot holds and a `Policy`
(S3-FIFO or LRU) that picks what to give up. This times what a load and a save ask of
them, with slots of 64 bytes (so 10^6 of them fit in memory: the bookkeeping does not
depend on a slot's bytes, only on how many there are) and 32 layer sizes per chunk (a
32-layer model's entry):

- `fill`: a new chunk into a free slot (`reserve` + `commit`);
- `hit` and `miss`: `get` of a chunk held, and of one not held;
- `evict`: a new chunk into the full cache, its policy giving up another, while half
  of the reads go to a tenth of the chunks (a hot set) and 0.1 % of the chunks are
  pinned (being read or written back), which a policy must step over;
- kvflow's bytes per slot once full (`tracemalloc`, kvflow/tiers only: the index, the
  policy's queues; not the slots' bytes).

Each operation is timed in batches of `BATCH`; the medians per operation are written
with their ratio to the smallest size's (the machine's speed divides out), every
batch kept; `python bench/run.py --render` renders them into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import record  # bench/record.py

from kvflow.tiers.host import HostCache

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "tier-scale.json"
SLOT = 64
SIZES = tuple([SLOT // 32] * 32)  # 32 layers
BATCH = 10_000
OPS = ("fill", "hit", "miss", "evict")


def _fill(cache: HostCache, keys: list[int]) -> list[float]:
    """Every slot filled: seconds per operation, a batch at a time."""
    out = []
    for start in range(0, len(keys), BATCH):
        part = keys[start : start + BATCH]
        t0 = time.perf_counter()
        for k in part:
            slot = cache.reserve()
            assert slot is not None
            cache.commit(k, slot, SIZES)
        out.append((time.perf_counter() - t0) / len(part))
    return out


def _gets(cache: HostCache, keys: list[int], batches: int) -> list[float]:
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for k in keys:
            cache.get(k, SIZES)
        out.append((time.perf_counter() - t0) / len(keys))
    return out


def _evicts(cache: HostCache, n: int, rng: random.Random, batches: int) -> list[float]:
    """New chunks into the full cache, each after a read (half of them of the hot
    tenth), with 0.1 % of the held chunks pinned."""
    held = list(range(n))
    for k in rng.sample(held, max(1, n // 1000)):
        cache.pin(k)
    hot = held[: max(1, n // 10)]
    nxt = n
    out = []
    for _ in range(batches):
        reads = [
            rng.choice(hot) if rng.random() < 0.5 else rng.randrange(nxt) for _ in range(BATCH)
        ]
        t0 = time.perf_counter()
        for r in reads:
            cache.get(r, SIZES)
            slot = cache.reserve()
            assert slot is not None, "every chunk pinned"
            cache.commit(nxt, slot, SIZES)
            nxt += 1
        out.append((time.perf_counter() - t0) / BATCH)
    return out


def _bytes_per_slot(policy: str, n: int) -> float:
    """kvflow/tiers's allocations per slot of a cache of `n` slots, filled."""
    tiers = [tracemalloc.Filter(True, str(ROOT / "kvflow" / "tiers") + "/*")]
    tracemalloc.start()
    before = tracemalloc.take_snapshot().filter_traces(tiers)
    cache = HostCache(n * SLOT, SLOT, policy)
    _fill(cache, list(range(n)))
    after = tracemalloc.take_snapshot().filter_traces(tiers)
    tracemalloc.stop()
    cache.close()
    return sum(s.size_diff for s in after.compare_to(before, "filename")) / n


def measure(policy: str, n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    cache = HostCache(n * SLOT, SLOT, policy)
    keys = list(range(n))
    samples: dict[str, list[float]] = {"fill": _fill(cache, keys)}
    probe = rng.sample(keys, min(n, BATCH))
    samples["hit"] = _gets(cache, probe, 5)
    samples["miss"] = _gets(cache, [n + 10**9 + k for k in probe], 5)
    samples["evict"] = _evicts(cache, n, rng, 5)
    cache.close()
    return {
        "policy": policy,
        "slots": n,
        "median_ns": {op: 1e9 * statistics.median(v) for op, v in samples.items()},
        "bytes_per_slot": _bytes_per_slot(policy, n),
        "samples_ns": {op: [round(1e9 * x, 1) for x in v] for op, v in samples.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="up to 10^5 slots")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    sizes = [10**3, 10**4, 10**5] + ([] if args.quick else [10**6])
    meta = record.start()
    rows = []
    for policy in ("s3fifo", "lru"):
        for n in sizes:
            row = measure(policy, n, args.seed)
            rows.append(row)
            said = ", ".join(f"{op} {ns:.0f}" for op, ns in row["median_ns"].items())
            print(f"{policy:6s} {n:8d} slots: ns an operation: {said}; "
                  f"{row['bytes_per_slot']:.0f} B a slot", flush=True)  # fmt: skip
    for row in rows:
        base = next(r for r in rows if r["policy"] == row["policy"])
        row["ratio"] = {op: ns / base["median_ns"][op] for op, ns in row["median_ns"].items()}
    data = {"slot_bytes": SLOT, "layers": len(SIZES), "batch": BATCH, "rows": rows}
    record.save(args.out, data, meta)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
