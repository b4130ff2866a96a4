"""A prefill/decode proxy that follows vLLM's convention (`kvflow proxy`).

What vLLM's own disaggregation proxies do: each completion request goes first to a
prefill server with `max_tokens=1` and `kv_transfer_params={"do_remote_decode": true,
...}` (the other fields vLLM's proxies send as null), then to a decode server with the
`kv_transfer_params` the prefill returned, as they came. The decode server's answer
(streamed or not) is passed through; a client that disconnects closes the decode
request, which vLLM aborts. Servers are used round robin. A request body longer than
`max_body_bytes` (`--max-body-bytes`, 32 MiB by default) is answered 413 unread; a
client silent for `client_timeout_s` (`--client-timeout-s`, 60 s) while the proxy waits
on it (a request line, a body, a read of the answer) is let go, a body that stops
arriving answered 408.

Nothing here is kvflow-specific, but `--stream`: it drives any connector that follows
the convention. It imports no vLLM.

`--server` (instead of `--prefill` and `--decode`): each request goes whole to one of the
servers, chosen by `--route` (`kvflow.route`): `prefix`, the one with the least prompt
work ahead (the prompt's leading blocks it holds, as its KV events (`--kv-events`)
announced them, against the requests it has in flight), within a bound on load
(`--max-skew`); `least-loaded`; `round-robin`; `random`. With `--prefill`
and `--decode`, `--route prefix` chooses the prefill server so (`--kv-events`: the
prefill servers') and the decode server by load, another than the prefill server where
there is one. `GET /routes` shows the servers, the index and the latest choices.

`--stream` (kvflow's connector only, decision 93): once a prefill server's answer named
its workers (`kv_transfer_params["kvflow"]["addresses"]`), each request goes to it and to
a decode server at once, the prefill's with `kvflow_offer` (an id the proxy draws), the
decode's with `kvflow_stream` (that id and those workers): the decode server claims the
offer as the request arrives and pulls each layer as the prefill computes it. The
prefill's answer is read in a task of its own, and the workers it names are learned
again (a restarted server's new ones); one that fails makes the next request to that
server go the convention's way, which learns them anew.

It runs on trio (decision 103): its HTTP is h11's (`kvflow.web`): the server, with the
limits a client it does not trust meets (docs/security.md: `--max-body-bytes`,
`--client-timeout-s`, `--max-clients`, `--request-timeout-s`), and the client that calls
the servers, connections kept alive; a client that goes away cancels its request's
task, which closes the server's request: vLLM aborts it. JSON is msgspec's.

Upstream servers are called directly, whatever `HTTP(S)_PROXY` says, and a 502 names
the role that failed (prefill or decode), never its URL, which goes to the log.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import socket
import sys
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

import msgspec
import trio

from kvflow.route.router import MAX_SKEW, Router
from kvflow.route.service import Routing
from kvflow.web.client import Answer, Client, UpstreamError
from kvflow.web.server import Limits, Reply, Request, serve

__all__ = [
    "CLIENT_TIMEOUT_S",
    "MAX_BODY_BYTES",
    "MAX_CLIENTS",
    "PREFILL_PARAMS",
    "REQUEST_TIMEOUT_S",
    "PdProxy",
    "prefill_request",
]

log = logging.getLogger("kvflow.proxy")

PD_KEY, OFFER_KEY, STREAM_KEY = "kvflow", "kvflow_offer", "kvflow_stream"
"""kvflow's entries in `kv_transfer_params` (`kvflow.pd.params`: not imported, so that
the proxy runs without kvflow's P/D)."""

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
"""A prefill that failed: its client was answered (`PdProxy._prefilled`)."""
KEPT_ANSWER_BYTES = 1 << 20
"""A routed answer this long or shorter, not streamed, is read for its `usage` (the prompt
tokens the server served from its cache, against what the router predicted)."""
KEPT_STREAM_BYTES = 64 << 10
"""The end of a streamed answer kept for its `usage` (its last event where the client
asked for `stream_options.include_usage`)."""
MAX_BODY_BYTES = 32 << 20
"""The longest request body the proxy reads by default (a long prompt as token ids in
JSON is a few MiB); a longer one is answered 413 before any of it is read."""
CLIENT_TIMEOUT_S = 60.0
"""How long the proxy waits on a silent client by default (`--client-timeout-s`)."""
MAX_CLIENTS = 1024
"""How many client connections the proxy serves at once by default (`--max-clients`):
vLLM's default batch (`max_num_seqs`) on a GPU of 70 GiB or more (256 on a
smaller one), so that the bound never starves one decode server of its batch."""
REQUEST_TIMEOUT_S = 60.0
"""How long one request may take to arrive, head and body, by default
(`--request-timeout-s`): a body of `MAX_BODY_BYTES` needs 0.6 MB/s, a typical request of a
few KiB is sent in milliseconds."""


