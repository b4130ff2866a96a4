"""vLLM's KV event stream as a router reads it (`--kv-events-config`, ZMQ PUB), without
vLLM: the wire structs of `vllm/distributed/kv_events.py` (0.32-0.33), decoded with every
field bounded before the index sees it.

A frame is (topic, 8-byte big-endian sequence number, msgpack `EventBatch`); a batch is
`[ts, [event, ...], data_parallel_rank]`, each event a map tagged by its class name. An
event of a kind this reader does not know (a later vLLM's) or out of bounds is skipped
and counted, never fatal: the publisher is a server this router was told about, but a
frame is still bytes from a socket.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "MAX_BLOCKS",
    "MAX_FRAME_BYTES",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "decode_batch",
]

MAX_FRAME_BYTES = 16 << 20
"""The longest batch decoded; a longer one is skipped (vLLM's are a step's events)."""
MAX_BLOCKS = 8192
"""The most blocks one event may name."""
MAX_BLOCK_SIZE = 4096
MAX_HASH_BYTES = 64

BlockHash = int | bytes
"""vLLM's `ExternalBlockHash`: the low 64 bits as an int, or the digest's bytes."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch = msgspec.msgpack.Decoder(_Batch)
_event: msgspec.msgpack.Decoder[Event] = msgspec.msgpack.Decoder(Event)


def decode_batch(payload: bytes) -> tuple[list[Event], int]:
    """The events of one published batch that are in bounds, and how many were not (or
    the whole batch: 1, when it is not one)."""
    if len(payload) > MAX_FRAME_BYTES:
        return [], 1
    try:
        batch = _batch.decode(payload)
    except msgspec.DecodeError:
        return [], 1
    out: list[Event] = []
    bad = 0
    for raw in batch.events:
        try:
            event = _event.decode(raw)
        except msgspec.DecodeError:
            bad += 1
            continue
        if _in_bounds(event):
            out.append(event)
        else:
            bad += 1
    return out, bad


def _in_bounds(event: Event) -> bool:
    if isinstance(event, AllBlocksCleared):
        return True
    hashes = event.block_hashes
    if not 0 < len(hashes) <= MAX_BLOCKS or not all(_hash_ok(h) for h in hashes):
        return False
    if isinstance(event, BlockRemoved):
        return event.medium is None or len(event.medium) <= 64
    return (
        0 < event.block_size <= MAX_BLOCK_SIZE
        and len(event.token_ids) == event.block_size * len(hashes)
        and (event.parent_block_hash is None or _hash_ok(event.parent_block_hash))
        and (event.medium is None or len(event.medium) <= 64)
        and (event.lora_name is None or len(event.lora_name) <= 256)
        and all(0 <= t < 1 << 32 for t in event.token_ids)
    )


def _hash_ok(h: BlockHash) -> bool:
    return len(h) <= MAX_HASH_BYTES if isinstance(h, bytes) else 0 <= h < 1 << 256
