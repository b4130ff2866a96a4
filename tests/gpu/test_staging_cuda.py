"""Host staging of a device cache: the `fs` transport saves device blocks laid out
as vLLM's FlashAttention default (LBNHC) through (pinned) host memory and loads them
into other blocks of another cache, every token checked and nothing else written. The
`cuda` case needs a GPU and is skipped without one; the `cpu` case runs the same test on
CPU tensors everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.engine.staging import HostStage
from kvflow.geometry.layout import KVLayout
from kvflow.keys import chunk_keys
from kvflow.observe.events import TierRead
from kvflow.testing.layouts import device_layout
from kvflow.tiers import HostTier, with_host_tier
from kvflow.transport import LoadJob, SaveJob, TransportContext
from kvflow_fs import FsOptions, FsTransport

DEVICES = [
    "cpu",  # the test itself, checked everywhere
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="staging a CUDA cache needs an NVIDIA GPU; torch.cuda.is_available() is "
            "False here",
        ),
    ),
]

LAYERS, BS = 4, 16
COUNTS = [BS, BS, 5]


def vllm_layout(
    device: str, layout: str, blocks: int, seed: int
) -> tuple[KVLayout, list[torch.Tensor]]:
    return device_layout(
        device, layout=layout, num_layers=LAYERS, num_blocks=blocks, block_size=BS, seed=seed
    )


@pytest.mark.parametrize(
    ("writer", "reader"), [("LBNHC", "LBNHC"), ("LBHNC", "LBNHC"), ("BLNHC", "LHBNC")]
)
@pytest.mark.parametrize("device", DEVICES)
async def test_fs_saves_and_loads_a_device_cache_through_host_staging(
    tmp_path: Path, device: str, writer: str, reader: str
) -> None:
    """The store holds chunks token-major: an instance whose attention backend lays out
    its cache otherwise (HND, layers inside blocks) reads what another wrote."""
    src, src_caches = vllm_layout(device, writer, 64, seed=1)
    dst, dst_caches = vllm_layout(device, reader, 100, seed=2)
    before = [c.clone() for c in dst_caches]
    ctx = lambda layout: TransportContext(  # noqa: E731
        "e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout
    )
    keys = chunk_keys("cuda-staging", list(range(sum(COUNTS))), BS)
    saver = FsTransport(FsOptions(path=str(tmp_path)), ctx(src))
    await saver.open()
    await saver.register(src)
    out = HostStage(src, [3, 40, 7], COUNTS)

    async def spans(layer: int) -> list[list[memoryview]]:
        await out.gather(layer)
        return out.spans(layer)

    await saver.save(SaveJob("s", keys, COUNTS, LAYERS, spans))
    loader = FsTransport(FsOptions(path=str(tmp_path)), ctx(dst))
    await loader.open()
    await loader.register(dst)
    into = HostStage(dst, [90, 0, 51], COUNTS)
    after = None
    if device == "cuda":  # what the worker records on vLLM's stream at bind
        after = torch.cuda.Event()
        after.record()
    landed: list[int] = []

    def loaded(layer: int) -> None:
        into.scatter(layer, after)
        landed.append(layer)

    await loader.load(LoadJob("l", keys, COUNTS, LAYERS, into.spans, loaded))
    assert landed == list(range(LAYERS))
    for layer in range(LAYERS):
        s, d, b = src_caches[layer], dst_caches[layer], before[layer]
        for a, z, n in zip([3, 40, 7], [90, 0, 51], COUNTS, strict=True):
            assert torch.equal(d[z, :, :n], s[a, :, :n]), (layer, a, z)
            assert torch.equal(d[z, :, n:], b[z, :, n:]), "past a partial block's tokens"
        others = [i for i in range(100) if i not in (90, 0, 51)]
        assert torch.equal(d[others], b[others])
    await saver.aclose()
    await loader.aclose()


@pytest.mark.parametrize("device", DEVICES)
async def test_the_host_tier_holds_a_device_caches_chunks_in_pinned_memory(
    tmp_path: Path, device: str
) -> None:
    """`cpu_cache_gib` in front of `fs` with a device cache: its region is pinned where
    CUDA is present (`cudaHostRegister`), a save lands there through host staging, and a
    load is served from it (the store's files are gone by then) into other blocks."""
    layout, caches = vllm_layout(device, "LBNHC", 100, seed=3)
    before = [c.clone() for c in caches]
    events: list[object] = []
    ctx = TransportContext("e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout)
    ctx.tier_event = events.append
    tier = with_host_tier(FsTransport(FsOptions(path=str(tmp_path)), ctx), 8 << 20, "s3fifo")
    await tier.open()
    await tier.register(layout)
    assert isinstance(tier, HostTier) and tier.cache is not None and tier.cache.slots >= 3
    region = torch.frombuffer(tier.cache.region, dtype=torch.uint8)
    assert region.is_pinned() == torch.cuda.is_available(), "pinned where CUDA is present"
    keys = chunk_keys("host-tier", list(range(sum(COUNTS))), BS)
    out = HostStage(layout, [3, 40, 7], COUNTS)

    async def spans(layer: int) -> list[list[memoryview]]:
        await out.gather(layer)
        return out.spans(layer)

    await tier.save(SaveJob("s", keys, COUNTS, LAYERS, spans))
    for f in tmp_path.rglob("*.kv"):
        f.unlink()
    into = HostStage(layout, [90, 0, 51], COUNTS)
    after = None
    if device == "cuda":
        after = torch.cuda.Event()
        after.record()
    await tier.load(
        LoadJob("l", keys, COUNTS, LAYERS, into.spans, lambda i: into.scatter(i, after))
    )
    if device == "cuda":
        torch.cuda.synchronize()
    (read,) = [e for e in events if isinstance(e, TierRead)]
    assert (read.hits, read.misses) == (3, 0)
    for c, b in zip(caches, before, strict=True):
        for a, z, n in zip([3, 40, 7], [90, 0, 51], COUNTS, strict=True):
            assert torch.equal(c[z, :, :n], b[a, :, :n]), (a, z)
            assert torch.equal(c[z, :, n:], b[z, :, n:]), "past a partial block's tokens"
    await tier.aclose()
