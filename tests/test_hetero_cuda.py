"""P/D between tensor-parallel sizes and KV layouts on CUDA caches: producer processes
on this GPU (as vLLM's workers are) offer their blocks, and each consumer rank of
another tensor-parallel size, in another layout, pulls exactly its heads device to
device, over `zmq`'s CUDA IPC and over NIXL VRAM READs (UCX between processes); every
cell of every head is compared with the producer's. Skipped without a GPU (the same
pulls run on host memory everywhere: tests/test_peer_tensor_parallel.py, with CUDA
IPC's copies through an in-process stand-in)."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
from multiprocessing.connection import Connection

import pytest
import torch
import trio

from kvflow.layout import KVLayout
from kvflow.pd.peer_transport import PeerTransport
from kvflow.testing.layouts import device_layout
from kvflow.transport import LoadJob, Offer, PeerSource, TransportContext

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA IPC and NIXL VRAM need an NVIDIA GPU; torch.cuda.is_available() is False here",
)

HEADS, LAYERS, BLOCKS, BS, HEAD_DIM = 4, 3, 32, 16, 64
COUNTS = [16, 16, 9]  # the last chunk partial: only its tokens move
SRC, DST = [1, 5, 30], [7, 2, 31]
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


def _cache(order: str, heads: int, seed: int) -> tuple[KVLayout, list[torch.Tensor]]:
    return device_layout(
        "cuda",
        layout=order,
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        block_size=BS,
        heads=heads,
        head_dim=HEAD_DIM,
        seed=seed,
    )


def producer_main(conn: Connection, name: str, order: str, rank: int, size: int) -> None:
    """One producer rank: serve its cache (heads HEADS // size, seeded by rank), offer
    SRC once, send the outcome."""

    async def run() -> None:
        layout, _ = _cache(order, HEADS // size, seed=rank + 1)
        t = _transport(name, layout, rank, size)
        await t.open()
        await t.register(layout)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(t.serve)
            conn.send(t.address)
            outcome = await t.offer(Offer("p-req", SRC, COUNTS, LAYERS, lambda layer: []))
            nursery.cancel_scope.cancel()
        await t.aclose()
        conn.send(outcome)

    trio.run(run)


async def _recv(pipe: Connection) -> object:
    return await trio.to_thread.run_sync(pipe.recv, abandon_on_cancel=True)


CASES = {  # name: (producer tp, consumer tp, producer order, consumer order)
    "tp1-to-tp2": (1, 2, "LBNHC", "LBNHC"),
    "tp1-to-tp2-nhd-to-hnd": (1, 2, "LBNHC", "LBHNC"),
    "tp2-to-tp1": (2, 1, "LBNHC", "LBNHC"),
    "tp2-to-tp1-hnd-to-nhd": (2, 1, "LBHNC", "LBNHC"),
    "tp1-nhd-to-hnd": (1, 1, "LBNHC", "LBHNC"),
}


@pytest.mark.parametrize("name", TRANSPORTS)
@pytest.mark.parametrize("case", list(CASES))
async def test_each_consumer_rank_pulls_its_heads_device_to_device(name: str, case: str) -> None:
    p_tp, c_tp, p_order, c_order = CASES[case]
    spawn = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(p_tp):
        parent, child = spawn.Pipe()
        proc = spawn.Process(
            target=producer_main, args=(child, name, p_order, rank, p_tp), daemon=True
        )
        proc.start()
        child.close()  # a producer that dies is an EOFError here, not a hang
        pipes.append(parent)
        procs.append(proc)
    try:
        with trio.fail_after(120):  # each producer imports torch and NIXL, starts CUDA
            addresses = [str(await _recv(p)) for p in pipes]
        source = PeerSource("p", addresses, "p-req", SRC, tp_size=p_tp, kv_heads=HEADS)
        ranks = [_cache(c_order, HEADS // c_tp, seed=100 + r) for r in range(c_tp)]
        with trio.fail_after(60):
            for r, (layout, _) in enumerate(ranks):
                t = _transport(name, layout, r, c_tp)
                await t.open()
                await t.register(layout)
                signalled: list[int] = []
                job = LoadJob(
                    "c-req", ["k"] * 3, COUNTS, LAYERS, lambda layer: [], signalled.append,
                    source, DST,
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
    producers = [_cache(p_order, HEADS // p_tp, seed=r + 1)[1] for r in range(p_tp)]
    for layer in range(LAYERS):  # the logical [blocks, heads, tokens, content] views
        whole_src = torch.cat([views[layer] for views in producers], dim=1)  # every head
        whole_dst = torch.cat([views[layer] for _, views in ranks], dim=1)
        for s, d, n in zip(SRC, DST, COUNTS, strict=True):
            got, want = whole_dst[d, :, :n], whole_src[s, :, :n]
            assert torch.equal(got, want), f"layer {layer}: block {s} -> {d}"
            if n < BS:  # nothing past the chunk's tokens written
                fresh = torch.cat([_cache(c_order, HEADS // c_tp, seed=100 + r)[1][layer]
                                   for r in range(c_tp)], dim=1)  # fmt: skip
                assert torch.equal(whole_dst[d, :, n:], fresh[d, :, n:]), f"layer {layer}"
