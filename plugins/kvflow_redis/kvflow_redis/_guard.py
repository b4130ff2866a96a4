"""Bounds on what a Redis server may make the client buffer, checked before coredis parses.

coredis reads whatever the server sends into its parser: a broken or hostile server that
declares a 1 GiB bulk, 10^8 array elements, arrays nested 100 000 deep or a line without
end would have it buffer until memory or `timeout_s` runs out. `Framer` follows the
RESP2/RESP3 framing of the byte stream as it arrives (lines, lengths, nesting; a bulk's
body is skipped, not copied) and raises `ProtocolError` at the first frame past a bound,
so the connection fails at once holding at most one read.

`guarded(cls, limits)` is a coredis connection class whose stream is checked this way
and read in large pieces (anyio's default of 64 KiB per read costs a parser pass each).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from anyio.abc import ByteStream

MAX_LINE = 64 << 10
"""The longest status, error, number or length line accepted."""
MAX_BULK = 64 << 10
"""The largest bulk until the transport knows its values' size (see `register`)."""
MAX_ELEMENTS = 1 << 16
"""The most elements an array, set, map or push reply may have (CLUSTER SLOTS of a
cluster whose 16384 slots are scattered over its shards fits)."""
MAX_DEPTH = 8
"""How deeply aggregates may nest (CLUSTER SHARDS nests 5 deep)."""
READ_SIZE = 4 << 20
"""Bytes asked of the socket per read."""

_BLOBS = frozenset(b"$!=")  # bulk string, bulk error, verbatim string: a length, then bytes
_AGGREGATES = {ord("*"): 1, ord("~"): 1, ord(">"): 1, ord("%"): 2, ord("|"): 2}
_SIMPLE = frozenset(b"+-:_,#(")  # one line each


class ProtocolError(ConnectionError):
    """The server sent what this client does not read: not RESP, or past a bound."""


@dataclasses.dataclass
class Limits:
    max_bulk: int = MAX_BULK


class Framer:
    """The RESP framing of one connection's inbound stream, followed incrementally: every
    line ends in CRLF and holds what its type promises (a number, a boolean, a double,
    UTF-8 text); every bulk body is followed by CRLF; a reply (with all it nests) holds at
    most `MAX_ELEMENTS` elements and `max_bulk` + `MAX_LINE` + 1 MiB bytes."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.line = bytearray()  # a header line not yet complete
        self.skip = 0  # bytes of a blob body still to come
        self.crlf = 0  # bytes of the CRLF after a blob body still to come
        self.text: bytearray | None = None  # a bulk error's or verbatim string's body
        self.verbatim = False
        self.stack: list[list[int]] = []  # per open aggregate: [elements left, is attribute]
        self.elements = 0  # of the reply being read
        self.nbytes = 0

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self.skip:
                take = min(self.skip, n - i)
                if self.text is not None:
                    self.text += data[i : i + take]
                self.skip -= take
                i += take
            elif self.crlf:
                if data[i] != b"\r\n"[2 - self.crlf]:
                    raise ProtocolError("a bulk reply not followed by CRLF")
                self.crlf -= 1
                i += 1
                if not self.crlf:
                    self._blob_done()
            else:
                i = self._line(data, i)

    def _line(self, data: bytes, i: int) -> int:
        """Take a header line's bytes from `data[i:]`; where the next part starts."""
        end = data.find(b"\n", i, i + MAX_LINE + 2 - len(self.line))
        if end < 0:
            self.line += data[i : i + MAX_LINE + 2]
            if len(self.line) > MAX_LINE + 1:
                raise ProtocolError(f"a reply line longer than {MAX_LINE} bytes")
            return len(data)
        self.line += data[i:end]
        line = bytes(self.line)
        self.line.clear()
        if not line.endswith(b"\r"):
            raise ProtocolError(f"a reply line not ended by CRLF: {line[:32]!r}")
        self._header(line[:-1])
        return end + 1

    def _count(self, nbytes: int) -> None:
        self.elements += 1
        self.nbytes += nbytes
        budget = self.limits.max_bulk + MAX_LINE + (1 << 20)
        if self.elements > MAX_ELEMENTS:
            raise ProtocolError(f"a reply of more than {MAX_ELEMENTS} elements")
        if self.nbytes > budget:
            raise ProtocolError(f"a reply of more than {budget} bytes")

    def _header(self, line: bytes) -> None:
        if not line:
            raise ProtocolError("an empty reply line")
        kind = line[0]
        self._count(len(line))
        if kind in _SIMPLE:
            _check_simple(kind, line)
            self._element_done()
        elif kind in _BLOBS:
            self._blob(kind, _number(line))
        elif kind in _AGGREGATES:
            count = _number(line)
            if count in (-1, 0):  # RESP2's null, or empty
                self._element_done()
            elif not 0 <= count <= MAX_ELEMENTS:
                raise ProtocolError(f"an array reply of {count} (at most {MAX_ELEMENTS} accepted)")
            elif len(self.stack) >= MAX_DEPTH:
                raise ProtocolError(f"arrays nested deeper than {MAX_DEPTH}")
            else:
                self.stack.append([count * _AGGREGATES[kind], kind == ord("|")])
        else:
            raise ProtocolError(f"not a RESP reply line: {line[:32]!r}")

    def _blob(self, kind: int, size: int) -> None:
        text = kind != ord("$")  # a bulk error or a verbatim string: text, kept short
        limit = MAX_LINE if text else self.limits.max_bulk
        if size == -1:  # RESP2's null
            self._element_done()
            return
        if not 0 <= size <= limit:
            raise ProtocolError(f"a bulk reply of {size} bytes (at most {limit} accepted)")
        self._count(size)
        self.skip, self.crlf = size, 2
        self.text = bytearray() if text else None
        self.verbatim = kind == ord("=")

    def _blob_done(self) -> None:
        if self.text is not None:
            body, self.text = bytes(self.text), None
            if not _utf8(body) or (self.verbatim and body[3:4] != b":"):
                raise ProtocolError(f"a malformed bulk error or verbatim string: {body[:32]!r}")
        self._element_done()

    def _element_done(self) -> None:
        while self.stack:
            top = self.stack[-1]
            top[0] -= 1
            if top[0]:
                return
            self.stack.pop()
            if top[1]:  # an attribute annotates the element that follows: not one itself
                return
        self.elements = self.nbytes = 0  # the reply is complete


