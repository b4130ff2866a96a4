"""Host staging of a device cache: the `fs` transport saves device blocks laid out
as vLLM's FlashAttention default (LBNHC) through (pinned) host memory and loads them
into other blocks of another cache, every token checked and nothing else written. The
`cuda` case needs a GPU and is skipped without one; the `cpu` case runs the same test on
CPU tensors everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.keys import chunk_keys
from kvflow.layout import KVLayout
from kvflow.staging import HostStage
from kvflow.testing.layouts import device_layout
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
