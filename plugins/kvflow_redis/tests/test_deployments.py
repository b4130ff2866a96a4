"""The transport on every kind of deployment it names, each a real one (`servers.py`): a
3-master/3-replica Redis Cluster, a Sentinel-managed primary, a TLS-only server, and an
ACL user. The whole conformance suite runs on each."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import servers
import trio

from kvflow import LoadJob, SaveJob, TransportContext, TransportError
from kvflow.testing import TransportConformance, make_layout
from kvflow_redis import RedisOptions, RedisTransport

pytestmark = pytest.mark.trio

_prefixes = itertools.count()


def _prefix() -> str:
    return f"kvflow-dep-{os.getpid()}-{next(_prefixes)}:"


def _maker(options: RedisOptions) -> Callable[[TransportContext], RedisTransport]:
    def make(context: TransportContext) -> RedisTransport:
        return RedisTransport(options, context)

    return make


def _context() -> TransportContext:
    return TransportContext("e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"])


class TestRedisClusterConformance(TransportConformance):
    @pytest.fixture
    def make_transport(
        self, redis_cluster: servers.Deployment
    ) -> Callable[[TransportContext], RedisTransport]:
        url = redis_cluster.url
        return _maker(RedisOptions(url=url, mode="cluster", key_prefix=_prefix()))


class TestRedisSentinelConformance(TransportConformance):
    @pytest.fixture
    def make_transport(
        self, redis_sentinel: servers.Deployment
    ) -> Callable[[TransportContext], RedisTransport]:
        options = RedisOptions(
            url=redis_sentinel.url, mode="sentinel", sentinel_master="kvflow", key_prefix=_prefix()
        )
        return _maker(options)


class TestRedisTLSConformance(TransportConformance):
    @pytest.fixture
    def make_transport(
        self, redis_tls: tuple[str, Path]
    ) -> Callable[[TransportContext], RedisTransport]:
        url, ca = redis_tls
        return _maker(RedisOptions(url=url, tls_ca_file=str(ca), key_prefix=_prefix()))


async def test_a_request_spreads_over_every_shard(redis_cluster: servers.Deployment) -> None:
    """One save of 48 chunks lands on all three masters (pipelines split by hash slot), and
    each chunk's shards share a slot (one EXISTS per key answers for all of them)."""
    layout = make_layout(num_layers=2, num_blocks=64, block_size=4, block_granular=False)
    prefix = _prefix()
    shards = ["tp0of2pp0", "tp1of2pp0"]
    transports = []
    for shard in shards:
        ctx = TransportContext("e", "worker", "ns", shard, shards)
        t = RedisTransport(
            RedisOptions(url=redis_cluster.url, mode="cluster", key_prefix=prefix), ctx
        )
        await t.open()
        await t.register(layout)
        transports.append(t)
    try:
        keys = [f"{i:032x}" for i in range(48)]

        async def spans(i: int) -> list[list[memoryview]]:
            return layout.chunk_spans(i, list(range(48)), [4] * 48)

        await transports[0].save(SaveJob("r", keys, [4] * 48, 2, spans))
        assert await transports[1].lookup(keys) == 0, "shard 1 saved nothing yet"
        await transports[1].save(SaveJob("r", keys, [4] * 48, 2, spans))
        assert await transports[1].lookup(keys) == 48
        masters = [s.port for s in redis_cluster.servers if servers.role(s.port) == b"master"]
        held = [int(servers.command(p, "DBSIZE")[1:].split(b"\r\n")[0]) for p in masters]
        assert len(masters) == 3 and all(n > 0 for n in held), held
    finally:
        for t in transports:
            await t.aclose()


async def test_tls_without_the_ca_fails_at_open(redis_tls: tuple[str, Path]) -> None:
    url, _ = redis_tls
    t = RedisTransport(RedisOptions(url=url), _context())
    with pytest.raises(TransportError, match=r"\['url'\].*certificate verify failed"):
        await t.open()


async def test_a_missing_tls_file_is_named() -> None:
    t = RedisTransport(
        RedisOptions(url="rediss://127.0.0.1/0", tls_ca_file="/nope.pem"), _context()
    )
    with pytest.raises(TransportError, match=r"\['tls_ca_file'\]: no such file '/nope.pem'"):
        await t.open()


