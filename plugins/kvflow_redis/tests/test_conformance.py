"""The kvflow transport conformance suite against a real redis-server, and the few things
the suite does not cover: option errors at open(), corrupt values, TTLs."""

from __future__ import annotations

import contextlib
import itertools
import os
import tracemalloc
from collections.abc import AsyncIterator, Callable

import pytest
import trio

from kvflow import (
    ChunkCorrupt,
    LoadJob,
    SaveJob,
    Transport,
    TransportContext,
    TransportError,
    with_host_tier,
)
from kvflow.testing import TransportConformance, make_layout
from kvflow_redis import RedisOptions, RedisTransport
from kvflow_redis._resp import MAX_BULK, Pool, ProtocolError, encode, parse_url

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


async def test_wrong_password_fails_at_open(redis_url: str) -> None:
    url = redis_url.replace("redis://", "redis://:nope@")
    t = RedisTransport(RedisOptions(url=url), _context())
    with pytest.raises(TransportError, match=r"\['url'\].*:\*\*\*@"):
        await t.open()


async def test_url_forms() -> None:
    a = parse_url("redis://u:p%40ss@cache.internal:6380/3")
    assert (a.host, a.port, a.db, a.username, a.password) == (
        "cache.internal",
        6380,
        3,
        "u",
        "p@ss",
    )
    assert "p@ss" not in a.redacted()
    u = parse_url("unix:///run/redis/redis.sock?db=2")
    assert (u.path, u.db) == ("/run/redis/redis.sock", 2)


async def _raw(url: str, *cmds: tuple[object, ...]) -> list[object]:
    pool = Pool(parse_url(url), 1, 5.0, "test")
    try:
        return await pool.pipeline(cmds)
    finally:
        pool.close()


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
        (value,) = await _raw(redis_url, ("GET", key))
        assert isinstance(value, bytes)
        await _raw(redis_url, ("SETRANGE", key, 5, bytes([value[5] ^ 0xFF])))
        with pytest.raises(ChunkCorrupt, match="checksum mismatch") as err:
            await t.load(load)
        assert err.value.chunk == 1
        assert await t.lookup(["k0", "k1", "k2"]) == 1, "the corrupt value was deleted"
        # truncated value
        key2 = t.key("k2")
        (v2,) = await _raw(redis_url, ("GET", key2))
        assert isinstance(v2, bytes)
        await _raw(redis_url, ("SET", key2, v2[:-30]))
        load.keys = ["k0", "k2"]
        load.token_counts = [4, 2]
        with pytest.raises(ChunkCorrupt) as err:
            await t.load(load)
        assert err.value.chunk == 1
    finally:
        await t.aclose()


async def test_ttl_sets_an_expiry(redis_url: str) -> None:
    t, _ = await _saved(redis_url, ttl_s=100)
    try:
        (ms,) = await _raw(redis_url, ("PTTL", t.key("k0")))
        assert isinstance(ms, int) and 90_000 < ms <= 100_000
    finally:
        await t.aclose()


async def test_unreachable_server_mid_run_is_a_transport_error(redis_url: str) -> None:
    t, load = await _saved(redis_url)
    try:
        t.addr = parse_url("redis://127.0.0.1:1/0")
        t.pool.close()
        t._pool = Pool(t.addr, 2, 2.0, "test")
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
    """A server on a real socket that completes the handshake (CLIENT SETNAME, PING), then
    answers the next command with `answer` and holds the connection open; its URL."""

    async def serve(stream: trio.SocketStream) -> None:
        got = b""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while b"PING\r\n" not in got:
                got += await stream.receive_some()
            await stream.send_all(b"+OK\r\n+PONG\r\n")
            await stream.receive_some()  # the next command
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
    "huge bulk": (b"$1073741824\r\n", r"a bulk reply of 1073741824 \(at most 65536"),
    "huge array": (b"*100000000\r\n:1\r\n", r"an array reply of 100000000 \(at most 1024"),
    "deep nesting": (b"*1\r\n" * 100_000, r"arrays nested deeper than 4"),
    "endless line": (b"+" + b"x" * (8 << 20), r"a reply line longer than 65536 bytes"),
    "no number": (b"$1x\r\n", r"not a number in the reply line b'\$1x'"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_a_hostile_reply_fails_fast_with_bounded_memory(case: str) -> None:
    """A server that declares a 1 GiB bulk or 10^8 elements, nests arrays 100 000 deep,
    or sends 8 MiB without a line end: the client refuses at once, naming the bound,
    holding at most a few hundred KiB (it used to allocate the bulk, wait out
    `timeout_s`, recurse until RecursionError, or buffer every byte)."""
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
    assert peak < 4 << 20, f"{peak} bytes held for one hostile reply"


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
        limit = t.pool.max_bulk
        assert limit > MAX_BULK  # 1 MiB chunks: the bound grew with the layout

        async def layer_spans(i: int) -> list[list[memoryview]]:
            return layout.chunk_spans(i, [0], [64])

        key = "ab" * 16
        await t.save(SaveJob("r", [key], [64], 4, layer_spans))
        (strlen,) = await t.pool.pipeline([("STRLEN", t.key(key))])
        assert isinstance(strlen, int) and strlen <= limit < strlen + 1024
        (value,) = await t.pool.pipeline([("GET", t.key(key))])
        assert isinstance(value, bytes) and len(value) == strlen
    finally:
        await t.aclose()
    async with hostile_server(b"$%d\r\n" % (limit + 1)) as url:
        pool = Pool(parse_url(url), 1, 30.0, "test")
        pool.max_bulk = limit
        try:
            async with pool.connection() as conn:
                await conn.send(encode("GETRANGE", "k", 0, -1))
                with pytest.raises(ProtocolError, match=f"a bulk reply of {limit + 1} "):
                    await conn.bulk_header()
        finally:
            pool.close()
