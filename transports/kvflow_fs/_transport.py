"""The `fs` transport: atomic chunk files, read straight into KV memory."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import trio

from kvflow.chunks import BadHeader, ChunkFailure, ChunkHeader, first_failure, layer_hash
from kvflow.config import default_cache_dir
from kvflow.keys import ChunkKey
from kvflow.transport import (
    Capabilities,
    ChunkCorrupt,
    ChunkMissing,
    LoadJob,
    SaveJob,
    Transport,
    TransportContext,
    TransportError,
)

from ._format import HEADER_SIZE, encode_header, layer_offset, read_header

log = logging.getLogger("kvflow.fs")
T = TypeVar("T")


class FsOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options of the `fs` transport (`kv_connector_extra_config["options"]`)."""

    path: str = ""
    """Cache directory; default `$KVFLOW_CACHE_DIR` or `~/.cache/kvflow`, plus `/fs`."""
    max_gb: float = 16.0
    """Size cap; least-recently-used chunk files are evicted above it. 0: no cap."""
    verify: bool = True
    """Check each layer's XXH3-64 on load (a mismatch is a load error, never wrong tokens)."""
    fsync: bool = False
    """fsync each file before it becomes visible (survives power loss; slower)."""
    threads: int = 2
    """Threads one load or save reads or writes with at once, each on its own files."""


THREADS = 32
"""Threads of each kind (loads, saves) one fs transport runs at once."""
USAGE_FILE = ".usage"
"""The store's byte count, under the store's root, shared by every process using it."""

STALE_TMP_S = 3600.0
"""A temp file untouched this long belongs to a writer that died; swept at open."""


BATCH_BYTES = 64 << 20
"""Bytes one thread call writes or reads: a cancelled transfer stops between batches."""
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _batches(sizes: list[int]) -> list[range]:
    """Consecutive chunk indices in runs of about `BATCH_BYTES`."""
    out, start, acc = [], 0, 0
    for c, n in enumerate(sizes):
        acc += n
        if acc >= BATCH_BYTES:
            out.append(range(start, c + 1))
            start, acc = c + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


async def _in_threads(
    work: Callable[[range], T], batches: list[range], limiter: trio.CapacityLimiter, width: int
) -> list[T]:
    """`work(batch)` for every batch, in threads, `width` at a time; the results in
    order. An exception is raised as it is (of the first batch that raised one), once
    every started batch has ended."""
    results: list[Any] = [None] * len(batches)
    slots = trio.Semaphore(width)

    async def one(i: int) -> None:
        async with slots:
            try:
                results[i] = await trio.to_thread.run_sync(work, batches[i], limiter=limiter)
            except Exception as exc:  # kept, so a nursery does not wrap it in a group
                results[i] = exc

    async with trio.open_nursery() as nursery:
        for i in range(len(batches)):
            nursery.start_soon(one, i)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def _layer_groups(num_layers: int) -> list[range]:
    """Layers 0, 1, 2-3, 4-7, ...: what a layer-by-layer load reads per system call."""
    powers = (min(1 << i, num_layers) for i in range(num_layers.bit_length()))
    edges = sorted({0, num_layers, *powers})
    return [range(a, b) for a, b in itertools.pairwise(edges)]


