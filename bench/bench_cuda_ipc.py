"""Benchmark and check: the `zmq` transport's CUDA IPC pull between two processes
against a one-pass device-to-device copy of as many bytes, in the same run.

    python bench/bench_cuda_ipc.py            # 32 layers x 512 of 1024 blocks of 16 tokens
    python bench/bench_cuda_ipc.py --quick    # a few seconds; what the test suite runs
    python bench/bench_cuda_ipc.py --consumer-layout LBHNC   # converted NHD -> HND
    python bench/bench_cuda_ipc.py --runs 3 --out /tmp/ipc.json

A producer process (CUDA IPC handles do not open in the process that exported them)
registers KV caches laid out as vLLM lays out FlashAttention's default (LBNHC, logical
`[blocks, 8 heads, 16 tokens, 256]` float16 per layer: 64 KiB per block and layer,
Llama-3-8B's geometry) with a `zmq` transport and offers the same blocks once per
request. This process, the consumer, pulls each request into other blocks of its own
caches (zeroed before each pull) and checks every pulled byte. Pulls are asynchronous
loads, as kvflow's P/D pulls are (`LoadJob.layerwise` False: one wait for all layers);
`--layerwise` times loads a forward waits on layer by layer.

The baseline is one `dst.copy_(src)` of as many bytes as a pull moves, between two
preallocated contiguous tensors of this process on the same GPU: one pass, no indexing,
no temporaries. Pulls and copies are each timed as wall time from a
`torch.cuda.synchronize()` to the `torch.cuda.synchronize()` after them, in the order
A-B-B-A (pull, copy, copy, pull, pull, copy, ...: one pull and one copy per request,
which comes first alternating), so neither side always runs first. The first sample of
each side is warm-up (the first pull opens the IPC handles) and is left out of the
medians of both; every sample is kept in the JSON.

Prints, per run, the median GB/s of the pulls and of the copy, their ratio, and each as
a fraction of the device's peak memory bandwidth. A copy reads and writes each byte, so
its fraction is `2 * bytes/s / peak`, and likewise a pull's. The peak is
`2 * memory_clock_rate * memory_bus_width / 8` from `torch.cuda.get_device_properties`
(DDR; "bandwidth_source": "properties") or, where torch lacks those fields, the best of a
few 2 GiB `copy_`s counting bytes read and written ("measured"; then the copy's fraction
is close to 1 by construction).

`--runs N` repeats the whole measurement (a fresh producer, fresh caches) N times and
keeps each run's samples and medians (`runs` in the JSON), which also holds the commit,
the command line, the date (UTC), the machine and the mode. Writes
bench/results/cuda_ipc.json (cuda_ipc_layerwise.json; `_LAYOUT` appended for another
consumer layout) or `--out`; `--quick` writes nothing unless given `--out`, and prints
the JSON. Needs an NVIDIA GPU; exits 2 without one.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import record
import torch
import trio

from kvflow.geometry.layout import KVLayout
from kvflow.testing.layouts import device_layout
from kvflow.transport import LoadJob, Offer, PeerSource, TransportContext
from kvflow_zmq import ZmqOptions, ZmqTransport
from kvflow_zmq import _ipc as ipc

BLOCK, HEADS, HEAD_DIM = 16, 8, 128
WARMUP = 1
"""Samples of each side left out of its median: the first pull opens the IPC handles."""
ROOT = Path(__file__).resolve().parent.parent


def make_layout(
    layers: int, blocks: int, seed: int, order: str = "LBNHC"
) -> tuple[KVLayout, list[torch.Tensor]]:
    """Caches laid out as vLLM's FlashAttention default (LBNHC; or `order`) filled from
    `seed`, and their views."""
    return device_layout(
        "cuda",
        layout=order,
        num_layers=layers,
        num_blocks=blocks,
        block_size=BLOCK,
        heads=HEADS,
        head_dim=HEAD_DIM,
        seed=seed,
    )


def _context(layout: KVLayout) -> TransportContext:
    return TransportContext("bench", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout)


def producer_main(conn: Connection, layers: int, blocks: int, requests: int, small: int) -> None:
    async def run() -> None:
        layout, _ = make_layout(layers, blocks, seed=1)
        t = ZmqTransport(ZmqOptions(), _context(layout))
        await t.open()
        await t.register(layout)
        outcomes = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.serve)
            conn.send(t.address)
            for r in range(requests + small):  # then pulls of one block each
                ids = list(range(blocks // 2 if r < requests else 1))
                offer = Offer(f"r{r}", ids, [BLOCK] * len(ids), layers, lambda layer: [])
                outcomes.append(await t.offer(offer))
            nursery.cancel_scope.cancel()
        conn.send(outcomes)
        await t.aclose()

    trio.run(run)


# -- timing --------------------------------------------------------------------------------


def copy_s(src: torch.Tensor, dst: torch.Tensor) -> float:
    """The baseline once: `src` copied into `dst` in one pass, synchronised either side."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


