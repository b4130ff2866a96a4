"""`kvflow proxy --server A B --route prefix` in front of two real vLLM servers (kvflow's
connector, `fs`, KV events on, one core each): a prompt returning to the proxy goes where
its prefix is, and that server then serves it from its cache; completions as token ids
and as text, and chat (both through a server's `/tokenize`). Issue 52.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from kvflow.pd.proxy import PdProxy
from kvflow.route.index import Match
from kvflow.route.router import Router
from kvflow_vllm.apiserver import ApiServer, free_port, post

pytestmark = [pytest.mark.engine]

_rng = random.Random(52)
SMALL = ("--num-gpu-blocks-override", "64", "--max-model-len", "1024", "--max-num-seqs", "8")
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]


def _words(n: int) -> str:
    return " ".join(
        _rng.choice(["kv", "cache", "route", "block", "prefix", "vllm"]) for _ in range(n)
    )


class Instance:
    def __init__(
        self,
        tmp: Path,
        name: str,
        core: str,
        again: Instance | None = None,
        transport: str = "fs",
    ) -> None:
        """`again`: in that one's place (its HTTP and event ports), a restarted server;
        `transport`: kvflow's (`zmq`: P/D between the instances)."""
        self.events, self.replay = (
            (again.events, again.replay) if again else (free_port(), free_port())
        )
        template = tmp / "chat.jinja"
        template.write_text(TEMPLATE)
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://*:{self.replay}",
        }
        config = {
            "kv_connector": "KVFlowConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": (
                {"transport": "fs", "options": {"path": str(tmp / name)}}
                if transport == "fs"
                else {"transport": transport}
            ),
        }
        self.server = ApiServer(
            tmp, name, config, *SMALL, "--kv-events-config", json.dumps(events),
            "--enable-prompt-tokens-details", "--chat-template", str(template), cores=core,
            port=again.server.port if again else 0,
        )  # fmt: skip

    @property
    def spec(self) -> str:
        return f"tcp://127.0.0.1:{self.events},tcp://127.0.0.1:{self.replay}"


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PdProxy, list[Instance]]]:
    tmp = tmp_path_factory.mktemp("serve-route")
    instances = [Instance(tmp, "a", "0"), Instance(tmp, "b", "1")]
    proxy = None
    try:
        for i in instances:
            i.server.wait_ready()
        proxy = PdProxy(
            [], [], servers=[i.server.url for i in instances], route="prefix",
            kv_events=[i.spec for i in instances], max_skew=2,
        ).start()  # fmt: skip
        yield proxy, instances
    finally:
        if proxy is not None:
            proxy.close()
        for i in instances:
            i.server.close()


