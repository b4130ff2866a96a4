"""The coredis client of one transport: where the server is (a standalone server, a Redis
Cluster or a Sentinel-managed primary), TLS and ACL credentials from the options, and a
task that holds the client open.

coredis runs on anyio, so on trio natively. A coredis client is an async context (its
pool's connections are tasks of it); kvflow opens and closes a transport from different
tasks, so `Holder` enters the context in a system task of its own and leaves it when
closed. Data connections check every reply's framing against bounds first
(`_guard.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ssl
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal
from urllib.parse import parse_qs, unquote

import coredis
import coredis.exceptions
import trio
from coredis.connection import (
    ClusterConnection,
    SentinelManagedConnection,
    TCPConnection,
    TCPLocation,
    UnixDomainSocketConnection,
    UnixDomainSocketLocation,
)
from coredis.pool import ClusterConnectionPool, ConnectionPool, SentinelConnectionPool

from ._guard import Limits, ProtocolError, guarded

Mode = Literal["standalone", "cluster", "sentinel"]
Client = coredis.Redis[bytes] | coredis.RedisCluster[bytes]
SCHEMES = ("redis", "rediss", "unix")
NETWORK_ERRORS = (OSError, trio.TooSlowError, coredis.exceptions.RedisError, ProtocolError)


class BadURL(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Target:
    """Where and how to connect, from the `url` option."""

    tls: bool
    hosts: tuple[tuple[str, int], ...] = ()
    path: str = ""  # a unix socket
    db: int = 0
    username: str | None = None
    password: str | None = None
    text: str = ""

    def redacted(self) -> str:
        """The URL without its password."""
        return masked(self.text)


def masked(url: str) -> str:
    """`url` with its password, if it names one, as `***` (`redis://user:***@host`): how
    every message and log line shows a URL."""
    scheme, sep, rest = url.partition("://")
    if not sep:  # not a URL, but may still hold `user:password@`
        scheme, rest = "", url
    userinfo, at, hosts = rest.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}{sep}{user}:***@{hosts}" if at and colon else url


def parse_url(url: str) -> Target:
    """`redis[s]://[[user]:password@]host[:port][,host[:port]...][/db]` or
    `unix://[[user]:password@]/path/redis.sock[?db=N]`; a `BadURL` names the URL without
    its password."""
    shown = masked(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise BadURL(f"{shown!r} is not a redis://, rediss:// or unix:// URL")
    userinfo, at, rest = rest.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    rest, _, query = rest.partition("?")
    params = parse_qs(query)
    if scheme == "unix":
        if not rest.startswith("/"):
            raise BadURL(f"{shown!r}: a unix:// URL names an absolute socket path")
        db = _db(params.get("db", ["0"])[0], shown)
        return Target(False, (), rest, db, username, password, url)
    netloc, _, db_text = rest.partition("/")
    hosts = tuple(_host(h, shown) for h in netloc.split(","))
    db = _db(db_text or "0", shown)
    return Target(scheme == "rediss", hosts, "", db, username, password, url)


def _host(text: str, url: str) -> tuple[str, int]:
    """`host:port` of one of `url`'s hosts (`url`, masked, names it in an error)."""
    if text.startswith("["):  # [v6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise BadURL(f"{url!r} names no host")
    if port and not port.isdigit():
        raise BadURL(f"{url!r}: port {port!r} is not a number")
    return host, int(port or 6379)


def _db(text: str, url: str) -> int:
    if not text.isdigit():
        raise BadURL(f"{url!r}: database {text!r} is not a number")
    return int(text)


@dataclasses.dataclass(frozen=True)
class TLS:
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    check_hostname: bool = True

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file or None)
        ctx.check_hostname = self.check_hostname
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file or None)
        return ctx


