"""The HTTP/1.1 server of `kvflow proxy`: h11 speaks the protocol on trio, this module
holds the limits a server facing untrusted clients needs (decision 103).

h11 parses each request's line and headers, keeps a connection alive or closes it as
the client asked (HTTP/1.0 included), answers `Expect: 100-continue`, and frames every
answer (a length, or chunks while it streams). What h11 leaves to its user:

- framing stricter than h11's (RFC 9112 lets a server accept it; a front end in front of
  the proxy may read it otherwise, which smuggles a request): a body framed by exactly
  one `Content-Length` of ASCII digits within `max_body_bytes` (413 past it, unread);
  `Transfer-Encoding` 501 (400 with a `Content-Length` too); a malformed or folded header
  line 400: `_framing`, checked before h11 sees the head. h11 is given one request's
  bytes at a time, so no byte of a body is ever read as the next request;
- a request that reads no body (`GET`, a path without one) but has one: answered, then
  the connection closed;
- at most `max_clients` connections at once: one past it is answered 503 and closed;
- every wait on a client at most `client_timeout_s` (an idle connection is closed, a body
  that stops arriving answered 408), and every request whole within `request_timeout_s`
  of its first byte, however steadily it trickles (408);
- a client that goes away while its request is served (its connection closed, or not
  read for `client_timeout_s`) cancels the handler, and so the upstream call it makes.
"""

from __future__ import annotations

import contextlib
import http
import http.client
import io
import json
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from email.message import Message
from typing import Any

import h11
import trio

__all__ = ["ClientGone", "Limits", "Reply", "Request", "serve"]

log = logging.getLogger("kvflow.proxy")

MAX_HEAD_BYTES = 64 << 10
"""The longest request line and headers read (http.server's line bound)."""
LINGER_S = 1.0
"""How long a connection the proxy closes is drained first, so that bytes of the client's
left unread do not reset the answer before the client read it."""
_HEAD_END = re.compile(rb"\r?\n\r?\n")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int
    client_timeout_s: float
    request_timeout_s: float
    max_clients: int


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: bytes
    """Read only for a `POST` to one of the server's `body_paths`, else empty."""


class ClientGone(Exception):
    """The client closed its connection, or read nothing for `client_timeout_s`."""


class _RequestDeadline(Exception):
    """A request still arriving at `request_timeout_s`."""


class _ClientSilent(Exception):
    """No byte from the client for `client_timeout_s`."""


Handler = Callable[[Request, "Reply"], Awaitable[None]]


class Reply:
    """The answer to one request: whole (`json`, `whole`) or streamed (`start`, `send`,
    `end`)."""

    def __init__(self, conn: _Connection, method: str, close: bool) -> None:
        self._conn = conn
        self._head_only = method == "HEAD"
        self.close = close
        """The connection closes after this answer (a body left unread)."""
        self.started = self.finished = False

    async def json(self, code: int, payload: dict[str, Any], close: bool = False) -> None:
        await self.whole(code, json.dumps(payload).encode(), "application/json", close)

    async def whole(self, code: int, data: bytes, kind: str, close: bool = False) -> None:
        await self.start(code, kind, len(data), close)
        await self.send(data)
        await self.end()

    async def start(
        self, code: int, kind: str, length: int | None = None, close: bool = False
    ) -> None:
        """The status and headers; no `length`: the body follows in chunks."""
        self.close = self.close or close
        headers = [("Content-Type", kind)]
        if length is not None:
            headers.append(("Content-Length", str(length)))
        if self.close:
            headers.append(("Connection", "close"))
        self.started = True
        head = h11.Response(status_code=code, headers=headers, reason=_phrase(code))
        await self._conn.write(head)

    async def send(self, data: bytes) -> None:
        if data and not self._head_only:
            await self._conn.write(h11.Data(data=data))

    async def end(self) -> None:
        await self._conn.write(h11.EndOfMessage())
        self.finished = True


