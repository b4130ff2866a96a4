"""A prefill/decode proxy that follows vLLM's convention (`kvflow proxy`).

What vLLM's own disaggregation proxies do, with the standard library alone: each
completion request goes first to a prefill server with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": true, ...}` (the other fields vLLM's
proxies send as null), then to a decode server with the
`kv_transfer_params` the prefill returned, as they came. The decode server's
answer (streamed or not) is passed through; a client that disconnects closes the
decode request, which vLLM aborts. Servers are used round robin. A request body
longer than `max_body_bytes` (`--max-body-bytes`, 32 MiB by default) is answered
413 unread; a client silent for `client_timeout_s` (`--client-timeout-s`, 60 s) while
the proxy waits on it (a request line, a body, a read of the answer) is let go, a body
that stops arriving answered 408.

Nothing here is kvflow-specific, but `--stream`: it drives any connector that follows
the convention. It imports no vLLM.

`--server` (instead of `--prefill` and `--decode`): each request goes whole to one of the
servers, chosen by `--route` (`kvflow.route`): `prefix`, the one holding the longest run
of the prompt's leading blocks as its KV events (`--kv-events`) announced them, within a
bound on load (`--max-skew`); `least-loaded`; `round-robin`; `random`. With `--prefill`
and `--decode`, `--route prefix` chooses the prefill server so (`--kv-events`: the
prefill servers') and the decode server by load, another than the prefill server where
there is one. `GET /routes` shows the servers, the index and the latest choices.

`--stream` (kvflow's connector only, decision 93): once a prefill server's answer named
its workers (`kv_transfer_params["kvflow"]["addresses"]`), each request goes to it and to
a decode server at once, the prefill's with `kvflow_offer` (an id the proxy draws), the
decode's with `kvflow_stream` (that id and those workers): the decode server claims the
offer as the request arrives and pulls each layer as the prefill computes it. The
prefill's answer is read in a thread of its own, and the workers it names are learned
again (a restarted server's new ones); one that fails makes the next request to that
server go the convention's way, which learns them anew.

What it takes from a client, which it does not trust (docs/security.md):

- a body framed by exactly one `Content-Length` of ASCII digits (optional whitespace
  around it), nothing else: a request with `Transfer-Encoding` is answered 501, with
  both it and a `Content-Length` 400 (RFC 9112 6.3), with a repeated or malformed length,
  a malformed or folded header line 400, each then closed, so that no byte of a body is
  ever read as the next request; a body on a request that reads none (`GET`, an unknown
  path) is answered, then the connection closed;
- at most `max_clients` connections served at once (`--max-clients`, 1024): one past it
  is answered 503 on the spot and closed, with no thread started for it;
- every request whole within `request_timeout_s` (`--request-timeout-s`, 60 s) of its
  first byte, head and body, however steadily it trickles, else 408 and closed.

Upstream servers are called directly, whatever `HTTP(S)_PROXY` says, and a 502 names
the role that failed (prefill or decode), never its URL, which goes to the log.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import itertools
import json
import logging
import secrets
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvflow.route.router import MAX_SKEW, Router
from kvflow.route.service import Routing

__all__ = [
    "CLIENT_TIMEOUT_S",
    "MAX_BODY_BYTES",
    "MAX_CLIENTS",
    "PREFILL_PARAMS",
    "REQUEST_TIMEOUT_S",
    "PdProxy",
    "open_post",
    "prefill_request",
]

log = logging.getLogger("kvflow.proxy")

PD_KEY, OFFER_KEY, STREAM_KEY = "kvflow", "kvflow_offer", "kvflow_stream"
"""kvflow's entries in `kv_transfer_params` (`kvflow.pd.params`: not imported, so that
the proxy runs on the standard library alone)."""

PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What vLLM's proxies put in the prefill request's `kv_transfer_params`."""

