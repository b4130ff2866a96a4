"""A small RESP2 client on trio sockets: pipelines, scatter/gather sends, reads into spans.

Only what the transport needs: build commands whose large arguments are lists of
memoryviews (sent with `sendmsg`, never joined), read replies generically or read a
bulk reply straight into caller memory (`recv_into`), and a bounded pool.

A connection whose exchange was cut short (cancellation, timeout, a network error)
is in an unknown position of the reply stream and is closed, never reused.

Replies are bounded before they are buffered (a hostile or broken server): a line
(`MAX_LINE`), a bulk (the connection's `max_bulk`), an array's length (`MAX_ARRAY`)
and nesting (`MAX_DEPTH`); past a bound the call raises `ProtocolError` at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket as _stdsocket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import trio

Buffer = bytes | bytearray | memoryview
Arg = str | bytes | int | float
Reply = Any
"""bytes | int | None | list[Reply] | RedisError, as RESP2 sends them."""

IOV_MAX = 1024
_RECV_SIZE = 256 * 1024
MAX_LINE = 64 << 10
"""The longest status, error or length line accepted (a server's errors are far shorter)."""
MAX_BULK = 64 << 10
"""A connection's `max_bulk` until its user knows better (the transport: see `register`)."""
MAX_ARRAY = 1024
"""The most elements an array reply may have (the transport reads a CONFIG GET pair)."""
MAX_DEPTH = 4
"""How deeply arrays may nest (the transport reads flat ones)."""


class RedisError(Exception):
    """An error reply (`-ERR ...`, `-WRONGTYPE ...`, `-OOM ...`); returned as a value."""


class ConnectionLost(ConnectionError):
    """The server closed the connection."""


class ProtocolError(ConnectionError):
    """The server sent what this client does not read: not RESP2, or past a bound."""


class BadURL(ValueError):
    pass


NETWORK_ERRORS = (OSError, ConnectionError, trio.TooSlowError, RedisError)


def network_error(exc: BaseException) -> BaseException | None:
    """The first network or server error `exc` stands for (also inside an exception group
    that holds nothing else), or None when it is something else (a cancellation, a bug)."""
    if isinstance(exc, NETWORK_ERRORS):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        match, rest = exc.split(NETWORK_ERRORS)
        if match is not None and rest is None:
            leaf: BaseException = match
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            return leaf
    return None


@dataclass(frozen=True)
class Address:
    """Where and how to connect, parsed from a `redis://` or `unix://` URL."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str = ""
    """Unix socket path (`unix://` URLs); host and port unused then."""
    db: int = 0
    username: str = ""
    password: str = ""

    def redacted(self) -> str:
        """The address for messages, without the password."""
        auth = f"{self.username or ''}:***@" if self.password else ""
        if self.path:
            return f"unix://{auth}{self.path}?db={self.db}"
        return f"redis://{auth}{self.host}:{self.port}/{self.db}"


def parse_url(url: str) -> Address:
    """`redis://[[user]:password@]host[:port][/db]` or `unix://[[user]:password@]/path[?db=N]`."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as exc:
        raise BadURL(f"{url!r} is not a URL ({exc})") from None
    username = unquote(u.username or "")
    password = unquote(u.password or "")
    query = parse_qs(u.query)
    db_text = query.get("db", [""])[0]
    if u.scheme == "redis":
        if not u.hostname:
            raise BadURL(f"{url!r} names no host (expected redis://host:port/db)")
        path_db = u.path.strip("/")
        db_text = path_db or db_text
        addr = Address(host=u.hostname, port=port or 6379, username=username, password=password)
    elif u.scheme == "unix":
        if not u.path:
            raise BadURL(f"{url!r} names no socket path (expected unix:///path/to/redis.sock)")
        addr = Address(path=u.path, username=username, password=password)
    elif u.scheme == "rediss":
        raise BadURL(
            f"{url!r}: TLS (rediss://) is not supported; reach the server over a private "
            "network, a unix socket or a local TLS tunnel (stunnel) instead"
        )
    else:
        raise BadURL(f"{url!r} is not a redis:// or unix:// URL")
    if db_text:
        if not db_text.isdigit():
            raise BadURL(f"{url!r}: database {db_text!r} is not a number")
        addr = dataclasses.replace(addr, db=int(db_text))
    return addr


def encode(*args: Arg | Sequence[Buffer], out: list[Buffer] | None = None) -> list[Buffer]:
    """One command as buffers to send. An argument that is a list or tuple of buffers is one
    bulk string made of those buffers (sent as they are, not joined)."""
    out = [] if out is None else out
    head = bytearray(b"*%d\r\n" % len(args))
    for a in args:
        if isinstance(a, (list, tuple)):
            n = sum(len(b) for b in a)
            head += b"$%d\r\n" % n
            out.append(bytes(head))
            out.extend(a)
            head = bytearray(b"\r\n")
            continue
        if isinstance(a, str):
            b: Buffer = a.encode()
        elif isinstance(a, int | float):
            b = str(a).encode()
        elif isinstance(a, bytes | bytearray | memoryview):
            b = a
        else:
            raise TypeError(f"cannot send a {type(a).__name__} as a redis argument")
        if len(b) > 16384:  # a large single argument: do not copy it into the header
            head += b"$%d\r\n" % len(b)
            out.append(bytes(head))
            out.append(b)
            head = bytearray(b"\r\n")
        else:
            head += b"$%d\r\n" % len(b)
            head += b
            head += b"\r\n"
    out.append(bytes(head))
    return out


class Connection:
    """One socket to the server and the unread part of its reply stream."""

    def __init__(self, sock: trio.socket.SocketType, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.max_bulk = MAX_BULK
        """The longest bulk reply accepted."""
        self.buf = bytearray()
        self.pos = 0
        self.last_used = trio.current_time()
        self.broken = False

    @classmethod
    async def connect(cls, addr: Address, timeout_s: float, name: str = "") -> Connection:
        with trio.fail_after(timeout_s):
            if addr.path:
                sock = trio.socket.socket(_stdsocket.AF_UNIX, _stdsocket.SOCK_STREAM)
                try:
                    await sock.connect(addr.path)
                except BaseException:
                    sock.close()
                    raise
            else:
                stream = await trio.open_tcp_stream(addr.host, addr.port)
                sock = stream.socket
                sock.setsockopt(_stdsocket.IPPROTO_TCP, _stdsocket.TCP_NODELAY, 1)
            conn = cls(sock, timeout_s)
            try:
                cmds: list[tuple[Arg, ...]] = []
                if addr.password:
                    auth: tuple[Arg, ...] = ("AUTH", addr.password)
                    if addr.username:
                        auth = ("AUTH", addr.username, addr.password)
                    cmds.append(auth)
                if addr.db:
                    cmds.append(("SELECT", addr.db))
                if name:
                    cmds.append(("CLIENT", "SETNAME", name))
                cmds.append(("PING",))
                replies = await conn.pipeline(cmds)
                for cmd, reply in zip(cmds, replies, strict=True):
                    if isinstance(reply, RedisError) and cmd[:2] != ("CLIENT", "SETNAME"):
                        raise reply
            except BaseException:
                conn.close()
                raise
        return conn

    def close(self) -> None:
        self.broken = True
        self.sock.close()

    # -- sending -----------------------------------------------------------
    async def send(self, bufs: Sequence[Buffer]) -> None:
        """Send every buffer, in order, with as few `sendmsg` calls as the kernel allows."""
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        i = 0
        while i < len(views):
            batch = views[i : i + IOV_MAX]
            with trio.fail_after(self.timeout_s):
                sent = await self.sock.sendmsg(batch)
            for v in batch:  # drop what was sent; cut the first partly sent view
                if sent >= len(v):
                    sent -= len(v)
                    i += 1
                else:
                    views[i] = v[sent:]
                    break

    # -- receiving ---------------------------------------------------------
    async def _fill(self) -> None:
        if self.pos and self.pos == len(self.buf):
            self.buf.clear()
            self.pos = 0
        elif self.pos > 65536:
            del self.buf[: self.pos]
            self.pos = 0
        with trio.fail_after(self.timeout_s):
            data = await self.sock.recv(_RECV_SIZE)
        if not data:
            raise ConnectionLost("the redis server closed the connection")
        self.buf += data

    async def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if 0 <= end <= self.pos + MAX_LINE:
                line = bytes(self.buf[self.pos : end])
                self.pos = end + 2
                return line
            if len(self.buf) - self.pos >= MAX_LINE + 2:  # no line end where one must be
                raise ProtocolError(f"a reply line longer than {MAX_LINE} bytes")
            await self._fill()

    async def reply(self, depth: int = 0) -> Reply:
        """The next reply, whole (for small replies)."""
        line = await self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return RedisError(rest.decode(errors="replace"))
        if kind == b":":
            return _number(line)
        if kind == b"$":
            n = _length(line, self.max_bulk, "a bulk reply")
            if n < 0:
                return None
            data = bytearray(n)
            await self.read_into([memoryview(data)])
            await self._crlf()
            return bytes(data)
        if kind == b"*":
            if depth >= MAX_DEPTH:
                raise ProtocolError(f"arrays nested deeper than {MAX_DEPTH}")
            n = _length(line, MAX_ARRAY, "an array reply")
            return None if n < 0 else [await self.reply(depth + 1) for _ in range(n)]
        raise ProtocolError(f"unexpected reply {line[:40]!r}: not a RESP2 server?")

    async def bulk_header(self) -> int | RedisError:
        """Start a bulk reply: its length (-1 for nil), or the error reply in its place."""
        line = await self._line()
        if line[:1] == b"$":
            return _length(line, self.max_bulk, "a bulk reply")
        if line[:1] == b"-":
            return RedisError(line[1:].decode(errors="replace"))
        raise ProtocolError(f"expected a bulk reply, got {line[:40]!r}")

    async def bulk_end(self) -> None:
        await self._crlf()

    async def _crlf(self) -> None:
        while len(self.buf) - self.pos < 2:
            await self._fill()
        if self.buf[self.pos : self.pos + 2] != b"\r\n":
            raise ProtocolError("malformed bulk reply (no CRLF after its data)")
        self.pos += 2

    async def read_into(self, views: Sequence[memoryview]) -> None:
        """Fill `views` exactly, in order, from the reply stream (buffered bytes first)."""
        for view in views:
            v = view.cast("B") if view.format != "B" or view.ndim != 1 else view
            done = 0
            have = len(self.buf) - self.pos
            if have:
                k = min(have, len(v))
                v[:k] = self.buf[self.pos : self.pos + k]
                self.pos += k
                done = k
            while done < len(v):
                with trio.fail_after(self.timeout_s):
                    got = await self.sock.recv_into(v[done:])
                if not got:
                    raise ConnectionLost("the redis server closed the connection mid-reply")
                done += got

    async def skip(self, n: int) -> None:
        """Discard `n` bytes of the reply stream."""
        have = len(self.buf) - self.pos
        k = min(have, n)
        self.pos += k
        n -= k
        if n:
            scratch = memoryview(bytearray(min(n, _RECV_SIZE)))
            while n:
                await self.read_into([scratch[: min(n, len(scratch))]])
                n -= min(n, len(scratch))

    # -- both --------------------------------------------------------------
    async def pipeline(self, cmds: Sequence[Sequence[Any]]) -> list[Reply]:
        """Send every command, then read every reply (error replies are `RedisError`s)."""
        bufs: list[Buffer] = []
        for cmd in cmds:
            encode(*cmd, out=bufs)
        replies: list[Reply] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.send, bufs)
            for _ in cmds:
                replies.append(await self.reply())
        return replies


def _number(line: bytes) -> int:
    """The integer after a reply line's type byte."""
    try:
        return int(line[1:])
    except ValueError:
        raise ProtocolError(f"not a number in the reply line {line[:40]!r}") from None


def _length(line: bytes, limit: int, what: str) -> int:
    """The length a bulk or array reply line announces (-1: nil), at most `limit`."""
    n = _number(line)
    if not -1 <= n <= limit:
        raise ProtocolError(f"{what} of {n} (at most {limit} accepted)")
    return n


class Pool:
    """At most `max_connections` connections; a connection goes back only after a clean use."""

    IDLE_CHECK_S = 5.0
    """An idle connection older than this is PINGed before use (the server may have
    restarted or dropped it)."""

    def __init__(self, addr: Address, max_connections: int, timeout_s: float, name: str) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self.name = name
        self._idle: list[Connection] = []
        self._limit = trio.Semaphore(max_connections)
        self._closed = False
        self.max_bulk = MAX_BULK
        """Each connection's `max_bulk`, from its next use on."""

    async def _get(self) -> Connection:
        while self._idle:
            conn = self._idle.pop()
            if trio.current_time() - conn.last_used < self.IDLE_CHECK_S:
                return conn
            try:
                (pong,) = await conn.pipeline([("PING",)])
            except BaseException as exc:
                conn.close()
                if network_error(exc) is None:
                    raise
                continue
            if not isinstance(pong, RedisError):
                return conn
            conn.close()
        return await Connection.connect(self.addr, self.timeout_s, self.name)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Connection]:
        async with self._limit:
            conn = await self._get()
            conn.max_bulk = self.max_bulk
            ok = False
            try:
                yield conn
                ok = True
            finally:
                if ok and not self._closed and not conn.broken:
                    conn.last_used = trio.current_time()
                    self._idle.append(conn)
                else:
                    conn.close()

    async def pipeline(self, cmds: Sequence[Sequence[Any]]) -> list[Reply]:
        async with self.connection() as conn:
            return await conn.pipeline(cmds)

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()
