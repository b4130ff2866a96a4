"""The parties, blocks and frames of the side-channel attack tests (issue 27), tried as an
attacker would: a second party with pyzmq on real sockets against a real producer (`zmq`
and `nixl` workers serving held blocks) and, as a hostile producer, against a real
consumer. The attacker's ZMQ context is the `zctx` fixture (tests/conftest.py).

Every attack on a producer ends with an honest pull (`honest_pull`) that must return
identical bytes: the proof that the producer still serves after what it was sent. Every
attack on a consumer checks that its load raised a transport error and that its
destination blocks hold what they held (`untouched`). Nothing waits on time: events,
`trio.testing.wait_all_tasks_blocked`, socket monitors and answers in order on one
connection say when something happened; `trio.fail_after` (and `move_on_after` where a
pull must not hang) is a hang guard only.
"""

from __future__ import annotations

import importlib.util
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from kvflow.geometry.layout import KVLayout
from kvflow.pd.context import PeerContext
from kvflow.pd.offers import Renew, answer_bind
from kvflow.pd.peer_transport import PeerTransport
from kvflow.pd.security import Channel
from kvflow.testing.layouts import fill_blocks, make_layout
from kvflow.transport import LoadJob, Offer, PeerSource, Renewed
from kvflow.zmqio import BadFrame, TrioSocket
from kvflow_nixl import NixlOptions, NixlTransport
from kvflow_nixl import _wire as nwire
from kvflow_zmq import ZmqOptions, ZmqTransport
from kvflow_zmq import _wire as zwire

HAS_NIXL = any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12"))
KINDS = [
    "zmq",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed (nixl-cu12)"),
    ),
]

BS = 4
LAYERS = 3
OFFERED = [1, 2, 3]
COUNTS = [4, 4, 2]
DEST = [7, 8, 9]
POISON = 0xAB
HANG_GUARD_S = 30.0
"""Only a hang guard: every wait below ends on an event long before it."""

HANDSHAKE_FAILED: set[int] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    zmq.EVENT_DISCONNECTED,
}


# -- the parties -------------------------------------------------------------------


class Seen:
    """A producer's `TransportContext.rejected`: every (reason, detail), awaitable."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self._more = trio.Event()
        self.on_call: Callable[[str, str], None] = lambda reason, detail: None

    def __call__(self, reason: str, detail: str) -> None:
        self.on_call(reason, detail)
        self.log.append((reason, detail))
        more, self._more = self._more, trio.Event()
        more.set()

    def count(self, reason: str) -> int:
        return sum(r == reason for r, _ in self.log)

    async def reach(self, reason: str, n: int) -> None:
        while self.count(reason) < n:
            await self._more.wait()

    async def total(self, n: int) -> list[tuple[str, str]]:
        """The log once it holds `n` refusals, whatever their reasons."""
        while len(self.log) < n:
            await self._more.wait()
        return self.log


def worker_context(
    layout: KVLayout, channel: Channel, rejected: Callable[[str, str], None] | None = None
) -> PeerContext:
    return PeerContext(
        "e",
        "worker",
        "ns",
        "tp0of1pp0",
        ["tp0of1pp0"],
        layout,
        channel=channel,
        rejected=rejected,
    )


@asynccontextmanager
async def worker(
    kind: str,
    channel: Channel | None = None,
    layout: KVLayout | None = None,
    rejected: Callable[[str, str], None] | None = None,
    cls: type[PeerTransport] | None = None,
) -> AsyncIterator[tuple[Any, KVLayout]]:
    """A registered worker-side transport of `kind` over `layout` (a fresh one if None)."""
    layout = layout or make_layout(num_layers=LAYERS, block_size=BS)
    context = worker_context(layout, channel or Channel(), rejected)
    t: Any
    if cls is not None:
        t = cls(ZmqOptions(), context)
    elif kind == "zmq":
        t = ZmqTransport(ZmqOptions(), context)
    else:
        t = NixlTransport(NixlOptions(), context)
    await t.open()
    try:
        await t.register(layout)
        yield t, layout
    finally:
        await t.aclose()


@dataclass
class Peers:
    kind: str
    producer: Any
    consumer: Any
    prod: KVLayout
    cons: KVLayout
    seen: Seen
    channel: Channel


@asynccontextmanager
async def peers(kind: str, channel: Channel | None = None) -> AsyncIterator[Peers]:
    """A producer (its blocks `OFFERED` filled, its refusals recorded) and a consumer,
    both over `channel` (keyless if None)."""
    channel = channel or Channel()
    seen = Seen()
    prod = make_layout(num_layers=LAYERS, block_size=BS)
    fill_blocks(prod, OFFERED, seed=27)
    async with (
        worker(kind, channel, prod, seen) as (producer, _),
        worker(kind, channel) as (consumer, cons),
    ):
        yield Peers(kind, producer, consumer, prod, cons, seen, channel)


AUTHENTICATORS: dict[int, list[Any]] = {}
"""The ZAP handlers hostile producers started, by context: stopped before it ends."""


class AnyPlain(ThreadAuthenticator):
    """A hostile producer's ZAP handler: any PLAIN user and password pass (a producer
    needs nothing to accept a consumer's one-time credential)."""

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        return True, b"OK"