def _check_simple(kind: int, line: bytes) -> None:
    """A one-line element holds what its type says (coredis would fail on it with an
    error that is not a connection error)."""
    body = line[1:]
    if kind == ord(":"):
        _number(line)
        return
    if kind == ord("("):
        ok = (body[1:] if body[:1] == b"-" else body).isdigit()
    elif kind == ord(","):
        ok = _is_float(body)
    elif kind == ord("#"):
        ok = body in (b"t", b"f")
    elif kind == ord("_"):
        ok = not body
    else:  # + and -: text
        ok = _utf8(body)
    if not ok:
        raise ProtocolError(f"a malformed reply line: {line[:32]!r}")


def _is_float(body: bytes) -> bool:
    try:
        float(body)
    except ValueError:
        return False
    return True


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _number(line: bytes) -> int:
    body = line[1:]
    digits = body[1:] if body[:1] == b"-" else body
    if not (0 < len(body) <= 20 and digits.isdigit()):
        raise ProtocolError(f"not a number in the reply line {line[:32]!r}")
    return int(body)


class GuardedStream(ByteStream):
    """`inner`, with every byte received checked by a `Framer` first."""

    def __init__(self, inner: ByteStream, limits: Limits) -> None:
        self.inner = inner
        self.framer = Framer(limits)

    async def receive(self, max_bytes: int = READ_SIZE) -> bytes:
        data = await self.inner.receive(max(max_bytes, READ_SIZE))
        self.framer.feed(data)
        return data

    async def send(self, item: bytes) -> None:
        await self.inner.send(item)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()

    @property
    def extra_attributes(self) -> Any:
        return self.inner.extra_attributes


def guarded(cls: type[Any], limits: Limits) -> type[Any]:
    """A subclass of the coredis connection class `cls` whose streams check `limits`."""

    async def _connect(self: Any) -> ByteStream:
        return GuardedStream(await cls._connect(self), limits)

    return type(f"Guarded{cls.__name__}", (cls,), {"_connect": _connect})
