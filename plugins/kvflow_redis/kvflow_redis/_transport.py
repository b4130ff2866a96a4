"""The `redis` transport: one Redis string value per chunk and shard, shared by every engine
that reaches the server."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import trio

from kvflow import (
    BadHeader,
    Capabilities,
    ChunkCorrupt,
    ChunkFailure,
    ChunkHeader,
    ChunkKey,
    ChunkMissing,
    KVLayout,
    LoadJob,
    SaveJob,
    Transport,
    TransportContext,
    TransportError,
    first_failure,
    layer_hash,
)

from ._format import decode_trailer, encode_trailer
from ._resp import (
    MAX_BULK,
    Address,
    BadURL,
    Buffer,
    Connection,
    Pool,
    RedisError,
    encode,
    network_error,
    parse_url,
)

log = logging.getLogger("kvflow.redis")

_WHERE = "kv_connector_extra_config['options']"
LOAD_WINDOW_BYTES = 16 << 20
"""A load asks for more layers only while fewer bytes than this are requested and unread."""


class RedisOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options of the `redis` transport (`kv_connector_extra_config["options"]`)."""

    url: str = "redis://127.0.0.1:6379/0"
    """The server: `redis://[[user]:password@]host[:port][/db]` or
    `unix://[[user]:password@]/path/to/redis.sock[?db=N]`. Every engine (scheduler and
    workers, on every machine) that should share the cache names the same server and db."""
    key_prefix: str = "kvflow:"
    """Prepended to every key (`<prefix><namespace>:<chunk key>:<shard>`), to share a
    server with other data or keep deployments apart."""
    ttl_s: float = 0.0
    """Expire a chunk this many seconds after its last save (`SET ... PX`). 0: never; the
    server's `maxmemory-policy allkeys-lru` evicts instead (see the README)."""
    verify: bool = True
    """Check each layer's XXH3-64 on load before vLLM may use it (a mismatch is a load
    error that vLLM recomputes, never wrong tokens). The hash is always written."""
    max_connections: int = 16
    """Connections per transport instance (each engine process has one per worker and
    one in its scheduler); one transfer uses one connection, more wait for a free one."""
    timeout_s: float = 10.0
    """Connecting, and any wait for the server to take or send bytes, fails after this
    long (a hung server becomes a transfer error, not a stalled engine)."""


