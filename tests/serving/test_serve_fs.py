"""kvflow's `fs` store under vLLM's OpenAI server, as a user runs it.

A server saves prompts' KV; it is stopped and a fresh server on the same store
serves the same prompts from kvflow (vLLM's own prefix cache is empty then). The
fresh server has a small KV cache (64 blocks of 32 tokens), so sixteen concurrent
requests preempt each other, and half of another sixteen are abandoned by their
clients mid-stream. Every completed request's text equals one request's alone, and
when the server is idle vLLM holds no block (`vllm:kv_cache_usage_perc` is 0): kvflow
returned every block vLLM lent it.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvflow_vllm.apiserver import ApiServer

from ..support.vllm_servers import assert_same, wait_idle

pytestmark = [pytest.mark.engine, pytest.mark.slow]

_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(100 + 37 * i)] for i in range(16)]
SMALL_CACHE = ("--num-gpu-blocks-override", "64", "--max-model-len", "1024", "--max-num-seqs", "16")


def _config(path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "KVFlowConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"transport": "fs", "options": {"path": str(path)}},
    }


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiServer, list[Any]]]:
    """A server that saved PROMPTS (their answers kept), then a fresh one on its store."""
    tmp = tmp_path_factory.mktemp("serve-fs")
    first = ApiServer(tmp, "first", _config(tmp / "kv"), *SMALL_CACHE, cores="0")
    try:
        first.wait_ready()
        want = [first.completion(p, 16) for p in PROMPTS]
        wait_idle(first)  # every save written, every lent block back
    finally:
        first.close()
    second = ApiServer(tmp, "second", _config(tmp / "kv"), *SMALL_CACHE, cores="0")
    try:
        second.wait_ready()
        yield second, want
    finally:
        second.close()


def test_a_restarted_server_serves_the_prompts_from_the_store(
    restarted: tuple[ApiServer, list[Any]],
) -> None:
    server, want = restarted
    m0 = server.metrics()
    for i in (0, 5, 15):
        assert_same(server.completion(PROMPTS[i], 16), want[i], f"prompt {i} after a restart")
    m1 = wait_idle(server)
    key = 'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}'
    external = m1.get(key, 0) - m0.get(key, 0)
    loaded = m1.get('vllm:kvflow_tokens_total{direction="load"}', 0) - m0.get(
        'vllm:kvflow_tokens_total{direction="load"}', 0
    )
    # vLLM took all but the last token of each prompt from kvflow's store; kvflow moved
    # whole chunks, the last token's with them (vLLM computes that token again)
    assert external == sum(len(PROMPTS[i]) - 1 for i in (0, 5, 15))
    assert loaded == sum(len(PROMPTS[i]) for i in (0, 5, 15))


def test_concurrent_requests_in_a_small_cache_are_preempted_and_still_right(
    restarted: tuple[ApiServer, list[Any]],
) -> None:
    server, want = restarted
    before = server.metrics().get("vllm:num_preemptions_total", 0)
    with ThreadPoolExecutor(16) as ex:
        got = list(ex.map(lambda p: server.completion(p, 96), PROMPTS))
    for i, g in enumerate(got):
        assert "choices" in g, g
        # the first 16 tokens are the ones the first server produced alone
        text = g["choices"][0]["logprobs"]["tokens"][:16]
        assert text == want[i]["choices"][0]["logprobs"]["tokens"], f"request {i}"
    m = wait_idle(server)
    assert m.get("vllm:num_preemptions_total", 0) > before, "the small cache preempted none"
    assert m.get("vllm:kv_cache_usage_perc") == 0, "blocks still held when idle"


def _stream(server: ApiServer, prompt: list[int], abandon: bool) -> str:
    """A streamed completion; `abandon`: the client leaves after the first event."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    body = {"model": server.model, "prompt": prompt, "max_tokens": 200, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    text = []
    try:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            if abandon:
                break
    finally:
        conn.close()
    return "".join(text)


def test_clients_that_leave_mid_stream_leave_no_block_behind(
    restarted: tuple[ApiServer, list[Any]],
) -> None:
    server, want = restarted
    with ThreadPoolExecutor(16) as ex:
        got = list(ex.map(lambda i: _stream(server, PROMPTS[i], i % 2 == 1), range(16)))
    for i in range(0, 16, 2):  # those that stayed got the whole answer, right
        assert got[i].startswith(want[i]["choices"][0]["text"]), f"request {i}"
    m = wait_idle(server)
    assert m.get("vllm:num_requests_running", 0) == 0
    assert m.get("vllm:kv_cache_usage_perc") == 0, "blocks still held when idle"


DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "kvflow-dashboard.json"
SUFFIX = {"_bucket": "histogram", "_sum": "histogram", "_count": "histogram", "_total": "counter"}


def test_every_metric_the_grafana_dashboard_queries_is_on_the_servers_metrics(
    restarted: tuple[ApiServer, list[Any]],
) -> None:
    """examples/grafana/kvflow-dashboard.json, as imported: every panel reads the chosen
    Prometheus data source, and every series its queries name is one this server's
    /metrics declares, of the kind the name's suffix says (`_total` a counter,
    `_bucket` a histogram, none a gauge)."""
    server, _ = restarted
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        declared = dict(
            line.split()[2:4]
            for line in r.read().decode().splitlines()
            if line.startswith("# TYPE")
        )
    board = json.loads(DASHBOARD.read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    queried = {
        name
        for p in panels
        for t in p["targets"]
        for name in re.findall(r"vllm:[A-Za-z0-9_:]+", t["expr"])
    }
    queried.add(board["templating"]["list"][1]["definition"].split("(")[1].split(",")[0])
    assert {n for n in queried if n.startswith("vllm:kvflow_")}, "no kvflow metric queried"
    for name in sorted(queried):
        kind = next((k for s, k in SUFFIX.items() if name.endswith(s)), "gauge")
        base = name.rsplit("_", 1)[0] if kind == "histogram" else name
        # (a counter's TYPE line names it with `_total`, or without in multiprocess mode)
        got = declared.get(base) or declared.get(name.removesuffix("_total"))
        assert got == kind, f"{name}: /metrics declares it as {got}, the query a {kind}"
