"""How full an `fs` store is, and its least-recently-used eviction.

Every process using a store shares one byte count (`root/.usage`, under a lock
file): saves add what they wrote, deleted corrupt chunks subtract theirs, and a
worker's open counts the store once (off the start-up path). Past the cap, one
process at a time deletes the least-recently-used chunk files (a load touches its
files) down to 90% of it, and reports what it deleted by namespace (vLLM's KV
events). Scans and evictions are store-wide chores: they run as system tasks, apart
from every transfer, and `chores_done` waits for them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import trio

from kvflow.keys import ChunkKey

__all__ = ["STALE_TMP_S", "USAGE_FILE", "StoreUsage"]

log = logging.getLogger("kvflow.fs")

USAGE_FILE = ".usage"
"""The store's byte count, under the store's root, shared by every process using it."""
STALE_TMP_S = 3600.0
"""A temp file untouched this long belongs to a writer that died; swept at open."""

Evicted = Callable[[str, list[ChunkKey]], None]


class StoreUsage:
    """The byte count and eviction of the store under `root`, capped at `max_bytes` (0:
    no cap); `evicted` (namespace, keys), if set, learns what eviction deleted."""

    def __init__(self, root: Path, max_bytes: int, evicted: Callable[[], Evicted | None]) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._evicted = evicted
        self._evicting = False
        self._chores = 0
        self._idle = trio.Event()
        self._idle.set()
        self.evictions = 0
        """Evictions this process ran."""

    # -- the loop thread ---------------------------------------------------------
    def scan_soon(self) -> None:
        """Count the store (and sweep dead writers' temp files) in the background."""
        self._spawn(self.scan)

    def saved(self, usage: int) -> None:
        """A save brought the count to `usage`: evict in the background if over the cap
        (one eviction at a time, after the save returned)."""
        if self.max_bytes and usage > self.max_bytes and not self._evicting:
            self._evicting = True
            self._spawn(self.evict)

    async def chores_done(self) -> None:
        """Wait until the store-wide chores started so far (scan, eviction) ended."""
        await self._idle.wait()

    def _spawn(self, work: Callable[[], None]) -> None:
        if not self._chores:
            self._idle = trio.Event()
        self._chores += 1
        trio.lowlevel.spawn_system_task(self._background, work, name=f"fs.{work.__name__}")

    async def _background(self, work: Callable[[], None]) -> None:
        try:
            await trio.to_thread.run_sync(work)
        except Exception as exc:  # the chunks are stored; a failed chore is not a transfer's
            log.warning("kvflow fs: %s under %s failed: %s", work.__name__, self.root, exc)
        finally:
            if work == self.evict:
                self._evicting = False
            self._chores -= 1
            if not self._chores:
                self._idle.set()

    # -- threads -----------------------------------------------------------------
    def add(self, delta: int, *, total: int | None = None) -> int:
        """Add `delta` bytes to the store's count, or set it to `total`; the new count."""
        path = self.root / USAGE_FILE
        with self._locked(USAGE_FILE + ".lock"):
            try:
                usage = int(path.read_text() or 0)
            except (FileNotFoundError, ValueError):
                usage = 0
            usage = max(0, usage + delta) if total is None else total
            tmp = path.with_name(f"{USAGE_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
            tmp.write_text(str(usage))
            os.replace(tmp, path)
        return usage

    def scan(self) -> None:
        """Count the chunk files in the store into the shared count; sweep temp files a
        crashed writer left."""
        usage, cutoff = 0, time.time() - STALE_TMP_S
        for e in self._walk():
            with contextlib.suppress(FileNotFoundError):
                if e.name.endswith(".kv"):
                    usage += e.stat().st_size
                elif ".kv.tmp." in e.name and e.stat().st_mtime < cutoff:
                    os.unlink(e.path)
        self.add(0, total=usage)

    def evict(self) -> None:
        """Delete least-recently-used chunk files until usage is 90% of the cap (one
        process at a time: another one evicting already is enough)."""
        with self._locked(".evict.lock", blocking=False) as mine:
            if mine:
                self._evict_locked()

    def _evict_locked(self) -> None:
        entries = []
        for e in self._walk():
            if e.name.endswith(".kv"):
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    entries.append((st.st_mtime, st.st_size, e.path))
        entries.sort()
        usage = sum(size for _, size, _ in entries)
        target = int(self.max_bytes * 0.9)
        freed = 0
        gone: dict[str, list[ChunkKey]] = {}  # namespace -> chunks deleted
        for _, size, path in entries:
            if usage - freed <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                freed += size
                namespace = os.path.basename(os.path.dirname(os.path.dirname(path)))
                gone.setdefault(namespace, []).append(os.path.basename(path).split(".", 1)[0])
        # what it deleted, not the walk's total: saves committed during the walk count
        usage = self.add(-freed)
        self.evictions += 1
        removed = sum(len(keys) for keys in gone.values())
        log.info("kvflow fs: evicted %d chunk files; %d bytes remain", removed, usage)
        if (evicted := self._evicted()) is not None:  # for vLLM's KV events
            for namespace, keys in gone.items():
                evicted(namespace, keys)

    def _walk(self) -> list[os.DirEntry[str]]:
        out: list[os.DirEntry[str]] = []
        if not self.root.is_dir():
            return out
        for ns in os.scandir(self.root):
            if not ns.is_dir():
                continue
            for sub in os.scandir(ns.path):
                if sub.is_dir():
                    out.extend(os.scandir(sub.path))
        return out

    @contextlib.contextmanager
    def _locked(self, name: str, blocking: bool = True) -> Iterator[bool]:
        """An exclusive lock on `root/name`, shared by every process using the store;
        yields False if `blocking` is off and another holds it."""
        fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # releases the lock
