"""Save / load throughput of the `redis` transport against a redis-server, and baselines.

    python3 plugins/kvflow_redis/bench/bench_redis.py [--url redis://HOST:PORT/0] [--repeat 7]

Without `--url` it starts `redis-server` on a free loopback port (no persistence,
`maxmemory 2gb`, `allkeys-lru`). One request = 64 chunks of Llama-8B-like KV: 32 layers x
64 KiB (16 tokens x 8 KV heads x 128 dims x K,V x fp16) = 2 MiB per chunk, 128 MiB in all,
in an NHD (token-granular) layout: two 32 KiB spans per layer and chunk.

Rows:
- `kvflow-redis save/load`: `RedisTransport.save` / `.load` of the request (layers given at
  once; load with XXH3 verification, and with `verify=false`), when the load signalled
  `layer_loaded(0)` (vLLM's attention on layer 0 may start), `lookup` of its 64 keys.
- `redis-py raw SET/GET`: the plain `redis` client (hiredis parser if installed) SETting
  and GETting the same 64 x 2 MiB values as prepared `bytes`, pipelined, in this process:
  the server's and the loopback's speed, with no KV memory on either side.
- `redis-py in a thread`: what a transport built on redis-py under `trio.to_thread` would
  do: join each chunk's spans into one value, SET pipelined; GET pipelined, then copy each
  value into the spans.
Each row: median of `--repeat` runs; GB/s = 2**30 bytes per second.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import trio

from kvflow.keys import chunk_keys
from kvflow.testing import make_layout
from kvflow.transport import LoadJob, SaveJob, TransportContext
from kvflow_redis import RedisOptions, RedisTransport

CHUNKS, LAYERS, BLOCK = 64, 32, 16


def start_server() -> tuple[str, subprocess.Popen[bytes]]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed (apt-get install -y redis-server), or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp(prefix="kvflow-redis-bench-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", work, "--save", ""]
    args += ["--appendonly", "no", "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}/0", proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


def gbps(nbytes: int, seconds: list[float]) -> str:
    med = statistics.median(seconds)
    return f"{nbytes / med / 2**30:6.2f} GB/s  ({med * 1e3:7.1f} ms median of {len(seconds)})"


async def bench_transport(url: str, repeat: int) -> list[tuple[str, int, list[float]]]:
    layout = make_layout(
        num_layers=LAYERS,
        num_blocks=2 * CHUNKS,
        block_size=BLOCK,
        heads=8,
        head_dim=128,
        dtype="float16",
    )
    rng = np.random.default_rng(0)
    for buf in layout.buffers:
        buf[:] = rng.integers(0, 256, len(buf), dtype=np.uint8).tobytes()
    src, dst = list(range(CHUNKS)), list(range(CHUNKS, 2 * CHUNKS))
    counts = [BLOCK] * CHUNKS
    nbytes = layout.nbytes(counts)
    assert layout.chunk_nbytes(0, BLOCK) == 64 * 1024, layout.chunk_nbytes(0, BLOCK)
    times: dict[str, list[float]] = {}

    def timed(name: str, t0: float) -> None:
        times.setdefault(name, []).append(time.perf_counter() - t0)

    for r in range(repeat):
        transports = {}
        for verify in (True, False):
            ctx = TransportContext("bench", "worker", "bench-ns", "tp0of1pp0", ["tp0of1pp0"])
            prefix = f"bench-{os.getpid()}-{r}:"
            t = RedisTransport(RedisOptions(url=url, key_prefix=prefix, verify=verify), ctx)
            await t.open()
            await t.register(layout)
            transports[verify] = t
        keys = chunk_keys(f"bench-{r}", list(rng.integers(0, 32000, CHUNKS * BLOCK)), BLOCK)

        async def spans(i: int) -> list[list[memoryview]]:
            return layout.chunk_spans(i, src, counts)

        t0 = time.perf_counter()
        await transports[True].save(SaveJob("bench", keys, counts, LAYERS, spans))
        timed("save", t0)
        t0 = time.perf_counter()
        assert await transports[True].lookup(keys) == CHUNKS
        timed("lookup", t0)
        for verify, t in transports.items():
            first: list[float] = []

            def layer_loaded(i: int, first: list[float] = first) -> None:
                if i == 0:
                    first.append(time.perf_counter())

            job = LoadJob(
                "bench",
                keys,
                counts,
                LAYERS,
                lambda i: layout.chunk_spans(i, dst, counts),
                layer_loaded,
            )
            t0 = time.perf_counter()
            await t.load(job)
            timed(f"load {verify}", t0)
            times.setdefault(f"first {verify}", []).append(first[0] - t0)
            for i in (0, LAYERS - 1):
                a, b = layout.chunk_spans(i, src, counts), layout.chunk_spans(i, dst, counts)
                for p, q in zip(a, b, strict=True):
                    assert all(bytes(x) == bytes(y) for x, y in zip(p, q, strict=True))
        async with transports[True].pool.connection() as conn:
            await conn.pipeline([("DEL", transports[True].key(k)) for k in keys])
        for t in transports.values():
            await t.aclose()
    return [
        ("kvflow-redis save (64 x 2 MiB)", nbytes, times["save"]),
        ("kvflow-redis load, verify=true", nbytes, times["load True"]),
        ("kvflow-redis load, verify=false", nbytes, times["load False"]),
        ("kvflow-redis load: layer_loaded(0) after", 0, times["first True"]),
        ("  same, verify=false", 0, times["first False"]),
        ("kvflow-redis lookup of 64 keys", 0, times["lookup"]),
    ]


def bench_redis_py(url: str, repeat: int) -> list[tuple[str, int, list[float]]]:
    try:
        import redis
    except ImportError:
        print("(redis-py not installed: pip install redis hiredis for the baseline rows)")
        return []
    layout = make_layout(
        num_layers=LAYERS,
        num_blocks=2 * CHUNKS,
        block_size=BLOCK,
        heads=8,
        head_dim=128,
        dtype="float16",
    )
    for buf in layout.buffers:
        buf[:] = os.urandom(len(buf))
    counts = [BLOCK] * CHUNKS
    nbytes = layout.nbytes(counts)
    client = redis.Redis.from_url(url)
    values = [os.urandom(LAYERS * 64 * 1024) for _ in range(CHUNKS)]

    def raw_set(keys: list[str]) -> None:
        p = client.pipeline(transaction=False)
        for k, v in zip(keys, values, strict=True):
            p.set(k, v)
        p.execute()

    def raw_get(keys: list[str]) -> None:
        p = client.pipeline(transaction=False)
        for k in keys:
            p.get(k)
        got = p.execute()
        assert len(got[0]) == len(values[0])

    def thread_set(keys: list[str]) -> None:
        p = client.pipeline(transaction=False)
        for c in range(CHUNKS):
            parts = [s for i in range(LAYERS) for s in layout.spans(i, c, BLOCK)]
            p.set(keys[c], b"".join(parts))
        p.execute()

    def thread_get(keys: list[str]) -> None:
        p = client.pipeline(transaction=False)
        for k in keys:
            p.get(k)
        got = p.execute()
        for c, value in enumerate(got):
            view, off = memoryview(value), 0
            for i in range(LAYERS):
                for s in layout.spans(i, CHUNKS + c, BLOCK):
                    s[:] = view[off : off + len(s)]
                    off += len(s)

    def in_thread(fn: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
        return lambda keys: trio.run(trio.to_thread.run_sync, fn, keys)

    times: dict[str, list[float]] = {}
    pairs = [("raw", raw_set, raw_get), ("thread", in_thread(thread_set), in_thread(thread_get))]
    for r in range(repeat):  # fresh keys each time, deleted after: as the transport rows
        for name, put, get in pairs:
            keys = [f"bench-{name}-{os.getpid()}-{r}-{c}" for c in range(CHUNKS)]
            for what, fn in (("set", put), ("get", get)):
                t0 = time.perf_counter()
                fn(keys)
                times.setdefault(f"{name} {what}", []).append(time.perf_counter() - t0)
            client.delete(*keys)
    parser = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "python parser"
    return [
        (f"redis-py raw SET, pipelined ({parser})", nbytes, times["raw set"]),
        (f"redis-py raw GET, pipelined ({parser})", nbytes, times["raw get"]),
        ("redis-py in a thread: join + SET", nbytes, times["thread set"]),
        ("redis-py in a thread: GET + copy", nbytes, times["thread get"]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    proc = None
    url = args.url
    if not url:
        url, proc = start_server()
    try:
        rows = trio.run(bench_transport, url, args.repeat)
        rows += bench_redis_py(url, args.repeat)
    finally:
        if proc is not None:
            proc.kill()
    print(f"server {url}; one request = {CHUNKS} chunks x {LAYERS} layers x 64 KiB = 128 MiB")
    for name, nbytes, secs in rows:
        if nbytes:
            print(f"  {name:44s} {gbps(nbytes, secs)}")
        else:
            print(f"  {name:44s} {statistics.median(secs) * 1e3:7.2f} ms median")


if __name__ == "__main__":
    main()
