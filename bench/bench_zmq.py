"""Benchmark: transfer throughput of the kvflow `zmq` peer transport vs plain pyzmq moving
the same bytes over the same socket pattern, in the same process and run; with
`--channels`, kvflow's pull on a keyless vs an authenticated vs an encrypted side channel.

    python bench/bench_zmq.py [--repeats 9] [--blocks 64,512] [--layers 32] [--quick]
    python bench/bench_zmq.py --channels [--repeats 31] [--blocks 1,16,128] [--quick]

About 60 s on a 2-core machine (`--channels`: about 35 s; `--quick`: 5-10 s).

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
  (a msgpack `Layer` header + one frame per block; the producer sends copies of its
  blocks, `copy=True`, so that they go back to vLLM as soon as they are queued; until
  2026-11-26 it sent them zero-copy, `copy=False` with one tracked frame per layer),
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
  sends zero-copy and untracked, so what kvflow's copies cost (the price of handing
  blocks back to vLLM as soon as they are sent, whatever the consumer does) shows in
  the ratio; `--plain-track` makes plain pyzmq track every frame.

Both sides move the same bytes between the same buffers; pyzmq's default
`copy_threshold` (64 KiB) applies to both (so 8 KiB frames are copied into zmq messages
on send either way). kvflow and plain transfers alternate (k p p k k p ...), so drift on
a shared machine hits both alike. Times are the median of `--repeats` transfers after
one warm-up transfer each; the ratio kvflow/plain is of throughputs (>1: kvflow faster),
also given for the fastest transfer of each. Prints a table and writes
bench/results/zmq.json.

`--channels`: what securing the side channel (`kvflow.pd.security.Channel`) costs a pull.
kvflow producer/consumer pairs, one pair per channel, all with one deployment key, each
producer in a process of its own (as in a deployment): `keyless` (no key),
`authenticated` (the `kv-in-clear` mode, labelled as in earlier results: each
connection's handshake is ZMQ PLAIN with a one-time credential MAC'd with the key,
checked by the producer's ZAP task, and every control frame - `Pull`, each layer's
`Layer` header, `Done` - sealed with a truncated HMAC-SHA256 and checked; KV frames as
they are) and `encrypted` (ZMQ CURVE on both sockets instead of PLAIN: every frame, KV
bytes included, encrypted with libsodium's XSalsa20-Poly1305). Model `llama3-8b`, 32
layers; `--blocks` defaults to 1, 16 and 128 blocks per request: 64 KiB, 1 MiB and
8 MiB per layer (2, 32 and 256 MiB per request). The three channels take turns in a
rotating order (k a e, a e k, e k a, ...), every byte checked after every pull, medians
of `--repeats` (31) after one warm-up round; ratios are of throughputs against keyless
(1.00: as fast), of the medians, of the fastest pulls, and the median of each round's
own ratio (paired). It also times, per call, median of 5 runs of many calls:
`kvflow.pd.params.check_pd_params` (what a consumer does with every P/D request before it
pulls: addresses, the params' MAC, the prompt's digest) on a 2048-token prompt's params
(128 blocks of 16), keyless and keyed, and its two parts; and one `Channel.seal` +
`Channel.open` of each control frame of a pull (both sides' MAC work), with their sum
for one 32-layer pull. Writes bench/results/zmq-channels.json.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import platform
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import record
import trio
import trio.testing
import zmq

from kvflow.geometry.layout import KVLayout
from kvflow.pd.context import PeerContext
from kvflow.pd.offers import answer_bind
from kvflow.pd.params import PD_VERSION, UNSET_SHAPE, PdParams, check_pd_params
from kvflow.pd.security import Channel, Toward, prompt_digest
from kvflow.testing.layouts import make_layout
from kvflow.transport import LoadJob, Offer, PeerSource, TransportContext
from kvflow_zmq import ZmqOptions, ZmqTransport
from kvflow_zmq import _wire as wire

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


def _ctx(layout: KVLayout, channel: Channel | None = None) -> PeerContext:
    ctx = TransportContext("bench", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout)
    return PeerContext.of(ctx, channel=channel or Channel())


async def _hold_offers(
    case: Case,
    reqs: list[str],
    channel: Channel | None,
    started: Callable[[str, Callable[[], None]], None],
    ended: Callable[[str, str], None],
    stopped: Callable[[], Awaitable[Any]] = trio.sleep_forever,
) -> None:
    """A producer transport holding an offer of `case` for each of `reqs`, serving until
    `stopped()` returns (or it is cancelled): `started(address, cancel)` once it serves,
    `ended(req, outcome)` as each offer ends. An offer ends once its copies are queued,
    before they are all sent: serving stops when the consumer says, not then."""
    producer = ZmqTransport(ZmqOptions(), _ctx(case.prod, channel))
    await producer.open()
    await producer.register(case.prod)

    async def hold(req: str) -> None:
        offer = Offer(req, case.src_ids, case.counts, case.prod.num_layers, case.src_spans)
        ended(req, await producer.offer(offer))

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            for req in reqs:
                nursery.start_soon(hold, req)
            await trio.testing.wait_all_tasks_blocked()
            started(producer.address, nursery.cancel_scope.cancel)
            await stopped()
            nursery.cancel_scope.cancel()
    finally:
        await producer.aclose()


def _kvflow_producer(
    case: Case,
    reqs: list[str],
    box: dict[str, Any],
    released: dict[str, threading.Event],
    channel: Channel | None = None,
) -> None:
    """Thread body: `_hold_offers`, reporting through `box` and `released`."""

    def started(address: str, cancel: Callable[[], None]) -> None:
        box.update(address=address, cancel=cancel, token=trio.lowlevel.current_trio_token())
        box["ready"].set()

    def ended(req: str, outcome: str) -> None:
        box[req] = outcome
        released[req].set()

    try:
        trio.run(_hold_offers, case, reqs, channel, started, ended)
    except BaseException as exc:
        box["error"] = exc
        box["ready"].set()


def _start_producer(
    case: Case, reqs: list[str], channel: Channel | None = None
) -> tuple[threading.Thread, dict[str, Any], dict[str, threading.Event]]:
    """A `_kvflow_producer` thread, started and serving (its box has its address)."""
    released = {r: threading.Event() for r in reqs}
    box: dict[str, Any] = {"ready": threading.Event()}
    thread = threading.Thread(
        target=_kvflow_producer, args=(case, reqs, box, released, channel), daemon=True
    )
    thread.start()
    box["ready"].wait(TIMEOUT_S)
    if "error" in box:
        raise box["error"]
    return thread, box, released


def _stop_producer(thread: threading.Thread, box: dict[str, Any]) -> None:
    if thread.is_alive() and "token" in box:  # the consumer failed: end the producer
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(box["cancel"], trio_token=box["token"])
    thread.join(TIMEOUT_S)


def _job(case: Case, address: str, req: str) -> LoadJob:
    """The consumer's load of offer `req` of `case` from the producer at `address`."""
    return LoadJob(
        f"c-{req}",
        ["k"] * len(case.dst_ids),
        case.counts,
        case.cons.num_layers,
        case.dst_spans,
        lambda _layer: None,
        PeerSource("bench", [address], req, case.src_ids),
        list(case.dst_ids),
    )


