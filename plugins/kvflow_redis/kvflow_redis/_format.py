"""One chunk (of one shard) as one Redis string value.

    payload: layer 0 bytes | layer 1 bytes | ... | layer L-1 bytes
    trailer: msgpack ChunkHeader | header length (u32 LE) | MAGIC (8 bytes)

The payload comes first so that a reader computes every layer's offset from its own
KV layout and can fetch all of them (`GETRANGE`) in the same pipeline as the
trailer, which it then checks: key, namespace, shard, token count, per-layer sizes,
and per-layer CRC32s.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import msgspec

MAGIC = b"KVFLOWR1"
_SUFFIX = struct.Struct("<I8s")  # header length, magic


class ChunkHeader(msgspec.Struct, frozen=True, array_like=True):
    key: str
    namespace: str
    shard: str
    num_tokens: int
    layer_nbytes: list[int]
    layer_crc: list[int]


class BadHeader(ValueError):
    pass


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ChunkHeader)


def encode_trailer(h: ChunkHeader) -> bytes:
    body = _encoder.encode(h)
    return body + _SUFFIX.pack(len(body), MAGIC)


def decode_trailer(raw: bytes) -> ChunkHeader:
    """The header of a value from its bytes after the payload (`raw`, exactly)."""
    if len(raw) < _SUFFIX.size:
        raise BadHeader(f"value too short for its trailer ({len(raw)} bytes after the payload)")
    n, magic = _SUFFIX.unpack_from(raw, len(raw) - _SUFFIX.size)
    if magic != MAGIC:
        raise BadHeader("not a kvflow chunk value (bad magic)")
    if n + _SUFFIX.size != len(raw):
        raise BadHeader(
            f"payload size does not match this KV layout or the value is truncated "
            f"({len(raw)} bytes after the expected payload, trailer says {n + _SUFFIX.size})"
        )
    try:
        return _decoder.decode(raw[:n])
    except msgspec.DecodeError as exc:
        raise BadHeader(f"undecodable header: {exc}") from None


def crc_of(spans: Sequence[memoryview], crc: int = 0) -> int:
    for s in spans:
        crc = zlib.crc32(s, crc)
    return crc
