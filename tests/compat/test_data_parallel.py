"""The compatibility matrix's data-parallel row: vLLM's OpenAI server with two engines
(`--data-parallel-size 2`, each on its own core), as a user serves one. Eight prompts at
once, so that both engines serve some: their tokens and log-probabilities equal an
engine's without a connector, and each engine's kvflow did the work of the column
(vLLM's metrics by engine).

- `fs` and the host tier: a server computes and saves; a second, fresh server loads from
  `fs` (no tier hit: its tiers start empty), then, asked again with vLLM's prefix
  caching off, serves from its engines' host tiers.
- P/D: one server of two engines (`kv_both`) prefills each prompt on one engine and
  decodes it on the other (vLLM's `X-data-parallel-rank`): each engine offers from its
  own side channel and pulls from the other's. (Two servers of two engines each, as a
  deployment would run them, need four cores: engines sharing a core stall each other's
  steps for seconds, as kvflow warns at start.)
"""

from __future__ import annotations

import json
import random
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvflow.pd.proxy import PREFILL_PARAMS
from kvflow_vllm.apiserver import ApiServer, post
from kvflow_vllm.engine_process import GenResult

from ..support.vllm_engines import run_engine
from ..support.vllm_servers import wait_idle

pytestmark = [pytest.mark.engine, pytest.mark.slow]

_rng = random.Random(4870)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(40 + 23 * i)] for i in range(8)]
MAX_TOKENS = 8
ROW = "data parallel: two engines of one OpenAI server (`--data-parallel-size 2`)"
DP = ("--data-parallel-size", "2", "--no-enable-prefix-caching", "--max-model-len", "512")
CORES = "0|1"
"""One core per engine (vLLM's CPU build binds each data-parallel rank to its own)."""
LOADED = "vllm:kvflow_tokens_total"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[GenResult]:
    """Every prompt decoded by an engine without a connector."""
    tmp = tmp_path_factory.mktemp("dp-reference")
    (batch,) = run_engine(
        tmp, "reference", batches=[PROMPTS], connector=False, max_tokens=MAX_TOKENS
    ).batches
    return batch


