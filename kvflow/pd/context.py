"""`PeerContext`: a peer transport's `TransportContext`, with what P/D needs.

A store transport knows where it runs and what it serves (`kvflow.transport.
TransportContext`). A peer transport also holds the deployment's side-channel security
(`channel`), reports each frame it refuses (`rejected`), bounds the wait for a
producer's next message (`progress_timeout_s`), and reads each request from the
producer ranks that hold this rank's heads (`peer_reads`, by `kvflow.geometry.topology`).
kvflow's adapter builds a `PeerContext` for a peer transport; a `PeerTransport` given a
plain `TransportContext` (a test, a benchmark) takes it with these fields' defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..geometry.topology import HeadRead, TopologyError, plan_reads, readers
from ..transport import PeerSource, Transport, TransportContext, TransportError
from .security import Channel

__all__ = ["PeerContext", "PeerRead", "channel_of_transport"]


@dataclass
class PeerContext(TransportContext):
    """Where a peer transport instance runs, what it serves, and how it meets peers."""

    channel: Channel = field(default_factory=Channel)
    """The deployment's side-channel security (peer transports seal every control
    frame with it and refuse peers without the key; `kvflow.pd.security`)."""
    rejected: Callable[[str, str], None] | None = None
    """Set by kvflow's vLLM adapter: a peer transport calls it with a reason from
    `kvflow.pd.security.REJECT_REASONS` and a detail for each frame it refuses (the
    counter `vllm:kvflow_rejected_total`)."""
    progress_timeout_s: float = 2.0
    """Consumers: the longest a pull waits for its producer's next message (kvflow's
    `progress_timeout_s`); past it the producer is dead or hung."""

    @classmethod
    def of(cls, context: TransportContext, **changes: Any) -> PeerContext:
        """A new context with `context`'s `TransportContext` fields (their values shared,
        not copied) and `changes` over them and the peer fields' defaults. Fields set on
        `context` afterwards do not reach it."""
        mine = {f.name: getattr(context, f.name) for f in dataclasses.fields(TransportContext)}
        return cls(**{**mine, **changes})

    def peer_address(self, src: PeerSource) -> str:
        """The producer endpoint serving this worker's shard; a `TransportError` if the
        producer has another number of shards (another tensor/pipeline parallel shape)."""
        if len(src.addresses) != len(self.shards):
            raise TransportError(
                f"producer {src.engine_id} runs {len(src.addresses)} worker shard(s), this "
                f"consumer {len(self.shards)}; this pull needs equal parallel shapes",
                chunk=0,
            )
        return src.addresses[self.shards.index(self.shard)]

    def peer_reads(self, src: PeerSource) -> list[PeerRead]:
        """Where this worker pulls its part of `src` from: its own shard's endpoint, whole
        blocks, when the producer has this engine's tensor parallel size; else the heads
        this rank holds from the producer ranks that hold them (`kvflow.geometry.topology`)."""
        if src.tp_size == self.tp_size:
            return [PeerRead(self.peer_address(src))]
        stage = src.addresses[self.pp_rank * src.tp_size : (self.pp_rank + 1) * src.tp_size]
        try:
            count = readers(src.kv_heads, src.tp_size, self.tp_size)
            reads = plan_reads(src.kv_heads, src.tp_size, self.tp_size, self.tp_rank)
        except TopologyError as exc:
            raise TransportError(f"producer {src.engine_id}: {exc}", chunk=0) from None
        if len(stage) != src.tp_size:
            raise TransportError(f"producer {src.engine_id}: too few addresses", chunk=0)
        return [PeerRead(stage[r.rank], r, count[r.rank]) for r in reads]


@dataclass(frozen=True)
class PeerRead:
    """One producer endpoint a consumer worker reads (`PeerContext.peer_reads`)."""

    address: str
    heads: HeadRead | None = None
    """Which heads, from which into which; None: every head, as they lie."""
    readers: int = 1
    """How many of the consumer's ranks read this producer rank (it holds the blocks until
    all are done)."""


def channel_of_transport(transport: Transport) -> Channel:
    """The side channel `transport` meets its peers over (keyless for a store)."""
    context = transport.context
    return context.channel if isinstance(context, PeerContext) else Channel()
