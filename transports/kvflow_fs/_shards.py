"""Which shards a namespace of the store holds files of, kept as marker files.

A lookup that misses this engine's own shards asks every other tensor-parallel size it
could load from (`kvflow.shapes.lookup_sources`): four more `stat` calls a miss, each
of which waits for vLLM's scheduler thread to let go of the GIL in a burst of requests
(bench/bench_sched_scale.py). Most stores hold one size. `NAMESPACE/.shards/SHARD`
says that shard's files may be there: the scan a worker starts at open writes a
marker for each shard whose files it found, and for its own, so a marker is never
missing for a file the scan saw. A namespace without the directory (a store an older
kvflow wrote, or whose scan has not ended) is asked as before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import trio

__all__ = ["SHARDS_DIR", "KnownShards", "mark"]

SHARDS_DIR = ".shards"
FRESH_S = 1.0
"""A namespace's markers are read again after this long: a shard another engine began
saving is asked within it (until then a chunk of it is a miss, never a wrong hit)."""


def mark(namespace_dir: str, shards: Iterable[str], file_mode: int, dir_mode: int) -> None:
    """Markers for `shards` in `namespace_dir` (those there already are left alone)."""
    where = os.path.join(namespace_dir, SHARDS_DIR)
    with contextlib.suppress(FileExistsError):
        os.mkdir(where, dir_mode)
    for shard in shards:
        path = os.path.join(where, shard)
        if not os.path.exists(path):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, file_mode))


def _read(namespace_dir: str) -> frozenset[str] | None:
    try:
        return frozenset(os.listdir(os.path.join(namespace_dir, SHARDS_DIR)))
    except FileNotFoundError:
        return None


class KnownShards:
    """The shards one namespace holds files of (None: not known), read at most every
    `FRESH_S` seconds."""

    def __init__(self, namespace_dir: str) -> None:
        self.namespace_dir = namespace_dir
        self._known: frozenset[str] | None = None
        self._read_at = -FRESH_S
        self._lock = trio.Lock()

    async def get(self) -> frozenset[str] | None:
        if trio.current_time() - self._read_at < FRESH_S:
            return self._known
        async with self._lock:  # one read at a time: a burst of lookups shares it
            if trio.current_time() - self._read_at >= FRESH_S:
                self._known = await trio.to_thread.run_sync(_read, self.namespace_dir)
                self._read_at = trio.current_time()
        return self._known