def dealer(
    zctx: zmq.Context[Any], address: str, *, channel: Channel | None = None, **opts: Any
) -> tuple[TrioSocket, TrioSocket]:
    """An attacker's DEALER connected to `address` (the handshake credentials of
    `channel` if given: its PLAIN password, or its CURVE keys) and a monitor of its
    connection's events."""
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    if channel is not None:
        channel.secure(sock, server=False)
    monitor = sock.get_monitor_socket()
    sock.connect(address)
    return TrioSocket(sock), TrioSocket(monitor)


def hostile_router(
    zctx: zmq.Context[Any], channel: Channel | None = None
) -> tuple[TrioSocket, str]:
    """A hostile producer's ROUTER on loopback and its address; with a keyed `kv-in-clear`
    `channel`, it passes a keyed consumer's handshake without the key (a PLAIN server
    takes any credential; the consumer cannot tell). An `encrypted` channel's handshake
    needs the server's secret: this one is given it (a test's shortcut, no attack)."""
    sock = zctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if channel is not None and channel.keyed:  # a ZAP handler that lets the consumer in
        auth = AnyPlain(zctx)
        auth.start()
        auth.configure_plain("kvflow", {"any": "any"})
        auth.configure_curve("kvflow", zmq.auth.CURVE_ALLOW_ANY)
        AUTHENTICATORS.setdefault(id(zctx), []).append(auth)
        channel.secure(sock, server=True)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return TrioSocket(sock), f"tcp://127.0.0.1:{port}"


def monitor_of(sock: TrioSocket) -> TrioSocket:
    """A monitor of `sock`'s connection events (read it: unread, libzmq's I/O thread
    blocks on it once its queue is full)."""
    return TrioSocket(sock.sock.get_monitor_socket())


async def until_event(monitor: TrioSocket, wanted: set[int]) -> list[int]:
    """The socket's events up to the first of `wanted`."""
    events: list[int] = []
    while not events or events[-1] not in wanted:
        events.append(int(parse_monitor_message(await monitor.recv_multipart())["event"]))
    return events


# -- blocks ------------------------------------------------------------------------


def spans(layout: KVLayout, blocks: list[int], counts: list[int] = COUNTS) -> Any:
    return lambda layer: [layout.spans(layer, b, n) for b, n in zip(blocks, counts, strict=True)]


def bytes_of(layout: KVLayout, blocks: list[int], counts: list[int] = COUNTS) -> list[bytes]:
    f = spans(layout, blocks, counts)
    return [b"".join(bytes(s) for c in f(i) for s in c) for i in range(layout.num_layers)]


def poison(layout: KVLayout, blocks: list[int] = DEST) -> None:
    for layer in range(layout.num_layers):
        for chunk in spans(layout, blocks)(layer):
            for s in chunk:
                s[:] = bytes([POISON]) * len(s)


def untouched(layout: KVLayout, blocks: list[int] = DEST) -> bool:
    return all(set(b) == {POISON} for b in bytes_of(layout, blocks))


def new_offer_id() -> str:
    return secrets.token_hex(16)


def load_job(
    layout: KVLayout, address: str, offer: str, src_blocks: list[int] = OFFERED
) -> LoadJob:
    return LoadJob(
        "c-req",
        ["k"] * len(DEST),
        COUNTS,
        layout.num_layers,
        spans(layout, DEST),
        lambda _: None,
        PeerSource("e", [address], offer, list(src_blocks)),
        list(DEST),
    )


@dataclass
class Held:
    offer: str
    outcome: list[str] = field(default_factory=list)
    released: trio.Event = field(default_factory=trio.Event)


