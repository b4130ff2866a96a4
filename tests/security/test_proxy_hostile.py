"""kvflow proxy against hostile clients (issue 46's "Low" findings): request framing that
could smuggle a second request, a connection count past its bound, a request trickled
forever, proxy settings in the environment, and what a 502 tells a client.

Real sockets against a real `PdProxy`, with real standard-library HTTP servers upstream.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO, NamedTuple

import pytest

from kvflow.pd.proxy import PdProxy
from kvflow_vllm.apiserver import free_port

WAIT_S = 20.0
"""How long a test waits on any one socket read before it fails (never reached when the
proxy behaves)."""


class Answer(NamedTuple):
    status: int
    body: bytes
    closes: bool  # the answer said `Connection: close`

    def error(self) -> str:
        return str(json.loads(self.body).get("error", ""))


class _Upstream(BaseHTTPRequestHandler):
    """A prefill (a request with `do_remote_decode`) or decode server in a few lines."""

    protocol_version = "HTTP/1.1"
    server: _UpstreamServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            data = self.server.prefill_answer
        else:
            data = json.dumps({"choices": [{"text": "decoded"}], "params": params}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _UpstreamServer(ThreadingHTTPServer):
    daemon_threads = True
    seen: list[dict[str, Any]]
    prefill_answer = json.dumps({"kv_transfer_params": {"offer": "o1"}}).encode()


@contextlib.contextmanager
def upstream(prefill_answer: bytes | None = None) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A real HTTP server answering as vLLM's would (a prefill with `prefill_answer` if
    given); its URL and the bodies it got."""
    server = _UpstreamServer(("127.0.0.1", 0), _Upstream)
    server.seen = []
    if prefill_answer is not None:
        server.prefill_answer = prefill_answer
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.seen
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def proxy_to(prefill: str, decode: str, **options: Any) -> Iterator[PdProxy]:
    proxy = PdProxy([prefill], [decode], **options).start()
    try:
        yield proxy
    finally:
        proxy.close()


def connect(proxy: PdProxy) -> socket.socket:
    host, port = proxy.address
    return socket.create_connection((str(host), int(port)), timeout=WAIT_S)


def read_answer(fp: BinaryIO) -> Answer | None:
    """The next answer on `fp`; None at its end."""
    while line := fp.readline():
        if not line.startswith(b"HTTP/"):  # an HTTP/0.9 answer: no status line, no headers
            return Answer(0, line + fp.read(), True)
        status = int(line.split()[1])
        headers = http.client.parse_headers(fp)
        if status == 100:
            continue
        if headers.get("Transfer-Encoding") == "chunked":
            body = b""
            while size := int(fp.readline(), 16):
                body += fp.read(size)
                fp.readline()
            fp.readline()
        else:
            body = fp.read(int(headers.get("Content-Length", "0")))
        return Answer(status, body, headers.get("Connection", "").lower() == "close")
    return None


def read_answers(sock: socket.socket, fp: BinaryIO | None = None) -> list[Answer]:
    """Every answer on `sock` (read through `fp` if given) until the proxy closes it."""
    fp = sock.makefile("rb") if fp is None else fp
    answers = []
    try:
        while (answer := read_answer(fp)) is not None:
            answers.append(answer)
    except ConnectionResetError:  # closed with bytes of ours unread: its answers came first
        pass
    return answers


def exchange(proxy: PdProxy, raw: bytes) -> list[Answer]:
    """Send `raw` on a fresh connection; every answer until the proxy closes it."""
    with connect(proxy) as sock:
        sock.sendall(raw)
        return read_answers(sock)


def completion(extra_headers: str, body: bytes) -> bytes:
    """A completion request with `extra_headers` (framing included) and `body` as sent."""
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        f"{extra_headers}\r\n"
    ).encode() + body


def honest(extra_headers: str = "") -> bytes:
    """A well-formed completion request."""
    body = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
    return completion(f"Content-Length: {len(body)}\r\n{extra_headers}", body)


SMUGGLED = honest()
"""A complete request hidden in the body of another."""


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[PdProxy, list[dict[str, Any]]]]:
    with upstream() as (url, seen), proxy_to(url, url, client_timeout_s=5) as proxy:
        yield proxy, seen


@pytest.fixture
def servers(
    shared: tuple[PdProxy, list[dict[str, Any]]],
) -> tuple[PdProxy, list[dict[str, Any]]]:
    """A proxy in front of one real upstream that is both prefill and decode, and what
    the upstream received in this test (one pair for the module: closing a server waits
    for its loop's half-second poll)."""
    shared[1].clear()
    return shared