PATHS = ("/v1/completions", "/v1/chat/completions")
_ANSWERED = object()
"""A prefill that failed: its client was answered (`_Handler._prefilled`)."""
KEPT_ANSWER_BYTES = 1 << 20
"""A routed answer this long or shorter, not streamed, is read for its `usage` (the prompt
tokens the server served from its cache, against what the router predicted)."""
MAX_BODY_BYTES = 32 << 20
"""The longest request body the proxy reads by default (a long prompt as token ids in
JSON is a few MiB); a longer one is answered 413 before any of it is read."""
CLIENT_TIMEOUT_S = 60.0
"""How long the proxy waits on a silent client by default (`--client-timeout-s`)."""
MAX_CLIENTS = 1024
"""How many client connections the proxy serves at once by default (`--max-clients`), a
thread each: vLLM's default batch (`max_num_seqs`) on a GPU of 70 GiB or more (256 on a
smaller one), so that the bound never starves one decode server of its batch."""
REQUEST_TIMEOUT_S = 60.0
"""How long one request may take to arrive, head and body, by default
(`--request-timeout-s`): a body of `MAX_BODY_BYTES` needs 0.6 MB/s, a typical request of a
few KiB is sent in milliseconds."""


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's copy of a client request: one token, no stream."""
    pre = dict(body, max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_PARAMS))
    pre.pop("stream_options", None)
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    return pre


class PdProxy:
    """`prefill` and `decode` are base URLs (`http://127.0.0.1:8100`)."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 600.0,
        max_body_bytes: int = MAX_BODY_BYTES,
        client_timeout_s: float = CLIENT_TIMEOUT_S,
        max_clients: int = MAX_CLIENTS,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        stream: bool = False,
        servers: Sequence[str] = (),
        route: str = "round-robin",
        kv_events: Sequence[str] = (),
        max_skew: int = MAX_SKEW,
    ) -> None:
        if servers and (prefill or decode):
            raise ValueError("give --server (whole requests) or --prefill and --decode, not both")
        if not servers and (not prefill or not decode):
            raise ValueError("a P/D proxy needs at least one prefill and one decode server")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, not {max_body_bytes}")
        if not client_timeout_s > 0:
            raise ValueError(f"client_timeout_s must be above 0, not {client_timeout_s}")
        if max_clients < 1:
            raise ValueError(f"max_clients must be at least 1, not {max_clients}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be above 0, not {request_timeout_s}")
        self.client_timeout_s = client_timeout_s
        self.request_timeout_s = request_timeout_s
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self._prefill = itertools.cycle([u.rstrip("/") for u in prefill])
        self._decode = itertools.cycle([u.rstrip("/") for u in decode])
        self._next_lock = threading.Lock()
        self.stream = stream
        self._producers: dict[str, list[str]] = {}
        """Streaming: a prefill server's workers, from its latest answer (under the lock)."""
        self.routing: Routing | None = None
        """With `servers`: which one serves each request (`kvflow.route`); P/D under
        another route than round robin: which prefill server."""
        self.decode_load: Router | None = None
        """P/D under another route than round robin: which decode server (by load, under
        `prefix`; at random under `random`)."""
        if servers:
            urls = [u.rstrip("/") for u in servers]
            self.routing = Routing(urls, route, kv_events, open_post, open_get, max_skew)
        elif route != "round-robin":
            pre = [u.rstrip("/") for u in prefill]
            self.routing = Routing(pre, route, kv_events, open_post, open_get, max_skew)
            policy = "least-loaded" if route == "prefix" else route
            self.decode_load = Router([u.rstrip("/") for u in decode], policy, max_skew=max_skew)
        self.httpd = _Server((host, port), self._handler(), max_clients)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> PdProxy:
        """Serve in a background thread."""
        if self.routing is not None:
            self.routing.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        if self.routing is not None:
            self.routing.start()
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self.routing is not None:
            self.routing.close()

    def _servers(self) -> tuple[str, str]:
        with self._next_lock:
            return next(self._prefill), next(self._decode)

    def producer(self, prefill: str) -> list[str]:
        """Streaming: the workers of `prefill` to claim a request's offer at ([] unknown)."""
        with self._next_lock:
            return self._producers.get(prefill, [])

    def learn(self, prefill: str, params: Any) -> None:
        """Streaming: what `prefill`'s latest answer says of its workers (nothing usable:
        forget them, and its next request goes the convention's way)."""
        if not self.stream:
            return
        entry = params.get(PD_KEY) if isinstance(params, dict) else None
        found = entry.get("addresses") if isinstance(entry, dict) else None
        ok = isinstance(found, list) and 0 < len(found) <= 1024
        ok = ok and all(isinstance(a, str) and len(a) <= 256 for a in found or ())
        with self._next_lock:
            if ok:
                self._producers[prefill] = list(found or ())
            else:  # another connector, several KV cache groups, an error
                self._producers.pop(prefill, None)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        # `timeout`: every wait on the client's socket (StreamRequestHandler's)
        return type("Handler", (_Handler,), {"proxy": self, "timeout": self.client_timeout_s})


