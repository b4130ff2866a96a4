"""The `zmq` peer transport on real sockets: a producer serves held blocks, a consumer
pulls them into its own KV memory."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing
import zmq

from kvflow.geometry.layout import KVLayout
from kvflow.keyfiles import keygen, read_key
from kvflow.pd.context import PeerContext
from kvflow.pd.security import Channel
from kvflow.testing.layouts import fill_blocks, make_layout
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


def _pull_job(cons: KVLayout, producer: ZmqTransport, landed: Any) -> LoadJob:
    """A pull of the producer's offer "p-req" (blocks 1-3) into the consumer's 7-9."""
    return LoadJob(
        "c-req",
        ["k"] * 3,
        COUNTS,
        cons.num_layers,
        _spans(cons, [7, 8, 9], COUNTS),
        landed,
        PeerSource("e", [producer.address], "p-req", [1, 2, 3]),
    )


async def test_consumer_pulls_held_blocks_layer_by_layer(
    pair: tuple[ZmqTransport, ZmqTransport], layouts: tuple[KVLayout, KVLayout]
) -> None:
    producer, consumer = pair
    prod, cons = layouts
    assert producer.address.startswith("tcp://127.0.0.1:") and not producer.address.endswith(":0")
    offer = Offer("p-req", [1, 2, 3], COUNTS, prod.num_layers, _spans(prod, [1, 2, 3], COUNTS))
    signalled: list[int] = []
    job = _pull_job(cons, producer, signalled.append)
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
            with pytest.raises(ChunkMissing, match="not offered by this producer"):
                await consumer.load(job)
            nursery.cancel_scope.cancel()


async def test_a_pull_of_another_wire_version_is_refused_naming_both(
    pair: tuple[ZmqTransport, ZmqTransport], layouts: tuple[KVLayout, KVLayout]
) -> None:
    """A producer of another kvflow release (its wire version differs) refuses a pull it
    holds the blocks for, naming both versions: the consumer recomputes."""
    producer, consumer = pair
    prod, cons = layouts
    producer.wire_version = wire.WIRE_VERSION + 1  # as a newer kvflow's producer
    offer = Offer("p-req", [1], [4], prod.num_layers, _spans(prod, [1], [4]))
    job = LoadJob(
        "c-req",
        ["k"],
        [4],
        cons.num_layers,
        _spans(cons, [7], [4]),
        lambda _: None,
        PeerSource("e", [producer.address], "p-req", [1]),
    )
    why = f"wire version {wire.WIRE_VERSION}; this producer speaks {wire.WIRE_VERSION + 1}"
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            nursery.start_soon(producer.offer, offer)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(ChunkMissing, match=why):
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


async def test_a_stalled_consumer_holds_up_nothing_and_never_reads_reused_blocks() -> None:
    """A consumer stalls mid-pull with its connection open (issue 27, finding 3): another
    consumer's pull is still answered; the stalled pull's blocks go back to vLLM when the
    hold ends, whatever ZMQ still queues for the stalled consumer; and what that consumer
    reads later is the offered KV, never what vLLM wrote into the blocks afterwards (the
    producer sends copies, not zero-copy views of the blocks)."""
    big_blocks, small_blocks = list(range(48)), [48, 49]
    kw: dict[str, Any] = dict(num_layers=8, num_blocks=50, block_size=16, heads=8, head_dim=128)
    prod = make_layout(block_granular=True, **kw)  # 128 KiB blocks: 48 MiB to stall on
    cons = make_layout(block_granular=True, **kw)
    fill_blocks(prod, big_blocks + small_blocks, seed=7)
    full = [prod.block_size] * len(big_blocks)
    offered = [
        bytes(b) for layer in range(prod.num_layers) for b in _layer(prod, layer, big_blocks)
    ]
    big = Offer("big", big_blocks, full, prod.num_layers, _spans(prod, big_blocks, full))
    counts = [prod.block_size, 3]
    small = Offer(
        "small", small_blocks, counts, prod.num_layers, _spans(prod, small_blocks, counts)
    )
    producer = ZmqTransport(ZmqOptions(), _ctx(prod))
    consumer = ZmqTransport(ZmqOptions(), _ctx(cons))
    for t, layout in ((producer, prod), (consumer, cons)):
        await t.open()
        await t.register(layout)
    job = LoadJob(
        "c-small",
        ["k"] * 2,
        counts,
        cons.num_layers,
        _spans(cons, [0, 1], counts),
        lambda _: None,
        PeerSource("e", [producer.address], "small", small_blocks),
    )
    small_outcome: list[str] = []
    small_released = trio.Event()
    big_hold = trio.CancelScope()
    big_returned = trio.Event()

    async def hold_small() -> None:
        small_outcome.append(await producer.offer(small))
        small_released.set()

    async def hold_big() -> None:
        with big_hold:  # cancelled: the hold deadline passes
            await producer.offer(big)
        big_returned.set()

    zctx = zmq.Context()
    stalled = TrioSocket(zctx.socket(zmq.DEALER))
    stalled.sock.setsockopt(zmq.RCVHWM, 1)  # its zmq queues no more than we read
    stalled.sock.setsockopt(zmq.RCVBUF, 1 << 16)
    try:
        with trio.fail_after(30):  # a hang guard, not a timing check
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer.serve)
                nursery.start_soon(hold_big)
                nursery.start_soon(hold_small)
                await trio.testing.wait_all_tasks_blocked()
                stalled.sock.connect(producer.address)
                await stalled.send_multipart([wire.encode(wire.Pull("big"))])
                frames = [await stalled.recv_multipart()]  # layer 0, then it reads no more
                first = wire.decode_to_consumer(frames[0][0])
                assert isinstance(first, wire.Layer) and first.layer == 0

                await consumer.load(job)
                assert _bytes(cons, [0, 1], counts) == _bytes(prod, small_blocks, counts)
                await small_released.wait()
                assert small_outcome == ["done"]

                big_hold.cancel()
                await big_returned.wait()  # the blocks are vLLM's again: it writes them
                for layer in range(prod.num_layers):
                    for b in _layer(prod, layer, big_blocks):
                        b[:] = b"\xee" * len(b)
                for _ in range(1, prod.num_layers):  # the stalled consumer reads on
                    frames.append(await stalled.recv_multipart())
                got = [bytes(f) for layer in frames for f in layer[1:]]
                assert got == offered, "a stalled consumer read what vLLM wrote afterwards"
                nursery.cancel_scope.cancel()
    finally:
        stalled.close(linger_ms=0)
        zctx.destroy(linger=0)
        await producer.aclose()
        await consumer.aclose()


async def test_one_consumer_gets_one_copy_of_an_offer_however_often_it_asks() -> None:
    """A producer answers pulls in tasks of their own (issue 49): a consumer that sends
    the same pull again before the first is answered is refused, not sent a second copy
    of every layer (each copy is queued for it whether it reads or not)."""
    blocks = [0, 1, 2]
    prod = make_layout(num_layers=3, num_blocks=4, block_size=4, block_granular=True)
    full = [prod.block_size] * len(blocks)
    offer = Offer("o", blocks, full, prod.num_layers, _spans(prod, blocks, full))
    producer = ZmqTransport(ZmqOptions(), _ctx(prod))
    await producer.open()
    await producer.register(prod)
    zctx = zmq.Context()
    dealer = TrioSocket(zctx.socket(zmq.DEALER))
    try:
        with trio.fail_after(30):  # a hang guard, not a timing check
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer.serve)
                nursery.start_soon(producer.offer, offer)
                await trio.testing.wait_all_tasks_blocked()
                dealer.sock.connect(producer.address)
                pull = wire.encode(wire.Pull("o"))
                await dealer.send_multipart([pull])
                await dealer.send_multipart([pull])
                got = [
                    wire.decode_to_consumer((await dealer.recv_multipart())[0])
                    for _ in range(prod.num_layers + 1)
                ]
                nursery.cancel_scope.cancel()
    finally:
        dealer.close(linger_ms=0)
        zctx.destroy(linger=0)
        await producer.aclose()
    layers = [m.layer for m in got if isinstance(m, wire.Layer)]
    refused = [m.reason for m in got if isinstance(m, wire.Refused)]
    assert layers == list(range(prod.num_layers))
    assert len(refused) == 1 and "already" in refused[0], refused


def _layer(layout: KVLayout, layer: int, blocks: list[int]) -> list[memoryview]:
    full = [layout.block_size] * len(blocks)
    return [s for chunk in _spans(layout, blocks, full)(layer) for s in chunk]


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.1", "::"])
async def test_a_keyless_producer_binds_loopback_only_unless_told_insecure(
    host: str, tmp_path: Any
) -> None:
    """Issue 27: anyone who reaches a keyless side channel can read the engine's KV, so
    binding beyond loopback without a key is refused at start, saying how to make one."""
    layout = make_layout(num_layers=1, num_blocks=2, block_size=4)
    producer = ZmqTransport(ZmqOptions(host=host), _ctx(layout))
    with pytest.raises(TransportError, match=r"kvflow keygen PATH.*'insecure': true"):
        await producer.open()
    await producer.aclose()


async def test_a_keyed_or_insecure_producer_binds_any_address(tmp_path: Any) -> None:
    layout = make_layout(num_layers=1, num_blocks=2, block_size=4)
    for channel in (Channel(read_key(str(keygen(tmp_path / "k")))), Channel(insecure=True)):
        ctx = PeerContext.of(_ctx(layout), channel=channel)
        producer = ZmqTransport(ZmqOptions(host="0.0.0.0"), ctx)
        await producer.open()
        assert producer.address.startswith("tcp://0.0.0.0:")
        await producer.aclose()


async def test_a_layer_computed_slower_than_the_progress_timeout_is_still_pulled(
    layouts: tuple[KVLayout, KVLayout],
) -> None:
    """A streamed offer's prefill may take longer than `progress_timeout_s` to compute a
    layer (a long prompt on a CPU): the producer says it is computing meanwhile, and the
    consumer, which gives up on a producer silent for that long, waits on."""
    prod, cons = layouts
    wait_s = 0.4
    producer = ZmqTransport(ZmqOptions(), PeerContext.of(_ctx(prod), progress_timeout_s=wait_s))
    consumer = ZmqTransport(ZmqOptions(), PeerContext.of(_ctx(cons), progress_timeout_s=wait_s))
    for t, layout in ((producer, prod), (consumer, cons)):
        await t.open()
        await t.register(layout)

    done_at: list[float] = []

    async def computed(layer: int) -> None:
        if layer == 1:  # the forward, slower than the consumer's bound
            done_at.append(done_at[0] if done_at else trio.current_time() + 4 * wait_s)
            await trio.sleep_until(done_at[0])

    offer = Offer("p-req", [1, 2, 3], COUNTS, prod.num_layers, _spans(prod, [1, 2, 3], COUNTS))
    offer = dataclasses.replace(offer, params=b"streamed", computed=computed)
    job = _pull_job(cons, producer, lambda _layer: None)
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer.serve)
                nursery.start_soon(producer.offer, offer)
                await trio.testing.wait_all_tasks_blocked()
                await consumer.load(job)
                nursery.cancel_scope.cancel()
    finally:
        await producer.aclose()
        await consumer.aclose()
    assert _bytes(cons, [7, 8, 9], COUNTS) == _bytes(prod, [1, 2, 3], COUNTS)
