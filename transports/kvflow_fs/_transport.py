"""The `fs` transport: atomic chunk files, read straight into KV memory."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import trio

from kvflow.chunks import BadHeader, ChunkFailure, ChunkHeader, first_failure
from kvflow.config import default_cache_dir
from kvflow.findings import Findings
from kvflow.keys import ChunkKey, is_chunk_key, is_plain_name, shown
from kvflow.threads import in_new_thread
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

from . import _doctor, _perms
from ._batch import Batched
from ._format import HEADER_SIZE, encode_header, group_extents, read_header
from ._io import IOV_MAX, read_all, write_all
from ._loading import Reading, layer_groups, load_runs, runs
from ._shards import KnownShards
from ._usage import StoreUsage

log = logging.getLogger("kvflow.fs")
T = TypeVar("T")
Extents = dict[int, list[tuple[int, int]]]
"""Of each token count of a load's chunks: each layer group's offset and size in the file."""


class FsOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options of the `fs` transport (`kv_connector_extra_config["options"]`)."""

    path: str = ""
    """Cache directory; default `$KVFLOW_CACHE_DIR` or `~/.cache/kvflow`, plus `/fs`."""
    max_gb: float = 16.0
    """Size cap; least-recently-used chunk files are evicted above it. 0: no cap."""
    verify: bool = True
    """Check each layer's XXH3-64 on load (a mismatch is a load error, never wrong tokens).
    Under a store key (`store_key_file`) each layer's keyed BLAKE3 is checked whatever
    this says."""
    fsync: bool = False
    """fsync each file before it becomes visible (survives power loss; slower)."""
    threads: int = 2
    """Threads one load or save reads or writes with at once, each on its own files."""
    file_mode: str = "0600"
    """Permissions of the chunk files (octal), less the umask: owner-only by default;
    e.g. "0640" for a store several users read through a group, "0660" for one they
    write. The store's directories (its root included) and bookkeeping files get the
    same, directories plus search where read is granted (0700 by default); at open, a
    root or namespace directory of another user's, or writable beyond this, is refused."""


THREADS = 32
"""Threads of each kind (loads, saves) one fs transport runs at once."""

BATCH_BYTES = 64 << 20
"""Bytes one thread call of a save writes: a cancelled save stops between batches."""


def _batches(sizes: list[int]) -> list[range]:
    """A save's chunk indices in runs of about `BATCH_BYTES`."""
    return runs(sizes, BATCH_BYTES)


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


def _which(group: range) -> str:
    """Layers `group`, in words."""
    return f"layer {group[0]}" if len(group) == 1 else f"layers {group[0]}-{group[-1]}"


def store_root(options: FsOptions) -> Path:
    """The store's directory: `path`, or `fs` in kvflow's cache directory."""
    return Path(options.path).expanduser() if options.path else default_cache_dir() / "fs"


