"""The peer conformance suite against the `zmq` transport on real sockets, and checked
itself: each deliberately broken variant fails the test guarding the promise it breaks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
import zmq

from kvflow.geometry.layout import KVLayout
from kvflow.testing.conformance import ContractViolation
from kvflow.testing.layouts import fill_blocks
from kvflow.testing.peer_conformance import PeerConformance, PeerPromise
from kvflow.transport import (
    ChunkMissing,
    LoadJob,
    Offer,
    PeerSource,
    TransportContext,
    TransportError,
)
from kvflow.zmqio import TrioSocket
from kvflow_zmq import ZmqOptions, ZmqTransport
from kvflow_zmq import _wire as wire

from ..support.zmq_standins import InProcessDevice, StandInIpcZmq, as_device


class TestZmqConformance(PeerConformance):
    @pytest.fixture
    def make_transport(self) -> Callable[[TransportContext], ZmqTransport]:
        return lambda context: ZmqTransport(ZmqOptions(), context)


# -- broken variants: each must fail the test guarding the promise it breaks ----------


class NeverReleases(ZmqTransport):
    """Ignores the consumer's Done and Failed: holds the blocks until the deadline."""

    async def open(self) -> None:
        await super().open()
        self.held.release = lambda *args, **kw: False  # type: ignore[method-assign]


class FlipsAByte(ZmqTransport):
    async def load(self, job: LoadJob) -> None:
        await super().load(job)
        job.spans(job.num_layers - 1)[-1][0][0] ^= 0xFF


class RefusalIsNotMissing(ZmqTransport):
    async def load(self, job: LoadJob) -> None:
        try:
            await super().load(job)
        except ChunkMissing as exc:
            raise TransportError(str(exc)) from None


class PullsFromShard0(ZmqTransport):
    async def load(self, job: LoadJob) -> None:
        assert job.source is not None
        src = msgspec.structs.replace(job.source, addresses=job.source.addresses[:1] * 2)
        await super().load(dataclasses.replace(job, source=src))


P = PeerPromise
BROKEN = [
    (NeverReleases, "pull_moves_the_offered_blocks", P.DONE),
    (NeverReleases, "a_consumer_that_gives_up_releases_the_blocks", P.RELEASE),
    (FlipsAByte, "pull_moves_the_offered_blocks", P.PULL),
    (RefusalIsNotMissing, "pull_of_an_unknown_request_is_refused", P.REFUSED),
    (RefusalIsNotMissing, "an_expired_offer_is_refused", P.REFUSED),
    (PullsFromShard0, "each_shard_pulls_its_own_slice", P.PULL),
]


@pytest.mark.parametrize(
    ("broken", "test", "promise"), BROKEN, ids=[f"{b.__name__}-{t}" for b, t, _ in BROKEN]
)
async def test_suite_catches_broken_peer_transport(
    broken: type[ZmqTransport], test: str, promise: str
) -> None:
    suite = PeerConformance()
    suite.progress_timeout_s = 1.0
    make = lambda context: broken(ZmqOptions(), context)  # noqa: E731
    async with suite.harness(make, suite.build_layout(True)) as kv:
        with pytest.raises(ContractViolation) as caught:
            await getattr(suite, f"test_{test}")(kv)
    assert str(caught.value).startswith(f"Transport contract broken: {promise}"), caught.value


# -- the CUDA IPC path, with an in-process stand-in for the GPU -----------------------


class TestZmqIpcConformance(PeerConformance):
    """The IPC path: layouts labelled `cuda` (host tensors, and host views for the suite's
    own checks), so the transport copies blocks with torch instead of sending frames."""

    def build_layout(self, block_granular: bool, **kw: Any) -> KVLayout:
        return as_device(super().build_layout(block_granular, **kw))

    @pytest.fixture
    def make_transport(self) -> Callable[[TransportContext], ZmqTransport]:
        return lambda context: StandInIpcZmq(ZmqOptions(), context)


async def test_ipc_handles_are_opened_once_per_producer() -> None:
    suite = TestZmqIpcConformance()
    make = lambda context: StandInIpcZmq(ZmqOptions(), context)  # noqa: E731
    async with suite.harness(make, suite.build_layout(True)) as kv:
        producer, consumer = await kv.worker(), await kv.worker()
        before = InProcessDevice.opened
        for i in range(3):
            await suite.pull(kv, producer, consumer, kv.chunks(2), req=f"r{i}")
        assert InProcessDevice.opened - before == kv.layout.num_layers