async def _kvflow_pull(
    consumer: ZmqTransport,
    case: Case,
    box: dict[str, Any],
    released: dict[str, threading.Event],
    req: str,
    times: list[float],
    what: str,
) -> None:
    """One timed `load()` of offer `req`, appended to `times`; then (untimed) wait for the
    producer to let go of the offer and check every byte."""
    job = _job(case, box["address"], req)
    _zero_dest(case)
    with trio.fail_after(TIMEOUT_S):
        t0 = time.perf_counter()
        await consumer.load(job)
        times.append(time.perf_counter() - t0)
    # the producer lets go of the blocks (it got Done)
    if not await trio.to_thread.run_sync(released[req].wait, TIMEOUT_S):
        raise AssertionError(f"{what}: the producer still holds {req} {TIMEOUT_S}s later")
    if box.get(req) != "done":
        raise AssertionError(f"{what}: the producer's offer ended {box.get(req)!r}")
    _verify(case, what)


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
    layers = range(case.prod.num_layers)
    src = [[s for chunk in case.src_spans(i) for s in chunk] for i in layers]
    dest = [[s for chunk in case.dst_spans(i) for s in chunk] for i in layers]
    server_ctx: zmq.Context[Any] = zmq.Context()
    client_ctx: zmq.Context[Any] = zmq.Context()
    plain_box: dict[str, Any] = {"ready": threading.Event()}
    plain_thread = threading.Thread(
        target=_plain_server, args=(server_ctx, src, plain_box, track), daemon=True
    )
    kv_thread, kv_box, released = _start_producer(case, reqs)
    plain_thread.start()
    plain_box["ready"].wait(TIMEOUT_S)
    if "error" in plain_box:
        raise plain_box["error"]
    kv_times: list[float] = []
    plain_times: list[float] = []

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
                await _kvflow_pull(consumer, case, kv_box, released, req, kv_times, "kvflow zmq")
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
        _stop_producer(kv_thread, kv_box)
        stop = client_ctx.socket(zmq.DEALER)
        stop.connect(plain_box["address"])
        stop.send(b"stop")
        stop.close(linger=1000)
        plain_thread.join(TIMEOUT_S)
        client_ctx.destroy(linger=0)
        server_ctx.destroy(linger=0)
    for box in (kv_box, plain_box):
        if "error" in box:
            raise box["error"]
    return kv_times[1:], plain_times[1:]


