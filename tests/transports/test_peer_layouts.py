"""Peers and stores whose KV layouts match or differ, with real transports on host memory
laid out as vLLM lays out its GPU caches (all six `KVCacheLayout`s, kernel blocks): equal
layouts move every byte; peers convert other layouts of the same cells (CUDA IPC, with
the in-process stand-in for the GPU; zmq host frames; NIXL READs); blocks of other
sizes are refused naming both, nothing written; a store holds chunks as they lie, and
another layout's are a miss."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import trio
import trio.testing

from kvflow.geometry.layout import KVLayout
from kvflow.keys import chunk_keys
from kvflow.testing.layouts import LAYOUTS, fill_blocks, make_layout, token_bytes
from kvflow.transport import LoadJob, Offer, PeerSource, SaveJob, TransportContext, TransportError
from kvflow_fs import FsOptions, FsTransport
from kvflow_zmq import ZmqOptions, ZmqTransport

pytest.importorskip("nixl_cu12", reason="NIXL is an optional extra: kvflow[nixl]")
from kvflow_nixl import NixlOptions, NixlTransport

from ..support.nixl_standins import StridedNixl, TorchBounceNixl
from ..support.zmq_standins import (
    InProcessDevice,
    StandInIpcZmq,
    as_device,
    interpreted_kernels,
)

BS = 8
SRC, DST, COUNTS = [1, 4, 6], [7, 2, 5], [BS, BS, 5]
PEERS = {
    "zmq": (ZmqTransport, ZmqOptions),
    "nixl": (NixlTransport, NixlOptions),
    "zmq-ipc": (StandInIpcZmq, ZmqOptions),
    "zmq-ipc-kernel": (StandInIpcZmq, ZmqOptions),  # and its device kernels, interpreted
    "zmq-ipc-kernel-all": (StandInIpcZmq, ZmqOptions),  # all layers in one launch
    "nixl-strided": (StridedNixl, NixlOptions),  # device memory's READs, on host memory
    "nixl-torch-bounce": (TorchBounceNixl, NixlOptions),  # and its bounce, on host memory
}
SAME = {name: {"layout": name} for name in LAYOUTS} | {
    "LBHNC-kernel4": {"layout": "LBHNC", "kernel_block_size": 4},
    "LBNHC-kernel4": {"layout": "LBNHC", "kernel_block_size": 4},
}
DIFFERENT = {  # producer, consumer
    "HND-to-NHD": ({"layout": "LBHNC"}, {"layout": "LBNHC"}),
    "NHD-to-HND": ({"layout": "BLNHC"}, {"layout": "LHBNC"}),
    "block8-to-block32": ({}, {"block_size": 4 * BS}),
    "kernel-blocks": ({"layout": "LBHNC", "kernel_block_size": 4}, {"layout": "LBHNC"}),
}
CONVERTED = {"HND-to-NHD", "NHD-to-HND", "kernel-blocks"}
"""Pairs of the same cells: every peer transport converts them."""


def layout(**kw: Any) -> KVLayout:
    return make_layout(**({"num_layers": 3, "num_blocks": 9, "block_size": BS, "heads": 4} | kw))


def ctx(kv: KVLayout) -> TransportContext:
    return TransportContext("e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], kv)


def chunks(kv: KVLayout, blocks: list[int]) -> list[bytes]:
    """Every layer's bytes of `blocks` holding COUNTS tokens."""
    f = chunk_spans(kv, blocks)
    return [b"".join(bytes(s) for c in f(i) for s in c) for i in range(kv.num_layers)]


def chunk_spans(kv: KVLayout, blocks: list[int]) -> Callable[[int], list[list[memoryview]]]:
    return lambda i: [kv.spans(i, b, n) for b, n in zip(blocks, COUNTS, strict=True)]


def whole(kv: KVLayout) -> list[bytes]:
    return [bytes(b) for b in kv.buffers]


