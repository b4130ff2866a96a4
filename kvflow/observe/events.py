"""The event vocabulary and the bus that carries it.

What a connector sees and does (vLLM's calls, the transfers they start, input
it refuses, tasks that fail) becomes one of these msgspec Structs
(a tagged union, so a stream of them decodes without pickle). Events are
emitted on the runtime's trio thread only; subscribers (stats, the event log,
the live `kvflow inspect` stream) are called in order and must not
block.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

import msgspec

__all__ = [
    "BlocksAllocated",
    "BlocksReleased",
    "CachesRegistered",
    "ClaimSeen",
    "ClaimSent",
    "Event",
    "EventBus",
    "FirstToken",
    "LayerComputed",
    "LayerLoaded",
    "LoadReported",
    "LoadStarted",
    "LookupAnswered",
    "LookupRequested",
    "OfferStreamed",
    "Origin",
    "Rejected",
    "RequestArrived",
    "RequestFinished",
    "RequestScheduled",
    "SaveStarted",
    "StepBound",
    "StepPlanned",
    "TaskFailed",
    "TierRead",
    "TierWrite",
    "TransferDone",
    "TransferFailed",
    "decode_event",
    "encode_event",
]

log = logging.getLogger("kvflow.events")

Direction = Literal["load", "save", "send"]
What = Literal["kv", "hidden_states"]
"""What a save moves: KV, or a request's hidden states (`kvflow.hidden_states`)."""


class Origin(msgspec.Struct, frozen=True):
    """Which runtime emitted an event."""

    engine: str
    role: Literal["scheduler", "worker"]
    rank: int = 0


_UNSET = Origin("", "scheduler")


class _Base(msgspec.Struct, tag=True, kw_only=True):
    ts: float = msgspec.field(default_factory=time.monotonic)
    origin: Origin = _UNSET
    req: str = ""


# scheduler side
class LookupRequested(_Base):
    num_tokens: int
    num_chunks: int


class LookupAnswered(_Base):
    hit_tokens: int
    elapsed_s: float
    error: str = ""


class BlocksAllocated(_Base):
    num_blocks: int
    external_tokens: int


class StepPlanned(_Base):
    step: int
    loads: int
    saves: int


class RequestFinished(_Base):
    lent: bool
    blocks: int = 0
    """How many blocks vLLM lends (0 unless `lent`)."""
    offer: str = ""
    """A P/D producer's: the offer its blocks are held under (`PdParams.offer`)."""


class OfferStreamed(_Base):
    """A P/D producer offered a streamed request's blocks as `offer` in the step that
    computes its prompt's last tokens (`step`), before they are computed."""

    offer: str
    step: int
    blocks: int


class RequestArrived(_Base):
    """vLLM handed kvflow a new request of `tokens` prompt tokens; `offer`: the P/D
    offer its params name (a consumer's P/D request), else ""."""

    tokens: int
    offer: str = ""


class ClaimSent(_Base):
    """A P/D consumer sent its first claim on the request's offer."""


class LoadReported(_Base):
    """vLLM's scheduler heard that the request's load ended (`finished_recving`; not
    `ok`: `failed_recving`)."""

    ok: bool = True


class RequestScheduled(_Base):
    """vLLM scheduled the P/D request to compute, after its pull, in step `step`."""

    step: int


class FirstToken(_Base):
    """The step that computed the P/D request's first token is over (vLLM planned the
    step after it, or the request finished)."""

    step: int


# worker side
class CachesRegistered(_Base):
    num_layers: int
    nbytes: int
    memory: str
    layout: str


class StepBound(_Base):
    step: int
    loads: int
    saves: int


class LoadStarted(_Base):
    chunks: int
    tokens: int
    nbytes: int
    transport: str


class LayerLoaded(_Base):
    layer: int


class LayerComputed(_Base):
    step: int
    layer: int


class SaveStarted(_Base):
    chunks: int
    tokens: int
    nbytes: int
    transport: str
    what: What = "kv"


class TransferDone(_Base):
    direction: Direction
    chunks: int
    nbytes: int
    elapsed_s: float
    what: What = "kv"


class TransferFailed(_Base):
    direction: Direction
    reason: str
    block_ids: list[int] = []
    timed_out: bool = False
    what: What = "kv"


class BlocksReleased(_Base):
    pass


class ClaimSeen(_Base):
    """A P/D producer's worker: a consumer claimed the request's offer (its first renewal)."""


class TierRead(_Base):
    """A load went through a host-memory tier (`kvflow.tiers`): `hits` chunks came from
    it, `misses` from the store below, `promoted` of those were kept in it, `evicted`
    chunks were dropped from it to make room for them."""

    tier: str
    hits: int
    misses: int
    promoted: int
    nbytes: int
    evicted: int = 0


class TierWrite(_Base):
    """A save went through a host-memory tier: `stored` chunks were copied into it (then
    vLLM got its blocks back, and the store below got them from the tier), `evicted`
    chunks were dropped from it to make room; `through`: chunks it had no room for,
    saved to the store directly. `nbytes`: bytes copied in."""

    tier: str
    stored: int
    through: int
    evicted: int
    nbytes: int


# either side
class Rejected(_Base):
    """Input from outside that kvflow refused: P/D params (scheduler) or a side-channel
    frame (worker). `reason` is one of `kvflow.pd.security.REJECT_REASONS`."""

    reason: str
    detail: str = ""


class TaskFailed(_Base):
    """A long-lived task (`kvflow.runtime.supervised`: a peer transport's `serve`, the
    P/D claims) ended by an exception: started again, or, `given_up`, not (the engine
    then stops: it must not serve with the task's work silently off)."""

    task: str
    error: str
    given_up: bool = False


Event = (
    LookupRequested
    | LookupAnswered
    | BlocksAllocated
    | StepPlanned
    | RequestFinished
    | RequestArrived
    | ClaimSent
    | LoadReported
    | RequestScheduled
    | FirstToken
    | CachesRegistered
    | StepBound
    | LoadStarted
    | LayerLoaded
    | LayerComputed
    | SaveStarted
    | TransferDone
    | TransferFailed
    | BlocksReleased
    | ClaimSeen
    | OfferStreamed
    | TierRead
    | TierWrite
    | Rejected
    | TaskFailed
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Event)


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes) -> Event:
    return _decoder.decode(data)


Subscriber = Callable[[Event], None]


class EventBus:
    """Stamps events with their origin and hands them to subscribers in order.

    A subscriber that raises is logged and kept; one bad consumer must not stop
    the transfers or the other consumers.
    """

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self._subscribers: list[Subscriber] = []

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn)

    def emit(self, event: Event) -> None:
        event.origin = self.origin
        for fn in self._subscribers:
            try:
                fn(event)
            except Exception:
                log.exception("event subscriber %r failed on %s", fn, type(event).__name__)
