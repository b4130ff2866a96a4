"""P/D between tensor-parallel sizes on real sockets, over the `zmq` transport's host
frames and real NIXL agents' READs: each consumer rank reads exactly its heads from the
producer ranks that hold them (`kvflow.geometry.topology`), and a producer rank read by
several consumer ranks holds its blocks until every one of them is done."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import AsyncIterator, Callable
from contextlib import nullcontext

import msgspec
import pytest
import trio
import trio.testing

from kvflow.geometry.layout import KVLayout, peer_cells_problem
from kvflow.pd.peer_transport import PeerTransport
from kvflow.testing.layouts import fill_blocks, make_layout, token_bytes
from kvflow.transport import LoadJob, Offer, PeerSource, TransportContext, TransportError
from kvflow_nixl import NixlOptions, NixlTransport
from kvflow_zmq import ZmqOptions, ZmqTransport

from ..support.nixl_standins import StridedNixl, TorchBounceNixl
from ..support.zmq_standins import StandInIpcZmq, as_device, interpreted_kernels

TRANSPORTS: dict[str, tuple[type[PeerTransport], type]] = {
    "zmq": (ZmqTransport, ZmqOptions),
    "zmq-ipc": (StandInIpcZmq, ZmqOptions),  # CUDA IPC's copies, on host tensors
    "zmq-ipc-kernel": (StandInIpcZmq, ZmqOptions),  # and its device kernels, interpreted
    "zmq-ipc-kernel-all": (StandInIpcZmq, ZmqOptions),  # all layers in one launch
    "nixl": (NixlTransport, NixlOptions),
    "nixl-strided": (StridedNixl, NixlOptions),
    "nixl-torch-bounce": (TorchBounceNixl, NixlOptions),
}
if not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12")):
    for name in ("nixl", "nixl-strided", "nixl-torch-bounce"):  # NIXL is not installed
        del TRANSPORTS[name]

BS, HEADS = 16, 4
COUNTS = [16, 16, 9]
SRC, DST = [1, 2, 3], [7, 8, 9]


def _layout(heads: int, kind: str) -> KVLayout:
    return make_layout(
        num_layers=3,
        block_size=BS,
        heads=heads,
        block_granular=kind == "block-granular",
        hnd=kind == "hnd",
    )


def _ctx(layout: KVLayout, rank: int, size: int) -> TransportContext:
    shards = [f"tp{r}of{size}pp0" for r in range(size)]
    return TransportContext(
        "e", "worker", "ns", shards[rank], shards, layout, tp_rank=rank, tp_size=size
    )


Make = Callable[[KVLayout, int, int], PeerTransport]


@pytest.fixture(params=list(TRANSPORTS))
async def make(request: pytest.FixtureRequest) -> AsyncIterator[Make]:
    kind, options = TRANSPORTS[request.param]
    opened: list[PeerTransport] = []

    def factory(layout: KVLayout, rank: int, size: int) -> PeerTransport:
        if request.param.startswith("zmq-ipc"):
            if layout.is_block_granular():
                pytest.skip("a device cache is never block-granular")
            as_device(layout)
        t = kind(options(), _ctx(layout, rank, size))
        if request.param == "zmq-ipc-kernel-all":  # an asynchronous pull: one launch
            load = t.load
            t.load = lambda job: load(dataclasses.replace(job, layerwise=False))  # type: ignore[method-assign]
        opened.append(t)
        return t

    kernel = interpreted_kernels() if "kernel" in request.param else nullcontext([1])
    with kernel as ran:
        yield factory
    for t in opened:
        await t.aclose()
    refusal = request.node.name.startswith("test_blocks_of_other_cells_are_refused")
    assert ran or refusal or not opened, "the device kernels copied nothing"


async def _open(t: PeerTransport) -> PeerTransport:
    await t.open()
    assert t.context.layout is not None
    await t.register(t.context.layout)
    return t


def _offer(layout: KVLayout) -> Offer:
    def spans(layer: int) -> list[list[memoryview]]:
        return [layout.spans(layer, b, n) for b, n in zip(SRC, COUNTS, strict=True)]

    return Offer("p-req", SRC, COUNTS, layout.num_layers, spans)


def _job(layout: KVLayout, source: PeerSource, signalled: list[int]) -> LoadJob:
    def spans(layer: int) -> list[list[memoryview]]:
        return [layout.spans(layer, b, n) for b, n in zip(DST, COUNTS, strict=True)]

    return LoadJob(
        "c-req", ["k"] * 3, COUNTS, layout.num_layers, spans, signalled.append, source, DST
    )


def _heads(layout: KVLayout, blocks: list[int], first: int, count: int) -> list[bytes]:
    """Per layer, heads `[first, first + count)` of `blocks` (COUNTS tokens), token by
    token and head by head whatever the layout (`token_bytes`: address arithmetic); a
    block-granular block's head runs whole."""
    out = []
    for layer, g in enumerate(layout.geometries):
        data = bytearray()
        for b, n in zip(blocks, COUNTS, strict=True):
            whole = token_bytes(layout, layer, b, n)  # a row a token (one: the block)
            per = g.head_run_bytes() if g.block_bytes else g.cell_bytes
            size = len(whole) if g.block_bytes else g.chunk_nbytes(1)
            for at in range(0, len(whole), size):
                row = whole[at : at + size]
                data += row[first * per : (first + count) * per]
        out.append(bytes(data))
    return out


