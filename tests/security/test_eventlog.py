"""`JsonlEventLog` (issue 46): an owner-only file, never written through a symbolic link,
and refusals rate-limited per reason, with a line saying how many were not written."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvflow.config import ConfigError
from kvflow.observe.events import EventBus, Origin, Rejected, TransferDone
from kvflow.observe.log import (
    REJECTED_PER_WINDOW,
    WINDOW_S,
    JsonlEventLog,
    not_written,
    read_event_log,
)


def test_a_new_log_is_owner_only(tmp_path: Path) -> None:
    umask = os.umask(0o022)  # the common umask: it would let every user read a 0644 file
    try:
        log = JsonlEventLog(str(tmp_path / "logs" / "events.jsonl"))
    finally:
        os.umask(umask)
    log(TransferDone(direction="save", chunks=1, nbytes=1, elapsed_s=0.0))
    log.close()
    assert stat.S_IMODE((tmp_path / "logs" / "events.jsonl").stat().st_mode) == 0o600


@pytest.mark.parametrize("target", ["a file", "nothing yet"])
def test_a_log_path_that_is_a_symbolic_link_is_refused(tmp_path: Path, target: str) -> None:
    """A link another user left where the log goes (/tmp) would have kvflow append to, or
    create, a file of the link's choosing: refused, naming the path; the target untouched."""
    victim = tmp_path / "victim"
    if target == "a file":
        victim.write_text("someone else's\n")
    link = tmp_path / "events.jsonl"
    link.symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link") as caught:
        JsonlEventLog(str(link))
    assert str(link) in str(caught.value)
    if target == "a file":
        assert victim.read_text() == "someone else's\n"
    else:
        assert not victim.exists()


def test_a_log_path_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "events.jsonl"
    os.mkfifo(fifo)  # opening it to write would wait for a reader forever
    with pytest.raises(ConfigError, match="not a regular file"):
        JsonlEventLog(str(fifo))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_refusals_are_rate_limited_per_reason_and_the_rest_counted(tmp_path: Path) -> None:
    """10 000 refused frames (a stranger's flood) write a bounded number of lines, then one
    line per reason saying how many were not written; other events are all written."""
    path = tmp_path / "events.jsonl"
    clock = Clock()
    log = JsonlEventLog(str(path), clock=clock)
    bus = EventBus(Origin("engine", "worker"))
    bus.subscribe(log)
    for i in range(10_000):
        bus.emit(Rejected(reason="frame" if i % 2 else "unauthenticated", detail=f"#{i}"))
        if i % 1000 == 0:
            bus.emit(TransferDone(direction="save", chunks=1, nbytes=i, elapsed_s=0.0))
    lines = path.read_bytes().count(b"\n")
    assert lines == 2 * REJECTED_PER_WINDOW + 10, "bounded: the rest are only counted yet"
    clock.now += WINDOW_S  # a new window: the counts are written, then refusals again
    bus.emit(Rejected(reason="frame", detail="later"))
    events = read_event_log(str(path))
    refused = [e for e in events if isinstance(e, Rejected)]
    assert len(refused) == 2 * REJECTED_PER_WINDOW + 1 and refused[-1].detail == "later"
    assert [e.detail for e in refused[:3]] == ["#0", "#1", "#2"]  # the first ones are kept
    assert sum(isinstance(e, TransferDone) for e in events) == 10
    skipped = 5_000 - REJECTED_PER_WINDOW
    assert not_written(str(path)) == {"frame": skipped, "unauthenticated": skipped}
    assert path.read_bytes().count(b"\n") == lines + 3
    log.close()  # nothing more was held back
    assert path.read_bytes().count(b"\n") == lines + 3


def test_closing_the_log_writes_what_it_held_back(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = JsonlEventLog(str(path), clock=Clock())
    for _ in range(REJECTED_PER_WINDOW + 7):
        log(Rejected(reason="signature"))
    log.close()
    assert not_written(str(path)) == {"signature": 7}
    assert len(read_event_log(str(path))) == REJECTED_PER_WINDOW
