"""pyzmq sockets driven from trio, without threads or a zmq poller.

pyzmq has no trio integration. What works: sends and receives with `zmq.NOBLOCK`,
and on `zmq.Again` a wait for the socket's FD to become readable. That FD is
edge-triggered and signals *any* change of `zmq.EVENTS`, so the loop re-checks
`EVENTS` before every wait and never sleeps on an edge it already consumed. Every
use of a socket (a send, a receive, reading `EVENTS`, failed or not) may take that
edge: a socket that several tasks of one loop use (a producer's ROUTER: the receiving
loop, and the tasks answering pulls) says so with `TrioSocket.used()` after each, and
the task waiting on the FD looks again. Only one task may wait on a socket's FD;
never share a socket across threads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec
import trio
import zmq

from .runtime import Backoff

__all__ = ["BadFrame", "TrioSocket", "bind_loopback", "decode_frame", "shown"]

T = TypeVar("T")
BUSY_PEER_MIN_S = 1e-4
BUSY_PEER_MAX_S = 5e-3
ANSWER_BATCH = 64
"""`TrioSocket.answer_all` answers at most this many requests between checkpoints."""


def shown(text: str, limit: int = 200) -> str:
    """A peer's text as kvflow logs or raises it: its first `limit` characters, each one
    that is not printable (newlines, escapes, other control and separator characters)
    written as its Python escape, so a line of the log stays one line and says what the
    peer sent."""
    cut = text[:limit]
    if cut.isprintable():
        return cut
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in cut)


class BadFrame(ValueError):
    """A control frame from a peer that is too large or does not decode."""


def decode_frame(decoder: msgspec.msgpack.Decoder[T], data: bytes | memoryview, limit: int) -> T:
    """Decode a peer's msgspec control frame, refusing anything over `limit` bytes first."""
    if len(data) > limit:
        raise BadFrame(f"control frame of {len(data)} bytes exceeds {limit}")
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # bad UTF-8 is ValueError
        raise BadFrame(f"undecodable control frame: {shown(str(exc))}") from None


class TrioSocket:
    """A zmq socket whose sends and receives are trio checkpoints."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        self._waiting: set[trio.CancelScope] = set()

    async def wait(self, flag: int) -> None:
        """Until the socket can receive (`zmq.POLLIN`) or send (`zmq.POLLOUT`)."""
        while not (int(self.sock.getsockopt(zmq.EVENTS)) & flag):
            with trio.CancelScope() as scope:  # `used` cancels it: look again
                self._waiting.add(scope)
                try:
                    await trio.lowlevel.wait_readable(self.sock.FD)
                finally:
                    self._waiting.discard(scope)

    def used(self) -> None:
        """The socket was used (see the module text): a task in `wait` looks at its
        events again (a pull that arrived while another pull's answer was being sent
        went unseen until the next message)."""
        for scope in self._waiting:
            scope.cancel()

    def send_now(self, frames: Sequence[Any], *, copy: bool = True) -> None:
        """Send at once or raise (`zmq.Again`: no room; other `zmq.ZMQError`s)."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        finally:
            self.used()

    async def send_multipart(
        self, frames: Sequence[Any], *, copy: bool = True, track: bool = False
    ) -> zmq.MessageTracker | None:
        await trio.lowlevel.checkpoint_if_cancelled()
        backoff = Backoff(BUSY_PEER_MIN_S, BUSY_PEER_MAX_S)
        while True:
            try:
                return self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy, track=track)
            except zmq.Again:
                room = int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLOUT
            finally:
                self.used()
            if room:  # room, not for this peer (a ROUTER_MANDATORY peer whose pipe is
                await backoff.wait()  # full): no FD edge will say when; back off
            else:
                await self.wait(zmq.POLLOUT)

    async def recv_multipart(self, *, copy: bool = True) -> list[Any]:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                return self.sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                pass
            finally:
                self.used()
            await self.wait(zmq.POLLIN)

    async def answer_all(
        self, answer: Callable[[list[bytes]], list[bytes]], batch: int = ANSWER_BATCH
    ) -> None:
        """Answer every request on this REP socket with `answer(frames)` until cancelled.
        A request and its answer are one step (a cancel between them would leave the
        socket waiting to send, and refusing every later receive); a burst is answered
        `batch` at a time, a checkpoint between batches (a flood of requests never holds
        the loop). A socket found waiting to send (EFSM) sends an empty answer first."""
        sock = self.sock
        while True:
            await self.wait(zmq.POLLIN)
            for _ in range(batch):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EFSM:
                        raise
                    reply = [b""]  # to a request received, never answered
                else:
                    reply = answer(frames)
                with contextlib.suppress(zmq.Again):  # the asker's pipe is full: dropped
                    sock.send_multipart(reply, zmq.NOBLOCK)  # (next receive: EFSM, above)
            await trio.lowlevel.checkpoint()

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
