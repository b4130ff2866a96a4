"""kvflow.runtime: the one door from vLLM's threads into a trio loop."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from collections.abc import Callable

import pytest
import trio
import trio.testing

from kvflow import runtime
from kvflow.runtime import Runtime, RuntimeClosed, supervised

MakeRuntime = Callable[..., Runtime]
WAIT = 10.0  # generous bound on anything that should happen "soon"


def loop_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"kvflow-{name}"]


async def answer(x: int = 42) -> int:
    return x


# -- start, submit, spawn, call --------------------------------------------


def test_lazy_start_no_thread_before_first_use(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("lazy")
    assert not rt.running
    assert loop_threads("lazy") == []
    rt.submit(lambda: None)
    assert rt.running
    assert len(loop_threads("lazy")) == 1
    rt.start()  # idempotent: no second loop
    assert len(loop_threads("lazy")) == 1


def test_submit_and_spawn_run_on_the_loop_thread(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("where")
    seen: dict[str, tuple[threading.Thread, bool]] = {}
    done = {"submit": threading.Event(), "spawn": threading.Event()}

    def sync_fn(tag: str) -> None:
        seen[tag] = (threading.current_thread(), rt.in_loop_thread())
        done[tag].set()

    async def async_fn(tag: str) -> None:
        await trio.lowlevel.checkpoint()
        sync_fn(tag)

    rt.submit(sync_fn, "submit")
    rt.spawn(async_fn, "spawn", name="spawned")
    assert done["submit"].wait(WAIT) and done["spawn"].wait(WAIT)
    (loop_thread,) = loop_threads("where")
    for tag in ("submit", "spawn"):
        thread, in_loop = seen[tag]
        assert thread is loop_thread and thread is not threading.current_thread()
        assert in_loop
    assert not rt.in_loop_thread()


def test_call_returns_the_value(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("call")
    assert rt.call(answer, 7, timeout=WAIT) == 7


def test_call_propagates_the_exception(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("raise")

    async def fails() -> None:
        await trio.lowlevel.checkpoint()
        raise KeyError("no such chunk")

    with pytest.raises(KeyError, match="no such chunk"):
        rt.call(fails, timeout=WAIT)
    assert rt.call(answer, timeout=WAIT) == 42  # the loop is still fine
    assert rt.task_errors == 0  # an error handed back to the caller is not a task crash


def test_call_passes_on_a_timeout_error_the_task_raised(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("own-timeout")

    async def peer_timed_out() -> None:
        await trio.lowlevel.checkpoint()
        raise TimeoutError("peer did not answer")

    with pytest.raises(TimeoutError, match="peer did not answer"):
        rt.call(peer_timed_out, timeout=WAIT)


def test_call_times_out_and_cancels_the_task(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("timeout")
    cancelled = threading.Event()

    async def never_answers() -> None:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    with pytest.raises(TimeoutError, match="no answer"):
        rt.call(never_answers, timeout=0.2)
    assert cancelled.wait(WAIT), "the abandoned task kept running"


def test_call_from_the_loop_thread_raises(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("reentrant")
    outcome: list[BaseException | None] = []
    done = threading.Event()

    def inside() -> None:
        try:
            rt.call(answer, timeout=1.0)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        done.set()

    rt.submit(inside)
    assert done.wait(WAIT)
    assert isinstance(outcome[0], RuntimeError) and "deadlock" in str(outcome[0])


# -- errors inside the loop ------------------------------------------------


def test_failing_task_is_logged_and_counted(
    make_runtime: MakeRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="kvflow.runtime")
    rt = make_runtime("crashy")

    async def bad_task() -> None:
        await trio.lowlevel.checkpoint()
        raise ValueError("disk on fire")

    rt.spawn(bad_task, name="save:req-7")
    rt.call(trio.testing.wait_all_tasks_blocked, timeout=WAIT)  # bad_task has run by now
    assert rt.task_errors == 1
    (rec,) = [r for r in caplog.records if "save:req-7" in r.getMessage()]
    assert rec.exc_info is not None and isinstance(rec.exc_info[1], ValueError)
    assert rt.running
    assert rt.call(answer, timeout=WAIT) == 42


def test_failing_submitted_callback_does_not_kill_the_loop(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("cb")
    rt.start()
    (thread,) = loop_threads("cb")

    def bad_callback() -> None:
        raise ValueError("subscriber bug")

    rt.submit(bad_callback)
    rt.spawn(functools.partial(answer, 1))  # a callable without __name__ must not crash it
    assert rt.call(answer, timeout=WAIT) == 42
    assert rt.task_errors == 1
    assert loop_threads("cb") == [thread], "the loop died and was replaced"


# -- shutdown --------------------------------------------------------------


def test_shutdown_cancels_tasks_then_runs_closers(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("shutdown", close_timeout_s=5.0)
    order: list[str] = []
    sleeper_cancelled = threading.Event()
    work_started, release_work = threading.Event(), threading.Event()

    async def sleeper() -> None:
        try:
            await trio.sleep_forever()
        finally:
            order.append("sleeper cancelled")
            sleeper_cancelled.set()

    def bounded_work() -> str:
        work_started.set()
        release_work.wait(WAIT)
        return "done"

    async def in_thread() -> None:
        try:
            await trio.to_thread.run_sync(bounded_work)
            await trio.sleep_forever()
        except trio.Cancelled:
            order.append("thread task cancelled")
            raise

    async def closer() -> None:
        await trio.lowlevel.checkpoint()  # a closer may await (shielded)
        order.append("closer")

    rt.add_closer(closer)
    rt.spawn(sleeper)
    rt.spawn(in_thread)
    assert work_started.wait(WAIT)
    (thread,) = loop_threads("shutdown")

    result: list[bool] = []
    stopper = threading.Thread(target=lambda: result.append(rt.shutdown(timeout=WAIT)))
    stopper.start()
    assert sleeper_cancelled.wait(WAIT)
    assert "closer" not in order  # closers wait for every task, even one in a thread
    release_work.set()
    stopper.join(WAIT + 1)
    assert result == [True]
    assert order == ["sleeper cancelled", "thread task cancelled", "closer"]
    assert not thread.is_alive()
    assert not rt.running


def test_shutdown_never_hangs_on_a_stuck_thread(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("stuck", close_timeout_s=0.2)
    started, release = threading.Event(), threading.Event()

    def stuck() -> None:
        started.set()
        release.wait(WAIT)

    rt.spawn(trio.to_thread.run_sync, stuck)
    assert started.wait(WAIT)
    assert rt.shutdown(timeout=0.3) is False  # reported, not waited for
    assert started.is_set() and not release.is_set()  # it returned while the thread ran
    release.set()
    assert rt.shutdown(timeout=WAIT) is True  # idempotent; now it ends


def test_call_in_flight_at_shutdown_raises_runtime_closed(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("inflight")
    entered = threading.Event()
    outcome: list[BaseException] = []

    async def waits() -> None:
        entered.set()
        await trio.sleep_forever()

    def caller() -> None:
        try:
            rt.call(waits, timeout=WAIT)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=caller)
    t.start()
    assert entered.wait(WAIT)
    assert rt.shutdown(timeout=WAIT)
    t.join(WAIT)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeClosed)


def test_use_after_shutdown_neither_raises_nor_hangs(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("after")
    assert rt.call(answer, timeout=WAIT) == 42
    assert rt.shutdown(timeout=WAIT)
    ran = threading.Event()
    outcome: list[object] = []

    def use() -> None:
        rt.submit(ran.set)
        rt.spawn(answer)
        try:
            rt.call(answer, timeout=WAIT)
        except RuntimeClosed as exc:
            outcome.append(exc)

    t = threading.Thread(target=use)
    t.start()
    t.join(WAIT)
    assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeClosed)
    assert not ran.is_set() and not rt.running
    assert loop_threads("after") == []


def test_shutdown_of_a_never_started_runtime(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("never")
    assert rt.shutdown(timeout=1.0) is True
    assert loop_threads("never") == []


# -- deadlines under a mock clock ------------------------------------------


def test_mock_clock_deadline_fires_instantly(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("mock", clock=trio.testing.MockClock(autojump_threshold=0))

    async def deadline() -> tuple[bool, float]:
        t0 = trio.current_time()
        with trio.move_on_after(30) as scope:
            await trio.sleep_forever()
        return scope.cancelled_caught, trio.current_time() - t0

    caught, virtual = rt.call(deadline, timeout=WAIT)  # WAIT < 30: virtual time only
    assert caught
    assert virtual >= 30.0


# -- fork ------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_gets_a_fresh_loop(make_runtime: MakeRuntime) -> None:
    rt = make_runtime("fork")
    parent_pid = os.getpid()

    async def where() -> int:
        await trio.to_thread.run_sync(lambda: None)  # trio's thread cache works there too
        return os.getpid()

    assert rt.call(where, timeout=WAIT) == parent_pid
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            signal.alarm(20)  # backstop: a hung child dies instead of hanging the parent
            ok = not rt.running and rt.call(where, timeout=WAIT) == os.getpid() and rt.running
            code = 0 if ok and rt.shutdown(timeout=WAIT) else 3
        except BaseException:
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert rt.call(where, timeout=WAIT) == parent_pid  # the parent's loop is untouched


# -- cost ------------------------------------------------------------------


def test_submits_run_in_order_once_each(make_runtime: MakeRuntime) -> None:
    # what a submit costs vLLM's thread is measured in bench/bench_event_stream.py
    rt = make_runtime("order")
    rt.start()
    seen: list[int] = []
    n = 5000
    for i in range(n):
        rt.submit(seen.append, i)
    rt.call(answer, timeout=WAIT)  # FIFO: every submit has run before this answers
    assert seen == list(range(n))


def test_the_loop_and_its_transfer_threads_run_on_the_cores_given() -> None:
    """vLLM's CPU workers start kvflow pinned to their compute core; `cpus` moves the loop
    and the threads transfers run in (`trio.to_thread`) to the spare ones. In a fresh
    process, as a vLLM worker is: trio reuses idle threads process-wide, and threads
    other trio loops started keep their own cores."""
    import ast
    import subprocess
    import sys

    last = max(os.sched_getaffinity(0))
    code = f"""