def _complete(
    url: str, model: str, prompt: list[int], params: dict[str, Any] | None = None, rank: int = -1
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    if rank >= 0:
        return _leg(url, body, rank)
    return post(url + "/v1/completions", body)


def _same(got: list[dict[str, Any]], reference: list[GenResult], what: str) -> None:
    """Each answer has the reference's tokens and log-probabilities."""
    for i, (answer, want) in enumerate(zip(got, reference, strict=True)):
        assert "choices" in answer, f"{what}: request {i} failed: {answer}"
        lp = answer["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        assert tokens == want.tokens, f"{what}: request {i}: {tokens} != {want.tokens}"
        worst = max(abs(a - b) for a, b in zip(lp["token_logprobs"], want.logprobs, strict=True))
        assert worst <= 2e-3, f"{what}: request {i}: logprobs differ by {worst:.2e}"


def _all_at_once(url: str, model: str, reference: list[GenResult], what: str) -> None:
    """The eight prompts at once; each got the reference's tokens."""
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        got = list(ex.map(lambda p: _complete(url, model, p), PROMPTS))
    _same(got, reference, what)


def _by_engine(server: ApiServer, name: str, labels: str = "") -> dict[str, float]:
    """A counter's value by vLLM engine (data-parallel rank), summed over other labels
    (those in `labels`, e.g. `direction="load"`, must be present)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if not key.startswith(name + "{") or labels not in key:
            continue
        engine = re.search(r'engine="(\d+)"', key)
        assert engine, f"{key}: no engine label"
        out[engine[1]] = out.get(engine[1], 0.0) + float(value)
    return out


def _served_by_both(server: ApiServer) -> dict[str, float]:
    wait_idle(server)
    served = _by_engine(server, "vllm:request_success_total")
    assert sorted(served) == ["0", "1"] and min(served.values()) > 0, f"engines served {served}"
    return served


def _fs_config(path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "KVFlowConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "transport": "fs",
            "options": {"path": str(path)},
            "cpu_cache_gib": 0.25,
        },
    }


@pytest.mark.cell(ROW, "fs")
@pytest.mark.cell(ROW, "tier")
def test_two_engines_of_one_server_save_then_load_from_fs_then_the_host_tier(
    reference: list[GenResult], tmp_path: Path
) -> None:
    config = _fs_config(tmp_path / "kv")
    cold = ApiServer(tmp_path, "cold", config, *DP, cores=CORES)
    try:
        cold.wait_ready()
        _all_at_once(cold.url, cold.model, reference, "the server that saved")
        _served_by_both(cold)
        saved = _by_engine(cold, LOADED, 'direction="save"')
        assert sorted(saved) == ["0", "1"] and min(saved.values()) > 0, f"saved {saved}"
    finally:
        cold.close()
    warm = ApiServer(tmp_path, "warm", config, *DP, cores=CORES)
    try:
        warm.wait_ready()
        _all_at_once(warm.url, warm.model, reference, "a fresh server, from fs")
        served = _served_by_both(warm)
        loaded = _by_engine(warm, LOADED, 'direction="load"')
        assert loaded.keys() == served.keys() and min(loaded.values()) > 0, f"loaded {loaded}"
        hits = _by_engine(warm, "vllm:kvflow_tier_chunks_total", 'outcome="hit"')
        assert sum(hits.values()) == 0, f"a fresh server's tiers served {hits}"
        _all_at_once(warm.url, warm.model, reference, "the same server, from its host tiers")
        _served_by_both(warm)
        hits = _by_engine(warm, "vllm:kvflow_tier_chunks_total", 'outcome="hit"')
        assert sum(hits.values()) > 0, "the host tiers served nothing"
    finally:
        warm.close()


PD_CLAIM = (
    "yes, between the two engines of one server (`kv_both`): each request prefilled on one "
    "engine and decoded on the other (`X-data-parallel-rank`); two servers of two engines "
    "each need four cores, this machine has two"
)


def _leg(url: str, body: dict[str, Any], rank: int) -> dict[str, Any]:
    """A completion on the server's engine `rank` (vLLM's `X-data-parallel-rank`)."""
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-data-parallel-rank": str(rank)},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        answer: dict[str, Any] = json.loads(r.read())
        return answer


@pytest.mark.parametrize(
    "transport",
    [pytest.param(t, marks=pytest.mark.cell(ROW, t, claim=PD_CLAIM)) for t in ("zmq", "nixl")],
)
def test_pd_between_the_two_engines_of_one_server(
    reference: list[GenResult], transport: str, tmp_path: Path
) -> None:
    """Each prompt's prefill on one engine, its decode on the other, all at once: each
    engine offers from its own side channel and pulls from the other's."""
    config = {
        "kv_connector": "KVFlowConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"transport": transport},
    }
    server = ApiServer(tmp_path, "pd", config, *DP, cores=CORES)

    def both_legs(i: int) -> dict[str, Any]:
        body = {"model": server.model, "prompt": PROMPTS[i], "max_tokens": 1}
        first = _leg(server.url, body | {"kv_transfer_params": dict(PREFILL_PARAMS)}, i % 2)
        params = first["kv_transfer_params"]
        assert params, f"request {i}: no params from its prefill"
        return _complete(server.url, server.model, PROMPTS[i], params, rank=1 - i % 2)

    try:
        server.wait_ready()
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            got = list(ex.map(both_legs, range(len(PROMPTS))))
        _same(got, reference, f"P/D over {transport} between engines")
        _served_by_both(server)
        pulled = _by_engine(server, LOADED, 'direction="load"')
        assert sorted(pulled) == ["0", "1"] and min(pulled.values()) > 0, f"pulled {pulled}"
        assert sum(pulled.values()) == sum(len(p) for p in PROMPTS), f"pulled {pulled}"
    finally:
        server.close()
