"""Benchmark: transfer throughput of the kvflow `zmq` peer transport vs plain pyzmq moving
the same bytes over the same socket pattern, in the same process and run.

    python bench/bench_zmq.py [--repeats 9] [--blocks 64,512] [--layers 32] [--quick]

About 45 s on a 2-core machine (`--quick`: a few seconds).

Workload. Block-granular KV memory shaped like vLLM's CPU cache
(`[blocks, kv_heads, block_size, 2*head_dim]` per layer, fp16 standing in for bf16, both
2 bytes), `--layers` layers, `--block-size` tokens per block:

- `llama3-8b`: 8 KV heads x 128 head dim x 2 (K,V) x 2 B x 16 tokens = 64 KiB per block
  per layer (1 GiB for 8k tokens over 32 layers);
- `small`: 2 KV heads x 64 head dim -> 8 KiB per block per layer.

A request moves `--blocks` blocks (64, 512: 1k and 8k tokens at block size 16), from a
random choice of producer blocks into a random choice of consumer blocks (vLLM's block ids
are scattered). The producer's blocks hold random bytes; the consumer's are zeroed
before every transfer and compared with the producer's after it (an AssertionError if a
single byte differs), for both sides, outside the timed window.

What each side does, per transfer (the timed window is the consumer's, from asking to
the last byte landed and the "done" reply queued):

- kvflow: a producer `ZmqTransport` (worker role, its own zmq context) runs in its own
  thread under its own `trio.run`: it binds its ROUTER, `offer()`s the request and runs
  `serve()`. The consumer `ZmqTransport` (its own zmq context) runs under `trio.run` in
  the main thread; the timed call is `await consumer.load(LoadJob(...))`: it opens a
  DEALER, connects, sends `Pull`, and per layer receives one multipart message
  (a msgpack `Layer` header + one frame per block, sent `copy=False, track=True`),
  decodes and checks the header, and copies each frame into its block with
  `d[:] = f.buffer`, then sends `Done`. The span lists come from `KVLayout.chunk_spans`
  per layer, as the worker engine does. Between transfers (untimed) the consumer waits
  until the producer has released the offer (it got `Done` and zmq freed every frame).
- plain pyzmq: a server thread with a blocking ROUTER (own zmq context,
  `ROUTER_MANDATORY`) and a client in the main thread with a blocking DEALER (own zmq
  context; plain blocking calls, no trio on either socket) - the same DEALER->ROUTER
  over tcp loopback, the same thread layout as the kvflow side. Per transfer the client
  opens and connects a fresh DEALER (as `load()` does), sends a request; the server sends
  per layer one multipart message `[ident, 8-byte header, *block spans]` with
  `copy=False` (untracked, see below); the client receives each layer with `copy=False`,
  checks the layer number and frame count and copies each frame into its block with
  `d[:] = f.buffer`, then sends "done" with NOBLOCK and closes the socket with linger.
  Its span lists are precomputed memoryviews over the same KV buffers. Plain pyzmq
  does not track sends, so kvflow's tracking cost (it must not hand blocks back to vLLM
  while zmq still reads them) shows in the ratio; `--plain-track` makes plain pyzmq
  track every frame as kvflow does, to isolate that cost.

Both sides move the same bytes between the same buffers; pyzmq's default
`copy_threshold` (64 KiB) applies to both (so 8 KiB frames are copied into zmq messages
on send either way). kvflow and plain transfers alternate (k p p k k p ...), so drift on
a shared machine hits both alike. Times are the median of `--repeats` transfers after
one warm-up transfer each; the ratio kvflow/plain is of throughputs (>1: kvflow faster),
also given for the fastest transfer of each. Prints a table and writes
bench/results/zmq.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import trio
import trio.testing
import zmq

from kvflow.layout import KVLayout
from kvflow.testing.layouts import make_layout
from kvflow.transport import LoadJob, Offer, PeerSource, TransportContext
from kvflow_zmq import ZmqOptions, ZmqTransport

MODELS: dict[str, dict[str, int]] = {
    "llama3-8b": {"heads": 8, "head_dim": 128},  # 64 KiB per block per layer
    "small": {"heads": 2, "head_dim": 64},  # 8 KiB per block per layer
}
TIMEOUT_S = 60.0
"""Per transfer, and per wait for a thread."""


@dataclass
class Case:
    """One request: `n` blocks from `src_ids` of the producer to `dst_ids` of the consumer."""

    prod: KVLayout
    cons: KVLayout
    src_ids: list[int]
    dst_ids: list[int]
    block_size: int

    @property
    def counts(self) -> list[int]:
        return [self.block_size] * len(self.src_ids)

    @property
    def nbytes(self) -> int:
        return self.prod.nbytes(self.counts)

    def src_spans(self, layer: int) -> list[list[memoryview]]:
        return self.prod.chunk_spans(layer, self.src_ids, self.counts)

    def dst_spans(self, layer: int) -> list[list[memoryview]]:
        return self.cons.chunk_spans(layer, self.dst_ids, self.counts)


def _blocks(layout: KVLayout, layer: int) -> np.ndarray[Any, Any]:
    g = layout.geometries[layer]
    return np.frombuffer(layout.buffers[layer], dtype=np.uint8).reshape(g.num_blocks, -1)


def _zero_dest(case: Case) -> None:
    for layer in range(case.cons.num_layers):
        _blocks(case.cons, layer)[case.dst_ids] = 0


def _verify(case: Case, what: str) -> None:
    for layer in range(case.prod.num_layers):
        src = _blocks(case.prod, layer)[case.src_ids]
        dst = _blocks(case.cons, layer)[case.dst_ids]
        if not np.array_equal(src, dst):
            bad = int(np.argmax((src != dst).any(axis=1)))
            raise AssertionError(f"{what}: layer {layer} block #{bad} differs after transfer")


def _layouts(model: str, layers: int, num_blocks: int, block_size: int) -> tuple[KVLayout, ...]:
    dims = MODELS[model]
    out = []
    for _ in range(2):
        out.append(
            make_layout(
                num_layers=layers,
                num_blocks=num_blocks,
                block_size=block_size,
                block_granular=True,
                dtype="float16",
                **dims,
            )
        )
    rng = np.random.default_rng(7)
    for layer in range(layers):  # random producer bytes; consumer pages touched as vLLM's are
        src = _blocks(out[0], layer)
        src[:] = np.frombuffer(rng.bytes(src.size), dtype=np.uint8).reshape(src.shape)
        _blocks(out[1], layer)[:] = 1
    return out[0], out[1]


# -- kvflow ----------------------------------------------------------------------------


def _ctx(layout: KVLayout) -> TransportContext:
    return TransportContext("bench", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout)


def _kvflow_producer(
    case: Case, reqs: list[str], box: dict[str, Any], released: dict[str, threading.Event]
) -> None:
    """Thread body: a producer transport holding an offer of `case` for each of `reqs`."""

    async def main() -> None:
        producer = ZmqTransport(ZmqOptions(), _ctx(case.prod))
        await producer.open()
        await producer.register(case.prod)
        left = len(reqs)
        all_done = trio.Event()

        async def hold(req: str) -> None:
            nonlocal left
            offer = Offer(req, case.src_ids, case.counts, case.prod.num_layers, case.src_spans)
            box[req] = await producer.offer(offer)
            released[req].set()
            left -= 1
            if not left:
                all_done.set()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer.serve)
                for req in reqs:
                    nursery.start_soon(hold, req)
                await trio.testing.wait_all_tasks_blocked()
                box.update(
                    address=producer.address,
                    cancel=nursery.cancel_scope.cancel,
                    token=trio.lowlevel.current_trio_token(),
                )
                box["ready"].set()
                await all_done.wait()
                nursery.cancel_scope.cancel()
        finally:
            await producer.aclose()

    try:
        trio.run(main)
    except BaseException as exc:
        box["error"] = exc
        box["ready"].set()


# -- plain pyzmq -----------------------------------------------------------------------


def _plain_server(
    ctx: zmq.Context[Any],
    src: list[list[memoryview]],
    box: dict[str, Any],
    track: bool,
) -> None:
    """Thread body: a blocking ROUTER that answers each b"pull" with every layer."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    box["address"] = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    box["ready"].set()
    try:
        while True:
            ident, what = sock.recv_multipart()
            if what == b"stop":
                break
            if what != b"pull":
                continue  # b"done"
            trackers = []
            for layer, spans in enumerate(src):
                header = layer.to_bytes(4, "little") + len(spans).to_bytes(4, "little")
                t = sock.send_multipart([ident, header, *spans], copy=False, track=track)
                trackers.append(t)
            for t in trackers:
                if t is not None:
                    t.wait(TIMEOUT_S)
    except BaseException as exc:
        box["error"] = exc
    finally:
        sock.close(linger=0)


