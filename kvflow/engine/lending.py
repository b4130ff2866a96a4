"""The life of a request's blocks while kvflow's transfers use them (a worker's one owner).

kvflow *uses* a request's blocks while a save reads them or an offer holds them for
a P/D consumer. vLLM owns the blocks throughout, except that, when the request
finishes while a use is under way, it *lends* them to kvflow until kvflow says they
are free (vLLM's `finished_sending`). A request's blocks are in one of these states:

    in use ──(vLLM finishes the request: lent)──▶ lent ──(last use ends)──▶ released
    in use ──(last use ends)──────────────────────▶ vLLM's alone (nothing to report)
    lent, with no use left (or none at all) ──────────────────────────────▶ released

`released` is reported to vLLM once (`take_released`). The ends of a use:

- it completes or fails (`end`);
- **preempted**: vLLM takes the running request's blocks back; `cancel` cancels its
  uses and vLLM waits (`ended`) until none reads them any more;
- **reused**: vLLM hands out again a block a save still reads (a sliding window's);
  it waits until no save reads it (`idle`), or cancels those saves (`cancel_over`);
- **expired**: an offer's hold deadline (the worker's offer transfer) ends its use;
- **loop gone**: nothing can use a block any more: every lent request is released
  at once (`release_all`).

A save counts the blocks it reads from the moment vLLM's thread binds it
(`bound`), so a block reused in the next step is known busy even before the save's
task runs.

Who calls it: the scheduler process decides what is lent (`lent_at_finish`, its
answer to vLLM's `request_finished`) and ships it to the workers (`WorkerPlan.lent`,
the hidden-state exports); each worker's `WorkerEngine` and `kvflow.engine.transfers` keep one
`Lending` per KV cache group, the adapter's hidden-state exporter one of its own,
and the adapter joins a request's releases over them before vLLM hears of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import trio

__all__ = ["Lending", "lent_at_finish"]


def lent_at_finish(*, saving: bool, offering: bool = False, exporting: bool = False) -> bool:
    """Whether vLLM lends a finished request's blocks to kvflow: a save of it was issued
    (it may still read them), they are offered to a P/D consumer, or its hidden states
    are to be copied out of them. The scheduler's answer to `request_finished`."""
    return saving or offering or exporting


class Lending:
    """Which of a worker's requests' blocks kvflow uses, and when vLLM may have them back.

    vLLM's thread calls `bound`, `busy`, `take_released` and `release_all`; the
    runtime's loop thread calls the rest."""

    def __init__(self, on_release: Callable[[str], None] = lambda req: None) -> None:
        self._on_release = on_release
        """Called (loop thread) when a lent request is released."""
        self._lock = threading.Lock()
        # under the lock (both threads)
        self._reading: dict[int, int] = {}
        """Block -> how many saves read it."""
        self._released: set[str] = set()
        # vLLM's thread
        self._open: set[str] = set()
        """Lent and not reported released yet: what `release_all` hands back."""
        # the loop thread
        self._lent: set[str] = set()
        self._uses: dict[str, int] = {}
        self._scopes: dict[str, set[trio.CancelScope]] = {}
        self._blocks: dict[trio.CancelScope, list[int]] = {}
        self._why: dict[trio.CancelScope, str] = {}
        self._changed: trio.Event | None = None

    # -- vLLM's thread ---------------------------------------------------------
    def bound(self, lent: Iterable[str], save_blocks: Iterable[list[int]]) -> None:
        """A step's plan: requests vLLM lends now, and the blocks its saves will read."""
        self._open.update(lent)
        with self._lock:
            for blocks in save_blocks:
                for b in blocks:
                    self._reading[b] = self._reading.get(b, 0) + 1

    def busy(self, blocks: Iterable[int]) -> set[int]:
        """Which of `blocks` a save reads."""
        with self._lock:
            return {b for b in blocks if b in self._reading}

    def take_released(self) -> set[str]:
        """Requests released since the last call (each reported once)."""
        with self._lock:
            out, self._released = self._released, set()
        self._open -= out
        return out

    def release_all(self) -> set[str]:
        """The loop is gone (no use runs, none will start): every lent request not
        reported yet, released now."""
        out = self._open | self.take_released()
        self._open.clear()
        return out

    # -- the loop thread -------------------------------------------------------
    def start(
        self, req: str, scope: trio.CancelScope | None = None, blocks: list[int] | None = None
    ) -> None:
        """A use of `req`'s blocks starts: a save, cancelled through `scope`, that reads
        `blocks` (counted at `bound`), or an offer (no scope)."""
        self._uses[req] = self._uses.get(req, 0) + 1
        if scope is not None:
            self._scopes.setdefault(req, set()).add(scope)
            self._blocks[scope] = blocks or []

    def end(self, req: str, scope: trio.CancelScope | None = None) -> None:
        """A use of `req`'s blocks ended; the request is released if lent and it was
        the last."""
        if scope is not None:
            self._scopes[req].discard(scope)
            if not self._scopes[req]:
                del self._scopes[req]
            self._why.pop(scope, None)
            with self._lock:
                for b in self._blocks.pop(scope, ()):
                    if (left := self._reading.pop(b) - 1) > 0:
                        self._reading[b] = left
        self._uses[req] -= 1
        self._maybe_release(req)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def lend(self, req: str) -> None:
        """vLLM finished `req` and lent its blocks."""
        self._lent.add(req)
        self._maybe_release(req)

    def why(self, scope: trio.CancelScope) -> str:
        """Why the save under `scope` was cancelled."""
        return self._why.get(scope, "request preempted")

    def drop(self, scope: trio.CancelScope, why: str) -> None:
        """Cancel the save under `scope`, saying why."""
        self._why[scope] = why
        scope.cancel()

    def cancel(self, reqs: Iterable[str]) -> None:
        """Preempted: cancel every save of `reqs`."""
        for req in reqs:
            for scope in self._scopes.get(req, ()):
                scope.cancel()

    def cancel_over(self, blocks: set[int], why: str) -> None:
        """Cancel every save that reads one of `blocks`."""
        for scope, reading in self._blocks.items():
            if not blocks.isdisjoint(reading):
                self.drop(scope, why)

    async def ended(self, reqs: Iterable[str]) -> None:
        """Wait until no use of `reqs` runs."""
        reqs = list(reqs)
        while any(self._uses.get(r, 0) > 0 for r in reqs):
            await self._change()

    async def idle(self, blocks: set[int]) -> None:
        """Wait until no save reads any of `blocks`."""
        while self.busy(blocks):
            await self._change()

    async def drained(self) -> None:
        """Wait until no use runs at all."""
        while any(n > 0 for n in self._uses.values()):
            await self._change()

    def _maybe_release(self, req: str) -> None:
        if req in self._lent and self._uses.get(req, 0) == 0:
            self._lent.discard(req)
            self._uses.pop(req, None)
            with self._lock:
                self._released.add(req)
            self._on_release(req)

    async def _change(self) -> None:
        """Wait until some use ends (any number of waiters)."""
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()
