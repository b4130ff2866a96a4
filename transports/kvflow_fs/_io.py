"""System calls over spans: whole writes and reads, whatever one call moves."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def move_all(
    call: Callable[[int, Sequence[memoryview], int], int],
    fd: int,
    spans: Sequence[memoryview],
    offset: int,
) -> int:
    """`call` (`os.preadv` or `os.pwritev`) over `spans` back to back from `offset`,
    whatever one call moves; the bytes moved (fewer only at the end of a file read)."""
    start = offset
    for i in range(0, len(spans), IOV_MAX):
        group = spans[i : i + IOV_MAX]
        n = call(fd, group, offset)
        if n == sum(map(len, group)):  # the common case: all of it
            offset += n
            continue
        for s in group:  # skip what was moved, finish what a short call left
            done, n = min(n, len(s)), max(0, n - len(s))
            while done < len(s):
                moved = call(fd, [s[done:]], offset + done)
                if not moved:
                    return offset + done - start
                done += moved
            offset += len(s)
    return offset - start


def write_all(fd: int, spans: Sequence[memoryview], offset: int = 0) -> None:
    want = sum(len(s) for s in spans)
    if (n := move_all(os.pwritev, fd, spans, offset)) != want:
        raise OSError(errno.EIO, f"wrote {n} of {want} bytes")


def read_all(fd: int, spans: Sequence[memoryview], offset: int) -> int:
    """`move_all` of `os.preadv`: the bytes read (fewer: the file ended)."""
    return move_all(os.preadv, fd, spans, offset)
