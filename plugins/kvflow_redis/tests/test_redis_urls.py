"""A redis URL's password never reaches a message or a log line (issue 46, Low): every
error that names the URL names it as `redis://user:***@host`, whatever is wrong with it."""

from __future__ import annotations

import logging

import pytest

from kvflow import TransportContext, TransportError
from kvflow_redis import RedisOptions, RedisTransport
from kvflow_redis._client import masked, parse_url

SECRET = "s3cr:et@pw"  # a ':' and an '@' in it, as a careless URL holds them
BAD_URLS = [
    f"http://kvflow:{SECRET}@127.0.0.1:6379/0",  # not redis
    f"redis://kvflow:{SECRET}@127.0.0.1:63x9/0",  # port
    f"redis://kvflow:{SECRET}@127.0.0.1:6379/zero",  # db
    f"redis://kvflow:{SECRET}@/0",  # no host
    f"unix://kvflow:{SECRET}@run/redis.sock",  # not an absolute path
    f"unix://kvflow:{SECRET}@/run/redis.sock?db=x",  # db
    f"redis://kvflow:{SECRET}@h1:7000,h2:7000/0",  # several hosts, standalone (unnamed)
    f"redis//kvflow:{SECRET}@127.0.0.1:6379",  # not even a URL
]


def _context() -> TransportContext:
    return TransportContext("e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"])


@pytest.mark.parametrize("url", BAD_URLS)
async def test_a_bad_url_fails_at_open_naming_it_without_its_password(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    t = RedisTransport(RedisOptions(url=url, timeout_s=2), _context())
    with pytest.raises(TransportError, match=r"\['url'\]") as err:
        await t.open()
    said = str(err.value) + t.where + caplog.text
    assert "s3cr" not in said and "et@pw" not in said, said
    if "h1:7000" not in url:  # the error that names the URL names it masked
        assert "kvflow:***@" in str(err.value), str(err.value)


async def test_an_unreachable_server_is_named_without_the_password() -> None:
    t = RedisTransport(
        RedisOptions(url=f"redis://kvflow:{SECRET}@127.0.0.1:1/0", timeout_s=2), _context()
    )
    with pytest.raises(TransportError, match=r"kvflow:\*\*\*@127\.0\.0\.1:1/0") as err:
        await t.open()
    assert "s3cr" not in str(err.value)


def test_masked_hides_a_password_and_nothing_else() -> None:
    assert masked(f"rediss://u:{SECRET}@cache:6380/3") == "rediss://u:***@cache:6380/3"
    assert masked(f"redis://:{SECRET}@cache") == "redis://:***@cache"
    assert masked("redis://user@cache") == "redis://user@cache"  # a user, no password
    assert masked("redis://cache:6379/0") == "redis://cache:6379/0"
    assert masked("unix://u:pw@/run/redis.sock?db=2") == "unix://u:***@/run/redis.sock?db=2"
    target = parse_url("rediss://u:p%40ss@cache.internal:6380/3")
    assert target.password == "p@ss" and target.redacted() == "rediss://u:***@cache.internal:6380/3"
