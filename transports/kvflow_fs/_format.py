"""On-disk format of one chunk file: fixed 4 KiB header, then layer-major payload."""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence

import msgspec

MAGIC = b"KVFLOWC1"
HEADER_SIZE = 4096
_PREFIX = struct.Struct("<8sI")  # magic, header length


class ChunkHeader(msgspec.Struct, frozen=True, array_like=True):
    key: str
    namespace: str
    shard: str
    num_tokens: int
    layer_nbytes: list[int]
    layer_crc: list[int]
    layout: str = ""
    """`KVLayout.describe()` of the writer ("" in files of kvflow before it was kept)."""

    def payload_nbytes(self) -> int:
        return sum(self.layer_nbytes)

    def layer_offset(self, layer: int) -> int:
        return HEADER_SIZE + sum(self.layer_nbytes[:layer])


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ChunkHeader)


class BadHeader(ValueError):
    pass


def encode_header(h: ChunkHeader) -> bytes:
    body = _encoder.encode(h)
    raw = _PREFIX.pack(MAGIC, len(body)) + body
    if len(raw) > HEADER_SIZE:
        raise ValueError(f"chunk header of {len(raw)} bytes exceeds {HEADER_SIZE}")
    return raw


def read_header(fd: int) -> ChunkHeader:
    raw = os.pread(fd, HEADER_SIZE, 0)
    if len(raw) < _PREFIX.size:
        raise BadHeader("file shorter than its header")
    magic, n = _PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise BadHeader("not a kvflow chunk file (bad magic)")
    if _PREFIX.size + n > len(raw):
        raise BadHeader("truncated header")
    try:
        return _decoder.decode(raw[_PREFIX.size : _PREFIX.size + n])
    except msgspec.DecodeError as exc:
        raise BadHeader(f"undecodable header: {exc}") from None


def crc_of(spans: Sequence[memoryview], crc: int = 0) -> int:
    for s in spans:
        crc = zlib.crc32(s, crc)
    return crc
