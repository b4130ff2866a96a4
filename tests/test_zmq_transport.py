"""The `zmq` peer transport on real sockets: a producer serves held blocks, a consumer
pulls them into its own KV memory."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from kvflow.layout import KVLayout
from kvflow.testing.layouts import fill_blocks, make_layout
from kvflow.transport import ChunkMissing, LoadJob, Offer, PeerSource, TransportContext
from kvflow_zmq import ZmqOptions, ZmqTransport

BS = 4


def _ctx(layout: KVLayout) -> TransportContext:
    return TransportContext("e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout)


@pytest.fixture(params=[False, True], ids=["nhd", "block-granular"])
def layouts(request: pytest.FixtureRequest) -> tuple[KVLayout, KVLayout]:
    prod = make_layout(num_layers=3, block_size=BS, block_granular=request.param)
    cons = make_layout(num_layers=3, block_size=BS, block_granular=request.param)
    fill_blocks(prod, [1, 2, 3], seed=5)
    return prod, cons


@pytest.fixture
async def pair(layouts: tuple[KVLayout, KVLayout]) -> AsyncIterator[tuple[ZmqTransport, ...]]:
    prod, cons = layouts
    producer = ZmqTransport(ZmqOptions(), _ctx(prod))
    consumer = ZmqTransport(ZmqOptions(), _ctx(cons))
    for t, layout in ((producer, prod), (consumer, cons)):
        await t.open()
        await t.register(layout)
    yield producer, consumer
    await producer.aclose()
    await consumer.aclose()


def _spans(layout: KVLayout, blocks: list[int], counts: list[int]):
    return lambda layer: [layout.spans(layer, b, n) for b, n in zip(blocks, counts, strict=True)]


def _bytes(layout: KVLayout, blocks: list[int], counts: list[int]) -> list[bytes]:
    f = _spans(layout, blocks, counts)
    return [b"".join(bytes(s) for c in f(i) for s in c) for i in range(layout.num_layers)]


COUNTS = [4, 4, 2]


async def test_consumer_pulls_held_blocks_layer_by_layer(
    pair: tuple[ZmqTransport, ZmqTransport], layouts: tuple[KVLayout, KVLayout]
) -> None:
    producer, consumer = pair
    prod, cons = layouts
    assert producer.address.startswith("tcp://127.0.0.1:") and not producer.address.endswith(":0")
    offer = Offer("p-req", [1, 2, 3], COUNTS, prod.num_layers, _spans(prod, [1, 2, 3], COUNTS))
    signalled: list[int] = []
    job = LoadJob(
        "c-req",
        ["k"] * 3,
        COUNTS,
        cons.num_layers,
        _spans(cons, [7, 8, 9], COUNTS),
        signalled.append,
        PeerSource("e", [producer.address], "p-req", [1, 2, 3]),
    )
    outcome: list[str] = []
    released = trio.Event()

    async def hold() -> None:
        outcome.append(await producer.offer(offer))
        released.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            await consumer.load(job)
            await released.wait()  # the producer learns of Done over the socket
            nursery.cancel_scope.cancel()
    assert signalled == [0, 1, 2]
    assert _bytes(cons, [7, 8, 9], COUNTS) == _bytes(prod, [1, 2, 3], COUNTS)
    assert outcome == ["done"], "the producer hands the blocks back once the consumer confirms"


async def test_pull_of_an_unknown_request_is_refused(
    pair: tuple[ZmqTransport, ZmqTransport], layouts: tuple[KVLayout, KVLayout]
) -> None:
    producer, consumer = pair
    _, cons = layouts
    job = LoadJob(
        "c",
        ["k"],
        [4],
        cons.num_layers,
        _spans(cons, [7], [4]),
        lambda _: None,
        PeerSource("e", [producer.address], "never-offered", [1]),
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            with pytest.raises(ChunkMissing, match="unknown or expired request"):
                await consumer.load(job)
            nursery.cancel_scope.cancel()


async def test_a_held_offer_ends_at_its_deadline_without_a_consumer(
    pair: tuple[ZmqTransport, ZmqTransport], layouts: tuple[KVLayout, KVLayout]
) -> None:
    producer, _ = pair
    prod, _ = layouts
    offer = Offer("p", [1], [4], prod.num_layers, _spans(prod, [1], [4]))
    with trio.move_on_after(0.2) as hold_deadline:
        await producer.offer(offer)
    assert hold_deadline.cancelled_caught
    assert "p" not in producer.held, "an expired offer is forgotten"


async def test_a_dead_producer_makes_the_load_time_out_not_hang(
    pair: tuple[ZmqTransport, ZmqTransport], layouts: tuple[KVLayout, KVLayout]
) -> None:
    producer, consumer = pair
    _, cons = layouts
    address = producer.address
    await producer.aclose()  # the producer process is gone
    job = LoadJob(
        "c",
        ["k"],
        [4],
        cons.num_layers,
        _spans(cons, [7], [4]),
        lambda _: None,
        PeerSource("e", [address], "p", [1]),
    )
    with trio.move_on_after(0.3) as load_deadline:
        await consumer.load(job)
    assert load_deadline.cancelled_caught
