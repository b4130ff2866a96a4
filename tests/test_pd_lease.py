"""P/D lease: a consumer claims a request's blocks as it arrives and renews the claim
while it waits; a producer holds claimed blocks past its hold timeout, frees them when
the claim lapses, and a consumer learns at once that a producer is gone.

The producer's deadlines run on trio's MockClock (time moves only when the test says);
the claims cross real ZMQ sockets between a consumer scheduler and a producer worker.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence

import trio
import trio.testing

from kvflow.config import KVFlowConfig
from kvflow.events import BlocksReleased, EventBus, LookupAnswered, Origin, TransferFailed
from kvflow.metadata import LoadSpec, OfferSpec, WorkerPlan
from kvflow.pd import PD_VERSION, PdParams
from kvflow.runtime import Runtime
from kvflow.scheduler import ScheduledRequest, SchedulerEngine
from kvflow.transport import Renewed
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


def _offer(e: Engine, req: str = "p-req", step: int = 1) -> None:
    plan = WorkerPlan(step=step, offers=[OfferSpec(req, [1, 2, 3], [4, 4, 2])], lent=[req])
    run_step(e, plan)


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

    def renew(lease_s: float) -> Renewed:
        async def go() -> Renewed:
            return peer.held.renew(["p-req", "nobody"], lease_s)

        return rt.call(go, timeout=WAIT)

    assert advance(20)  # t=20: within the hold timeout, unclaimed
    assert renew(60.0) == Renewed({}, ["nobody"])  # claimed until t=80; nobody: not offered
    assert advance(40)  # t=60: past the 30 s hold timeout, still held for the consumer
    assert renew(60.0) == Renewed({}, ["nobody"])  # renewed until t=120
    assert advance(50)  # t=110
    assert not e.worker.take_results().finished_sending
    assert not advance(20)  # t=130: the consumer stopped renewing at t=60; the claim lapsed
    failed = e.worker_events.wait_for(TransferFailed, "p-req")
    assert failed.direction == "send" and failed.timed_out, failed
    assert "claim lapsed (lease of 60.0s not renewed)" in failed.reason
    e.worker_events.wait_for(BlocksReleased, "p-req")
    assert e.worker.take_results().finished_sending == {"p-req"}
    lapsed = renew(60.0).refused["p-req"]  # a consumer that comes back learns why
    assert lapsed == "expired: its hold timeout passed or its claim lapsed", lapsed


def _pd(addresses: list[str], req: str = "p-req") -> PdParams:
    return PdParams(PD_VERSION, "producer", addresses, req, [1, 2, 3], len(PROMPT), BS)


def _consumer(
    make_runtime: MakeRuntime, shards: int = 1, **config: float
) -> tuple[SchedulerEngine, Recorder]:
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
        num_shards=shards,
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
    clock = trio.testing.MockClock()  # time moves only when the test says
    producer = start_engine(
        "producer",
        config=KVFlowConfig(hold_timeout_s=30.0),
        worker_transport=_zmq,
        worker_clock=clock,
    )
    _offer(producer, "gone")
    for seconds in (0.0, 31.0):  # the offer holds from t=0; nobody claims it by t=31
        producer.worker.runtime.call(_advance, clock, seconds, timeout=WAIT)
    producer.worker_events.wait_for(BlocksReleased, "gone")
    _offer(producer, step=2)
    sched, rec = _consumer(make_runtime)
    sched.add_request("d", PROMPT, pd=_pd([producer.worker_transport.address]))
    sched.add_request("late", PROMPT, pd=_pd([producer.worker_transport.address], "gone"))

    held = rec.wait_for(LookupAnswered, "d")
    assert held.hit_tokens == len(PROMPT) and not held.error, held
    assert _planned_load(sched, "d").error == ""

    refused = rec.wait_for(LookupAnswered, "late")
    assert refused.hit_tokens == 0, refused
    assert "refused gone: expired: its hold timeout passed" in refused.error, refused
    load = _planned_load(sched, "late")  # planned, and failed by the worker at once
    assert load.error == refused.error


def _watch_answers(e: Engine, req: str = "p-req") -> threading.Event:
    """Set once `e`'s producer worker answered a claim of `req` (pending or refused)."""
    peer = e.worker_transport
    assert isinstance(peer, ZmqTransport)
    answered, renew = threading.Event(), peer.held.renew

    def watched(reqs: Sequence[str], lease_s: float) -> Renewed:  # the real answer, seen
        answer = renew(reqs, lease_s)
        if req in answer.pending or req in answer.refused:
            answered.set()
        return answer

    peer.held.renew = watched  # type: ignore[method-assign]
    return answered


def test_a_claim_that_reaches_the_producer_before_its_offer_is_held_once_offered(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    """vLLM's API server answers the prefill as the request finishes; the producer's worker
    learns of the offer with a later step's metadata (with async scheduling, after the
    next forward). A claim arriving in between is not refused: it asks again."""
    producer = start_engine("producer", worker_transport=_zmq)
    answered_early = _watch_answers(producer)
    sched, rec = _consumer(make_runtime)
    sched.add_request("d", PROMPT, pd=_pd([producer.worker_transport.address]))
    assert answered_early.wait(WAIT), "the producer did not answer the claim"
    _offer(producer)  # the producer's next step binds the offer
    held = rec.wait_for(LookupAnswered, "d")
    assert held.hit_tokens == len(PROMPT) and not held.error, held
    assert _planned_load(sched, "d").error == ""
    assert sched.lookup("d", 0) == len(PROMPT)


def test_a_tensor_parallel_claim_waits_for_the_shard_that_has_not_offered_yet(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    """Two producer workers (tensor-parallel ranks) bind the same step's offer at
    different times: the claim is held once both hold their shard."""
    rank0, rank1 = (
        start_engine("producer-0", worker_transport=_zmq),
        start_engine("producer-1", worker_transport=_zmq),
    )
    _offer(rank0)
    rank1_early = _watch_answers(rank1)
    sched, rec = _consumer(make_runtime, shards=2)
    addresses = [rank0.worker_transport.address, rank1.worker_transport.address]
    sched.add_request("d", PROMPT, pd=_pd(addresses))
    assert rank1_early.wait(WAIT), "rank 1 did not answer the claim"
    assert sched.lookup("d", 0) is None  # rank 0 holds, rank 1 not yet: vLLM asks again
    _offer(rank1)
    held = rec.wait_for(LookupAnswered, "d")
    assert held.hit_tokens == len(PROMPT) and not held.error, held
    assert sched.lookup("d", 0) == len(PROMPT)


def test_a_claim_the_producer_never_offers_fails_after_lookup_timeout(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    producer = start_engine("producer", worker_transport=_zmq)
    address = producer.worker_transport.address
    sched, rec = _consumer(make_runtime, lookup_timeout_s=0.5)
    sched.add_request("d", PROMPT, pd=_pd([address], "never"))
    answer = rec.wait_for(LookupAnswered, "d")
    assert answer.hit_tokens == 0, answer
    assert f"producer {address} has not offered never within 0.5s" in answer.error, answer
    assert _planned_load(sched, "d").error == answer.error


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
