"""The `zmq` transport's control frames: msgspec msgpack, typed, size-bounded. No pickle.

A pull is one DEALER->ROUTER conversation:

    consumer -> producer   Pull(req, block_ids, geometries, heads, readers, nonce)
    producer -> consumer   Layer(req, layer, sizes, cells) + one raw frame per span, per layer
                           (host memory), or
                           Ipc(req, host, geometries, block_ids, lease_s, handles) (CUDA memory:
                           the consumer copies device to device), or
                           Refused(req, reason);
                           before a layer, Computing(req) while a streamed offer's prefill
                           has not computed it (every `progress_timeout_s / 2`)
    consumer -> producer   Done(req) | Failed(req, reason)

and, from the consumer's scheduler while the request waits (`kvflow.pd.offers`):

    consumer -> producer   Renew(reqs, lease_ms, release, nonce, consumer)
    producer -> consumer   Renewed(refused, pending, params)

Keyed, every control frame carries a MAC toward its side (`Channel.seal`), and a
producer's answers are bound to their request's `nonce` and their index among its
answers (counting every `Computing` and `Layer`), so an answer of another pull, a
reordered one or a consumer's frame sent back fails it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kvflow.geometry.layout import LayerGeometry
from kvflow.pd.offers import Nonce, OfferId, Renew
from kvflow.pd.params import MAX_SHARDS
from kvflow.zmqio import decode_frame

from ._ipc import IpcHandle

WIRE_VERSION = 9
MAX_CONTROL_BYTES = 1 << 20
MAX_BLOCKS = 1 << 20
MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 12

BlockIds = Annotated[list[Annotated[int, Meta(ge=0, lt=1 << 31)]], Meta(max_length=MAX_BLOCKS)]
Reason = Annotated[str, Meta(max_length=4096)]


Count = Annotated[int, Meta(ge=0, le=MAX_HEADS)]


class Heads(msgspec.Struct, frozen=True):
    """Heads `[first, first + count)` of the producer's blocks (`kvflow.geometry.topology`)."""

    first: Count
    count: Count


class Pull(msgspec.Struct, tag=True, frozen=True):
    req: OfferId
    block_ids: BlockIds = []
    """The offered blocks this consumer wants (it may have a prefix already); [] all."""
    version: int = WIRE_VERSION
    geometries: Annotated[list[LayerGeometry], Meta(max_length=MAX_LAYERS)] = []
    """The consumer's layers: a producer refuses a pull into blocks of another layout."""
    heads: Heads | None = None
    """A consumer rank of another tensor-parallel size: only these heads; None: all."""
    readers: Annotated[int, Meta(ge=1, le=MAX_SHARDS)] = 1
    """How many of the consumer's ranks pull this offer (the producer holds it until every
    one of them is done)."""
    nonce: Nonce = b""
    """The consumer's random bytes for this pull: every answer is bound to them."""


class Layer(msgspec.Struct, tag=True, frozen=True):
    req: OfferId
    layer: int
    sizes: list[int]
    """Byte size of each data frame that follows, chunk by chunk, span by span."""
    cells: bool = False
    """A frame a chunk holding the cells of the heads asked for, token-major (`[tokens,
    heads, cell]`: `kvflow.geometry.cells.cell_index`), for a consumer whose runs of them differ
    (another layout or head count); False: the producer's runs as they lie."""


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
    req: OfferId
    reason: Reason


class Computing(msgspec.Struct, tag=True, frozen=True):
    """The next layer is not computed yet (a streamed offer): the producer is alive."""

    req: OfferId


class Done(msgspec.Struct, tag=True, frozen=True):
    req: OfferId


class Failed(msgspec.Struct, tag=True, frozen=True):
    req: OfferId
    reason: Reason


ToProducer = Pull | Done | Failed | Renew
ToConsumer = Layer | Ipc | Refused | Computing

_encoder = msgspec.msgpack.Encoder()
_to_producer = msgspec.msgpack.Decoder(ToProducer)
_to_consumer = msgspec.msgpack.Decoder(ToConsumer)


def encode(msg: ToProducer | ToConsumer) -> bytes:
    return _encoder.encode(msg)


def decode_to_producer(data: bytes | memoryview) -> ToProducer:
    return decode_frame(_to_producer, data, MAX_CONTROL_BYTES)


def decode_to_consumer(data: bytes | memoryview) -> ToConsumer:
    return decode_frame(_to_consumer, data, MAX_CONTROL_BYTES)
