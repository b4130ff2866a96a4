"""Benchmark: a P/D pull that converts on receive (another tensor-parallel size, another
layout) against a pull of the same bytes that converts nothing, per peer transport, in
the same run, alternating.

    python bench/bench_convert.py [--repeats 7] [--quick]

No engine: real producer and consumer transports (`zmq` host frames, `nixl` with real
NIXL agents over UCX) on real sockets, in one trio loop, as kvflow's workers drive them.
The KV is llama3-8b's per token (32 layers, 8 KV heads x 128, fp16, block 16), 1024
tokens (64 blocks, 128 MiB over all heads; `--quick`: 256 tokens), in vLLM's CPU cache
(block-granular, each head one run of a block) or NHD / HND host memory.

Each case has two sides, timed alternately (order swapped each repeat), pulling into
the same destination blocks, each checked byte for byte against the consumer's own
image of the same KV (untimed):

- `converted`: the case's pull. `TP=1 -> TP=2`: rank 0 of a TP=2 consumer reads its 4
  heads of each block of a TP=1 producer. `TP=2 -> TP=1`: a TP=1 consumer reads both
  TP=2 producer ranks at once, each into its half. `NHD -> HND`: equal sizes, the
  producer's cache NHD, the consumer's HND. `blocks 32 -> 16`: the producer's blocks
  hold 32 tokens, the consumer's 16.
- `same`: a producer of the consumer's own size and layout holding the same KV: the
  bytes that land are the same, nothing is converted.

Throughput is of the bytes that land in the consumer's blocks; medians of `--repeats`
after one warm-up round. Writes bench/results/convert.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import record
import trio
import trio.testing

from kvflow.geometry.cells import copy_heads
from kvflow.geometry.layout import KVLayout
from kvflow.geometry.topology import HeadRead
from kvflow.pd.peer_transport import PeerTransport
from kvflow.testing.layouts import make_layout
from kvflow.transport import LoadJob, Offer, PeerSource, TransportContext
from kvflow_nixl import NixlOptions, NixlTransport
from kvflow_zmq import ZmqOptions, ZmqTransport

HEADS, LAYERS, BS = 8, 32, 16
TRANSPORTS: dict[str, tuple[type[PeerTransport], Any]] = {
    "zmq": (ZmqTransport, ZmqOptions),
    "nixl": (NixlTransport, NixlOptions),
}
# case: (layout kind, producer tp, consumer tp, producer kind, producer block size)
CASES = {
    "CPU blocks, TP=1 -> TP=2": ("cpu", 1, 2, "cpu", BS),
    "CPU blocks, TP=2 -> TP=1": ("cpu", 2, 1, "cpu", BS),
    "NHD, TP=1 -> TP=2": ("nhd", 1, 2, "nhd", BS),
    "NHD, TP=2 -> TP=1": ("nhd", 2, 1, "nhd", BS),
    "NHD -> HND": ("hnd", 1, 1, "nhd", BS),
    "NHD, blocks 32 -> 16": ("nhd", 1, 1, "nhd", 2 * BS),
}


def _layout(kind: str, heads: int, blocks: int, bs: int = BS) -> KVLayout:
    return make_layout(
        num_layers=LAYERS,
        num_blocks=blocks,
        block_size=bs,
        heads=heads,
        head_dim=128,
        block_granular=kind == "cpu",
        hnd=kind != "nhd",
        dtype="float16",
    )


def _image(layout: KVLayout, blocks: list[int]) -> bytes:
    counts = [layout.block_size] * len(blocks)
    return b"".join(
        bytes(s)
        for layer in range(LAYERS)
        for chunk in layout.chunk_spans(layer, blocks, counts)
        for s in chunk
    )


def _holding(
    whole: KVLayout, kind: str, tp: int, blocks: list[int], bs: int = BS
) -> list[KVLayout]:
    """The ranks of a `tp`-sized cache of `kind` holding `whole`'s KV in `blocks` (of `bs`
    tokens: NHD at TP=1 only when not `BS`, the first blocks)."""
    if bs != BS:  # NHD, every head: a block's image is its tokens' in order
        lay = _layout(kind, HEADS, 2 * len(blocks), bs)
        for layer in range(LAYERS):
            data = b"".join(bytes(s) for b in blocks for s in whole.spans(layer, b, BS))
            step = len(data) * bs // (BS * len(blocks))
            for j in range(len(data) // step):
                (span,) = lay.spans(layer, j, bs)
                span[:] = data[j * step : (j + 1) * step]
        return [lay]
    out = []
    per = HEADS // tp
    for r in range(tp):
        lay = _layout(kind, per, 2 * len(blocks))
        for layer in range(LAYERS):
            src, dst = whole.geometries[layer], lay.geometries[layer]
            read = HeadRead(0, r * per, per, 0)
            for b in blocks:
                image = memoryview(b"".join(bytes(s) for s in whole.spans(layer, b, BS)))
                copy_heads(image, src, lay.spans(layer, b, BS), dst, read, BS)
        out.append(lay)
    return out


async def _open(cls: Any, options: Any, layout: KVLayout, rank: int, size: int) -> PeerTransport:
    shards = [f"tp{r}of{size}pp0" for r in range(size)]
    ctx = TransportContext(
        "bench", "worker", "ns", shards[rank], shards, layout, tp_rank=rank, tp_size=size,
        kv_heads=HEADS,
    )  # fmt: skip
    t = cls(options(), ctx)
    await t.open()
    await t.register(layout)
    return t


async def _pull(
    producers: list[PeerTransport],
    held: list[KVLayout],
    consumers: list[PeerTransport],
    req: str,
    dst: list[int],
) -> float:
    """Offer the blocks holding the tokens on every producer rank, pull them into `dst`
    on every consumer rank at once; the seconds from the first pull to the last byte
    landed."""
    counts = [BS] * len(dst)
    p_bs = held[0].block_size
    src = list(range(len(dst) * BS // p_bs))
    size = len(producers)
    async with trio.open_nursery() as offers:
        for p, lay in zip(producers, held, strict=True):
            spans = lambda layer, lay=lay: lay.chunk_spans(layer, src, [p_bs] * len(src))  # noqa: E731
            offers.start_soon(p.offer, Offer(req, src, [p_bs] * len(src), LAYERS, spans))
        await trio.testing.wait_all_tasks_blocked()
        other = 0 if p_bs == BS else p_bs
        source = PeerSource(
            "p", [p.address for p in producers], req, src, size, HEADS, block_size=other
        )
        t0 = time.perf_counter()
        async with trio.open_nursery() as pulls:
            for c in consumers:
                cons = c.context.layout
                assert cons is not None
                job = LoadJob(
                    "c", ["k"] * len(dst), counts, LAYERS,
                    lambda layer, cons=cons: cons.chunk_spans(layer, dst, counts),
                    lambda _: None, source, dst, layerwise=False,
                )  # fmt: skip
                pulls.start_soon(c.load, job)
        return time.perf_counter() - t0


async def _case(transport: str, case: str, blocks: int, repeats: int) -> dict[str, float]:
    cls, options = TRANSPORTS[transport]
    kind, p_tp, c_tp, p_kind, p_bs = CASES[case]
    src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
    whole = _layout("cpu" if kind == "cpu" else "nhd", HEADS, 2 * blocks)
    rng = np.random.default_rng(1)
    for buf in whole.buffers:
        np.frombuffer(buf, np.uint8)[:] = rng.integers(0, 256, len(buf), dtype=np.uint8)
    held = {
        "converted": _holding(whole, p_kind, p_tp, src, p_bs),
        "same": _holding(whole, kind, c_tp, src),
    }
    want = [_image(lay, src) for lay in held["same"]]  # each consumer rank's own image
    ranks = [_layout(kind, HEADS // c_tp, 2 * blocks) for _ in range(c_tp)]
    consumers = [await _open(cls, options, lay, r, c_tp) for r, lay in enumerate(ranks)]
    producers = {
        side: [await _open(cls, options, lay, r, len(lays)) for r, lay in enumerate(lays)]
        for side, lays in held.items()
    }
    times: dict[str, list[float]] = {side: [] for side in held}
    async with trio.open_nursery() as nursery:
        for ps in producers.values():
            for p in ps:
                nursery.start_soon(p.serve)
        for i in range(repeats + 1):
            for side in ("converted", "same") if i % 2 == 0 else ("same", "converted"):
                for lay in ranks:  # poison: a pull that moves nothing is caught
                    for buf in lay.buffers:
                        np.frombuffer(buf, np.uint8)[:] = 0
                took = await _pull(producers[side], held[side], consumers, f"{side}-{i}", dst)
                if i:
                    times[side].append(took)
                if [_image(lay, dst) for lay in ranks] != want:
                    raise SystemExit(f"{transport} {case} {side}: wrong bytes")
        nursery.cancel_scope.cancel()
    for t in [*consumers, *(p for ps in producers.values() for p in ps)]:
        await t.aclose()
    nbytes = sum(len(w) for w in want)
    return {side: nbytes / statistics.median(t) / 1e9 for side, t in times.items()}


def main() -> int:
    meta = record.start()
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats, 256 tokens")
    args = ap.parse_args()
    repeats, blocks = (3, 16) if args.quick else (args.repeats, 64)
    rows = []
    for transport in TRANSPORTS:
        for case in CASES:
            gbs = trio.run(_case, transport, case, blocks, repeats)
            ratio = gbs["converted"] / gbs["same"]
            rows.append({"transport": transport, "case": case, **gbs, "ratio": ratio})
            print(
                f"{transport:<5} {case:<26} same {gbs['same']:.2f} GB/s, converted "
                f"{gbs['converted']:.2f} GB/s ({ratio:.2f}x)",
                flush=True,
            )
    out = Path(__file__).parent / "results" / "convert.json"
    record.save(out, {"repeats": repeats, "tokens": blocks * BS, "rows": rows}, meta)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