async def test_ipc_consumer_refuses_a_host_memory_producer() -> None:
    suite = PeerConformance()
    host, device = suite.build_layout(True), as_device(suite.build_layout(True))
    async with suite.harness(lambda c: StandInIpcZmq(ZmqOptions(), c), host) as kv:
        producer = await kv.worker(layout=host)
        consumer = await kv.worker(layout=device)
        src = kv.chunks(1, layout=host)
        job, _ = kv.load_job(src.at([9]), host, source=suite.source([producer], "r", src))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.offer, suite.offer_of(kv, "r", src, host))
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(TransportError, match="both sides need the same kind"):
                await consumer.load(job)
            nursery.cancel_scope.cancel()


async def test_ipc_lease_hands_blocks_back_if_the_consumer_never_answers() -> None:
    """A consumer that got the handles and vanished: the producer lets go after
    ipc_lease_s, not never."""
    layout = as_device(PeerConformance().build_layout(True))
    ctx = TransportContext("e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"])
    producer = StandInIpcZmq(ZmqOptions(ipc_lease_s=5.0), ctx)
    await producer.open()
    await producer.register(layout)
    returned = trio.Event()
    with trio.fail_after(3):  # MockClock autojump is not used: real sockets
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)

            async def hold() -> None:
                spans = lambda layer: [layout.spans(layer, 1, layout.block_size)]  # noqa: E731
                with trio.move_on_after(0.2):  # the hold deadline passes during the lease
                    await producer.offer(Offer("r", [1], [layout.block_size], 3, spans))
                returned.set()

            nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            dealer = TrioSocket(zmq.Context.instance().socket(zmq.DEALER))
            dealer.sock.connect(producer.address)
            await dealer.send_multipart([wire.encode(wire.Pull("r"))])
            reply = wire.decode_to_consumer((await dealer.recv_multipart())[0])
            assert isinstance(reply, wire.Ipc) and reply.lease_s == 5.0
            with trio.move_on_after(0.5):
                await returned.wait()
            assert not returned.is_set(), "blocks handed back while the consumer may read"
            producer.held.release("r", "consumer gave up")  # what Failed does
            await returned.wait()
            dealer.close()
            nursery.cancel_scope.cancel()
    await producer.aclose()


@pytest.mark.parametrize("kind", ["nhd", "hnd"])
async def test_ipc_consumer_with_more_blocks_than_the_producer(kind: str) -> None:
    """Prefill and decode instances size their caches differently; in NHD/HND the V half
    starts after all K blocks, so only the blocks' shape must match, not the offsets."""
    suite = PeerConformance()
    prod = as_device(suite.build_layout(False, num_blocks=16, hnd=kind == "hnd"))
    cons = as_device(suite.build_layout(False, num_blocks=23, hnd=kind == "hnd"))
    fill_blocks(prod, [2, 5], seed=3)
    ctx = lambda layout: TransportContext(  # noqa: E731
        "e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout
    )
    producer, consumer = (
        StandInIpcZmq(ZmqOptions(), ctx(prod)),
        StandInIpcZmq(ZmqOptions(), ctx(cons)),
    )
    for t, layout in ((producer, prod), (consumer, cons)):
        await t.open()
        await t.register(layout)
    counts = [prod.block_size, 3]
    spans = lambda layer: [prod.spans(layer, b, n) for b, n in zip([2, 5], counts, strict=True)]  # noqa: E731
    job = LoadJob(
        "c",
        ["k1", "k2"],
        counts,
        cons.num_layers,
        lambda layer: [cons.spans(layer, b, n) for b, n in zip([20, 7], counts, strict=True)],
        lambda layer: None,
        PeerSource("e", [producer.address], "r", [2, 5]),
        [20, 7],
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            nursery.start_soon(producer.offer, Offer("r", [2, 5], counts, prod.num_layers, spans))
            await trio.testing.wait_all_tasks_blocked()
            await consumer.load(job)
            nursery.cancel_scope.cancel()
    for layer in range(prod.num_layers):
        for a, b, n in zip([2, 5], [20, 7], counts, strict=True):
            got = b"".join(bytes(s) for s in cons.spans(layer, b, n))
            assert got == b"".join(bytes(s) for s in prod.spans(layer, a, n))
    await consumer.aclose()
    await producer.aclose()