async def pull_s(t: ZmqTransport, job: LoadJob) -> float:
    """One pull, timed as `copy_s` times a copy."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    await t.load(job)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def peak_bandwidth() -> tuple[float, str]:
    """The device's peak memory bandwidth in bytes/s, and where it came from: its
    properties (DDR: two transfers a clock) or, lacking those, a measured copy."""
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8, "properties"
    return measured_bandwidth(), "measured"


def measured_bandwidth(nbytes: int = 2 << 30, reps: int = 5) -> float:
    """Bytes read and written per second by the fastest of `reps` `copy_`s of `nbytes`
    (after one warm-up)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s(src, dst)
    best = min(copy_s(src, dst) for _ in range(reps))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / best


# -- one run -------------------------------------------------------------------------------


def _pull_job(
    args: argparse.Namespace, r: int, address: str, signalled: list[int], n: int = 0
) -> LoadJob:
    """Request r's pull of `n` blocks (half the cache if 0) into other blocks, reversed."""
    n = n or args.blocks // 2
    return LoadJob(
        f"c{r}",
        [""] * n,
        [BLOCK] * n,
        args.layers,
        lambda layer: [],
        signalled.append,
        PeerSource("bench", [address], f"r{r}", list(range(n))),
        list(range(args.blocks - 1, args.blocks - 1 - n, -1)),
        layerwise=args.layerwise,
    )