# -- channels --------------------------------------------------------------------------

CHANNELS = ("keyless", "authenticated", "encrypted")


def _channels(key: bytes) -> dict[str, Channel]:
    return {
        "keyless": Channel(),
        "authenticated": Channel(key, "kv-in-clear"),
        "encrypted": Channel(key, "encrypted"),
    }


def _producer_process(case: Case, reqs: list[str], channel: Channel, conn: Connection) -> None:
    """Process body: `_hold_offers`, sending its address, then how each offer ended (a
    P/D producer is a process of its own, as in a deployment: its MAC and handshake work
    does not share the consumer's GIL)."""
    outcomes: dict[str, str] = {}

    async def stopped() -> None:  # the consumer's "stop", after its last pull
        await trio.to_thread.run_sync(conn.recv)

    trio.run(
        _hold_offers, case, reqs, channel, lambda a, _: conn.send(a), outcomes.__setitem__, stopped
    )
    conn.send(outcomes)


def bench_channels(case: Case, repeats: int) -> dict[str, list[float]]:
    """Seconds per kvflow pull of `case` on each channel of `CHANNELS` (one producer
    process and one consumer each, one deployment key), in a rotating order, warm-up
    round dropped; every byte checked after every pull, every offer "done"."""
    channels = _channels(secrets.token_bytes(32))
    rounds = repeats + 1
    fork = mp.get_context("fork")  # the producer inherits `case`'s filled blocks
    producers: dict[str, tuple[Any, Connection, str]] = {}
    try:
        for name, ch in channels.items():
            mine, theirs = fork.Pipe()
            reqs = [f"{name[0]}{i}" for i in range(rounds)]
            proc = fork.Process(target=_producer_process, args=(case, reqs, ch, theirs))
            proc.start()
            if not mine.poll(TIMEOUT_S):
                raise RuntimeError(f"the {name} producer did not start")
            producers[name] = (proc, mine, mine.recv())
        times = trio.run(_pull_rounds, case, channels, producers, rounds)
        for name, (_, conn, _) in producers.items():
            conn.send("stop")
            outcomes = conn.recv() if conn.poll(TIMEOUT_S) else {}
            if sorted(outcomes.values()) != ["done"] * rounds:
                raise AssertionError(f"zmq {name}: offers ended {sorted(set(outcomes.values()))}")
    finally:
        for proc, _, _ in producers.values():
            proc.join(TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
    return {name: t[1:] for name, t in times.items()}


async def _pull_rounds(
    case: Case,
    channels: dict[str, Channel],
    producers: dict[str, tuple[Any, Connection, str]],
    rounds: int,
) -> dict[str, list[float]]:
    """The consumer's side of `bench_channels`: `rounds` rounds of one timed pull per
    channel, in a rotating order."""
    times: dict[str, list[float]] = {name: [] for name in channels}
    consumers: dict[str, ZmqTransport] = {}
    try:
        for name, ch in channels.items():
            consumers[name] = ZmqTransport(ZmqOptions(), _ctx(case.cons, ch))
            await consumers[name].open()
            await consumers[name].register(case.cons)
        for i in range(rounds):
            for k in range(len(CHANNELS)):
                name = CHANNELS[(i + k) % len(CHANNELS)]
                req = f"{name[0]}{i}"
                job = _job(case, producers[name][2], req)
                _zero_dest(case)
                with trio.fail_after(TIMEOUT_S):
                    t0 = time.perf_counter()
                    await consumers[name].load(job)
                    times[name].append(time.perf_counter() - t0)
                _verify(case, f"zmq {name}")
    finally:
        for consumer in consumers.values():
            await consumer.aclose()
    return times


def _per_call_us(fn: Callable[[], object], n: int, runs: int = 5) -> float:
    """Microseconds per call of `fn`: the median of `runs` runs of `n` calls."""
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter_ns() - t0) / n / 1e3)
    return statistics.median(samples)


