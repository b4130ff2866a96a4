"""The kvflow transport conformance suite against a real redis-server, and the few things
the suite does not cover: option errors at open(), corrupt values, TTLs."""

from __future__ import annotations

import contextlib
import itertools
import os
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import trio
from kvflow_fs import FsOptions, FsTransport

from kvflow import (
    ChunkCorrupt,
    LoadJob,
    SaveJob,
    Transport,
    TransportContext,
    TransportError,
    stacked,
    with_host_tier,
)
from kvflow.testing import TransportConformance, make_layout
from kvflow_redis import RedisOptions, RedisTransport
from kvflow_redis._client import parse_url
from kvflow_redis._guard import MAX_BULK, MAX_ELEMENTS, READ_SIZE, Framer, ProtocolError

pytestmark = pytest.mark.trio

_prefixes = itertools.count()


def _prefix() -> str:
    """A key prefix of its own per test: tests never see each other's chunks."""
    return f"kvflow-test-{os.getpid()}-{next(_prefixes)}:"


class TestRedisConformance(TransportConformance):
    @pytest.fixture
    def make_transport(self, redis_url: str) -> Callable[[TransportContext], RedisTransport]:
        options = RedisOptions(url=redis_url, key_prefix=_prefix())

        def make(context: TransportContext) -> RedisTransport:
            return RedisTransport(options, context)

        return make


class TestFsOverRedisConformance(TransportConformance):
    """The same promises with `fs` stacked over redis (the `tiers` option: a local disk in
    front of the shared cache)."""

    @pytest.fixture
    def make_transport(
        self, redis_url: str, tmp_path: Path
    ) -> Callable[[TransportContext], Transport]:
        options = RedisOptions(url=redis_url, key_prefix=_prefix())

        def make(context: TransportContext) -> Transport:
            near = FsTransport(FsOptions(path=str(tmp_path / "near")), context)
            return stacked([near, RedisTransport(options, context)])

        return make


class TestRedisUnderHostTierConformance(TransportConformance):
    """The same promises with kvflow's host-memory tier in front (`cpu_cache_gib`)."""

    @pytest.fixture
    def make_transport(self, redis_url: str) -> Callable[[TransportContext], Transport]:
        options = RedisOptions(url=redis_url, key_prefix=_prefix())

        def make(context: TransportContext) -> Transport:
            redis = RedisTransport(options, context)
            return with_host_tier(redis, 4 << 20, "s3fifo") if context.role == "worker" else redis

        return make


def _context(role: str = "worker") -> TransportContext:
    return TransportContext("e", role, "ns", "tp0of1pp0", ["tp0of1pp0"])


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (RedisOptions(url="http://127.0.0.1:6379"), "['url']"),
        (RedisOptions(url="redis://"), "['url']"),
        (RedisOptions(url="redis://127.0.0.1:6379/zero"), "['url']"),
        (RedisOptions(url="redis://h1:7000,h2:7000"), "['url']"),  # several: mode cluster
        (RedisOptions(key_prefix="a{b}:"), "['key_prefix']"),
        (RedisOptions(url="redis://127.0.0.1:1/0", timeout_s=2), "['url']"),
        (RedisOptions(max_connections=0), "['max_connections']"),
        (RedisOptions(timeout_s=0), "['timeout_s']"),
        (RedisOptions(ttl_s=-1), "['ttl_s']"),
    ],
)
async def test_bad_options_fail_at_open_naming_the_option(
    options: RedisOptions, names: str
) -> None:
    t = RedisTransport(options, _context())
    with pytest.raises(TransportError) as err:
        await t.open()
    assert f"kv_connector_extra_config['options']{names}" in str(err.value)


async def test_url_forms() -> None:
    a = parse_url("rediss://u:p%40ss@cache.internal:6380/3")
    assert (a.tls, a.hosts, a.db, a.username, a.password) == (
        True,
        (("cache.internal", 6380),),
        3,
        "u",
        "p@ss",
    )
    assert "p@ss" not in a.redacted()
    u = parse_url("unix:///run/redis/redis.sock?db=2")
    assert (u.path, u.db) == ("/run/redis/redis.sock", 2)
    c = parse_url("redis://10.0.0.1:7000,[::1]:7001,cache")
    assert c.hosts == (("10.0.0.1", 7000), ("::1", 7001), ("cache", 6379))


