"""Benchmark: `fs` save and load throughput against plain file writes and reads of the
same bytes, in the same run, alternating.

    python bench/bench_fs_io.py [--repeats 9] [--quick]
    python bench/bench_fs_io.py --store-key [--repeats 5] [--quick]

No engine: the transport is driven directly, as kvflow's worker drives it, over KV
memory laid out as vLLM's CPU build lays it out (block-granular caches). Two
geometries:

- `llama3-8b`: 32 layers, 8 KV heads x 128, fp16, block 16: 128 KiB per token; one
  request of 8192 tokens = 512 chunk files, 1 GiB;
- `bench-llama`: the engine benchmarks' model, 8 layers, 8 KV heads x 128, fp32,
  block 128: 64 KiB per token; one request of 4096 tokens = 32 files, 256 MiB.

Four sides, in alternating order each repeat, each with its own store:

- `kvflow`: `FsTransport` as configured by default (`threads: 2`, `verify: true`):
  save = temp files, each file's header and layers (each hashed with XXH3-64 just
  before) in one `pwritev`, rename; layer load = layers in groups 0, 1, 2-3, 4-7, ...
  (what a load the forward waits on does), each layer hashed and checked right after
  it is read; file load = each file in one `preadv` (an asynchronous load, vLLM's
  prefix cache on);
- `kvflow 1 thread`: the same with `threads: 1`;
- `kvflow unverified`: `kvflow` with `verify: false` (what the checksums cost);
- `plain`: one thread, no checksum, no header, no rename: per chunk `open(O_CREAT)`,
  one `pwritev` of its layers, `close`; per file `open`, one `preadv` into the same
  destination blocks, `close`.

The process's garbage-collected heap is frozen once the stores are open (`gc.freeze()`),
as vLLM's engine core and GPU worker freeze theirs once started (`freeze_gc_heap`):
otherwise a collection during a load traverses every object the process holds.
Saves go into an empty store (the files removed and the disk synced before, untimed);
loads read what the side saved, from the page cache, the disk synced before each
(untimed: no writeback of the saves runs during a load). Every load is checked byte for
byte against the source blocks (untimed). Each side's files are read once, untimed,
before its timed loads: in experiments a file's first read after its write varied
most from one load to the next, and it fell on whichever load came first. Each load of
a kvflow side is timed next to a plain load, first or second in turn (the machine's
memory bandwidth drifts with what else runs on it, and a neighbour sees the same); a
load's ratio is the median of its ratios to those plain loads, a save's of median GB/s.
One more pair each round, `layer load, first read`: `kvflow`'s and plain's stores
written again (untimed), then `kvflow`'s layer load and a plain load, each its files'
first read since their write (a prefix saved, then loaded a moment later). Medians of
`--repeats` after one warm-up round; every time is kept (`samples`). Writes
bench/results/fs-io.json.

`--store-key` measures what a store key (`store_key_file`) costs instead, on
`bench-llama` alone (a run under 2 minutes on 2 cores): three sides, `unkeyed`, `keyed`
and `keyed AUTO`, each `FsTransport` as configured by default (`threads: 2`,
`verify: true`) with its own store, the keyed ones with a `StoreKey` in their context
(each layer hashed and checked with keyed BLAKE3 instead of XXH3-64: `keyed` in one
thread per layer as kvflow does, `keyed AUTO` with `max_threads=blake3.blake3.AUTO`
inside each of the transport's threads), the same save, layer load and file load in
alternating order; ratios are of GB/s against unkeyed. Before them, the hashes alone over
one chunk's layers (1 MiB each): XXH3-64, the keyed BLAKE2b-64 kvflow used before, keyed
BLAKE3 and keyed BLAKE3 AUTO, in one thread and in two threads at once (each on its own
layers, as `fs`'s two threads hash). It records the load average before and after (the
machine may be shared). Writes bench/results/fs-store-key.json.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import record
import trio

import kvflow.chunks
from kvflow.chunks import layer_hash
from kvflow.geometry.layout import KVLayout
from kvflow.keys import StoreKey, chunk_keys
from kvflow.testing.layouts import make_layout
from kvflow.transport import LoadJob, SaveJob, TransportContext
from kvflow_fs import FsOptions, FsTransport


@dataclass(frozen=True)
class Geometry:
    layers: int
    heads: int
    head_dim: int
    dtype: str
    block_size: int
    tokens: int


GEOMETRIES = {
    "llama3-8b": Geometry(32, 8, 128, "float16", 16, 8192),
    "bench-llama": Geometry(8, 8, 128, "float32", 128, 4096),
}


@dataclass
class Case:
    name: str
    geo: Geometry
    src: KVLayout
    dst: KVLayout
    keys: list[str]
    src_ids: list[int]
    dst_ids: list[int]

    @property
    def counts(self) -> list[int]:
        return [self.geo.block_size] * len(self.keys)

    @property
    def nbytes(self) -> int:
        return self.src.nbytes(self.counts)

    def spans(self, layout: KVLayout, ids: list[int]) -> list[list[memoryview]]:
        """Each chunk's spans over all layers, layer-major (the file's order)."""
        per_layer = [layout.chunk_spans(i, ids, self.counts) for i in range(self.geo.layers)]
        return [[s for layer in per_layer for s in layer[c]] for c in range(len(ids))]


def make_case(name: str, geo: Geometry) -> Case:
    n = geo.tokens // geo.block_size
    kw = dict(
        num_layers=geo.layers,
        num_blocks=2 * n,
        block_size=geo.block_size,
        heads=geo.heads,
        head_dim=geo.head_dim,
        block_granular=True,
        dtype=geo.dtype,
    )
    src, dst = make_layout(**kw), make_layout(**kw)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    for buf in src.buffers:
        np.frombuffer(buf, dtype=np.uint8)[:] = rng.integers(0, 256, len(buf), dtype=np.uint8)
    tokens = rng.integers(3, 30000, geo.tokens).tolist()
    ids = rng.permutation(2 * n).tolist()
    return Case(name, geo, src, dst, chunk_keys("bench", tokens, geo.block_size), ids[:n], ids[n:])


def _transport(
    root: Path, case: Case, threads: int = 1, store_key: StoreKey | None = None
) -> FsTransport:
    shard = "tp0of1pp0"
    ctx = TransportContext("bench", "worker", "ns", shard, [shard], case.src, store_key=store_key)
    return FsTransport(FsOptions(path=str(root), max_gb=0, threads=threads), ctx)


async def kvflow_save(t: FsTransport, case: Case) -> None:
    async def layer(i: int) -> list[list[memoryview]]:
        return case.src.chunk_spans(i, case.src_ids, case.counts)

    await t.save(SaveJob("r", case.keys, case.counts, case.geo.layers, layer))


async def kvflow_load(t: FsTransport, case: Case, layerwise: bool = True) -> None:
    loaded: list[int] = []
    job = LoadJob(
        "r",
        case.keys,
        case.counts,
        case.geo.layers,
        spans=lambda i: case.dst.chunk_spans(i, case.dst_ids, case.counts),
        layer_loaded=loaded.append,
        layerwise=layerwise,
    )
    await t.load(job)
    assert loaded == list(range(case.geo.layers)), loaded


def plain_write(t: FsTransport, case: Case) -> None:
    for key, spans in zip(case.keys, case.spans(case.src, case.src_ids), strict=True):
        path = t.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.pwritev(fd, spans, 4096)
        os.close(fd)


def plain_read(t: FsTransport, case: Case) -> None:
    for key, spans in zip(case.keys, case.spans(case.dst, case.dst_ids), strict=True):
        fd = os.open(t.path(key), os.O_RDONLY)
        os.preadv(fd, spans, 4096)
        os.close(fd)


def check_loaded(case: Case) -> None:
    for i in range(case.geo.layers):
        a = case.src.chunk_spans(i, case.src_ids, case.counts)
        b = case.dst.chunk_spans(i, case.dst_ids, case.counts)
        if any(x[0] != y[0] for x, y in zip(a, b, strict=True)):
            raise AssertionError(f"{case.name}: layer {i} differs after the load")


def clear(case: Case) -> None:
    for buf in case.dst.buffers:
        np.frombuffer(buf, dtype=np.uint8)[:] = 0


SIDES = ("kvflow", "kvflow 1 thread", "kvflow unverified", "plain")
"""`kvflow unverified`: `kvflow` with `verify: false` (what the checksums cost)."""
KVFLOW_SIDES = SIDES[:3]
OPS = (("save", "plain save"), ("layer load", "plain load"), ("file load", "plain load"))
LOADS = ("layer load", "file load")
FIRST_READ = ", first read"
"""Of a load that is its files' first read since they were written."""


