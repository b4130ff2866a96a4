"""A shared store that stops answering, or goes away and comes back, under kvflow's real
scheduler and worker engines: a real redis-server (the `redis` example transport),
frozen with SIGSTOP and killed with SIGKILL.

What a vLLM user is promised: lookups answer within `lookup_timeout_s` as misses (the
request computes its prompt), nothing crashes, and once the store answers again the
same prompts hit."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvflow.config import KVFlowConfig
from kvflow.observe.events import LookupAnswered, TransferDone
from kvflow.transport import Transport, TransportContext

from ..support.by_path import load
from ..support.kvflow_engines import PROMPT, Engine, lookup, prefill_cold, run_step

kvflow_redis = pytest.importorskip("kvflow_redis")


servers = load("plugins/kvflow_redis/tests/servers.py", "kvflow_redis_test_servers")


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Any]:
    if servers.binary() is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install -y redis-server)")
    with servers.standalone(tmp_path / "redis") as deployment:
        yield deployment


def _engine(start_engine: Callable[..., Engine], url: str) -> Engine:
    options = kvflow_redis.RedisOptions(url=url, timeout_s=2.0)

    def transport(context: TransportContext) -> Transport:
        t: Transport = kvflow_redis.RedisTransport(options, context)
        return t

    return start_engine("outage", config=KVFlowConfig(lookup_timeout_s=1.0), transport=transport)


def _save(e: Engine, req: str) -> None:
    run_step(e, prefill_cold(e, req, PROMPT, [1, 2, 3]))
    done = e.worker_events.wait_for(TransferDone, req)
    assert done.direction == "save" and done.chunks == 3, done


def test_a_frozen_then_dead_store_is_a_miss_and_hits_again_when_back(
    start_engine: Callable[..., Engine], redis: Any
) -> None:
    d = redis
    e = _engine(start_engine, d.url)
    proc = d.servers[0].proc
    _save(e, "saved")
    assert lookup(e, "warm", PROMPT) == len(PROMPT) - 1  # vLLM computes the last token

    proc.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        assert lookup(e, "frozen", PROMPT) == 0
        answered = e.sched_events.wait_for(LookupAnswered, "frozen")
        assert "lookup_timeout_s=1.0" in answered.error
    finally:
        proc.send_signal(signal.SIGCONT)
    assert lookup(e, "thawed", PROMPT) == len(PROMPT) - 1, "hits again once it answers"

    d.servers[0].kill()  # gone: connections refused
    assert lookup(e, "dead", PROMPT) == 0
    assert "redis lookup" in e.sched_events.wait_for(LookupAnswered, "dead").error
    d.servers[0].start()  # back, empty: the same port
    servers.wait_for("redis-server", lambda: servers.answers(d.servers[0].port), d.servers)
    assert lookup(e, "back", PROMPT) == 0, "a restarted cache starts empty"
    _save(e, "saved again")
    assert lookup(e, "hit again", PROMPT) == len(PROMPT) - 1
    assert e.sched.runtime.task_errors == 0 and e.worker.runtime.task_errors == 0
