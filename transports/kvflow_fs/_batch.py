"""Calls that come together run together, in one worker thread.

A burst of requests (a benchmark's, a client's batch) makes as many lookups at once,
each a few `stat` calls: a worker thread round trip each cost more than the calls,
and on vLLM's engine core, whose scheduler thread holds the GIL while requests wait,
each round trip waited for the GIL too (bench/bench_sched_scale.py, decision 96).
`Batched` runs the items of the calls waiting when a batch starts in one thread call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import trio

__all__ = ["Batched"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False)  # each call is itself (`in` the queue)
class _Call(Generic[T, R]):
    item: T
    woken: trio.Event = field(default_factory=trio.Event)
    """Set when its result is in, or when it is asked to run the next batches."""
    done: bool = False
    result: R | None = None
    error: BaseException | None = None


class Batched(Generic[T, R]):
    """`await batched(item)` is `fn([item])[0]`, run in a worker thread together with the
    items of the calls that wait meanwhile (at most `limit` a batch). One caller at a
    time runs batches until none waits; if it is cancelled, the first waiting caller
    takes over, so no call waits on a batch nobody runs. An exception `fn` raises is
    raised by every call of its batch."""

    def __init__(self, fn: Callable[[list[T]], list[R]], limit: int = 1024) -> None:
        self._fn = fn
        self._limit = limit
        self._queue: list[_Call[T, R]] = []
        self._running = False

    async def __call__(self, item: T) -> R:
        call: _Call[T, R] = _Call(item)
        self._queue.append(call)
        try:
            while not call.done:
                if self._running:
                    await call.woken.wait()
                    call.woken = trio.Event()
                else:
                    await self._run()
        except BaseException:  # cancelled: waiting, or running batches
            if call in self._queue:  # never ran
                self._queue.remove(call)
            if not self._running and self._queue:  # nobody runs the next batch: the
                self._queue[0].woken.set()  # first call waiting does
            raise
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]  # R, set with done

    async def _run(self) -> None:
        self._running = True
        try:
            while self._queue:
                batch = self._queue[: self._limit]  # left queued if cancelled before it runs
                try:  # not abandoned once started: every call of the batch gets its result
                    results = await trio.to_thread.run_sync(self._fn, [c.item for c in batch])
                except Exception as exc:
                    for c in batch:
                        c.error = exc
                else:
                    for c, r in zip(batch, results, strict=True):
                        c.result = r
                ran = {id(c) for c in batch}
                self._queue = [c for c in self._queue if id(c) not in ran]  # more came
                for c in batch:
                    c.done = True
                    c.woken.set()
        finally:
            self._running = False
