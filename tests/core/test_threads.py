"""kvflow.threads: a part of a transfer in a thread started for it."""

from __future__ import annotations

import functools
import threading

import pytest
import trio
import trio.testing

from kvflow.threads import in_new_thread


async def test_each_call_runs_in_a_thread_of_its_own_and_returns_its_value() -> None:
    seen: list[threading.Thread] = []

    def work(x: int) -> int:
        seen.append(threading.current_thread())
        return x * 2

    assert await in_new_thread(work, 21) == 42
    assert await in_new_thread(work, 1) == 2
    first, second = seen
    assert first is not second  # not a thread kept for the next call (trio's cache)
    assert first is not threading.main_thread() and first.name == "kvflow " + work.__qualname__
    assert not first.is_alive()


async def test_what_the_work_raises_is_raised_to_the_caller() -> None:
    def work() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        await in_new_thread(work)


async def test_a_cancel_waits_for_the_work_to_end() -> None:
    """The work may write into memory the caller hands back once cancelled."""
    started, release = threading.Event(), threading.Event()
    wrote: list[str] = []

    def work() -> None:
        started.set()
        release.wait(30)
        wrote.append("done")

    async def release_once_all_wait() -> None:
        await trio.testing.wait_all_tasks_blocked()
        release.set()

    async with trio.open_nursery() as outer:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(in_new_thread, work)
                await trio.to_thread.run_sync(started.wait)
                scope.cancel()
                outer.start_soon(release_once_all_wait)
        assert wrote == ["done"]


async def test_a_limiter_bounds_the_threads_running_at_once() -> None:
    limiter = trio.CapacityLimiter(1)
    first_in, let_go = threading.Event(), threading.Event()
    order: list[str] = []

    def first() -> None:
        order.append("first in")
        first_in.set()
        let_go.wait(30)
        order.append("first out")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(in_new_thread, first, limiter=limiter))
        await trio.to_thread.run_sync(first_in.wait)
        second = functools.partial(in_new_thread, order.append, "second", limiter=limiter)
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert limiter.statistics().tasks_waiting == 1
        let_go.set()
    assert order == ["first in", "first out", "second"]


async def test_a_call_in_a_cancelled_scope_starts_nothing() -> None:
    ran: list[int] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        await in_new_thread(ran.append, 1)
    assert scope.cancelled_caught
    assert ran == []


async def test_a_task_holding_the_limiter_may_still_call() -> None:
    """Each call borrows the limiter for itself, as `trio.to_thread.run_sync` does."""
    limiter = trio.CapacityLimiter(2)
    async with limiter:
        assert await in_new_thread(len, "abc", limiter=limiter) == 3
    assert limiter.borrowed_tokens == 0
