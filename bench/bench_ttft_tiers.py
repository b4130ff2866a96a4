"""Warm TTFT on bench-llama by where the KV comes from: recompute, `fs`, `redis` (fresh
engine processes) and the host-memory tier (`cpu_cache_gib`, the same process).

    python bench/bench_ttft_tiers.py [--repeats 3] [--quick]
    python bench/run.py --only ttft-tiers              # the same, table into the docs

Each repeat, with fresh random prompts of each length (1k, 4k, 8k tokens; --quick: 1k),
run one at a time (`one_by_one`), vLLM's prefix cache off, every engine process on core
0 after the one before it ended:

- `recompute`: an engine without a connector (its TTFT computes the whole prompt);
- `host tier`: an engine with `cpu_cache_gib: 2` over `fs` over `redis` (`tiers`) runs
  the prompts twice: the first time it computes and saves them (to its host tier, the
  fs directory and the redis-server), the second time they load from host memory;
- `fs`, `redis`: a fresh engine process on that store alone loads what the first saved
  (fs from the page cache: the files were just written; redis over loopback, a
  server with `maxmemory 4gb`, emptied before each repeat).

TTFT is vLLM's own first-token latency of the request. Every warm run's tokens are
compared with the recompute run's (a mismatch fails the benchmark). Writes every
sample to bench/results/ttft-tiers.json with the commit, command, machine and date.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "kvflow_redis" / "tests"))
import record  # noqa: E402
import servers  # noqa: E402

SOURCES = ("recompute", "host tier", "fs", "redis")


def one_repeat(work: Path, redis_url: str, lengths: list[int], seed: int) -> dict[str, Any]:
    from kvflow_vllm.engine_process import Scenario, model_dir, spawn_engine

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]  # vocab: 1024
    model = model_dir("bench-llama")
    store = work / f"fs-{seed}"
    redis = {"transport": "redis", "options": {"url": redis_url, "key_prefix": f"b{seed}:"}}
    common = {"model": model, "block_size": 128, "one_by_one": True, "max_tokens": 4}
    common["llm_args"] = {"max_model_len": 8448, "max_num_batched_tokens": 8448,
                          "hf_overrides": {"max_position_embeddings": 8448}}  # fmt: skip
    common["env"] = {"VLLM_CPU_OMP_THREADS_BIND": "0"}

    def run(name: str, batches: list[list[list[int]]], **kw: Any) -> list[Any]:
        sc = Scenario(batches=batches, **common, **kw)  # type: ignore[arg-type]
        return [r for b in spawn_engine(work, f"{name}-{seed}", sc).batches for r in b]

    fs = {"options": {"path": str(store), "max_gb": 0}}
    base = run("recompute", [prompts], connector=False)
    tier = run("tier", [prompts, prompts], extra_config=fs | {"cpu_cache_gib": 2, "tiers": [redis]})
    warm_fs = run("fs", [prompts], extra_config=fs)
    warm_redis = run("redis", [prompts], extra_config=redis)
    got = {
        "recompute": base,
        "host tier": tier[len(prompts) :],
        "fs": warm_fs,
        "redis": warm_redis,
    }
    for source, results in got.items():
        for r, want in zip(results, base, strict=True):
            if r.error or r.tokens != want.tokens:
                raise SystemExit(f"{source}: tokens differ from recompute ({r.error or r.tokens})")
    return {
        source: {str(n): {"ttft_s": r.ttft_s, "cached": r.cached_tokens}
                 for n, r in zip(lengths, results, strict=True)}
        for source, results in got.items()
    }  # fmt: skip


def main() -> None:
    meta = record.start()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1k tokens, 2 repeats")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ttft-tiers.json"))
    args = ap.parse_args()
    lengths = [1024] if args.quick else [1024, 4096, 8192]
    repeats = 2 if args.quick else args.repeats
    work = Path(tempfile.mkdtemp(prefix="kvflow-ttft-tiers-"))
    runs = []
    # room for a repeat's 13k tokens of KV (64 KiB each): its LRU must not evict them
    with servers.standalone(work / "redis", maxmemory="4gb") as redis:
        for r in range(repeats):
            servers.command(redis.servers[0].port, "FLUSHALL")
            runs.append(one_repeat(work, redis.url, lengths, seed=r))
            print(f"repeat {r + 1}/{repeats}: " + ", ".join(
                f"{s} {1e3 * runs[-1][s][str(lengths[-1])]['ttft_s']:.0f} ms" for s in SOURCES
            ), flush=True)  # fmt: skip
    result = {"engines_on": "core 0", "lengths": lengths, "runs": runs}
    extra = ("kvflow", "plugins/kvflow_vllm", "plugins/kvflow_redis", "transports/kvflow_fs")
    record.save(args.out, result, meta, extra)
    for n in lengths:
        row = [
            f"{s} {1e3 * statistics.median(run[s][str(n)]['ttft_s'] for run in runs):7.0f} ms"
            for s in SOURCES
        ]
        print(f"{n:5d} tokens: " + "  ".join(row))


if __name__ == "__main__":
    main()