def kernels(kind: str) -> contextlib.AbstractContextManager[list[int]]:
    """The device kernels, interpreted, for their kinds; else nothing (yields `[1]`)."""
    return interpreted_kernels() if "kernel" in kind else contextlib.nullcontext([1])


async def pull(kind: str, prod: KVLayout, cons: KVLayout) -> None:
    """Offer SRC on `prod`'s producer; pull it into DST of `cons` (raises what load raises)."""
    cls, options = PEERS[kind]
    if kind.startswith("zmq-ipc"):
        prod, cons = as_device(prod), as_device(cons)
    producer, consumer = cls(options(), ctx(prod)), cls(options(), ctx(cons))
    for t, kv in ((producer, prod), (consumer, cons)):
        await t.open()
        await t.register(kv)
    offer = Offer("p", SRC, COUNTS, prod.num_layers, chunk_spans(prod, SRC))
    job = LoadJob(
        "c", ["k"] * 3, COUNTS, cons.num_layers, chunk_spans(cons, DST), lambda _: None,
        PeerSource("e", [producer.address], "p", SRC), DST,
        layerwise=kind != "zmq-ipc-kernel-all",
    )  # fmt: skip
    failed: TransportError | None = None
    kernel = kernels(kind)
    with trio.fail_after(30), kernel as ran:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            nursery.start_soon(producer.offer, offer)
            await trio.testing.wait_all_tasks_blocked()
            try:
                await consumer.load(job)
            except TransportError as exc:
                failed = exc
            nursery.cancel_scope.cancel()
    await producer.aclose()
    await consumer.aclose()
    if failed is not None:
        raise failed
    assert ran, "the device kernels copied nothing"


@pytest.mark.parametrize("kind", PEERS)
@pytest.mark.parametrize("same", SAME)
async def test_peers_of_one_layout_move_every_byte(kind: str, same: str) -> None:
    prod, cons = layout(**SAME[same]), layout(**SAME[same], num_blocks=12)  # layers apart
    fill_blocks(prod, SRC, seed=3)
    before = whole(cons)
    await pull(kind, prod, cons)
    assert chunks(cons, DST) == chunks(prod, SRC)
    only_chunks_written(before, cons)


@pytest.mark.parametrize("kind", PEERS)
@pytest.mark.parametrize("pair", sorted(CONVERTED))
async def test_peers_convert_between_layouts_of_the_same_cells(kind: str, pair: str) -> None:
    """CUDA IPC's copy, zmq's consumer as its frames arrive, NIXL's READs cell by cell."""
    prod, cons = layout(**DIFFERENT[pair][0]), layout(**DIFFERENT[pair][1])
    fill_blocks(prod, SRC, seed=3)
    before = whole(cons)
    await pull(kind, prod, cons)
    for i in range(3):
        for a, b, n in zip(SRC, DST, COUNTS, strict=True):
            assert token_bytes(cons, i, b, n) == token_bytes(prod, i, a, n), (i, a, b)
    only_chunks_written(before, cons)


def only_chunks_written(before: list[bytes], cons: KVLayout) -> None:
    """No byte of `cons` changed but those of DST's first COUNTS tokens (by address: in
    layouts with blocks outside layers, a layer's buffer spans the others' blocks)."""
    bases = [np.frombuffer(b, np.uint8).ctypes.data for b in cons.buffers]
    written = {
        base + o + j
        for base, g in zip(bases, cons.geometries, strict=True)
        for b, n in zip(DST, COUNTS, strict=True)
        for o, m in g.ranges(b, n)
        for j in range(m)
    }
    for base, old, new in zip(bases, before, whole(cons), strict=True):
        changed = {base + j for j, (x, y) in enumerate(zip(old, new, strict=True)) if x != y}
        assert changed <= written, "only the chunks' own tokens are written"


