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
    """The RESP framing of one connection's inbound stream, followed incrementally."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.line = bytearray()  # a header line not yet complete
        self.skip = 0  # bytes of a blob body (and its CRLF) still to come
        self.stack: list[list[int]] = []  # per open aggregate: [elements left, is attribute]

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self.skip:
                take = min(self.skip, n - i)
                self.skip -= take
                i += take
                if not self.skip:
                    self._element_done()
                continue
            end = data.find(b"\n", i, i + MAX_LINE + 2 - len(self.line))
            if end < 0:
                self.line += data[i : i + MAX_LINE + 2]
                if len(self.line) > MAX_LINE + 1:
                    raise ProtocolError(f"a reply line longer than {MAX_LINE} bytes")
                return
            self.line += data[i:end]
            i = end + 1
            line = bytes(self.line)
            self.line.clear()
            self._header(line[:-1] if line.endswith(b"\r") else line)

    def _header(self, line: bytes) -> None:
        if not line:
            raise ProtocolError("an empty reply line")
        kind = line[0]
        if kind in _SIMPLE:
            self._element_done()
        elif kind in _BLOBS:
            size = _number(line)
            if size == -1:  # RESP2 null
                self._element_done()
            elif not 0 <= size <= self.limits.max_bulk:
                raise ProtocolError(
                    f"a bulk reply of {size} bytes (at most {self.limits.max_bulk} accepted)"
                )
            else:
                self.skip = size + 2
        elif kind in _AGGREGATES:
            count = _number(line)
            if count == -1:
                self._element_done()
            elif not 0 <= count <= MAX_ELEMENTS:
                raise ProtocolError(f"an array reply of {count} (at most {MAX_ELEMENTS} accepted)")
            elif count == 0:
                self._element_done()
            elif len(self.stack) >= MAX_DEPTH:
                raise ProtocolError(f"arrays nested deeper than {MAX_DEPTH}")
            else:
                self.stack.append([count * _AGGREGATES[kind], kind == ord("|")])
        else:
            raise ProtocolError(f"not a RESP reply line: {line[:32]!r}")

    def _element_done(self) -> None:
        while self.stack:
            top = self.stack[-1]
            top[0] -= 1
            if top[0]:
                return
            self.stack.pop()
            if top[1]:  # an attribute annotates the element that follows: not one itself
                return


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
