"""On-disk format of one chunk file: a fixed 4 KiB page holding its `ChunkHeader`
(`kvflow.chunks`), then the layer-major payload.

Format 2 (magic `KVFLOWC2`) checks each layer's payload with XXH3-64, which runs at
memory speed (~4x zlib's CRC32 here), or under a store key (`store_key_file`) with a
keyed BLAKE3 bound to the chunk, shard and layer, in the same header field
(`kvflow.chunks.layer_hash`); format 1 (`KVFLOWC1`, CRC32) files are refused with a
message saying so: the chunk is computed again and rewritten in format 2.
"""

from __future__ import annotations

import os
import struct

from kvflow.chunks import BadHeader, ChunkHeader

MAGIC = b"KVFLOWC2"
OLD_MAGICS = {b"KVFLOWC1": "format 1 (CRC32)"}
HEADER_SIZE = 4096
_PREFIX = struct.Struct("<8sI")  # magic, header length


def group_extents(layer_nbytes: list[int], groups: list[range]) -> list[tuple[int, int]]:
    """Where each group's layers start in a chunk file whose layers are `layer_nbytes`
    long, and how many bytes they are (adjacent: one read each)."""
    return [
        (HEADER_SIZE + sum(layer_nbytes[: g.start]), sum(layer_nbytes[g.start : g.stop]))
        for g in groups
    ]


def encode_header(h: ChunkHeader) -> bytes:
    body = h.encode()
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
            "(XXH3, or keyed BLAKE3 under a store key): computed again and rewritten"
        )
    if magic != MAGIC:
        raise BadHeader("not a kvflow chunk file (bad magic)")
    if _PREFIX.size + n > len(raw):
        raise BadHeader("truncated header")
    return ChunkHeader.decode(raw[_PREFIX.size : _PREFIX.size + n])
