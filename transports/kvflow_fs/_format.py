"""On-disk format of one chunk file: fixed 4 KiB header, then layer-major payload.

Format 2 (magic `KVFLOWC2`) checks each layer's payload with XXH3-64, which runs at
memory speed (~4x zlib's CRC32 here); format 1 (`KVFLOWC1`, CRC32) files are refused
with a message saying so: the chunk is computed again and rewritten in format 2.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import msgspec
import xxhash

MAGIC = b"KVFLOWC2"
OLD_MAGICS = {b"KVFLOWC1": "format 1 (CRC32)"}
HEADER_SIZE = 4096
_PREFIX = struct.Struct("<8sI")  # magic, header length


class ChunkHeader(msgspec.Struct, frozen=True, array_like=True):
    key: str
    namespace: str
    shard: str
    num_tokens: int
    layer_nbytes: list[int]
    layer_hash: list[int]
    """XXH3-64 of each layer's payload."""
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
    if magic in OLD_MAGICS:
        raise BadHeader(
            f"written in kvflow's chunk {OLD_MAGICS[magic]}; this kvflow reads format 2 "
            "(XXH3): computed again and rewritten"
        )
    if magic != MAGIC:
        raise BadHeader("not a kvflow chunk file (bad magic)")
    if _PREFIX.size + n > len(raw):
        raise BadHeader("truncated header")
    try:
        return _decoder.decode(raw[_PREFIX.size : _PREFIX.size + n])
    except msgspec.DecodeError as exc:
        raise BadHeader(f"undecodable header: {exc}") from None


def hash_of(spans: Sequence[memoryview]) -> int:
    """XXH3-64 of the spans' bytes, in order."""
    if len(spans) == 1:  # the common case (a block-granular or dense chunk): one call
        return xxhash.xxh3_64_intdigest(spans[0])
    h = xxhash.xxh3_64()
    for s in spans:
        h.update(s)
    return h.intdigest()
