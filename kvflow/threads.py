"""Work that must run on several cores at once, each part in a thread started for it.

`trio.to_thread.run_sync` runs a function in a thread of trio's cache, woken by the
loop's thread. Linux often wakes such a thread on the waker's core and keeps it near
the thread it trades the GIL with: the two readers of an `fs` load then shared one core
in most loads of a run, and the load ran nearly as on one thread. A thread started for
the call is placed on the idlest core it may use when it starts (decision 105, issue 50
item 6). Starting one costs tens of microseconds: this is for parts of one transfer
that run in parallel for milliseconds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

__all__ = ["in_new_thread"]

T = TypeVar("T")


@trio.lowlevel.enable_ki_protection  # no Ctrl-C between the thread's start and the wait
async def in_new_thread(
    fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter | None = None
) -> T:
    """`fn(*args)` in a thread started for this call (holding `limiter` meanwhile); what
    it returns or raises. As `trio.to_thread.run_sync` without `abandon_on_cancel`: a
    cancel before the start raises, one after it waits for the thread to end (it may
    write into memory the caller hands back). Unlike it, `fn` gets no copy of the
    caller's context variables and cannot call `trio.from_thread`."""
    await trio.lowlevel.checkpoint_if_cancelled()
    token = trio.lowlevel.current_trio_token()
    ended = trio.Event()
    out: list[T] = []
    err: list[BaseException] = []

    def body() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:  # handed to the caller, as to_thread does
            err.append(exc)
        finally:
            with contextlib.suppress(trio.RunFinishedError):  # the loop died meanwhile
                token.run_sync_soon(ended.set)

    holder = object()  # each call its own borrower, as to_thread's
    if limiter is not None:
        await limiter.acquire_on_behalf_of(holder)
    try:
        name = f"kvflow {getattr(fn, '__qualname__', 'work')}"
        threading.Thread(target=body, name=name, daemon=True).start()
        with trio.CancelScope(shield=True):
            await ended.wait()
    finally:
        if limiter is not None:
            limiter.release_on_behalf_of(holder)
    if err:
        raise err[0]
    return out[0]