async def serve(
    sock: socket.socket,
    handler: Handler,
    limits: Limits,
    body_paths: Collection[str],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP/1.1 on the listening `sock` until cancelled: `handler` answers each
    request (a `POST` to one of `body_paths` with its body read)."""
    server = _Server(handler, limits, frozenset(body_paths))
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, server.connection, [listener])
        task_status.started()


class _Server:
    def __init__(self, handler: Handler, limits: Limits, body_paths: frozenset[str]) -> None:
        self.handler, self.limits, self.body_paths = handler, limits, body_paths
        self.clients = 0
        self._refused = 0
        self._warned = -1e9

    async def connection(self, stream: trio.SocketStream) -> None:
        if self.clients >= self.limits.max_clients:
            await self._refuse(stream)
            return
        self.clients += 1
        try:
            await _Connection(self, stream).serve()
        except Exception:  # a bug of ours: this client's connection, not the proxy
            log.exception("kvflow proxy: a client's connection failed")
        finally:
            self.clients -= 1  # before the close: a client that sees it finds the slot
            await _close(stream)

    async def _refuse(self, stream: trio.SocketStream) -> None:
        clients = f"{self.limits.max_clients} clients (--max-clients)"
        error = f"the proxy is serving {clients}: retry later"
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            with trio.move_on_after(LINGER_S):
                await stream.send_all(_raw_answer(503, error, "Retry-After: 1\r\n"))
        await _close(stream)
        self._refused += 1
        now = time.monotonic()
        if now - self._warned >= 10:  # a flood of refusals is a line every 10 s
            log.warning("kvflow proxy: %d client(s) refused 503 (--max-clients)", self._refused)
            self._warned, self._refused = now, 0


class _Connection:
    def __init__(self, server: _Server, stream: trio.SocketStream) -> None:
        self.server, self.stream, self.limits = server, stream, server.limits
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.buf = bytearray()
        """Bytes read from the client and not yet given to h11 (the next request's)."""
        self.deadline: float | None = None
        """When the request being read must have arrived whole (from its first byte)."""

    async def serve(self) -> None:
        """Requests until one closes the connection or the client goes silent or away."""
        with contextlib.suppress(ClientGone, _ClientSilent):
            try:
                while await self._one():
                    self.h11.start_next_cycle()
            except _RequestDeadline:
                limit = f"{self.limits.request_timeout_s:g} s (--request-timeout-s)"
                error = f"the request did not arrive within {limit}"
                await self.write_raw(_raw_answer(408, error))

    async def _one(self) -> bool:
        """Read, check and answer one request; whether the connection stays open."""
        head = await self._head()
        if head is None:
            return False
        fields = head.partition(b"\n")[2]
        try:
            headers = http.client.parse_headers(io.BytesIO(fields))
        except http.client.HTTPException as exc:  # over 100 header lines, one over 64 KiB
            await self.write_raw(_raw_answer(431, f"request headers too large ({exc})"))
            return False
        framing = _framing(headers, self.limits.max_body_bytes)
        if not isinstance(framing, int):
            await self.write_raw(_raw_answer(*framing))
            return False
        self.h11.receive_data(head)
        try:
            request = self.h11.next_event()
        except h11.RemoteProtocolError as exc:
            await self.write_raw(_raw_answer(exc.error_status_hint, f"a malformed request ({exc})"))
            return False
        if not isinstance(request, h11.Request):  # bytes of a request line that h11 skips
            await self.write_raw(_raw_answer(400, "a malformed request line"))
            return False
        method = request.method.decode("ascii", "replace")
        path = request.target.decode("ascii", "replace")
        reads = method == "POST" and path in self.server.body_paths
        body: bytes | None = b""
        if reads and framing:
            body = await self._body(framing)
        if body is None:
            return False
        unread = framing > 0 and not reads
        if not unread:
            self._through_h11(body)
        reply = Reply(self, method, close=unread)
        if not await self._handle(Request(method, path, body), reply):
            return False
        return not reply.close and self.h11.our_state is h11.DONE

    def _through_h11(self, body: bytes) -> None:
        """Give h11 the body already read, a slice at a time (its events unkept: the body
        is `body`), to the request's end."""

        def drain() -> bool:  # whether the request ended
            while (event := self.h11.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
                if isinstance(event, h11.EndOfMessage):
                    return True
            return False

        view = memoryview(body)
        for at in range(0, len(body), 1 << 16):  # (no bytes: the client's stream ended)
            if drain():
                return
            self.h11.receive_data(bytes(view[at : at + (1 << 16)]))
        drain()

    async def _head(self) -> bytes | None:
        """One request's line and headers (None: the client left, or went idle, between
        requests); from its first byte, within `request_timeout_s`."""
        self.deadline = None
        skipped = scanned = 0
        while True:
            if self.buf and self.deadline is None:  # from its first byte, an empty line's too
                self.deadline = trio.current_time() + self.limits.request_timeout_s
            if not scanned and (empty := len(self.buf) - len(self.buf.lstrip(b"\r\n"))):
                del self.buf[:empty]  # empty lines before a request: RFC 9112 2.2
                skipped += empty
            found = _HEAD_END.search(self.buf, max(0, scanned - 3), MAX_HEAD_BYTES + 4)
            if found:
                head = bytes(self.buf[: found.end()])
                del self.buf[: found.end()]
                return head
            scanned = len(self.buf)  # the next search starts where this one ended
            if scanned + skipped > MAX_HEAD_BYTES:
                await self.write_raw(_raw_answer(431, "a request head over 64 KiB"))
                return None
            if not await self._fill(self.deadline):
                return None

    async def _body(self, length: int) -> bytes | None:
        """`length` bytes of body (None: the client was answered 408, or left)."""
        if self.h11.they_are_waiting_for_100_continue:
            await self.write(h11.InformationalResponse(status_code=100, headers=[]))
        try:
            while len(self.buf) < length:
                if not await self._fill(self.deadline):
                    return None
        except _ClientSilent:
            limit = f"{self.limits.client_timeout_s:g} s (--client-timeout-s)"
            await self.write_raw(_raw_answer(408, f"the body did not arrive within {limit}"))
            return None
        body = bytes(self.buf[:length])
        del self.buf[:length]
        return body

    async def _fill(self, deadline: float | None) -> bool:
        """More of the client's bytes into `buf`; False at the end of its stream."""
        wait = self.limits.client_timeout_s
        if deadline is not None:
            left = deadline - trio.current_time()
            if left <= 0:
                raise _RequestDeadline
            wait = min(wait, left)
        with trio.move_on_after(wait):
            try:
                data = await self.stream.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
            self.buf += data
            return bool(data)
        if deadline is not None and trio.current_time() >= deadline:
            raise _RequestDeadline
        raise _ClientSilent

    async def _handle(self, request: Request, reply: Reply) -> bool:
        """Run the handler, cancelled if the client goes away meanwhile; whether the
        answer went out whole."""
        gone = False

        async def watch(scope: trio.CancelScope) -> None:
            nonlocal gone
            while len(self.buf) <= MAX_HEAD_BYTES:  # a pipelined request: kept for later
                try:
                    data = await self.stream.receive_some(1 << 16)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    gone = True
                    scope.cancel()
                    return
                self.buf += data
            await trio.sleep_forever()

        failed = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            try:  # caught here: the nursery would wrap them in a group
                await self.server.handler(request, reply)
            except ClientGone:
                gone = True
            except Exception:
                log.exception("kvflow proxy: %s %s failed", request.method, request.path[:200])
                failed = True
            finally:
                nursery.cancel_scope.cancel()
        if failed:
            if not reply.started:
                await self.write_raw(_raw_answer(500, "the proxy failed (its log says why)"))
            return False
        if gone:
            log.info("kvflow proxy: client went away; its upstream request aborted")
        return not gone and reply.finished

    async def write(self, event: Any) -> None:
        await self.write_raw(self.h11.send(event) or b"")

    async def write_raw(self, data: bytes) -> None:
        """Send `data`, within `client_timeout_s` (`ClientGone` otherwise)."""
        with trio.move_on_after(self.limits.client_timeout_s):
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ClientGone from exc
            return
        raise ClientGone


def _raw_answer(code: int, error: str, extra: str = "") -> bytes:
    """A whole JSON error answer that closes its connection, outside h11 (which refuses
    to answer a request it could not parse)."""
    data = json.dumps({"error": error}).encode()
    return (
        f"HTTP/1.1 {code} {_phrase(code)}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n{extra}Connection: close\r\n\r\n"
    ).encode() + data


def _phrase(code: int) -> str:
    try:
        return http.HTTPStatus(code).phrase
    except ValueError:
        return ""


async def _close(stream: trio.SocketStream) -> None:
    """Close after at most `LINGER_S` of reading what the client still sends (unread, it
    would reset the connection and the answer with it)."""
    with trio.move_on_after(LINGER_S), contextlib.suppress(Exception):
        await stream.send_eof()
        while await stream.receive_some(1 << 16):
            pass
    with trio.CancelScope(shield=True):
        await stream.aclose()


def _framing(headers: Message, max_body_bytes: int) -> int | tuple[int, str]:
    """The length of a request's body, or the status and error that refuse the request:
    one `Content-Length` of ASCII digits (RFC 9112 6.3; Python's int() would also read
    '0_2', '+2', Unicode digits and spaces) within `max_body_bytes`, no
    `Transfer-Encoding`, no header line the parser dropped or folded."""
    if headers.defects:  # a line with whitespace before its colon, or none: it and the rest dropped
        return 400, "a malformed header line (RFC 9112 5.1)"
    if any("\n" in value for value in headers.values()):
        return 400, "a folded header line (obs-fold, RFC 9112 5.2)"
    lengths = headers.get_all("Content-Length") or []
    if headers.get_all("Transfer-Encoding"):
        if lengths:
            return 400, "a request with both Transfer-Encoding and Content-Length (RFC 9112 6.3)"
        return 501, "Transfer-Encoding is not supported: send one Content-Length"
    if not lengths:
        return 0
    if len(lengths) > 1:
        return 400, f"one Content-Length header, not {len(lengths)}"
    declared = lengths[0].strip(" \t")
    if not (declared.isascii() and declared.isdigit()):
        return 400, f"Content-Length {lengths[0][:40]!r} is not a byte count"
    digits = declared.lstrip("0") or "0"
    if len(digits) > len(str(max_body_bytes)) or int(digits) > max_body_bytes:
        shown = digits if len(digits) <= 40 else f"{digits[:40]}..."
        limit = f"at most {max_body_bytes} (--max-body-bytes)"
        return 413, f"a body of {shown} bytes: this proxy reads {limit}"
    return int(digits)