@pytest.mark.parametrize(
    ("kind", "pair"),
    [(k, p) for k in PEERS for p in DIFFERENT if p not in CONVERTED and k != "zmq"],
)
async def test_peers_of_other_layouts_are_refused_naming_both(kind: str, pair: str) -> None:
    prod, cons = layout(**DIFFERENT[pair][0]), layout(**DIFFERENT[pair][1])
    fill_blocks(prod, SRC, seed=3)
    before = whole(cons)
    with pytest.raises(TransportError) as info:
        await pull(kind, prod, cons)
    theirs, ours = prod.geometries[0].describe(), cons.geometries[0].describe()
    assert f"producer {theirs}, consumer {ours}" in str(info.value)
    assert whole(cons) == before, "nothing written into the consumer's blocks"


def rows(kv: KVLayout, blocks: list[int], counts: list[int]) -> list[list[bytes]]:
    """Per layer, each token's cells (every head) of `blocks` holding `counts` tokens, in
    order, read by address arithmetic (`token_bytes`)."""
    out = []
    for i in range(kv.num_layers):
        per = kv.geometries[i].chunk_nbytes(1)
        data = b"".join(token_bytes(kv, i, b, n) for b, n in zip(blocks, counts, strict=True))
        out.append([data[t : t + per] for t in range(0, len(data), per)])
    return out


# (producer block size, its blocks and counts), (consumer's), tokens the consumer has
BLOCK_SIZES = {
    "8-to-32": ((8, [1, 4, 6], [8, 8, 5]), (32, [2], [21]), 0),
    "32-to-8": ((32, [3], [21]), (8, [7, 2, 5], [8, 8, 5]), 0),
    "32-to-8-past-a-prefix": ((32, [3], [21]), (8, [2, 5], [8, 5]), 8),
}


BLOCK_SIZE_PEERS = ["zmq", *(k for k in PEERS if k.startswith("zmq-ipc")), "nixl"]


@pytest.mark.parametrize("kind", [*BLOCK_SIZE_PEERS, "nixl-strided", "nixl-torch-bounce"])
@pytest.mark.parametrize("case", BLOCK_SIZES)
@pytest.mark.parametrize("order", ["LBNHC-to-LBHNC", "LBHNC-to-LBNHC", "LBNHC-to-LBNHC"])
async def test_peers_convert_between_block_sizes(kind: str, case: str, order: str) -> None:
    """A consumer of blocks of another size gets the producer's cells token-major (zmq),
    copies them as one token stream device to device (CUDA IPC), or READs its whole
    blocks into the bounce buffer (nixl), and scatters them into its own blocks, token
    for token, past tokens it already has."""
    (p_bs, p_blocks, p_counts), (c_bs, c_blocks, c_counts), have = BLOCK_SIZES[case]
    p_name, c_name = order.split("-to-")
    prod = layout(block_size=p_bs, layout=p_name, num_blocks=9)
    cons = layout(block_size=c_bs, layout=c_name, num_blocks=9)
    if kind.startswith("zmq-ipc"):
        prod, cons = as_device(prod), as_device(cons)
    fill_blocks(prod, p_blocks, seed=3)
    fill_blocks(cons, c_blocks, seed=4)
    cls, options = PEERS[kind]
    producer, consumer = cls(options(), ctx(prod)), cls(options(), ctx(cons))
    for t, kv in ((producer, prod), (consumer, cons)):
        await t.open()
        await t.register(kv)
    spans = lambda i: [prod.spans(i, b, n) for b, n in zip(p_blocks, p_counts, strict=True)]  # noqa: E731
    source = PeerSource("e", [producer.address], "p", p_blocks, block_size=p_bs, skip=have)
    job = LoadJob(
        "c", ["k"] * len(c_blocks), c_counts, cons.num_layers,
        lambda i: [cons.spans(i, b, n) for b, n in zip(c_blocks, c_counts, strict=True)],
        lambda _: None, source, c_blocks, layerwise=kind != "zmq-ipc-kernel-all",
    )  # fmt: skip
    kernel = kernels(kind)
    with trio.fail_after(30), kernel as ran:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            nursery.start_soon(producer.offer, Offer("p", p_blocks, p_counts, 3, spans))
            await trio.testing.wait_all_tasks_blocked()
            await consumer.load(job)
            nursery.cancel_scope.cancel()
    await producer.aclose()
    await consumer.aclose()
    want = [layer[have : have + sum(c_counts)] for layer in rows(prod, p_blocks, p_counts)]
    assert rows(cons, c_blocks, c_counts) == want
    assert ran, "the device kernels copied nothing"


