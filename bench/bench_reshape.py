"""Benchmark: an `fs` load of chunks another tensor-parallel size saved (`kvflow.shapes.reshape`)
against the load of the same bytes saved at the reader's own size, in the same run,
alternating.

    python bench/bench_reshape.py [--repeats 7] [--quick]

No engine: the transport is driven directly, as kvflow's worker drives it. The KV is
llama3-8b's per token (32 layers, 8 KV heads x 128, fp16, block 16: 128 KiB a token
over all heads), 4096 tokens (256 chunks, 512 MiB over all heads), in two layouts:
vLLM's CPU cache (block-granular, each head one run of a block) and NHD host memory
(what a CUDA cache's token-major staging image is: each token's heads side by side).

Two directions, each with two sides timed alternately (order swapped each repeat),
each into the same destination blocks, each checked byte for byte (untimed):

- `TP=1 reads TP=2`: a TP=1 rank loads all heads. `own`: from the TP=1 files of the
  same bytes; `reshaped`: from both TP=2 ranks' files (half the heads each), copied
  into its blocks.
- `TP=2 reads TP=1`: rank 0 of TP=2 loads its 4 heads. `own`: from its own TP=2
  files; `reshaped`: from the TP=1 files, which hold all 8 heads (twice the bytes
  read), its half copied into its blocks.

Loads read from the page cache (each store was written just before). Throughput is of
the bytes that land in the reader's blocks. Medians of `--repeats` after one warm-up
round. Writes bench/results/reshape.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import record
import trio

from kvflow.geometry.layout import KVLayout
from kvflow.keys import chunk_keys
from kvflow.shapes.reshape import load_reshaped, shard_name
from kvflow.testing.layouts import fill_blocks, make_layout
from kvflow.transport import LoadJob, SaveJob, TransportContext
from kvflow_fs import FsOptions, FsTransport

HEADS, LAYERS, BS = 8, 32, 16
KINDS = {"CPU cache (block-granular)": True, "NHD (CUDA staging image)": False}


def _layout(heads: int, chunks: int, block_granular: bool) -> KVLayout:
    return make_layout(
        num_layers=LAYERS,
        num_blocks=2 * chunks,
        block_size=BS,
        heads=heads,
        head_dim=128,
        block_granular=block_granular,
        hnd=block_granular,
        dtype="float16",
    )


async def _store(root: Path, layout: KVLayout, rank: int, size: int) -> FsTransport:
    shards = [shard_name(r, size, 0) for r in range(size)]
    ctx = TransportContext(
        "bench", "worker", "ns", shards[rank], shards, tp_rank=rank, tp_size=size, kv_heads=HEADS
    )
    t = FsTransport(FsOptions(path=str(root), max_gb=0), ctx)
    await t.open()
    await t.register(layout)
    return t


async def _save(t: FsTransport, keys: list[str], blocks: list[int]) -> None:
    layout = t.context.layout
    assert layout is not None
    counts = [BS] * len(keys)

    async def spans(layer: int) -> list[list[memoryview]]:
        return layout.chunk_spans(layer, blocks, counts)

    await t.save(SaveJob("save", keys, counts, LAYERS, spans))


def _job(layout: KVLayout, keys: list[str], blocks: list[int]) -> LoadJob:
    counts = [BS] * len(keys)

    def spans(layer: int) -> list[list[memoryview]]:
        return layout.chunk_spans(layer, blocks, counts)

    return LoadJob("load", keys, counts, LAYERS, spans, lambda layer: None, None, blocks)


def _image(layout: KVLayout, blocks: list[int]) -> bytes:
    counts = [BS] * len(blocks)
    return b"".join(
        bytes(s)
        for layer in range(LAYERS)
        for chunk in layout.chunk_spans(layer, blocks, counts)
        for s in chunk
    )


async def _direction(
    root: Path, chunks: int, repeats: int, block_granular: bool, reader_tp: int
) -> dict[str, float]:
    """GB/s of `own` and `reshaped` loads into a rank of size `reader_tp` (1 or 2)."""
    other = 2 if reader_tp == 1 else 1
    keys = chunk_keys("bench", list(range(chunks * BS)), BS)
    src, dst = list(range(chunks)), list(range(chunks, 2 * chunks))
    # the same KV at both sizes: a TP=1 cache of all heads and its two TP=2 halves
    whole = _layout(HEADS, chunks, block_granular)
    fill_blocks(whole, src, seed=1)
    halves = [_layout(HEADS // 2, chunks, block_granular) for _ in range(2)]
    for r, half in enumerate(halves):
        for layer in range(LAYERS):
            for b in src:
                spans = whole.head_spans(layer, [b], [BS], r * HEADS // 2, HEADS // 2)[0]
                data = b"".join(bytes(s) for s in spans)
                at = 0
                for s in half.chunk_spans(layer, [b], [BS])[0]:
                    s[:] = data[at : at + len(s)]
                    at += len(s)
    saved = {1: [whole], 2: halves}
    for size, layouts in saved.items():
        for r, lay in enumerate(layouts):
            await _save(await _store(root, lay, r, size), keys, src)
    reader_layout = whole if reader_tp == 1 else halves[0]
    reader = await _store(root, reader_layout, 0, reader_tp)
    want = _image(reader_layout, src)
    nbytes = len(want)
    times: dict[str, list[float]] = {"own": [], "reshaped": []}
    for i in range(repeats + 1):
        order = ["own", "reshaped"] if i % 2 == 0 else ["reshaped", "own"]
        for side in order:
            for layer in range(LAYERS):  # poison: a load that moves nothing is caught
                for chunk in reader_layout.chunk_spans(layer, dst, [BS] * chunks):
                    for s in chunk:
                        s[:] = bytes(len(s))
            job = _job(reader_layout, keys, dst)
            t0 = time.perf_counter()
            if side == "own":
                await reader.load(job)
            else:
                await load_reshaped(reader, job, [other] * chunks)
            if i:
                times[side].append(time.perf_counter() - t0)
            if _image(reader_layout, dst) != want:
                raise SystemExit(f"{side} load of TP={other}'s chunks: wrong bytes")
    return {side: nbytes / statistics.median(t) / 1e9 for side, t in times.items()}


def main() -> int:
    meta = record.start()
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 repeats, 1024 tokens")
    args = ap.parse_args()
    repeats, chunks = (3, 64) if args.quick else (args.repeats, 256)
    rows = []
    for kind, block_granular in KINDS.items():
        for reader_tp in (1, 2):
            tmp = Path(tempfile.mkdtemp(prefix="kvflow-reshape-"))
            try:
                gbs = trio.run(_direction, tmp, chunks, repeats, block_granular, reader_tp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            what = "TP=1 reads TP=2" if reader_tp == 1 else "TP=2 reads TP=1"
            ratio = gbs["reshaped"] / gbs["own"]
            rows.append({"kind": kind, "direction": what, **gbs, "ratio": ratio})
            print(
                f"{kind:<28} {what}: own {gbs['own']:.2f} GB/s, reshaped "
                f"{gbs['reshaped']:.2f} GB/s ({ratio:.2f}x)",
                flush=True,
            )
    out = Path(__file__).parent / "results" / "reshape.json"
    record.save(out, {"repeats": repeats, "tokens": chunks * BS, "rows": rows}, meta)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
