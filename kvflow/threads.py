"""Work that must run on several cores at once, each part in a thread started for it.

`trio.to_thread.run_sync` runs a function in a thread of trio's cache, woken by the
loop's thread. Linux often wakes such a thread on the waker's core and keeps it near
the thread it trades the GIL with: the two readers of an `fs` load then shared one core
in most loads of a run, and the load ran as if it had one thread. A thread started for
the call is placed on the idlest core when it starts (decision 105, issue 50 item 6).
Starting one costs tens of microseconds: this is for parts of one transfer that run in
parallel for milliseconds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

__all__ = ["in_new_thread"]

T = TypeVar("T")


async def in_new_thread(
    fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter | None = None
) -> T:
    """`fn(*args)` in a thread started for this call (holding `limiter` meanwhile); what
    it returns or raises. As `trio.to_thread.run_sync` without `abandon_on_cancel`, a
    cancel waits for it to end (it may write into memory the caller hands back)."""
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
            token.run_sync_soon(ended.set)

    async with limiter if limiter is not None else contextlib.nullcontext():
        name = f"kvflow {getattr(fn, '__qualname__', 'work')}"
        threading.Thread(target=body, name=name, daemon=True).start()
        with trio.CancelScope(shield=True):
            await ended.wait()
    if err:
        raise err[0]
    return out[0]
