"""Benchmark and check: the `zmq` transport's CUDA IPC path against a plain
device-to-device copy of the same blocks, in the same run.

    python bench/bench_cuda_ipc.py            # 32 layers x 512 blocks of 16 tokens
    python bench/bench_cuda_ipc.py --quick    # a few seconds; what the test suite runs
    python bench/bench_cuda_ipc.py --consumer-layout LBHNC   # converted NHD -> HND

A producer process (CUDA IPC handles do not open in the process that exported
them) registers KV caches laid out as vLLM lays out FlashAttention's default (LBNHC,
logical `[blocks, 8 heads, 16 tokens, 256]` float16 per layer: 64 KiB per block and
layer, Llama-3-8B's geometry) with a
`zmq` transport and offers the same blocks once per request; this process, the
consumer, pulls each request into other blocks of its own caches and checks
every byte. The baseline is what the pull does at best: `index_copy_` of the
same blocks between two tensors of this process on the same GPU, timed the
same way (wall time including synchronisation), alternating with the pulls. Pulls
are asynchronous loads, as kvflow's P/D pulls are (`LoadJob.layerwise` False: one
wait for all layers); `--layerwise` times loads a forward waits on layer by layer.
Prints median GB/s for both and their ratio, and writes bench/results/cuda_ipc.json
(cuda_ipc_layerwise.json). Needs an NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import trio

from kvflow.layout import KVLayout
from kvflow.testing.layouts import device_layout
from kvflow.transport import LoadJob, Offer, PeerSource, TransportContext
from kvflow_zmq import ZmqOptions, ZmqTransport

BLOCK, HEADS, HEAD_DIM = 16, 8, 128


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


def producer_main(conn: Connection, layers: int, blocks: int, requests: int) -> None:
    async def run() -> None:
        layout, _ = make_layout(layers, blocks, seed=1)
        t = ZmqTransport(ZmqOptions(), _context(layout))
        await t.open()
        await t.register(layout)
        outcomes = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.serve)
            conn.send(t.address)
            for r in range(requests):
                ids = list(range(blocks // 2))
                offer = Offer(f"r{r}", ids, [BLOCK] * len(ids), layers, lambda layer: [])
                outcomes.append(await t.offer(offer))
            nursery.cancel_scope.cancel()
        conn.send(outcomes)
        await t.aclose()

    trio.run(run)


def plain_copy_s(
    caches: list[torch.Tensor], other: list[torch.Tensor], si: torch.Tensor, di: torch.Tensor
) -> float:
    """The baseline once: the same blocks copied between two tensors of this process."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for c, o in zip(caches, other, strict=True):
        o.index_copy_(0, di, c.index_select(0, si))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1024, help="blocks per cache; half move")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layerwise", action="store_true", help="wait for each layer")
    ap.add_argument(
        "--consumer-layout",
        default="LBNHC",
        help="the consumer's KV layout (LBHNC: HND, converted on receive; the baseline "
        "copies within it)",
    )
    args = ap.parse_args()
    if args.quick:
        args.layers, args.blocks, args.requests = 4, 64, 3
    if not torch.cuda.is_available():
        print("bench_cuda_ipc: no CUDA device here", file=sys.stderr)
        return 2
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=producer_main, args=(child, args.layers, args.blocks, args.requests)
    )
    proc.start()
    address = parent.recv()
    layout, caches = make_layout(args.layers, args.blocks, seed=2, order=args.consumer_layout)
    _, expected = make_layout(args.layers, args.blocks, seed=1)  # the producer's bytes
    half = args.blocks // 2
    src_ids = list(range(half))
    dst_ids = list(range(args.blocks - 1, half - 1, -1))  # other blocks, reversed
    secs: list[float] = []
    plain: list[float] = []
    other = [c.clone() for c in caches]
    si = torch.tensor(src_ids, device="cuda")
    di = torch.tensor(dst_ids, device="cuda")
    equal = True

    async def consume() -> None:
        nonlocal equal
        t = ZmqTransport(ZmqOptions(), _context(layout))
        await t.open()
        await t.register(layout)
        for r in range(args.requests):
            signalled: list[int] = []
            job = LoadJob(
                f"c{r}",
                [""] * half,
                [BLOCK] * half,
                args.layers,
                lambda layer: [],
                signalled.append,
                PeerSource("bench", [address], f"r{r}", src_ids),
                dst_ids,
                layerwise=args.layerwise,
            )
            t0 = time.perf_counter()
            await t.load(job)
            torch.cuda.synchronize()
            secs.append(time.perf_counter() - t0)
            got = [c[dst_ids] for c in caches]
            want = [e[src_ids] for e in expected]
            equal &= all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            equal &= signalled == list(range(args.layers))
            plain.append(plain_copy_s(caches, other, si, di))  # alternating with the pulls
        await t.aclose()

    trio.run(consume)
    outcomes = parent.recv()
    proc.join(30)
    nbytes = sum(c[0].numel() * c.element_size() for c in caches) * half
    ipc_gbs = nbytes / statistics.median(secs[1:] or secs) / 1e9  # the first pull opens handles
    plain_gbs = nbytes / statistics.median(plain[1:] or plain) / 1e9
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "layers": args.layers,
        "blocks_moved": half,
        "bytes_per_request": nbytes,
        "layerwise": args.layerwise,
        "consumer_layout": args.consumer_layout,
        "first_pull_s": secs[0],
        "ipc_pull_gbs": ipc_gbs,
        "plain_d2d_gbs": plain_gbs,
        "ratio": ipc_gbs / plain_gbs,
        "bytes_equal": equal,
        "producer_outcomes": outcomes,
    }
    print(json.dumps(result, indent=2))
    print(f"bytes equal: {'yes' if equal else 'NO'}")
    if not args.quick:
        name = "cuda_ipc_layerwise.json" if args.layerwise else "cuda_ipc.json"
        if args.consumer_layout != "LBNHC":
            name = name.replace(".json", f"_{args.consumer_layout}.json")
        out = Path(__file__).parent / "results" / name
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if equal and outcomes == ["done"] * args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
