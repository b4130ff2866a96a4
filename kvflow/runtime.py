"""One trio loop per connector instance, in a daemon thread: the only door from vLLM.

vLLM calls connectors synchronously from its own threads. Those threads never
run trio code: they hand work in with `submit` / `spawn` (a non-blocking
`TrioToken.run_sync_soon`, a few microseconds) and read completions the transfers
publish. Only where vLLM's contract needs an answer now (opening transports and
registering memory, preemption, a reused block a save still reads, shutdown) does
a thread block, and then always with a timeout (`call`), so no caller ever waits
on a loop that died.

The loop starts lazily in the process that uses it. After `fork` the child
has no loop thread, so the runtime resets itself and starts afresh on first
use. Shutdown is explicit (`shutdown()`, with an atexit fallback): it cancels
every task, then runs the registered closers (transports) under a shielded
deadline, then joins the thread with a timeout.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import trio

__all__ = [
    "GAVE_UP_THEN",
    "GIVE_UP_AFTER",
    "Backoff",
    "KVFlowFatal",
    "Runtime",
    "RuntimeClosed",
    "all_or_first_error",
    "cuda_event",
    "event_done",
    "given_up",
    "poll_until",
    "supervised",
]

log = logging.getLogger("kvflow.runtime")
T = TypeVar("T")

_RUNTIMES: weakref.WeakSet[Runtime] = weakref.WeakSet()


class KVFlowFatal(RuntimeError):
    """kvflow cannot go on safely (a load that could not be stopped, a long-lived task
    that cannot be restarted): raised in vLLM's thread, it stops the engine, whose
    health check then fails."""


class RuntimeClosed(RuntimeError):
    """The runtime was shut down (or its loop died); the work was not done."""


class _Loop:
    """State of one started loop; replaced wholesale on fork or restart."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.ready = threading.Event()
        self.thread: threading.Thread | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.nursery: trio.Nursery | None = None
        self.stop: trio.Event | None = None
        self.closed = False


