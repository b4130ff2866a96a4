"""Benchmark: the host-memory tier (`cpu_cache_gib`, `kvflow.tiers`).

    python bench/bench_tier.py [--trace FILE ...] [--repeats 7] [--quick]

Two parts, one results file (bench/results/tier.json):

- **policy**: a prefix trace replayed through the tier's own cache (`HostCache`, one
  slot a chunk) under LRU and S3-FIFO, at cache sizes of 2 %, 5 %, 10 % and 25 % of the
  trace's distinct chunks. Each request looks up its leading chunks (a hit reads them),
  then stores the rest, as kvflow's scheduler and worker do; the figure is the share of
  all requested chunks that were hits. No timing. The default trace is synthetic and
  deterministic (`synthetic_trace`: hot system prompts by a Zipf law, multi-turn
  sessions that grow, and one-off long documents); `--trace` replays a Mooncake trace
  (JSON lines with `hash_ids`, e.g. FAST25-release/traces/conversation_trace.jsonl of
  github.com/kvcache-ai/Mooncake), each file its own rows.
- **load**: a load of 64 chunks of llama3-8b's KV (32 layers, 8 KV heads x 128, fp16,
  blocks of 16 tokens: 128 MiB) from the tier into vLLM's CPU cache blocks, against a
  plain copy of the same bytes from one preallocated buffer into the same blocks, in
  the same run, alternating (order swapped each repeat), medians after a warm-up. The
  goal is 0.8x.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import record
import trio

from kvflow.testing.layouts import fill_blocks, make_layout
from kvflow.tiers import HostCache, with_host_tier
from kvflow.transport import LoadJob, SaveJob, TransportContext
from kvflow_fs import FsOptions, FsTransport

SHARES = (0.02, 0.05, 0.10, 0.25)


def synthetic_trace(requests: int = 20000, seed: int = 11) -> list[list[int]]:
    """Chunk ids per request: 30 % reuse one of 40 system prompts (4-16 chunks, Zipf
    popularity) and add a question; 40 % continue one of the live multi-turn sessions
    (its whole history, then 1-4 new chunks); 30 % are one-off documents of 8-64
    chunks (a scan)."""
    rng = random.Random(seed)
    next_id = iter(range(1 << 40))
    prompts = [[next(next_id) for _ in range(rng.randint(4, 16))] for _ in range(40)]
    weights = [1 / (i + 1) for i in range(len(prompts))]
    sessions: list[list[int]] = []
    out = []
    for _ in range(requests):
        r = rng.random()
        if r < 0.3:
            (sys_prompt,) = rng.choices(prompts, weights)
            out.append([*sys_prompt, *(next(next_id) for _ in range(rng.randint(1, 3)))])
        elif r < 0.7:
            if not sessions or rng.random() < 0.2:
                sessions.append([next(next_id) for _ in range(rng.randint(2, 8))])
                sessions = sessions[-200:]
            s = rng.choice(sessions)
            s.extend(next(next_id) for _ in range(rng.randint(1, 4)))
            out.append(list(s))
        else:
            out.append([next(next_id) for _ in range(rng.randint(8, 64))])
    return out


def mooncake_trace(path: Path) -> list[list[int]]:
    return [json.loads(line)["hash_ids"] for line in path.read_text().splitlines() if line]


def replay(trace: list[list[int]], slots: int, policy: str) -> float:
    """The share of requested chunks that were hits (see the module text)."""
    cache = HostCache(slots, 1, policy)
    hits = total = 0
    for chunks in trace:
        total += len(chunks)
        lead = 0
        while lead < len(chunks) and cache.get(chunks[lead]) is not None:
            lead += 1
        hits += lead
        for key in chunks[lead:]:
            if (slot := cache.reserve()) is not None:
                cache.commit(key, slot, [1])
    return hits / total


def policy_rows(traces: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    rows = []
    for name, trace in traces.items():
        distinct = len({c for r in trace for c in r})
        for share in SHARES:
            slots = max(1, int(distinct * share))
            got = {p: replay(trace, slots, p) for p in ("lru", "s3fifo")}
            rows.append({"trace": name, "share": share, "slots": slots, **got})
            print(
                f"{name:<24} cache {share:>4.0%} ({slots} chunks): LRU {got['lru']:.3f}, "
                f"S3-FIFO {got['s3fifo']:.3f}",
                flush=True,
            )
    return rows


async def load_rates(chunks: int, repeats: int) -> dict[str, float]:
    """GB/s of a load from the tier and of a plain copy of the same bytes."""
    kv = make_layout(
        num_layers=32, num_blocks=2 * chunks, block_size=16, heads=8, head_dim=128,
        block_granular=True, dtype="float16",
    )  # fmt: skip
    src, dst = list(range(chunks)), list(range(chunks, 2 * chunks))
    fill_blocks(kv, src, seed=1)
    ctx = TransportContext("bench", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], kv)
    keys = [f"{i:032x}" for i in range(chunks)]
    nbytes = sum(len(s) for i in range(32) for b in src for s in kv.spans(i, b, 16))
    with tempfile.TemporaryDirectory() as tmp:
        tier = with_host_tier(FsTransport(FsOptions(path=tmp), ctx), 2 * nbytes, "s3fifo")
        await tier.open()
        await tier.register(kv)

        async def spans(layer: int) -> list[list[memoryview]]:
            return kv.chunk_spans(layer, src, [16] * chunks)

        await tier.save(SaveJob("r", keys, [16] * chunks, 32, spans))
        plain = np.frombuffer(bytearray(nbytes), np.uint8)
        plain[:] = np.concatenate(
            [np.frombuffer(s, np.uint8) for i in range(32) for b in src for s in kv.spans(i, b, 16)]
        )
        targets = [
            np.frombuffer(s, np.uint8) for i in range(32) for b in dst for s in kv.spans(i, b, 16)
        ]

        async def from_tier() -> None:
            await tier.load(
                LoadJob("r", keys, [16] * chunks, 32,
                        lambda i: kv.chunk_spans(i, dst, [16] * chunks), lambda _: None)
            )  # fmt: skip

        async def copy() -> None:
            at = 0
            for t in targets:
                t[:] = plain[at : at + len(t)]
                at += len(t)

        times: dict[str, list[float]] = {"tier": [], "copy": []}
        for r in range(repeats + 1):
            for name, run in (("tier", from_tier), ("copy", copy))[:: 1 if r % 2 else -1]:
                t0 = time.perf_counter()
                await run()
                if r:
                    times[name].append(time.perf_counter() - t0)
        assert [bytes(s) for b in dst for s in kv.spans(0, b, 16)] == [
            bytes(s) for b in src for s in kv.spans(0, b, 16)
        ]
        await tier.aclose()
    return {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}


def main() -> int:
    meta = record.start()
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", action="append", default=[], help="a Mooncake trace (JSONL)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats, a shorter trace")
    args = ap.parse_args()
    repeats = 3 if args.quick else args.repeats
    traces = {"synthetic": synthetic_trace(5000 if args.quick else 20000)}
    traces |= {Path(p).stem: mooncake_trace(Path(p)) for p in args.trace}
    rows = policy_rows(traces)
    rates = trio.run(load_rates, 64, repeats)
    ratio = rates["tier"] / rates["copy"]
    print(f"load: tier {rates['tier']:.2f} GB/s, copy {rates['copy']:.2f} GB/s ({ratio:.2f}x)")
    out = Path(__file__).parent / "results" / "tier.json"
    load = {**rates, "ratio": ratio, "repeats": repeats, "chunks": 64}
    record.save(out, {"policy": rows, "load": load}, meta)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