def _plain_pull(ctx: zmq.Context[Any], address: str, dest: list[list[memoryview]]) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1e3))
    sock.connect(address)
    sock.send(b"pull")
    for layer, spans in enumerate(dest):
        frames = sock.recv_multipart(copy=False)
        head = frames[0].bytes
        if int.from_bytes(head[:4], "little") != layer or len(frames) != len(spans) + 1:
            raise AssertionError(f"plain: unexpected layer message {head!r}")
        for d, f in zip(spans, frames[1:], strict=True):
            d[:] = f.buffer
    sock.send(b"done", zmq.NOBLOCK)
    sock.close(linger=1000)


def bench_case(case: Case, repeats: int, track: bool) -> tuple[list[float], list[float]]:
    """Seconds per transfer of kvflow and of plain pyzmq, interleaved (so that drift of a
    shared machine hits both alike), warm-up transfers dropped."""
    reqs = [f"r{i}" for i in range(repeats + 1)]
    released = {r: threading.Event() for r in reqs}
    kv_box: dict[str, Any] = {"ready": threading.Event()}
    kv_thread = threading.Thread(
        target=_kvflow_producer, args=(case, reqs, kv_box, released), daemon=True
    )
    layers = range(case.prod.num_layers)
    src = [[s for chunk in case.src_spans(i) for s in chunk] for i in layers]
    dest = [[s for chunk in case.dst_spans(i) for s in chunk] for i in layers]
    server_ctx: zmq.Context[Any] = zmq.Context()
    client_ctx: zmq.Context[Any] = zmq.Context()
    plain_box: dict[str, Any] = {"ready": threading.Event()}
    plain_thread = threading.Thread(
        target=_plain_server, args=(server_ctx, src, plain_box, track), daemon=True
    )
    for thread, box in ((kv_thread, kv_box), (plain_thread, plain_box)):
        thread.start()
        box["ready"].wait(TIMEOUT_S)
        if "error" in box:
            raise box["error"]
    kv_times: list[float] = []
    plain_times: list[float] = []

    async def kvflow_load(consumer: ZmqTransport, req: str) -> None:
        job = LoadJob(
            f"c-{req}",
            ["k"] * len(case.dst_ids),
            case.counts,
            case.cons.num_layers,
            case.dst_spans,
            lambda _layer: None,
            PeerSource("bench", [kv_box["address"]], req, case.src_ids),
            list(case.dst_ids),
        )
        _zero_dest(case)
        with trio.fail_after(TIMEOUT_S):
            t0 = time.perf_counter()
            await consumer.load(job)
            kv_times.append(time.perf_counter() - t0)
        # the producer lets go of the blocks (it got Done and zmq freed every frame)
        if not await trio.to_thread.run_sync(released[req].wait, TIMEOUT_S):
            raise AssertionError(f"kvflow: the producer still holds {req} {TIMEOUT_S}s later")
        if kv_box.get(req) != "done":
            raise AssertionError(f"kvflow: the producer's offer ended {kv_box.get(req)!r}")
        _verify(case, "kvflow zmq")

    def plain_pull() -> None:
        _zero_dest(case)
        t0 = time.perf_counter()
        _plain_pull(client_ctx, plain_box["address"], dest)
        plain_times.append(time.perf_counter() - t0)
        _verify(case, "plain pyzmq")

    async def main() -> None:
        consumer = ZmqTransport(ZmqOptions(), _ctx(case.cons))
        await consumer.open()
        await consumer.register(case.cons)
        try:
            for i, req in enumerate(reqs):
                if i % 2:
                    plain_pull()
                await kvflow_load(consumer, req)
                if not i % 2:
                    plain_pull()
        finally:
            await consumer.aclose()

    try:
        trio.run(main)
    except BaseException:
        for box in (kv_box, plain_box):
            if "error" in box:  # a server thread's failure is the cause to report
                raise box["error"]  # noqa: B904 - the consumer's error stays as context
        raise
    finally:
        if kv_thread.is_alive() and "token" in kv_box:  # the consumer failed: end the producer
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(kv_box["cancel"], trio_token=kv_box["token"])
        stop = client_ctx.socket(zmq.DEALER)
        stop.connect(plain_box["address"])
        stop.send(b"stop")
        stop.close(linger=1000)
        plain_thread.join(TIMEOUT_S)
        kv_thread.join(TIMEOUT_S)
        client_ctx.destroy(linger=0)
        server_ctx.destroy(linger=0)
    for box in (kv_box, plain_box):
        if "error" in box:
            raise box["error"]
    return kv_times[1:], plain_times[1:]


