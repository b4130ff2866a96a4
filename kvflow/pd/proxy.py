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

Nothing here is kvflow-specific: it drives any connector that follows the
convention. It imports no vLLM.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "CLIENT_TIMEOUT_S",
    "MAX_BODY_BYTES",
    "PREFILL_PARAMS",
    "PdProxy",
    "open_post",
    "prefill_request",
]

log = logging.getLogger("kvflow.proxy")

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
MAX_BODY_BYTES = 32 << 20
"""The longest request body the proxy reads by default (a long prompt as token ids in
JSON is a few MiB); a longer one is answered 413 before any of it is read."""
CLIENT_TIMEOUT_S = 60.0
"""How long the proxy waits on a silent client by default (`--client-timeout-s`)."""


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
    ) -> None:
        if not prefill or not decode:
            raise ValueError("a P/D proxy needs at least one prefill and one decode server")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, not {max_body_bytes}")
        if not client_timeout_s > 0:
            raise ValueError(f"client_timeout_s must be above 0, not {client_timeout_s}")
        self.client_timeout_s = client_timeout_s
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self._prefill = itertools.cycle([u.rstrip("/") for u in prefill])
        self._decode = itertools.cycle([u.rstrip("/") for u in decode])
        self._next_lock = threading.Lock()
        self.httpd = _Server((host, port), self._handler())
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> PdProxy:
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _servers(self) -> tuple[str, str]:
        with self._next_lock:
            return next(self._prefill), next(self._decode)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        # `timeout`: every wait on the client's socket (StreamRequestHandler's)
        return type("Handler", (_Handler,), {"proxy": self, "timeout": self.client_timeout_s})


class _Handler(BaseHTTPRequestHandler):
    """One client connection: a completion request goes to a prefill server, then to a
    decode server with the prefill's `kv_transfer_params`, streamed back."""

    proxy: PdProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)

    def do_POST(self) -> None:
        if self.path not in PATHS:
            self._reply(404, {"error": f"the proxy serves {', '.join(PATHS)}"})
            return
        body = self._body()
        if body is None:
            return
        prefill, decode = self.proxy._servers()
        answer = self._upstream("prefill", prefill, prefill_request(body))
        if answer is None:
            return
        with answer:
            body["kv_transfer_params"] = json.loads(answer.read()).get("kv_transfer_params")
        upstream = self._upstream("decode", decode, body)
        if upstream is None:
            return
        with upstream:  # closing it early (client gone) makes vLLM abort the request
            self.send_response(upstream.status)
            self.send_header("Content-Type", upstream.headers.get("Content-Type", ""))
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for chunk in _chunks(upstream):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                log.info("kvflow proxy: client went away; aborting the decode request")

    def _body(self) -> dict[str, Any] | None:
        """The request's JSON object, read only if its declared length is within
        bounds and within `client_timeout_s`; None once the client was answered (400,
        408, 413)."""
        declared = self.headers.get("Content-Length", "0")
        try:
            size = int(declared)
        except ValueError:
            size = -1
        if size < 0:
            error = f"Content-Length {declared[:40]!r} is not a byte count"
            self._reply(400, {"error": error}, close=True)
            return None
        if size > self.proxy.max_body_bytes:
            limit = f"at most {self.proxy.max_body_bytes} (--max-body-bytes)"
            error = f"a body of {size} bytes: this proxy reads {limit}"
            self._reply(413, {"error": error}, close=True)
            return None
        try:
            body = json.loads(self.rfile.read(size))
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

    def _upstream(self, which: str, base: str, body: dict[str, Any]) -> Any:
        """POST `body` to a server; on failure answer the client and return None."""
        try:
            return open_post(base + self.path, body, self.proxy.timeout_s)
        except urllib.error.HTTPError as exc:
            self._reply(exc.code, _error_body(exc, which))
        except OSError as exc:
            self._reply(502, {"error": f"{which} server {base}: {exc}"})
        return None

    def do_GET(self) -> None:
        self._reply(200 if self.path == "/health" else 404, {})

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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    """The listen backlog (socketserver's default is 5: a burst of clients connecting at
    once was reset)."""


def open_post(url: str, body: dict[str, Any], timeout: float) -> Any:
    """POST `body` as JSON; the open response (an `HTTPError` for an error status)."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(req, timeout=timeout)


def _chunks(resp: Any) -> Iterator[bytes]:
    while chunk := resp.read1(1 << 16):
        yield chunk


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
    try:
        proxy = PdProxy(
            args.prefill,
            args.decode,
            args.host,
            args.port,
            max_body_bytes=max_body,
            client_timeout_s=wait,
        )
    except ValueError as exc:
        print(f"kvflow proxy: {exc}", file=sys.stderr)
        return 2
    print(f"kvflow proxy on {proxy.url}: prefill {args.prefill}, decode {args.decode}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        proxy.serve_forever()
    return 0