def _request(proxy: PdProxy, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The answer through the proxy, and the server it went to."""
    assert proxy.routing is not None
    before = len(proxy.routing.router.decisions)
    answer = post(proxy.url + path, body)
    assert "choices" in answer, answer
    return proxy.routing.router.decisions[before].server, answer


def _settled(*routers: Router) -> None:
    """Until every request's count in flight is given back: a proxy's request task does
    that just after it wrote the answer's last byte, which the client may see first."""
    deadline = time.monotonic() + 10
    while any(s.in_flight for r in routers for s in r.servers.values()):
        assert time.monotonic() < deadline, [
            s.in_flight for r in routers for s in r.servers.values()
        ]
        time.sleep(0.01)  # polls the proxy's request tasks


def _cached(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _held(proxy: PdProxy, server: str, tokens: list[int], want: int) -> None:
    """Until the index says `server` holds `want` leading tokens of `tokens` (its KV
    events come from another process, a step after the blocks were cached)."""
    assert proxy.routing is not None
    index = proxy.routing.router.index
    deadline = time.monotonic() + 30
    while (held := index.match(tokens, None).get(server, Match()).tokens) < want:
        assert time.monotonic() < deadline, f"{server} holds {held} of {want} tokens by its events"
        time.sleep(0.05)  # polls what another process publishes


def test_a_prompt_goes_where_its_prefix_is_and_is_served_from_that_cache(
    routed: tuple[PdProxy, list[Instance]],
) -> None:
    proxy, instances = routed
    model = instances[0].server.model
    prefix = _tokens(320)

    def body(prompt: list[int]) -> dict[str, Any]:
        return {"model": model, "prompt": prompt, "max_tokens": 2}

    first, _ = _request(proxy, "/v1/completions", body(prefix))
    _held(proxy, first, prefix, 288)  # 9 full blocks of 32 (the last token is recomputed)
    for k in range(4):
        for _ in range(1 + k % 2):  # other prompts between: 1, 2, 1, 2 (no round robin's turn)
            _request(proxy, "/v1/completions", body(_tokens(100)))
        server, answer = _request(proxy, "/v1/completions", body(prefix + _tokens(40)))
        assert server == first, f"request {k}: the prefix is on {first}, routed to {server}"
        assert _cached(answer) >= 288, answer["usage"]
    streamed = dict(body(prefix + _tokens(40)), stream=True)
    streamed["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(
        proxy.url + "/v1/completions", json.dumps(streamed).encode(), {"Content-Type": "x"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        events = [line[6:] for line in answer.read().split(b"\n") if line.startswith(b"data: {")]
    usage = json.loads(events[-1])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 288, usage
    assert proxy.routing.router.decisions[-1].server == first  # type: ignore[union-attr]
    servers = {d.server for d in proxy.routing.router.decisions}  # type: ignore[union-attr]
    assert servers == {i.server.url for i in instances}  # the fresh prompts went to both
    _settled(proxy.routing.router)  # type: ignore[union-attr]
    view = proxy.routing.view()  # type: ignore[union-attr]
    assert [f["lost"] for f in view["feeds"]] == [0, 0]
    assert all(f["batches"] > 0 for f in view["feeds"])
    routed_ones = [d for d in view["decisions"] if d["predicted_tokens"] >= 288]
    assert len(routed_ones) == 5
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=30) as answer:
        metrics = dict(
            line.rsplit(" ", 1) for line in answer.read().decode().splitlines() if line[:1] != "#"
        )
    on = f'{{server="{first}"}}'
    assert float(metrics[f"kvflow_proxy_predicted_tokens_total{on}"]) >= 5 * 288
    # the server's word, from four answers and a stream's last event
    assert float(metrics[f"kvflow_proxy_cached_tokens_total{on}"]) >= 5 * 288
    assert float(metrics["kvflow_proxy_index_blocks"]) > 0


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_text_and_chat_prompts_are_tokenized_by_a_server_and_routed_by_prefix(
    routed: tuple[PdProxy, list[Instance]], kind: str
) -> None:
    proxy, instances = routed
    model = instances[0].server.model
    system = _words(120)

    def body(tail: str) -> tuple[str, dict[str, Any]]:
        if kind == "text":
            return "/v1/completions", {"model": model, "prompt": system + tail, "max_tokens": 2}
        messages = [{"role": "system", "content": system}, {"role": "user", "content": tail}]
        return "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 2}

    first, answer = _request(proxy, *body(_words(20)))
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert 200 < prompt_tokens < 900, prompt_tokens
    assert proxy.routing is not None
    tokens = trio.from_thread.run(proxy.routing.prompt_tokens, *body(""), trio_token=proxy.token)
    assert tokens is not None
    _held(proxy, first, tokens, 32 * (len(tokens) // 32) - 32)
    for _ in range(2):  # (under round robin, the turn would be elsewhere)
        fresh = {"model": model, "prompt": _tokens(100), "max_tokens": 2}
        _request(proxy, "/v1/completions", fresh)
    again, answer = _request(proxy, *body(_words(20)))
    assert again == first
    assert _cached(answer) >= 32 * (len(tokens) // 32) - 32, answer["usage"]


@pytest.mark.slow
def test_a_dead_server_is_dropped_within_seconds_and_comes_back_empty(
    tmp_path: Path,
) -> None:
    """Issue 52, faults: the server holding a prefix is killed: its health check fails
    within seconds, its blocks are forgotten, and its prefix's requests are served by the
    other; started again in its place, it is routed to again, holding nothing."""
    a, b = Instance(tmp_path, "a", "0"), Instance(tmp_path, "b", "1")
    proxy = None
    try:
        for i in (a, b):
            i.server.wait_ready()
        proxy = PdProxy(
            [], [], servers=[a.server.url, b.server.url], route="prefix",
            kv_events=[a.spec, b.spec],
        ).start()  # fmt: skip
        assert proxy.routing is not None
        router, model = proxy.routing.router, a.server.model
        prefix = _tokens(320)
        first, _ = _request(
            proxy, "/v1/completions", {"model": model, "prompt": prefix, "max_tokens": 2}
        )
        assert first == a.server.url  # both idle: the first in order
        _held(proxy, first, prefix, 288)
        a.server.close()  # killed
        deadline = time.monotonic() + 20
        while router.servers[first].healthy:
            assert time.monotonic() < deadline, "the dead server is still routed to"
            time.sleep(0.1)  # polls the proxy's health checker (its own thread)
        assert router.index.match(prefix, None) == {}
        server, answer = _request(
            proxy, "/v1/completions", {"model": model, "prompt": prefix, "max_tokens": 2}
        )
        assert server == b.server.url and answer["usage"]["completion_tokens"] == 2
        again = Instance(tmp_path, "a-again", "0", again=a)
        try:
            again.server.wait_ready()
            deadline = time.monotonic() + 20
            while not router.servers[first].healthy:
                assert time.monotonic() < deadline, "the restarted server is not routed to"
                time.sleep(0.1)
            assert first not in router.index.match(prefix, None)  # it starts empty
            fresh = [
                _request(
                    proxy,
                    "/v1/completions",
                    {"model": model, "prompt": _tokens(64), "max_tokens": 2},
                )[0]
                for _ in range(2)
            ]
            assert first in fresh
        finally:
            again.server.close()
    finally:
        if proxy is not None:
            proxy.close()
        for i in (a, b):
            i.server.close()


@pytest.mark.slow
def test_pd_chooses_the_prefill_server_by_prefix_and_the_decode_server_by_load(
    tmp_path: Path,
) -> None:
    """`kvflow proxy --prefill A B --decode A B --route prefix` (kvflow's `zmq`, both
    servers `kv_both`): each prefill goes to a server holding the prompt's prefix once
    one does, each decode to the other server, the tokens are one server's, and every
    request's count in flight is given back on both sides."""
    a, b = (
        Instance(tmp_path, "a", "0", transport="zmq"),
        Instance(tmp_path, "b", "1", transport="zmq"),
    )
    proxy = None
    try:
        for i in (a, b):
            i.server.wait_ready()
        urls = [a.server.url, b.server.url]
        proxy = PdProxy(urls, urls, route="prefix", kv_events=[a.spec, b.spec]).start()
        assert proxy.routing is not None and proxy.decode_load is not None
        prefill, decode = proxy.routing.router, proxy.decode_load
        prefix = _tokens(320)
        prompts = [prefix + _tokens(40) for _ in range(3)]
        got = [post(proxy.url + "/v1/completions", _greedy(a, prefix))]
        first = prefill.decisions[0].server
        _held(proxy, first, prefix, 288)
        got += [post(proxy.url + "/v1/completions", _greedy(a, p)) for p in prompts]
        assert [d.predicted_tokens >= 288 for d in prefill.decisions] == [False, True, True, True]
        pairs = zip(prefill.decisions, decode.decisions, strict=True)
        assert all(p.server != d.server for p, d in pairs)
        _settled(prefill, decode)  # every count given back (a count never given back fails)
        proxy.close()
        proxy = None
        for prompt, answer in zip([prefix, *prompts], got, strict=True):
            want = post(a.server.url + "/v1/completions", _greedy(a, prompt))
            assert answer["choices"][0]["text"] == want["choices"][0]["text"]
    finally:
        if proxy is not None:
            proxy.close()
        for i in (a, b):
            i.server.close()


def _greedy(i: Instance, prompt: list[int]) -> dict[str, Any]:
    return {
        "model": i.server.model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
