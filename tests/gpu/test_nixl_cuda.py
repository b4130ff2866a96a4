"""The `nixl` transport on CUDA caches (VRAM): two agents READ blocks laid out as
vLLM's FlashAttention default (LBNHC) device to device, every byte checked. Skipped
without a GPU (the DRAM path runs everywhere: tests/transports/test_nixl_transport.py,
tests/transports/test_conformance_nixl.py)."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from kvflow.geometry.layout import KVLayout
from kvflow.testing.layouts import device_layout
from kvflow.transport import LoadJob, Offer, PeerSource, TransportContext

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="the NIXL VRAM path needs an NVIDIA GPU; torch.cuda.is_available() is False here",
)
nixl = pytest.importorskip("nixl_cu12", reason="NIXL is an optional extra: kvflow[nixl]")

LAYERS, BLOCKS, BS = 4, 64, 16


def cuda_layout(seed: int) -> tuple[KVLayout, list[torch.Tensor]]:
    return device_layout("cuda", num_layers=LAYERS, num_blocks=BLOCKS, block_size=BS, seed=seed)


async def test_consumer_reads_vram_blocks_device_to_device() -> None:
    from kvflow_nixl import NixlOptions, NixlTransport

    (prod, theirs), (cons, ours) = cuda_layout(1), cuda_layout(2)
    src, dst, counts = [1, 5, 9, 30], [2, 3, 40, 63], [BS, BS, BS, 7]

    def ctx(layout: KVLayout) -> TransportContext:
        return TransportContext("e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout)

    producer = NixlTransport(NixlOptions(), ctx(prod))
    consumer = NixlTransport(NixlOptions(), ctx(cons))
    for t, layout in ((producer, prod), (consumer, cons)):
        await t.open()
        await t.register(layout)
    signalled: list[int] = []
    outcome: list[str] = []
    offer = Offer("p", src, counts, LAYERS, lambda layer: [])
    job = LoadJob(
        "c", ["k"] * 4, counts, LAYERS, lambda layer: [], signalled.append,
        PeerSource("e", [producer.address], "p", src), dst,
    )  # fmt: skip
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)

            async def hold() -> None:
                outcome.append(await producer.offer(offer))
                nursery.cancel_scope.cancel()

            nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            await consumer.load(job)
    await producer.aclose()
    await consumer.aclose()
    torch.cuda.synchronize()
    assert signalled == list(range(LAYERS)) and outcome == ["done"]
    for t_src, t_dst in zip(theirs, ours, strict=True):
        for s, d, n in zip(src, dst, counts, strict=True):
            assert torch.equal(t_dst[d, :, :n], t_src[s, :, :n]), f"block {s} -> {d}"