import os, trio
from kvflow.runtime import Runtime
rt = Runtime("pinned", cpus={{{last}}})
async def where():
    return os.sched_getaffinity(0), await trio.to_thread.run_sync(os.sched_getaffinity, 0)
print([sorted(os.sched_getaffinity(0))] + [sorted(c) for c in rt.call(where, timeout=10)])
rt.shutdown(5)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    caller, loop, worker = ast.literal_eval(out.stdout)
    assert loop == worker == [last]
    assert caller == sorted(os.sched_getaffinity(0))  # the thread that started it keeps its


def test_a_supervised_task_that_fails_is_started_again(
    make_runtime: MakeRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    """A long-lived task (a peer transport's serve, the claims' renewals) that ends by an
    exception runs again, logged with its traceback; one that returns stays ended."""
    rt = make_runtime("supervised")
    runs: list[int] = []
    done = threading.Event()

    async def flaky() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError(f"boom {len(runs)}")
        done.set()

    restarts: list[tuple[str, str]] = []
    rt.spawn(
        functools.partial(supervised, restarted=lambda *r: restarts.append(r)),
        "flaky-task",
        flaky,
        name="flaky-task",
    )
    assert done.wait(30), runs
    assert runs == [0, 1, 2]
    assert restarts == [
        ("flaky-task", "RuntimeError: boom 1"),
        ("flaky-task", "RuntimeError: boom 2"),
    ]
    assert caplog.text.count("kvflow: starting flaky-task again") == 2
    assert "RuntimeError: boom 2" in caplog.text  # the traceback is in the log


def test_a_supervised_task_that_keeps_failing_is_given_up_and_reported(
    make_runtime: MakeRuntime,
) -> None:
    """Issue 28, item 3: a task that cannot be restarted must not fail for ever unseen:
    after `give_up_after` failures in a row it stays ended and `gave_up` is told (the
    engine then reports itself unhealthy)."""
    rt = make_runtime("supervised")
    runs: list[int] = []
    restarts: list[str] = []
    given_up: list[tuple[str, str]] = []
    told = threading.Event()

    async def broken() -> None:
        runs.append(len(runs))
        raise OSError(f"address in use {len(runs)}")

    def gave_up(name: str, error: str) -> None:
        given_up.append((name, error))
        told.set()

    task = functools.partial(
        supervised,
        first_s=0.001,
        give_up_after=3,
        restarted=lambda name, error: restarts.append(error),
        gave_up=gave_up,
    )
    rt.spawn(task, "broken-task", broken, name="broken-task")
    assert told.wait(30), runs
    assert runs == [0, 1, 2]
    assert restarts == ["OSError: address in use 1", "OSError: address in use 2"]
    assert given_up == [("broken-task", "OSError: address in use 3")]


class StandInEvent:
    """A CUDA event's waiting surface (`query`, `synchronize`) over a threading.Event:
    lands when the test says so."""

    def __init__(self) -> None:
        self.landed = threading.Event()
        self.waited_in: list[str] = []

    def query(self) -> bool:
        return self.landed.is_set()

    def synchronize(self) -> None:
        self.waited_in.append(threading.current_thread().name)
        self.landed.wait()


async def test_event_done_waits_in_a_thread_while_the_loop_runs() -> None:
    """The wait blocks a thread, not the loop (another task runs meanwhile), and ends
    when the event lands; not polled with sleeps (trio's last a millisecond at least)."""
    event, ticks = StandInEvent(), [0]

    async def other_task() -> None:
        while not event.waited_in:  # the loop runs while the thread waits
            await trio.lowlevel.checkpoint()
        for _ in range(10):
            ticks[0] += 1
            await trio.lowlevel.checkpoint()
        event.landed.set()

    with trio.fail_after(WAIT):  # a polled wait never calls synchronize: no hang
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_task)
            await runtime.event_done(event)
            assert event.landed.is_set()
    assert ticks[0] == 10
    assert event.waited_in != [threading.current_thread().name], "waited in another thread"


async def test_event_done_of_a_landed_event_or_none_starts_no_thread() -> None:
    event = StandInEvent()
    event.landed.set()
    await runtime.event_done(event)
    await runtime.event_done(None)
    assert event.waited_in == []


async def test_a_cancelled_event_wait_returns_while_the_event_has_not_landed() -> None:
    event = StandInEvent()
    with trio.fail_after(WAIT), trio.CancelScope() as scope:

        async def cancel_once_waiting() -> None:
            while not event.waited_in:
                await trio.lowlevel.checkpoint()
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_once_waiting)
            await runtime.event_done(event)
    assert scope.cancelled_caught and not event.landed.is_set()
    event.landed.set()  # its thread ends
