"""The `redis` transport: one Redis string value per chunk and shard, shared by every engine
that reaches the server."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import coredis
import coredis.exceptions
import msgspec
import trio
from coredis.exceptions import WrongTypeError

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
    one_error,
)

from . import _doctor
from ._client import NETWORK_ERRORS, TLS, BadURL, Holder, Mode, Target, build, masked, parse_url
from ._format import decode_trailer, encode_trailer
from ._guard import MAX_BULK, Limits

log = logging.getLogger("kvflow.redis")
T = TypeVar("T")

_WHERE = "kv_connector_extra_config['options']"
LOAD_WINDOW_BYTES = 16 << 20
"""A load has at most this many bytes of layers requested and not yet read (at least one
layer); a save sends its values in pipelines of about this many bytes."""
MAX_LAYERS_IN_FLIGHT = 4


class RedisOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options of the `redis` transport (`kv_connector_extra_config["options"]`)."""

    url: str = "redis://127.0.0.1:6379/0"
    """`redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS) or
    `unix://[[user]:password@]/path/to/redis.sock[?db=N]`; for `mode` `cluster` or
    `sentinel`, the nodes or sentinels to start from, comma-separated:
    `redis://h1:7000,h2:7000`. Every engine (scheduler and workers, on every machine)
    that should share the cache names the same deployment and db."""
    mode: Mode = "standalone"
    """`standalone` (one server), `cluster` (a Redis Cluster: keys spread over its
    shards by hash slot, pipelines split per shard) or `sentinel` (the primary that the
    sentinels in `url` name for `sentinel_master`, followed across failovers)."""
    sentinel_master: str = "mymaster"
    """`mode: sentinel`: the name of the monitored primary."""
    password_env: str = ""
    """The name of an environment variable holding the password (the ACL user's, with
    the user in `url`), so that no secret sits in the configuration; it overrides a
    password in `url`."""
    tls_ca_file: str = ""
    """`rediss://`: the CA certificates that sign the server's (default: the system's)."""
    tls_cert_file: str = ""
    """`rediss://`: a client certificate (PEM), for servers that require one."""
    tls_key_file: str = ""
    """`rediss://`: the client certificate's key, if not in `tls_cert_file`."""
    tls_check_hostname: bool = True
    """`rediss://`: check that the server's certificate names the host in `url`."""
    key_prefix: str = "kvflow:"
    """Prepended to every key (`<prefix>{<namespace>:<chunk key>}:<shard>`), to share a
    server with other data or keep deployments apart. No braces: the part in braces is
    the hash tag that keeps a chunk's shards in one cluster slot."""
    ttl_s: float = 0.0
    """Expire a chunk this many seconds after its last save (`SET ... PX`). 0: never; the
    server's `maxmemory-policy allkeys-lru` evicts instead (see the README)."""
    verify: bool = True
    """Check each layer's XXH3-64 on load before vLLM may use it (a mismatch is a load
    error that vLLM recomputes, never wrong tokens). The hash is always written. Under a
    store key (`store_key_file`) each layer's keyed hash is checked whatever this says."""
    max_connections: int = 16
    """Connections per transport instance and server (each engine process has one
    instance per worker and one in its scheduler)."""
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
        self.target: Target | None = None
        self.limits = Limits()
        self._holder: Holder | None = None
        self._restart = trio.Lock()
        self._layout_stale = False
        self._closed = False

    # -- lifecycle ---------------------------------------------------------
    async def open(self) -> None:
        o = self.options
        if not (o.max_connections >= 1):
            raise TransportError(f"{_WHERE}['max_connections'] must be >= 1")
        if not (o.timeout_s > 0 and math.isfinite(o.timeout_s)):
            raise TransportError(f"{_WHERE}['timeout_s'] must be a positive number of seconds")
        if not (o.ttl_s >= 0 and math.isfinite(o.ttl_s)):
            raise TransportError(f"{_WHERE}['ttl_s'] must be >= 0 (0: no expiry)")
        if "{" in o.key_prefix or "}" in o.key_prefix:
            raise TransportError(
                f"{_WHERE}['key_prefix'] must not contain braces ({o.key_prefix!r}): the "
                "transport puts each chunk's hash tag in braces"
            )
        if o.password_env and o.password_env not in os.environ:
            raise TransportError(
                f"{_WHERE}['password_env']: the environment variable {o.password_env!r} is not set"
            )
        try:
            self.target = parse_url(o.url)
        except BadURL as exc:
            raise TransportError(f"{_WHERE}['url']: {exc}") from None
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            path = getattr(o, name)
            if path and not os.path.isfile(path):
                raise TransportError(f"{_WHERE}['{name}']: no such file {path!r}")
        with self._errors("connect", where="url"):
            await self._start()
            try:
                policy = await self._maxmemory_policy()
            except BaseException:
                await self.aclose()
                raise
        if policy == b"noeviction":
            log.warning(
                "kvflow redis: %s has maxmemory-policy noeviction: saves fail once it is "
                "full; set allkeys-lru (see the kvflow-redis README)",
                self.where,
            )

    async def _start(self) -> None:
        """Build the client and hold it open (again, after its tasks failed)."""
        o, target = self.options, self.target
        assert target is not None
        tls = TLS(o.tls_ca_file, o.tls_cert_file, o.tls_key_file, o.tls_check_hostname)
        try:
            client, enter = build(
                target,
                o.mode,
                master=o.sentinel_master,
                password=os.environ.get(o.password_env) if o.password_env else None,
                tls=tls,
                limits=self.limits,
                max_connections=o.max_connections,
                timeout_s=o.timeout_s,
                name=f"kvflow-{self.context.role}-{self.context.shard}",
            )
        except (BadURL, OSError, ValueError) as exc:
            raise TransportError(f"{_WHERE}['url']: {exc}") from None
        holder = Holder(client, enter)
        try:
            await self._within(holder.start)
        except BaseException:
            with trio.CancelScope(shield=True):
                await holder.stop()
            raise
        self._holder = holder

    async def _maxmemory_policy(self) -> bytes | None:
        """The server's eviction policy; None where CONFIG is not allowed (ACL users,
        managed services that rename it) or not routed (a cluster)."""
        await self._within(self.client.ping)
        if self.options.mode == "cluster":
            return None
        try:
            config = await self._within(lambda: self.client.config_get([b"maxmemory-policy"]))
        except coredis.exceptions.ResponseError:
            return None
        for value in _leaves(config):
            return value
        return None

    async def register(self, layout: KVLayout) -> None:
        """Also bounds the replies this transport reads: no bulk longer than a value it
        writes (a hostile or broken server's `$<huge>` fails at once, unbuffered)."""
        await super().register(layout)
        self.limits.max_bulk = max(MAX_BULK, _largest_value(self.context, layout))

    async def aclose(self) -> None:
        self._closed = True
        if self._holder is not None:
            await self._holder.stop()

    @classmethod
    def doctor(cls, options: RedisOptions, findings: Any) -> None:
        """`kvflow doctor`: the server reachable, taking the credentials, answering PING."""
        _doctor.check(options, findings)

    @property
    def client(self) -> coredis.Redis[bytes] | coredis.RedisCluster[bytes]:
        if self._holder is None:
            raise TransportError("the redis transport is not open")
        return self._holder.client

    @property
    def where(self) -> str:
        return self.target.redacted() if self.target else masked(self.options.url)

    async def _ready(self) -> None:
        """Start the client again if its tasks ended (a failure inside coredis); in a
        cluster, read its layout again after a request failed on the network (coredis
        does so only after several errors, and a failover would fail requests to the
        dead master until then)."""
        if self._holder is not None and self._holder.alive and not self._layout_stale:
            return
        if self._closed:
            raise TransportError("the redis transport is closed")
        async with self._restart:
            if self._holder is None or not self._holder.alive:
                log.warning("kvflow redis: the client to %s stopped; starting it again", self.where)
                await self._start()
            client = self.client
            if self._layout_stale and isinstance(client, coredis.RedisCluster):
                self._layout_stale = False
                await self._within(client.connection_pool.cluster_layout.initialize)

    def _pipeline(self) -> Any:
        return self.client.pipeline(transaction=False, raise_on_error=False)

    @contextlib.contextmanager
    def _errors(self, what: str, where: str = "") -> Iterator[None]:
        """Network and server failures as `TransportError`s naming the server."""
        try:
            yield
        except BaseException as raised:
            exc = network_error(raised)
            if exc is None:
                raise
            detail, at = _describe(exc, self.options.timeout_s), self.where
            text = (
                f"{_WHERE}['{where}']: cannot use the redis server at {at} ({detail})"
                if where
                else f"redis {what} at {at}: {detail}"
            )
            raise TransportError(text) from raised

    async def _run(self, what: str, queue: Any) -> list[Any]:
        """One pipeline (`queue(pipe)` queues its commands), its replies: values or the
        error each command got."""

        async def run() -> list[Any]:
            async with self._pipeline() as pipe:
                queue(pipe)
            replies = list(pipe.results or ())
            for reply in replies:  # a node lost, CLUSTERDOWN, OOM, a replica's READONLY:
                if isinstance(reply, Exception) and not isinstance(reply, WrongTypeError):
                    raise reply  # the request failed, not the key (only WRONGTYPE is the key's)
            return replies

        with self._errors(what):
            await self._ready()
            try:
                return await self._within(run)
            except NETWORK_ERRORS:
                if self.options.mode != "cluster":
                    raise
            # a node gone (a master failed over?): once more, on the cluster's layout as
            # it is now (every command here may run twice: a SET names the same bytes)
            self._layout_stale = True
            await self._ready()
            return await self._within(run)

    async def _within(self, fn: Callable[[], Awaitable[T]]) -> T:
        """`fn()` within `timeout_s`. coredis reports a connection attempt that was
        cancelled as a `ConnectionError`: the cancellation is what the caller gets (a
        `trio.TooSlowError` past `timeout_s`)."""
        failure = None
        with trio.CancelScope(deadline=trio.current_time() + self.options.timeout_s) as scope:
            try:
                return await fn()
            except BaseException as exc:
                if network_error(exc) is None:
                    raise
                if not scope.cancel_called:
                    if trio.current_effective_deadline() == -math.inf:
                        await trio.lowlevel.checkpoint()  # an outer cancellation: raise it
                    raise
                failure = exc
        await trio.lowlevel.checkpoint()  # the caller's own cancellation, if any, first
        raise trio.TooSlowError from failure

    # -- keys --------------------------------------------------------------
    def key(self, key: ChunkKey, shard: str | None = None) -> bytes:
        """`<prefix>{<namespace>:<key>}:<shard>`: every shard of a chunk in one slot."""
        ctx = self.context
        return f"{self.options.key_prefix}{{{ctx.namespace}:{key}}}:{shard or ctx.shard}".encode()

    # -- lookup ------------------------------------------------------------
    async def lookup(self, keys: Sequence[ChunkKey], shards: Sequence[str] = ()) -> int:
        """One round trip: `EXISTS` of each of `shards`' values (default: this engine's),
        per key, pipelined (one command per key: its shards share a hash slot).

        EXISTS does not touch a value's LRU clock: only loads keep a chunk warm."""
        if not keys:
            return 0
        shards = shards or self.context.shards
        names = [[self.key(k, s) for s in shards] for k in keys]
        replies = await self._run("lookup", lambda pipe: [pipe.exists(n) for n in names])
        for i, reply in enumerate(replies):  # (an error reply fails `_run`)
            if reply != len(shards):
                return i
        return len(keys)

    async def touch(self, keys: Sequence[ChunkKey]) -> None:
        """`TOUCH` this shard's value of each of `keys` (one round trip, pipelined): a
        host tier served them, and `allkeys-lru` must not evict them as cold."""
        if keys:
            names = [self.key(k) for k in keys]
            await self._run("touch", lambda pipe: [pipe.touch([n]) for n in names])

    # -- save --------------------------------------------------------------
    async def save(self, job: SaveJob) -> None:
        """Each chunk not stored yet becomes one `SET`, sent once every layer is final,
        in pipelines of about `LOAD_WINDOW_BYTES`. Redis applies a SET only once its whole
        value arrived: a chunk is never visible half-written, and a save cut short
        (cancelled, connection lost) leaves no trace of the chunk in flight."""
        layout = self.context.layout
        assert layout is not None, "redis save needs registered KV caches"
        keys = [self.key(k) for k in job.keys]
        ttl_ms = round(self.options.ttl_s * 1000)
        present = await self._run("save", lambda pipe: [pipe.exists([k]) for k in keys])
        todo = [c for c, p in enumerate(present) if p != 1]
        if ttl_ms and len(todo) < len(keys):  # a key names the same bytes forever: keep longer
            kept = [keys[c] for c in range(len(keys)) if c not in todo]
            await self._run("save", lambda pipe: [pipe.pexpire(k, ttl_ms) for k in kept])
        if not todo:
            return
        spans: list[list[list[memoryview]]] = []  # [layer][todo index] -> spans
        hashes: list[list[int]] = []  # [layer][todo index]
        for layer in range(job.num_layers):
            layer_spans = await job.layer(layer)
            chosen = [layer_spans[c] for c in todo]
            spans.append(chosen)
            keys_todo = [job.keys[c] for c in todo]
            hashes.append(
                await trio.to_thread.run_sync(_hashes, chosen, self.context, keys_todo, layer)
            )
        batch: list[tuple[bytes, bytes]] = []  # (key, value) of the SETs sent next
        first = size = 0  # the batch's first chunk (numbered as in the job), its bytes
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
            parts = [s for i in range(job.num_layers) for s in spans[i][j]]
            first = first if batch else c
            batch.append((keys[c], b"".join([*parts, encode_trailer(header)])))
            size += len(batch[-1][1])
            if size >= LOAD_WINDOW_BYTES or j == len(todo) - 1:
                await self._set(job, batch, first, ttl_ms)
                batch, size = [], 0

    async def _set(
        self, job: SaveJob, values: list[tuple[bytes, bytes]], first: int, ttl_ms: int
    ) -> None:
        """One pipeline of SETs; its failure names `first`, its first chunk (the batches
        before it are stored)."""
        px = ttl_ms or None
        try:
            await self._run("save", lambda pipe: [pipe.set(k, v, px=px) for k, v in values])
        except TransportError as exc:
            exc.chunk, exc.key = first, job.keys[first]
            raise

    # -- load --------------------------------------------------------------
    async def load(self, job: LoadJob) -> None:
        """First every chunk's length and trailer in one round trip (checked against this
        layout), then each layer's bytes, one pipelined `GETRANGE` per chunk, up to
        `MAX_LAYERS_IN_FLIGHT` layers (and `LOAD_WINDOW_BYTES`) requested ahead. A layer
        is copied into its spans and its hashes checked in a thread while the next layers
        arrive, and `layer_loaded(i)` follows its check, in layer order."""
        layout = job.layout or self.context.layout  # another shape's chunk: as it lies
        assert layout is not None, "redis load needs registered KV caches"
        n, num_layers = len(job.keys), job.num_layers
        keys = [self.key(k, job.shard) for k in job.keys]
        sizes = [[layout.chunk_nbytes(i, t) for i in range(num_layers)] for t in job.token_counts]
        found: list[ChunkFailure | None] = []
        bad: list[bytes] = []  # values that failed validation, deleted afterwards
        headers = await self._headers(job, keys, sizes, found, bad)
        intact = _intact(found, n)
        starts = [[sum(s[:i]) for i in range(num_layers)] for s in sizes[:intact]]
        layer_nbytes = max(
            (sum(s[i] for s in sizes[:intact]) for i in range(num_layers)), default=0
        )
        ahead = max(1, min(MAX_LAYERS_IN_FLIGHT, LOAD_WINDOW_BYTES // max(1, layer_nbytes)))

        async def fetch(i: int) -> list[Any]:
            if not intact:
                return []
            return await self._run(
                "load",
                lambda pipe: [
                    pipe.getrange(keys[c], starts[c][i], starts[c][i] + sizes[c][i] - 1)
                    for c in range(intact)
                ],
            )

        with one_error():
            async with trio.open_nursery() as nursery:
                pending = [_Later(nursery, fetch, i) for i in range(min(ahead, num_layers))]
                prev = trio.Event()
                prev.set()
                for i in range(num_layers):
                    values = await pending[i].result()
                    if i + ahead < num_layers:
                        pending.append(_Later(nursery, fetch, i + ahead))
                    done = trio.Event()
                    layer_spans = job.spans(i)[:intact] if intact else []
                    nursery.start_soon(
                        self._fill_check_signal, job, i, values, layer_spans, sizes, headers, keys,
                        found, bad, prev, done,
                    )  # fmt: skip
                    prev = done
        failure = first_failure(found)
        if bad:
            with trio.move_on_after(self.options.timeout_s), contextlib.suppress(Exception):
                # a corrupt value would fail every later load of its key: drop it so the
                # next save of the key writes it again
                await self._run("delete", lambda pipe: [pipe.delete([k]) for k in bad])
                log.warning("kvflow redis: deleted %d corrupt chunk value(s)", len(bad))
        if failure is not None:
            raise failure.error(job.keys[failure.chunk])

    async def _headers(
        self,
        job: LoadJob,
        keys: list[bytes],
        sizes: list[list[int]],
        found: list[ChunkFailure | None],
        bad: list[bytes],
    ) -> list[ChunkHeader]:
        """Every chunk's trailer, checked, up to the first bad chunk (recorded in `found`)."""

        def queue(pipe: Any) -> None:
            for k, s in zip(keys, sizes, strict=True):
                pipe.strlen(k)
                pipe.getrange(k, sum(s), -1)

        replies = await self._run("load", queue)
        headers: list[ChunkHeader] = []
        for c, key in enumerate(job.keys):
            strlen, raw = replies[2 * c], replies[2 * c + 1]
            if strlen == 0:
                found.append(ChunkFailure(c, ChunkMissing, "not stored (never saved, or evicted)"))
                break
            problem = ""
            if isinstance(strlen, BaseException) or isinstance(raw, BaseException):
                error = strlen if isinstance(strlen, BaseException) else raw
                problem = f"not a chunk value ({error})"
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

    async def _fill_check_signal(
        self,
        job: LoadJob,
        layer: int,
        values: list[Any],
        layer_spans: list[list[memoryview]],
        sizes: list[list[int]],
        headers: list[ChunkHeader],
        keys: list[bytes],
        found: list[ChunkFailure | None],
        bad: list[bytes],
        after: trio.Event,
        done: trio.Event,
    ) -> None:
        """Copy `layer`'s values into its spans and verify its hashes (in a thread), then
        signal it once every earlier layer was signalled."""
        for c, value in enumerate(values):
            want = sizes[c][layer]
            if not isinstance(value, bytes) or len(value) != want:
                # the value went away (evicted, deleted) or changed between round trips
                got = len(value) if isinstance(value, bytes) else value
                found.append(
                    ChunkFailure(
                        c,
                        ChunkMissing if not value else ChunkCorrupt,
                        f"value changed during the load (layer {layer}: got {got}, "
                        f"expected {want} bytes)",
                    )
                )
                values, layer_spans = values[:c], layer_spans[:c]
                break
        check = self.options.verify or self.context.store_key is not None
        intact = await trio.to_thread.run_sync(
            _fill, values, layer_spans, headers, layer, self.context, check
        )
        for c, ok in enumerate(intact):
            if not ok:
                found.append(ChunkFailure(c, ChunkCorrupt, f"checksum mismatch in layer {layer}"))
                bad.append(keys[c])
                break
        await after.wait()
        job.layer_loaded(layer)
        done.set()


class _Later:
    """`fetch(i)` started now in `nursery`; its result awaited later."""

    def __init__(self, nursery: trio.Nursery, fetch: Any, i: int) -> None:
        self._done = trio.Event()
        self._value: list[Any] = []
        nursery.start_soon(self._run, fetch, i)

    async def _run(self, fetch: Any, i: int) -> None:
        self._value = await fetch(i)
        self._done.set()

    async def result(self) -> list[Any]:
        await self._done.wait()
        return self._value


def _fill(
    values: list[bytes],
    spans: list[list[memoryview]],
    headers: list[ChunkHeader],
    layer: int,
    context: TransportContext,
    check: bool,
) -> list[bool]:
    """Copy each chunk's value into its spans; if `check`, whether each is intact (its
    `layer` hashes as its header says, under the context's store key)."""
    for value, chunk_spans in zip(values, spans, strict=True):
        at = 0
        for span in chunk_spans:
            span[:] = value[at : at + len(span)]
            at += len(span)
    if not check:
        return []
    return [
        h.layer_intact(layer, s, context.store_key) for h, s in zip(headers, spans, strict=False)
    ]


def _leaves(reply: Any) -> Iterator[bytes]:
    """The values of a CONFIG GET reply: a map, or (a cluster's) a map per node."""
    if isinstance(reply, dict):
        for value in reply.values():
            yield from _leaves(value)
    elif isinstance(reply, bytes | str):
        yield reply.encode() if isinstance(reply, str) else reply


def network_error(exc: BaseException) -> BaseException | None:
    """The first network or server error `exc` stands for (also inside an exception group
    that holds nothing else), or None when it is something else (a cancellation, a bug)."""
    if isinstance(exc, NETWORK_ERRORS):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        match, rest = exc.split(NETWORK_ERRORS)
        if match is not None and rest is None:
            leaf: BaseException = match
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            return leaf
    return None


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


def _hashes(
    spans: list[list[memoryview]], context: TransportContext, keys: list[ChunkKey], layer: int
) -> list[int]:
    """Layer `layer`'s hash of each chunk `keys[i]` (`spans[i]`) this context writes."""
    sk, shard = context.store_key, context.shard
    return [layer_hash(s, sk, k, shard, layer) for s, k in zip(spans, keys, strict=True)]


def _describe(exc: BaseException, timeout_s: float | None = None) -> str:
    while isinstance(exc, coredis.exceptions.ConnectionError) and exc.__cause__ is not None:
        exc = exc.__cause__  # "Unable to establish a connection": say why
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _describe(exc.exceptions[0], timeout_s)
    if isinstance(exc, trio.TooSlowError | TimeoutError):
        return "no answer within timeout_s" + (f"={timeout_s}" if timeout_s else "")
    if isinstance(exc, coredis.exceptions.ResponseError):
        return f"server error: {exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