class FsTransport(Transport):
    name = "fs"
    Options = FsOptions
    capabilities = Capabilities(store=True, peer=False, memory=frozenset({"cpu"}), reshape=True)

    def __init__(self, options: FsOptions, context: TransportContext) -> None:
        super().__init__(options, context)
        self.options: FsOptions = options
        base = store_root(options)
        self.root = base
        self.dir = base / context.namespace
        self._dir = str(self.dir)
        self.usage = StoreUsage(base, int(options.max_gb * (1 << 30)), lambda: context.evicted)
        """The store's byte count and eviction, shared with every process using it."""
        # Loads and saves have threads of their own: a layer the forward waits for never
        # queues behind saves (trio's default limiter would serve both, 40 threads).
        self._load_threads = trio.CapacityLimiter(THREADS)
        self._save_threads = trio.CapacityLimiter(THREADS)
        self._file_mode = 0o600
        self._dir_mode = 0o700
        self._lookups = Batched(_count_each)
        """Lookups that come together are answered in one worker thread call (`_batch`)."""
        self._shards = KnownShards(self._dir)
        """The shards this namespace holds files of (`_shards`)."""

    # -- lifecycle ---------------------------------------------------------
    async def open(self) -> None:
        if self.options.threads < 1:
            raise TransportError(
                "kv_connector_extra_config['options']['threads']: must be at least 1, "
                f"not {self.options.threads}"
            )
        self._file_mode = _file_mode(self.options.file_mode)
        self._dir_mode = _perms.dir_mode(self._file_mode)
        if not is_plain_name(self.context.namespace):  # one directory below the root
            raise TransportError(
                f"fs: refused namespace {shown(self.context.namespace)}: not a plain name "
                "(letters, digits, '_', '-', '.', not starting with '.')"
            )
        where = "kv_connector_extra_config['options']['path']"
        self.usage.file_mode = self._file_mode
        try:  # the root gets dir_mode too (its parents, if made, the umask's default)
            self.root.parent.mkdir(parents=True, exist_ok=True)
            _mkdir(self.root, self._dir_mode)
            if not self.root.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            self._refuse_unsafe(self.root, where, follow=True)
            _mkdir(self.dir, self._dir_mode)
            self._refuse_unsafe(self.dir, where, follow=False)
            probe = self.dir / f".probe.{os.getpid()}.{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise TransportError(
                f"{where}: {str(self.root)!r} is not a writable directory ({exc.strerror or exc})"
            ) from None
        if self.context.role == "worker":  # off the start-up path: a big store takes a while
            self.usage.own_shards.append((self._dir, self.context.shard))
            self.usage.scan_soon()

    def _refuse_unsafe(self, directory: Path, where: str, *, follow: bool) -> None:
        """Refuse a store directory others could plant chunk files in (`_perms.unsafe`)."""
        if problem := _perms.unsafe(directory, self._file_mode, follow=follow):
            found, fix = problem
            raise TransportError(f"{where}: fs refuses this store: {found}; fix: {fix}")

    @classmethod
    def doctor(cls, options: FsOptions, findings: Findings) -> None:
        """`kvflow doctor`: the directory writable, free space against `max_gb`, `file_mode`."""
        _doctor.check(options, findings)

    # -- paths -------------------------------------------------------------
    def path(self, key: ChunkKey, shard: str | None = None) -> Path:
        """The file of chunk `key`; a key of any other form than `chunk_keys` gives (a
        client's `../x`) is refused before it names a file."""
        return Path(self._file(key, shard or self.context.shard))

    def _file(self, key: ChunkKey, shard: str) -> str:
        """`path` as a string (a lookup makes one per chunk and shard: a `Path` each cost
        lookups more than their `stat` calls, bench/bench_sched_scale.py)."""
        if not is_chunk_key(key):
            raise TransportError(
                f"fs: refused chunk key {shown(key)}: not 32 lowercase hex characters"
            )
        return f"{self._dir}/{key[:2]}/{key}.{shard}.kv"

    # -- lookup ------------------------------------------------------------
    async def lookup(self, keys: Sequence[ChunkKey], shards: Sequence[str] = ()) -> int:
        """Leading keys with a file for each of `shards` (default: this engine's)."""
        shards = shards or self.context.shards
        if not all(is_plain_name(s) for s in shards):
            raise TransportError(f"fs: refused shard names {shown(list(shards))}")
        if list(shards) != list(self.context.shards):  # another size's (`lookup_sources`)
            known = await self._shards.get()
            if known is not None and not known.issuperset(shards):
                return 0  # no file of some shard it needs: not one `stat` (`_shards`)
        return await self._lookups([[self._file(k, s) for s in shards] for k in keys])

    async def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Count this shard's files of `keys` as just read: eviction takes the oldest
        modification times first, and a load sets its files' to now."""
        paths = [self.path(k) for k in keys]
        await trio.to_thread.run_sync(_touch_files, paths)

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
                _create,
                finals,
                tmps,
                fds,
                self._file_mode,
                self._dir_mode,
                limiter=self._save_threads,
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
                _commit, fds, headers, tmps, finals, self.options.fsync, limiter=self._save_threads
            )
            committed = True
        except OSError as exc:
            raise TransportError(f"fs save under {self.dir}: {exc}") from exc
        finally:
            if not committed:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(_discard, fds, tmps, limiter=self._save_threads)
        self.usage.saved(*written)  # counted (and evicted past the cap) after this returns

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
            write_all(fd, [s for ls in spans for s in ls], HEADER_SIZE)
            write_all(fd, [memoryview(encode_header(h))], 0)  # apart: see decision 35
            headers[c] = h

    # -- load --------------------------------------------------------------
    async def load(self, job: LoadJob) -> None:
        """Read straight into KV memory, each layer checked (XXH3-64, or under a store key
        keyed BLAKE3, hashed right after it is read, from the CPU's cache) before it is
        signalled: vLLM may write into a loaded block as soon as its layer is signalled.

        A load the forward waits on (`job.layerwise`) reads layers in groups of 1, 1, 2,
        4, ... (`layer_groups`): the first layer lands as soon as it can, and later
        ones, which the forward reaches later, come in fewer system calls. An
        asynchronous load reads each file in one system call. Its `threads` threads
        take runs of chunks group by group, none waiting for another (`_loading`); a
        group's layers are signalled once every run of it is read.
        """
        layout = job.layout or self.context.layout
        assert layout is not None, "fs load needs registered KV caches"
        if job.shard and not is_plain_name(job.shard):
            raise TransportError(f"fs: refused shard name {shown(job.shard)}")
        paths = [self._file(k, job.shard or self.context.shard) for k in job.keys]
        groups = layer_groups(job.num_layers) if job.layerwise else [range(job.num_layers)]
        chunk_runs = load_runs(job.token_counts, self.options.threads)
        # every span made first: made while the threads read, they held the GIL from them
        spans = [[job.spans(layer) for layer in g] for g in groups] if job.keys else []
        # a chunk's header must give its layout's sizes (`ChunkHeader.problem`): where its
        # groups lie depends on its token count alone
        extents = {n: group_extents(layout.layer_nbytes(n), groups) for n in set(job.token_counts)}
        reading = Reading(groups, chunk_runs, spans, len(job.keys))
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(min(self.options.threads, len(chunk_runs))):
                    nursery.start_soon(self._read_in_thread, job, paths, extents, reading)
                try:
                    for g, group in enumerate(groups):
                        if chunk_runs:
                            await reading.done[g].wait()
                        if reading.error is not None:
                            break
                        for layer in group:
                            job.layer_loaded(layer)
                finally:
                    reading.end()
        finally:
            if left := reading.still_open():  # it stopped early: every thread has ended
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self._close, left, limiter=self._load_threads)
        if reading.error is not None:
            raise reading.error
        failure = first_failure(reading.failures)
        if failure is not None:
            raise failure.error(job.keys[failure.chunk])

    async def _read_in_thread(
        self, job: LoadJob, paths: list[str], extents: Extents, reading: Reading
    ) -> None:
        try:  # a new thread each: see kvflow.threads
            await in_new_thread(
                self._read_runs, job, paths, extents, reading, limiter=self._load_threads
            )
        except Exception as exc:  # kept for `load` to raise, not wrapped in a group
            reading.raised(exc)

    def _read_runs(
        self, job: LoadJob, paths: list[str], extents: Extents, reading: Reading
    ) -> None:
        """In a thread: read what `reading` hands out, run by run: a run's files opened
        and checked in the first group, each of its chunks read and checked in each,
        its files closed once every group of it is read."""
        for g, r in reading.take():
            run = reading.runs[r]
            if g == 0:
                self._open_chunks(job, paths, run, reading)
            self._read_group(job, paths, extents, reading, g, run)
            if reading.read(g, r):  # every group of the run is read: its files are done
                self._close([fd for c in run if (fd := reading.fds[c]) is not None])
                reading.fds[run.start : run.stop] = [None] * len(run)

    def _open_chunks(self, job: LoadJob, paths: list[str], run: range, reading: Reading) -> None:
        """Open and validate each of `run`'s files into `reading.fds` / `headers`, up to
        the first bad one (told to `reading`)."""
        for c in run:
            if c >= reading.limit:
                return
            key, count, path = job.keys[c], job.token_counts[c], paths[c]
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return reading.failed(ChunkFailure(c, ChunkMissing, f"missing file {path}"))
            except OSError as exc:
                return reading.failed(ChunkFailure(c, TransportError, f"cannot open {path}: {exc}"))
            try:
                h = read_header(fd)
                problem = h.problem(self.context, key, count, job)
                if problem and job.shard:  # another shape's chunk, not ours: left alone
                    os.close(fd)
                    return reading.failed(ChunkFailure(c, ChunkCorrupt, f"{problem} in {path}"))
                if not problem and os.fstat(fd).st_size < HEADER_SIZE + h.payload_nbytes():
                    problem = "truncated payload"
            except BadHeader as exc:
                problem = str(exc)
            except OSError as exc:
                os.close(fd)
                return reading.failed(ChunkFailure(c, TransportError, f"cannot read {path}: {exc}"))
            if problem:
                failure = self._corrupt(c, fd, path, problem)
                os.close(fd)
                return reading.failed(failure)
            reading.fds[c], reading.headers[c] = fd, h
        return None

    def _read_group(
        self,
        job: LoadJob,
        paths: list[str],
        extents: Extents,
        reading: Reading,
        g: int,
        run: range,
    ) -> None:
        """Group `g`'s layers of each chunk of `run` (adjacent in its file: one system
        call), then each layer checked, up to the first bad chunk (told to `reading`).

        The loop a load's readers spend their time in: the Python it runs between reads
        holds the GIL the other readers wait for after theirs (decision 106), so what
        is the same for every chunk is worked out before it (`extents`, these locals)."""
        group, by_layer, fds, headers = (
            reading.groups[g],
            reading.spans[g],
            reading.fds,
            reading.headers,
        )
        counts, sk = job.token_counts, self.context.store_key
        check = self.options.verify or sk is not None  # a store key's checksums always are
        for c in run:
            fd, h = fds[c], headers[c]
            if reading.stop or c >= reading.limit or fd is None or h is None:
                return
            offset, want = extents[counts[c]][g]
            mine = [layer[c] for layer in by_layer]
            flat = mine[0] if len(mine) == 1 else [s for spans in mine for s in spans]
            try:
                got = self._read(fd, flat, offset, want)
            except OSError as exc:
                what = f"cannot read {_which(group)} of {paths[c]}: {exc}"
                return reading.failed(ChunkFailure(c, TransportError, what))
            if got != want:
                why = f"short read ({got} of {want} bytes) in {_which(group)}"
                return reading.failed(self._corrupt(c, fd, paths[c], why))
            if check and (bad := h.first_bad_layer(group, mine, sk)) is not None:
                why = f"checksum mismatch in layer {bad}"
                return reading.failed(self._corrupt(c, fd, paths[c], why))
        return None

    def _read(self, fd: int, spans: list[memoryview], offset: int, want: int) -> int:
        """Read `want` bytes at `offset` into `spans` in one `preadv`, or, if that call is
        cut short (or the spans are more than one call takes), with `read_all`; the
        bytes read (fewer: the file ended)."""
        got = os.preadv(fd, spans, offset) if len(spans) <= IOV_MAX else -1
        return got if got == want else read_all(fd, spans, offset)

    def _corrupt(self, chunk: int, fd: int, path: str, problem: str) -> ChunkFailure:
        """A chunk file that failed validation: delete it, so that the next save of its key
        writes it again instead of every later load failing on it."""
        deleted = False
        with contextlib.suppress(OSError):
            st, now = os.fstat(fd), os.stat(path)
            # unless a writer has renamed a new file into place since we opened this one
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(path)
                deleted = True
                self.usage.defer(-st.st_size)  # counted by the next chore: no lock here
                log.warning("kvflow fs: deleted bad chunk file %s (%s)", path, problem)
        return ChunkFailure(
            chunk, ChunkCorrupt, f"{problem} in {path}{'; deleted it' if deleted else ''}"
        )

    def _close(self, fds: list[int]) -> None:
        _close_files(fds)

    # -- capacity ----------------------------------------------------------
    @property
    def evictions(self) -> int:
        """Evictions this transport's process ran."""
        return self.usage.evictions

    async def chores_done(self) -> None:
        """Wait until the store-wide chores started so far (scan, eviction) ended."""
        await self.usage.chores_done()