# -- driver ----------------------------------------------------------------------------


def _case(prod: KVLayout, cons: KVLayout, n: int, block_size: int, seed: int) -> Case:
    rng = np.random.default_rng(seed)
    nb = prod.geometries[0].num_blocks
    src = [int(b) for b in rng.permutation(nb)[:n]]
    dst = [int(b) for b in rng.permutation(nb)[:n]]
    return Case(prod, cons, src, dst, block_size)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    ap.add_argument("--blocks", default="64,512", help="blocks per request, comma-separated")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--repeats", type=int, default=9, help="timed transfers after 1 warm-up")
    ap.add_argument("--plain-track", action="store_true", help="plain pyzmq sends tracked")
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 blocks, 2 repeats")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "zmq.json"))
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.repeats = "64", 2
    blocks = [int(b) for b in args.blocks.split(",")]
    models = args.models.split(",")
    print(
        f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, {os.cpu_count()} CPUs, "
        f"{args.layers} layers, block size {args.block_size}, median of {args.repeats} "
        f"after 1 warm-up",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for model in models:
        prod, cons = _layouts(model, args.layers, max(blocks), args.block_size)
        per_block = prod.geometries[0].block_bytes
        for n in blocks:
            case = _case(prod, cons, n, args.block_size, seed=n)
            name = f"{model} {n} blocks"
            print(f"  {name} ({per_block // 1024} KiB/block/layer) ...", flush=True)
            kv, plain = bench_case(case, args.repeats, args.plain_track)
            kv_s, plain_s = statistics.median(kv), statistics.median(plain)
            rows.append(
                {
                    "config": name,
                    "model": model,
                    "blocks": n,
                    "tokens": n * args.block_size,
                    "block_bytes_per_layer": per_block,
                    "total_bytes": case.nbytes,
                    "kvflow_ms": kv_s * 1e3,
                    "kvflow_gbs": case.nbytes / kv_s / 1e9,
                    "plain_ms": plain_s * 1e3,
                    "plain_gbs": case.nbytes / plain_s / 1e9,
                    "ratio": plain_s / kv_s,
                    "ratio_best": min(plain) / min(kv),
                    "kvflow_times_s": kv,
                    "plain_times_s": plain,
                }
            )
        del prod, cons

    heads = ("MiB", "kvflow ms", "kvflow GB/s", "plain ms", "plain GB/s", "kvflow/plain", "(best)")
    print(f"\n{'config':<24}" + "".join(f"{h:>13}" for h in heads))
    for r in rows:
        cells = (
            f"{r['total_bytes'] / 2**20:.0f}",
            f"{r['kvflow_ms']:.1f}",
            f"{r['kvflow_gbs']:.2f}",
            f"{r['plain_ms']:.1f}",
            f"{r['plain_gbs']:.2f}",
            f"{r['ratio']:.2f}",
            f"{r['ratio_best']:.2f}",
        )
        print(f"{r['config']:<24}" + "".join(f"{c:>13}" for c in cells))
    print(
        "(kvflow/plain: throughput ratio of the medians, 1.00 = as fast as plain pyzmq; "
        "(best): of the fastest transfers)"
    )

    results = {
        "args": vars(args),
        "env": {
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "table": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
