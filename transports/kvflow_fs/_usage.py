"""How full an `fs` store is, and its least-recently-used eviction.

Every process using a store shares one byte count (`root/.usage`, under a lock
file): saves add what they wrote, deleted corrupt chunks subtract theirs, and a
worker's open counts the store once (off the start-up path). Past the cap, one
process at a time deletes least-recently-used chunk files (a load touches its files)
down to 99.5% of it, and reports what it deleted by namespace (vLLM's KV events). An
eviction never walks the whole store (issue 50): chunk keys are hashes, so each key
prefix directory is a random sample of it; it lists directories in a random order,
sets a cutoff at the least recently used `EVICT_SHARE` of the first `SAMPLE_FILES` files it
sees, and deletes files older than that, oldest first, until it freed enough.

Counting, scans and evictions are store-wide chores: they run as system tasks after the
save that asked for them returned, apart from every transfer, and `chores_done` waits
for them. A worker's open still counts the whole store once (a scan, in the
background).

A lock is never waited on for long (issue 46): another process (another user, where
an older kvflow left the lock file readable) may hold it for good. A chore that
cannot take the lock within `LOCK_WAIT_S` gives up, says so once, and keeps what it
had to count for the next chore. The walks never follow a symbolic link: a link in
the store to a directory outside it is neither counted nor evicted through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import random
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import trio

from kvflow.keys import ChunkKey, is_plain_name

from ._perms import dir_mode
from ._shards import mark

__all__ = [
    "EVICT_SHARE",
    "EVICT_TO",
    "LOCK_WAIT_S",
    "SAMPLE_FILES",
    "STALE_TMP_S",
    "USAGE_FILE",
    "StoreUsage",
]

log = logging.getLogger("kvflow.fs")

USAGE_FILE = ".usage"
"""The store's byte count, under the store's root, shared by every process using it."""
USAGE_LOCK = USAGE_FILE + ".lock"
EVICT_LOCK = ".evict.lock"
STALE_TMP_S = 3600.0
"""A temp file untouched this long belongs to a writer that died; swept at open."""
EVICT_TO = 0.995
"""An eviction frees down to this share of the cap: a small step, so that each one looks
at a small part of a large store (`EVICT_SHARE`)."""
EVICT_SHARE = 0.02
"""An eviction deletes only files among the least recently used 2 % of a sample of the
store (or a quarter more than the share it must free, if larger): about 50 files
looked at for each one
deleted, a quarter of a large store for a step of `EVICT_TO`, never all of it. The
largest share bench/bench_fs_evict.py measures as such whose hit rate on both its traces
was not below that of the exact eviction kvflow had before (decision 97)."""
SAMPLE_FILES = 1024
"""The files an eviction looks at before it sets its cutoff; a store this small or
smaller is evicted exactly, oldest first."""
LOCK_WAIT_S = 2.0
"""How long a chore tries for `.usage.lock` (held for a read and a write of a few bytes
by anyone honest) before it gives up until the next one."""

Evicted = Callable[[str, list[ChunkKey]], None]


class StoreUsage:
    """The byte count and eviction of the store under `root`, capped at `max_bytes` (0:
    no cap); `evicted` (namespace, keys), if set, learns what eviction deleted. Its
    files (`.usage`, the locks) get `file_mode`."""

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        evicted: Callable[[], Evicted | None],
        file_mode: int = 0o600,
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.file_mode = file_mode
        self._evicted = evicted
        self._pending = 0
        """Bytes not counted in `.usage` yet (saves since the last chore, or a chore that
        could not take the lock): the next chore adds them."""
        self._mutex = threading.Lock()  # `_pending`, `_stuck`, `lock_skips`: any thread
        self._stuck = False
        self._counting = False
        """A count (scan or account) is running: one at a time, or a scan's total would
        overwrite what a save's count added meanwhile."""
        self._fresh: set[int] | None = None
        """While a scan walks: the files (inode numbers) this process saved meanwhile,
        whose bytes come with `_pending`."""
        self._queued: Callable[[], None] | None = None
        """The count to run when the running one ends (a scan covers an account)."""
        self.own_shards: list[tuple[str, str]] = []
        """(namespace directory, shard) of this engine: marked by the scan (`_shards`)."""
        self._chores = 0
        self._idle = trio.Event()
        self._idle.set()
        self.evictions = 0
        """Evictions this process ran."""
        self.lock_skips = 0
        """Chores this process gave up because another held the store's lock."""
        self.last_pass: EvictPass | None = None
        """What this process's latest eviction looked at and deleted."""

    # -- the loop thread ---------------------------------------------------------
    def scan_soon(self) -> None:
        """Count the store (and sweep dead writers' temp files), and evict if over the
        cap, in the background."""
        self._count(self.scan)

    def saved(self, nbytes: int, inodes: Iterable[int] = ()) -> None:
        """A save made `nbytes` of chunk files (of `inodes`) visible: count them, and
        evict if over the cap, in the background, after the save returned: a save never
        waits for the store's lock."""
        with self._mutex:
            self._pending += nbytes
            if self._fresh is not None:  # a scan walks: it must not count them too
                self._fresh.update(inodes)
        self._count(self.account)

    def _count(self, work: Callable[[], None]) -> None:
        """Run `work` now, or after the running count (which may have read the store's
        count already)."""
        if not self._counting:
            self._counting = True
            self._spawn(work)
        elif self._queued != self.scan:
            self._queued = work

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
            self._counting = False
            if (queued := self._queued) is not None:  # before idle
                self._queued = None
                self._count(queued)
            self._chores -= 1
            if not self._chores:
                self._idle.set()

    # -- threads -----------------------------------------------------------------
    def defer(self, delta: int) -> None:
        """Add `delta` bytes to the count with the next chore (any thread, never waits)."""
        with self._mutex:
            self._pending += delta

    def account(self) -> None:
        """Count what saves wrote; past the cap, evict."""
        self._evict_past_cap(self.add(0))

    def _evict_past_cap(self, usage: int | None) -> None:
        if usage is not None and self.max_bytes and usage > self.max_bytes:
            self.evict(usage)

    def add(self, delta: int, *, total: int | None = None) -> int | None:
        """Add `delta` bytes, and what was deferred, to the store's count, or to `total`
        (a scan's) in place of the count; the new count. None if the lock stayed taken
        for `LOCK_WAIT_S`: then nothing is written, and the bytes are added by the next
        call."""
        self.defer(delta)
        path = self.root / USAGE_FILE
        with self._locked(USAGE_LOCK) as mine:
            if not mine:
                self._skipped("counting the store" if total is None else "the store's scan")
                return None
            with self._mutex:
                delta, self._pending = self._pending, 0
            try:
                try:
                    usage = int(path.read_text() or 0)
                except (FileNotFoundError, ValueError):
                    usage = 0
                usage = max(0, (usage if total is None else total) + delta)
                tmp = path.with_name(f"{USAGE_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.file_mode)
                try:
                    os.write(fd, str(usage).encode())
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except BaseException:
                self.defer(delta)  # counted by the next call instead
                raise
        self._unstuck()
        return usage

    def scan(self) -> None:
        """Count the chunk files in the store into the shared count, and evict if over
        the cap; sweep temp files a crashed writer left. What this process's saves
        deferred before the walk, the walk sees; what they defer during it is added to
        its total, and the walk leaves out their files (`_fresh`). What other processes
        save or delete while it walks may be missed or counted twice (until the next
        open's scan; an over-count evicts early, never fills the disk)."""
        with self._mutex:
            seen, self._pending = self._pending, 0
            self._fresh = set()
            fresh = self._fresh
        now = time.time()
        usage, cutoff = 0, now - STALE_TMP_S
        recent: dict[int, int] = {}  # inode -> bytes, of files written or used meanwhile
        shards: dict[str, set[str]] = {ns: {shard} for ns, shard in self.own_shards}
        for e in self._walk():
            with contextlib.suppress(FileNotFoundError):
                if e.name.endswith(".kv"):
                    if e.inode() in fresh:  # saved by this process since the walk began
                        continue
                    st = e.stat(follow_symlinks=False)
                    usage += st.st_size
                    # used since the scan began, or just before: a save committed then
                    # may defer its count past the scan's start (`_fresh`)
                    if st.st_mtime >= now - 2.0:
                        recent[st.st_ino] = st.st_size
                    namespace, shard = os.path.dirname(os.path.dirname(e.path)), _shard(e.name)
                    if shard:
                        shards.setdefault(namespace, set()).add(shard)
                elif ".kv.tmp." in e.name and e.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(e.path)
        with self._mutex:
            self._fresh = None
        # those saved before it knew them: counted with what they deferred, not twice
        usage -= sum(n for inode, n in recent.items() if inode in fresh)
        for namespace, names in shards.items():  # those it saw, and this engine's own
            try:
                mark(namespace, names, self.file_mode, dir_mode(self.file_mode))
            except OSError as exc:  # lookups of other sizes ask every shard, as before
                log.warning("kvflow fs: cannot mark the shards of %s: %s", namespace, exc)
        counted = self.add(0, total=usage)
        if counted is None:  # the old count stands: it still lacks what was deferred
            self.defer(seen)
        self._evict_past_cap(counted)

    def evict(self, usage: int) -> None:
        """Free what the store's count `usage` holds over `EVICT_TO` of the cap, least
        recently used first, as sampled, and again while saves committed meanwhile keep
        it over the cap (one process at a time: another one evicting already is enough)."""
        with self._locked(EVICT_LOCK, wait_s=0) as mine:
            while mine:
                done = self._evict_pass(usage)
                left = self.add(-done.freed)  # what it deleted: saves meanwhile count
                remain = f"{left} bytes remain" if left is not None else "the count follows"
                log.info(
                    "kvflow fs: evicted %d chunk files of %d looked at; %s",
                    done.deleted,
                    done.looked_at,
                    remain,
                )
                # again if saves meanwhile keep it over the cap, or its cutoff (a sample's)
                # let it free less than it had to
                short = done.freed < done.need
                if left is None or not done.deleted or (left <= self.max_bytes and not short):
                    return
                usage = left

    def _evict_pass(self, usage: int) -> EvictPass:
        need = usage - int(self.max_bytes * EVICT_TO)
        done = EvictPass(need=need)
        if need <= 0:
            return done
        # a share well above what it must free: it finds that much in a part of the store
        share = min(1.0, max(EVICT_SHARE, 1.25 * need / usage))
        dirs = self._dirs()
        random.shuffle(dirs)  # chunk keys are hashes: each directory is a random sample
        sample: list[tuple[float, int, str]] = []
        cutoff: float | None = None  # known once `SAMPLE_FILES` were seen
        gone: dict[str, list[ChunkKey]] = {}  # namespace -> chunks deleted
        for d in dirs:
            if done.freed >= need:
                break
            found = _chunk_files(d)
            done.looked_at += len(found)
            if cutoff is None:
                sample.extend(found)
                if len(sample) < SAMPLE_FILES:
                    continue
                sample.sort()
                cutoff = sample[max(0, math.ceil(share * len(sample)) - 1)][0]
                found, sample = sample, []
            _delete(sorted(found), cutoff, need, done, gone)
        if cutoff is None:  # the whole store was the sample: exactly the oldest first
            _delete(sorted(sample), math.inf, need, done, gone)
        self.evictions += 1
        self.last_pass = done
        if (evicted := self._evicted()) is not None:  # for vLLM's KV events
            for namespace, keys in gone.items():
                evicted(namespace, keys)
        return done

    def _dirs(self) -> list[str]:
        """The directories two below the root (namespace, key prefix), never through a
        symbolic link."""
        out: list[str] = []
        if not self.root.is_dir():
            return out
        with os.scandir(self.root) as namespaces:
            for ns in namespaces:
                if ns.is_dir(follow_symlinks=False):
                    with os.scandir(ns.path) as subs:
                        out.extend(s.path for s in subs if s.is_dir(follow_symlinks=False))
        return out

    def _walk(self) -> Iterator[os.DirEntry[str]]:
        """The regular files in `_dirs`, one directory listed at a time."""
        for d in self._dirs():
            with contextlib.suppress(FileNotFoundError), os.scandir(d) as found:
                yield from (e for e in found if e.is_file(follow_symlinks=False))

    @contextlib.contextmanager
    def _locked(self, name: str, wait_s: float | None = None) -> Iterator[bool]:
        """An exclusive lock on `root/name`, shared by every process using the store,
        tried for `wait_s` seconds (default `LOCK_WAIT_S`; 0: once), never blocking;
        yields whether it was taken."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.root / name, flags, self.file_mode)
        try:
            st = os.fstat(fd)  # an older kvflow's lock file (0644): others could hold it
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & ~self.file_mode:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & self.file_mode)
            yield _flock(fd, LOCK_WAIT_S if wait_s is None else wait_s)
        finally:
            os.close(fd)  # releases the lock

    def _skipped(self, what: str) -> None:
        with self._mutex:
            self.lock_skips += 1
            first, self._stuck = not self._stuck, True
        (log.warning if first else log.debug)(
            "kvflow fs: %s is held by another process for over %g s: %s skipped (saves go "
            "on; a save's bytes are counted by a later chore, a scan waits for the next "
            "open). If another user can open it, make the store owner-only (chmod 0700 the "
            "root, 0600 the lock)",
            self.root / USAGE_LOCK,
            LOCK_WAIT_S,
            what,
        )

    def _unstuck(self) -> None:
        with self._mutex:
            was, self._stuck = self._stuck, False
        if was:
            log.warning("kvflow fs: %s is free again; the store is counted", self.root / USAGE_LOCK)


@dataclasses.dataclass
class EvictPass:
    """One eviction pass: the bytes it had to free, the chunk files it looked at (`stat`)
    and deleted, and their bytes."""

    need: int = 0
    looked_at: int = 0
    deleted: int = 0
    freed: int = 0


def _chunk_files(directory: str) -> list[tuple[float, int, str]]:
    """(modification time, size, path) of the chunk files in `directory`."""
    out = []
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as found:
        for e in found:
            if e.name.endswith(".kv") and e.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat(follow_symlinks=False)
                    out.append((st.st_mtime, st.st_size, e.path))
    return out


def _delete(
    oldest_first: list[tuple[float, int, str]],
    cutoff: float,
    need: int,
    done: EvictPass,
    gone: dict[str, list[ChunkKey]],
) -> None:
    """Delete files used at or before `cutoff`, oldest first, until `need` bytes are
    freed in all; count them in `done` and `gone` (namespace -> keys)."""
    for mtime, size, path in oldest_first:
        if done.freed >= need or mtime > cutoff:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            done.freed += size
            done.deleted += 1
            namespace = os.path.basename(os.path.dirname(os.path.dirname(path)))
            gone.setdefault(namespace, []).append(os.path.basename(path).split(".", 1)[0])


def _flock(fd: int, wait_s: float) -> bool:
    """Take an exclusive `flock` on `fd`, trying (with a growing pause) for `wait_s`."""
    deadline, pause = time.monotonic() + wait_s, 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)


def _shard(name: str) -> str:
    """The shard a chunk file's name (`KEY.SHARD.kv`) names; "" for any other name (a
    stray file's: never a marker)."""
    parts = name.split(".")
    return parts[1] if len(parts) == 3 and is_plain_name(parts[1]) else ""