def micro_us(layout: KVLayout, n: int = 2000) -> dict[str, float]:
    """Per-call cost (us) of a consumer's P/D params check and of sealing and opening
    each control frame of a pull of `layout` (see the module text)."""
    key = secrets.token_bytes(32)
    keyless, keyed = Channel(), Channel(key, "kv-in-clear")
    rng = np.random.default_rng(11)
    tokens = [int(t) for t in rng.integers(0, 128_000, 2048)]  # a 2k-token prompt
    blocks = [int(b) for b in rng.permutation(4096)[:128]]  # 2048 tokens / 16 per block
    salt = '["tenant-a", "lora:3"]'

    def params(address: str, channel: Channel) -> PdParams:
        p = PdParams(
            PD_VERSION,
            "prefill-0-dp0",
            [address],
            secrets.token_hex(16),
            blocks,
            len(tokens),
            16,
            prompt_digest(tokens, salt),
            UNSET_SHAPE,
            1,
            1,
        )
        return p.signed(channel)

    out: dict[str, float] = {}
    for label, channel, address in (
        ("keyless", keyless, "tcp://127.0.0.1:5601"),
        ("keyed", keyed, "tcp://10.0.0.7:5601"),
    ):
        p = params(address, channel)
        if check_pd_params(p, channel, tokens, salt) != ("", ""):
            raise AssertionError(f"check_pd_params refused the bench's {label} params")
        out[f"check_pd_params, {label} (2048-token prompt, 128 blocks)"] = _per_call_us(
            lambda p=p, channel=channel: check_pd_params(p, channel, tokens, salt), n
        )
    signed = params("tcp://10.0.0.7:5601", keyed)
    out["of which the params' MAC (keyed: encode + HMAC + compare)"] = _per_call_us(
        lambda: keyed.signed(signed.message(), signed.mac), n * 5
    )
    out["of which the prompt's digest (2048 tokens)"] = _per_call_us(
        lambda: prompt_digest(tokens, salt), n
    )
    req = secrets.token_hex(16)
    span = layout.geometries[0].block_bytes
    frames = {
        "Pull": wire.Pull(req, blocks, geometries=list(layout.geometries)),
        "Layer": wire.Layer(req, 7, [span] * 16),  # a 1 MiB layer of 64 KiB blocks
        "Done": wire.Done(req),
    }
    what = {
        "Pull": f"Pull (128 blocks, {layout.num_layers} layer geometries)",
        "Layer": "Layer header (16 spans)",
        "Done": "Done",
    }
    frame_us = {}
    for name, msg in frames.items():
        payload = wire.encode(msg)
        # a Layer header is a producer's answer, bound to its pull and place in it
        to, bind = ("consumer", answer_bind(secrets.token_bytes(16), 7))
        if name != "Layer":
            to, bind = "producer", b""

        def seal_open(payload: bytes = payload, to: Toward = to, bind: bytes = bind) -> None:
            if keyed.open(keyed.seal(payload, to, bind), to, bind) != payload:
                raise AssertionError("seal/open changed the frame")

        frame_us[name] = _per_call_us(seal_open, n * 5)
        out[f"seal + open, {what[name]}, {len(payload)} B"] = frame_us[name]
    pull = frame_us["Pull"] + layout.num_layers * frame_us["Layer"] + frame_us["Done"]
    out[f"seal + open, a {layout.num_layers}-layer pull's frames (sum)"] = pull
    return out


# -- driver ----------------------------------------------------------------------------


def _case(prod: KVLayout, cons: KVLayout, n: int, block_size: int, seed: int) -> Case:
    rng = np.random.default_rng(seed)
    nb = prod.geometries[0].num_blocks
    src = [int(b) for b in rng.permutation(nb)[:n]]
    dst = [int(b) for b in rng.permutation(nb)[:n]]
    return Case(prod, cons, src, dst, block_size)


