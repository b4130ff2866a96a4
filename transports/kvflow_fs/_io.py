"""System calls over spans: whole writes and reads whatever one call moves, and a load's
read of a chunk's layers, each checked as soon as it lands."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence

from xxhash import xxh3_64_intdigest as xxh3

from kvflow.chunks import ChunkHeader, layer_hash
from kvflow.keys import StoreKey

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


def read_checked(
    fd: int,
    offset: int,
    layers: range,
    spans: Sequence[Sequence[memoryview]],
    check: ChunkHeader | None,
    store_key: StoreKey | None,
) -> tuple[int, int | None]:
    """Read layers `layers` of a chunk file, which lie back to back from `offset`, into
    `spans` (`spans[i]`: layer `layers[i]`'s) in one system call; with `check` (the
    chunk's header), hash each layer. The bytes read (fewer: the file ended), and the
    first layer whose hash is not the header's (None: every layer read is intact, or
    none was checked)."""
    flat = spans[0] if len(spans) == 1 else [s for ls in spans for s in ls]
    got = move_all(os.preadv, fd, flat, offset)
    if check is None or got != sum(check.layer_nbytes[layers.start : layers.stop]):
        return got, None
    want = check.layer_hash
    for layer, ls in zip(layers, spans, strict=True):
        if store_key is None and len(ls) == 1:  # the common case: no Python in between
            if xxh3(ls[0]) != want[layer]:
                return got, layer
        elif layer_hash(ls, store_key, check.key, check.shard, layer) != want[layer]:
            return got, layer
    return got, None