def build(
    target: Target,
    mode: Mode,
    *,
    master: str,
    password: str | None,
    tls: TLS,
    limits: Limits,
    max_connections: int,
    timeout_s: float,
    name: str,
) -> tuple[Client, list[AbstractAsyncContextManager[Any]]]:
    """A coredis client for `target` in `mode`, and what `Holder` enters to run it."""
    kwargs: dict[str, Any] = {
        "username": target.username,
        "password": password if password is not None else target.password,
        "stream_timeout": timeout_s,
        "connect_timeout": timeout_s,
        "client_name": name,
        "ssl_context": tls.context() if target.tls else None,
    }
    if mode == "cluster":
        if target.path:
            raise BadURL("a cluster is reached over TCP: name its nodes as host:port")
        pool = ClusterConnectionPool(
            [TCPLocation(h, p) for h, p in target.hosts],
            connection_class=guarded(ClusterConnection, limits),
            max_connections=max_connections,
            max_connections_per_node=True,
            timeout=timeout_s,
            **kwargs,
        )
        client = coredis.RedisCluster(connection_pool=pool, retry_policy=_NO_RETRY)
        return client, [client]
    if mode == "sentinel":
        if target.path:
            raise BadURL("sentinels are reached over TCP: name them as host:port")
        shared = ("connect_timeout", "stream_timeout", "ssl_context")
        sentinel_kwargs = {k: kwargs[k] for k in shared}
        locations = [TCPLocation(h, p) for h, p in target.hosts]
        sentinel = coredis.Sentinel(locations, sentinel_kwargs=sentinel_kwargs)
        pool_class = _guarded_sentinel_pool(limits)
        primary = sentinel.primary_for(
            master,
            connection_pool_class=pool_class,
            db=target.db,
            max_connections=max_connections,
            timeout=timeout_s,
            **kwargs,
        )
        return primary, [sentinel, primary]  # the sentinels are entered first
    location: TCPLocation | UnixDomainSocketLocation
    cls: type[TCPConnection | UnixDomainSocketConnection]
    if target.path:
        location, cls = UnixDomainSocketLocation(target.path), UnixDomainSocketConnection
        kwargs.pop("ssl_context")
    else:
        if len(target.hosts) > 1:
            raise BadURL(
                "a standalone server is one host:port; several name a cluster's nodes or "
                "sentinels (set 'mode')"
            )
        location, cls = TCPLocation(*target.hosts[0]), TCPConnection
    single = ConnectionPool(
        connection_class=guarded(cls, limits),
        location=location,
        max_connections=max_connections,
        timeout=timeout_s,
        db=target.db,
        **kwargs,
    )
    redis = coredis.Redis(connection_pool=single, retry_policy=_NO_RETRY)
    return redis, [redis]


_NO_RETRY = coredis.retry.NoRetryPolicy()
"""A failed transfer is retried by vLLM (recompute), not by the client behind its back."""


def _guarded_sentinel_pool(limits: Limits) -> type[SentinelConnectionPool]:
    connection_class = guarded(SentinelManagedConnection, limits)

    class GuardedSentinelPool(SentinelConnectionPool):
        async def _construct_connection(self) -> SentinelManagedConnection:
            location = await self.get_primary_location()
            conn: SentinelManagedConnection = connection_class(
                location, self.service_name, True, **self.connection_kwargs
            )
            return conn

    return GuardedSentinelPool


class Holder:
    """Keeps a coredis client entered from a system task, from `start` to `stop`."""

    def __init__(self, client: Client, enter: list[AbstractAsyncContextManager[Any]]) -> None:
        self.client = client
        self._enter = enter
        self._entered = trio.Event()
        self._stopped = trio.Event()
        self._scope = trio.CancelScope()
        self._failure: BaseException | None = None

    async def start(self) -> None:
        trio.lowlevel.spawn_system_task(self._hold, name="kvflow-redis client")
        await self._entered.wait()
        if isinstance(self._failure, trio.Cancelled):  # stopped, or the trio run ends
            raise RuntimeError("the redis client was stopped while it started")
        if self._failure is not None:
            raise self._failure

    @property
    def alive(self) -> bool:
        return self._entered.is_set() and not self._stopped.is_set()

    async def stop(self) -> None:
        """Leave the client's context (also while it is still being entered)."""
        self._scope.cancel()
        with trio.move_on_after(10):
            await self._stopped.wait()

    async def _hold(self) -> None:
        try:
            with self._scope:
                async with contextlib.AsyncExitStack() as stack:
                    for context in self._enter:
                        await stack.enter_async_context(context)
                    self._entered.set()
                    await trio.sleep_forever()
        except BaseException as exc:  # a system task must not raise
            self._failure = exc
        finally:
            self._entered.set()
            self._stopped.set()
