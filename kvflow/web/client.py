"""`kvflow proxy`'s calls to its servers: HTTP/1.1 on trio with h11, connections kept
alive per server (decision 103).

A connection whose answer was read to its end goes back to its server's idle stack (at
most `KEPT` a server, the newest taken first); one idle for `IDLE_S` or more, or that
the server closed (readable while idle), is dropped when next taken. A request whose
kept connection was closed or reset before any byte of an answer came back is sent once
more, on a new connection (the server had closed it as it was taken); a timeout is
never retried. An answer closed before its end closes its connection: the server sees
its client gone (vLLM aborts the request). Every wait (connect, each read, each write)
is at most the request's timeout (the client's `timeout_s` by default).
"""

from __future__ import annotations

import ssl
import urllib.parse
from typing import Any

import h11
import trio

__all__ = ["Answer", "Client", "UpstreamError"]

IDLE_S = 4.0
"""How long a kept connection may have been idle and still be used (under uvicorn's 5 s
keep-alive, vLLM's server's)."""
KEPT = 64
"""Idle connections kept per server."""
MAX_HEAD_BYTES = 64 << 10
_FAILED = (OSError, trio.BrokenResourceError, trio.TooSlowError, h11.ProtocolError)
"""What a call to a server raises when the server cannot be reached or breaks off."""


