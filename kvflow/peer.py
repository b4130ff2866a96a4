"""Producer-side block lifetime for peer transports (prefill/decode disaggregation).

A producer holds a finished request's blocks until one of three things happens:
the consumer confirms its pull, the consumer reports failure, or the hold
deadline passes (the worker cancels `Transport.offer`). In every case the
blocks go back to vLLM only once no read of them is in flight. `HeldOffers`
is that bookkeeping, shared by every peer transport so each one gets it right
the same way: `offer()` implements `Transport.offer`, the transport's serving
task looks offers up, wraps each read in `reading()` and calls `release()`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio

from .transport import Offer

__all__ = ["HeldOffers", "NotHeld", "select_blocks"]


def select_blocks(offer: Offer, block_ids: Sequence[int]) -> Offer | None:
    """The part of `offer` a consumer pulls: the chunks in `block_ids` (all of them if
    empty). A consumer that already has a prefix of the prompt (its prefix cache) pulls
    only the rest. None if a block is not offered."""
    if not block_ids:
        return offer
    where = {b: i for i, b in enumerate(offer.block_ids)}
    if any(b not in where for b in block_ids):
        return None
    idx = [where[b] for b in block_ids]

    def spans(layer: int) -> list[list[memoryview]]:
        chunks = offer.spans(layer)
        return [chunks[i] for i in idx]

    counts = [offer.token_counts[i] for i in idx]
    return Offer(offer.req, list(block_ids), counts, offer.num_layers, spans)


class NotHeld(KeyError):
    """The request is not held (never offered, expired, or closing)."""


@dataclass
class _Held:
    offer: Offer
    released: trio.Event = field(default_factory=trio.Event)
    """Set when the consumer answered (done or failed)."""
    outcome: str = ""
    closed: bool = False
    """Set when `offer()` ends: no new pull or read may start."""
    peer: object = None
    """The consumer that claimed the pull (a socket identity, an agent name)."""
    readers: int = 0
    idle: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


class HeldOffers:
    """Offers a producer holds, by request id; trio-only (one loop owns it)."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def _open(self, req: str) -> _Held | None:
        held = self._held.get(req)
        if held is None or held.closed or held.released.is_set():
            return None
        return held

    def __contains__(self, req: str) -> bool:
        return self._open(req) is not None

    def get(self, req: str) -> Offer | None:
        held = self._open(req)
        return None if held is None else held.offer

    def claim(self, req: str, peer: object) -> str:
        """Reserve `req` for the consumer `peer`: "" if it may pull, else why not. One
        consumer pulls a request; a second is refused, and only the claimer's answer
        counts (`release(..., peer=)`)."""
        held = self._open(req)
        if held is None:
            return "unknown or expired request"
        if held.peer is not None and held.peer != peer:
            return "already being pulled by another consumer"
        held.peer = peer
        return ""

    async def offer(self, offer: Offer) -> str:
        """Hold `offer` until released; return the outcome ("done" or the consumer's
        reason). When cancelled, return only after every read of the blocks ended."""
        held = self._held[offer.req] = _Held(offer)
        try:
            await held.released.wait()
            return held.outcome
        finally:
            held.closed = True  # at once: nothing new may read the blocks from here on
            with trio.CancelScope(shield=True):
                while held.readers:
                    await held.idle.wait()
            if self._held.get(offer.req) is held:
                del self._held[offer.req]

    def release(self, req: str, outcome: str, peer: object = None) -> bool:
        """The consumer is done with `req` ("done") or failed (its reason). With `peer`,
        only the consumer that claimed the pull may release it. Returns whether it did."""
        held = self._held.get(req)
        if held is None or held.released.is_set():
            return False
        if peer is not None and peer != held.peer:
            return False
        held.outcome = outcome
        held.released.set()
        return True

    async def lend(
        self,
        req: str,
        lease_s: float,
        *,
        task_status: trio.TaskStatus[bool] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """A peer reads `req`'s blocks by itself (CUDA IPC, RDMA) until it answers or
        `lease_s` passes; the blocks stay held meanwhile, also past the hold deadline. The
        peer must not trust what it read after the lease ended (the blocks may be vLLM's
        again). Start it with `nursery.start` before telling the peer where the blocks
        are, so the read is registered before the peer can begin; it starts with False
        (and returns) if `req` is not held."""
        held = self._open(req)
        if held is None:
            task_status.started(False)
            return
        with self.reading(req):
            task_status.started(True)
            with trio.move_on_after(lease_s):
                await held.released.wait()

    @contextmanager
    def reading(self, req: str) -> Iterator[Offer]:
        """Mark a read of `req`'s blocks in flight; its blocks stay held until it ends.
        Raises `NotHeld` if `req` is not held."""
        held = self._open(req)
        if held is None:
            raise NotHeld(req)
        if held.readers == 0:
            held.idle = trio.Event()
        held.readers += 1
        try:
            yield held.offer
        finally:
            held.readers -= 1
            if held.readers == 0:
                held.idle.set()