class _Handler(BaseHTTPRequestHandler):
    """One client connection: a completion request goes to a prefill server, then to a
    decode server with the prefill's `kv_transfer_params`, streamed back."""

    proxy: PdProxy
    protocol_version = "HTTP/1.1"
    _reader: _ClientReader
    _length = 0
    """The request body's declared length, checked (`parse_request`)."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own file: read through the deadline instead
        self._reader = _ClientReader(self.connection, self.proxy.client_timeout_s)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        """One request, which must arrive whole within `request_timeout_s` of its first
        byte (a 408 otherwise)."""
        self._reader.start(self.proxy.request_timeout_s)
        self.requestline, self.request_version, self._length = "", "HTTP/1.1", 0
        try:
            super().handle_one_request()
        except _RequestDeadline:
            limit = f"{self.proxy.request_timeout_s:g} s (--request-timeout-s)"
            error = f"the request did not arrive within {limit}"
            self.close_connection = True
            with contextlib.suppress(OSError):  # a client gone too
                self._reply(408, {"error": error}, close=True)

    def parse_request(self) -> bool:
        """The request line and headers, and the body's framing (`_framing`): a request
        framed in any other way is answered and its connection closed."""
        if not super().parse_request():
            return False
        framing = _framing(self.headers, self.proxy.max_body_bytes)
        if isinstance(framing, int):
            self._length = framing
            return True
        self._reply(*framing, close=True)
        return False

    def do_POST(self) -> None:
        if self.path not in PATHS:
            paths = {"error": f"the proxy serves {', '.join(PATHS)}"}
            self._reply(404, paths, close=self._length > 0)  # a body left unread
            return
        body = self._body()
        if body is None:
            return
        routing, decoding = self.proxy.routing, self.proxy.decode_load
        if routing is not None and decoding is None:
            self._routed(routing, body)
        elif routing is None or decoding is None:
            self._pd(body, *self.proxy._servers(), None)
        else:
            prefill = routing.choose(self.path, body).server
            decode = decoding.choose(avoid=prefill).server
            try:
                self._pd(body, prefill, decode, routing)
            finally:
                decoding.done(decode)

    def _pd(self, body: dict[str, Any], prefill: str, decode: str, routing: Routing | None) -> None:
        """`body` prefilled by `prefill`, then decoded by `decode`; `routing` (what chose
        the prefill server) is told once the prefill's part ended."""
        if workers := self.proxy.producer(prefill):
            offer = secrets.token_hex(16)
            pre = prefill_request(body)
            pre["kv_transfer_params"][OFFER_KEY] = offer
            args = (prefill, pre, routing)
            threading.Thread(target=self._prefill, args=args, daemon=True).start()
            body["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                STREAM_KEY: {"offer": offer, "addresses": workers},
            }
        else:
            try:
                params = self._prefilled(prefill, body, routing)
            finally:
                if routing is not None:
                    routing.done(prefill)
            if params is _ANSWERED:
                return
            body["kv_transfer_params"] = params  # None too: the decode server computes it
        upstream = self._upstream("decode", decode, body)
        if upstream is not None:
            self._relay(upstream)

    def _prefilled(self, prefill: str, body: dict[str, Any], routing: Routing | None) -> Any:
        """The prefill server's `kv_transfer_params` for `body` (None where it gave none:
        the decode server then computes the prompt); `_ANSWERED` once the client was
        answered instead (the server failed)."""
        unreachable = None if routing is None else (lambda: routing.failed(prefill))
        answer = self._upstream("prefill", prefill, prefill_request(body), unreachable)
        if answer is None:
            return _ANSWERED
        with answer:
            try:
                params = json.loads(answer.read()).get("kv_transfer_params")
            except (OSError, http.client.HTTPException, ValueError, AttributeError) as exc:
                log.warning("kvflow proxy: the prefill server %s answered: %s", prefill, exc)
                error = f"the prefill server's answer could not be read ({type(exc).__name__})"
                self._reply(502, {"error": error})
                return _ANSWERED
        self.proxy.learn(prefill, params)
        return params

    def _routed(self, routing: Routing, body: dict[str, Any]) -> None:
        """A request to the server `routing` chooses, its answer relayed."""
        server = routing.choose(self.path, body).server
        answer = None
        try:
            upstream = self._upstream("chosen", server, body, lambda: routing.failed(server))
            if upstream is not None:
                answer = self._relay(upstream)
        finally:
            routing.done(server, answer)

    def _relay(self, upstream: Any) -> bytes | None:
        """The upstream server's answer, as it comes; its bytes where it was one JSON
        document (not a stream) of at most `KEPT_ANSWER_BYTES`, else None."""
        kind = upstream.headers.get("Content-Type", "")
        kept: bytearray | None = bytearray() if kind.startswith("application/json") else None
        with upstream:  # closing it early (client gone) makes vLLM abort the request
            self.send_response(upstream.status)
            self.send_header("Content-Type", kind)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for chunk in _chunks(upstream):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                    if kept is not None and len(kept) + len(chunk) <= KEPT_ANSWER_BYTES:
                        kept += chunk
                    else:
                        kept = None
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                log.info("kvflow proxy: client went away; aborting the upstream request")
                return None
        return None if kept is None else bytes(kept)

    def _prefill(self, prefill: str, body: dict[str, Any], routing: Routing | None) -> None:
        """Streaming: the prefill of a request sent to its decode server meanwhile. Its
        failure is the decode server's to find (the claim goes unanswered: it computes
        the prompt); the server's workers are learned again from its answer."""
        params: Any = None
        try:
            with open_post(prefill + self.path, body, self.proxy.timeout_s) as answer:
                params = json.loads(answer.read()).get("kv_transfer_params")
        except (OSError, http.client.HTTPException, ValueError, AttributeError) as exc:
            log.warning("kvflow proxy: the prefill server %s (streamed): %s", prefill, exc)
        finally:
            if routing is not None:
                routing.done(prefill)
        self.proxy.learn(prefill, params)

    def _body(self) -> dict[str, Any] | None:
        """The request's JSON object, of its checked length (`_framing`), read within
        `client_timeout_s` of each byte (and `request_timeout_s` of the first); None once
        the client was answered (400, 408)."""
        try:
            body = json.loads(self.rfile.read(self._length))
        except TimeoutError:
            limit = f"{self.proxy.client_timeout_s:g} s (--client-timeout-s)"
            self._reply(408, {"error": f"the body did not arrive within {limit}"}, close=True)
            return None
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._reply(400, {"error": "the body is not a JSON object"})
            return None
        return body

    def _upstream(
        self, which: str, base: str, body: dict[str, Any], unreachable: Any = None
    ) -> Any:
        """POST `body` to a server; on failure answer the client and return None (and
        call `unreachable()` if the server could not be reached at all)."""
        try:
            return open_post(base + self.path, body, self.proxy.timeout_s)
        except urllib.error.HTTPError as exc:
            self._reply(exc.code, _error_body(exc, which))
        except OSError as exc:  # the URL to the log, not to the client (internal addresses)
            if unreachable is not None:
                unreachable()
            log.warning("kvflow proxy: the %s server %s could not be reached: %s", which, base, exc)
            error = f"the {which} server could not be reached ({_reason(exc)})"
            self._reply(502, {"error": error})
        return None

    def do_GET(self) -> None:
        if self.path == "/routes" and self.proxy.routing is not None:
            view = self.proxy.routing.view()
            if self.proxy.decode_load is not None:  # P/D: `view` is the prefill servers'
                view["decode"] = self.proxy.decode_load.view()
            self._reply(200, view, close=self._length > 0)
            return
        if self.path == "/metrics" and self.proxy.routing is not None:
            data = self.proxy.routing.metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        code = 200 if self.path == "/health" else 404
        self._reply(code, {}, close=self._length > 0)  # a body left unread

    def _reply(self, code: int, payload: dict[str, Any], close: bool = False) -> None:
        """Answer `payload`; `close`: and close the connection (a body left unread)."""
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)