async def test_a_sentinel_name_it_does_not_know_fails_at_open(
    redis_sentinel: servers.Deployment,
) -> None:
    options = RedisOptions(url=redis_sentinel.url, mode="sentinel", sentinel_master="other")
    t = RedisTransport(options, _context())
    with pytest.raises(TransportError, match=r"\['url'\].*other"):
        await t.open()


@pytest.fixture(scope="module")
def acl_user(redis_url: str) -> str:
    """An ACL user `kvflow-acl` (password `s3cret`) allowed only keys under `acl:`."""
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    reply = servers.command(
        port, "ACL", "SETUSER", "kvflow-acl", "on", ">s3cret", "~acl:*", "+@all", "-@dangerous"
    )
    assert reply.startswith(b"+OK"), reply
    return redis_url.replace("redis://", "redis://kvflow-acl:s3cret@")


async def test_an_acl_user_saves_and_loads(acl_user: str) -> None:
    layout = make_layout(num_layers=2, num_blocks=4, block_size=4, block_granular=False)
    t = RedisTransport(RedisOptions(url=acl_user, key_prefix="acl:"), _context())
    await t.open()  # CONFIG GET is not allowed (-@dangerous): no warning check, no failure
    try:
        await t.register(layout)
        for b in range(4):
            for i in range(2):
                for span in layout.spans(i, b, 4):
                    span[:] = bytes([b + 1]) * len(span)

        async def spans(i: int) -> list[list[memoryview]]:
            return layout.chunk_spans(i, [0, 1], [4, 4])

        await t.save(SaveJob("r", ["a" * 32, "b" * 32], [4, 4], 2, spans))
        assert await t.lookup(["a" * 32, "b" * 32]) == 2
        loaded = LoadJob(
            "r", ["a" * 32, "b" * 32], [4, 4], 2,
            lambda i: layout.chunk_spans(i, [2, 3], [4, 4]), lambda i: None,
        )  # fmt: skip
        await t.load(loaded)
        assert bytes(layout.spans(0, 2, 4)[0])[:1] == b"\x01"
        assert bytes(layout.spans(1, 3, 4)[0])[:1] == b"\x02"
    finally:
        await t.aclose()
    outside = RedisTransport(RedisOptions(url=acl_user, key_prefix="kvflow:"), _context())
    await outside.open()
    try:
        with pytest.raises(TransportError, match="no permissions to access one of the keys"):
            await outside.lookup(["a" * 32])
    finally:
        await outside.aclose()


async def test_a_wrong_acl_password_fails_at_open_without_printing_it(acl_user: str) -> None:
    t = RedisTransport(RedisOptions(url=acl_user.replace("s3cret", "guess")), _context())
    with pytest.raises(TransportError, match=r"\['url'\].*kvflow-acl:\*\*\*@") as err:
        await t.open()
    assert "guess" not in str(err.value)


async def test_the_password_comes_from_the_environment(
    acl_user: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = acl_user.replace(":s3cret@", "@")
    monkeypatch.setenv("KVFLOW_TEST_REDIS_PASSWORD", "s3cret")
    options = RedisOptions(url=url, key_prefix="acl:", password_env="KVFLOW_TEST_REDIS_PASSWORD")
    t = RedisTransport(options, _context())
    await t.open()
    try:
        assert await t.lookup(["c" * 32]) == 0
    finally:
        await t.aclose()
    monkeypatch.delenv("KVFLOW_TEST_REDIS_PASSWORD")
    with pytest.raises(TransportError, match=r"\['password_env'\].*KVFLOW_TEST_REDIS_PASSWORD"):
        await RedisTransport(options, _context()).open()


async def test_the_client_is_started_again_after_it_stopped(redis_url: str) -> None:
    """A client whose tasks ended (coredis failed inside) is started again on next use."""
    t = RedisTransport(RedisOptions(url=redis_url, key_prefix=_prefix()), _context())
    await t.open()
    try:
        assert t._holder is not None
        await t._holder.stop()
        with trio.fail_after(30):
            assert await t.lookup(["d" * 32]) == 0
        assert t._holder.alive
    finally:
        await t.aclose()
