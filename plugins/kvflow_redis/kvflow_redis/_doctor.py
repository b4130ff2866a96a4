"""`kvflow doctor`'s check of a `redis` store: is the server (each cluster node or
sentinel) reachable, does it take the credentials, does it answer PING, and does it
evict. A blocking socket with a short timeout, one command at a time; the URL's password
is never shown."""

from __future__ import annotations

import os
import socket
import ssl
from typing import TYPE_CHECKING, Any

from ._client import TLS, BadURL, Target, parse_url

if TYPE_CHECKING:
    from ._transport import RedisOptions

__all__ = ["check"]

WHERE = "kv_connector_extra_config['options']"
TIMEOUT_S = 3.0
"""The longest one server may take to connect or answer (or `timeout_s`, if shorter)."""


class ServerError(Exception):
    """The server's error reply (`-NOAUTH ...`)."""


def check(options: RedisOptions, findings: Any) -> None:
    o = options
    try:
        target = parse_url(o.url)
        if o.mode == "standalone" and len(target.hosts) > 1:
            raise BadURL("a standalone server is one host:port (several need 'mode')")
    except BadURL as exc:
        findings.fail("redis", f"{WHERE}['url']: {_hide(str(exc), o.url)}", "correct the URL")
        return
    if o.password_env and o.password_env not in os.environ:
        findings.fail(
            "redis",
            f"{WHERE}['password_env']: the environment variable {o.password_env!r} is not set",
            f"export {o.password_env} (the password) in the engine's environment",
        )
        return
    for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        if (path := getattr(o, name)) and not os.path.isfile(path):
            findings.fail("redis", f"{WHERE}['{name}']: no such file {path!r}", "name the file")
            return
    password = os.environ[o.password_env] if o.password_env else target.password
    tls = TLS(o.tls_ca_file, o.tls_cert_file, o.tls_key_file, o.tls_check_hostname)
    timeout = min(o.timeout_s, TIMEOUT_S) if o.timeout_s > 0 else TIMEOUT_S
    auth = password if o.mode != "sentinel" else None  # sentinels take none of the data's
    places: list[Any] = [target.path] if target.path else list(target.hosts)
    answers, failures = [], []
    for place in places:
        shown = place if isinstance(place, str) else f"{place[0]}:{place[1]}"
        try:
            answers.append(_probe(target, place, auth, tls, timeout))
        except (OSError, ServerError, ssl.SSLError) as exc:
            failures.append(f"{shown}: {_why(exc, timeout)}")
    _say(findings, target, o.mode, answers, failures)


def _say(
    findings: Any, target: Target, mode: str, answers: list[str | None], failures: list[str]
) -> None:
    url = target.redacted()
    if not answers:
        findings.fail(
            "redis",
            f"{url}: {'; '.join(failures)}",
            f"start the server, or correct {WHERE}['url'] (host, port, TLS) and the password "
            "(in the URL, or password_env)",
        )
        return
    if failures:
        findings.warn(
            "redis",
            f"{url}: {len(answers)} of {len(answers) + len(failures)} answered; "
            + "; ".join(failures),
            f"bring those {'sentinels' if mode == 'sentinel' else 'nodes'} back, or drop them",
        )
        return
    policy = answers[0]
    if policy == "noeviction":
        findings.warn(
            "redis",
            f"{url} answers PING, with maxmemory-policy noeviction: saves fail once it is full",
            "CONFIG SET maxmemory-policy allkeys-lru (and set maxmemory; kvflow-redis README)",
        )
        return
    evicts = f", maxmemory-policy {policy}" if policy else ""
    findings.ok("redis", f"{url} answers PING ({mode}{evicts})")


def _probe(
    target: Target, place: str | tuple[str, int], password: str | None, tls: TLS, timeout: float
) -> str | None:
    """PING one server (after AUTH, where a password is set); its maxmemory-policy, if it
    tells (None: CONFIG is refused, or a sentinel)."""
    if isinstance(place, str):
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.settimeout(timeout)
        try:
            raw.connect(place)
        except OSError:
            raw.close()
            raise
    else:
        raw = socket.create_connection(place, timeout=timeout)
    with raw:
        sock = raw
        if target.tls and not isinstance(place, str):
            sock = tls.context().wrap_socket(raw, server_hostname=place[0])
        reader = sock.makefile("rb")
        if password is not None:
            user = [target.username] if target.username else []
            _call(sock, reader, "AUTH", *user, password)
        if _call(sock, reader, "PING") != "PONG":
            raise ServerError("answered PING with something other than PONG")
        try:
            reply = _call(sock, reader, "CONFIG", "GET", "maxmemory-policy")
        except ServerError:
            return None
        return reply[1] if isinstance(reply, list) and len(reply) == 2 else None


def _call(sock: socket.socket, reader: Any, *args: str) -> Any:
    """Send one command; its reply (a `ServerError` for an error reply)."""
    parts = [a.encode() for a in args]
    sock.sendall(b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
    return _reply(reader)


def _reply(reader: Any) -> Any:
    line = reader.readline(1 << 16)
    if not line.endswith(b"\r\n"):
        raise ServerError("closed the connection, or is not a Redis server")
    kind, body = line[:1], line[1:-2].decode(errors="replace")
    if kind == b"+":
        return body
    if kind == b"-":
        raise ServerError(body)
    if kind == b":":
        return int(body)
    if kind == b"$":
        n = int(body)
        return None if n < 0 else reader.read(n + 2)[:-2].decode(errors="replace")
    if kind == b"*":
        return [_reply(reader) for _ in range(max(int(body), 0))]
    raise ServerError("is not a Redis server (its reply is not RESP)")


def _why(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError | socket.timeout):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, ServerError):
        return str(exc)
    return getattr(exc, "strerror", None) or str(exc)


def _hide(text: str, url: str) -> str:
    """`text` without the password of `url`."""
    userinfo = url.partition("://")[2].rpartition("@")[0]
    password = userinfo.partition(":")[2]
    return text.replace(password, "***") if password else text