MAX_PREFILL_ANSWER_BYTES = 256 << 20
"""The longest prefill answer read (one token; its prompt logprobs, if asked for)."""


class _Prefilled(msgspec.Struct):
    """What the proxy reads of a prefill's answer (the rest is skipped, never built)."""

    kv_transfer_params: Any = None


_PREFILLED = msgspec.json.Decoder(_Prefilled)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's copy of a client request: one token, no stream."""
    pre = dict(body, max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_PARAMS))
    pre.pop("stream_options", None)
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    return pre


class PdProxy:
    """`prefill` and `decode` are base URLs (`http://127.0.0.1:8100`). The port is bound
    at construction; `start` serves in a thread of its own, `serve_forever` in this one."""

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
        for flag, urls in (("--prefill", prefill), ("--decode", decode), ("--server", servers)):
            for url in urls:
                if not _base_url(url):
                    raise ValueError(f"{flag} {url!r}: give a base URL, http://HOST:PORT")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, not {max_body_bytes}")
        if not client_timeout_s > 0:
            raise ValueError(f"client_timeout_s must be above 0, not {client_timeout_s}")
        if max_clients < 1:
            raise ValueError(f"max_clients must be at least 1, not {max_clients}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be above 0, not {request_timeout_s}")
        self.limits = Limits(max_body_bytes, client_timeout_s, request_timeout_s, max_clients)
        self.timeout_s = timeout_s
        self._prefill = itertools.cycle([u.rstrip("/") for u in prefill])
        self._decode = itertools.cycle([u.rstrip("/") for u in decode])
        self.stream = stream
        self._producers: dict[str, list[str]] = {}
        """Streaming: a prefill server's workers, from its latest answer."""
        self.routing: Routing | None = None
        """With `servers`: which one serves each request (`kvflow.route`); P/D under
        another route than round robin: which prefill server."""
        self.decode_load: Router | None = None
        """P/D under another route than round robin: which decode server (by load, under
        `prefix`; at random under `random`)."""
        if servers:
            urls = [u.rstrip("/") for u in servers]
            self.routing = Routing(urls, route, kv_events, max_skew)
        elif route != "round-robin":
            self.routing = Routing([u.rstrip("/") for u in prefill], route, kv_events, max_skew)
            policy = "least-loaded" if route == "prefix" else route
            self.decode_load = Router([u.rstrip("/") for u in decode], policy, max_skew=max_skew)
        self._sock = socket.create_server((host, port), backlog=1024)
        self._client = Client(timeout_s)
        self._tasks: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread: threading.Thread | None = None
        self._serving = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    @property
    def token(self) -> trio.lowlevel.TrioToken | None:
        """The proxy's trio loop once it serves (for another thread to run a call in it:
        `trio.from_thread.run(..., trio_token=proxy.token)`)."""
        return self._token

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> PdProxy:
        """Serve in a background thread (what stopped it from serving raised here)."""
        failed: list[BaseException] = []

        def serve() -> None:
            try:
                self.serve_forever()
            except BaseException as exc:
                failed.append(exc)
            finally:
                self._serving.set()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        self._serving.wait()
        if failed:
            raise RuntimeError(f"kvflow proxy did not start: {failed[0]!r}") from failed[0]
        return self

    def serve_forever(self) -> None:
        trio.run(self._serve)

    def close(self) -> None:
        if self._token is not None and self._tasks is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._tasks.cancel_scope.cancel)
        if self._thread is not None:
            self._thread.join()
        self._sock.close()

    async def _serve(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._tasks, self._token = nursery, trio.lowlevel.current_trio_token()
                if self.routing is not None:
                    await nursery.start(self.routing.run, self._client)
                await nursery.start(serve, self._sock, self._handle, self.limits, PATHS)
                self._serving.set()
        finally:
            with trio.CancelScope(shield=True):
                await self._client.aclose()

    def _servers(self) -> tuple[str, str]:
        return next(self._prefill), next(self._decode)

    def producer(self, prefill: str) -> list[str]:
        """Streaming: the workers of `prefill` to claim a request's offer at ([] unknown)."""
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
        if ok:
            self._producers[prefill] = list(found or ())
        else:  # another connector, several KV cache groups, an error
            self._producers.pop(prefill, None)

    # -- a request -----------------------------------------------------------------------
    async def _handle(self, request: Request, reply: Reply) -> None:
        if request.method == "GET":
            await self._get(request.path, reply)
            return
        if request.method != "POST":
            await reply.json(501, {"error": "the proxy answers GET and POST"})
            return
        if request.path not in PATHS:
            await reply.json(404, {"error": f"the proxy serves {', '.join(PATHS)}"})
            return
        try:
            body = msgspec.json.decode(request.body)
        except (msgspec.DecodeError, RecursionError):  # (nested too deep: RecursionError)
            body = None
        if not isinstance(body, dict):
            await reply.json(400, {"error": "the body is not a JSON object"})
            return
        path, routing, decoding = request.path, self.routing, self.decode_load
        if routing is not None and decoding is None:
            await self._routed(reply, path, routing, body)
        elif routing is None or decoding is None:
            await self._pd(reply, path, body, *self._servers(), None)
        else:
            prefill = (await routing.choose(path, body)).server
            decode = decoding.choose(avoid=prefill).server
            try:
                await self._pd(reply, path, body, prefill, decode, routing)
            finally:
                decoding.done(decode)

    async def _pd(
        self,
        reply: Reply,
        path: str,
        body: dict[str, Any],
        prefill: str,
        decode: str,
        routing: Routing | None,
    ) -> None:
        """`body` prefilled by `prefill`, then decoded by `decode`; `routing` (what chose
        the prefill server) is told once the prefill's part ended."""
        if (workers := self.producer(prefill)) and self._tasks is not None:
            offer = secrets.token_hex(16)
            pre = prefill_request(body)
            pre["kv_transfer_params"][OFFER_KEY] = offer
            self._tasks.start_soon(self._prefill_streamed, path, prefill, pre, routing)
            body["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                STREAM_KEY: {"offer": offer, "addresses": workers},
            }
        else:
            try:
                params = await self._prefilled(reply, path, prefill, body, routing)
            finally:
                if routing is not None:
                    routing.done(prefill)
            if params is _ANSWERED:
                return
            body["kv_transfer_params"] = params  # None too: the decode server computes it
        upstream = await self._upstream(reply, "decode", decode + path, body)
        if upstream is not None:
            await self._relay(reply, upstream)

    async def _prefilled(
        self, reply: Reply, path: str, prefill: str, body: dict[str, Any], routing: Routing | None
    ) -> Any:
        """The prefill server's `kv_transfer_params` for `body` (None where it gave none:
        the decode server then computes the prompt); `_ANSWERED` once the client was
        answered instead (the server failed)."""
        unreachable = None if routing is None else (lambda: routing.failed(prefill))
        answer = await self._upstream(
            reply, "prefill", prefill + path, prefill_request(body), unreachable
        )
        if answer is None:
            return _ANSWERED
        try:
            data = await answer.read(MAX_PREFILL_ANSWER_BYTES)
            params = _PREFILLED.decode(data).kv_transfer_params
        except (UpstreamError, ValueError, RecursionError) as exc:
            log.warning("kvflow proxy: the prefill server %s answered: %r", prefill, exc)
            error = f"the prefill server's answer could not be read ({type(exc).__name__})"
            await reply.json(502, {"error": error})
            return _ANSWERED
        finally:
            await answer.aclose()
        self.learn(prefill, params)
        return params

    async def _routed(
        self, reply: Reply, path: str, routing: Routing, body: dict[str, Any]
    ) -> None:
        """A request to the server `routing` chooses, its answer relayed."""
        server = (await routing.choose(path, body)).server
        answer = None
        try:
            failed = lambda: routing.failed(server)  # noqa: E731
            upstream = await self._upstream(reply, "chosen", server + path, body, failed)
            if upstream is not None:
                answer = await self._relay(reply, upstream)
        finally:
            routing.done(server, answer)

    async def _relay(self, reply: Reply, upstream: Answer) -> bytes | None:
        """The upstream server's answer, as it comes; its bytes where it was one JSON
        document of at most `KEPT_ANSWER_BYTES`, the last `KEPT_STREAM_BYTES` of a stream
        of events, else None. Closing it early (the client gone: this task cancelled)
        makes vLLM abort the request."""
        kind = upstream.content_type
        events = kind.startswith("text/event-stream")
        kept = bytearray() if events or kind.startswith("application/json") else None
        try:
            await reply.start(upstream.status, kind)
            try:
                while chunk := await upstream.next_chunk():
                    await reply.send(chunk)
                    if kept is None:
                        continue
                    kept += chunk
                    if events:
                        del kept[:-KEPT_STREAM_BYTES]
                    elif len(kept) > KEPT_ANSWER_BYTES:
                        kept = None
            except UpstreamError as exc:  # the client's answer is cut short: closed
                log.warning("kvflow proxy: a server's answer broke off: %r", exc)
                return None
            await reply.end()
        finally:
            await upstream.aclose()
        return None if kept is None else bytes(kept)

    async def _prefill_streamed(
        self, path: str, prefill: str, body: dict[str, Any], routing: Routing | None
    ) -> None:
        """Streaming: the prefill of a request sent to its decode server meanwhile. Its
        failure is the decode server's to find (the claim goes unanswered: it computes
        the prompt); the server's workers are learned again from its answer."""
        params: Any = None
        try:
            async with await self._client.post(prefill + path, msgspec.json.encode(body)) as answer:
                data = await answer.read(MAX_PREFILL_ANSWER_BYTES)
            params = _PREFILLED.decode(data).kv_transfer_params
        except Exception as exc:  # a task of the proxy's own: never its end
            log.warning("kvflow proxy: the prefill server %s (streamed): %r", prefill, exc)
        finally:
            if routing is not None:
                routing.done(prefill)
        self.learn(prefill, params)

    async def _upstream(
        self, reply: Reply, which: str, url: str, body: dict[str, Any], unreachable: Any = None
    ) -> Answer | None:
        """POST `body` to a server: its open answer; on failure answer the client and
        return None (and call `unreachable()` if the server could not be reached)."""
        try:
            answer = await self._client.post(url, msgspec.json.encode(body))
        except UpstreamError as exc:  # the URL to the log, not to the client (internal addresses)
            if unreachable is not None:
                unreachable()
            log.warning("kvflow proxy: the %s server %s could not be reached: %r", which, url, exc)
            error = f"the {which} server could not be reached ({exc.reason})"
            await reply.json(502, {"error": error})
            return None
        if answer.status < 400:
            return answer
        try:
            payload = await _error_body(answer, which)
        finally:
            await answer.aclose()
        await reply.json(answer.status, payload)
        return None

    async def _get(self, path: str, reply: Reply) -> None:
        if path == "/routes" and self.routing is not None:
            view = self.routing.view()
            if self.decode_load is not None:  # P/D: `view` is the prefill servers'
                view["decode"] = self.decode_load.view()
            await reply.json(200, view)
        elif path == "/metrics" and self.routing is not None:
            text = self.routing.metrics().encode()
            await reply.whole(200, text, "text/plain; version=0.0.4")
        else:
            await reply.json(200 if path == "/health" else 404, {})


def _base_url(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018  (a port that is no number raises)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


async def _error_body(answer: Answer, which: str) -> dict[str, Any]:
    try:
        payload = msgspec.json.decode(await answer.read(1 << 20))
    except (UpstreamError, ValueError):
        payload = None
    if not isinstance(payload, dict):
        payload = {"error": f"HTTP {answer.status}"}
    payload.setdefault("kvflow_proxy", f"the {which} server answered {answer.status}")
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
