"""kvflow proxy on its async stack (issue 52 item 5, decision 103): a client that goes
away aborts the server's request at whatever stage it is, many slow requests are served
at once, and a streamed answer reaches the client as it is made.

Real sockets: a real `PdProxy` in front of a standard-library HTTP server that holds its
answers until the test lets them go.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvflow.pd.proxy import PdProxy

WAIT_S = 30.0
"""The longest any one wait of a test lasts (never reached when the proxy behaves)."""


class _Held(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512
    hold: str = ""
    """The stage whose request waits for its client to go away ("prefill", "decode")."""
    barrier: threading.Barrier | None = None
    """Decode requests answer once this many of them are held at once."""
    arrived: threading.Event
    aborted: threading.Event
    go: threading.Event
    """A streamed decode answer's second event waits for this."""
    drop: bool = False
    """Close each connection after its answer, without saying so (as a server does with a
    connection idle past its keep-alive timeout)."""
    peers: list[int]
    """The client port of each request: one per connection the proxy opened."""


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Held

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.peers.append(self.client_address[1])
        self.close_connection = self.server.drop
        prefill = bool((body.get("kv_transfer_params") or {}).get("do_remote_decode"))
        if self.server.hold == ("prefill" if prefill else "decode"):
            self.server.arrived.set()
            self.connection.settimeout(WAIT_S)
            with contextlib.suppress(OSError):
                if self.connection.recv(1) == b"":  # the proxy closed its request
                    self.server.aborted.set()
            self.close_connection = True
            return
        if prefill:
            self._answer(json.dumps({"kv_transfer_params": {"offer": "o1"}}).encode())
        elif body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"data: 1\n\n")
            self.wfile.flush()
            self.server.go.wait(WAIT_S)
            self.wfile.write(b"data: 2\n\n")
            self.close_connection = True
        else:
            if self.server.barrier is not None:
                self.server.barrier.wait(WAIT_S)
            self._answer(json.dumps({"choices": [{"text": "decoded"}]}).encode())

    def _answer(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def held(options: dict[str, Any] | None = None, **setting: Any) -> Iterator[tuple[_Held, PdProxy]]:
    """An upstream server (prefill and decode) set up as `setting` says, and a proxy
    (with `options`)."""
    options = options or {}
    server = _Held(("127.0.0.1", 0), _Upstream)
    server.arrived, server.aborted, server.go = (threading.Event() for _ in range(3))
    server.peers = []
    for name, value in setting.items():
        setattr(server, name, value)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    proxy = PdProxy([url], [url], **options).start()
    try:
        yield server, proxy
    finally:
        proxy.close()
        server.shutdown()
        server.server_close()


def send(proxy: PdProxy, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(proxy.address, timeout=WAIT_S)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    return sock


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_a_client_that_goes_away_aborts_the_servers_request(stage: str) -> None:
    """The client closes its connection while a server works on its request (no answer
    written yet): the proxy closes that request at once, which makes vLLM abort it. The
    thread-per-client proxy noticed a client gone only when it wrote the answer, so the
    server worked on to the end (here: held forever)."""
    with held(hold=stage) as (server, proxy):
        sock = send(proxy, {"prompt": "hi", "max_tokens": 4})
        assert server.arrived.wait(WAIT_S), f"the {stage} request never arrived"
        sock.close()
        assert server.aborted.wait(WAIT_S), f"the {stage} request was not closed"


def test_many_slow_requests_are_served_at_once() -> None:
    """160 clients whose decode answers wait until all 160 are held together: served
    only if the proxy has them all under way at once, each with its own connection to
    the server (a pool bounded below 160, as httpx's is at 100 by default, would hold
    the rest back, and the barrier would never open)."""
    n = 160
    with held(barrier=threading.Barrier(n)) as (_, proxy):

        def ask(_: int) -> str:
            req = urllib.request.Request(
                proxy.url + "/v1/completions", b'{"prompt": "hi"}', {"Content-Type": "x"}
            )
            with urllib.request.urlopen(req, timeout=2 * WAIT_S) as answer:
                return str(json.loads(answer.read())["choices"][0]["text"])

        with ThreadPoolExecutor(n) as ex:
            assert list(ex.map(ask, range(n))) == ["decoded"] * n


def test_a_streamed_answer_reaches_the_client_as_it_is_made() -> None:
    """The decode server's first event reaches the client while the server still holds
    the second (an answer read whole before relaying would hold both)."""
    with held() as (server, proxy):
        conn = http.client.HTTPConnection(*proxy.address, timeout=WAIT_S)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "stream": True}))
        answer = conn.getresponse()
        assert answer.status == 200 and answer.getheader("Content-Type") == "text/event-stream"
        assert answer.read1() == b"data: 1\n\n"
        server.go.set()
        assert answer.read() == b"data: 2\n\n"
        conn.close()