def bench_case(case: Case, repeats: int, tmp: Path) -> dict[str, Any]:
    """Each side's saves and loads: `gbs` (medians, GB/s), `ratios` (medians of each
    load's ratio to the plain load timed next to it) and `samples` (every time, s)."""
    roots = {side: tmp / f"{case.name}-{i}" for i, side in enumerate(SIDES)}
    times: dict[str, list[float]] = {}
    paired: dict[str, list[float]] = {}

    async def load(side: str, op: str, t: FsTransport) -> float:
        clear(case)
        os.sync()  # no writeback of the saves above runs during the load
        t0 = time.perf_counter()
        if side == "plain":
            plain_read(t, case)
        else:
            await kvflow_load(t, case, layerwise=op == "layer load")
        took = time.perf_counter() - t0
        check_loaded(case)
        return took

    async def save(side: str, t: FsTransport) -> float:
        shutil.rmtree(Path(t.options.path) / "ns")
        (Path(t.options.path) / "ns").mkdir()
        os.sync()  # every side starts with no deletes or writes pending on the disk
        t0 = time.perf_counter()
        if side == "plain":
            plain_write(t, case)
        else:
            await kvflow_save(t, case)
        took = time.perf_counter() - t0
        await t.chores_done()  # the count of what it saved, in the background: not in a load
        return took

    async def pair(
        r: int, i: int, side: str, op: str, ts: dict[str, FsTransport], tag: str = ""
    ) -> None:
        """Round `r`'s `i`th load, `side`'s `op`, and a plain load, first or second in
        turn: the machine's memory bandwidth drifts with what else runs on it, and a
        neighbour sees the same."""
        both = [("plain", "load"), (side, op)]
        took = {k: await load(*k, ts[k[0]]) for k in (both if (r + i) % 2 else both[::-1])}
        if r:
            for (s, o), v in took.items():
                times.setdefault(f"{s} {o}{tag}", []).append(v)
            paired.setdefault(f"{side} {op}{tag}", []).append(
                took["plain", "load"] / took[side, op]
            )

    async def run() -> None:
        ts = {side: _transport(roots[side], case, 1 if "1 thread" in side else 2) for side in SIDES}
        ts["kvflow unverified"].options.verify = False
        for t in ts.values():
            await t.open()
        gc.collect()  # as vLLM's engine core and workers do once started (`freeze_gc_heap`):
        gc.freeze()  # what they hold is never traversed again by a collection
        for r in range(repeats + 1):  # round 0 warms up and is not counted
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for side in order:
                took = await save(side, ts[side])
                if r:
                    times.setdefault(f"{side} save", []).append(took)
            for side in order:  # untimed: a file's first read after its write varies most
                plain_read(ts[side], case)
            loads = [(side, op) for side in order if side != "plain" for op in LOADS]
            for i, (side, op) in enumerate(loads):
                await pair(r, i, side, op, ts)
            # as configured, the first read of files written a moment before (a prefix
            # saved, then loaded), against plain's first read of its own: both written again
            for side in ("kvflow", "plain"):
                await save(side, ts[side])
            await pair(r, 0, "kvflow", "layer load", ts, FIRST_READ)

    try:
        trio.run(run)
    finally:
        gc.unfreeze()
    return {
        "gbs": {k: case.nbytes / statistics.median(v) / 1e9 for k, v in times.items()},
        "ratios": {k: statistics.median(v) for k, v in paired.items()},
        "samples": times,
    }