@contextlib.asynccontextmanager
async def _opened(url: str) -> AsyncIterator[RedisTransport]:
    t = RedisTransport(RedisOptions(url=url), _context())
    await t.open()
    try:
        yield t
    finally:
        await t.aclose()


async def _saved(redis_url: str, ttl_s: float = 0.0) -> tuple[RedisTransport, LoadJob]:
    """A transport that saved three chunks (the last one partial), and a load of them."""

    layout = make_layout(num_layers=3, num_blocks=8, block_size=4, block_granular=False)
    t = RedisTransport(RedisOptions(url=redis_url, key_prefix=_prefix(), ttl_s=ttl_s), _context())
    await t.open()
    await t.register(layout)
    keys, counts, blocks = ["k0", "k1", "k2"], [4, 4, 2], [0, 1, 2]

    async def layer_spans(i: int) -> list[list[memoryview]]:
        return layout.chunk_spans(i, blocks, counts)

    await t.save(SaveJob("r", keys, counts, 3, layer_spans))
    load = LoadJob(
        "r", keys, counts, 3, lambda i: layout.chunk_spans(i, [3, 4, 5], counts), lambda i: None
    )
    return t, load


async def test_corrupt_value_fails_its_chunk_and_is_deleted(redis_url: str) -> None:
    t, load = await _saved(redis_url)
    try:
        key = t.key("k1")
        # flip one byte in the payload of chunk 1
        value = await t.client.get(key)
        assert isinstance(value, bytes)
        await t.client.setrange(key, 5, bytes([value[5] ^ 0xFF]))
        with pytest.raises(ChunkCorrupt, match="checksum mismatch") as err:
            await t.load(load)
        assert err.value.chunk == 1
        assert await t.lookup(["k0", "k1", "k2"]) == 1, "the corrupt value was deleted"
        # truncated value
        key2 = t.key("k2")
        v2 = await t.client.get(key2)
        assert isinstance(v2, bytes)
        await t.client.set(key2, v2[:-30])
        load.keys = ["k0", "k2"]
        load.token_counts = [4, 2]
        with pytest.raises(ChunkCorrupt) as err:
            await t.load(load)
        assert err.value.chunk == 1
    finally:
        await t.aclose()


async def test_touch_marks_this_shards_values_used(redis_url: str) -> None:
    """Issue 50, item 0: chunks a host tier served are TOUCHed (the LRU clock that
    `allkeys-lru` evicts by; EXISTS, the lookup, does not move it), one per chunk."""
    t, _ = await _saved(redis_url)
    try:
        before = await _touches(t)
        await t.touch(["k0", "k2"])
        assert await _touches(t) == before + 2
    finally:
        await t.aclose()


async def _touches(t: RedisTransport) -> int:
    stats = await t.client.info("commandstats")
    touch = stats.get("cmdstat_touch", {})
    return int(touch.get("calls", 0)) if isinstance(touch, dict) else 0


async def test_ttl_sets_an_expiry(redis_url: str) -> None:
    t, _ = await _saved(redis_url, ttl_s=100)
    try:
        ms = await t.client.pttl(t.key("k0"))
        assert isinstance(ms, int) and 90_000 < ms <= 100_000
    finally:
        await t.aclose()


async def test_unreachable_server_mid_run_is_a_transport_error(redis_url: str) -> None:
    t, load = await _saved(redis_url)
    try:
        # the server moves away: the client is started again, toward the new address
        t.target = parse_url("redis://127.0.0.1:1/0")
        assert t._holder is not None
        await t._holder.stop()
        with pytest.raises(TransportError, match=r"redis lookup at redis://127\.0\.0\.1:1/0"):
            await t.lookup(["k0"])
        with pytest.raises(TransportError, match="redis load"):
            await t.load(load)
    finally:
        await t.aclose()


