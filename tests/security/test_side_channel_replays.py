"""Issue 46's replays on a keyed `kv-in-clear` side channel, whose bytes an on-path
attacker reads: a PLAIN handshake sniffed off the wire and replayed (the credential is
one-time), an honest consumer whose connection drops and reconnects with its spent
credential, a sealed frame sent back the way it came, and a producer's answers to one
pull replayed into a later pull of the same offer (each answer is bound to its pull and
its place in it). Real sockets, a real TCP relay that records what crosses it
(tests/support/side_channel_attacks.py).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing
import zmq

from kvflow.pd.security import PLAIN_WINDOW_S, Channel
from kvflow.transport import ChunkCorrupt, TransportError
from kvflow_zmq import _wire as zwire

from ..support.side_channel_attacks import (
    DEST,
    HANDSHAKE_FAILED,
    HANG_GUARD_S,
    KINDS,
    LAYERS,
    OFFERED,
    Peers,
    bytes_of,
    dealer,
    hold,
    honest_pull,
    hostile_router,
    load_job,
    peers,
    poison,
    renew_frame,
    until_event,
    untouched,
)

READY = b"\x05READY"
"""ZMTP 3's READY command (a length byte and its name): the server's last handshake word."""
HELLO = b"\x05HELLO"


@dataclass
class Link:
    """One connection through the relay: what each side sent."""

    up: bytearray = field(default_factory=bytearray)
    """consumer -> producer"""
    down: bytearray = field(default_factory=bytearray)
    """producer -> consumer"""
    cut: trio.Event = field(default_factory=trio.Event)


class Relay:
    """A TCP relay in front of a producer, an on-path attacker's view of the wire: it
    records every byte of each connection, and can cut the first connection once its
    handshake is done (at the consumer's first message, which it drops)."""

    def __init__(self, port: int, *, cut_first: bool = False) -> None:
        self.port = port
        self.cut_first = cut_first
        self.links: list[Link] = []
        self.address = ""

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.address = f"tcp://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        task_status.started()
        await trio.serve_listeners(self._link, listeners)

    async def _link(self, client: trio.SocketStream) -> None:
        link = Link()
        self.links.append(link)
        cut = self.cut_first and len(self.links) == 1
        server = await trio.open_tcp_stream("127.0.0.1", self.port)
        async with client, server, trio.open_nursery() as nursery:

            async def pump(src: trio.SocketStream, dst: trio.SocketStream, into: bytearray) -> None:
                async for data in src:
                    if cut and into is link.up and READY in link.down:
                        link.cut.set()  # the handshake is done: drop this and the link
                        nursery.cancel_scope.cancel()
                        return
                    into += data
                    await dst.send_all(data)
                nursery.cancel_scope.cancel()

            nursery.start_soon(pump, client, server, link.up)
            nursery.start_soon(pump, server, client, link.down)


def sniffed_plain(stream: bytes) -> tuple[bytes, bytes]:
    """The PLAIN user name and password of the ZMTP HELLO command in a consumer's bytes,
    as a sniffer reads them (RFC 24: name length, name, password length, password)."""
    at = stream.index(HELLO) + len(HELLO)
    n = stream[at]
    user = stream[at + 1 : at + 1 + n]
    m = stream[at + 1 + n]
    return user, stream[at + 2 + n : at + 2 + n + m]


async def pull_via(p: Peers, address: str, offer: str) -> None:
    """The consumer pulls `offer` from `address`: identical bytes must land."""
    poison(p.cons)
    await p.consumer.load(load_job(p.cons, address, offer))
    assert bytes_of(p.cons, DEST) == bytes_of(p.prod, OFFERED), "other bytes landed"


async def serving(p: Peers, test: Callable[[trio.Nursery], Awaitable[None]]) -> None:
    with trio.fail_after(HANG_GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(p.producer.serve)
            await test(nursery)
            nursery.cancel_scope.cancel()


# -- 1. the handshake -----------------------------------------------------------------


async def test_a_sniffed_plain_handshake_cannot_be_replayed(zctx: zmq.Context[Any]) -> None:
    """Issue 46, M1: a PLAIN handshake carries its credential in the clear, and the
    credential was one fixed password: whoever sniffed one connection passed every
    producer's handshake, and could send the one unbounded multipart message (libzmq takes
    it all in before kvflow sees it) that only the handshake keeps out. The credential is
    now one-time: an attacker who read an honest consumer's handshake off the wire and
    replays it fails the handshake (counted `unauthenticated`), its 96 MiB message
    never reaches the producer, and honest pulls go on."""
    async with peers("zmq", Channel(os.urandom(32), "kv-in-clear")) as p:

        async def test(nursery: trio.Nursery) -> None:
            relay = Relay(int(p.producer.address.rsplit(":", 1)[1]))
            await nursery.start(relay.run)
            held = await hold(p, nursery)
            await pull_via(p, relay.address, held.offer)  # sniffed on its way
            await held.released.wait()
            user, password = sniffed_plain(bytes(relay.links[0].up))
            assert user and password, "no PLAIN handshake crossed the relay"

            replayer, events = dealer(
                zctx, p.producer.address, PLAIN_USERNAME=user, PLAIN_PASSWORD=password
            )
            part = bytes(p.producer.max_frame_bytes)
            await replayer.send_multipart([part] * 96, copy=False)
            got = await until_event(events, HANDSHAKE_FAILED | {zmq.EVENT_HANDSHAKE_SUCCEEDED})
            assert got[-1] != zmq.EVENT_HANDSHAKE_SUCCEEDED, "a replayed handshake passed"
            await p.seen.reach("unauthenticated", 1)
            await honest_pull(p, await hold(p, nursery))

        await serving(p, test)
    assert p.seen.count("frame") == 0, "the replayer's message reached the producer"
    assert {r for r, _ in p.seen.log} == {"unauthenticated"}


def test_a_credential_passes_once_and_only_within_its_window(zctx: zmq.Context[Any]) -> None:
    """The producer's side of the one-time credential (`ZapSocket.first_use`, its MAC
    already checked): it passes once; again, stale, from too far ahead or malformed, it
    fails; it is forgotten only once its window has passed (memory stays bounded)."""
    zap = Channel(os.urandom(32), "kv-in-clear").zap_socket(zctx)
    assert zap is not None
    now = 1_800_000_000.0

    def user(at: float) -> bytes:
        return b"kvflow:%s:%d" % (os.urandom(16).hex().encode(), int(at * 1000))

    first = user(now)
    assert zap.first_use(first, now)
    assert not zap.first_use(first, now + 1), "a credential passed twice"
    assert not zap.first_use(user(now - PLAIN_WINDOW_S - 1), now), "a stale one passed"
    assert not zap.first_use(user(now + PLAIN_WINDOW_S + 1), now), "one from ahead passed"
    assert not zap.first_use(b"kvflow", now) and not zap.first_use(b"kvflow:x:1", now)
    assert not zap.first_use(first, now + PLAIN_WINDOW_S - 1) and first in zap.seen
    later = now + PLAIN_WINDOW_S + 1
    assert zap.first_use(user(later), later) and first not in zap.seen
    zap.close()


async def test_a_consumer_that_reconnects_fails_into_a_recompute(zctx: zmq.Context[Any]) -> None:
    """The one-time credential's cost: libzmq reconnects a dropped connection with the
    credential it was given, which the producer has seen, so the reconnection fails its
    handshake (counted). A reconnection could not have saved that pull anyway: what was
    in flight on the dropped connection is lost, and the producer answers the
    connection that asked. The consumer's load fails after `progress_timeout_s`, a
    transport error (vLLM recomputes the prompt); the offer, which the dropped pull never
    reached, is pulled whole by the next pull."""
    async with peers("zmq", Channel(os.urandom(32), "kv-in-clear")) as p:
        p.consumer.context.progress_timeout_s = 0.5  # how long the load waits for a word

        async def test(nursery: trio.Nursery) -> None:
            relay = Relay(int(p.producer.address.rsplit(":", 1)[1]), cut_first=True)
            await nursery.start(relay.run)
            held = await hold(p, nursery)
            poison(p.cons)
            with pytest.raises(TransportError, match=r"sent nothing for 0\.5s"):
                await p.consumer.load(load_job(p.cons, relay.address, held.offer))
            assert relay.links[0].cut.is_set(), "the relay did not cut the connection"
            assert len(relay.links) >= 2, "the consumer did not reconnect"
            assert untouched(p.cons)
            await p.seen.reach("unauthenticated", 1)  # the reconnection, refused
            sniffed = [sniffed_plain(bytes(link.up)) for link in relay.links if HELLO in link.up]
            assert len(set(sniffed)) == 1, "a reconnection used another credential"
            assert held.offer in p.producer.held
            await honest_pull(p, held)

        await serving(p, test)
    assert {r for r, _ in p.seen.log} == {"unauthenticated"}


# -- 2. frames sent back, or across pulls ---------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_a_frame_sent_back_the_way_it_came_fails_its_mac(
    kind: str, zctx: zmq.Context[Any]
) -> None:
    """Issue 46 (Low): a sealed frame's MAC did not say which way it went. Each direction
    now has its own MAC key: a producer's sealed answer sent to a producer, and a
    consumer's sealed pull sent back to the consumer as its answer, fail their MAC
    (`unauthenticated`, a corrupt load) before anything decodes them."""
    channel = Channel(os.urandom(32), "kv-in-clear")
    async with peers(kind, channel) as p:

        async def test(nursery: trio.Nursery) -> None:
            held = await hold(p, nursery)
            peer, _ = dealer(zctx, p.producer.address, channel=channel)  # it has the key
            renew = renew_frame([held.offer], 1000, nonce=os.urandom(16))
            await peer.send_multipart([channel.seal(renew, "producer")])
            (answer,) = await peer.recv_multipart()  # a producer's sealed frame
            await peer.send_multipart([answer])  # sent back to a producer
            (refused,) = await p.seen.total(1)
            assert refused[0] == "unauthenticated", f"a frame sent back was decoded: {refused}"

            router, address = hostile_router(zctx, channel)
            reflected: list[bytes] = []

            async def reflect() -> None:  # answers the pull with the pull itself
                ident, pull = await router.recv_multipart()
                reflected.append(pull)
                await router.send_multipart([ident, pull])

            nursery.start_soon(reflect)
            poison(p.cons)
            with pytest.raises(ChunkCorrupt, match="MAC"):
                await p.consumer.load(load_job(p.cons, address, held.offer))
            assert reflected and untouched(p.cons)
            await honest_pull(p, held)

        await serving(p, test)


async def test_a_producers_answers_replayed_into_a_later_pull_fail_their_mac(
    zctx: zmq.Context[Any],
) -> None:
    """Issue 46 (Low): the answers of a pull (each layer's sealed header, its data after
    it) were sealed the same for every pull of an offer. An on-path attacker who recorded
    one pull replays its answers into a later pull of the same offer (a consumer pulling
    again, another rank of the consumer): before, the consumer took them as the
    producer's. Each answer is now bound to its pull's nonce and its place: the replay
    fails its MAC, and not a byte lands."""
    channel = Channel(os.urandom(32), "kv-in-clear")
    async with peers("zmq", channel) as p:

        async def test(nursery: trio.Nursery) -> None:
            held = await hold(p, nursery)
            router, address = hostile_router(zctx, channel)
            upstream, _ = dealer(zctx, p.producer.address, channel=channel)
            recorded: list[list[bytes]] = []

            async def on_path() -> None:
                ident, pull = await router.recv_multipart()  # the first pull: relayed
                await upstream.send_multipart([pull])
                for _ in range(LAYERS):
                    frames = await upstream.recv_multipart()
                    recorded.append(frames)
                    await router.send_multipart([ident, *frames])
                ident, done = await router.recv_multipart()
                await upstream.send_multipart([done])
                while True:  # the later pulls: answered with the first one's answers
                    ident, pull = await router.recv_multipart()
                    msg = zwire.decode_to_producer(channel.open(pull, "producer"))
                    if isinstance(msg, zwire.Pull):
                        for frames in recorded:
                            await router.send_multipart([ident, *frames])

            nursery.start_soon(on_path)
            await pull_via(p, address, held.offer)
            await held.released.wait()
            assert held.outcome == ["done"] and len(recorded) == LAYERS
            poison(p.cons)
            with pytest.raises(ChunkCorrupt, match="MAC"):
                await p.consumer.load(load_job(p.cons, address, held.offer))
            assert untouched(p.cons), "a replayed answer landed"
            await honest_pull(p, await hold(p, nursery))

        await serving(p, test)
