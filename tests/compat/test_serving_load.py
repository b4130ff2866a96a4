"""The compatibility matrix's load rows, through vLLM's OpenAI server as users run it
(vLLM's prefix caching on, its default): 64 concurrent requests sharing four system
prompts, a quarter of their clients leaving after the first streamed token, on a server
whose KV cache holds a fraction of them (preemption), over the host tier and `fs`, and
over P/D (`zmq`, `nixl`) through `kvflow proxy`. Every completed request's tokens and
log-probabilities equal an engine's without a connector; idle, vLLM holds no block (kvflow
handed every one back); kvflow's metrics say it loaded.
"""

from __future__ import annotations

import http.client
import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvflow.pd.proxy import PdProxy
from kvflow_vllm.apiserver import ApiServer
from kvflow_vllm.engine_process import GenResult
from kvflow_vllm.serving import close_all

from ..support.vllm_engines import run_engine
from ..support.vllm_servers import wait_idle

pytestmark = [pytest.mark.engine, pytest.mark.slow]

_rng = random.Random(4864)
SYSTEM = [[_rng.randrange(3, 1000) for _ in range(96)] for _ in range(4)]
PROMPTS = [SYSTEM[i % 4] + [_rng.randrange(3, 1000) for _ in range(20 + i)] for i in range(64)]
LEAVE = set(range(3, 64, 4))
"""The clients that leave after the first streamed token."""
MAX_TOKENS = 16
SMALL_CACHE = ("--num-gpu-blocks-override", "48", "--max-num-seqs", "64", "--max-model-len", "512")
"""48 blocks of 32 tokens: about 10 of the 64 requests at once (each needs 4-5 blocks)."""
ROW = (
    "64 concurrent requests sharing 4 system prompts, 16 clients leaving mid-stream, "
    "a KV cache holding about 10 (preemption), vLLM's prefix caching on (OpenAI server)"
)
LOADED = 'vllm:kvflow_tokens_total{direction="load"}'


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[GenResult]:
    """Every prompt decoded by an engine without a connector."""
    tmp = tmp_path_factory.mktemp("load-reference")
    (batch,) = run_engine(
        tmp, "reference", batches=[PROMPTS], connector=False, max_tokens=MAX_TOKENS
    ).batches
    return batch


def _stream(url: str, model: str, prompt: list[int], leave: bool) -> tuple[list[int], list[float]]:
    """A streamed greedy completion: its token ids and their log-probabilities; `leave`:
    the client closes the connection after the first token."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "stream": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    tokens: list[int] = []
    logprobs: list[float] = []
    try:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "choices" in chunk, chunk
            lp = chunk["choices"][0]["logprobs"]
            tokens += [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
            logprobs += lp["token_logprobs"]
            if leave:
                break
    finally:
        conn.close()
    return tokens, logprobs


def _load(url: str, model: str, reference: list[GenResult], what: str) -> None:
    """The 64 requests at once; those that stayed got the reference's tokens."""
    with ThreadPoolExecutor(64) as ex:
        got = list(ex.map(lambda i: _stream(url, model, PROMPTS[i], i in LEAVE), range(64)))
    for i, (tokens, logprobs) in enumerate(got):
        if i in LEAVE:
            continue
        want = reference[i]
        assert tokens == want.tokens, f"{what}: request {i}: {tokens} != {want.tokens}"
        worst = max(abs(a - b) for a, b in zip(logprobs, want.logprobs, strict=True))
        assert worst <= 2e-3, f"{what}: request {i}: logprobs differ by {worst:.2e}"


def _idle(server: ApiServer) -> dict[str, float]:
    m = wait_idle(server)
    assert m.get("vllm:num_requests_running", 0) == 0, f"{server.name}: requests still running"
    assert m.get("vllm:kv_cache_usage_perc") == 0, f"{server.name}: blocks held when idle"
    return m


@pytest.mark.cell(ROW, "fs")
@pytest.mark.cell(ROW, "tier")
def test_a_host_tier_over_fs_under_load(reference: list[GenResult], tmp_path: Path) -> None:
    """Twice: the first time saves (and the first of each system prompt's requests
    serve the others from vLLM's cache, or kvflow's once it evicted them), the second
    time loads from the host tier and `fs`."""
    config = {
        "kv_connector": "KVFlowConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "transport": "fs",
            "options": {"path": str(tmp_path / "kv")},
            "cpu_cache_gib": 0.25,
        },
    }
    server = ApiServer(tmp_path, "tier", config, *SMALL_CACHE, cores="0")
    try:
        server.wait_ready()
        _load(server.url, server.model, reference, "first time")
        first = _idle(server)
        _load(server.url, server.model, reference, "second time")
        second = _idle(server)
    finally:
        server.close()
    assert second.get(LOADED, 0) > first.get(LOADED, 0), "kvflow loaded nothing"
    hits = [
        v
        for k, v in second.items()
        if k.startswith("vllm:kvflow_tier_chunks_total") and 'outcome="hit"' in k
    ]
    assert sum(hits) > 0, "the host tier served nothing"
    assert second.get("vllm:num_preemptions_total", 0) > 0, "the small cache preempted none"


def _pd_config(transport: str, role: str) -> dict[str, Any]:
    return {
        "kv_connector": "KVFlowConnector",
        "kv_role": role,
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"transport": transport},
    }


@pytest.fixture
def pd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[ApiServer, PdProxy]]:
    transport = request.param
    prefill = ApiServer(
        tmp_path, "prefill", _pd_config(transport, "kv_producer"), *SMALL_CACHE, cores="0"
    )
    decode = ApiServer(
        tmp_path, "decode", _pd_config(transport, "kv_consumer"), *SMALL_CACHE, cores="1"
    )
    proxy = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        proxy = PdProxy([prefill.url], [decode.url]).start()
        yield decode, proxy
        _idle(prefill)
    finally:
        if proxy is not None:
            proxy.close()
        close_all((prefill, decode))


@pytest.mark.parametrize(
    "pd", [pytest.param(t, marks=pytest.mark.cell(ROW, t)) for t in ("zmq", "nixl")], indirect=True
)
def test_pd_under_load(reference: list[GenResult], pd: tuple[ApiServer, PdProxy]) -> None:
    decode, proxy = pd
    _load(proxy.url, decode.model, reference, "through P/D")
    m = _idle(decode)
    assert m.get(LOADED, 0) > 0, "the decode server pulled nothing"
