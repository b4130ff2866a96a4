"""P/D lease: a consumer claims a request's blocks as it arrives and renews the claim
while it waits; a producer holds claimed blocks past its hold timeout, frees them when
the claim lapses or its claimant (and no other consumer) releases them, and a consumer
learns at once that a producer is gone.

The producer's deadlines run on trio's MockClock (time moves only when the test says);
the claims cross real ZMQ sockets between a consumer scheduler and a producer worker.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import trio
import trio.testing

from kvflow.config import KVFlowConfig
from kvflow.engine.metadata import LoadSpec, OfferSpec, WorkerPlan
from kvflow.engine.scheduler import ScheduledRequest, SchedulerEngine
from kvflow.observe.events import (
    BlocksReleased,
    ClaimSent,
    EventBus,
    LookupAnswered,
    Origin,
    TaskFailed,
    TransferDone,
    TransferFailed,
)
from kvflow.observe.stats import StatsCollector
from kvflow.pd.offers import HeldOffers
from kvflow.pd.params import PD_VERSION, UNSET_SHAPE, PdParams
from kvflow.pd.security import Channel, prompt_digest
from kvflow.runtime import GIVE_UP_AFTER, KVFlowFatal, Runtime
from kvflow.transport import Offer, Renewed
from kvflow_zmq import ZmqOptions, ZmqTransport

from ..support.kvflow_engines import (
    BS,
    PROMPT,
    WAIT,
    Engine,
    MakeRuntime,
    Recorder,
    loop_held,
    open_transport,
    run_step,
    transport_context,
)
from ..support.side_channel_attacks import HANG_GUARD_S, hold, honest_pull, peers, worker


def _zmq(_options: object, ctx: object) -> ZmqTransport:
    return ZmqTransport(ZmqOptions(), ctx)  # type: ignore[arg-type]


def _oid(req: str) -> str:
    """The offer id a producer scheduler would give `req` (random there; fixed here)."""
    return req.encode().hex().ljust(32, "0")


def _offer(e: Engine, req: str = "p-req", step: int = 1) -> None:
    offer = OfferSpec(req, [1, 2, 3], [4, 4, 2], _oid(req))
    run_step(e, WorkerPlan(step=step, offers=[offer], lent=[req]))


P_REQ, NOBODY = _oid("p-req"), _oid("nobody")


async def _advance(clock: trio.testing.MockClock, seconds: float) -> None:
    clock.jump(seconds)
    await trio.testing.wait_all_tasks_blocked()  # whatever the jump woke has run


def test_a_claimed_offer_outlives_the_hold_timeout_and_ends_when_the_claim_lapses(
    start_engine: Callable[..., Engine],
) -> None:
    clock = trio.testing.MockClock()  # time moves only in _advance
    e = start_engine(
        "producer",
        config=KVFlowConfig(hold_timeout_s=30.0, lease_s=60.0),
        worker_transport=_zmq,
        worker_clock=clock,
    )
    _offer(e)
    rt, peer = e.worker.runtime, e.worker_transport
    assert isinstance(peer, ZmqTransport)

    def advance(seconds: float) -> bool:
        rt.call(_advance, clock, seconds, timeout=WAIT)
        return rt.call(trio.to_thread.run_sync, lambda: P_REQ in peer.held, timeout=WAIT)

    def renew(lease_s: float) -> Renewed:
        async def go() -> Renewed:
            return peer.held.renew([P_REQ, NOBODY], lease_s)

        return rt.call(go, timeout=WAIT)

    assert advance(20)  # t=20: within the hold timeout, unclaimed
    assert renew(60.0) == Renewed({}, [NOBODY])  # claimed until t=80; nobody: not offered
    assert advance(40)  # t=60: past the 30 s hold timeout, still held for the consumer
    assert renew(60.0) == Renewed({}, [NOBODY])  # renewed until t=120
    assert advance(50)  # t=110
    assert not e.worker.take_results().finished_sending
    assert not advance(20)  # t=130: the consumer stopped renewing at t=60; the claim lapsed
    failed = e.worker_events.wait_for(TransferFailed, "p-req")
    assert failed.direction == "send" and failed.timed_out, failed
    assert "claim lapsed (lease of 60.0s not renewed)" in failed.reason
    e.worker_events.wait_for(BlocksReleased, "p-req")
    assert e.worker.take_results().finished_sending == {"p-req"}
    lapsed = renew(60.0).refused[P_REQ]  # a consumer that comes back learns why
    assert lapsed == "expired: its hold timeout passed or its claim lapsed", lapsed


def test_a_renewal_holds_no_longer_than_the_producers_lease_nor_max_hold_s(
    start_engine: Callable[..., Engine],
) -> None:
    """Issue 27, finding 2: a renewal names its own lease. One asking for ~forever holds
    the blocks the producer's `lease_s`; renewals, however many, end at `max_hold_s`."""
    clock = trio.testing.MockClock()
    e = start_engine(
        "producer",
        config=KVFlowConfig(hold_timeout_s=30.0, lease_s=30.0, max_hold_s=100.0),
        worker_transport=_zmq,
        worker_clock=clock,
    )
    rt, peer = e.worker.runtime, e.worker_transport
    assert isinstance(peer, ZmqTransport)

    def advance(seconds: float, offer: str) -> bool:
        rt.call(_advance, clock, seconds, timeout=WAIT)
        return rt.call(trio.to_thread.run_sync, lambda: offer in peer.held, timeout=WAIT)

    def renew(offer: str, lease_s: float) -> None:
        async def go() -> Renewed:
            return peer.held.renew([offer], lease_s)

        assert rt.call(go, timeout=WAIT) == Renewed({})

    _offer(e, "greedy")
    assert advance(0, _oid("greedy"))  # the offer is bound
    renew(_oid("greedy"), 1e15)  # 10**18 ms
    assert advance(29, _oid("greedy"))
    assert not advance(2, _oid("greedy")), "held past the producer's lease_s"
    failed = e.worker_events.wait_for(TransferFailed, "greedy")
    assert "claim lapsed (lease of 30.0s not renewed)" in failed.reason, failed

    _offer(e, "renewed", step=2)  # from t=31, renewed every 20 s: held until t=131
    assert advance(0, _oid("renewed"))
    for _ in range(4):
        renew(_oid("renewed"), 30.0)
        assert advance(20, _oid("renewed"))  # t=51, 71, 91, 111
    renew(_oid("renewed"), 30.0)
    assert not advance(21, _oid("renewed")), "held past max_hold_s"  # t=132
    failed = e.worker_events.wait_for(TransferFailed, "renewed")
    assert "held max_hold_s=100.0 without a pull" in failed.reason, failed


