"""A consumer's renewals at a producer share one connection (issue 49: a keyed
connection's handshake, checked by the producer's ZAP handler, cost each claim's first
answer some milliseconds), and a kept connection that lost its producer is replaced."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import trio
import zmq

from kvflow.pd.security import Channel
from kvflow.transport import Renewed

from ..support.side_channel_attacks import HANG_GUARD_S, hold, honest_pull, peers


async def test_a_consumers_renewals_at_one_producer_share_one_connection() -> None:
    channel = Channel(os.urandom(32), "kv-in-clear")
    async with peers("zmq", channel) as p:
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(p.producer.serve)
                held = await hold(p, nursery)
                for _ in range(3):
                    answer = await p.consumer.renew(p.producer.address, [held.offer], 60.0)
                    assert answer == Renewed({}, [])
                handshakes = len(p.producer._zap.seen)  # one-time credentials it accepted
                assert handshakes == 1, f"{handshakes} connections for 3 renewals"
                await honest_pull(p, held)  # a pull is a connection of its own
                nursery.cancel_scope.cancel()


@dataclass
class _Relay:
    """A TCP relay to a producer: a network between the consumer and it, which `cut`
    breaks (every connection through it drops; new ones pass)."""

    address: str = ""
    scopes: list[trio.CancelScope] = field(default_factory=list)

    def cut(self) -> None:
        for scope in self.scopes:
            scope.cancel()


async def _pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    try:
        async for data in src:
            await dst.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def _relay(target: str, *, task_status: trio.TaskStatus[_Relay]) -> None:
    host, port = target.removeprefix("tcp://").rsplit(":", 1)
    relay = _Relay()

    async def carry(client: trio.SocketStream) -> None:
        with trio.CancelScope() as scope:
            relay.scopes.append(scope)
            server = await trio.open_tcp_stream(host, int(port))
            async with client, server, trio.open_nursery() as both:
                both.start_soon(_pump, client, server)
                both.start_soon(_pump, server, client)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    relay.address = f"tcp://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    task_status.started(relay)
    await trio.serve_listeners(carry, listeners)


async def test_a_kept_connection_that_lost_its_producer_is_replaced() -> None:
    """The connection drops (the network between them breaks) and the kept socket's
    reconnection offers its one-time credential again, which the producer refuses as a
    replay: the next renewal sees it unconnected and goes over a new connection."""
    channel = Channel(os.urandom(32), "kv-in-clear")
    async with peers("zmq", channel) as p:
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(p.producer.serve)
                relay: _Relay = await nursery.start(_relay, p.producer.address)
                held = await hold(p, nursery)
                assert await p.consumer.renew(relay.address, [held.offer], 60.0) == Renewed({}, [])
                kept = p.consumer._dealers._idle[relay.address]
                relay.cut()
                while kept.sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:  # until it saw the drop
                    await trio.sleep(0.01)
                assert await p.consumer.renew(relay.address, [held.offer], 60.0) == Renewed({}, [])
                assert len(p.producer._zap.seen) == 2  # the first connection's, a new one's
                nursery.cancel_scope.cancel()