def _file_mode(text: str) -> int:
    """The `file_mode` option as permission bits: octal, owner read and write at least."""
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        raise TransportError(
            f"kv_connector_extra_config['options']['file_mode']: {shown(text)} is not "
            'octal permissions with owner read and write, like "0600" or "0640"'
        )
    return mode


def _mkdir(path: Path, mode: int) -> None:
    """Make directory `path` with `mode` (less the umask) unless something is there."""
    if not os.path.lexists(path):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, mode)


def _count_each(lookups: list[list[list[str]]]) -> list[int]:
    """`_count_present` of each lookup."""
    return [_count_present(paths) for paths in lookups]


def _count_present(paths: list[list[str]]) -> int:
    """How many leading chunks have every shard's file (`paths[chunk][shard]`)."""
    for i, shards in enumerate(paths):
        if not all(os.path.exists(p) for p in shards):
            return i
    return len(paths)


def _create(
    finals: list[Path], tmps: list[Path], fds: list[int | None], mode: int, dir_mode: int
) -> None:
    """Open a temp file for each chunk not stored yet, into `fds` (so that a failure
    half-way leaves `fds` naming what `_discard` must clean up)."""
    for c, (final, tmp) in enumerate(zip(finals, tmps, strict=True)):
        if final.exists():  # same key, same bytes: someone saved it already
            continue
        final.parent.mkdir(parents=True, exist_ok=True, mode=dir_mode)
        fds[c] = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)