def _move_all(
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
        for s in group:  # skip what was moved, finish what a short call left
            done, n = min(n, len(s)), max(0, n - len(s))
            while done < len(s):
                moved = call(fd, [s[done:]], offset + done)
                if not moved:
                    return offset + done - start
                done += moved
            offset += len(s)
    return offset - start


def _write_all(fd: int, spans: Sequence[memoryview], offset: int = 0) -> None:
    want = sum(len(s) for s in spans)
    if (n := _move_all(os.pwritev, fd, spans, offset)) != want:
        raise OSError(errno.EIO, f"wrote {n} of {want} bytes")


def _read_all(fd: int, spans: Sequence[memoryview], offset: int) -> int:
    return _move_all(os.preadv, fd, spans, offset)


class FsTransport(Transport):
    name = "fs"
    Options = FsOptions
    capabilities = Capabilities(store=True, peer=False, memory=frozenset({"cpu"}))

    def __init__(self, options: FsOptions, context: TransportContext) -> None:
        super().__init__(options, context)
        self.options: FsOptions = options
        base = Path(options.path).expanduser() if options.path else default_cache_dir() / "fs"
        self.root = base
        self.dir = base / context.namespace
        self.max_bytes = int(options.max_gb * (1 << 30))
        self._evicting = False
        self._chores = 0
        self._idle = trio.Event()
        self._idle.set()
        self.evictions = 0
        """Evictions this transport ran (the background task counts them)."""
        # Loads and saves have threads of their own: a layer the forward waits for never
        # queues behind saves (trio's default limiter would serve both, 40 threads).
        self._load_threads = trio.CapacityLimiter(THREADS)
        self._save_threads = trio.CapacityLimiter(THREADS)

    # -- lifecycle ---------------------------------------------------------
    async def open(self) -> None:
        if self.options.threads < 1:
            raise TransportError(
                "kv_connector_extra_config['options']['threads']: must be at least 1, "
                f"not {self.options.threads}"
            )
        where = "kv_connector_extra_config['options']['path']"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}.{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise TransportError(
                f"{where}: {str(self.root)!r} is not a writable directory ({exc.strerror or exc})"
            ) from None
        if self.context.role == "worker":  # off the start-up path: a big store takes a while
            self._spawn(self._scan_usage)

    # -- paths -------------------------------------------------------------
    def path(self, key: ChunkKey, shard: str | None = None) -> Path:
        return self.dir / key[:2] / f"{key}.{shard or self.context.shard}.kv"

    # -- lookup ------------------------------------------------------------
    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        return await trio.to_thread.run_sync(self._count_present, list(keys))

    def _count_present(self, keys: list[ChunkKey]) -> int:
        for i, key in enumerate(keys):
            if not all(os.path.exists(self.path(key, s)) for s in self.context.shards):
                return i
        return len(keys)

    # -- save --------------------------------------------------------------
    async def save(self, job: SaveJob) -> None:
        """Wait for every layer, then write each chunk's payload in one system call.

        Files are written whole, not layer by layer as the layers are computed: 512 files
        written a layer at a time took 1.5x as long as written one after another (bench
        `bench_fs_io.py`, decision 35), and vLLM keeps the blocks until the save returns.
        """
        layout = self.context.layout
        assert layout is not None, "fs save needs registered KV caches"
        n = len(job.keys)
        finals = [self.path(k) for k in job.keys]
        tmps = [p.with_name(f"{p.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}") for p in finals]
        fds: list[int | None] = [None] * n
        headers: list[ChunkHeader | None] = [None] * n
        committed = False
        try:
            await trio.to_thread.run_sync(
                self._create, finals, tmps, fds, limiter=self._save_threads
            )
            if not any(fd is not None for fd in fds):
                return
            layers = [await job.layer(i) for i in range(job.num_layers)]
            batches = _batches([layout.nbytes([n]) for n in job.token_counts])
            await _in_threads(
                functools.partial(self._write_chunks, job, fds, layers, headers),
                batches,
                self._save_threads,
                self.options.threads,
            )
            written = await trio.to_thread.run_sync(
                self._commit, fds, headers, tmps, finals, limiter=self._save_threads
            )
            committed = True
        except OSError as exc:
            raise TransportError(f"fs save under {self.dir}: {exc}") from exc
        finally:
            if not committed:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(
                        self._discard, fds, tmps, limiter=self._save_threads
                    )
        with trio.CancelScope(shield=True):  # the files are visible: count them
            usage = await trio.to_thread.run_sync(
                self._add_usage, written, limiter=self._save_threads
            )
        if self.max_bytes and usage > self.max_bytes and not self._evicting:
            self._evicting = True  # one eviction at a time, after the save returned
            self._spawn(self._evict)

    def _create(self, finals: list[Path], tmps: list[Path], fds: list[int | None]) -> None:
        """Open a temp file for each chunk not stored yet, into `fds` (so that a failure
        half-way leaves `fds` naming what `_discard` must clean up)."""
        for c, (final, tmp) in enumerate(zip(finals, tmps, strict=True)):
            if final.exists():  # same key, same bytes: someone saved it already
                continue
            final.parent.mkdir(parents=True, exist_ok=True)
            fds[c] = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def _write_chunks(
        self,
        job: SaveJob,
        fds: list[int | None],
        layers: list[list[list[memoryview]]],
        headers: list[ChunkHeader | None],
        chunks: range,
    ) -> None:
        """Write payload and header of each chunk in `chunks`; each layer is hashed just
        before, so the write copies it from the CPU's cache."""
        for c in chunks:
            fd = fds[c]
            if fd is None:
                continue
            spans = [layer[c] for layer in layers]
            h = ChunkHeader.of(self.context, job.keys[c], job.token_counts[c], spans)
            _write_all(fd, [s for ls in spans for s in ls], HEADER_SIZE)
            _write_all(fd, [memoryview(encode_header(h))], 0)  # apart: see decision 35
            headers[c] = h

    def _commit(
        self,
        fds: list[int | None],
        headers: list[ChunkHeader | None],
        tmps: list[Path],
        finals: list[Path],
    ) -> int:
        written = 0
        for c, (fd, h, tmp, final) in enumerate(zip(fds, headers, tmps, finals, strict=True)):
            if fd is None:
                continue
            assert h is not None, "every open chunk file was written"
            if self.options.fsync:
                os.fsync(fd)
            fds[c] = None  # closed: `_discard` must not close this number again
            os.close(fd)
            os.replace(tmp, final)
            written += HEADER_SIZE + h.payload_nbytes()
        return written

    def _discard(self, fds: list[int | None], tmps: list[Path]) -> None:
        """Close what is still open and remove every temp file (committed ones are gone)."""
        for fd, tmp in zip(fds, tmps, strict=True):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()

    # -- load --------------------------------------------------------------
    async def load(self, job: LoadJob) -> None:
        """Read straight into KV memory, each layer checked (XXH3-64, hashed right after
        it is read, from the CPU's cache) before it is signalled: vLLM may write into a
        loaded block as soon as its layer is signalled.

        A load the forward waits on (`job.layerwise`) reads layers in groups of 1, 1, 2,
        4, ... (`_layer_groups`): the first layer lands as soon as it can, and later
        ones, which the forward reaches later, come in fewer system calls. An
        asynchronous load reads each file in one system call.
        """
        assert self.context.layout is not None, "fs load needs registered KV caches"
        paths = [self.path(k) for k in job.keys]
        fds: list[int] = []
        headers: list[ChunkHeader] = []
        found: list[ChunkFailure | None] = []
        groups = _layer_groups(job.num_layers) if job.layerwise else [range(job.num_layers)]
        try:
            found.append(
                await trio.to_thread.run_sync(
                    self._open_chunks, job, paths, fds, headers, limiter=self._load_threads
                )
            )
            for group in groups:
                first = first_failure(found)
                intact = len(fds) if first is None else first.chunk
                spans = [job.spans(layer) for layer in group]
                sizes = [sum(h.layer_nbytes[i] for i in group) for h in headers[:intact]]
                found += await _in_threads(
                    functools.partial(self._read_layers, fds, headers, paths, group, spans),
                    _batches(sizes),
                    self._load_threads,
                    self.options.threads,
                )
                for layer in group:
                    job.layer_loaded(layer)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._close, fds, limiter=self._load_threads)
        failure = first_failure(found)
        if failure is not None:
            raise failure.error(job.keys[failure.chunk])

    def _open_chunks(
        self, job: LoadJob, paths: list[Path], fds: list[int], headers: list[ChunkHeader]
    ) -> ChunkFailure | None:
        """Open and validate each chunk's file into `fds` / `headers`, up to the first bad one."""
        for c, (key, count, path) in enumerate(zip(job.keys, job.token_counts, paths, strict=True)):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return ChunkFailure(c, ChunkMissing, f"missing file {path}")
            except OSError as exc:
                return ChunkFailure(c, TransportError, f"cannot open {path}: {exc}")
            try:
                h = read_header(fd)
                problem = h.problem(self.context, key, count)
                if not problem and os.fstat(fd).st_size < HEADER_SIZE + h.payload_nbytes():
                    problem = "truncated payload"
            except BadHeader as exc:
                problem = str(exc)
            except OSError as exc:
                os.close(fd)
                return ChunkFailure(c, TransportError, f"cannot read {path}: {exc}")
            if problem:
                failure = self._corrupt(c, fd, path, problem)
                os.close(fd)
                return failure
            fds.append(fd)
            headers.append(h)
        return None

    def _read_layers(
        self,
        fds: list[int],
        headers: list[ChunkHeader],
        paths: list[Path],
        group: range,
        spans: list[list[list[memoryview]]],
        chunks: range,
    ) -> ChunkFailure | None:
        """Read layers `group` of each chunk in `chunks` (adjacent in the file: one system
        call), then check each of them; `spans[i]` are the spans of layer `group[i]`."""
        for c in chunks:
            fd, h = fds[c], headers[c]
            mine = [layer[c] for layer in spans]
            want = sum(h.layer_nbytes[i] for i in group)
            where = f"layer {group[0]}" if len(group) == 1 else f"layers {group[0]}-{group[-1]}"
            try:
                got = _read_all(fd, [s for ls in mine for s in ls], layer_offset(h, group[0]))
            except OSError as exc:
                return ChunkFailure(c, TransportError, f"cannot read {where} of {paths[c]}: {exc}")
            if got != want:
                return self._corrupt(
                    c, fd, paths[c], f"short read ({got} of {want} bytes) in {where}"
                )
            if self.options.verify:
                for layer, s in zip(group, mine, strict=True):
                    if layer_hash(s) != h.layer_hash[layer]:
                        return self._corrupt(c, fd, paths[c], f"checksum mismatch in layer {layer}")
        return None

    def _corrupt(self, chunk: int, fd: int, path: Path, problem: str) -> ChunkFailure:
        """A chunk file that failed validation: delete it, so that the next save of its key
        writes it again instead of every later load failing on it."""
        deleted = False
        with contextlib.suppress(OSError):
            st, now = os.fstat(fd), os.stat(path)
            # unless a writer has renamed a new file into place since we opened this one
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(path)
                deleted = True
                self._add_usage(-st.st_size)
                log.warning("kvflow fs: deleted bad chunk file %s (%s)", path, problem)
        return ChunkFailure(
            chunk, ChunkCorrupt, f"{problem} in {path}{'; deleted it' if deleted else ''}"
        )

    def _close(self, fds: list[int]) -> None:
        now = time.time()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.utime(fd, (now, now))  # recency for LRU eviction
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- capacity ----------------------------------------------------------
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

    def _files(self) -> list[os.DirEntry[str]]:
        return [e for e in self._walk() if e.name.endswith(".kv")]

    def _spawn(self, work: Callable[[], None]) -> None:
        """Start a store-wide chore (scan, eviction) apart from every transfer."""
        if not self._chores:
            self._idle = trio.Event()
        self._chores += 1
        trio.lowlevel.spawn_system_task(self._background, work, name=f"fs{work.__name__}")

    async def _background(self, work: Callable[[], None]) -> None:
        try:
            await trio.to_thread.run_sync(work)
        except Exception as exc:  # the chunks are stored; a failed chore is not a transfer's
            log.warning("kvflow fs: %s under %s failed: %s", work.__name__, self.root, exc)
        finally:
            if work == self._evict:
                self._evicting = False
            self._chores -= 1
            if not self._chores:
                self._idle.set()

    async def chores_done(self) -> None:
        """Wait until the store-wide chores started so far (scan, eviction) ended."""
        await self._idle.wait()

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

    def _add_usage(self, delta: int, *, total: int | None = None) -> int:
        """Add `delta` bytes to the store's usage, or set it to `total`: one count in
        `root/.usage` for every process that uses the store. Returns the new count."""
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

    def _scan_usage(self) -> None:
        """Count the chunk files in the store into the shared usage; sweep temp files a
        crashed writer left."""
        usage, cutoff = 0, time.time() - STALE_TMP_S
        for e in self._walk():
            with contextlib.suppress(FileNotFoundError):
                if e.name.endswith(".kv"):
                    usage += e.stat().st_size
                elif ".kv.tmp." in e.name and e.stat().st_mtime < cutoff:
                    os.unlink(e.path)
        self._add_usage(0, total=usage)

    def _evict(self) -> None:
        """Delete least-recently-used chunk files until usage is 90% of the cap (one
        process at a time: another one evicting already is enough)."""
        with self._locked(".evict.lock", blocking=False) as mine:
            if mine:
                self._evict_locked()

    def _evict_locked(self) -> None:
        entries = []
        for e in self._files():
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
        usage = self._add_usage(-freed)
        self.evictions += 1
        removed = sum(len(keys) for keys in gone.values())
        log.info("kvflow fs: evicted %d chunk files; %d bytes remain", removed, usage)
        if self.context.evicted is not None:  # for vLLM's KV events
            for namespace, keys in gone.items():
                self.context.evicted(namespace, keys)
