"""The `redis` transport on coredis against the hand-written RESP client it replaced, and a
3-master Redis Cluster against one server.

    python3 plugins/kvflow_redis/bench/bench_redis.py [--repeat 7] [--baseline-ref faa0d4c]
    python bench/run.py --only redis                  # the same, tables into the docs

It starts its own servers on loopback (no persistence, `maxmemory 2gb`, `allkeys-lru`):
one redis-server, and a cluster of 3 masters with a replica each (`tests/servers.py`).
The old client is the package as it was at `--baseline-ref` (`git show`), imported
under another name; both sides run in this process, alternating A-B-B-A within each
repeat, on fresh keys deleted after. GB/s = 10^9 bytes per second; every sample is kept
in bench/results/redis.json with the commit, command, machine and date.

Parts:
- `client`: 64 values of 1 MiB, SET pipelined, then read back with one MGET, and (the
  old client's own load path) GET read straight into a preallocated buffer.
- `transport`: `RedisTransport.save` and `.load` of one request of Llama-8B-like KV
  (64 chunks x 32 layers x 64 KiB = 128 MiB, XXH3 verified), and when `layer_loaded(0)`
  came.
- `cluster`: 4 workers at once, each saving then loading its own 32 MiB request, on one
  server and on the cluster (`mode: cluster`): the aggregate.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import trio

from kvflow import LoadJob, SaveJob, TransportContext
from kvflow.testing import make_layout

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(ROOT / "bench"))  # record.py: what a results file records
import record  # noqa: E402
import servers  # noqa: E402

import kvflow_redis  # noqa: E402

CHUNKS, LAYERS, BLOCK, MIB = 64, 32, 16, 1 << 20
OLD_FILES = ("__init__.py", "_format.py", "_resp.py", "_transport.py")


def old_package(ref: str) -> ModuleType:
    """kvflow_redis as it was at `ref`, imported as `kvflow_redis_old`."""
    work = Path(tempfile.mkdtemp(prefix="kvflow-redis-old-")) / "kvflow_redis_old"
    work.mkdir()
    for name in OLD_FILES:
        text = subprocess.run(
            ["git", "show", f"{ref}:plugins/kvflow_redis/kvflow_redis/{name}"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        (work / name).write_text(text)
    spec = importlib.util.spec_from_file_location(
        "kvflow_redis_old", work / "__init__.py", submodule_search_locations=[str(work)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvflow_redis_old"] = module
    spec.loader.exec_module(module)
    return module


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


# -- client: pipelined SET / MGET of 1 MiB values ----------------------------------------


async def client_rounds(url: str, old: ModuleType, repeat: int) -> dict[str, list[float]]:
    import coredis

    values = [os.urandom(MIB) for _ in range(CHUNKS)]
    samples: dict[str, list[float]] = {}
    target = old._resp.parse_url(url)
    pool = old._resp.Pool(target, 4, 60.0, "bench")
    pool.max_bulk = 2 * MIB
    new = kvflow_redis.RedisTransport(
        kvflow_redis.RedisOptions(url=url), TransportContext("b", "worker", "ns", "s", ["s"])
    )
    await new.open()
    new.limits.max_bulk = CHUNKS * MIB  # the guard bounds a whole reply: MGET of them all
    client: coredis.Redis[bytes] = new.client  # type: ignore[assignment]
    bufs = [bytearray(MIB) for _ in range(CHUNKS)]

    async def new_side(keys: list[bytes]) -> None:
        async def put() -> None:
            async with client.pipeline(transaction=False) as p:
                for k, v in zip(keys, values, strict=True):
                    p.set(k, v)

        async def mget() -> None:
            got = await client.mget(keys)
            assert got[-1] == values[-1]

        samples.setdefault("coredis SET", []).append(await timed(put))
        samples.setdefault("coredis MGET", []).append(await timed(mget))
        await client.delete(keys)

    async def old_side(keys: list[bytes]) -> None:
        async def put() -> None:
            sets = [("SET", k, [memoryview(v)]) for k, v in zip(keys, values, strict=True)]
            await pool.pipeline(sets)

        async def mget() -> None:
            (got,) = await pool.pipeline([("MGET", *keys)])
            assert got[-1] == values[-1]

        async def get_into() -> None:
            async with pool.connection() as conn:
                await conn.send([b for k in keys for b in old._resp.encode("GET", k)])
                for buf in bufs:
                    assert await conn.bulk_header() == MIB
                    await conn.read_into([memoryview(buf)])
                    await conn.bulk_end()
            assert bufs[-1] == values[-1]

        samples.setdefault("old SET", []).append(await timed(put))
        samples.setdefault("old MGET", []).append(await timed(mget))
        samples.setdefault("old GET into buffers", []).append(await timed(get_into))
        await pool.pipeline([("DEL", *keys)])

    try:
        for r in range(repeat):
            for side in (new_side, old_side, old_side, new_side):  # A-B-B-A
                await side([f"bench-{r}-{side.__name__}-{c}".encode() for c in range(CHUNKS)])
    finally:
        pool.close()
        await new.aclose()
    return samples


# -- transport: save / load of one request -----------------------------------------------


def llama_layout(chunks: int) -> Any:
    layout = make_layout(
        num_layers=LAYERS, num_blocks=2 * chunks, block_size=BLOCK, heads=8, head_dim=128,
        dtype="float16",
    )  # fmt: skip
    rng = np.random.default_rng(0)
    for buf in layout.buffers:
        buf[:] = rng.integers(0, 256, len(buf), dtype=np.uint8).tobytes()
    return layout


async def save_then_load(transport: Any, layout: Any, chunks: int, tag: str) -> dict[str, float]:
    """Save `chunks` chunks from the first blocks, load them into the next ones, check."""
    src, dst = list(range(chunks)), list(range(chunks, 2 * chunks))
    counts = [BLOCK] * chunks
    keys = [f"{tag}{c:020x}" for c in range(chunks)]

    async def spans(i: int) -> list[list[memoryview]]:
        return layout.chunk_spans(i, src, counts)

    first: list[float] = []

    def loaded(i: int) -> None:
        if i == 0:
            first.append(time.perf_counter())

    save = await timed(lambda: transport.save(SaveJob("b", keys, counts, LAYERS, spans)))
    t0 = time.perf_counter()
    job = LoadJob("b", keys, counts, LAYERS, lambda i: layout.chunk_spans(i, dst, counts), loaded)
    await transport.load(job)
    load = time.perf_counter() - t0
    for i in (0, LAYERS - 1):
        a, b = layout.chunk_spans(i, src, counts), layout.chunk_spans(i, dst, counts)
        assert [bytes(x) for p in a for x in p] == [bytes(y) for q in b for y in q]
    return {"save": save, "load": load, "first layer": first[0] - t0}


async def open_transport(package: ModuleType, url: str, prefix: str, **options: Any) -> Any:
    ctx = TransportContext("b", "worker", "bench-ns", "tp0of1pp0", ["tp0of1pp0"])
    opts = package.RedisOptions(url=url, key_prefix=prefix, **options)
    t = package.RedisTransport(opts, ctx)
    await t.open()
    return t


async def transport_rounds(url: str, old: ModuleType, repeat: int) -> dict[str, list[float]]:
    layout = llama_layout(CHUNKS)
    samples: dict[str, list[float]] = {}
    sides = {"coredis": kvflow_redis, "old": old}
    opened = {name: await open_transport(p, url, f"b-{name}:") for name, p in sides.items()}
    try:
        for t in opened.values():
            await t.register(layout)
        for r in range(repeat):
            for name in ("coredis", "old", "old", "coredis"):
                got = await save_then_load(opened[name], layout, CHUNKS, f"{r}{name}{len(samples)}")
                for what, secs in got.items():
                    samples.setdefault(f"{name} {what}", []).append(secs)
    finally:
        for t in opened.values():
            await t.aclose()
    return samples


# -- cluster: aggregate of concurrent workers --------------------------------------------

WORKERS, WORKER_CHUNKS = 4, 16


async def aggregate(url: str, mode: str, r: int) -> float:
    """Seconds for WORKERS transports to each save then load WORKER_CHUNKS chunks, at once."""
    layouts = [llama_layout(WORKER_CHUNKS) for _ in range(WORKERS)]
    ts = [await open_transport(kvflow_redis, url, f"agg{r}{w}:", mode=mode) for w in range(WORKERS)]
    try:
        for t, layout in zip(ts, layouts, strict=True):
            await t.register(layout)
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for w, (t, layout) in enumerate(zip(ts, layouts, strict=True)):
                nursery.start_soon(save_then_load, t, layout, WORKER_CHUNKS, f"{mode}{r}w{w}")
        return time.perf_counter() - t0
    finally:
        for t in ts:
            await t.aclose()


async def cluster_rounds(single: str, cluster: str, repeat: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"one server": [], "cluster": []}
    one, many = ("one server", single, "standalone"), ("cluster", cluster, "cluster")
    for r in range(repeat):
        for i, (name, url, mode) in enumerate((one, many, many, one)):  # A-B-B-A
            samples[name].append(await aggregate(url, mode, 4 * r + i))
    return samples


# -- report --------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def report(results: dict[str, Any]) -> None:
    c, t, k = results["client"], results["transport"], results["cluster"]
    n = CHUNKS * MIB
    print(f"client: {CHUNKS} x 1 MiB, medians of {len(c['coredis SET'])}")
    for op, old_op in (("SET", "SET"), ("MGET", "MGET"), ("MGET", "GET into buffers")):
        new_s, old_s = med(c[f"coredis {op}"]), med(c[f"old {old_op}"])
        print(f"  coredis {op:5s} {n / new_s / 1e9:5.2f} GB/s   old {old_op:17s} "
              f"{n / old_s / 1e9:5.2f} GB/s   ratio {old_s / new_s:4.2f}x")  # fmt: skip
    nbytes = CHUNKS * LAYERS * 64 * 1024
    print(f"transport: {nbytes >> 20} MiB request, medians of {len(t['coredis save'])}")
    for what in ("save", "load"):
        new_s, old_s = med(t[f"coredis {what}"]), med(t[f"old {what}"])
        print(f"  {what}: coredis {nbytes / new_s / 1e9:5.2f} GB/s, old "
              f"{nbytes / old_s / 1e9:5.2f} GB/s, ratio {old_s / new_s:4.2f}x")  # fmt: skip
    print(f"  first layer signalled: coredis {med(t['coredis first layer']) * 1e3:6.1f} ms, "
          f"old {med(t['old first layer']) * 1e3:6.1f} ms")  # fmt: skip
    agg = WORKERS * WORKER_CHUNKS * LAYERS * 64 * 1024 * 2  # saved and loaded
    one, many = med(k["one server"]), med(k["cluster"])
    print(f"cluster: {WORKERS} workers x {WORKER_CHUNKS * 2} MiB saved + loaded at once: one "
          f"server {agg / one / 1e9:5.2f} GB/s, 3 masters {agg / many / 1e9:5.2f} GB/s, "
          f"ratio {one / many:4.2f}x")  # fmt: skip


def main() -> None:
    meta = record.start()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats")
    ap.add_argument("--baseline-ref", default="faa0d4c", help="a commit with the old client")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "redis.json"))
    args = ap.parse_args()
    repeat = 3 if args.quick else args.repeat
    old = old_package(args.baseline_ref)
    work = Path(tempfile.mkdtemp(prefix="kvflow-redis-bench-"))
    with servers.standalone(work / "one") as single, servers.cluster(work / "cluster") as cl:
        results: dict[str, Any] = {
            "baseline_ref": args.baseline_ref,
            "client": trio.run(client_rounds, single.url, old, repeat),
            "transport": trio.run(transport_rounds, single.url, old, repeat),
            "cluster": trio.run(cluster_rounds, single.url, cl.url, repeat),
        }
    record.save(args.out, results, meta, ("plugins/kvflow_redis/kvflow_redis",))
    report(results)


if __name__ == "__main__":
    main()
