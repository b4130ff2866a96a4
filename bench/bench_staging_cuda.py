"""Benchmark and check: host staging of a CUDA KV cache (`kvflow.engine.staging.HostStage`,
what `fs`, Redis and the host tier move through) against pinned `cudaMemcpyAsync` of as
many bytes on the same GPU, both directions, and what a running save costs a forward pass.

    python bench/bench_staging_cuda.py            # 32 layers x 512 of 1024 blocks (1 GiB)
    python bench/bench_staging_cuda.py --quick    # a few seconds

The cache is laid out as vLLM lays out FlashAttention's default (LBNHC, `[blocks, 8 heads,
16 tokens, 256]` float16 a layer: Llama-3-8B's geometry), as bench_cuda_ipc.py's. A save
is timed as the worker drives one: `await stage.gather(layer)` layer after layer (each a
copy into the pinned image on a side stream, waited for from trio); a load as
`stage.scatter(layer)` layer after layer (each waits for its copy). The baselines are one
`copy_` of as many bytes between a contiguous device tensor and a pinned host tensor
(`non_blocking`, one `cudaMemcpyAsync`), device to host and host to device. Every sample
is wall time between two `torch.cuda.synchronize()`s, A-B-B-A, the first of each side
left out of its median; every sample kept. Each save's and load's bytes are checked.

The forward's cost: a loop of bf16 matrix products on the default stream (what a forward
keeps busy), timed alone and while a thread of its own saves the same 1 GiB over and over
as the worker does (its own trio loop), A-B-B-A: the ratio of medians, and how many saves
ran under the loop.

Writes bench/results/staging_cuda.json (or `--out`; `--quick` writes nothing unless given
`--out`). Needs an NVIDIA GPU; exits 2 without one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import record
import torch
import trio

from kvflow.engine.staging import HostStage
from kvflow.geometry.layout import KVLayout
from kvflow.testing.layouts import device_layout

BLOCK, HEADS, HEAD_DIM = 16, 8, 128
WARMUP = 1


def make_layout(layers: int, blocks: int, seed: int) -> tuple[KVLayout, list[torch.Tensor]]:
    return device_layout(
        "cuda", layout="LBNHC", num_layers=layers, num_blocks=blocks, block_size=BLOCK,
        heads=HEADS, head_dim=HEAD_DIM, seed=seed,
    )  # fmt: skip


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def save(layout: KVLayout, ids: list[int]) -> HostStage:
    """A save's staging, as the worker drives it: every layer gathered in turn."""
    stage = HostStage(layout, ids, [BLOCK] * len(ids))

    async def run() -> None:
        for layer in range(layout.num_layers):
            await stage.gather(layer)

    trio.run(run)
    return stage


def filled(layout: KVLayout, ids: list[int], staged: HostStage) -> HostStage:
    """A load's staging with its image filled (what a transport does; not timed)."""
    stage = HostStage(layout, ids, [BLOCK] * len(ids))
    for layer in range(layout.num_layers):
        for mine, theirs in zip(stage.spans(layer), staged.spans(layer), strict=True):
            mine[0][:] = theirs[0]
    return stage


def load(stage: HostStage) -> None:
    """A load's staging, as the worker drives it: every layer scattered in turn."""
    for layer in range(stage.layout.num_layers):
        stage.scatter(layer)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    src, src_caches = make_layout(args.layers, args.blocks, seed=1)
    dst, dst_caches = make_layout(args.layers, args.blocks, seed=2)
    half = args.blocks // 2
    ids, into = list(range(half)), list(range(args.blocks - 1, half - 1, -1))
    nbytes = sum(c[0].numel() * c.element_size() for c in src_caches) * half
    dev = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out: dict[str, Any] = {k: [] for k in ("save_s", "d2h_s", "load_s", "h2d_s", "order")}
    out["bytes_equal"] = True
    staged = save(src, ids)  # what the loads scatter (and a warm-up)
    for r in range(args.requests):
        pair = [("save", lambda: save(src, ids)), ("d2h", lambda: host.copy_(dev, True))]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            out[f"{name}_s"].append(timed(fn))
            out["order"].append(name)
        stage = filled(dst, into, staged)
        pair = [("load", lambda stage=stage: load(stage)), ("h2d", lambda: dev.copy_(host, True))]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            out[f"{name}_s"].append(timed(fn))
            out["order"].append(name)
        out["bytes_equal"] &= all(
            torch.equal(d[into], s[ids]) for d, s in zip(dst_caches, src_caches, strict=True)
        )
        for c in dst_caches:
            c[into] = 0
    out["forward"] = forward_cost(args, src, ids)
    out["bytes_per_sample"] = nbytes
    return out