def _commit(
    fds: list[int | None],
    headers: list[ChunkHeader | None],
    tmps: list[Path],
    finals: list[Path],
    fsync: bool,
) -> tuple[int, list[int]]:
    """Make each written chunk visible under its final name (fsynced first if asked);
    the bytes committed, and the files' inode numbers (`StoreUsage.saved`)."""
    written, inodes = 0, []
    for c, (fd, h, tmp, final) in enumerate(zip(fds, headers, tmps, finals, strict=True)):
        if fd is None:
            continue
        assert h is not None, "every open chunk file was written"
        if fsync:
            os.fsync(fd)
        inode = os.fstat(fd).st_ino
        fds[c] = None  # closed: `_discard` must not close this number again
        os.close(fd)
        if _link(tmp, final):
            written += HEADER_SIZE + h.payload_nbytes()
            inodes.append(inode)
    return written, inodes


def _link(tmp: Path, final: Path) -> bool:
    """Give `tmp` the name `final`, unless another process committed the same key since
    `_create` looked (same key, same bytes): then its file stays and is counted once, by
    its saver (two engines saving one prefix at once over-counted the store by a file,
    tests/transports/test_fs_shared.py). Whether this file is now the key's."""
    try:
        os.link(tmp, final)  # never replaces (a rename would)
    except FileExistsError:
        os.unlink(tmp)
        return False
    except OSError:  # a file system without hard links: the last rename wins
        os.replace(tmp, final)
        return True
    with contextlib.suppress(OSError):  # committed; a temp name left is swept at open
        os.unlink(tmp)
    return True


def _discard(fds: list[int | None], tmps: list[Path]) -> None:
    """Close what is still open and remove every temp file (committed ones are gone)."""
    for fd, tmp in zip(fds, tmps, strict=True):
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()


def _touch_files(files: Sequence[Path | int]) -> None:
    """Set each file's times (a path or an open descriptor) to now: recency for LRU
    eviction. A file gone is skipped."""
    now = time.time()
    for f in files:
        with contextlib.suppress(OSError):
            os.utime(f, (now, now))


def _close_files(fds: list[int]) -> None:
    """Close the files a load read, touching each first (recency for LRU eviction)."""
    _touch_files(fds)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
