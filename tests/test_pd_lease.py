"""P/D lease: a consumer claims a request's blocks as it arrives and renews the claim
while it waits; a producer holds claimed blocks past its hold timeout, frees them when
the claim lapses, and a consumer learns at once that a producer is gone.

The producer's deadlines run on trio's MockClock (time moves only when the test says);
the claims cross real ZMQ sockets between a consumer scheduler and a producer worker.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import trio
import trio.testing

from kvflow.config import KVFlowConfig
from kvflow.events import BlocksReleased, EventBus, LookupAnswered, Origin, TransferFailed
from kvflow.metadata import LoadSpec, OfferSpec, WorkerPlan
from kvflow.pd import PD_VERSION, PdParams
from kvflow.runtime import Runtime
from kvflow.scheduler import ScheduledRequest, SchedulerEngine
from kvflow_zmq import ZmqOptions, ZmqTransport

from .test_engines import (  # noqa: F401 - fixtures too
    BS,
    PROMPT,
    WAIT,
    Engine,
    MakeRuntime,
    Recorder,
    _context,
    _open,
    loop_held,
    run_step,
    start_engine,
    store,
)


def _zmq(_options: object, ctx: object) -> ZmqTransport:
    return ZmqTransport(ZmqOptions(), ctx)  # type: ignore[arg-type]


def _offer(e: Engine, req: str = "p-req") -> None:
    run_step(e, WorkerPlan(step=1, offers=[OfferSpec(req, [1, 2, 3], [4, 4, 2])], lent=[req]))


async def _advance(clock: trio.testing.MockClock, seconds: float) -> None:
    clock.jump(seconds)
    await trio.testing.wait_all_tasks_blocked()  # whatever the jump woke has run


def test_a_claimed_offer_outlives_the_hold_timeout_and_ends_when_the_claim_lapses(
    start_engine: Callable[..., Engine],
) -> None:
    clock = trio.testing.MockClock()  # time moves only in _advance
    e = start_engine(
        "producer",
        config=KVFlowConfig(hold_timeout_s=30.0),
        worker_transport=_zmq,
        worker_clock=clock,
    )
    _offer(e)
    rt, peer = e.worker.runtime, e.worker_transport
    assert isinstance(peer, ZmqTransport)

    def advance(seconds: float) -> bool:
        rt.call(_advance, clock, seconds, timeout=WAIT)
        return rt.call(trio.to_thread.run_sync, lambda: "p-req" in peer.held, timeout=WAIT)

    def renew(lease_s: float) -> dict[str, str]:
        async def go() -> dict[str, str]:
            return peer.held.renew(["p-req", "nobody"], lease_s).refused

        return rt.call(go, timeout=WAIT)

    assert advance(20)  # t=20: within the hold timeout, unclaimed
    assert renew(60.0) == {"nobody": "unknown or expired request"}  # claimed until t=80
    assert advance(40)  # t=60: past the 30 s hold timeout, still held for the consumer
    assert renew(60.0) == {"nobody": "unknown or expired request"}  # renewed until t=120
    assert advance(50)  # t=110
    assert not e.worker.take_results().finished_sending
    assert not advance(20)  # t=130: the consumer stopped renewing at t=60; the claim lapsed
    failed = e.worker_events.wait_for(TransferFailed, "p-req")
    assert failed.direction == "send" and failed.timed_out, failed
    assert "claim lapsed (lease of 60.0s not renewed)" in failed.reason
    e.worker_events.wait_for(BlocksReleased, "p-req")
    assert e.worker.take_results().finished_sending == {"p-req"}


def _pd(addresses: list[str], req: str = "p-req") -> PdParams:
    return PdParams(PD_VERSION, "producer", addresses, req, [1, 2, 3], len(PROMPT), BS)


def _consumer(make_runtime: MakeRuntime, **config: float) -> tuple[SchedulerEngine, Recorder]:
    """A P/D consumer's scheduler side with its real zmq transport (it sends the claims)."""
    rt: Runtime = make_runtime("consumer-sched")
    transport = ZmqTransport(ZmqOptions(), _context("scheduler", "ns", None))
    _open(rt, transport)
    bus, rec = EventBus(Origin("consumer", "scheduler")), Recorder()
    bus.subscribe(rec)
    sched = SchedulerEngine(
        config=KVFlowConfig(**config),
        transport=transport,
        runtime=rt,
        bus=bus,
        namespace="ns",
        block_size=BS,
        can_pull=True,
    )
    return sched, rec


def _planned_load(sched: SchedulerEngine, req: str) -> LoadSpec:
    n = sched.lookup(req, 0)
    assert n == len(PROMPT), n
    sched.allocated(req, [7, 8, 9], n)
    (load,) = sched.plan([ScheduledRequest(req, 0, 0, [7, 8, 9], True, PROMPT)]).loads
    return load


def test_a_consumer_claims_a_request_as_it_arrives_and_pulls_only_what_is_held(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    producer = start_engine("producer", worker_transport=_zmq)
    _offer(producer)
    sched, rec = _consumer(make_runtime)
    sched.add_request("d", PROMPT, pd=_pd([producer.worker_transport.address]))
    sched.add_request("late", PROMPT, pd=_pd([producer.worker_transport.address], "gone"))

    held = rec.wait_for(LookupAnswered, "d")
    assert held.hit_tokens == len(PROMPT) and not held.error, held
    assert _planned_load(sched, "d").error == ""

    refused = rec.wait_for(LookupAnswered, "late")
    assert refused.hit_tokens == 0, refused
    assert "refused gone: unknown or expired request" in refused.error
    load = _planned_load(sched, "late")  # planned, and failed by the worker at once
    assert load.error == refused.error


def _dead_address() -> str:
    """A loopback port nobody listens on (a producer that is gone)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_a_gone_producer_is_known_at_the_claim_and_the_load_fails_at_once(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    sched, rec = _consumer(make_runtime, lookup_timeout_s=0.5, load_timeout_s=600.0)
    address = _dead_address()
    with loop_held(sched.runtime):  # no answer can come meanwhile
        sched.add_request("d", PROMPT, pd=_pd([address]))
        assert sched.lookup("d", 0) is None  # vLLM asks again next step
    answer = rec.wait_for(LookupAnswered, "d")
    assert f"producer {address} did not answer its claim within 0.5s" in answer.error
    load = _planned_load(sched, "d")
    assert load.error == answer.error and load.asynchronous

    consumer = start_engine("consumer", worker_transport=_zmq)
    run_step(consumer, WorkerPlan(step=1, loads=[load]))
    failed = consumer.worker_events.wait_for(TransferFailed, "d")  # not load_timeout_s (600 s)
    assert failed.direction == "load" and not failed.timed_out, failed
    assert answer.error in failed.reason and failed.block_ids == [7, 8, 9]
    results = consumer.worker.take_results()
    assert results.finished_recving == {"d"} and results.failed_recving == {"d"}