def _framing(headers: Message, max_body_bytes: int) -> int | tuple[int, dict[str, Any]]:
    """The length of a request's body, or the status and answer that refuse the request:
    one `Content-Length` of ASCII digits (RFC 9112 6.3; Python's int() would also read
    '0_2', '+2', Unicode digits and spaces) within `max_body_bytes`, no
    `Transfer-Encoding`, no header line the parser dropped or folded."""

    def refuse(code: int, error: str) -> tuple[int, dict[str, Any]]:
        return code, {"error": error}

    if headers.defects:  # a line with whitespace before its colon, or none: it and the rest dropped
        return refuse(400, "a malformed header line (RFC 9112 5.1)")
    if any("\n" in value for value in headers.values()):
        return refuse(400, "a folded header line (obs-fold, RFC 9112 5.2)")
    lengths = headers.get_all("Content-Length") or []
    if headers.get_all("Transfer-Encoding"):
        if lengths:
            both = "both Transfer-Encoding and Content-Length (RFC 9112 6.3)"
            return refuse(400, f"a request with {both}")
        return refuse(501, "Transfer-Encoding is not supported: send one Content-Length")
    if not lengths:
        return 0
    if len(lengths) > 1:
        return refuse(400, f"one Content-Length header, not {len(lengths)}")
    declared = lengths[0].strip(" \t")
    if not (declared.isascii() and declared.isdigit()):
        return refuse(400, f"Content-Length {lengths[0][:40]!r} is not a byte count")
    digits = declared.lstrip("0") or "0"
    if len(digits) > len(str(max_body_bytes)) or int(digits) > max_body_bytes:
        shown = digits if len(digits) <= 40 else f"{digits[:40]}..."
        limit = f"at most {max_body_bytes} (--max-body-bytes)"
        return refuse(413, f"a body of {shown} bytes: this proxy reads {limit}")
    return int(digits)


