"""Helpers for end-to-end tests: run one real vLLM engine per process, read its events."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvflow.observe.events import Event
from kvflow.observe.log import read_event_log
from kvflow_vllm import serving
from kvflow_vllm.engine_process import (
    EngineFailed,
    GenResult,
    Scenario,
    ScenarioResult,
    spawn_engine,
)
from kvflow_vllm.serving import close_all

__all__ = [
    "IN_PROCESS",
    "ServingEngine",
    "assert_same_generation",
    "close_all",
    "events_for",
    "in_process",
    "run_engine",
    "run_engines",
    "started",
]


IN_PROCESS = {
    "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    "llm_args": {"distributed_executor_backend": "uni"},
}
"""vLLM's engine core and its worker in the engine's own process: the same scheduler,
connector and model runner objects, started in about a third of the time (one import of
vLLM where a user's `LLM` makes three processes, each importing it). The tests' offline
engines of one rank run so (decisions 83, 86): a serving engine steps between requests
while vLLM's scheduler has work, as vLLM's engine core process does. vLLM's OpenAI
servers, tensor-parallel engines, the demo and the installed wheel's check run vLLM's
processes, as users do."""


def in_process(**scenario: Any) -> dict[str, Any]:
    """Scenario fields `scenario` for an engine in one process (`IN_PROCESS`); an engine
    of more than one rank keeps vLLM's processes (its ranks are processes)."""
    if scenario.get("tensor_parallel_size", 1) > 1:
        return scenario
    return {
        **scenario,
        "env": IN_PROCESS["env"] | scenario.get("env", {}),
        "llm_args": IN_PROCESS["llm_args"] | scenario.get("llm_args", {}),
    }


def run_engine(tmp: Path, name: str, **scenario: Any) -> ScenarioResult:
    """A fresh engine process running `Scenario(**scenario)`, vLLM in that one process."""
    return spawn_engine(tmp, name, Scenario(**in_process(**scenario)))


class ServingEngine(serving.ServingEngine):
    """`kvflow_vllm.serving.ServingEngine`, vLLM in the engine's one process."""

    def __init__(self, tmp: Path, name: str, **scenario: Any) -> None:
        super().__init__(tmp, name, **in_process(**scenario))


def run_engines(
    tmp: Path, scenarios: dict[str, dict[str, Any]]
) -> dict[str, ScenarioResult | EngineFailed]:
    """Fresh engine processes running `Scenario(**scenarios[name])`, two at a time: by
    name, each one's result, or the `EngineFailed` of one that did not start (any other
    error is raised). An engine process spends most of its life importing vLLM, three
    times over (itself, its engine core, its worker), on one core; two at once overlap
    those on two cores, and their short forwards rarely meet."""
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run_engine, tmp, name, **sc) for name, sc in scenarios.items()}
    out: dict[str, ScenarioResult | EngineFailed] = {}
    for name, future in futures.items():
        exc = future.exception()
        if exc is not None and not isinstance(exc, EngineFailed):
            raise exc
        out[name] = exc if isinstance(exc, EngineFailed) else future.result()
    return out


def started(result: ScenarioResult | EngineFailed) -> ScenarioResult:
    """`run_engines`' result of an engine that must have started (else its error)."""
    if isinstance(result, EngineFailed):
        raise result
    return result


def events_for(path: Path, result: GenResult) -> list[Event]:
    """Events of one request (vLLM suffixes the user-visible request id internally)."""
    return [e for e in read_event_log(str(path)) if e.req.split("-")[0] == result.request_id]


def assert_same_generation(got: GenResult, want: GenResult, what: str, tol: float = 2e-3) -> None:
    assert not got.error, f"{what}: request failed with {got.error!r}"
    assert got.tokens == want.tokens, f"{what}: tokens {got.tokens} != baseline {want.tokens}"
    worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    assert worst <= tol, f"{what}: logprobs differ from baseline by {worst:.2e}"
