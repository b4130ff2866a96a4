"""Helpers for the tests through vLLM's OpenAI server (`kvflow_vllm.apiserver.ApiServer`)."""

from __future__ import annotations

from typing import Any

from kvflow_vllm.apiserver import ApiServer


def assert_same(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """The completion `got` is `want` (one server's): its text, its log-probabilities."""
    assert "choices" in got, f"{what}: the request failed: {got}"
    g, w = got["choices"][0], want["choices"][0]
    assert g["text"] == w["text"], f"{what}: {g['text']!r} != one server's {w['text']!r}"
    lg, lw = g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"]
    worst = max(abs(a - b) for a, b in zip(lg, lw, strict=True))
    assert worst <= 2e-3, f"{what}: log-probabilities differ by {worst:.2e}"


def wait_idle(server: ApiServer, timeout: float = 60) -> dict[str, float]:
    """Metrics once vLLM runs nothing and holds no block, or after `timeout` as they are."""
    return server.metrics_once(
        lambda m: (
            m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:kv_cache_usage_perc", 1) == 0
        ),
        timeout,
    )