def test_a_completion_goes_through_and_the_connection_stays_open(
    servers: tuple[PdProxy, list[dict[str, Any]]],
) -> None:
    """The honest path these bounds must not break: two requests on one kept-alive
    connection, each prefilled then decoded with the prefill's params."""
    proxy, seen = servers
    answers = exchange(proxy, honest() + honest("Connection: close\r\n"))
    assert [a.status for a in answers] == [200, 200]
    assert json.loads(answers[0].body)["params"] == {"offer": "o1"}
    assert len(seen) == 4 and seen[1]["kv_transfer_params"] == {"offer": "o1"}


@pytest.mark.parametrize("route", ["round-robin", "random"])
def test_a_prefill_that_gives_no_params_is_still_decoded(route: str) -> None:
    """vLLM's prefill server answers `kv_transfer_params: null` when it offers nothing
    (kvflow's: its offers already hold all the blocks they may): the request still goes
    to the decode server, which computes the prompt. (A refactoring of the proxy once
    took that answer for a failed prefill and answered the client nothing: found by
    tests/compat/test_serving_load.py's 64 requests under load.)"""
    none = json.dumps({"kv_transfer_params": None}).encode()
    with upstream(none) as (url, seen):
        proxy = PdProxy([url], [url], route=route).start()
        try:
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}
            with urllib.request.urlopen(
                urllib.request.Request(proxy.url + "/v1/completions", json.dumps(body).encode()),
                timeout=WAIT_S,
            ) as answer:
                got = json.loads(answer.read())
        finally:
            proxy.close()
    assert got["choices"] == [{"text": "decoded"}] and got["params"] == {}
    assert len(seen) == 2 and seen[1].get("kv_transfer_params") is None


# 1: Transfer-Encoding


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)


@pytest.mark.parametrize(
    ("headers", "status", "says"),
    [
        ("Transfer-Encoding: chunked\r\n", 501, "Transfer-Encoding is not supported"),
        ("Transfer-Encoding: identity\r\n", 501, "Transfer-Encoding is not supported"),
        (
            f"Transfer-Encoding: chunked\r\nContent-Length: {len(chunked(SMUGGLED))}\r\n",
            400,
            "both Transfer-Encoding and Content-Length",
        ),
        (
            f"Content-Length: {len(chunked(SMUGGLED))}\r\nTransfer-Encoding: chunked\r\n",
            400,
            "both Transfer-Encoding and Content-Length",
        ),
        ("Transfer-Encoding : chunked\r\n", 400, "malformed header"),
        ("X: 1\r\n Transfer-Encoding: chunked\r\n", 400, "folded"),
        ("X-No-Colon\r\nTransfer-Encoding: chunked\r\n", 400, "malformed header"),
    ],
)
def test_a_chunked_body_is_refused_never_read_as_the_next_request(
    servers: tuple[PdProxy, list[dict[str, Any]]], headers: str, status: int, says: str
) -> None:
    """A body sent chunked, holding a whole second request: one refusal, the connection
    closed, nothing sent upstream (the proxy used to read no body, answer 400, and then
    serve the chunk's bytes as a request of their own)."""
    proxy, seen = servers
    answers = exchange(proxy, completion(headers, chunked(SMUGGLED)))
    assert [(a.status, a.closes) for a in answers] == [(status, True)], answers
    assert says in answers[0].error()
    assert seen == []


# 2: Content-Length


@pytest.mark.parametrize("declared", ["0_2", "+2", "2\x0c", "\xa02"])
def test_a_content_length_of_anything_but_ascii_digits_is_refused(
    servers: tuple[PdProxy, list[dict[str, Any]]], declared: str
) -> None:
    """Python's int() reads '0_2', '+2' and Unicode spaces and digits; the proxy used to
    take them as lengths a front end may read otherwise."""
    proxy, seen = servers
    raw = completion(f"Content-Length: {declared}\r\n", b'{"p": 0}').replace(
        declared.encode("utf-8"), declared.encode("latin-1", "replace")
    )
    answers = exchange(proxy, raw)
    assert [(a.status, a.closes) for a in answers] == [(400, True)], answers
    assert "is not a byte count" in answers[0].error()
    assert seen == []


@pytest.mark.parametrize("lengths", [(0, len(SMUGGLED)), (len(SMUGGLED), len(SMUGGLED))])
def test_a_repeated_content_length_is_refused(
    servers: tuple[PdProxy, list[dict[str, Any]]], lengths: tuple[int, int]
) -> None:
    """Two Content-Length headers, even equal: the proxy used to take the first (0) and
    then serve the body as a request of its own."""
    proxy, seen = servers
    first, second = lengths
    head = f"Content-Length: {first}\r\nContent-Length: {second}\r\n"
    answers = exchange(proxy, completion(head, SMUGGLED))
    assert [(a.status, a.closes) for a in answers] == [(400, True)], answers
    assert "one Content-Length header, not 2" in answers[0].error()
    assert seen == []


