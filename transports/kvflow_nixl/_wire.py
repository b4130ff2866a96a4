"""The `nixl` transport's control frames: msgspec msgpack, typed, size-bounded. No pickle.

A pull is one DEALER->ROUTER conversation on the side channel, plus one NIXL
notification for the data path:

    consumer -> producer   Pull(req, agent, known, lease_ms, block_ids, beat_ms, readers, nonce)
    producer -> consumer   Blocks(req, agent, metadata, block_ids, token_counts, memory,
                           regions)
                           (or Refused(req, reason))
    consumer ==> producer  NIXL READs, one per layer (two for a layer whose last
                           chunk is a partial block of a token-granular cache)
    consumer -> producer   Reading(req, nonce), every beat_ms / 4 while they run: the producer
    producer -> consumer   Held(req, held_ms): held that long past it (or Refused)
    consumer ==> producer  the NIXL notification Read(req), once every READ is DONE,
    consumer -> producer   and the same Read(req) over the side channel (UCX may hold a
                           notification until the consumer's agent next progresses)
    consumer -> producer   Failed(req, reason), only if it gave up (no READ in flight)

and, from the consumer's scheduler while the request waits (`kvflow.pd.offers`):

    consumer -> producer   Renew(reqs, lease_ms, release, nonce, consumer)
    producer -> consumer   Renewed(refused, pending, params)

Keyed, every control frame (and notification) carries a MAC toward its side
(`Channel.seal`), and each answer is bound to the `nonce` of the request it answers
(`Blocks`/`Refused` to the pull's, `Held`/`Refused` to that heartbeat's): an answer of
another pull or an earlier heartbeat, or a consumer's frame sent back, fails it.

`metadata` (the producer agent's NIXL metadata) and `regions` (where its KV memory
starts and how it is paged) come only on a consumer's first pull from that agent:
the consumer prepares one descriptor list over the producer's whole KV memory from
them, once, and afterwards a pull needs only the offered block ids.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kvflow.geometry.layout import LayerGeometry
from kvflow.pd.offers import Nonce, OfferId, Renew
from kvflow.pd.params import MAX_SHARDS
from kvflow.zmqio import decode_frame

WIRE_VERSION = 9
MAX_TO_PRODUCER_BYTES = 64 << 10
"""Pull / Failed / notifications: small, fixed-shape frames."""
MAX_TO_CONSUMER_BYTES = 64 << 20
"""Blocks: agent metadata, a few numbers per layer and one id per block; 64 MiB is far
above any request, and still bounds what a bad peer can make us decode."""

BlockIds = Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 31)]], Meta(max_length=1 << 20)]
Name = Annotated[str, Meta(max_length=256)]
Reason = Annotated[str, Meta(max_length=4096)]


class Pull(msgspec.Struct, tag=True, frozen=True):
    req: OfferId
    agent: Name
    """The consumer's NIXL agent name: its READ notifications arrive under it."""
    known: Name = ""
    """The producer agent the consumer already added (its metadata is not resent)."""
    lease_ms: Annotated[int, Meta(ge=0, lt=1 << 40)] = 0
    """The consumer stops reading within this many ms (0: unknown; the producer caps it)."""
    block_ids: BlockIds = []
    """The offered blocks this consumer wants (it may have a prefix already); [] all."""
    version: int = WIRE_VERSION
    beat_ms: Annotated[int, Meta(ge=0, lt=1 << 40)] = 0
    """The producer holds the blocks this long past the pull and past each `Reading`, and
    no longer (a consumer that died frees them that soon); 0: for all of `lease_ms`."""
    readers: Annotated[int, Meta(ge=1, le=MAX_SHARDS)] = 1
    """How many of the consumer's ranks pull this offer (a consumer of another tensor
    parallel size: each its heads); the producer holds it until every one is done."""
    nonce: Nonce = b""
    """The consumer's random bytes for this pull: the answer is bound to them."""


class Reading(msgspec.Struct, tag=True, frozen=True):
    """The consumer still reads `req`'s blocks: hold them `beat_ms` longer."""

    req: OfferId
    nonce: Nonce = b""
    """Fresh for each heartbeat: its answer is bound to them (an earlier `Held` replayed
    fails)."""


class Held(msgspec.Struct, tag=True, frozen=True):
    """The producer's answer to `Reading`: the blocks stay held `held_ms` past its arrival
    (`beat_ms`, or less near the end of the pull's `lease_ms`)."""

    req: str
    held_ms: Annotated[int, Meta(ge=0, lt=1 << 40)]


class Regions(msgspec.Struct, frozen=True):
    """A producer's registered KV memory: enough to address any of its blocks."""

    bases: list[tuple[int, int]]
    """Per layer, [address of its first byte, device id]."""
    geometries: list[LayerGeometry]


class Blocks(msgspec.Struct, tag=True, frozen=True):
    req: str
    agent: str
    metadata: bytes
    """The producer agent's NIXL metadata; empty if the consumer `known`s the agent."""
    block_ids: list[int]
    """The offered blocks, chunk by chunk."""
    token_counts: list[int]
    """Tokens of each offered chunk: the consumer's must be the same."""
    memory: str = "DRAM"
    """NIXL memory type of the producer's KV: DRAM (CPU caches) or VRAM (CUDA caches)."""
    regions: Regions | None = None
    """Sent with `metadata`: where the producer's blocks are."""


class Refused(msgspec.Struct, tag=True, frozen=True):
    req: OfferId
    reason: Reason


class Failed(msgspec.Struct, tag=True, frozen=True):
    req: OfferId
    reason: Reason


class Read(msgspec.Struct, tag=True, frozen=True):
    """The consumer's READs of `req` all finished; nothing reads its blocks any more.
    Sent as a NIXL notification and over the side channel (whichever arrives first)."""

    req: OfferId


ToProducer = Pull | Failed | Read | Reading | Renew
ToConsumer = Blocks | Refused | Held

_encoder = msgspec.msgpack.Encoder()
_to_producer = msgspec.msgpack.Decoder(ToProducer)
_to_consumer = msgspec.msgpack.Decoder(ToConsumer)
_notif = msgspec.msgpack.Decoder(Read)


def encode(msg: ToProducer | ToConsumer | Read) -> bytes:
    return _encoder.encode(msg)


def decode_to_producer(data: bytes | memoryview) -> ToProducer:
    return decode_frame(_to_producer, data, MAX_TO_PRODUCER_BYTES)


def decode_to_consumer(data: bytes | memoryview) -> ToConsumer:
    return decode_frame(_to_consumer, data, MAX_TO_CONSUMER_BYTES)


def decode_notif(data: bytes | memoryview) -> Read:
    return decode_frame(_notif, data, MAX_TO_PRODUCER_BYTES)
