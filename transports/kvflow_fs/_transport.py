"""The `fs` transport: atomic chunk files, read straight into KV memory."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import trio

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

from ._format import HEADER_SIZE, BadHeader, ChunkHeader, crc_of, encode_header, read_header

log = logging.getLogger("kvflow.fs")


class FsOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options of the `fs` transport (`kv_connector_extra_config["options"]`)."""

    path: str = ""
    """Cache directory; default `$KVFLOW_CACHE_DIR` or `~/.cache/kvflow`, plus `/fs`."""
    max_gb: float = 16.0
    """Size cap; least-recently-used chunk files are evicted above it. 0: no cap."""
    verify: bool = True
    """Check each layer's CRC32 on load (a mismatch is a load error, never wrong tokens)."""
    fsync: bool = False
    """fsync each file before it becomes visible (survives power loss; slower)."""


def _write_all(fd: int, spans: Sequence[memoryview], offset: int) -> None:
    total = sum(len(s) for s in spans)
    n = os.pwritev(fd, spans, offset)
    if n != total:  # short write: finish span by span
        for s in spans:
            done = 0
            while done < len(s):
                done += os.pwrite(fd, s[done:], offset + done)
            offset += len(s)


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
        self._usage = 0
        self._evicting = False

    # -- lifecycle ---------------------------------------------------------
    async def open(self) -> None:
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
        if self.context.role == "worker" and self.max_bytes:
            self._usage = await trio.to_thread.run_sync(self._scan_usage)

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
        layout = self.context.layout
        assert layout is not None, "fs save needs registered KV caches"
        n = len(job.keys)
        finals = [self.path(k) for k in job.keys]
        tmps = [p.with_name(f"{p.name}.tmp.{os.getpid()}.{secrets.token_hex(4)}") for p in finals]
        fds: list[int | None] = await trio.to_thread.run_sync(self._create, finals, tmps)
        layer_nbytes = [
            [layout.chunk_nbytes(i, c) for i in range(job.num_layers)] for c in job.token_counts
        ]
        crcs: list[list[int]] = [[] for _ in range(n)]
        committed = False
        try:
            if not any(fd is not None for fd in fds):
                return
            for layer in range(job.num_layers):
                spans = await job.layer(layer)
                offsets = [HEADER_SIZE + sum(layer_nbytes[c][:layer]) for c in range(n)]
                layer_crcs = await trio.to_thread.run_sync(self._write_layer, fds, spans, offsets)
                for c in range(n):
                    crcs[c].append(layer_crcs[c])
            headers = [
                ChunkHeader(
                    key=job.keys[c],
                    namespace=self.context.namespace,
                    shard=self.context.shard,
                    num_tokens=job.token_counts[c],
                    layer_nbytes=layer_nbytes[c],
                    layer_crc=crcs[c],
                )
                for c in range(n)
            ]
            written = await trio.to_thread.run_sync(self._commit, fds, headers, tmps, finals)
            committed = True
            self._usage += written
            if self.max_bytes and self._usage > self.max_bytes and not self._evicting:
                self._evicting = True
                try:
                    self._usage = await trio.to_thread.run_sync(self._evict)
                finally:
                    self._evicting = False
        finally:
            if not committed:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self._discard, fds, tmps)

    def _create(self, finals: list[Path], tmps: list[Path]) -> list[int | None]:
        fds: list[int | None] = []
        for final, tmp in zip(finals, tmps, strict=True):
            if final.exists():  # same key, same bytes: someone saved it already
                fds.append(None)
                continue
            final.parent.mkdir(parents=True, exist_ok=True)
            fds.append(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        return fds

    def _write_layer(
        self, fds: list[int | None], spans: list[list[memoryview]], offsets: list[int]
    ) -> list[int]:
        crcs = []
        for fd, chunk_spans, off in zip(fds, spans, offsets, strict=True):
            if fd is None:
                crcs.append(0)
                continue
            crcs.append(crc_of(chunk_spans))
            _write_all(fd, chunk_spans, off)
        return crcs

    def _commit(
        self,
        fds: list[int | None],
        headers: list[ChunkHeader],
        tmps: list[Path],
        finals: list[Path],
    ) -> int:
        written = 0
        for fd, h, tmp, final in zip(fds, headers, tmps, finals, strict=True):
            if fd is None:
                continue
            os.pwrite(fd, encode_header(h), 0)
            if self.options.fsync:
                os.fsync(fd)
            os.close(fd)
            os.replace(tmp, final)
            written += HEADER_SIZE + h.payload_nbytes()
        return written

    def _discard(self, fds: list[int | None], tmps: list[Path]) -> None:
        for fd, tmp in zip(fds, tmps, strict=True):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                with contextlib.suppress(OSError):
                    tmp.unlink()

    # -- load --------------------------------------------------------------
    async def load(self, job: LoadJob) -> None:
        layout = self.context.layout
        assert layout is not None, "fs load needs registered KV caches"
        fds, headers, intact, reason = await trio.to_thread.run_sync(self._open_chunks, job)
        try:
            for layer in range(job.num_layers):
                if intact:
                    spans = job.spans(layer)[:intact]
                    intact, why = await trio.to_thread.run_sync(
                        self._read_layer, fds[:intact], headers[:intact], spans, layer
                    )
                    reason = why or reason
                job.layer_loaded(layer)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._close, fds)
        if intact < len(job.keys):
            key = job.keys[intact]
            cls = ChunkMissing if reason.startswith("missing") else ChunkCorrupt
            raise cls(f"chunk {intact} ({key}): {reason}", chunk=intact, key=key)

    def _open_chunks(self, job: LoadJob) -> tuple[list[int], list[ChunkHeader], int, str]:
        layout = self.context.layout
        assert layout is not None
        fds: list[int] = []
        headers: list[ChunkHeader] = []
        for key, count in zip(job.keys, job.token_counts, strict=True):
            path = self.path(key)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return fds, headers, len(fds), f"missing file {path}"
            try:
                h = read_header(fd)
                expect = [layout.chunk_nbytes(i, count) for i in range(job.num_layers)]
                problem = (
                    "key mismatch"
                    if h.key != key
                    else "written by another configuration"
                    if h.namespace != self.context.namespace
                    else "shard mismatch"
                    if h.shard != self.context.shard
                    else "token count mismatch"
                    if h.num_tokens != count
                    else "layer sizes do not match this KV layout"
                    if h.layer_nbytes != expect
                    else "truncated payload"
                    if os.fstat(fd).st_size < HEADER_SIZE + h.payload_nbytes()
                    else ""
                )
            except BadHeader as exc:
                problem = str(exc)
            if problem:
                os.close(fd)
                return fds, headers, len(fds), f"{problem} in {path}"
            fds.append(fd)
            headers.append(h)
        return fds, headers, len(fds), ""

    def _read_layer(
        self, fds: list[int], headers: list[ChunkHeader], spans: list[list[memoryview]], layer: int
    ) -> tuple[int, str]:
        for c, (fd, h, chunk_spans) in enumerate(zip(fds, headers, spans, strict=True)):
            want = h.layer_nbytes[layer]
            got = os.preadv(fd, chunk_spans, h.layer_offset(layer))
            if got != want:
                return c, f"short read ({got} of {want} bytes) in layer {layer}"
            if self.options.verify and crc_of(chunk_spans) != h.layer_crc[layer]:
                return c, f"checksum mismatch in layer {layer}"
        return len(fds), ""

    def _close(self, fds: list[int]) -> None:
        now = time.time()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.utime(fd, (now, now))  # recency for LRU eviction
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- capacity ----------------------------------------------------------
    def _files(self) -> list[os.DirEntry[str]]:
        out: list[os.DirEntry[str]] = []
        if not self.root.is_dir():
            return out
        for ns in os.scandir(self.root):
            if not ns.is_dir():
                continue
            for sub in os.scandir(ns.path):
                if sub.is_dir():
                    out.extend(e for e in os.scandir(sub.path) if e.name.endswith(".kv"))
        return out

    def _scan_usage(self) -> int:
        return sum(e.stat().st_size for e in self._files())

    def _evict(self) -> int:
        """Delete least-recently-used chunk files until usage is 90% of the cap."""
        entries = []
        for e in self._files():
            with contextlib.suppress(FileNotFoundError):
                st = e.stat()
                entries.append((st.st_mtime, st.st_size, e.path))
        entries.sort()
        usage = sum(size for _, size, _ in entries)
        target = int(self.max_bytes * 0.9)
        removed = 0
        for _, size, path in entries:
            if usage <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                usage -= size
                removed += 1
        log.info("kvflow fs: evicted %d chunk files; %d bytes remain", removed, usage)
        return usage