KEYED_SIDES = ("unkeyed", "keyed", "keyed AUTO")
KEYED_GEOMETRIES = ("bench-llama",)
KEYED_OPS = ("save", "layer load", "file load")


@contextmanager
def hash_threads(n: int) -> Iterator[None]:
    """Keyed layer hashes with `max_threads=n` (kvflow's is 1) while inside."""
    was, kvflow.chunks.KEYED_HASH_THREADS = kvflow.chunks.KEYED_HASH_THREADS, n
    try:
        yield
    finally:
        kvflow.chunks.KEYED_HASH_THREADS = was


def _blake2b_before(spans: list[memoryview], key: StoreKey, chunk: str, layer: int) -> int:
    """The keyed layer hash kvflow had before BLAKE3 (e25b338), for comparison."""
    h = hashlib.blake2b(kvflow.chunks._binding(chunk, "s", layer), digest_size=8, key=key.checksums)
    for s in spans:
        h.update(s)
    return int.from_bytes(h.digest(), "little")


def bench_hashes(case: Case, rounds: int = 5, secs: float = 0.2) -> dict[str, dict[str, float]]:
    """GB/s of each layer hash over the case's layers, in one thread and in two at once
    (the first thread on the even chunks, the second on the odd): medians of `rounds`
    rounds of about `secs` each, every hash and width in turn within a round."""
    key = StoreKey(os.urandom(32))
    layers = [case.src.chunk_spans(i, case.src_ids, case.counts) for i in range(case.geo.layers)]
    work = [(c, i, layers[i][c]) for c in range(len(case.keys)) for i in range(case.geo.layers)]

    def keyed(spans: list[memoryview], c: int, i: int) -> object:
        return layer_hash(spans, key, case.keys[c], "s", i)

    # name: (hash, its max_threads where keyed BLAKE3)
    hashes: dict[str, tuple[Callable[[list[memoryview], int, int], object], int]] = {
        "XXH3-64 (no key)": (lambda spans, c, i: layer_hash(spans), 1),
        "keyed BLAKE2b-64 (before)": (lambda spans, c, i: _blake2b_before(spans, key, "k", i), 1),
        "keyed BLAKE3": (keyed, 1),
        "keyed BLAKE3 AUTO": (keyed, blake3.blake3.AUTO),
    }

    def rate(fn: Callable[[list[memoryview], int, int], object], width: int) -> float:
        done = [0] * width
        stop = time.perf_counter() + secs

        def one(w: int) -> None:
            mine = work[w::width]
            while time.perf_counter() < stop:
                for c, i, spans in mine[:8]:
                    fn(spans, c, i)
                    done[w] += sum(len(s) for s in spans)
                mine = mine[8:] + mine[:8]

        threads = [threading.Thread(target=one, args=(w,)) for w in range(width)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(done) / (time.perf_counter() - t0) / 1e9

    got: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds + 1):  # round 0 warms up and is not counted
        for name, (fn, threads) in hashes.items():
            with hash_threads(threads):
                for width, label in ((1, "1 thread"), (2, "2 threads")):
                    gbs = rate(fn, width)
                    if r:
                        got.setdefault((name, label), []).append(gbs)
    out: dict[str, dict[str, float]] = {}
    for (name, label), v in got.items():
        out.setdefault(name, {})[label] = statistics.median(v)
    for name, at in out.items():
        print(
            f"  {name:<26} 1 thread {at['1 thread']:5.2f} GB/s   "
            f"2 threads at once {at['2 threads']:5.2f} GB/s",
            flush=True,
        )
    return out