def test_a_content_length_with_optional_whitespace_is_a_length(
    servers: tuple[PdProxy, list[dict[str, Any]]],
) -> None:
    """RFC 9112's optional whitespace around a value is not part of it."""
    proxy, _ = servers
    body = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
    head = f"Content-Length:\t{len(body)} \r\nConnection: close\r\n"
    answers = exchange(proxy, completion(head, body))
    assert [a.status for a in answers] == [200]


def test_a_body_on_a_request_that_reads_none_closes_the_connection(
    servers: tuple[PdProxy, list[dict[str, Any]]],
) -> None:
    """A GET or an unknown path with a body: answered, then closed, the body unread (it
    used to be served as the next request)."""
    proxy, seen = servers
    for head in ("GET /health HTTP/1.1", "POST /v1/other HTTP/1.1"):
        raw = f"{head}\r\nHost: p\r\nContent-Length: {len(SMUGGLED)}\r\n\r\n".encode() + SMUGGLED
        answers = exchange(proxy, raw)
        assert len(answers) == 1 and answers[0].closes, answers
    assert seen == []


# 3: a bound on connections, a deadline on a request


def ask_health(sock: socket.socket, close: bool = False) -> None:
    extra = "Connection: close\r\n" if close else ""
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: p\r\n{extra}\r\n".encode())


def test_past_max_clients_a_connection_is_answered_503_and_closed() -> None:
    """Two clients hold both of `max_clients=2`: a third is answered 503 on the spot and
    closed, having sent nothing (it used to get a thread of its own, however many came);
    once one of the two leaves, the next is served."""
    dead = f"http://127.0.0.1:{free_port()}"
    with proxy_to(dead, dead, max_clients=2, client_timeout_s=60) as proxy:
        held = [connect(proxy), connect(proxy)]
        try:
            files = [sock.makefile("rb") for sock in held]
            for sock, fp in zip(held, files, strict=True):  # each holds a thread, then waits
                ask_health(sock)
                assert read_answer(fp) == (200, b"{}", False)
            with connect(proxy) as third:
                answers = read_answers(third)
            assert [(a.status, a.closes) for a in answers] == [(503, True)], answers
            assert "2 clients (--max-clients)" in answers[0].error()
            ask_health(held[0], close=True)
            assert [a.status for a in read_answers(held[0], files[0])] == [200]  # slot freed
            with connect(proxy) as fourth:
                ask_health(fourth, close=True)
                assert [a.status for a in read_answers(fourth)] == [200]
        finally:
            for sock in held:
                sock.close()
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_clients must be at least 1"):
            PdProxy([dead], [dead], max_clients=bad)


def trickle(
    sock: socket.socket, data: bytes, deadline_s: float = WAIT_S, unit: int = 1
) -> list[Answer]:
    """Send `data` `unit` bytes at a time, a pause after each, until the proxy answers."""
    deadline = time.monotonic() + deadline_s
    for at in range(0, len(data), unit):
        sock.sendall(data[at : at + unit])
        if select.select([sock], [], [], 0.05)[0]:
            return read_answers(sock)
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no answer to a trickled request within {deadline_s} s")


@pytest.mark.parametrize("where", ["head", "body", "empty lines"])
def test_a_trickled_request_is_answered_408_at_request_timeout_s(where: str) -> None:
    """A client sends a byte every 50 ms, never silent for `client_timeout_s` (60 s):
    the whole request must still arrive within `request_timeout_s` (0.5 s here), else
    408 and closed (it used to hold its thread for as long as it kept trickling)."""
    dead = f"http://127.0.0.1:{free_port()}"
    with proxy_to(dead, dead, client_timeout_s=60, request_timeout_s=0.5) as proxy:
        with connect(proxy) as sock:
            if where == "head":
                answers = trickle(sock, honest("X-Pad: " + "a" * 60000 + "\r\n"))
            elif where == "empty lines":  # before a request line: they start its deadline too
                answers = trickle(sock, b"\r\n" * 30000, unit=2)
            else:
                sock.sendall(completion("Content-Length: 60000\r\n", b""))
                answers = trickle(sock, b" " * 60000)
        assert [(a.status, a.closes) for a in answers] == [(408, True)], answers
        assert answers[0].error() == (
            "the request did not arrive within 0.5 s (--request-timeout-s)"
        )
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="request_timeout_s must be above 0"):
            PdProxy([dead], [dead], request_timeout_s=bad)


# 4: proxy settings in the environment


