"""Host staging of device KV caches, on CPU tensors standing in for a CUDA cache (the
copies are the same torch indexing on any device, and the device kernels run in Triton's
interpreter; tests/gpu/test_staging_cuda.py runs them on a GPU where one exists)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import trio

from kvflow.engine.staging import HostStage
from kvflow.geometry.layout import KVLayout, LayoutError
from kvflow.testing.layouts import LAYOUTS, fill_blocks, make_layout, token_bytes

from ..support.zmq_standins import interpreted_kernels

BS = 4
KINDS = {name: {"layout": name} for name in LAYOUTS} | {
    "packed": {"block_granular": True},
    "LBHNC-kernel2": {"layout": "LBHNC", "kernel_block_size": BS // 2},
    "LBNHC-kernel2": {"layout": "LBNHC", "kernel_block_size": BS // 2},
}
COUNTS = [4, 4, 3]
COPIES = ["torch", "kernel"]
"""Torch's indexing (what runs on a CPU) or the device kernels (what runs on a GPU)."""


def copies(how: str) -> contextlib.AbstractContextManager[list[int]]:
    return interpreted_kernels() if how == "kernel" else contextlib.nullcontext([1])


def device_layout(kind: str, num_blocks: int = 12) -> KVLayout:
    """A layout whose `tensors` are the cache (memory 'cuda', as vLLM's GPU caches are);
    `buffers` alias them so the test can read bytes."""
    layout = make_layout(num_layers=3, num_blocks=num_blocks, block_size=BS, **KINDS[kind])
    layout.memory = "cuda"
    layout.tensors = [torch.frombuffer(b, dtype=torch.uint8) for b in layout.buffers]
    return layout


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("kind", KINDS)
def test_gather_hands_the_transport_each_chunks_token_bytes(kind: str, how: str) -> None:
    layout = device_layout(kind)
    fill_blocks(layout, [3, 5, 7], seed=1)
    stage = HostStage(layout, [3, 5, 7], COUNTS)
    with copies(how) as ran:
        for layer in range(layout.num_layers):
            trio.run(stage.gather, layer)
            for chunk, (block, n) in enumerate(zip([3, 5, 7], COUNTS, strict=True)):
                got = b"".join(bytes(s) for s in stage.spans(layer)[chunk])
                assert got == token_bytes(layout, layer, block, n)
    assert ran or kind == "packed", "the device kernels copied nothing"


@pytest.mark.parametrize(
    ("kind", "into"),
    [(k, k) for k in KINDS] + [("LBHNC", "LBNHC"), ("LBNHC-kernel2", "BHLNC")],
    ids=lambda k: k,
)
@pytest.mark.parametrize("how", COPIES)
def test_scatter_writes_the_chunks_and_nothing_else(kind: str, into: str, how: str) -> None:
    """Into a cache of the same layout, or another (a store written by an instance whose
    attention backend lays out its cache otherwise)."""
    src, dst = device_layout(kind), device_layout(into, num_blocks=20)
    fill_blocks(src, [0, 1, 2], seed=2)
    out, into = HostStage(src, [0, 1, 2], COUNTS), HostStage(dst, [9, 4, 17], COUNTS)
    for layer in range(src.num_layers):
        trio.run(out.gather, layer)
        for mine, theirs in zip(into.spans(layer), out.spans(layer), strict=True):
            for d, s in zip(mine, theirs, strict=True):
                d[:] = s  # what a transport does with the spans
        before = np.frombuffer(dst.buffers[layer], np.uint8).copy()
        with copies(how) as ran:
            into.scatter(layer)
        assert ran or kind == "packed", "the device kernels copied nothing"
        for a, b, n in zip([0, 1, 2], [9, 4, 17], COUNTS, strict=True):
            assert token_bytes(dst, layer, b, n) == token_bytes(src, layer, a, n)
        changed = np.flatnonzero(np.frombuffer(dst.buffers[layer], np.uint8) != before)
        g = dst.geometries[layer]
        written = {
            off + i
            for b, n in zip([9, 4, 17], COUNTS, strict=True)
            for off, length in g.ranges(b, n)
            for i in range(length)
        }
        assert set(changed.tolist()) <= written, "a partial block's other slots stay as they were"


def test_block_ids_outside_the_cache_are_refused_on_the_host() -> None:
    with pytest.raises(LayoutError, match=r"staged block ids \[3, 12\] outside 0\.\.11"):
        HostStage(device_layout("LBNHC"), [3, 12], [4, 4])