class _RequestDeadline(Exception):
    """A request still arriving at `request_timeout_s`."""


class _ClientReader(io.RawIOBase):
    """A client's socket as the handler reads it: each wait at most `wait_s`
    (`client_timeout_s`) and, from a request's first byte, all of it within the
    deadline `start` set (`_RequestDeadline` past it). Writes wait `wait_s` as before."""

    def __init__(self, sock: socket.socket, wait_s: float) -> None:
        self._sock = sock
        self._wait_s = wait_s
        self._request_s = 0.0
        self._deadline: float | None = None

    def readable(self) -> bool:
        return True

    def start(self, request_s: float) -> None:
        """A new request: its deadline starts at its first byte (an idle connection
        waits `wait_s`)."""
        self._request_s = request_s
        self._deadline = None

    def readinto(self, buffer: Any) -> int:
        wait = self._wait_s
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise _RequestDeadline
            wait = min(wait, left)
        self._sock.settimeout(wait)
        try:
            n = self._sock.recv_into(buffer)
        except TimeoutError:
            if self._deadline is not None and time.monotonic() >= self._deadline:
                raise _RequestDeadline from None
            raise
        finally:
            self._sock.settimeout(self._wait_s)
        if n and self._deadline is None:
            self._deadline = time.monotonic() + self._request_s
        return n