def main() -> int:
    meta = record.start()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--models", help=f"of {', '.join(MODELS)} (default: all; --channels: llama3-8b)"
    )
    ap.add_argument(
        "--blocks", help="blocks per request, comma-separated (default 64,512; --channels 1,16,128)"
    )
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument(
        "--repeats", type=int, help="timed transfers after 1 warm-up (default 9; --channels 31)"
    )
    ap.add_argument("--plain-track", action="store_true", help="plain pyzmq sends tracked")
    ap.add_argument(
        "--channels", action="store_true", help="keyless vs authenticated vs encrypted channels"
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer blocks, 2 repeats")
    ap.add_argument("--out", help="results file (default bench/results/zmq[-channels].json)")
    args = ap.parse_args()
    if args.channels:
        args.models = args.models or "llama3-8b"
        args.blocks = args.blocks or ("1,16" if args.quick else "1,16,128")
    else:
        args.models = args.models or ",".join(MODELS)
        args.blocks = args.blocks or ("64" if args.quick else "64,512")
    args.repeats = 2 if args.quick else args.repeats or (31 if args.channels else 9)
    name = "zmq-channels" if args.channels else "zmq"
    args.out = args.out or str(Path(__file__).parent / "results" / f"{name}.json")
    print(
        f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}, {os.cpu_count()} CPUs, "
        f"{args.layers} layers, block size {args.block_size}, median of {args.repeats} "
        f"after 1 warm-up",
        flush=True,
    )
    blocks = [int(b) for b in args.blocks.split(",")]
    models = args.models.split(",")
    results: dict[str, Any] = {
        "run": {"load_average": list(os.getloadavg())},
        "args": vars(args),
        "env": {
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "curve": zmq.has("curve"),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
    }
    if args.channels:
        results |= run_channels(args, models, blocks)
    else:
        results["table"] = run_plain(args, models, blocks)
    results["run"]["load_average_after"] = list(os.getloadavg())
    record.save(args.out, results, meta)
    print(f"\nwrote {args.out}")
    return 0


def _cases(
    args: argparse.Namespace, models: list[str], blocks: list[int]
) -> Iterator[tuple[str, int, int, Case]]:
    """(model, blocks per request, bytes per block and layer, case) for each of `models`
    (its layouts made once, as large as the largest request) and each of `blocks`."""
    for model in models:
        prod, cons = _layouts(model, args.layers, max(blocks), args.block_size)
        per_block = prod.geometries[0].block_bytes
        for n in blocks:
            yield model, n, per_block, _case(prod, cons, n, args.block_size, seed=n)


def run_plain(args: argparse.Namespace, models: list[str], blocks: list[int]) -> list[Any]:
    """kvflow vs plain pyzmq: the table's rows."""
    rows: list[dict[str, Any]] = []
    for model, n, per_block, case in _cases(args, models, blocks):
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
    return rows


def run_channels(args: argparse.Namespace, models: list[str], blocks: list[int]) -> dict[str, Any]:
    """Keyless vs authenticated vs encrypted pulls ("table") and the per-call costs of
    the checks ("micro_us")."""
    rows: list[dict[str, Any]] = []
    for model, n, per_block, case in _cases(args, models, blocks):
        layer_bytes = n * per_block
        name = f"{model}, {_size(layer_bytes)} per layer"
        print(f"  {name} ({n} blocks of {per_block // 1024} KiB) ...", flush=True)
        times = bench_channels(case, args.repeats)
        med = {ch: statistics.median(t) for ch, t in times.items()}
        row: dict[str, Any] = {
            "config": name,
            "model": model,
            "blocks": n,
            "layer_bytes": layer_bytes,
            "total_bytes": case.nbytes,
        }
        for ch in CHANNELS:
            row[f"{ch}_ms"] = med[ch] * 1e3
            row[f"{ch}_gbs"] = case.nbytes / med[ch] / 1e9
        for ch in CHANNELS[1:]:
            row[f"{ch}_ratio"] = med["keyless"] / med[ch]
            row[f"{ch}_ratio_best"] = min(times["keyless"]) / min(times[ch])
            row[f"{ch}_ratio_paired"] = statistics.median(  # each round's own ratio
                k / c for k, c in zip(times["keyless"], times[ch], strict=True)
            )
        row["times_s"] = times
        rows.append(row)
    micro = micro_us(case.prod)  # the last model's layout
    del case

    heads = ("MiB", "keyless GB/s", "auth GB/s", "auth/keyless", "(best)", "(paired)")
    heads += ("encr GB/s", "encr/keyless", "(best)", "(paired)")
    print(f"\n{'config':<28}" + "".join(f"{h:>13}" for h in heads))
    for r in rows:
        cells = [f"{r['total_bytes'] / 2**20:.0f}", f"{r['keyless_gbs']:.2f}"]
        for ch in CHANNELS[1:]:
            cells.append(f"{r[f'{ch}_gbs']:.2f}")
            cells += [f"{r[f'{ch}_ratio{x}']:.3f}" for x in ("", "_best", "_paired")]
        print(f"{r['config']:<28}" + "".join(f"{c:>13}" for c in cells))
    print(
        "(x/keyless: throughput ratio of the medians, 1.000 = as fast as keyless; "
        "(best): of the fastest pulls; (paired): median of each round's ratio)\n"
    )
    for what, us in micro.items():
        print(f"  {us:9.2f} us  {what}")
    return {"table": rows, "micro_us": micro}


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 and not n % 2**20 else f"{n // 1024} KiB"


if __name__ == "__main__":
    sys.exit(main())