@pytest.mark.parametrize("pair", DIFFERENT)
async def test_a_store_read_with_another_layout_is_a_miss(tmp_path: Path, pair: str) -> None:
    """Same namespace (as when only the attention backend differs), other bytes order:
    the reader refuses the chunks and writes nothing."""
    writer_kv, reader_kv = layout(**DIFFERENT[pair][0]), layout(**DIFFERENT[pair][1])
    fill_blocks(writer_kv, SRC, seed=4)
    keys = chunk_keys("ns", list(range(sum(COUNTS))), BS)
    writer, reader = FsTransport(FsOptions(path=str(tmp_path)), ctx(writer_kv)), None
    await writer.open()
    await writer.register(writer_kv)

    async def spans(i: int) -> list[list[memoryview]]:
        return chunk_spans(writer_kv, SRC)(i)

    await writer.save(SaveJob("s", keys, COUNTS, 3, spans))
    reader = FsTransport(FsOptions(path=str(tmp_path)), ctx(reader_kv))
    await reader.open()
    await reader.register(reader_kv)
    before = whole(reader_kv)
    job = LoadJob(
        "l", keys, COUNTS, 3,
        chunk_spans(reader_kv, DST), lambda _: None,
    )  # fmt: skip
    with pytest.raises(TransportError, match=r"another KV layout|layer sizes do not match"):
        await reader.load(job)
    assert whole(reader_kv) == before
    await writer.aclose()
    await reader.aclose()


class NeverDone(InProcessDevice):
    """Copies queued on a stream that never reports them landed (a stalled GPU)."""

    entered: trio.Event
    idle: ClassVar[list[str]] = []

    async def done(self, device: torch.device) -> None:
        NeverDone.entered.set()
        await trio.sleep_forever()

    def wait_idle(self, device: torch.device) -> None:
        NeverDone.idle.append(str(device))


class NeverDoneIpcZmq(ZmqTransport):
    device_type = NeverDone


async def test_a_cancelled_cuda_ipc_copy_waits_for_its_queued_copies() -> None:
    """The load's deadline fires while the first layer's copies are queued: the load
    waits for the stream before it returns (and the blocks go back to vLLM)."""
    prod, cons = as_device(layout()), as_device(layout())
    producer, consumer = (
        NeverDoneIpcZmq(ZmqOptions(), ctx(prod)),
        NeverDoneIpcZmq(ZmqOptions(), ctx(cons)),
    )
    for t, kv in ((producer, prod), (consumer, cons)):
        await t.open()
        await t.register(kv)
    NeverDone.entered, NeverDone.idle = trio.Event(), []
    order: list[str] = []
    job = LoadJob(
        "c", ["k"] * 3, COUNTS, cons.num_layers, chunk_spans(cons, DST), lambda _: None,
        PeerSource("e", [producer.address], "p", SRC), DST,
    )  # fmt: skip

    async def load(scope: trio.CancelScope) -> None:
        with scope:
            await consumer.load(job)
        order.append(f"load returned after {len(NeverDone.idle)} stream wait(s)")

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            nursery.start_soon(producer.offer, Offer("p", SRC, COUNTS, 3, chunk_spans(prod, SRC)))
            await trio.testing.wait_all_tasks_blocked()
            scope = trio.CancelScope()
            nursery.start_soon(load, scope)
            await NeverDone.entered.wait()
            scope.cancel()  # load_timeout_s
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    await producer.aclose()
    await consumer.aclose()
    assert order == ["load returned after 1 stream wait(s)"]
