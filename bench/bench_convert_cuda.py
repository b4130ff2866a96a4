"""Benchmark: a P/D pull that converts on receive on a GPU (the producer's cache NHD,
the consumer's HND) against a pull of the same bytes from a producer laid out as the
consumer is, per transport (`zmq`'s CUDA IPC, `nixl` VRAM READs), in the same consumer
process, alternating.

    python bench/bench_convert_cuda.py [--transports zmq,nixl] [--quick]

Two producer processes on this GPU (CUDA IPC handles and NIXL agents, as vLLM's workers
have them) hold the same KV (llama3-8b's per token: 32 layers, 8 KV heads x 128, fp16,
block 16): one in vLLM's FlashAttention layout (`LBNHC`, NHD), one in `LBHNC` (HND, as
FlashInfer keeps it). The consumer, HND, pulls `--blocks` blocks of each per request
into the same blocks, the two sides alternating (order swapped each request), timed
from the pull to the last byte on the device; medians after the first request of each
(which opens handles, connects agents). Every pull's bytes are checked against the
producer's (untimed). Writes bench/results/convert_cuda.json. Needs an NVIDIA GPU.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import record
import torch
import trio

from kvflow.geometry.layout import KVLayout
from kvflow.pd.peer_transport import PeerTransport
from kvflow.testing.layouts import device_layout
from kvflow.transport import LoadJob, Offer, PeerSource, TransportContext

SIDES = {"same": "LBHNC", "converted": "LBNHC"}  # the producers' layouts
CONSUMER = "LBHNC"


def _cache(order: str, layers: int, blocks: int) -> tuple[KVLayout, list[torch.Tensor]]:
    """Caches of `order` holding the same KV whatever the order: each layer's logical
    `[blocks, heads, tokens, content]` view filled from one seed."""
    layout, views = device_layout(
        "cuda", layout=order, num_layers=layers, num_blocks=blocks, heads=8, head_dim=128,
    )  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(1)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=gen, device="cuda").half())
    return layout, views


def _transport(name: str, layout: KVLayout) -> PeerTransport:
    ctx = TransportContext("bench", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout)
    if name == "nixl":
        from kvflow_nixl import NixlOptions, NixlTransport

        return NixlTransport(NixlOptions(), ctx)
    from kvflow_zmq import ZmqOptions, ZmqTransport

    return ZmqTransport(ZmqOptions(), ctx)


def producer_main(conn: Connection, name: str, order: str, args: dict[str, int]) -> None:
    async def run() -> None:
        layout, _ = _cache(order, args["layers"], args["blocks"])
        t = _transport(name, layout)
        await t.open()
        await t.register(layout)
        ids = list(range(args["move"]))
        outcomes = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.serve)
            conn.send(t.address)
            for r in range(args["requests"]):
                offer = Offer(f"r{r}", ids, [16] * len(ids), args["layers"], lambda layer: [])
                outcomes.append(await t.offer(offer))
            nursery.cancel_scope.cancel()
        await t.aclose()
        conn.send(outcomes)

    trio.run(run)


def _case(name: str, args: dict[str, int]) -> dict[str, Any]:
    spawn = mp.get_context("spawn")
    pipes, procs = {}, []
    for side, order in SIDES.items():
        parent, child = spawn.Pipe()
        proc = spawn.Process(target=producer_main, args=(child, name, order, args), daemon=True)
        proc.start()
        child.close()
        pipes[side] = parent
        procs.append(proc)
    addresses = {side: p.recv() for side, p in pipes.items()}
    layout, views = _cache(CONSUMER, args["layers"], args["blocks"])
    src = list(range(args["move"]))
    dst = list(range(args["blocks"] - 1, args["blocks"] - 1 - args["move"], -1))
    want = [v[src].clone() for v in views]  # the producers' KV, in the consumer's view
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    equal = True

    async def consume() -> None:
        nonlocal equal
        t = _transport(name, layout)
        await t.open()
        await t.register(layout)
        for r in range(args["requests"]):
            for side in SIDES if r % 2 == 0 else reversed(list(SIDES)):
                for v in views:
                    v[dst] = 0  # a pull that moves nothing is caught
                source = PeerSource("p", [addresses[side]], f"r{r}", src)
                job = LoadJob(
                    f"c{r}", [""] * len(dst), [16] * len(dst), args["layers"],
                    lambda layer: [], lambda layer: None, source, dst, layerwise=False,
                )  # fmt: skip
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                await t.load(job)
                torch.cuda.synchronize()
                times[side].append(time.perf_counter() - t0)
                equal &= all(torch.equal(v[dst], w) for v, w in zip(views, want, strict=True))
        await t.aclose()

    trio.run(consume)
    outcomes = {side: p.recv() for side, p in pipes.items()}
    for proc in procs:
        proc.join(30)
    nbytes = sum(int(v[0].numel()) * v.element_size() for v in views) * len(dst)
    gbs = {side: nbytes / statistics.median(ts[1:] or ts) / 1e9 for side, ts in times.items()}
    return {
        "transport": name,
        "same_gbs": gbs["same"],
        "converted_gbs": gbs["converted"],
        "ratio": gbs["converted"] / gbs["same"],
        "runs_s": times,
        "bytes_equal": equal,
        "producer_outcomes": outcomes,
    }


def main() -> int:
    meta = record.start()
    ap = argparse.ArgumentParser()
    ap.add_argument("--transports", default="zmq,nixl")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1024, help="blocks per cache")
    ap.add_argument("--move", type=int, default=512, help="blocks per pull")
    ap.add_argument("--requests", type=int, default=9)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.layers, a.blocks, a.move, a.requests = 4, 64, 32, 3
    if not torch.cuda.is_available():
        print("bench_convert_cuda: no CUDA device here", file=sys.stderr)
        return 2
    args = {"layers": a.layers, "blocks": a.blocks, "move": a.move, "requests": a.requests}
    results = []
    for name in a.transports.split(","):
        res = _case(name, args)
        results.append(res)
        print(
            f"{name:5} NHD -> HND  same {res['same_gbs']:.1f} GB/s, converted "
            f"{res['converted_gbs']:.1f} GB/s ({res['ratio']:.2f}x), bytes equal: "
            f"{'yes' if res['bytes_equal'] else 'NO'}",
            flush=True,
        )
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **args}
    out["results"] = results
    if not a.quick:
        path = Path(__file__).parent / "results" / "convert_cuda.json"
        record.save(path, out, meta, ("kvflow", "transports/kvflow_zmq", "transports/kvflow_nixl"))
    ok = all(r["bytes_equal"] for r in results)
    done = all(o == ["done"] * a.requests for r in results for o in r["producer_outcomes"].values())
    return 0 if ok and done else 1


if __name__ == "__main__":
    sys.exit(main())
