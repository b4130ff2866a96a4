"""kvflow as one child of vLLM's `MultiConnector`, next to vLLM's `ExampleConnector`.

vLLM builds each child from its own `kv_transfer_config` dict, saves through every
child and loads through the first that has the prompt. Engines run once for the
module: a baseline without a connector and, at the same time, the first of two fresh
engine processes with the same `MultiConnector` configuration (kvflow `fs` first),
which computes and saves the prompts through both children; the second loads them
through kvflow.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvflow.observe.events import LoadStarted, TransferDone
from kvflow_vllm.engine_process import ScenarioResult

from ..support.vllm_engines import (
    assert_same_generation,
    events_for,
    run_engine,
    run_engines,
    started,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

_rng = random.Random(18)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (300, 200)]


class Run:
    baseline: ScenarioResult
    first: ScenarioResult
    second: ScenarioResult

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def connectors(self, name: str) -> dict[str, Any]:
        kvflow = {
            "transport": "fs",
            "options": {"path": str(self.tmp / "store")},
            "event_log": str(self.tmp / f"{name}.events.jsonl"),
        }
        return {
            "connectors": [
                {
                    "kv_connector": "KVFlowConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": kvflow,
                },
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(self.tmp / "ex")},
                },
            ]
        }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    r = Run(tmp_path_factory.mktemp("multi"))
    multi = {"batches": [PROMPTS], "connector_name": "MultiConnector"}
    first = run_engines(
        r.tmp,
        {
            "baseline": {"batches": [PROMPTS], "connector": False},
            "first": {**multi, "extra_config": r.connectors("first")},
        },
    )
    r.baseline, r.first = started(first["baseline"]), started(first["first"])
    r.second = run_engine(r.tmp, "second", **multi, extra_config=r.connectors("second"))
    return r


def test_both_children_save_and_tokens_match(run: Run) -> None:
    for got, want in zip(run.first.batches[0], run.baseline.batches[0], strict=True):
        assert_same_generation(got, want, "first MultiConnector engine")
    assert any((run.tmp / "store").rglob("*.kv")), "kvflow saved nothing"
    assert any((run.tmp / "ex").rglob("*.safetensors")), "ExampleConnector saved nothing"


def test_a_fresh_engine_loads_through_kvflow_with_identical_tokens(run: Run) -> None:
    log = run.tmp / "second.events.jsonl"
    for got, want, prompt in zip(
        run.second.batches[0], run.baseline.batches[0], PROMPTS, strict=True
    ):
        assert_same_generation(got, want, "second MultiConnector engine")
        assert got.cached_tokens == len(prompt) - 1
        events = events_for(log, got)
        assert any(isinstance(e, LoadStarted) for e in events), "kvflow did not load"
        assert any(isinstance(e, TransferDone) and e.direction == "load" for e in events)
