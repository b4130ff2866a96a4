"""The `nixl` transport's control frames: msgspec msgpack, typed, size-bounded. No pickle.

A pull is one DEALER->ROUTER conversation on the side channel, plus NIXL
notifications for the data path:

    consumer -> producer   Pull(req, agent, known, lease_ms)
    producer -> consumer   Blocks(req, agent, metadata, layers)   (or Refused(req, reason))
    consumer ==> producer  one NIXL READ per layer, each completing with the
                           notification LayerRead(req, layer, num_layers)
    consumer -> producer   Failed(req, reason), only if it gave up (no READ in flight)

`metadata` is the producer agent's NIXL metadata, empty when the consumer said it
already `known`s that agent (it caches it per producer). `layers[i]` lists the
producer's spans of layer i as [addr, len, dev_id], chunk by chunk, plane by plane.
"""

from __future__ import annotations

import msgspec

from kvflow.zmqio import decode_frame

WIRE_VERSION = 1
MAX_TO_PRODUCER_BYTES = 64 << 10
"""Pull / Failed / notifications: small, fixed-shape frames."""
MAX_TO_CONSUMER_BYTES = 256 << 20
"""Blocks: agent metadata plus one descriptor per span (~10 bytes each); 256 MiB is
~25M spans, far above any request, and still bounds what a bad peer can make us decode."""


class Pull(msgspec.Struct, tag=True, frozen=True):
    req: str
    agent: str
    """The consumer's NIXL agent name: its READ notifications arrive under it."""
    known: str = ""
    """The producer agent the consumer already added (its metadata is not resent)."""
    lease_ms: int = 0
    """The consumer stops reading within this many ms (0: unknown; the producer caps it)."""
    version: int = WIRE_VERSION


class Blocks(msgspec.Struct, tag=True, frozen=True):
    req: str
    agent: str
    metadata: bytes
    layers: list[list[tuple[int, int, int]]]
    """Per layer, the offered blocks' runs as [address, length, device id]."""
    memory: str = "DRAM"
    """NIXL memory type of those addresses: DRAM (CPU caches) or VRAM (CUDA caches)."""


class Refused(msgspec.Struct, tag=True, frozen=True):
    req: str
    reason: str


class Failed(msgspec.Struct, tag=True, frozen=True):
    req: str
    reason: str


class LayerRead(msgspec.Struct, tag=True, frozen=True):
    """NIXL notification of one finished READ: layer `layer` of `req` is no longer read."""

    req: str
    layer: int
    num_layers: int


ToProducer = Pull | Failed
ToConsumer = Blocks | Refused

_encoder = msgspec.msgpack.Encoder()
_to_producer = msgspec.msgpack.Decoder(ToProducer)
_to_consumer = msgspec.msgpack.Decoder(ToConsumer)
_notif = msgspec.msgpack.Decoder(LayerRead)


def encode(msg: ToProducer | ToConsumer | LayerRead) -> bytes:
    return _encoder.encode(msg)


def decode_to_producer(data: bytes | memoryview) -> ToProducer:
    return decode_frame(_to_producer, data, MAX_TO_PRODUCER_BYTES)


def decode_to_consumer(data: bytes | memoryview) -> ToConsumer:
    return decode_frame(_to_consumer, data, MAX_TO_CONSUMER_BYTES)


def decode_notif(data: bytes) -> LayerRead:
    return decode_frame(_notif, data, MAX_TO_PRODUCER_BYTES)
