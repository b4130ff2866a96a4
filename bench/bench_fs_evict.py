"""How well `fs`'s sampled eviction keeps what is used, and what it looks at (issue 50,
item 1): the same request traces against the store's real eviction (`StoreUsage`, on
real files) with each way it could evict.

    python bench/bench_fs_evict.py            # both traces, every variant (~4 min)
    python bench/bench_fs_evict.py --quick    # shorter traces

A request is a prompt's chunk keys; its hits are the leading chunks the store holds (a
lookup's prefix), which it then reads (their times set to now, as a load does); it
saves the rest, and each save is counted and evicts as a save's chore does. Times are
logical (one tick a request), so ties and the machine's clock play no part. Traces:

- `zipf`: documents of `DOC_CHUNKS` chunks, picked with Zipf popularity;
- `chat`: conversations, each turn the whole conversation so far and one new chunk,
  behind one of a few shared system prompts (Zipf); `ACTIVE` conversations at once,
  each of a random number of turns, a new one starting when one ends.

Variants: `exact` deletes exactly the least recently used files, walking the whole store
(to 90 %: kvflow before issue 50, down to 90 % of the cap; and in `EVICT_TO`'s steps);
`sampled` is kvflow's eviction with `EVICT_SHARE` at each value (only files among the
least recently used share of a sample are deleted). Each reports the share of chunk
reads that hit, the files its evictions looked at for each one deleted, and the
median time of an eviction pass.

Writes bench/results/fs-evict.json; `python bench/run.py --render` renders it into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import record  # bench/record.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvflow_fs import _usage  # noqa: E402
from kvflow_fs._usage import EvictPass, StoreUsage  # noqa: E402

SIZE = 64
DOC_CHUNKS = 4
ACTIVE = 1024
CAP_FILES = 8000
SHARES = [0.01, 0.02, 0.05, 0.1]
OUT = ROOT / "bench" / "results" / "fs-evict.json"
SAMPLE_FILES = _usage.SAMPLE_FILES
"""kvflow's sample, kept before `replay` sets the module's for each variant."""


def _key(name: str) -> str:
    return hashlib.blake2b(name.encode(), digest_size=16).hexdigest()


def zipf_trace(requests: int, docs: int, seed: int = 1) -> Iterator[list[str]]:
    rng = random.Random(seed)
    weights = list(itertools.accumulate(1 / (i + 1) ** 0.9 for i in range(docs)))
    for _ in range(requests):
        (doc,) = rng.choices(range(docs), cum_weights=weights)
        yield [_key(f"doc{doc}/{c}") for c in range(DOC_CHUNKS)]


def chat_trace(requests: int, prompts: int, seed: int = 2) -> Iterator[list[str]]:
    rng = random.Random(seed)
    weights = list(itertools.accumulate(1 / (i + 1) for i in range(prompts)))
    started = itertools.count()

    def new() -> list[Any]:  # [system prompt, conversation, turns so far, turns in all]
        (prompt,) = rng.choices(range(prompts), cum_weights=weights)
        return [prompt, next(started), 0, rng.randint(1, 12)]

    active = [new() for _ in range(ACTIVE)]
    for _ in range(requests):
        i = rng.randrange(ACTIVE)
        prompt, conv, turns, last = active[i]
        active[i][2] = turns = turns + 1
        yield [_key(f"sys{prompt}/{c}") for c in range(2)] + [
            _key(f"conv{conv}/{t}") for t in range(turns)
        ]
        if turns == last:
            active[i] = new()


class Counted(StoreUsage):
    """`StoreUsage` that keeps every eviction pass's counts."""

    passes: list[tuple[EvictPass, float]]

    def _evict_pass(self, usage: int) -> EvictPass:
        t0 = time.perf_counter()
        done = super()._evict_pass(usage)
        self.passes.append((done, time.perf_counter() - t0))
        return done


def replay(
    trace: list[list[str]], cap_files: int, to: float, share: float, exact: bool
) -> dict[str, Any]:
    """The trace against a fresh store capped at `cap_files` files of `SIZE` bytes."""
    _usage.EVICT_TO, _usage.EVICT_SHARE = to, share
    _usage.SAMPLE_FILES = 1 << 62 if exact else SAMPLE_FILES
    with tempfile.TemporaryDirectory(prefix="kvflow-fs-evict-") as tmp:
        root = Path(tmp)
        usage = Counted(root, cap_files * SIZE, lambda: None)
        usage.passes = []
        payload = b"x" * SIZE
        hits = reads = 0
        for t, keys in enumerate(trace):
            now = 1e9 + t
            paths = [f"{root}/ns/{k[:2]}/{k}.tp0of1pp0.kv" for k in keys]
            held = 0
            for p in paths:
                if not os.path.exists(p):
                    break
                held += 1
            hits += held
            reads += len(paths)
            for p in paths[:held]:
                os.utime(p, (now, now))
            for p in paths[held:]:
                os.makedirs(os.path.dirname(p), exist_ok=True)
                with open(p, "wb") as f:
                    f.write(payload)
                os.utime(p, (now, now))
                usage.defer(SIZE)
                usage.account()
    looked = sum(p.looked_at for p, _ in usage.passes)
    deleted = sum(p.deleted for p, _ in usage.passes)
    pass_s = sorted(s for _, s in usage.passes)
    return {
        "hit_rate": hits / reads,
        "passes": len(usage.passes),
        "looked_at": looked,
        "deleted": deleted,
        "looked_per_deleted": looked / max(1, deleted),
        "pass_ms": 1e3 * statistics.median(pass_s) if pass_s else None,
        "evict_s": sum(pass_s),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    requests = 10_000 if args.quick else 40_000
    traces = {
        "zipf": (list(zipf_trace(requests, docs=16_000)), CAP_FILES),
        "chat": (list(chat_trace(requests, prompts=32)), CAP_FILES),
    }
    step = _usage.EVICT_TO
    variants = [("exact", 0.9, 1.0), ("exact", step, 1.0)]
    variants += [("sampled", step, s) for s in SHARES]
    meta = record.start()
    rows = []
    for trace, (requested, cap_files) in traces.items():
        for kind, to, share in variants:
            row = replay(requested, cap_files, to, share, exact=kind == "exact")
            row.update(
                trace=trace, kind=kind, evict_to=to, share=share if kind == "sampled" else None
            )
            rows.append(row)
            print(
                f"{trace:5} {kind:7} to {to:.1%} share {share:4}: hit {row['hit_rate']:.4f}, "
                f"{row['passes']} passes, looked at {row['looked_per_deleted']:.1f} a file "
                f"deleted, {row['pass_ms'] or 0:.1f} ms a pass, {row['evict_s']:.1f} s in all",
                flush=True,
            )
    distinct = {name: len({k for r in t for k in r}) for name, (t, _) in traces.items()}
    data = {
        "requests": requests,
        "file_bytes": SIZE,
        "sample_files": SAMPLE_FILES,
        "step": step,
        "cap_files": {name: cap for name, (_, cap) in traces.items()},
        "distinct_chunks": distinct,
        "rows": rows,
    }
    record.save(args.out, data, meta)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
