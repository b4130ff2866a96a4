"""Shared fixtures: real runtimes that are always shut down after the test, the engines
of the SchedulerEngine + WorkerEngine tests (tests/support/kvflow_engines.py), vLLM's
real Scheduler in both of the engine core's loops (tests/support/vllm_scheduler.py) and
the side-channel attacker's ZMQ context (tests/support/side_channel_attacks.py).

The helpers behind a fixture are imported where it runs, so that a test module that
uses none of them does not import them (torch, the transports)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import zmq

from kvflow.runtime import Runtime

# Helper modules with the asserts of tests: rewritten as the tests' own (before any imports them).
pytest.register_assert_rewrite(
    "tests.support.kvflow_engines",
    "tests.support.vllm_servers",
    "tests.support.side_channel_attacks",
    "tests.support.vllm_scheduler",
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .support.kvflow_engines import Engine
    from .support.vllm_scheduler import Harness, Loop, MakeHarness


@pytest.fixture
def make_runtime() -> Iterator[Callable[..., Runtime]]:
    """`make_runtime(name, cls=Runtime, **kwargs)`: a runtime shut down and joined at teardown."""
    made: list[Runtime] = []

    def make(name: str, cls: type[Runtime] = Runtime, **kwargs: Any) -> Runtime:
        rt = cls(name, **kwargs)
        made.append(rt)
        return rt

    yield make
    stuck = [rt.name for rt in made if not rt.shutdown(timeout=10.0)]
    assert not stuck, f"runtimes did not stop: {stuck}"


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def start_engine(make_runtime: Callable[..., Runtime], store: Path) -> Callable[..., Engine]:
    """`start_engine(name, **options)`: one vLLM instance's scheduler- and worker-side
    engines over the `fs` store `store` (tests/support/kvflow_engines.py)."""
    from .support.kvflow_engines import engine_starter

    return engine_starter(make_runtime, store)


@pytest.fixture(params=["sync", "async"])
def loop(request: pytest.FixtureRequest) -> Loop:
    """The engine core loop the test's harnesses run (`Loop`: see
    `tests/support/vllm_scheduler.py`)."""
    value: Loop = request.param
    return value


@pytest.fixture
def harness(loop: Loop) -> Iterator[MakeHarness]:
    """`harness(vllm_config, num_blocks)`: a scheduler driven in the test's `loop`, shut
    down (kvflow's runtime with it) at teardown."""
    from .support.vllm_scheduler import make_harness

    made: list[Harness] = []

    def make(vllm_config: VllmConfig, num_blocks: int) -> Harness:
        h = make_harness(vllm_config, num_blocks, loop)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.fixture
def zctx() -> Iterator[zmq.Context[Any]]:
    """The attacker's (or hostile producer's) own ZMQ context."""
    from .support.side_channel_attacks import AUTHENTICATORS

    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    for auth in AUTHENTICATORS.pop(id(ctx), []):
        auth.stop()
    ctx.destroy(linger=0)


# -- the compatibility matrix (docs/compatibility.md) -----------------------------------
COMPAT_ENV = "KVFLOW_COMPAT_RESULTS"
"""Where tests marked `cell` append their outcome (JSON lines): bench/bench_compat.py sets
it, and renders docs/compatibility.md from what they wrote."""


LIST_CELLS_ENV = "KVFLOW_LIST_CELLS"
"""Where a collection writes each selected test's cells (JSON lines): which cells a test
set would show (tests/project/test_bench_docs.py checks the default set's)."""


def _cells(item: pytest.Item) -> Iterator[dict[str, str]]:
    """The cells a test marked `cell` shows: its row, its column, its claim."""
    for mark in item.iter_markers("cell"):
        path = mark.args[1]
        yield {
            "row": mark.args[0],
            "path": path(item) if callable(path) else path,
            "claim": mark.kwargs.get("claim", "yes"),
            "test": item.nodeid,
        }


def pytest_collection_finish(session: pytest.Session) -> None:
    if path := os.environ.get(LIST_CELLS_ENV):
        with open(path, "a") as f:
            f.writelines(json.dumps(cell) + "\n" for item in session.items for cell in _cells(item))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = (yield).get_result()
    path = os.environ.get(COMPAT_ENV)
    if not path or not (report.when == "call" or report.failed or report.skipped):
        return  # a setup or teardown that went well: the call says
    for cell in _cells(item):
        line = cell | {
            "outcome": report.outcome
            if report.when == "call"
            else f"{report.outcome} in {report.when}",
        }
        if report.failed or report.skipped:
            line["said"] = str(report.longrepr)[-2000:]
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
