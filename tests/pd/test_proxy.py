"""kvflow proxy without vLLM: the prefill copy of a request, a dead server's error, and
what it reads of a client's request."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvflow.cli.main import build_parser
from kvflow.pd import params
from kvflow.pd import proxy as proxy_keys
from kvflow.pd.proxy import (
    MAX_BODY_BYTES,
    MAX_CLIENTS,
    PREFILL_PARAMS,
    REQUEST_TIMEOUT_S,
    PdProxy,
    prefill_request,
    run,
)
from kvflow_vllm.apiserver import free_port


def test_the_prefill_copy_follows_vllms_convention() -> None:
    body = {"prompt": [1, 2], "max_tokens": 50, "stream": True, "stream_options": {}}
    pre = prefill_request(body)
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    assert pre["kv_transfer_params"] == PREFILL_PARAMS
    assert PREFILL_PARAMS["do_remote_decode"] is True and PREFILL_PARAMS["remote_host"] is None
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body  # untouched
    chat = prefill_request({"messages": [], "max_completion_tokens": 9})
    assert chat["max_completion_tokens"] == 1


def test_a_dead_prefill_server_is_a_clear_502_naming_its_role() -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxy = PdProxy([dead], [dead]).start()
    try:
        req = urllib.request.Request(
            proxy.url + "/v1/completions",
            json.dumps({"prompt": "hi", "max_tokens": 4}).encode(),
            {"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 502
        error = json.loads(err.value.read())["error"]
        assert error == "the prefill server could not be reached (ConnectionRefusedError)"
    finally:
        proxy.close()


def test_a_burst_of_clients_is_answered_not_reset() -> None:
    """64 clients connecting at once (socketserver's backlog of 5 reset some of them)."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = PdProxy([dead], [dead]).start()

    def ask(_: int) -> int | str:
        req = urllib.request.Request(
            proxy.url + "/v1/completions", b'{"prompt": "hi"}', {"Content-Type": "application/json"}
        )
        try:
            urllib.request.urlopen(req, timeout=60)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError as exc:
            return type(exc).__name__
        return 200

    try:
        with ThreadPoolExecutor(64) as ex:
            answers = list(ex.map(ask, range(256)))
    finally:
        proxy.close()
    assert answers == [502] * 256, Counter(answers)


def test_a_proxy_needs_both_kinds_of_server() -> None:
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        PdProxy([], ["http://127.0.0.1:1"])


@pytest.mark.parametrize("url", ["127.0.0.1:8100", "http://", "ftp://host", ""])
def test_a_server_that_is_no_base_url_is_refused_at_start_naming_its_flag(url: str) -> None:
    with pytest.raises(ValueError, match=r"--decode '.*': give a base URL, http://HOST:PORT"):
        PdProxy(["http://127.0.0.1:1"], [url])


def raw_post(proxy: PdProxy, content_length: str, body: bytes = b"") -> tuple[int, str, bool]:
    """POST `body` over a real socket under a declared `Content-Length`, the socket left
    open for more; the status, the error the proxy answered, whether it closes."""
    host, port = proxy.address
    with socket.create_connection((str(host), int(port)), timeout=60) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\n"
            f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        answer = http.client.HTTPResponse(sock)
        answer.begin()
        error = json.loads(answer.read()).get("error", "")
        return answer.status, error, answer.will_close


@pytest.mark.parametrize("declared", [MAX_BODY_BYTES + 1, 1 << 40])
def test_a_body_longer_than_max_body_bytes_is_refused_unread(declared: int) -> None:
    """A client declares a body past the bound and sends nothing more: the proxy answers
    413 at once, naming its bound, and closes (it used to allocate the declared size and
    wait for it, holding a thread, until the client gave up)."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = PdProxy([dead], [dead]).start()
    try:
        status, error, closes = raw_post(proxy, str(declared))
        assert (status, closes) == (413, True)
        assert f"a body of {declared} bytes" in error and f"at most {MAX_BODY_BYTES}" in error
        assert "--max-body-bytes" in error
    finally:
        proxy.close()


def test_max_body_bytes_is_the_largest_body_read() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = PdProxy([dead], [dead], max_body_bytes=64).start()

    def body(n: int) -> bytes:
        raw = json.dumps({"prompt": "", "max_tokens": 4}).encode()
        return raw[:-1] + b" " * (n - len(raw)) + b"}"

    try:
        status, error, _ = raw_post(proxy, "64", body(64))
        assert status == 502 and "the prefill server" in error  # read, and passed on
        assert raw_post(proxy, "65", body(65))[:2] == (
            413,
            "a body of 65 bytes: this proxy reads at most 64 (--max-body-bytes)",
        )
        for declared in ("-1", "12abc"):
            status, error, closes = raw_post(proxy, declared)
            assert (status, closes) == (400, True) and "is not a byte count" in error
        assert raw_post(proxy, "3", b"[1]")[:2] == (400, "the body is not a JSON object")
    finally:
        proxy.close()
    with pytest.raises(ValueError, match="max_body_bytes must be at least 1"):
        PdProxy([dead], [dead], max_body_bytes=0)


def test_the_proxy_command_takes_max_body_bytes() -> None:
    base = ["proxy", "--prefill", "http://p", "--decode", "http://d"]
    assert build_parser().parse_args(base).max_body_bytes is None  # run(): MAX_BODY_BYTES
    assert build_parser().parse_args([*base, "--max-body-bytes", "1024"]).max_body_bytes == 1024


def test_a_client_that_stops_sending_is_answered_408_and_let_go() -> None:
    """A client declares a body and sends part of it (a slow-loris): the proxy waits at
    most `client_timeout_s`, answers 408 naming the bound, and closes; its thread is free
    again (it used to wait on the socket for as long as the client held it open)."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = PdProxy([dead], [dead], client_timeout_s=0.5).start()
    try:
        status, error, closes = raw_post(proxy, "100", b'{"prompt": ')
        assert (status, closes) == (408, True)
        assert error == "the body did not arrive within 0.5 s (--client-timeout-s)"
        with pytest.raises(ValueError, match="client_timeout_s must be above 0"):
            PdProxy([dead], [dead], client_timeout_s=0)
    finally:
        proxy.close()


def test_a_connection_left_idle_is_closed_by_the_proxy() -> None:
    """A client that connects and sends nothing holds no thread past `client_timeout_s`."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = PdProxy([dead], [dead], client_timeout_s=0.5).start()
    host, port = proxy.address
    try:
        with socket.create_connection((str(host), int(port)), timeout=60) as sock:
            assert sock.recv(1) == b""  # the proxy closed it (recv would wait 60 s, then raise)
    finally:
        proxy.close()


def test_the_proxy_command_takes_client_timeout_s() -> None:
    base = ["proxy", "--prefill", "http://p", "--decode", "http://d"]
    assert build_parser().parse_args(base).client_timeout_s is None  # run(): CLIENT_TIMEOUT_S
    assert build_parser().parse_args([*base, "--client-timeout-s", "5"]).client_timeout_s == 5.0


def test_the_proxy_command_takes_max_clients_and_request_timeout_s() -> None:
    base = ["proxy", "--prefill", "http://p", "--decode", "http://d"]
    args = build_parser().parse_args(base)
    assert args.max_clients is None and args.request_timeout_s is None  # run(): the defaults
    args = build_parser().parse_args([*base, "--max-clients", "8", "--request-timeout-s", "2.5"])
    assert (args.max_clients, args.request_timeout_s) == (8, 2.5)
    assert (MAX_CLIENTS, REQUEST_TIMEOUT_S) == (1024, 60.0)


def test_the_proxy_command_takes_stream() -> None:
    base = ["proxy", "--prefill", "http://p", "--decode", "http://d"]
    assert build_parser().parse_args(base).stream is False
    assert build_parser().parse_args([*base, "--stream"]).stream is True
    # the proxy names kvflow's entries itself (it imports nothing of kvflow's P/D)
    assert (proxy_keys.PD_KEY, proxy_keys.OFFER_KEY, proxy_keys.STREAM_KEY) == (
        params.KEY, params.OFFER_KEY, params.STREAM_KEY,
    )  # fmt: skip


def test_a_streaming_proxy_streams_only_to_a_prefill_server_whose_workers_it_learned() -> None:
    """What a prefill server's answer said of its workers, and what it did not: another
    connector's params, several KV cache groups, an answer that failed, oversized."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = PdProxy([dead], [dead], stream=True)
    try:
        assert proxy.producer(dead) == []
        proxy.learn(dead, {"kvflow": {"addresses": ["tcp://127.0.0.1:5555"]}})
        assert proxy.producer(dead) == ["tcp://127.0.0.1:5555"]
        for said in (
            None,
            {"remote_host": "x"},
            {"kvflow": [{"addresses": ["a"]}]},
            {"kvflow": {"addresses": ["a" * 300]}},
            {"kvflow": {"addresses": []}},
        ):
            proxy.learn(dead, {"kvflow": {"addresses": ["tcp://127.0.0.1:5555"]}})
            proxy.learn(dead, said)
            assert proxy.producer(dead) == [], said  # fmt: skip
        plain = PdProxy([dead], [dead])  # not streaming: learns nothing
        plain.learn(dead, {"kvflow": {"addresses": ["tcp://127.0.0.1:5555"]}})
        assert plain.producer(dead) == []
        plain.close()
    finally:
        proxy.close()


def test_the_proxy_command_routes_over_servers_and_says_what_is_missing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--server` instead of `--prefill`/`--decode` (issue 52); `--route prefix` needs each
    server's KV event endpoint, and the command says so before it serves."""
    args = build_parser().parse_args(["proxy", "--server", "http://a", "http://b"])
    assert (args.route, args.kv_events, args.max_skew) == ("round-robin", [], None)
    args = build_parser().parse_args(
        ["proxy", "--server", "http://a", "http://b", "--route", "prefix", "--port", "0"]
    )
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "--route prefix needs --kv-events for each server it chooses among" in err
    assert "2 servers, 0 --kv-events" in err
    args.kv_events = ["tcp://127.0.0.1:1", "http://b"]
    assert run(args) == 2
    assert "give ENDPOINT or ENDPOINT,REPLAY_ENDPOINT" in capsys.readouterr().err
    args.prefill = ["http://p"]
    assert run(args) == 2
    assert "not both" in capsys.readouterr().err


def test_a_proxy_that_cannot_serve_says_why_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """What stops the proxy's loop as it starts (here: its router's tasks) is raised by
    `start`, not left in a thread while `start` returns a proxy that serves nothing."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = PdProxy([], [], servers=[dead], route="least-loaded")
    assert proxy.routing is not None

    async def broken(*args: object, **kwargs: object) -> None:
        raise OSError("no events for you")

    monkeypatch.setattr(proxy.routing, "run", broken)
    with pytest.raises(RuntimeError, match=r"kvflow proxy did not start: .*no events for you"):
        proxy.start()
    proxy.close()
