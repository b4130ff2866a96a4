"""Routing as `kvflow proxy --server ... --route ...` runs it: the router, its index fed by
every instance's KV events, health checks, and a request's prompt as token ids.

The followers (`kvflow.route.feeds`) and health checks run as trio tasks of the proxy's
loop (`run`); a follower that fails is restarted after a second with its instance
forgotten. An instance whose `/health` does not answer 200 within
`HEALTH_TIMEOUT_S` is left out of routing (and forgotten) until it does again, checked
every `health_s`. A request's prompt is its token ids where it gives them, else what an
instance's `/tokenize` makes of it (chat messages through the model's chat template, as
the instance will): a tokenizer the router need not have.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import msgspec
import trio
import zmq

from kvflow.web.client import Client, UpstreamError

from .feeds import FeedState, follow
from .index import PrefixIndex
from .router import MAX_SKEW, Decision, Router

__all__ = ["HEALTH_S", "Routing", "parse_events"]

log = logging.getLogger("kvflow.route")

HEALTH_S = 2.0
HEALTH_TIMEOUT_S = 5.0
TOKENIZE_TIMEOUT_S = 30.0
MAX_PROMPT_TOKENS = 1 << 21
MAX_TOKENIZE_ANSWER_BYTES = 64 << 20
"""The longest `/tokenize` answer read: `MAX_PROMPT_TOKENS` token ids of up to 10 digits
and a separator each, with room to spare."""


class _Tokenized(msgspec.Struct):
    """What the router reads of a `/tokenize` answer."""

    tokens: Any = None


_TOKENIZED = msgspec.json.Decoder(_Tokenized)
CHAT_KEYS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
)
"""What a chat request's `/tokenize` call takes from it beside `model` and `messages`."""


def parse_events(spec: str) -> tuple[str, str | None]:
    """`ENDPOINT[,REPLAY_ENDPOINT]` (`--kv-events`) as (endpoint, replay endpoint)."""
    parts = spec.split(",")
    if not 1 <= len(parts) <= 2 or not all(p.startswith(("tcp://", "ipc://")) for p in parts):
        raise ValueError(
            f"--kv-events {spec!r}: give ENDPOINT or ENDPOINT,REPLAY_ENDPOINT, each "
            "tcp://host:port (the instance's --kv-events-config endpoint and replay_endpoint)"
        )
    return parts[0], parts[1] if len(parts) == 2 else None


