"""P/D between tensor-parallel sizes, KV layouts and block sizes on CUDA caches:
producer processes on this GPU (as vLLM's workers are) offer their blocks, and each
consumer rank of another tensor-parallel size, layout or block size pulls exactly its
heads' tokens device to device, over `zmq`'s CUDA IPC and over NIXL VRAM READs (UCX
between processes); every cell of every head is compared with the producer's.
Skipped without a GPU (the same pulls run on host memory everywhere:
tests/pd/test_peer_tensor_parallel.py and tests/transports/test_peer_layouts.py, CUDA IPC's copies
through an in-process stand-in, NIXL's device READs as strided READs of host memory and
its device bounce buffer with torch scattering host tensors)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
from multiprocessing.connection import Connection

import pytest
import torch
import trio

from kvflow.geometry.layout import KVLayout
from kvflow.pd.peer_transport import PeerTransport
from kvflow.testing.layouts import device_layout
from kvflow.transport import LoadJob, Offer, PeerSource, TransportContext

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA IPC and NIXL VRAM need an NVIDIA GPU; torch.cuda.is_available() is False here",
)

HEADS, LAYERS, BLOCKS, HEAD_DIM = 4, 3, 32, 64
# 41 tokens in blocks of each size: (producer's blocks, consumer's, their token counts);
# the last chunk partial: only its tokens move
BLOCKS_OF = {16: ([1, 5, 30], [7, 2, 31], [16, 16, 9]), 32: ([1, 5], [7, 2], [32, 9])}
TRANSPORTS = ["zmq", "nixl"]
if not importlib.util.find_spec("nixl_cu12"):
    TRANSPORTS.remove("nixl")


def _transport(name: str, layout: KVLayout, rank: int, size: int) -> PeerTransport:
    shards = [f"tp{r}of{size}pp0" for r in range(size)]
    ctx = TransportContext(
        "e", "worker", "ns", shards[rank], shards, layout, tp_rank=rank, tp_size=size
    )
    if name == "nixl":
        from kvflow_nixl import NixlOptions, NixlTransport

        return NixlTransport(NixlOptions(), ctx)
    from kvflow_zmq import ZmqOptions, ZmqTransport

    return ZmqTransport(ZmqOptions(), ctx)


def _cache(order: str, heads: int, seed: int, bs: int) -> tuple[KVLayout, list[torch.Tensor]]:
    return device_layout(
        "cuda",
        layout=order,
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        block_size=bs,
        heads=heads,
        head_dim=HEAD_DIM,
        seed=seed,
    )


def producer_main(conn: Connection, name: str, order: str, rank: int, size: int, bs: int) -> None:
    """One producer rank: serve its cache (heads HEADS // size, seeded by rank, blocks of
    `bs` tokens), offer its blocks of the prompt once, send the outcome."""

    async def run() -> None:
        layout, _ = _cache(order, HEADS // size, rank + 1, bs)
        src, _, counts = BLOCKS_OF[bs]
        t = _transport(name, layout, rank, size)
        await t.open()
        await t.register(layout)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.serve)
            conn.send(t.address)
            outcome = await t.offer(Offer("p-req", src, counts, LAYERS, lambda layer: []))
            nursery.cancel_scope.cancel()
        await t.aclose()
        conn.send(outcome)

    trio.run(run)


async def _recv(pipe: Connection) -> object:
    return await trio.to_thread.run_sync(pipe.recv, abandon_on_cancel=True)


CASES = {  # name: (producer tp, consumer tp, producer order, consumer order, block sizes)
    "tp1-to-tp2": (1, 2, "LBNHC", "LBNHC", (16, 16)),
    "tp1-to-tp2-nhd-to-hnd": (1, 2, "LBNHC", "LBHNC", (16, 16)),
    "tp2-to-tp1": (2, 1, "LBNHC", "LBNHC", (16, 16)),
    "tp2-to-tp1-hnd-to-nhd": (2, 1, "LBHNC", "LBNHC", (16, 16)),
    "tp1-nhd-to-hnd": (1, 1, "LBNHC", "LBHNC", (16, 16)),
    "blocks-16-to-32-nhd-to-hnd": (1, 1, "LBNHC", "LBHNC", (16, 32)),
    "blocks-32-to-16-tp1-to-tp2": (1, 2, "LBHNC", "LBNHC", (32, 16)),
}


@pytest.mark.parametrize("name", TRANSPORTS)
@pytest.mark.parametrize("case", list(CASES))
async def test_each_consumer_rank_pulls_its_heads_device_to_device(name: str, case: str) -> None:
    p_tp, c_tp, p_order, c_order, (p_bs, c_bs) = CASES[case]
    src, _, p_counts = BLOCKS_OF[p_bs]
    _, dst, counts = BLOCKS_OF[c_bs]
    spawn = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(p_tp):
        parent, child = spawn.Pipe()
        proc = spawn.Process(
            target=producer_main, args=(child, name, p_order, rank, p_tp, p_bs), daemon=True
        )
        proc.start()
        child.close()  # a producer that dies is an EOFError here, not a hang
        pipes.append(parent)
        procs.append(proc)
    try:
        with trio.fail_after(120):  # each producer imports torch and NIXL, starts CUDA
            addresses = [str(await _recv(p)) for p in pipes]
        other = p_bs if p_bs != c_bs else 0
        source = PeerSource("p", addresses, "p-req", src, p_tp, HEADS, block_size=other)
        ranks = [_cache(c_order, HEADS // c_tp, 100 + r, c_bs) for r in range(c_tp)]
        with trio.fail_after(60):
            for r, (layout, _) in enumerate(ranks):
                t = _transport(name, layout, r, c_tp)
                await t.open()
                await t.register(layout)
                signalled: list[int] = []
                job = LoadJob(
                    "c-req", ["k"] * len(dst), counts, LAYERS, lambda layer: [],
                    signalled.append, source, dst,
                )  # fmt: skip
                await t.load(job)
                await t.aclose()
                assert signalled == list(range(LAYERS)), f"consumer rank {r}"
            outcomes = [await _recv(p) for p in pipes]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert outcomes == ["done"] * p_tp
    torch.cuda.synchronize()
    producers = [_cache(p_order, HEADS // p_tp, r + 1, p_bs)[1] for r in range(p_tp)]
    fresh = [_cache(c_order, HEADS // c_tp, 100 + r, c_bs)[1] for r in range(c_tp)]
    for layer in range(LAYERS):  # the logical [blocks, heads, tokens, content] views
        theirs = torch.cat([views[layer] for views in producers], dim=1)  # every head
        ours = torch.cat([views[layer] for _, views in ranks], dim=1)
        before = torch.cat([views[layer] for views in fresh], dim=1)
        want = torch.cat([theirs[b, :, :n] for b, n in zip(src, p_counts, strict=True)], dim=1)
        got = torch.cat([ours[b, :, :n] for b, n in zip(dst, counts, strict=True)], dim=1)
        assert torch.equal(got, want), f"layer {layer}: the tokens differ"
        last, n = dst[-1], counts[-1]  # nothing past the last chunk's tokens written
        assert torch.equal(ours[last, :, n:], before[last, :, n:]), f"layer {layer}"