def complete(proxy: PdProxy) -> str:
    req = urllib.request.Request(proxy.url + "/v1/completions", b'{"prompt": "hi"}')
    with urllib.request.urlopen(req, timeout=WAIT_S) as answer:
        return str(json.loads(answer.read())["choices"][0]["text"])


def test_connections_to_a_server_are_kept_alive() -> None:
    """Ten P/D requests one after another: twenty calls to the server, over one
    connection (urllib opened one a call)."""
    with held() as (server, proxy):
        assert [complete(proxy) for _ in range(10)] == ["decoded"] * 10
    assert len(server.peers) == 20 and len(set(server.peers)) == 1, server.peers


def test_a_kept_connection_the_server_closed_is_not_used_again() -> None:
    """The server closes every connection once it answered, without saying so: each call
    still succeeds, on a new connection (a kept one it closed is dropped, or the call
    sent once more)."""
    with held(drop=True) as (server, proxy):
        assert [complete(proxy) for _ in range(10)] == ["decoded"] * 10
    assert len(set(server.peers)) == 20


def test_servers_behind_https_are_called_over_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `https://` server, its certificate checked against the trusted ones
    (`SSL_CERT_FILE` here: a certificate made for the test)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    server = _Held(("127.0.0.1", 0), _Upstream)
    server.peers = []
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{server.server_address[1]}"
    proxy = PdProxy([url], [url]).start()
    try:
        assert complete(proxy) == "decoded" and len(server.peers) == 2
    finally:
        proxy.close()
        server.shutdown()
        server.server_close()


def test_a_server_at_an_ipv6_address_is_called_with_its_host_in_brackets() -> None:
    """`http://[::1]:PORT`: the `Host` header a server checks is `[::1]:PORT`."""

    class _Held6(_Held):
        address_family = socket.AF_INET6

    try:
        server = _Held6(("::1", 0), _Upstream)
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    server.peers, hosts = [], []
    handle = _Upstream.do_POST

    def seen(self: _Upstream) -> None:
        hosts.append(self.headers["Host"])
        handle(self)

    server.RequestHandlerClass = type("_Seen", (_Upstream,), {"do_POST": seen})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://[::1]:{server.server_address[1]}"
    proxy = PdProxy([url], [url]).start()
    try:
        assert complete(proxy) == "decoded"
    finally:
        proxy.close()
        server.shutdown()
        server.server_close()
    assert hosts == [f"[::1]:{server.server_address[1]}"] * 2


def test_a_server_that_does_not_answer_in_time_is_asked_once() -> None:
    """A kept connection whose server does not answer within the proxy's timeout: a 502
    naming the timeout, and the request was sent once (a retry would send the server a
    POST it is working on a second time)."""
    with held({"timeout_s": 1.0}) as (server, proxy):
        assert complete(proxy) == "decoded"  # its connection kept
        server.hold = "prefill"
        with pytest.raises(urllib.error.HTTPError) as err:
            complete(proxy)
        assert err.value.code == 502
        assert "the prefill server could not be reached (TimeoutError)" in err.value.read().decode()
        assert server.aborted.wait(WAIT_S)
    assert len(server.peers) == 3  # prefill, decode, and the held prefill once