async def hold(
    p: Peers, nursery: trio.Nursery, renew: Callable[[float], None] = lambda lease_s: None
) -> Held:
    """The producer holds blocks `OFFERED` under a fresh random offer id."""
    held = Held(new_offer_id())
    offer = Offer(held.offer, OFFERED, COUNTS, LAYERS, spans(p.prod, OFFERED), renew)

    async def run() -> None:
        held.outcome.append(await p.producer.offer(offer))
        held.released.set()

    nursery.start_soon(run)
    await trio.testing.wait_all_tasks_blocked()
    return held


async def honest_pull(p: Peers, held: Held) -> None:
    """An honest consumer pulls `held`: identical bytes, and the producer hands the
    blocks back on its word."""
    poison(p.cons)
    await p.consumer.load(load_job(p.cons, p.producer.address, held.offer))
    await held.released.wait()
    assert held.outcome == ["done"]
    assert bytes_of(p.cons, DEST) == bytes_of(p.prod, OFFERED), "the honest pull got other bytes"


def pull_frame(kind: str, offer: str, **kw: Any) -> bytes:
    if kind == "zmq":
        return zwire.encode(zwire.Pull(offer, **kw))
    return nwire.encode(nwire.Pull(offer, "attacker-agent", **kw))


def invalid_utf8(frame: bytes, text: str) -> bytes:
    """`frame` with the last character of `text` (a string in it) replaced by a byte that
    no UTF-8 string has."""
    enc = text.encode()
    assert frame.count(enc) == 1
    return frame.replace(enc, enc[:-1] + b"\x88")


def renew_frame(reqs: list[str], lease_ms: int, **kw: Any) -> bytes:
    return msgspec.msgpack.encode(Renew(reqs, lease_ms, **kw))


def renewed(channel: Channel, frame: Any, nonce: bytes = b"") -> Renewed:
    """A producer's answer to the renewal carrying `nonce`, checked and decoded."""
    payload = channel.open(frame, "consumer", answer_bind(nonce, 0))
    return msgspec.msgpack.decode(payload, type=Renewed)


async def probe_in_order(p: Peers, attacker: TrioSocket) -> None:
    """Renew an unknown offer from `attacker`: its answer must be the first message the
    socket gets (a ROUTER answers one connection in order), so nothing before it was
    answered."""
    probe, nonce = f"probe-{secrets.token_hex(4)}", secrets.token_bytes(16)
    await attacker.send_multipart(
        [p.channel.seal(renew_frame([probe], 1000, nonce=nonce), "producer")]
    )
    frames = await attacker.recv_multipart()
    answer = renewed(p.channel, frames[0], nonce)
    assert answer == Renewed({}, [probe]), f"an answer to an earlier frame: {answer}"


def minimal_geometry() -> dict[str, int]:
    return {"num_blocks": 1, "block_size": BS, "block_stride": 64}


# -- a hostile producer ---------------------------------------------------------


Answer = Callable[[str], list[list[bytes]]]
"""The hostile producer's messages (each a list of frames) for a pull of an offer id."""


async def against(
    consumer: Any,
    layout: KVLayout,
    router: TrioSocket,
    address: str,
    answer: Answer,
    *,
    kind: str = "zmq",
    channel: Channel | None = None,
) -> BaseException | None:
    """Run `consumer.load` against the hostile producer at `address` answering its pull
    with `answer` (the consumer's pull sealed for `channel`); return what the load raised
    (None if it returned)."""
    channel = channel or Channel()
    offer = new_offer_id()
    decode = zwire.decode_to_producer if kind == "zmq" else nwire.decode_to_producer

    async def hostile() -> None:
        while True:  # skip what earlier loads sent (their Failed)
            ident, *rest = await router.recv_multipart()
            try:
                msg = decode(channel.open(rest[0], "producer"))
            except BadFrame:
                continue
            if isinstance(msg, zwire.Pull | nwire.Pull) and msg.req == offer:
                break
        for frames in answer(offer):
            await router.send_multipart([ident, *frames])

    poison(layout)
    outcome: BaseException | None = None
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hostile)
            try:
                await consumer.load(load_job(layout, address, offer))
            except Exception as exc:
                outcome = exc
            nursery.cancel_scope.cancel()
    return outcome


def one(*frames: bytes) -> list[list[bytes]]:
    return [list(frames)]


def layer0(p: KVLayout) -> tuple[list[int], list[bytes]]:
    """What an honest producer sends for layer 0 of blocks `OFFERED`: sizes and data."""
    data = [bytes(s) for chunk in spans(p, OFFERED)(0) for s in chunk]
    return [len(d) for d in data], data


def layer_frame(offer: str, sizes: list[int], layer: int = 0) -> bytes:
    return zwire.encode(zwire.Layer(offer, layer, sizes))
