"""Helpers for end-to-end tests: run one real vLLM engine per process, read its events."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
from kvflow_vllm.engine import GenResult, Scenario, ScenarioResult

from kvflow.eventlog import read_event_log
from kvflow.events import Event

ENGINE_TIMEOUT_S = 400


class EngineFailed(RuntimeError):
    def __init__(self, returncode: int, log: str) -> None:
        super().__init__(f"engine process exited with {returncode}")
        self.log = log


def run_engine(tmp: Path, name: str, **scenario: Any) -> ScenarioResult:
    """Start a fresh engine process for `scenario`; raise EngineFailed with its log on error."""
    spec, out, log = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec.write_bytes(msgspec.json.encode(Scenario(**scenario)))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "wb") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "kvflow_vllm.engine", str(spec), str(out)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=ENGINE_TIMEOUT_S,
        )
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        raise EngineFailed(proc.returncode, text)
    return msgspec.json.decode(out.read_bytes(), type=ScenarioResult)


def events_for(path: Path, result: GenResult) -> list[Event]:
    """Events of one request (vLLM suffixes the user-visible request id internally)."""
    return [e for e in read_event_log(str(path)) if e.req.split("-")[0] == result.request_id]


def assert_same_generation(got: GenResult, want: GenResult, what: str, tol: float = 2e-3) -> None:
    assert not got.error, f"{what}: request failed with {got.error!r}"
    assert got.tokens == want.tokens, f"{what}: tokens {got.tokens} != baseline {want.tokens}"
    worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    assert worst <= tol, f"{what}: logprobs differ from baseline by {worst:.2e}"