async def test_server_side_timeout_is_bounded(redis_url: str) -> None:
    """A server that accepts but never answers fails the call after timeout_s."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    t = RedisTransport(RedisOptions(url=f"redis://127.0.0.1:{port}/0", timeout_s=0.3), _context())
    with trio.fail_after(5), pytest.raises(TransportError, match=r"timeout_s=0\.3"):
        await t.open()
    listener.close()


# -- a hostile server ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def hostile_server(answer: bytes) -> AsyncIterator[str]:
    """A server on a real socket that answers the client's first command (the handshake's
    HELLO) with `answer` and holds the connection open; its URL."""

    async def serve(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.receive_some()  # the first command
            view = memoryview(answer)
            for i in range(0, len(view), 1 << 16):  # until the client hangs up
                await stream.send_all(view[i : i + (1 << 16)])
            while await stream.receive_some():
                pass

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, serve, 0)
        port = listeners[0].socket.getsockname()[1]
        yield f"redis://127.0.0.1:{port}/0"
        nursery.cancel_scope.cancel()


HOSTILE = {
    "huge bulk": (b"$1073741824\r\n", r"a bulk reply of 1073741824 bytes \(at most 65536"),
    "huge array": (
        b"*100000000\r\n:1\r\n",
        rf"an array reply of 100000000 \(at most {MAX_ELEMENTS}",
    ),
    "deep nesting": (b"*1\r\n" * 100_000, r"arrays nested deeper than 8"),
    "endless line": (b"+" + b"x" * (8 << 20), r"a reply line longer than 65536 bytes"),
    "no number": (b"$1x\r\n", r"not a number in the reply line b'\$1x'"),
    "bare LF": (b"+OK\n" + b"$3\r\nabc\r\n" * 1000, r"a reply line not ended by CRLF"),
    "not an integer": (b":abc\r\n", r"not a number in the reply line b':abc'"),
    "bulk without CRLF": (b"$3\r\nabcXY", r"a bulk reply not followed by CRLF"),
    "not UTF-8": (b"-\xff\xfe\r\n", r"a malformed reply line"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_a_hostile_reply_fails_fast_with_bounded_memory(case: str) -> None:
    """A server that declares a 1 GiB bulk or 10^8 elements, nests arrays 100 000 deep,
    or sends 8 MiB without a line end: the client refuses at once, naming the bound,
    holding about one socket read (`READ_SIZE`, 4 MiB), before coredis parses any of it
    (unguarded, it buffers what the server sends until `timeout_s`)."""
    answer, message = HOSTILE[case]
    async with hostile_server(answer) as url:
        t = RedisTransport(RedisOptions(url=url, timeout_s=30), _context())
        tracemalloc.start()
        try:
            with pytest.raises(TransportError, match=message):
                await t.open()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 2 * READ_SIZE, f"{peak} bytes held for one hostile reply"


@pytest.mark.parametrize("block_granular", [False, True])
async def test_the_bulk_bound_covers_the_largest_value_written(
    redis_url: str, block_granular: bool
) -> None:
    """`register` bounds bulk replies by the largest value the transport writes (a full
    chunk and its trailer): such a value reads whole; a server's bulk one byte longer
    fails before anything is buffered."""
    layout = make_layout(
        num_layers=4,
        num_blocks=2,
        block_size=64,
        heads=8,
        head_dim=64,
        block_granular=block_granular,
    )
    t = RedisTransport(RedisOptions(url=redis_url, key_prefix=_prefix()), _context())
    await t.open()
    try:
        await t.register(layout)
        limit = t.limits.max_bulk
        assert limit > MAX_BULK  # 1 MiB chunks: the bound grew with the layout

        async def layer_spans(i: int) -> list[list[memoryview]]:
            return layout.chunk_spans(i, [0], [64])

        key = "ab" * 16
        await t.save(SaveJob("r", [key], [64], 4, layer_spans))
        strlen = await t.client.strlen(t.key(key))
        assert strlen <= limit < strlen + 1024
        value = await t.client.get(t.key(key))  # read through the guard
        assert isinstance(value, bytes) and len(value) == strlen
    finally:
        await t.aclose()
    with pytest.raises(ProtocolError, match=f"a bulk reply of {limit + 1} "):
        Framer(t.limits).feed(b"$%d\r\n" % (limit + 1))