def _pd(addresses: list[str], req: str = "p-req") -> PdParams:
    digest = prompt_digest(PROMPT, scope="ns")  # the consumer's namespace, below
    return PdParams(
        PD_VERSION,
        "producer",
        addresses,
        _oid(req),
        [1, 2, 3],
        len(PROMPT),
        BS,
        digest,
        UNSET_SHAPE,
        tp_size=len(addresses),
        pp_size=1,
    )


def _consumer(
    make_runtime: MakeRuntime, shards: int = 1, **config: float
) -> tuple[SchedulerEngine, Recorder]:
    """A P/D consumer's scheduler side with its real zmq transport (it sends the claims)."""
    rt: Runtime = make_runtime("consumer-sched")
    transport = ZmqTransport(ZmqOptions(), transport_context("scheduler", "ns", None))
    open_transport(rt, transport)
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
        tp_size=shards,
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
    assert f"refused {_oid('gone')}: expired: its hold timeout passed" in refused.error
    load = _planned_load(sched, "late")  # planned, and failed by the worker at once
    assert load.error == refused.error


def _watch_answers(e: Engine, req: str = "p-req") -> threading.Event:
    """Set once `e`'s producer worker answered a claim of `req` (pending or refused)."""
    peer = e.worker_transport
    assert isinstance(peer, ZmqTransport)
    answered, renew = threading.Event(), peer.held.renew

    def watched(reqs: Sequence[str], lease_s: float, consumer: str = "") -> Renewed:
        answer = renew(reqs, lease_s, consumer)  # the real answer, seen
        if _oid(req) in answer.pending or _oid(req) in answer.refused:
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


