"""One chunk (of one shard) as one Redis string value.

    payload: layer 0 bytes | layer 1 bytes | ... | layer L-1 bytes
    trailer: msgpack ChunkHeader | header length (u32 LE) | MAGIC (8 bytes)

The payload comes first so that a reader computes every layer's offset from its own
KV layout and can fetch all of them (`GETRANGE`) in the same pipeline as the
trailer, which it then checks (`kvflow.ChunkHeader`: key, namespace, shard, token
count, per-layer sizes and XXH3-64s, the writer's layout).
"""

from __future__ import annotations

import struct

from kvflow import BadHeader, ChunkHeader

__all__ = ["MAGIC", "decode_trailer", "encode_trailer"]

MAGIC = b"KVFLOWR2"
OLD_MAGICS = {b"KVFLOWR1": "format 1 (CRC32)"}
_SUFFIX = struct.Struct("<I8s")  # header length, magic


def encode_trailer(h: ChunkHeader) -> bytes:
    body = h.encode()
    return body + _SUFFIX.pack(len(body), MAGIC)


def decode_trailer(raw: bytes) -> ChunkHeader:
    """The header of a value from its bytes after the payload (`raw`, exactly)."""
    if len(raw) < _SUFFIX.size:
        raise BadHeader(f"value too short for its trailer ({len(raw)} bytes after the payload)")
    n, magic = _SUFFIX.unpack_from(raw, len(raw) - _SUFFIX.size)
    if magic in OLD_MAGICS:
        raise BadHeader(
            f"written in kvflow-redis's {OLD_MAGICS[magic]}; this version reads format 2 "
            "(XXH3): computed again and rewritten"
        )
    if magic != MAGIC:
        raise BadHeader("not a kvflow chunk value (bad magic)")
    if n + _SUFFIX.size != len(raw):
        raise BadHeader(
            f"payload size does not match this KV layout or the value is truncated "
            f"({len(raw)} bytes after the expected payload, trailer says {n + _SUFFIX.size})"
        )
    return ChunkHeader.decode(raw[:n])
