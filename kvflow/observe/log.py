"""An event subscriber that appends each event as one JSON line to a file.

The simplest durable view of what every runtime did: scheduler and workers of
several engines may append to one file (each line is written with one
`write` on an O_APPEND descriptor, so lines do not interleave).

The file is created owner-only (0600, less the umask) and never opened through a
symbolic link. Refusals (`Rejected`), which strangers cause at will, are written at
most `REJECTED_PER_WINDOW` per reason per `WINDOW_S`; what a window held back is one
`RejectedNotWritten` line (its reason and count) when the window is over, or when
the log is closed. `read_event_log` returns the events; `not_written` the counts.
"""

from __future__ import annotations

import atexit
import errno
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from ..config import ConfigError
from .events import Event, Origin, Rejected

__all__ = [
    "REJECTED_PER_WINDOW",
    "WINDOW_S",
    "JsonlEventLog",
    "RejectedNotWritten",
    "not_written",
    "read_event_log",
]

REJECTED_PER_WINDOW = 20
"""`Rejected` events of one reason written per window; the rest are counted."""
WINDOW_S = 10.0


class RejectedNotWritten(msgspec.Struct, tag=True, kw_only=True):
    """A line of the log, not an event: `count` `Rejected` events of `reason` (the last
    one from `origin`) were not written, in the window from `since` to `ts`
    (`time.monotonic()`, as events' `ts`)."""

    ts: float
    origin: Origin
    reason: str
    count: int
    since: float


@dataclass
class _Window:
    start: float
    written: int = 0
    held: int = 0
    origin: Origin | None = None


class JsonlEventLog:
    """Appends each event to `path` as a JSON line; refusals rate-limited (see above).
    `clock`: the windows' time (tests pass their own)."""

    def __init__(self, path: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fd = _open(path)
        self._encoder = msgspec.json.Encoder()
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._next_end = float("inf")
        """When the first window holding refusals back ends (then its count is written)."""
        atexit.register(self.close)

    def __call__(self, event: Event) -> None:
        now = self._clock()
        if now >= self._next_end:
            self._write_held(now, ended_only=True)
        if isinstance(event, Rejected):
            w = self._windows.get(event.reason)
            if w is None or now - w.start >= WINDOW_S:
                if len(self._windows) > 1024:  # reasons are a short list; bound it anyway
                    self._windows = {r: x for r, x in self._windows.items() if x.held}
                w = self._windows[event.reason] = _Window(now)
            if w.written >= REJECTED_PER_WINDOW:
                w.held += 1
                w.origin = event.origin
                self._next_end = min(self._next_end, w.start + WINDOW_S)
                return
            w.written += 1
        self._write(event)

    def close(self) -> None:
        """Write what is held back, then close the file (also at interpreter exit)."""
        atexit.unregister(self.close)
        if self._fd < 0:
            return
        self._write_held(self._clock(), ended_only=False)
        os.close(self._fd)
        self._fd = -1

    def _write_held(self, now: float, *, ended_only: bool) -> None:
        self._next_end = float("inf")
        for reason, w in self._windows.items():
            if not w.held:
                continue
            if ended_only and now - w.start < WINDOW_S:
                self._next_end = min(self._next_end, w.start + WINDOW_S)
                continue
            assert w.origin is not None
            self._write(
                RejectedNotWritten(
                    ts=now, origin=w.origin, reason=reason, count=w.held, since=w.start
                )
            )
            w.held = 0

    def _write(self, line: Event | RejectedNotWritten) -> None:
        os.write(self._fd, self._encoder.encode(line) + b"\n")


def _open(path: str) -> int:
    """`path` to append to: created 0600, never through a symbolic link (another user's
    link in a shared directory would choose the file), and a regular file."""
    what = f"kv_connector_extra_config['event_log']: {path!r}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{what} is a symbolic link; kvflow does not write through one (it could "
                "name a file of someone else's): name the file itself"
            ) from None
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads
            raise ConfigError(f"{what} is not a regular file; name a file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{what} is not a regular file; name a file")
    return fd


def _lines(path: str) -> list[Event | RejectedNotWritten]:
    decoder = msgspec.json.Decoder(Event | RejectedNotWritten)
    with open(path, "rb") as f:
        return [decoder.decode(line) for line in f if line.strip()]


def read_event_log(path: str) -> list[Event]:
    """Decode a file written by `JsonlEventLog`: its events (see `not_written`)."""
    return [e for e in _lines(path) if not isinstance(e, RejectedNotWritten)]


def not_written(path: str) -> dict[str, int]:
    """How many `Rejected` events of each reason a log held back (rate limit)."""
    counts: dict[str, int] = {}
    for e in _lines(path):
        if isinstance(e, RejectedNotWritten):
            counts[e.reason] = counts.get(e.reason, 0) + e.count
    return counts