class _Server(ThreadingHTTPServer):
    """A thread per client connection, at most `max_clients` of them: one past it is
    answered 503 by the listening thread, which neither waits on it nor starts a thread."""

    daemon_threads = True
    request_queue_size = 1024
    """The listen backlog (socketserver's default is 5: a burst of clients connecting at
    once was reset)."""

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_clients: int
    ) -> None:
        self.max_clients = max_clients
        self._slots = threading.BoundedSemaphore(max_clients)
        self._refused = 0
        self._warned = -1e9
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # a thread, which releases
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._slots.release()  # before the close: a client that sees it finds the slot
            self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets or breaks its connection costs a debug line, not a
        traceback on stderr (socketserver's default)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("kvflow proxy: client %s: %r", client_address, exc)
        else:
            super().handle_error(request, client_address)

    def _refuse(self, request: socket.socket) -> None:
        error = f"the proxy is serving {self.max_clients} clients (--max-clients): retry later"
        data = json.dumps({"error": error}).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(OSError):
            request.setblocking(False)  # a few hundred bytes fit any fresh socket's buffer
            with contextlib.suppress(BlockingIOError):  # unread, they would reset the answer
                request.recv(1 << 16)
            request.send(head.encode() + data)
        self.shutdown_request(request)
        self._refused += 1
        now = time.monotonic()
        if now - self._warned >= 10:  # a flood of refusals is a line every 10 s
            log.warning("kvflow proxy: %d client(s) refused 503 (--max-clients)", self._refused)
            self._warned, self._refused = now, 0


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""urllib's opener without proxies: upstream servers are called directly (the default
opener follows `HTTP(S)_PROXY`, which would send every prompt through the proxy named
there)."""


def open_post(url: str, body: dict[str, Any], timeout: float) -> Any:
    """POST `body` as JSON, directly whatever the environment's proxy settings; the open
    response (an `HTTPError` for an error status)."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return _DIRECT.open(req, timeout=timeout)


def open_get(url: str, timeout: float) -> Any:
    """GET `url`, directly as `open_post` does; the open response."""
    return _DIRECT.open(url, timeout=timeout)


def _chunks(resp: Any) -> Iterator[bytes]:
    while chunk := resp.read1(1 << 16):
        yield chunk


def _reason(exc: OSError) -> str:
    """What went wrong calling a server, with no address in it: the error's kind."""
    reason = getattr(exc, "reason", None)  # a URLError wraps the socket's error
    return type(reason if isinstance(reason, BaseException) else exc).__name__


def _error_body(exc: urllib.error.HTTPError, which: str) -> dict[str, Any]:
    try:
        payload: dict[str, Any] = json.loads(exc.read())
    except ValueError:
        payload = {"error": str(exc)}
    payload.setdefault("kvflow_proxy", f"the {which} server answered {exc.code}")
    return payload


def run(args: Any) -> int:
    max_body = MAX_BODY_BYTES if args.max_body_bytes is None else args.max_body_bytes
    wait = CLIENT_TIMEOUT_S if args.client_timeout_s is None else args.client_timeout_s
    clients = MAX_CLIENTS if args.max_clients is None else args.max_clients
    deadline = REQUEST_TIMEOUT_S if args.request_timeout_s is None else args.request_timeout_s
    try:
        proxy = PdProxy(
            args.prefill,
            args.decode,
            args.host,
            args.port,
            max_body_bytes=max_body,
            client_timeout_s=wait,
            max_clients=clients,
            request_timeout_s=deadline,
            stream=args.stream,
            servers=args.server,
            route=args.route,
            kv_events=args.kv_events,
            max_skew=MAX_SKEW if args.max_skew is None else args.max_skew,
        )
    except ValueError as exc:
        print(f"kvflow proxy: {exc}", file=sys.stderr)
        return 2
    if args.server:
        print(f"kvflow proxy on {proxy.url}: {args.route} over {args.server}", flush=True)
    else:
        print(
            f"kvflow proxy on {proxy.url}: prefill {args.prefill}, decode {args.decode}", flush=True
        )
    with contextlib.suppress(KeyboardInterrupt):
        proxy.serve_forever()
    return 0