def test_a_new_claim_is_answered_while_another_producer_hangs_on_a_renewal(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    """Issue 49: a new claim went out with the next round of renewals, and a round waits
    for every producer's answer, so one slow producer (busy serving a pull, or hung)
    held every new claim to every other producer. A new claim is now asked on its own."""
    slow = start_engine("producer-slow", worker_transport=_zmq)
    fast = start_engine("producer-fast", worker_transport=_zmq)
    _offer(slow, "a-req")
    _offer(fast)
    sched, rec = _consumer(make_runtime, progress_timeout_s=600.0, lookup_timeout_s=600.0)
    sched.add_request("d1", PROMPT, pd=_pd([slow.worker_transport.address], "a-req"))
    assert not rec.wait_for(LookupAnswered, "d1").error
    with loop_held(slow.worker.runtime):  # it answers nothing now (for up to 600 s)
        sched.add_request("d2", PROMPT, pd=_pd([slow.worker_transport.address], "a-req"))
        rec.wait_for(ClaimSent, "d2")  # its ask waits on the slow producer
        sched.add_request("e", PROMPT, pd=_pd([fast.worker_transport.address]))
        held = rec.wait_for(LookupAnswered, "e")
        assert held.hit_tokens == len(PROMPT) and not held.error, held


def test_new_claims_to_one_producer_go_out_together(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    """New claims are asked apart from the rounds, but together per producer: a burst of
    requests costs the producer one renewal (one connection, one handshake when keyed),
    not one each."""
    producer = start_engine("producer", worker_transport=_zmq)
    reqs = [f"p{i}" for i in range(8)]
    for step, req in enumerate(reqs, 1):
        _offer(producer, req, step=step)
    peer = producer.worker_transport
    assert isinstance(peer, ZmqTransport)
    asked: list[int] = []  # each renewal: how many of the burst's offers it carried
    offers, renew = {_oid(r) for r in reqs}, peer.held.renew

    def counted(claimed: Sequence[str], lease_s: float, consumer: str = "") -> Renewed:
        if ours := [r for r in claimed if r in offers]:
            asked.append(len(ours))
        return renew(claimed, lease_s, consumer)

    sched, rec = _consumer(make_runtime)
    _offer(producer, "first", step=len(reqs) + 1)
    sched.add_request("d-first", PROMPT, pd=_pd([peer.address], "first"))
    assert not rec.wait_for(LookupAnswered, "d-first").error  # the renewals run
    peer.held.renew = counted  # type: ignore[method-assign]
    with loop_held(sched.runtime):  # the claims arrive together
        for req in reqs:
            sched.add_request(f"d-{req}", PROMPT, pd=_pd([peer.address], req))
    for req in reqs:
        assert not rec.wait_for(LookupAnswered, f"d-{req}").error
    assert asked[0] == len(reqs), asked  # (a round may renew them all since)


class _SlowSend(ZmqTransport):
    """A producer whose answer to a pull takes until `go` is set (as a pull of many MiB
    on a core busy with prefills takes long)."""

    sending, go = threading.Event(), threading.Event()

    async def _send(self, *args: Any) -> bool:
        self.sending.set()
        await trio.to_thread.run_sync(self.go.wait, WAIT)
        return await super()._send(*args)


def test_a_producer_answers_claims_while_it_answers_a_pull(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    """Issue 49: a `zmq` producer answered a pull in its serving loop, so a claim that
    came meanwhile waited for the whole pull (or, past `progress_timeout_s`, was refused:
    the request recomputed). The pull is now answered in a task of its own."""
    producer = start_engine(
        "producer", worker_transport=lambda _o, ctx: _SlowSend(ZmqOptions(), ctx)
    )
    _offer(producer)
    _offer(producer, "q-req", step=2)
    sched, rec = _consumer(make_runtime)
    sched.add_request("d", PROMPT, pd=_pd([producer.worker_transport.address]))
    assert not rec.wait_for(LookupAnswered, "d").error
    consumer = start_engine("consumer", worker_transport=_zmq)
    try:
        run_step(consumer, WorkerPlan(step=1, loads=[_planned_load(sched, "d")]))
        assert _SlowSend.sending.wait(WAIT)  # the producer is answering d's pull
        sched.add_request("d2", PROMPT, pd=_pd([producer.worker_transport.address], "q-req"))
        held = rec.wait_for(LookupAnswered, "d2")
        assert held.hit_tokens == len(PROMPT) and not held.error, held
    finally:
        _SlowSend.go.set()
    consumer.worker_events.wait_for(TransferDone, "d")


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


def test_a_producers_serving_task_that_fails_is_started_again(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    """Issue 28, item 3: a peer transport's `serve` that ended by an exception stayed
    dead (every later claim and pull unanswered while the server looked healthy). The
    worker now starts it again: a claim after the failure is held."""
    failed: list[str] = []

    class Flaky(ZmqTransport):
        async def serving(self, nursery: trio.Nursery) -> None:
            if not failed:
                failed.append("serve")
                raise RuntimeError("a bug in serve")
            await super().serving(nursery)

    producer = start_engine("producer", worker_transport=lambda _o, ctx: Flaky(ZmqOptions(), ctx))
    stats = StatsCollector()
    producer.worker.bus.subscribe(stats)
    _offer(producer)
    sched, rec = _consumer(make_runtime)
    sched.add_request("d", PROMPT, pd=_pd([producer.worker_transport.address]))
    held = rec.wait_for(LookupAnswered, "d")
    assert held.hit_tokens == len(PROMPT) and not held.error, held
    assert failed == ["serve"]
    restart = producer.worker_events.wait_for(TaskFailed)
    assert restart.task == "zmq:serve" and not restart.given_up, restart
    assert restart.error == "RuntimeError: a bug in serve"
    data = stats.take()  # vllm:kvflow_task_restarts_total{task="zmq:serve"}
    assert data is not None and data["task_restarts"] == {"zmq:serve": 1}, data


def test_a_producers_serving_task_that_cannot_be_restarted_stops_the_engine(
    start_engine: Callable[..., Engine],
) -> None:
    """Issue 28, item 3: a `serve` that fails every time it starts must not leave the
    engine serving with P/D off while its health check says all is well: after
    `GIVE_UP_AFTER` failures in a row vLLM's thread gets `KVFlowFatal` at its next call
    (vLLM's engine stops, and its `/health` fails)."""

    class Broken(ZmqTransport):
        async def serving(self, nursery: trio.Nursery) -> None:
            raise OSError("the side channel's socket is gone")

    producer = start_engine("producer", worker_transport=lambda _o, ctx: Broken(ZmqOptions(), ctx))
    events = producer.worker_events
    events.wait_for(TaskFailed, count=GIVE_UP_AFTER)
    *restarts, last = events.of(TaskFailed)
    assert [r.given_up for r in restarts] == [False] * (GIVE_UP_AFTER - 1)
    assert last.given_up and last.task == "zmq:serve", last
    with pytest.raises(KVFlowFatal, match=r"zmq:serve failed 5 times in a row \(last: OSError"):
        run_step(producer, WorkerPlan(step=1))


def test_claims_that_cannot_be_restarted_stop_the_consumers_scheduler(
    make_runtime: MakeRuntime,
) -> None:
    """Issue 28, item 3, the consumer's side: renewals that fail for good stop the
    engine at its next step, rather than leave every P/D request waiting on claims no
    task renews."""
    sched, rec = _consumer(make_runtime)
    claims = sched._claims
    assert claims is not None

    async def broken(*_args: object) -> None:
        raise RuntimeError("a bug in the renewals")

    claims._renew_at = broken  # type: ignore[method-assign]
    sched.add_request("d", PROMPT, pd=_pd([_dead_address()]))
    rec.wait_for(TaskFailed, count=GIVE_UP_AFTER)
    assert rec.of(TaskFailed)[-1].given_up
    with pytest.raises(KVFlowFatal, match=r"pd-claims failed 5 times in a row"):
        sched.plan([])


def test_a_claim_the_producer_never_offers_fails_after_lookup_timeout(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    producer = start_engine("producer", worker_transport=_zmq)
    address = producer.worker_transport.address
    sched, rec = _consumer(make_runtime, lookup_timeout_s=0.5)
    sched.add_request("d", PROMPT, pd=_pd([address], "never"))
    answer = rec.wait_for(LookupAnswered, "d")
    assert answer.hit_tokens == 0, answer
    assert f"producer {address} has not offered {_oid('never')} within 0.5s" in answer.error
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


def test_a_producer_that_hangs_mid_pull_fails_the_load_within_progress_timeout(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    """Issue 28, item 2: a producer that hung after its claim was held (SIGSTOP, a stuck
    GPU, a partition) cost the whole `load_timeout_s`. Its silence now fails the load
    after `progress_timeout_s`, and once it runs again its blocks go back."""
    producer = start_engine("producer", worker_transport=_zmq)
    _offer(producer)
    sched, rec = _consumer(make_runtime, load_timeout_s=600.0)
    sched.add_request("d", PROMPT, pd=_pd([producer.worker_transport.address]))
    held = rec.wait_for(LookupAnswered, "d")
    assert held.hit_tokens == len(PROMPT) and not held.error, held
    load = _planned_load(sched, "d")
    consumer = start_engine(
        "consumer", config=KVFlowConfig(load_timeout_s=600.0), worker_transport=_zmq
    )
    consumer.worker_transport.context.progress_timeout_s = 0.5
    with loop_held(producer.worker.runtime):  # the producer hangs before it answers
        run_step(consumer, WorkerPlan(step=1, loads=[load]))
        failed = consumer.worker_events.wait_for(TransferFailed, "d")
    assert failed.direction == "load" and not failed.timed_out, failed
    assert "sent nothing for 0.5s while" in failed.reason, failed.reason
    results = consumer.worker.take_results()
    assert results.finished_recving == {"d"} and results.failed_recving == {"d"}
    producer.worker_events.wait_for(BlocksReleased, "p-req")  # awake again: handed back


def _claimed(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> tuple[Engine, SchedulerEngine]:
    """A producer holding an offer (its hold timeout 600 s) and a consumer's scheduler
    whose claim on it is held."""
    producer = start_engine(
        "producer", config=KVFlowConfig(hold_timeout_s=600.0), worker_transport=_zmq
    )
    _offer(producer)
    sched, rec = _consumer(make_runtime)
    sched.add_request("d", PROMPT, pd=_pd([producer.worker_transport.address]))
    held = rec.wait_for(LookupAnswered, "d")
    assert held.hit_tokens == len(PROMPT) and not held.error, held
    return producer, sched


def _released(producer: Engine) -> TransferFailed:
    """The producer's offer of p-req, ended by its consumer's release; its blocks back."""
    failed = producer.worker_events.wait_for(TransferFailed, "p-req")
    assert "released unpulled by its consumer" in failed.reason, failed.reason
    producer.worker_events.wait_for(BlocksReleased, "p-req")
    return failed


def test_a_request_that_ends_before_its_pull_hands_the_producers_blocks_back_at_once(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    """Issue 28, item 4: a consumer request aborted while it waited in the queue left the
    producer holding its blocks until `hold_timeout_s` (here 600 s). Its end now tells
    the producer, which hands them back at once."""
    producer, sched = _claimed(start_engine, make_runtime)
    assert sched.finished("d") == (False, None)  # aborted before vLLM scheduled it
    failed = _released(producer)
    assert failed.direction == "send" and not failed.timed_out, failed
    assert producer.worker.take_results().finished_sending == {"p-req"}


def test_a_request_refused_for_its_shape_hands_the_producers_blocks_back_at_once(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    """Issue 28, item 4: a consumer that refuses signed P/D params for its shape (here
    another pipeline parallel size) computes the prompt itself and tells the producer it
    will not pull."""
    producer = start_engine(
        "producer", config=KVFlowConfig(hold_timeout_s=600.0), worker_transport=_zmq
    )
    _offer(producer)
    sched, _rec = _consumer(make_runtime)
    sched.pp_size = 2
    sched.add_request("d", PROMPT, pd=_pd([producer.worker_transport.address]))
    assert not sched.is_remote("d")
    _released(producer)


def test_a_pull_that_failed_releases_the_producers_blocks_too(
    start_engine: Callable[..., Engine], make_runtime: MakeRuntime
) -> None:
    """A consumer's failed pull tells the producer with `Failed` on the pull's socket,
    which a hung producer never reads (scripts/faults.py, producer-stop-queued: its blocks
    came back only when the claim lapsed, 27 s after SIGCONT). The consumer's scheduler
    now releases the offer as well, so a producer that did not see the pull frees them
    as soon as it hears."""
    producer, sched = _claimed(start_engine, make_runtime)
    _planned_load(sched, "d")  # sent to the workers, whose pull never reached the producer
    sched.loads_failed(["d"])
    _released(producer)


async def test_only_the_consumer_that_claimed_an_offer_may_release_it() -> None:
    """Issue 46 (Low): `release_unpulled` ended any offer a renewal named, whoever sent
    it. The first consumer to renew an offer claims it: another consumer with the key
    that releases it (or renews it) is refused, the offer stays held for its claimant,
    who pulls identical bytes; a claimant's own release still hands the blocks back."""
    channel = Channel(os.urandom(32), "kv-in-clear")
    async with peers("zmq", channel) as p, worker("zmq", channel) as (other, _):
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(p.producer.serve)
                address = p.producer.address
                held = await hold(p, nursery)
                assert await p.consumer.renew(address, [held.offer], 60.0) == Renewed({}, [])
                answer = await other.renew(address, [held.offer], 60.0, release=[held.offer])
                assert held.offer in p.producer.held, "another consumer released the offer"
                assert answer == Renewed({held.offer: "claimed by another consumer"}), answer
                assert await p.consumer.renew(address, [held.offer], 60.0) == Renewed({}, [])
                await honest_pull(p, held)

                mine = await hold(p, nursery)  # a claimant's release still counts
                assert await p.consumer.renew(address, [mine.offer], 60.0) == Renewed({}, [])
                await p.consumer.renew(address, [], 60.0, release=[mine.offer])
                await mine.released.wait()
                assert mine.outcome == ["released unpulled by its consumer"]
                nursery.cancel_scope.cancel()


async def test_a_streamed_offer_its_transport_reads_whole_is_claimed_once_computed() -> None:
    """A transport that reads a streamed offer only once every layer is computed (`nixl`:
    the consumer READs it by itself): a claim of it is pending until then, so the
    consumer's pull never waits on the producer's forward (a long prompt's would outlast
    its `progress_timeout_s`)."""
    held = HeldOffers()
    forward = trio.Event()

    async def computed(_layer: int) -> None:
        await forward.wait()

    offer = Offer("s", [1], [4], 2, lambda _layer: [], params=b"signed", computed=computed)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(held.offer, offer, whole=True))
        await trio.testing.wait_all_tasks_blocked()
        assert held.renew(["s"], 5.0, "c") == Renewed({}, ["s"]), "pending while computing"
        forward.set()
        await trio.testing.wait_all_tasks_blocked()
        assert held.renew(["s"], 5.0, "c") == Renewed({}, [], {"s": b"signed"})
        nursery.cancel_scope.cancel()
