"""Helpers for end-to-end tests: run one real vLLM engine per process, read its events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvflow.eventlog import read_event_log
from kvflow.events import Event
from kvflow_vllm.engine_process import GenResult, Scenario, ScenarioResult, spawn_engine
from kvflow_vllm.serving import ServingEngine, close_all

__all__ = ["ServingEngine", "assert_same_generation", "close_all", "events_for", "run_engine"]


def run_engine(tmp: Path, name: str, **scenario: Any) -> ScenarioResult:
    """A fresh engine process running `Scenario(**scenario)`."""
    return spawn_engine(tmp, name, Scenario(**scenario))


def events_for(path: Path, result: GenResult) -> list[Event]:
    """Events of one request (vLLM suffixes the user-visible request id internally)."""
    return [e for e in read_event_log(str(path)) if e.req.split("-")[0] == result.request_id]


def assert_same_generation(got: GenResult, want: GenResult, what: str, tol: float = 2e-3) -> None:
    assert not got.error, f"{what}: request failed with {got.error!r}"
    assert got.tokens == want.tokens, f"{what}: tokens {got.tokens} != baseline {want.tokens}"
    worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    assert worst <= tol, f"{what}: logprobs differ from baseline by {worst:.2e}"