class _ForwardProxy(BaseHTTPRequestHandler):
    """What `HTTP_PROXY` points at: it records what it was asked, and refuses it."""

    protocol_version = "HTTP/1.1"
    server: _UpstreamServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.server.seen.append({"url": self.path})
        self.send_response(407)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_upstream_calls_ignore_proxy_settings_in_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`HTTP_PROXY` set, no `NO_PROXY`: the proxy's calls still go straight to its servers
    (urllib's default opener sent them, and the prompts, to the proxy named there)."""
    forward = _UpstreamServer(("127.0.0.1", 0), _ForwardProxy)
    forward.seen = []
    threading.Thread(target=forward.serve_forever, daemon=True).start()
    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{forward.server_address[1]}")
    urllib.request.install_opener(None)  # urllib's default opener reads the environment anew
    try:
        with upstream() as (url, seen), proxy_to(url, url) as proxy:
            answers = exchange(proxy, honest("Connection: close\r\n"))
        assert [a.status for a in answers] == [200] and forward.seen == []
        assert len(seen) == 2
    finally:
        urllib.request.install_opener(None)
        forward.shutdown()
        forward.server_close()


# 5: what a 502 says


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_502_names_the_role_that_failed_not_its_url(
    role: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client learns which role failed; the URL (internal addresses) goes to the log."""
    caplog.set_level(logging.WARNING, logger="kvflow.proxy")
    dead = f"http://127.0.0.1:{free_port()}"
    with upstream() as (url, _):
        prefill, decode = (dead, url) if role == "prefill" else (url, dead)
        with proxy_to(prefill, decode) as proxy:
            answers = exchange(proxy, honest("Connection: close\r\n"))
    assert [a.status for a in answers] == [502], answers
    error = answers[0].error()
    assert error.startswith(f"the {role} server could not be reached"), error
    assert dead.split("//")[1] not in answers[0].body.decode()
    assert "127.0.0.1" not in answers[0].body.decode()
    assert any(dead in r.getMessage() and role in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("answer", [b"[]", b"<html>", b""])
def test_a_prefill_answer_that_is_no_json_object_is_a_502(
    answer: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """It was an exception in the handler: the client's connection dropped, unanswered."""
    caplog.set_level(logging.WARNING, logger="kvflow.proxy")
    with upstream(answer) as (url, seen), proxy_to(url, url) as proxy:
        answers = exchange(proxy, honest("Connection: close\r\n"))
    assert [a.status for a in answers] == [502], answers
    assert answers[0].error().startswith("the prefill server's answer could not be read")
    assert len(seen) == 1  # no decode
    assert any(url in r.getMessage() for r in caplog.records)


# 6: what real clients send


def test_a_client_that_waits_for_100_continue_gets_it_then_its_answer(
    servers: tuple[PdProxy, list[dict[str, Any]]],
) -> None:
    """curl sends `Expect: 100-continue` before a body over 1 KiB and waits (a second)
    for the go-ahead: the proxy gives it, then reads the body and answers."""
    proxy, seen = servers
    body = json.dumps({"prompt": "hi " * 600, "max_tokens": 4}).encode()
    head = completion(f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n", b"")
    with connect(proxy) as sock:
        sock.sendall(head)
        fp = sock.makefile("rb")
        assert fp.readline().split()[1] == b"100"
        assert fp.readline() == b"\r\n"
        sock.sendall(body)
        answer = read_answer(fp)
    assert answer is not None and answer.status == 200
    assert len(seen) == 2 and seen[0]["prompt"] == "hi " * 600


def test_a_head_request_is_answered_without_a_body(
    servers: tuple[PdProxy, list[dict[str, Any]]],
) -> None:
    proxy, seen = servers
    with connect(proxy) as sock:
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: p\r\n\r\n")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n")
        fp = sock.makefile("rb")
        status = fp.readline().split()[1]
        headers = http.client.parse_headers(fp)  # then no body: the next answer follows
        answer = read_answer(fp)
    assert status == b"501" and int(headers["Content-Length"]) > 0
    assert answer is not None and (answer.status, answer.body) == (200, b"{}")
    assert seen == []


def test_a_body_nested_too_deep_is_a_400_not_a_failure(
    servers: tuple[PdProxy, list[dict[str, Any]]],
) -> None:
    """JSON nested 100,000 deep: the decoder's recursion limit is a bad body (400), not
    an error of the proxy's (500 and a traceback in its log for each such request)."""
    proxy, seen = servers
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    answers = exchange(
        proxy, completion(f"Content-Length: {len(body)}\r\nConnection: close\r\n", body)
    )
    assert [a.status for a in answers] == [400], answers
    assert answers[0].error() == "the body is not a JSON object"
    assert seen == []
