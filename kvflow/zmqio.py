"""pyzmq sockets driven from trio, without threads or a zmq poller.

pyzmq has no trio integration. What works: one trio task owns each socket; it
sends and receives with `zmq.NOBLOCK`, and on `zmq.Again` waits for the
socket's FD to become readable. That FD is edge-triggered and signals *any*
change of `zmq.EVENTS`, so the loop re-checks `EVENTS` before every wait and
never sleeps on an edge it already consumed. Never share a socket across tasks
or threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
import trio
import zmq

from .runtime import Backoff

__all__ = ["BadFrame", "TrioSocket", "bind_loopback", "decode_frame"]

T = TypeVar("T")
BUSY_PEER_MIN_S = 1e-4
BUSY_PEER_MAX_S = 5e-3


class BadFrame(ValueError):
    """A control frame from a peer that is too large or does not decode."""


def decode_frame(decoder: msgspec.msgpack.Decoder[T], data: bytes | memoryview, limit: int) -> T:
    """Decode a peer's msgspec control frame, refusing anything over `limit` bytes first."""
    if len(data) > limit:
        raise BadFrame(f"control frame of {len(data)} bytes exceeds {limit}")
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # bad UTF-8 is ValueError
        raise BadFrame(f"undecodable control frame: {str(exc)[:200]}") from None


class TrioSocket:
    """A zmq socket whose sends and receives are trio checkpoints."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock

    async def _ready(self, flag: int) -> None:
        while not (int(self.sock.getsockopt(zmq.EVENTS)) & flag):
            await trio.lowlevel.wait_readable(self.sock.FD)

    async def send_multipart(
        self, frames: Sequence[Any], *, copy: bool = True, track: bool = False
    ) -> zmq.MessageTracker | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        backoff = Backoff(BUSY_PEER_MIN_S, BUSY_PEER_MAX_S)
        while True:
            try:
                return self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy, track=track)
            except zmq.Again:
                if int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT:
                    # The socket has room, not for this peer (a ROUTER_MANDATORY peer
                    # whose pipe is full): no FD edge will say when; back off.
                    await backoff.wait()
                else:
                    await self._ready(zmq.POLLOUT)

    async def recv_multipart(self, *, copy: bool = True) -> list[Any]:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                return self.sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                await self._ready(zmq.POLLIN)

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger=linger_ms)


def bind_loopback(sock: zmq.Socket[Any], host: str = "127.0.0.1", port: int = 0) -> str:
    """Bind `sock` on `host:port` (0: a free ephemeral port) and return the real endpoint.

    A taken fixed port is an error that names it, never a silent clash.
    """
    try:
        if port:
            sock.bind(f"tcp://{host}:{port}")
            return f"tcp://{host}:{port}"
        sock.bind(f"tcp://{host}:*")
    except zmq.ZMQError as exc:
        raise OSError(f"cannot bind tcp://{host}:{port or '*'}: {exc}") from None
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