def forward_cost(args: argparse.Namespace, layout: KVLayout, ids: list[int]) -> dict[str, Any]:
    """A loop of matrix products alone and under saves running in another thread."""
    a = torch.randn(args.matmul, args.matmul, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)

    def loop() -> None:
        for _ in range(args.products):
            a.matmul(b)

    alone: list[float] = []
    busy: list[float] = []
    saves: list[int] = []
    for r in range(args.forward_runs):
        for kind in ("alone", "busy") if r % 2 == 0 else ("busy", "alone"):
            if kind == "alone":
                alone.append(timed(loop))
                continue
            stop, count = threading.Event(), [0]

            def saving(stop: threading.Event = stop, count: list[int] = count) -> None:
                while not stop.is_set():
                    save(layout, ids)
                    count[0] += 1

            worker = threading.Thread(target=saving)
            worker.start()
            busy.append(timed(loop))
            stop.set()
            worker.join()
            saves.append(count[0])
    m_alone = statistics.median(alone[WARMUP:] or alone)
    m_busy = statistics.median(busy[WARMUP:] or busy)
    return {
        "alone_s": alone,
        "busy_s": busy,
        "saves_during": saves,
        "matmul": args.matmul,
        "products": args.products,
        "slowdown": m_busy / m_alone - 1,
    }


def summary(run: dict[str, Any]) -> dict[str, float]:
    n = run["bytes_per_sample"]

    def gbs(key: str) -> float:
        return n / statistics.median(run[key][WARMUP:] or run[key]) / 1e9

    out = {k: gbs(f"{k}_s") for k in ("save", "d2h", "load", "h2d")}
    return out | {
        "save_ratio": out["save"] / out["d2h"],
        "load_ratio": out["load"] / out["h2d"],
        "forward_slowdown": run["forward"]["slowdown"],
    }


def main() -> int:
    meta = record.start()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1024, help="blocks per cache; half move")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--matmul", type=int, default=8192)
    ap.add_argument("--products", type=int, default=60)
    ap.add_argument("--forward-runs", type=int, default=8)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.blocks, args.requests = 4, 64, 3
        args.matmul, args.products, args.forward_runs = 2048, 10, 2
    if not torch.cuda.is_available():
        print("bench_staging_cuda: no CUDA device here", file=sys.stderr)
        return 2
    run = measure(args)
    s = summary(run)
    print(
        f"save {s['save']:.1f} GB/s vs pinned D2H {s['d2h']:.1f} ({s['save_ratio']:.2f}x); "
        f"load {s['load']:.1f} vs pinned H2D {s['h2d']:.1f} ({s['load_ratio']:.2f}x); "
        f"forward under saves {s['forward_slowdown']:+.1%} "
        f"({sum(run['forward']['saves_during'])} saves); "
        f"bytes equal {'yes' if run['bytes_equal'] else 'NO'}",
        flush=True,
    )
    result = {
        "device": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__},
        "mode": vars(args),
        "warmup_samples": WARMUP,
        "summary": s,
        "run": run,
    }
    out = Path(args.out) if args.out else None
    if out is None and not args.quick:
        out = Path(__file__).parent / "results" / "staging_cuda.json"
    if out is None:
        print(json.dumps(result | meta, indent=2))
    else:
        record.save(out, result, meta, ("kvflow",))
        print(f"wrote {out}")
    return 0 if run["bytes_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