KINDS = ["block-granular", "hnd", "nhd", "nhd-to-hnd", "hnd-to-nhd"]
"""The producer's layout and the consumer's ("-to-": other layouts, converted too)."""


@pytest.mark.parametrize("kinds", KINDS)
async def test_tp1_producer_to_tp2_consumer(make: Make, kinds: str) -> None:
    kind, _, theirs = kinds.partition("-to-")
    prod = _layout(HEADS, kind)
    fill_blocks(prod, SRC, seed=3)
    producer = await _open(make(prod, 0, 1))
    ranks = [await _open(make(_layout(HEADS // 2, theirs or kind), r, 2)) for r in range(2)]
    source = PeerSource("p", [producer.address], "p-req", SRC, tp_size=1, kv_heads=HEADS)
    outcome: list[str] = []
    released = trio.Event()

    async def hold() -> None:
        outcome.append(await producer.offer(_offer(prod)))
        released.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            signalled: list[int] = []
            assert ranks[0].context.layout is not None
            await ranks[0].load(_job(ranks[0].context.layout, source, signalled))
            await trio.testing.wait_all_tasks_blocked()
            assert not outcome, "one of the offer's two readers is done: still held"
            assert ranks[1].context.layout is not None
            await ranks[1].load(_job(ranks[1].context.layout, source, signalled))
            await released.wait()
            nursery.cancel_scope.cancel()
    assert outcome == ["done"] and signalled == [0, 1, 2, 0, 1, 2]
    if type(producer) is NixlTransport and kinds == "nhd":  # a run a token: READ whole blocks
        assert all(r._bounce is not None and r._bounce.buf is not None for r in ranks)  # type: ignore[attr-defined]
    for r, rank in enumerate(ranks):
        cons = rank.context.layout
        assert cons is not None
        got = _heads(cons, DST, 0, HEADS // 2)
        assert got == _heads(prod, SRC, r * HEADS // 2, HEADS // 2), f"rank {r}'s heads"


@pytest.mark.parametrize("kinds", KINDS)
async def test_tp2_producer_to_tp1_consumer(make: Make, kinds: str) -> None:
    kind, _, theirs = kinds.partition("-to-")
    prods = [_layout(HEADS // 2, kind) for _ in range(2)]
    for seed, p in enumerate(prods):
        fill_blocks(p, SRC, seed=seed + 10)
    producers = [await _open(make(p, r, 2)) for r, p in enumerate(prods)]
    consumer = await _open(make(_layout(HEADS, theirs or kind), 0, 1))
    addresses = [p.address for p in producers]
    source = PeerSource("p", addresses, "p-req", SRC, tp_size=2, kv_heads=HEADS)
    outcomes: list[str] = []
    signalled: list[int] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for producer, prod in zip(producers, prods, strict=True):
                nursery.start_soon(producer.serve)

                async def hold(producer: PeerTransport = producer, prod: KVLayout = prod) -> None:
                    outcomes.append(await producer.offer(_offer(prod)))

                nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            assert consumer.context.layout is not None
            await consumer.load(_job(consumer.context.layout, source, signalled))
            while len(outcomes) < 2:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert outcomes == ["done", "done"] and signalled == [0, 1, 2]
    cons = consumer.context.layout
    for r, prod in enumerate(prods):
        want = _heads(prod, SRC, 0, HEADS // 2)
        assert _heads(cons, DST, r * HEADS // 2, HEADS // 2) == want, f"producer rank {r}"


async def test_blocks_of_other_cells_are_refused_naming_both(make: Make) -> None:
    """A consumer converts any order of the same cells (NHD into HND, heads of a block of
    another head count: the tests above); blocks whose cells are not separable (vLLM's
    CPU cache) are not NHD blocks of another engine, and the pull fails naming both
    layouts (the consumer recomputes)."""
    prods = [_layout(HEADS // 2, "nhd") for _ in range(2)]
    producers = [await _open(make(p, r, 2)) for r, p in enumerate(prods)]
    consumer = await _open(make(_layout(HEADS, "block-granular"), 0, 1))
    source = PeerSource("p", [p.address for p in producers], "p-req", SRC, 2, HEADS)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for producer, prod in zip(producers, prods, strict=True):
                nursery.start_soon(producer.serve)
                nursery.start_soon(producer.offer, _offer(prod))
            await trio.testing.wait_all_tasks_blocked()
            assert consumer.context.layout is not None
            with pytest.raises(TransportError, match=r"KV layouts differ .*producer NHD"):
                await consumer.load(_job(consumer.context.layout, source, []))
            nursery.cancel_scope.cancel()


def test_a_peers_geometry_costs_no_more_than_our_own_to_check() -> None:
    """A peer's geometry of 2^40 tokens a block with no token stride is within the byte
    bounds, and listing its cells would loop over every token; it is refused on its
    sizes first."""
    ours = _layout(HEADS, "hnd").geometries
    hostile = msgspec.structs.replace(ours[0], block_size=1 << 40, token_stride=0)
    why = peer_cells_problem([hostile] * len(ours), ours)
    assert why.startswith("KV layouts differ (layer 0)"), why
    assert peer_cells_problem(_layout(2, "nhd").geometries, ours) == ""
