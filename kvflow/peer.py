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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio

from .transport import Offer

__all__ = ["HeldOffers"]


@dataclass
class _Held:
    offer: Offer
    released: trio.Event = field(default_factory=trio.Event)
    outcome: str = ""
    readers: int = 0
    idle: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


class HeldOffers:
    """Offers a producer holds, by request id; trio-only (one loop owns it)."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def __contains__(self, req: str) -> bool:
        return req in self._held

    def get(self, req: str) -> Offer | None:
        held = self._held.get(req)
        return None if held is None else held.offer

    async def offer(self, offer: Offer) -> str:
        """Hold `offer` until released; return the outcome ("done" or the consumer's
        reason). When cancelled, return only after every read of the blocks ended."""
        held = self._held[offer.req] = _Held(offer)
        try:
            await held.released.wait()
            return held.outcome
        finally:
            with trio.CancelScope(shield=True):
                await held.idle.wait()
            if self._held.get(offer.req) is held:
                del self._held[offer.req]

    def release(self, req: str, outcome: str) -> bool:
        """The consumer is done with `req` ("done") or failed (its reason). Returns
        whether `req` was held."""
        held = self._held.get(req)
        if held is None or held.released.is_set():
            return False
        held.outcome = outcome
        held.released.set()
        return True

    async def lend(
        self,
        req: str,
        lease_s: float,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """A peer reads `req`'s blocks by itself (CUDA IPC, RDMA) until it releases them or
        `lease_s` passes; the blocks stay held meanwhile. The peer must not trust what it
        read after the lease ended (the blocks may be vLLM's again). Start it with
        `nursery.start` before telling the peer where the blocks are, so the read is
        registered before the peer can begin."""
        with self.reading(req):
            task_status.started()
            with trio.move_on_after(lease_s):
                await self._held[req].released.wait()

    @contextmanager
    def reading(self, req: str) -> Iterator[Offer]:
        """Mark a read of `req`'s blocks in flight; its blocks stay held until it ends.
        Raises `KeyError` if `req` is not held."""
        held = self._held[req]
        if held.readers == 0:
            held.idle = trio.Event()
        held.readers += 1
        try:
            yield held.offer
        finally:
            held.readers -= 1
            if held.readers == 0:
                held.idle.set()