def bench_keyed(case: Case, repeats: int, tmp: Path) -> dict[str, float]:
    """Medians of each side's save and loads, in GB/s: unkeyed, keyed and keyed with
    BLAKE3's own threads (`keyed AUTO`), alternating."""
    roots = {side: tmp / f"{case.name}-{side}" for side in KEYED_SIDES}
    key = StoreKey(os.urandom(32))
    times: dict[str, list[float]] = {}

    async def run() -> None:
        ts = {
            side: _transport(roots[side], case, 2, None if side == "unkeyed" else key)
            for side in KEYED_SIDES
        }
        threads = {side: blake3.blake3.AUTO if side == "keyed AUTO" else 1 for side in KEYED_SIDES}
        for t in ts.values():
            await t.open()
        for r in range(repeats + 1):  # round 0 warms up and is not counted
            order = KEYED_SIDES if r % 2 == 0 else KEYED_SIDES[::-1]
            for side in order:
                shutil.rmtree(roots[side] / "ns")
                (roots[side] / "ns").mkdir()
                os.sync()
                t0 = time.perf_counter()
                with hash_threads(threads[side]):
                    await kvflow_save(ts[side], case)
                if r:
                    times.setdefault(f"{side} save", []).append(time.perf_counter() - t0)
            for side in order:
                for op in KEYED_OPS[1:]:
                    clear(case)
                    t0 = time.perf_counter()
                    with hash_threads(threads[side]):
                        await kvflow_load(ts[side], case, layerwise=op == "layer load")
                    if r:
                        times.setdefault(f"{side} {op}", []).append(time.perf_counter() - t0)
                    check_loaded(case)

    try:
        trio.run(run)
    finally:
        gc.unfreeze()
    return {k: case.nbytes / statistics.median(v) / 1e9 for k, v in times.items()}