class RedisTransport(Transport):
    name = "redis"
    Options = RedisOptions
    capabilities = Capabilities(store=True, peer=False, memory=frozenset({"cpu"}), reshape=True)

    def __init__(self, options: RedisOptions, context: TransportContext) -> None:
        super().__init__(options, context)
        self.options: RedisOptions = options
        self.addr: Address | None = None
        self._pool: Pool | None = None
        self._max_bulk = MAX_BULK

    # -- lifecycle ---------------------------------------------------------
    async def open(self) -> None:
        o = self.options
        if not (o.max_connections >= 1):
            raise TransportError(f"{_WHERE}['max_connections'] must be >= 1")
        if not (o.timeout_s > 0 and math.isfinite(o.timeout_s)):
            raise TransportError(f"{_WHERE}['timeout_s'] must be a positive number of seconds")
        if not (o.ttl_s >= 0 and math.isfinite(o.ttl_s)):
            raise TransportError(f"{_WHERE}['ttl_s'] must be >= 0 (0: no expiry)")
        try:
            self.addr = parse_url(o.url)
        except BadURL as exc:
            raise TransportError(f"{_WHERE}['url']: {exc}") from None
        name = f"kvflow-{self.context.role}-{self.context.shard}"
        self._pool = Pool(self.addr, o.max_connections, o.timeout_s, name)
        self._pool.max_bulk = self._max_bulk
        try:
            async with self._pool.connection() as conn:
                policy = await conn.pipeline([("CONFIG", "GET", "maxmemory-policy")])
        except BaseException as raised:
            self._pool.close()
            err = network_error(raised)
            if err is None:
                raise
            raise TransportError(
                f"{_WHERE}['url']: cannot use the redis server at {self.addr.redacted()} "
                f"({_describe(err, o.timeout_s)})"
            ) from None
        reply = policy[0]
        if isinstance(reply, list) and len(reply) == 2 and reply[1] == b"noeviction":
            log.warning(
                "kvflow redis: %s has maxmemory-policy noeviction: saves fail once it is "
                "full; set allkeys-lru (see the kvflow-redis README)",
                self.addr.redacted(),
            )

    async def register(self, layout: KVLayout) -> None:
        """Also bounds the replies this transport reads: no bulk longer than a value it
        writes (a hostile or broken server's `$<huge>` fails at once, unbuffered)."""
        await super().register(layout)
        self._max_bulk = max(MAX_BULK, _largest_value(self.context, layout))
        if self._pool is not None:
            self._pool.max_bulk = self._max_bulk

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()

    @property
    def pool(self) -> Pool:
        if self._pool is None:
            raise TransportError("the redis transport is not open")
        return self._pool

    @contextlib.contextmanager
    def _errors(self, what: str, chunk: int = 0, key: ChunkKey = "") -> Iterator[None]:
        """Network and server failures as `TransportError`s naming the server."""
        try:
            yield
        except BaseException as raised:
            exc = network_error(raised)
            if exc is None:
                raise
            where = self.addr.redacted() if self.addr else self.options.url
            raise TransportError(
                f"redis {what} at {where}: {_describe(exc, self.options.timeout_s)}",
                chunk=chunk,
                key=key,
            ) from raised

    # -- keys --------------------------------------------------------------
    def key(self, key: ChunkKey, shard: str | None = None) -> bytes:
        ctx = self.context
        return f"{self.options.key_prefix}{ctx.namespace}:{key}:{shard or ctx.shard}".encode()

    # -- lookup ------------------------------------------------------------
    async def lookup(self, keys: Sequence[ChunkKey], shards: Sequence[str] = ()) -> int:
        """One round trip: `EXISTS` of each of `shards`' values (default: this engine's),
        per key, pipelined.

        EXISTS does not touch a value's LRU clock: only loads keep a chunk warm."""
        if not keys:
            return 0
        shards = shards or self.context.shards
        cmds = [("EXISTS", *(self.key(k, s) for s in shards)) for k in keys]
        with self._errors("lookup"):
            replies = await self.pool.pipeline(cmds)
        for i, reply in enumerate(replies):
            if isinstance(reply, RedisError):
                raise TransportError(f"redis lookup: {reply}", chunk=i, key=keys[i])
            if reply != len(shards):
                return i
        return len(keys)

    # -- save --------------------------------------------------------------
    async def save(self, job: SaveJob) -> None:
        """Each chunk not stored yet becomes one `SET`, sent once every layer is final,
        straight from the KV spans (no copy on this side). Redis applies a SET only once
        its whole value arrived: a chunk is never visible half-written, and a save cut
        short (cancelled, connection lost) leaves no trace of the chunk in flight."""
        layout = self.context.layout
        assert layout is not None, "redis save needs registered KV caches"
        keys = [self.key(k) for k in job.keys]
        ttl_ms = round(self.options.ttl_s * 1000)
        with self._errors("save"):
            present = await self.pool.pipeline([("EXISTS", k) for k in keys])
        todo = [c for c, p in enumerate(present) if p != 1]  # an error reply: write it again
        if not todo:
            if ttl_ms:  # a key names the same bytes forever: just keep them longer
                with self._errors("save"):
                    await self.pool.pipeline([("PEXPIRE", k, ttl_ms) for k in keys])
            return
        spans: list[list[list[memoryview]]] = []  # [layer][todo index] -> spans
        hashes: list[list[int]] = []  # [layer][todo index]
        for layer in range(job.num_layers):
            layer_spans = await job.layer(layer)
            chosen = [layer_spans[c] for c in todo]
            spans.append(chosen)
            hashes.append(await trio.to_thread.run_sync(_hashes, chosen))
        cmds: list[tuple[Any, ...]] = []
        for j, c in enumerate(todo):
            header = ChunkHeader(
                key=job.keys[c],
                namespace=self.context.namespace,
                shard=self.context.shard,
                num_tokens=job.token_counts[c],
                layer_nbytes=[sum(len(s) for s in spans[i][j]) for i in range(job.num_layers)],
                layer_hash=[hashes[i][j] for i in range(job.num_layers)],
                layout=layout.describe(),
            )
            value: list[Buffer] = [s for i in range(job.num_layers) for s in spans[i][j]]
            value.append(encode_trailer(header))
            cmds.append(
                ("SET", keys[c], value, "PX", ttl_ms) if ttl_ms else ("SET", keys[c], value)
            )
        if ttl_ms:
            cmds += [("PEXPIRE", keys[c], ttl_ms) for c in range(len(keys)) if c not in todo]
        with self._errors("save"):
            replies = await self.pool.pipeline(cmds)
        for j, c in enumerate(todo):
            if isinstance(replies[j], RedisError):
                raise TransportError(
                    f"redis save of chunk {c} ({job.keys[c]}): {replies[j]}",
                    chunk=c,
                    key=job.keys[c],
                )

    # -- load --------------------------------------------------------------
    async def load(self, job: LoadJob) -> None:
        """Two round trips on one connection: first every chunk's length and trailer
        (checked against this layout), then, pipelined in layer order, one `GETRANGE` per
        layer and chunk, read straight into the KV spans. A layer's hashes are checked in a
        thread while the next layer streams in, and `layer_loaded(i)` follows its check."""
        layout = job.layout or self.context.layout  # another shape's chunk: as it lies
        assert layout is not None, "redis load needs registered KV caches"
        n, num_layers = len(job.keys), job.num_layers
        keys = [self.key(k, job.shard) for k in job.keys]
        sizes = [[layout.chunk_nbytes(i, t) for i in range(num_layers)] for t in job.token_counts]
        found: list[ChunkFailure | None] = []
        bad: list[bytes] = []  # values that failed validation, deleted afterwards
        with self._errors("load"):
            async with self.pool.connection() as conn:
                headers = await self._headers(conn, job, keys, sizes, found, bad)
                intact = _intact(found, n)
                layers: list[list[Buffer]] = [[] for _ in range(num_layers)]
                offsets = [0] * intact
                for i in range(num_layers):
                    for c in range(intact):
                        end = offsets[c] + sizes[c][i]
                        encode("GETRANGE", keys[c], offsets[c], end - 1, out=layers[i])
                        offsets[c] = end
                # Redis runs a pipeline's commands as fast as they arrive and buffers their
                # replies: asking for every layer at once would hold the whole request in
                # its output buffer (server memory) and deliver layer 0 only after it has
                # copied all of it. A window of layers in flight keeps the stream moving.
                layer_nbytes = max(
                    (sum(s[i] for s in sizes[:intact]) for i in range(num_layers)), default=0
                )
                window = trio.Semaphore(max(1, LOAD_WINDOW_BYTES // max(1, layer_nbytes)))
                async with trio.open_nursery() as nursery:
                    if intact:
                        nursery.start_soon(self._send_layers, conn, layers, window)
                    prev = trio.Event()
                    prev.set()
                    for i in range(num_layers):
                        layer_spans = job.spans(i)[:intact] if intact else []
                        await self._read_layer(conn, i, layer_spans, sizes, found)
                        if intact:
                            window.release()
                        done = trio.Event()
                        nursery.start_soon(
                            self._check_then_signal, job, i, layer_spans, headers, keys,
                            found, bad, prev, done,
                        )  # fmt: skip
                        prev = done
        failure = first_failure(found)
        if bad:
            with trio.move_on_after(self.options.timeout_s), contextlib.suppress(Exception):
                # a corrupt value would fail every later load of its key: drop it so the
                # next save of the key writes it again
                await self.pool.pipeline([("DEL", k) for k in bad])
                log.warning("kvflow redis: deleted %d corrupt chunk value(s)", len(bad))
        if failure is not None:
            raise failure.error(job.keys[failure.chunk])

    @staticmethod
    async def _send_layers(
        conn: Connection, layers: list[list[Buffer]], window: trio.Semaphore
    ) -> None:
        for bufs in layers:
            await window.acquire()
            await conn.send(bufs)

    async def _headers(
        self,
        conn: Connection,
        job: LoadJob,
        keys: list[bytes],
        sizes: list[list[int]],
        found: list[ChunkFailure | None],
        bad: list[bytes],
    ) -> list[ChunkHeader]:
        """Every chunk's trailer, checked, up to the first bad chunk (recorded in `found`)."""
        cmds: list[tuple[Any, ...]] = []
        for k, s in zip(keys, sizes, strict=True):
            cmds += [("STRLEN", k), ("GETRANGE", k, sum(s), -1)]
        replies = await conn.pipeline(cmds)
        headers: list[ChunkHeader] = []
        for c, key in enumerate(job.keys):
            strlen, raw = replies[2 * c], replies[2 * c + 1]
            if strlen == 0:
                found.append(ChunkFailure(c, ChunkMissing, "not stored (never saved, or evicted)"))
                break
            problem = ""
            if isinstance(strlen, RedisError) or isinstance(raw, RedisError):
                problem = f"not a chunk value ({strlen if isinstance(strlen, RedisError) else raw})"
            else:
                try:
                    h = decode_trailer(raw)
                    problem = h.problem(self.context, key, job.token_counts[c], job)
                    if not problem and strlen != sum(sizes[c]) + len(raw):
                        problem = f"value of {strlen} bytes, expected {sum(sizes[c]) + len(raw)}"
                except BadHeader as exc:
                    problem = str(exc)
            if problem:
                if not job.shard:  # another shape's chunk is not ours to drop
                    bad.append(keys[c])
                found.append(ChunkFailure(c, ChunkCorrupt, problem))
                break
            headers.append(h)
        return headers

    async def _read_layer(
        self,
        conn: Connection,
        layer: int,
        layer_spans: list[list[memoryview]],
        sizes: list[list[int]],
        found: list[ChunkFailure | None],
    ) -> None:
        """Read the replies of one layer (one per intact chunk) into its spans."""
        for c, spans in enumerate(layer_spans):
            n = await conn.bulk_header()
            want = sizes[c][layer]
            if n == want:
                await conn.read_into(spans)
            else:  # the value went away (evicted, deleted) between the two round trips
                if isinstance(n, int) and n > 0:
                    await conn.skip(n)
                found.append(
                    ChunkFailure(
                        c,
                        ChunkMissing if n in (0, -1) else ChunkCorrupt,
                        f"value changed during the load (layer {layer}: got "
                        f"{n}, expected {want} bytes)",
                    )
                )
            if isinstance(n, int) and n >= 0:
                await conn.bulk_end()

    async def _check_then_signal(
        self,
        job: LoadJob,
        layer: int,
        layer_spans: list[list[memoryview]],
        headers: list[ChunkHeader],
        keys: list[bytes],
        found: list[ChunkFailure | None],
        bad: list[bytes],
        after: trio.Event,
        done: trio.Event,
    ) -> None:
        """Verify `layer`'s hashes, then signal it once every earlier layer was signalled."""
        if self.options.verify and layer_spans:
            hashes = await trio.to_thread.run_sync(_hashes, layer_spans)
            for c, h in enumerate(hashes):
                if h != headers[c].layer_hash[layer]:
                    found.append(
                        ChunkFailure(c, ChunkCorrupt, f"checksum mismatch in layer {layer}")
                    )
                    bad.append(keys[c])
                    break
        await after.wait()
        job.layer_loaded(layer)
        done.set()


def _largest_value(context: TransportContext, layout: KVLayout) -> int:
    """Bytes of the largest value this transport writes for `layout`: a full block of
    every layer, then a trailer with each of its numbers at its widest."""
    full = [g.chunk_nbytes(g.block_size) for g in layout.geometries]  # block-granular: whole
    widest = 2**64 - 1
    trailer = ChunkHeader(
        key="f" * 64,  # chunk keys have 32 characters
        namespace=context.namespace,
        shard=context.shard,
        num_tokens=widest,
        layer_nbytes=[widest] * len(full),
        layer_hash=[widest] * len(full),
        layout=layout.describe(),
    )
    return sum(full) + len(encode_trailer(trailer))


def _intact(found: list[ChunkFailure | None], n: int) -> int:
    return min((f.chunk for f in found if f is not None), default=n)


def _hashes(spans: list[list[memoryview]]) -> list[int]:
    return [layer_hash(s) for s in spans]


def _describe(exc: BaseException, timeout_s: float | None = None) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "no answer within timeout_s" + (f"={timeout_s}" if timeout_s else "")
    if isinstance(exc, RedisError):
        return f"server error: {exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