def kernel_s(
    src: KVLayout, dst: KVLayout, src_ids: list[int], dst_ids: list[int], layers: int
) -> float:
    """The pull's copies alone, as `_copy_ipc` queues them (one index, one call for every
    layer), between two caches of this process: what the pull costs beyond its messages
    and waits."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    index = ipc.ChunkIndex(
        src_ids, dst_ids, [BLOCK] * len(src_ids), src.geometries[0], src.tensors[0].device,
        dst.tensors[0].device,
    )  # fmt: skip
    ipc.copy_chunks(
        src.tensors[:layers], src.geometries[0], dst.tensors[:layers], dst.geometries[0], index
    )
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(args: argparse.Namespace, address: str) -> dict[str, Any]:
    """Pulls `args.requests` requests from the producer at `address` and as many copies,
    A-B-B-A; their samples, order, whether every pulled byte is equal, and the bytes."""
    layout, caches = make_layout(args.layers, args.blocks, seed=2, order=args.consumer_layout)
    theirs, expected = make_layout(args.layers, args.blocks, seed=1)  # the producer's bytes
    half = args.blocks // 2
    src_ids = list(range(half))
    dst_ids = list(range(args.blocks - 1, half - 1, -1))
    di = torch.tensor(dst_ids, device="cuda")
    nbytes = sum(c[0].numel() * c.element_size() for c in caches) * half
    src = torch.ones(nbytes // caches[0].element_size(), dtype=caches[0].dtype, device="cuda")
    dst = torch.empty_like(src)
    out: dict[str, Any] = {
        "pull_s": [], "copy_s": [], "kernel_s": [], "one_block_pull_s": [], "order": [],
        "bytes_equal": True,
    }  # fmt: skip

    def copy() -> None:
        out["copy_s"].append(copy_s(src, dst))
        out["kernel_s"].append(kernel_s(theirs, layout, src_ids, dst_ids, args.layers))
        out["order"].append("copy")

    async def consume() -> None:
        t = ZmqTransport(ZmqOptions(), _context(layout))
        await t.open()
        await t.register(layout)
        for r in range(args.requests):
            if r % 2:
                copy()
            for c in caches:
                c.index_fill_(0, di, 0)  # so that a pull that writes nothing fails the check
            signalled: list[int] = []
            out["pull_s"].append(await pull_s(t, _pull_job(args, r, address, signalled)))
            out["order"].append("pull")
            got = [c[dst_ids] for c in caches]
            want = [e[src_ids] for e in expected]
            out["bytes_equal"] &= all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            out["bytes_equal"] &= signalled == list(range(args.layers))
            if not r % 2:
                copy()
        for r in range(args.requests, args.requests + args.small):
            signalled = []
            job = _pull_job(args, r, address, signalled, n=1)
            out["one_block_pull_s"].append(await pull_s(t, job))
            got = [c[args.blocks - 1] for c in caches]
            want = [e[0] for e in expected]
            out["bytes_equal"] &= all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        await t.aclose()

    with phases(out) if args.phases else contextlib.nullcontext():
        trio.run(consume)
    out["bytes_per_sample"] = nbytes
    return out


PHASES = ("connect", "receive", "_copy_ipc", "_landed")
"""The consumer's parts of a pull `--phases` times (`ZmqTransport` methods): the socket,
each answer awaited, the copies queued and waited for, the wait alone."""


@contextlib.contextmanager
def phases(out: dict[str, Any]) -> Iterator[None]:
    """Time each of `PHASES` in every pull (into `out["phases_s"]`, every call kept)."""
    out["phases_s"] = {name: [] for name in PHASES}
    saved = {}
    for name in PHASES:
        owner = next(c for c in ZmqTransport.__mro__ if name in c.__dict__)
        saved[name] = (owner, orig := owner.__dict__[name])

        def done(name: str, t0: float) -> None:
            out["phases_s"][name].append(time.perf_counter() - t0)

        async def timed(*a: Any, _orig: Any = orig, _name: str = name, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await _orig(*a, **k)
            finally:
                done(_name, t0)

        def timed_sync(*a: Any, _orig: Any = orig, _name: str = name, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _orig(*a, **k)
            finally:
                done(_name, t0)

        setattr(owner, name, timed if inspect.iscoroutinefunction(orig) else timed_sync)
    try:
        yield
    finally:
        for name, (owner, orig) in saved.items():
            setattr(owner, name, orig)


def one_run(args: argparse.Namespace, peak: float) -> dict[str, Any]:
    """A producer process, `measure` against it, and the medians of what it measured."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=producer_main, args=(child, args.layers, args.blocks, args.requests, args.small)
    )
    proc.start()
    run = measure(args, parent.recv())
    run["producer_outcomes"] = parent.recv()
    proc.join(30)
    nbytes = run["bytes_per_sample"]
    pull_gbs = nbytes / statistics.median(run["pull_s"][WARMUP:] or run["pull_s"]) / 1e9
    copy_gbs = nbytes / statistics.median(run["copy_s"][WARMUP:] or run["copy_s"]) / 1e9
    kernel_gbs = nbytes / statistics.median(run["kernel_s"][WARMUP:] or run["kernel_s"]) / 1e9
    offers_done = run["producer_outcomes"] == ["done"] * (args.requests + args.small)
    run |= {
        "first_pull_s": run["pull_s"][0],
        "pull_gbs": pull_gbs,
        "copy_gbs": copy_gbs,
        "kernel_gbs": kernel_gbs,
        "ratio": pull_gbs / copy_gbs,
        "kernel_ratio": kernel_gbs / copy_gbs,
        "one_block_pull_ms": 1e3 * statistics.median(run["one_block_pull_s"][WARMUP:] or [0]),
        "pull_fraction": 2 * pull_gbs * 1e9 / peak,
        "copy_fraction": 2 * copy_gbs * 1e9 / peak,
        "offers_done": offers_done,
        "ok": run["bytes_equal"] and offers_done,
    }
    return run