class UpstreamError(Exception):
    """A server that could not be reached, or whose answer broke off; `reason` is what
    went wrong, with no address in it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Connection:
    def __init__(self, stream: trio.abc.Stream, origin: tuple[str, str, int]) -> None:
        self.stream, self.origin = stream, origin
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.idle_since = 0.0
        self.answered = False
        """Bytes of an answer came back on it (a failure after that is not retried)."""

    def readable(self) -> bool:
        """Whether the server closed it (or sent what no request asked for) while idle."""
        sock = getattr(self.stream, "socket", None) or getattr(
            getattr(self.stream, "transport_stream", None), "socket", None
        )
        return sock is None or bool(sock.is_readable())

    async def send(self, event: Any, timeout_s: float) -> None:
        with trio.fail_after(timeout_s):
            await self.stream.send_all(self.h11.send(event) or b"")

    async def next_event(self, timeout_s: float) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            with trio.fail_after(timeout_s):
                data = await self.stream.receive_some(1 << 16)
            self.answered = self.answered or bool(data)
            self.h11.receive_data(bytes(data))


class Answer:
    """A server's answer, its body to read (`next_chunk`, `read`) or to close (`aclose`:
    closed even in a cancelled scope, `trio.aclose_forcefully`)."""

    def __init__(
        self, client: Client, conn: _Connection, head: h11.Response, timeout_s: float
    ) -> None:
        self._client, self._conn, self._timeout_s = client, conn, timeout_s
        self.status = head.status_code
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
        self._done = False

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    async def next_chunk(self) -> bytes:
        """The body's next bytes as they come, b"" at its end (`UpstreamError` if it
        breaks off)."""
        if self._done:
            return b""
        try:
            while True:
                event = await self._conn.next_event(self._timeout_s)
                if isinstance(event, h11.Data) and event.data:
                    return bytes(event.data)
                if isinstance(event, h11.EndOfMessage):
                    self._done = True
                    await self._client._release(self._conn)
                    return b""
        except _FAILED as exc:
            await self.aclose()
            raise UpstreamError(_reason(exc)) from exc

    async def read(self, limit: int) -> bytes:
        """The whole body, at most `limit` bytes (`UpstreamError` past it)."""
        body = bytearray()
        while chunk := await self.next_chunk():
            body += chunk
            if len(body) > limit:
                await self.aclose()
                raise UpstreamError(f"an answer over {limit} bytes")
        return bytes(body)

    async def aclose(self) -> None:
        """Done with it: an answer not read to its end closes its connection."""
        if not self._done:
            self._done = True
            await trio.aclose_forcefully(self._conn.stream)

    async def __aenter__(self) -> Answer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Client:
    def __init__(self, timeout_s: float, kept: int = KEPT) -> None:
        self.timeout_s, self.kept = timeout_s, kept
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def request(
        self, method: str, url: str, body: bytes = b"", timeout_s: float | None = None
    ) -> Answer:
        """Send a request (a JSON `body` for a POST): the server's answer, its body not yet
        read; `UpstreamError` if the server could not be reached or did not answer."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        origin, target = _split(url)
        host = f"[{origin[1]}]" if ":" in origin[1] else origin[1]  # an IPv6 address
        headers = [("Host", f"{host}:{origin[2]}")]
        if method == "POST":
            headers += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        for attempt in range(2):
            conn, kept = await self._take(origin, wait, fresh=attempt > 0)
            try:
                await conn.send(h11.Request(method=method, target=target, headers=headers), wait)
                if body:
                    await conn.send(h11.Data(data=body), wait)
                await conn.send(h11.EndOfMessage(), wait)
                while isinstance(head := await conn.next_event(wait), h11.InformationalResponse):
                    pass
                if isinstance(head, h11.Response):
                    return Answer(self, conn, head, wait)
                raise h11.RemoteProtocolError("the connection closed before an answer")
            except _FAILED as exc:
                await trio.aclose_forcefully(conn.stream)
                closed = not isinstance(exc, trio.TooSlowError)  # a slow server is not retried
                if kept and closed and not conn.answered and attempt == 0:
                    continue  # the server closed it as it was taken: once more, on a new one
                raise UpstreamError(_reason(exc)) from exc
            except BaseException:  # cancelled (the client gone): the server sees it too
                await trio.aclose_forcefully(conn.stream)
                raise
        raise UpstreamError("a new connection failed")  # (not reached: a new one is not retried)

    async def post(self, url: str, body: bytes, timeout_s: float | None = None) -> Answer:
        return await self.request("POST", url, body, timeout_s)

    async def get(self, url: str, timeout_s: float | None = None) -> Answer:
        return await self.request("GET", url, b"", timeout_s)

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                await trio.aclose_forcefully(conn.stream)
        self._idle.clear()

    async def _take(
        self, origin: tuple[str, str, int], timeout_s: float, fresh: bool = False
    ) -> tuple[_Connection, bool]:
        """A kept connection to `origin` (True), or a new one (False; always if `fresh`)."""
        idle = self._idle.get(origin, [])
        now = trio.current_time()
        while idle and not fresh:
            conn = idle.pop()
            if now - conn.idle_since < IDLE_S and not conn.readable():
                return conn, True
            await trio.aclose_forcefully(conn.stream)
        scheme, host, port = origin
        try:
            with trio.fail_after(timeout_s):
                stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
                if scheme == "https":
                    if self._tls is None:
                        self._tls = ssl.create_default_context()
                    stream = trio.SSLStream(stream, self._tls, server_hostname=host)
                    await stream.do_handshake()
        except (*_FAILED, ssl.SSLError) as exc:
            raise UpstreamError(_reason(exc)) from exc
        return _Connection(stream, origin), False

    async def _release(self, conn: _Connection) -> None:
        """An answer read to its end: its connection kept for the next request, if it
        can be."""
        h = conn.h11
        idle = self._idle.setdefault(conn.origin, [])
        clean = h.trailing_data == (b"", False)  # nothing the server sent beyond its answer
        if (
            h.our_state is h11.DONE
            and h.their_state is h11.DONE
            and clean
            and len(idle) < self.kept
        ):
            h.start_next_cycle()
            conn.idle_since, conn.answered = trio.current_time(), False
            idle.append(conn)
        else:  # closed by either side, or enough kept
            await trio.aclose_forcefully(conn.stream)


def _split(url: str) -> tuple[tuple[str, str, int], str]:
    """(scheme, host, port) and the request target of `url`."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme
    port = parts.port or (443 if scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (scheme, parts.hostname or "", port), target


def _reason(exc: BaseException) -> str:
    """What went wrong calling a server, with no address in it: the innermost error's
    kind (`ConnectionRefusedError` under trio's group of the addresses tried), or
    `TimeoutError`."""
    if isinstance(exc, trio.TooSlowError):
        return "TimeoutError"
    for _ in range(16):
        if isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        elif exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            break
    return type(exc).__name__
