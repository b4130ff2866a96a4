"""The `zmq` transport's control frames: msgspec msgpack, typed, size-bounded. No pickle.

A pull is one DEALER->ROUTER conversation:

    consumer -> producer   Pull(req)
    producer -> consumer   Layer(req, layer, sizes) + one raw frame per span, per layer
                           (host memory), or
                           Ipc(req, host, geometries, block_ids, handles) (CUDA memory:
                           the consumer copies device to device), or
                           Refused(req, reason)
    consumer -> producer   Done(req) | Failed(req, reason)
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from kvflow.layout import LayerGeometry

from ._ipc import IpcHandle

T = TypeVar("T")

WIRE_VERSION = 1
MAX_CONTROL_BYTES = 1 << 20


class Pull(msgspec.Struct, tag=True, frozen=True):
    req: str
    version: int = WIRE_VERSION


class Layer(msgspec.Struct, tag=True, frozen=True):
    req: str
    layer: int
    sizes: list[int]
    """Byte size of each data frame that follows, chunk by chunk, span by span."""


class Ipc(msgspec.Struct, tag=True, frozen=True):
    req: str
    host: str
    """`_ipc.host_id()` of the producer: the handles open on that host only."""
    geometries: list[LayerGeometry]
    block_ids: list[int]
    """The offered blocks, in chunk order."""
    lease_s: float
    """The consumer must have copied everything within this long of receiving this."""
    handles: list[IpcHandle]
    """One per layer, exported once at registration."""


class Refused(msgspec.Struct, tag=True, frozen=True):
    req: str
    reason: str


class Done(msgspec.Struct, tag=True, frozen=True):
    req: str


class Failed(msgspec.Struct, tag=True, frozen=True):
    req: str
    reason: str


ToProducer = Pull | Done | Failed
ToConsumer = Layer | Ipc | Refused

_encoder = msgspec.msgpack.Encoder()
_to_producer = msgspec.msgpack.Decoder(ToProducer)
_to_consumer = msgspec.msgpack.Decoder(ToConsumer)


class BadFrame(ValueError):
    """A control frame that is too large or does not decode."""


def encode(msg: ToProducer | ToConsumer) -> bytes:
    return _encoder.encode(msg)


def _decode(decoder: msgspec.msgpack.Decoder[T], data: bytes | memoryview) -> T:
    if len(data) > MAX_CONTROL_BYTES:
        raise BadFrame(f"control frame of {len(data)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise BadFrame(f"undecodable control frame: {exc}") from None


def decode_to_producer(data: bytes | memoryview) -> ToProducer:
    return _decode(_to_producer, data)


def decode_to_consumer(data: bytes | memoryview) -> ToConsumer:
    return _decode(_to_consumer, data)