class Routing:
    def __init__(
        self,
        servers: Sequence[str],
        policy: str,
        kv_events: Sequence[str],
        max_skew: int = MAX_SKEW,
        max_blocks: int | None = None,
        health_s: float = HEALTH_S,
    ) -> None:
        index = PrefixIndex(max_blocks) if max_blocks else PrefixIndex()
        self.router = Router(servers, policy, index, max_skew)
        if policy == "prefix" and len(kv_events) != len(servers):
            raise ValueError(
                f"--route prefix needs --kv-events for each server it chooses among (each "
                f"--server, or each --prefill), in the same order ({len(servers)} servers, "
                f"{len(kv_events)} --kv-events)"
            )
        self.feeds = [
            FeedState(server, *parse_events(spec))
            for server, spec in zip(servers, kv_events, strict=False)
        ]
        self.health_s = health_s
        self._client: Client | None = None

    # -- the proxy's tasks -----------------------------------------------------------
    async def run(
        self,
        client: Client,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Follow every instance's events and check its health until cancelled; `client`
        calls the instances (the proxy's)."""
        self._client = client
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            async with trio.open_nursery() as nursery:
                for state in self.feeds:
                    nursery.start_soon(self._follow, state, ctx)
                for server in self.router.servers:
                    nursery.start_soon(self._check, client, server)
                task_status.started()
        finally:
            ctx.destroy(linger=0)

    async def _follow(self, state: FeedState, ctx: zmq.Context[Any]) -> None:
        while True:
            try:
                await follow(state, self.router.index, ctx)
            except Exception:
                log.exception("kvflow proxy: following %s's KV events failed", state.name)
                self.router.index.forget(state.name)
                state.restarts += 1
                await trio.sleep(1.0)

    async def _check(self, client: Client, server: str) -> None:
        """`server`'s health every `health_s`."""
        while True:
            try:
                async with await client.get(server + "/health", HEALTH_TIMEOUT_S) as answer:
                    await answer.read(1 << 16)
                healthy = answer.status == 200
            except Exception:  # unreachable, or no HTTP server there: not healthy
                healthy = False
            self.router.set_healthy(server, healthy)
            await trio.sleep(self.health_s)

    # -- requests ----------------------------------------------------------------------
    async def choose(self, path: str, body: dict[str, Any]) -> Decision:
        """The server for `body` (a request to `path`), counted in flight until `done`."""
        if self.router.policy != "prefix":
            return self.router.choose()
        tokens = await self.prompt_tokens(path, body)
        model = body.get("model")
        lora = model if isinstance(model, str) and model in self.router.index.loras else None
        return self.router.choose(tokens, lora)

    def done(self, server: str, answer: bytes | None = None) -> None:
        """`server`'s request ended; `answer`: its JSON answer, if the proxy kept it
        (the prompt tokens it served from its cache are counted from its `usage`)."""
        self.router.done(server, _cached_tokens(answer))

    def failed(self, server: str) -> None:
        """`server` could not be reached: left out until its health check passes."""
        self.router.set_healthy(server, False)

    async def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids: as given, or an instance's `/tokenize` of it; None where
        it is neither (a batch of prompts, no instance answering)."""
        prompt: Any = body.get("prompt")
        if _token_ids(prompt):
            return list(prompt)
        if path.endswith("/chat/completions"):
            if not isinstance(body.get("messages"), list):
                return None
            ask = {k: body[k] for k in CHAT_KEYS if k in body}
            ask |= {"model": body.get("model"), "messages": body["messages"]}
        elif isinstance(prompt, str):
            ask = {"model": body.get("model"), "prompt": prompt}
            if "add_special_tokens" in body:
                ask["add_special_tokens"] = body["add_special_tokens"]
        else:
            return None
        server = self.router.least_loaded()
        try:
            assert self._client is not None, "run() first"
            url, data = server + "/tokenize", msgspec.json.encode(ask)
            async with await self._client.post(url, data, TOKENIZE_TIMEOUT_S) as answer:
                said = await answer.read(MAX_TOKENIZE_ANSWER_BYTES)
            if answer.status != 200:
                raise ValueError(f"answered {answer.status}")
            tokens = _TOKENIZED.decode(said).tokens
        except (UpstreamError, ValueError, RecursionError) as exc:
            log.info("kvflow proxy: %s/tokenize: %s; routed by load", server, exc)
            return None
        return list(tokens) if _token_ids(tokens) else None

    def view(self) -> dict[str, Any]:
        return self.router.view() | {"feeds": [asdict(f) for f in self.feeds]}

    def metrics(self) -> str:
        """Prometheus text: per server, requests, in flight, health, the prompt tokens
        the router predicted it held and those it reported from its cache; the index's
        size and evictions; per event stream, batches, bad events and lost gaps."""
        lines: list[str] = []

        def metric(name: str, kind: str, what: str, samples: list[tuple[str, float]]) -> None:
            lines.extend(
                [f"# HELP kvflow_proxy_{name} {what}", f"# TYPE kvflow_proxy_{name} {kind}"]
            )
            lines.extend(f"kvflow_proxy_{name}{labels} {value:g}" for labels, value in samples)

        view = self.view()
        servers = view["servers"]
        per = [(f'{{server="{s["url"]}"}}', s) for s in servers]
        metric("requests_total", "counter", "Requests routed", [(k, s["requests"]) for k, s in per])
        metric("in_flight", "gauge", "Requests in flight", [(k, s["in_flight"]) for k, s in per])
        metric(
            "healthy",
            "gauge",
            "1 if the last health check passed",
            [(k, s["healthy"]) for k, s in per],
        )
        metric(
            "predicted_tokens_total", "counter", "Prompt tokens the index said the server held",
            [(k, s["predicted_tokens"]) for k, s in per],
        )  # fmt: skip
        metric(
            "cached_tokens_total", "counter", "Prompt tokens the server reported from its cache",
            [(k, s["cached_tokens"]) for k, s in per],
        )  # fmt: skip
        index = view["index"]
        metric("index_blocks", "gauge", "Blocks in the prefix index", [("", index["blocks"])])
        metric(
            "index_evicted_total",
            "counter",
            "Blocks dropped for the bound",
            [("", index["evicted"])],
        )
        feeds = [(f'{{server="{f["name"]}"}}', f) for f in view["feeds"]]
        metric(
            "event_batches_total",
            "counter",
            "KV event batches applied",
            [(k, f["batches"]) for k, f in feeds],
        )
        metric(
            "events_bad_total",
            "counter",
            "KV events out of bounds",
            [(k, f["bad"]) for k, f in feeds],
        )
        metric(
            "events_lost_total",
            "counter",
            "Event gaps no replay filled",
            [(k, f["lost"]) for k, f in feeds],
        )
        return "\n".join(lines) + "\n"


def _cached_tokens(answer: bytes | None) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of a JSON answer, or of the last events
    of a streamed one (vLLM reports it with `--enable-prompt-tokens-details`, in a stream
    where the client asked for `stream_options.include_usage`), or None."""
    if not answer:
        return None
    if answer[:1] == b"{":
        documents = [answer]
    else:  # server-sent events: `data: {...}` lines, the usage last before `data: [DONE]`
        lines = [line for line in answer.rsplit(b"\n", 8) if line.startswith(b"data:")]
        documents = [line[5:] for line in reversed(lines)]
    for document in documents:
        try:
            details = json.loads(document)["usage"]["prompt_tokens_details"]
            cached = details["cached_tokens"]
        except (ValueError, TypeError, KeyError):
            continue
        return cached if type(cached) is int and 0 <= cached < 1 << 31 else None
    return None


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and 0 < len(value) <= MAX_PROMPT_TOKENS
        and all(type(t) is int and 0 <= t < 1 << 32 for t in value)
    )