class Runtime:
    """A trio loop in a daemon thread with a root nursery that lives until `shutdown()`."""

    def __init__(
        self,
        name: str,
        *,
        close_timeout_s: float = 5.0,
        clock: trio.abc.Clock | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        self.name = name
        self.cpus = cpus
        """Cores the loop thread, and the threads it starts (transfers), run on; None:
        those of the thread that starts it."""
        self.close_timeout_s = close_timeout_s
        self.task_errors = 0
        self._clock = clock
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._lock = threading.Lock()
        self._loop: _Loop | None = None
        self._shut = False
        _RUNTIMES.add(self)

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        """Start the loop if this process has none yet (idempotent, fork-aware).

        Raises `RuntimeClosed` after `shutdown()` or after the loop crashed.
        """
        loop = self._loop
        if loop is not None and loop.pid == os.getpid() and not loop.closed:
            return
        with self._lock:
            if self._shut:
                raise RuntimeClosed(f"runtime {self.name!r} was shut down")
            loop = self._loop
            if loop is not None and loop.pid == os.getpid() and not loop.closed:
                return
            loop = _Loop()
            loop.thread = threading.Thread(
                target=self._thread_main, args=(loop,), name=f"kvflow-{self.name}", daemon=True
            )
            self._loop = loop
            loop.thread.start()
        if not loop.ready.wait(10.0) or loop.closed:
            raise RuntimeClosed(f"runtime {self.name!r} did not start")

    @property
    def running(self) -> bool:
        loop = self._loop
        return (
            loop is not None and loop.pid == os.getpid() and loop.ready.is_set() and not loop.closed
        )

    def in_loop_thread(self) -> bool:
        loop = self._loop
        return loop is not None and loop.thread is threading.current_thread()

    def add_closer(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Run `closer()` on shutdown, after tasks are cancelled (last added runs first)."""
        self._closers.append(closer)

    def shutdown(self, timeout: float | None = None) -> bool:
        """Cancel all tasks, run closers, join the thread. True if it ended in time.

        Idempotent. Later `submit` / `spawn` calls are dropped, `call` raises
        `RuntimeClosed`. From the loop thread itself it only requests the stop
        (and returns False: a thread cannot join itself).
        """
        with self._lock:
            self._shut = True
            loop = self._loop
        if loop is None or loop.pid != os.getpid() or loop.thread is None:
            return True
        if loop.thread is threading.current_thread():
            self._request_stop(loop)
            return False
        wait = self.close_timeout_s + 2.0 if timeout is None else timeout
        deadline = time.monotonic() + wait
        loop.ready.wait(wait)  # a loop still starting has no token to stop it with yet
        self._request_stop(loop)
        loop.thread.join(max(0.0, deadline - time.monotonic()))
        alive = loop.thread.is_alive()
        if alive:
            log.warning("kvflow runtime %r did not stop in time; abandoning its thread", self.name)
        return not alive

    @staticmethod
    def _request_stop(loop: _Loop) -> None:
        if not loop.closed and loop.token is not None and loop.stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                loop.token.run_sync_soon(loop.stop.set)

    # -- the door in -------------------------------------------------------
    def submit(self, fn: Callable[..., object], *args: Any) -> None:
        """Run `fn(*args)` on the loop thread soon. Never blocks, never raises.

        Dropped (with a log line) once the runtime is shut down. If `fn` raises,
        the error is logged and counted in `task_errors`; the loop goes on.
        """
        self._post(fn, args)

    def _post(self, fn: Callable[..., object], args: tuple) -> bool:
        """Queue `fn(*args)` on the loop thread; False if it was dropped."""
        loop = self._loop
        if loop is None or loop.pid != os.getpid() or loop.closed:
            try:
                self.start()
            except RuntimeClosed:
                log.debug("kvflow runtime %r is closed; dropped %r", self.name, fn)
                return False
            loop = self._loop
        assert loop is not None and loop.token is not None
        try:
            loop.token.run_sync_soon(self._run_guarded, fn, args)
        except trio.RunFinishedError:
            log.debug("kvflow runtime %r is closed; dropped %r", self.name, fn)
            return False
        return True

    def spawn(self, async_fn: Callable[..., Awaitable[object]], *args: Any, name: str = "") -> None:
        """Start `async_fn(*args)` as a task in the root nursery. Never blocks, never raises."""
        self._post(self._start_task, (async_fn, args, name))

    def call(self, async_fn: Callable[..., Awaitable[T]], *args: Any, timeout: float) -> T:
        """Run `async_fn(*args)` in the loop and wait for its result, at most `timeout` s.

        Returns its value or raises its exception. Raises `TimeoutError` (and
        cancels the task) when no answer came in time, `RuntimeClosed` when the
        runtime is shut down or shuts down during the call, and `RuntimeError`
        from the loop thread itself (it would deadlock).
        """
        if self.in_loop_thread():
            raise RuntimeError("Runtime.call from the loop thread would deadlock")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        scope = trio.CancelScope()
        name = _name_of(async_fn)

        async def runner() -> None:
            with scope:
                try:
                    fut.set_result(await async_fn(*args))
                except BaseException as exc:
                    fut.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise

        def launch() -> None:
            if not self._start_task(runner, (), name):
                fut.set_exception(RuntimeClosed(f"runtime {self.name!r} is shutting down"))

        if not self._post(launch, ()):
            raise RuntimeClosed(f"runtime {self.name!r} was shut down")
        # Wait apart from fut.result(): a TimeoutError the task raised is its own answer.
        if not concurrent.futures.wait([fut], timeout).done:
            self._post(scope.cancel, ())
            raise TimeoutError(f"kvflow runtime {self.name!r}: no answer in {timeout}s")
        try:
            return fut.result()
        except trio.Cancelled:
            raise RuntimeClosed(f"runtime {self.name!r} shut down during the call") from None

    # -- inside the loop ---------------------------------------------------
    def start_soon(
        self, async_fn: Callable[..., Awaitable[object]], *args: Any, name: str = ""
    ) -> None:
        """From the loop thread: start a guarded task in the root nursery."""
        self._start_task(async_fn, args, name)

    def _run_guarded(self, fn: Callable[..., object], args: tuple) -> None:
        # An exception escaping a run_sync_soon callback would abort trio.run.
        try:
            fn(*args)
        except Exception:
            self.task_errors += 1
            log.exception("kvflow callback %s failed in runtime %r", _name_of(fn), self.name)

    def _start_task(
        self, async_fn: Callable[..., Awaitable[object]], args: tuple, name: str
    ) -> bool:
        loop = self._loop
        assert loop is not None and loop.nursery is not None
        name = name or _name_of(async_fn)
        try:
            loop.nursery.start_soon(self._guard, async_fn, args, name, name=name)
        except RuntimeError:  # the nursery closed: we are shutting down
            log.warning("kvflow runtime %r is closing; dropped task %s", self.name, name)
            return False
        return True

    async def _guard(
        self, async_fn: Callable[..., Awaitable[object]], args: tuple, name: str
    ) -> None:
        try:
            await async_fn(*args)
        except Exception:
            self.task_errors += 1
            log.exception("kvflow task %s failed in runtime %r", name, self.name)

    def _thread_main(self, loop: _Loop) -> None:
        try:
            if self.cpus:
                try:
                    os.sched_setaffinity(0, self.cpus)  # this thread; its threads inherit it
                except OSError as exc:
                    log.warning("kvflow runtime %r stays on its cores: %s", self.name, exc)
            trio.run(self._main, loop, clock=self._clock)
        except BaseException:
            # Tasks and closers are gone: never start a loop on that state again.
            self._shut = True
            log.exception("kvflow runtime %r crashed; its transfers are disabled", self.name)
        finally:
            loop.closed = True
            loop.ready.set()

    async def _main(self, loop: _Loop) -> None:
        loop.token = trio.lowlevel.current_trio_token()
        loop.stop = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                loop.nursery = nursery
                loop.ready.set()
                await loop.stop.wait()
                nursery.cancel_scope.cancel()
        finally:
            with trio.move_on_after(self.close_timeout_s, shield=True):
                for closer in reversed(self._closers):
                    try:
                        await closer()
                    except Exception:
                        log.exception("kvflow runtime %r: closer %r failed", self.name, closer)


class Backoff:
    """Sleeps that double from `first` to `most` seconds: how kvflow polls what no event
    announces (a NIXL transfer, a store that has not been written yet; CUDA events are
    awaited in a thread, `event_done`), never blocking the loop, never spinning. A
    sleep under a millisecond lasts a millisecond or more (epoll's resolution)."""

    def __init__(self, first: float = 2e-5, most: float = 1e-3) -> None:
        self.first = first
        self.most = most
        self.delay = first

    async def wait(self) -> None:
        await trio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.most)

    def reset(self) -> None:
        """Something happened: poll at once again."""
        self.delay = self.first


async def poll_until(done: Callable[[], bool], *, first: float = 2e-5, most: float = 1e-3) -> None:
    """Wait for a condition only polling can see, backing off from `first` to `most`."""
    backoff = Backoff(first, most)
    while not done():
        await backoff.wait()


GIVE_UP_AFTER = 5
"""A supervised task that fails this many times in a row, no run lasting `most_s`, is
broken for good: it is not started again, and its engine says it is unhealthy."""

GAVE_UP_THEN = "Stopping the engine rather than serve with it off."
"""What an engine does when a supervised task is given up (`given_up`)."""


def given_up(task: str, error: str) -> str:
    """Why an engine stops when `supervised` gave up `task` (its last `error`)."""
    return f"{task} failed {GIVE_UP_AFTER} times in a row (last: {error})"


Report = Callable[[str, str], None]
"""Told `(task name, "ErrorType: message")` (on the loop thread)."""


async def supervised(
    name: str,
    async_fn: Callable[..., Awaitable[object]],
    *args: Any,
    first_s: float = 0.1,
    most_s: float = 5.0,
    give_up_after: int = GIVE_UP_AFTER,
    restarted: Report | None = None,
    gave_up: Report | None = None,
) -> None:
    """Run `async_fn(*args)` for as long as the loop lives, starting it again whenever it
    ends by an exception (logged with its traceback; `restarted` is told), after a pause
    that doubles from `first_s` to `most_s` (a run that lasted longer than `most_s` starts
    the pauses and the count of failures over). After `give_up_after` failures in a row
    it is not started again: `gave_up` is told, and the engine must then report itself
    unhealthy rather than serve with the task's work silently off. For the long-lived
    tasks an engine depends on (a peer transport's `serve`, the P/D claims' renewals)."""
    backoff = Backoff(first_s, most_s)
    failures = 0
    while True:
        started = trio.current_time()
        try:
            await async_fn(*args)
            return
        except Exception as exc:
            error = _describe(exc)
            log.exception("kvflow: %s failed", name)
        if trio.current_time() - started > most_s:
            backoff.reset()
            failures = 0
        failures += 1
        if failures >= give_up_after:
            log.error("kvflow: %s failed %d times in a row; not starting it again", name, failures)
            if gave_up is not None:
                gave_up(name, error)
            return
        log.warning("kvflow: starting %s again (failure %d in a row)", name, failures)
        if restarted is not None:
            restarted(name, error)
        await backoff.wait()


def _describe(exc: BaseException) -> str:
    """`"ErrorType: message"` of what failed: the first error inside nurseries' groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:500]


def _name_of(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _after_fork_in_child() -> None:
    for rt in list(_RUNTIMES):
        rt._loop = None
        rt._lock = threading.Lock()


def _shutdown_all() -> None:
    for rt in list(_RUNTIMES):
        rt.shutdown(timeout=2.0)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_shutdown_all)


async def all_or_first_error(
    calls: Iterable[Callable[[], Awaitable[Any]]], catch: type[BaseException]
) -> None:
    """Run the calls concurrently; the first to raise `catch` cancels the others and is
    re-raised as itself (not wrapped in an exception group)."""
    errors: list[BaseException] = []

    async def run(call: Callable[[], Awaitable[Any]]) -> None:
        try:
            await call()
        except catch as exc:
            errors.append(exc)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for call in calls:
            nursery.start_soon(run, call)
    if errors:
        raise errors[0]


EVENT_WAIT_THREADS = 256
"""Threads that may wait on CUDA events at once (per trio run; one a wait)."""
_event_waits: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("kvflow_events")


async def event_done(event: Any) -> None:
    """Wait for a CUDA event from trio, never blocking the loop; None: nothing to wait for.

    Done already: at once. Else a thread waits in `event.synchronize()` (without the GIL;
    an event made with `blocking=True` sleeps there rather than spin, see `cuda_event`)
    and wakes the loop as it lands. Not polled: a trio sleep under a millisecond lasts a
    millisecond or more (epoll waits in whole milliseconds), so a poll added that to
    every copy waited on, per layer where layers are waited on one by one. Cancelled,
    the wait returns at once and its thread ends when the event lands."""
    if event is None or event.query():
        return
    try:
        limiter = _event_waits.get()
    except LookupError:
        limiter = trio.CapacityLimiter(EVENT_WAIT_THREADS)
        _event_waits.set(limiter)
    await trio.to_thread.run_sync(event.synchronize, abandon_on_cancel=True, limiter=limiter)


def cuda_event() -> Any:
    """A CUDA event whose `synchronize()` sleeps until it lands (`blocking=True`: a thread
    of `event_done` waits on it without spinning a core)."""
    import torch

    return torch.cuda.Event(blocking=True)