# -- provenance ----------------------------------------------------------------------------


def _command_output(*cmd: str) -> str:
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _provenance(args: argparse.Namespace) -> dict[str, Any]:
    """The device and the mode measured (`record.start()` gives commit, command, date)."""
    driver = _command_output(
        "nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"
    ).splitlines()
    return {
        "device": {
            "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "driver": driver[0] if driver else None,
        },
        "mode": {
            "quick": args.quick,
            "layerwise": args.layerwise,
            "consumer_layout": args.consumer_layout,
            "layers": args.layers,
            "blocks": args.blocks,
            "blocks_moved": args.blocks // 2,
            "requests": args.requests,
            "one_block_pulls": args.small,
            "phases": args.phases,
            "runs": args.runs,
        },
    }


# -- driver --------------------------------------------------------------------------------


def _out_path(args: argparse.Namespace) -> Path | None:
    """Where the JSON goes: `--out`, else bench/results/ unless `--quick`."""
    if args.out:
        return Path(args.out)
    if args.quick:
        return None
    name = "cuda_ipc_layerwise.json" if args.layerwise else "cuda_ipc.json"
    if args.consumer_layout != "LBNHC":
        name = name.replace(".json", f"_{args.consumer_layout}.json")
    return Path(__file__).parent / "results" / name


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1024, help="blocks per cache; half move")
    ap.add_argument("--requests", type=int, default=12, help="pulls (and copies) per run")
    ap.add_argument("--runs", type=int, default=1, help="whole measurements, each kept")
    ap.add_argument("--small", type=int, default=9, help="pulls of one block (fixed cost)")
    ap.add_argument("--phases", action="store_true", help="time the consumer's parts of a pull")
    ap.add_argument("--quick", action="store_true", help="4 layers, 64 blocks, 3 requests")
    ap.add_argument("--layerwise", action="store_true", help="wait for each layer")
    ap.add_argument(
        "--consumer-layout",
        default="LBNHC",
        help="the consumer's KV layout (LBHNC: HND, converted on receive)",
    )
    ap.add_argument("--out", help="the JSON's path (default: bench/results/cuda_ipc*.json)")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.blocks, args.requests, args.small = 4, 64, 3, 3
    return args


def main() -> int:
    meta = record.start()
    args = _parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda_ipc: no CUDA device here", file=sys.stderr)
        return 2
    peak, source = peak_bandwidth()
    print(f"peak memory bandwidth: {peak / 1e9:.0f} GB/s ({source})")
    runs = []
    for i in range(args.runs):
        run = one_run(args, peak)
        runs.append(run)
        for name, v in run.get("phases_s", {}).items():
            print(f"  {name}: {len(v)} calls, median {1e3 * statistics.median(v or [0]):.3f} ms")
        print(
            f"run {i + 1}/{args.runs}: pull {run['pull_gbs']:.1f} GB/s "
            f"({run['pull_fraction']:.0%} of peak), copy {run['copy_gbs']:.1f} GB/s "
            f"({run['copy_fraction']:.0%} of peak), ratio {run['ratio']:.2f}, copies alone "
            f"{run['kernel_gbs']:.1f} GB/s ({run['kernel_ratio']:.2f}), one-block pull "
            f"{run['one_block_pull_ms']:.3f} ms, "
            f"equal {'yes' if run['bytes_equal'] else 'NO'}, "
            f"offers {'all done' if run['offers_done'] else run['producer_outcomes']}",
            flush=True,
        )
    equal = all(r["bytes_equal"] for r in runs)
    result = _provenance(args) | {
        "peak_bandwidth_gbs": peak / 1e9,
        "bandwidth_source": source,
        "warmup_samples": WARMUP,
        "bytes_equal": equal,
        "runs": runs,
    }
    out = _out_path(args)
    if out is None:
        print(json.dumps(result | meta, indent=2))
    else:
        record.save(out, result, meta, ("kvflow", "transports/kvflow_zmq"))
        print(f"wrote {out}")
    print(f"bytes equal: {'yes' if equal else 'NO'}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