def main_store_key(args: argparse.Namespace, meta: dict[str, object]) -> int:
    repeats = 3 if args.quick else args.repeats
    tmp = Path(tempfile.mkdtemp(prefix="kvflow-fskey-", dir=args.dir or None))
    load_before = os.getloadavg()
    cases: dict[str, object] = {}
    try:
        for name in KEYED_GEOMETRIES:
            case = make_case(name, GEOMETRIES[name])
            print(f"{name}: each layer hash alone, over 1 MiB layers:")
            hashes = bench_hashes(case)
            gbs = bench_keyed(case, repeats, tmp)
            ratio = {op: gbs[f"keyed {op}"] / gbs[f"unkeyed {op}"] for op in KEYED_OPS}
            auto = {op: gbs[f"keyed AUTO {op}"] / gbs[f"unkeyed {op}"] for op in KEYED_OPS}
            cases[name] = {
                "mib": case.nbytes / 2**20,
                "files": len(case.keys),
                "layer_mib": case.nbytes / 2**20 / len(case.keys) / case.geo.layers,
                "hashes": hashes,
                "gbs": gbs,
                "ratio": ratio,
                "ratio_auto": auto,
            }
            print(f"{name}: {case.nbytes / 2**20:.0f} MiB in {len(case.keys)} files, GB/s:")
            for op in KEYED_OPS:
                print(
                    f"  {op:<11} unkeyed {gbs[f'unkeyed {op}']:.2f}   "
                    f"keyed {gbs[f'keyed {op}']:.2f} ({ratio[op]:.2f}x)   "
                    f"keyed AUTO {gbs[f'keyed AUTO {op}']:.2f} ({auto[op]:.2f}x)",
                    flush=True,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = Path(__file__).parent / "results" / "fs-store-key.json"
    data = {
        "repeats": repeats,
        "dir": args.dir or tempfile.gettempdir(),
        "threads": 2,
        "cores": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cases": cases,
    }
    record.save(out, data, meta)
    print(f"wrote {out}")
    return 0


def main() -> int:
    meta = record.start()
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="3 repeats")
    ap.add_argument("--dir", default="", help="where the stores go (default: the temp dir)")
    ap.add_argument(
        "--store-key", action="store_true", help="keyed against unkeyed checksums instead"
    )
    args = ap.parse_args()
    if args.store_key:
        return main_store_key(args, meta)
    repeats = 3 if args.quick else args.repeats
    tmp = Path(tempfile.mkdtemp(prefix="kvflow-fsio-", dir=args.dir or None))
    cases: dict[str, object] = {}
    try:
        for name, geo in GEOMETRIES.items():
            case = make_case(name, geo)
            got = bench_case(case, repeats, tmp)
            cases[name] = {"mib": case.nbytes / 2**20, "files": len(case.keys), **got}
            gbs, ratios = got["gbs"], got["ratios"]
            print(f"{name}: {case.nbytes / 2**20:.0f} MiB in {len(case.keys)} files, GB/s:")
            for op, base in (*OPS, ("layer load" + FIRST_READ, "plain load" + FIRST_READ)):
                keys = [k for side in KVFLOW_SIDES if (k := f"{side} {op}") in gbs]
                cells = [
                    f"{k} {gbs[k]:.2f} ({ratios.get(k, gbs[k] / gbs[base]):.2f}x)" for k in keys
                ]
                print(f"  {op:<11} {base} {gbs[base]:.2f}   " + "   ".join(cells), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = Path(__file__).parent / "results" / "fs-io.json"
    where = os.statvfs(args.dir or tempfile.gettempdir())
    data = {
        "repeats": repeats,
        "dir": args.dir or tempfile.gettempdir(),
        "free_gb": where.f_bavail * where.f_frsize / 1e9,
        "cases": cases,
    }
    record.save(out, data, meta)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
