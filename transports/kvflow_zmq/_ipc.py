"""CUDA IPC for the `zmq` transport: on one host, KV moves device to device and ZMQ
carries only control frames.

The producer exports one IPC handle per layer when vLLM registers its caches
(`export`); a consumer opens a producer's handles once and caches them
(`open`), then copies the offered blocks straight out of the producer's
memory into its own on a side stream, and signals a layer once the copy's
CUDA event has completed (`Device.done`, awaited from trio, never blocking
the loop).

Handles are the fields of torch's `UntypedStorage._share_cuda_()`, the same
mechanism `torch.multiprocessing` uses, carried as a msgspec Struct (never
pickle). `Device` is the one seam between this module and the GPU. The copies are
Triton kernels on a GPU (`kvflow.geometry.kernels`: every layer of an asynchronous
pull in one launch) and torch's indexing elsewhere; the CPU test suite runs both,
the kernels in Triton's interpreter, with an in-process stand-in for the handles.
"""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
import trio

from kvflow.geometry import kernels
from kvflow.geometry.layout import LayerGeometry
from kvflow.geometry.views import (
    block_views,
    cell_view,
    copy_tokens,
    from_token_major,
    to_token_major,
)
from kvflow.runtime import cuda_event, event_done

__all__ = [
    "ChunkIndex",
    "CudaDevice",
    "Device",
    "IpcHandle",
    "copy_chunks",
    "copy_stream",
    "host_id",
    "stream_map",
]


class IpcHandle(msgspec.Struct, array_like=True, frozen=True):
    """One layer's memory, exported by the producer (torch's `_share_cuda_()` fields)."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    start: int
    """Byte offset of the layer's first byte in the exported storage."""
    nbytes: int


@functools.cache
def host_id() -> str:
    """This machine's identity: CUDA IPC handles only open on the host that made them."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


class Device:
    """How layer memory is shared and copies are awaited; `CudaDevice` is the real one."""

    def export(self, layer: torch.Tensor) -> IpcHandle:
        raise NotImplementedError

    def open(self, handle: IpcHandle) -> torch.Tensor:
        raise NotImplementedError

    @contextlib.contextmanager
    def stream(self, device: torch.device) -> Iterator[None]:
        yield

    async def done(self, device: torch.device) -> None:
        """Wait until the copies queued under `stream(device)` have landed."""
        await trio.lowlevel.checkpoint()

    def wait_idle(self, device: torch.device) -> None:
        """Block until every copy queued under `stream(device)` has landed (a cancelled
        `done` must not leave copies queued into blocks vLLM gets back)."""


class CudaDevice(Device):
    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def export(self, layer: torch.Tensor) -> IpcHandle:
        storage = layer.untyped_storage()
        dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
        return IpcHandle(
            int(dev),
            bytes(handle),
            int(size),
            int(offset),
            bytes(rc_handle),
            int(rc_offset),
            bytes(ev_handle or b""),
            bool(ev_sync),
            start=int(layer.storage_offset()),
            nbytes=layer.numel(),
        )

    def open(self, handle: IpcHandle) -> torch.Tensor:
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            handle.device,
            handle.handle,
            handle.size,
            handle.offset,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle or None,
            handle.event_sync_required,
        )
        whole = torch.empty(0, dtype=torch.uint8, device=f"cuda:{handle.device}")
        whole.set_(storage)
        return whole[handle.start : handle.start + handle.nbytes]

    @contextlib.contextmanager
    def stream(self, device: torch.device) -> Iterator[None]:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(self._streams[device]):
            yield

    async def done(self, device: torch.device) -> None:
        event = cuda_event()
        event.record(self._streams[device])
        await event_done(event)

    def wait_idle(self, device: torch.device) -> None:
        if device in self._streams:
            self._streams[device].synchronize()


class ChunkIndex:
    """A pull's chunks as device tensors, built once per pull (`copy_chunks`): the full
    chunks' source and destination blocks, the chunk numbers of full and partial
    chunks, and, for the device kernels, token maps (`kvflow.geometry.kernels`)."""

    def __init__(
        self,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        token_counts: Sequence[int],
        g: LayerGeometry,
        src_device: torch.device,
        dst_device: torch.device,
    ) -> None:
        self.src_blocks, self.dst_blocks = list(src_blocks), list(dst_blocks)
        self.token_counts = list(token_counts)
        full = [i for i, n in enumerate(token_counts) if g.block_bytes or n == g.block_size]
        self.full, self.partial = full, sorted(set(range(len(token_counts))) - set(full))
        self.si = torch.tensor([src_blocks[i] for i in full], device=src_device)
        self.di = torch.tensor([dst_blocks[i] for i in full], device=dst_device)
        self._block_size, self._device = g.block_size, dst_device
        self._maps: dict[bool, torch.Tensor] = {}

    def tokens(self, partial_only: bool) -> torch.Tensor:
        """The token map of every chunk's tokens, or of the partial chunks' only."""
        if partial_only not in self._maps:
            which = self.partial if partial_only else range(len(self.token_counts))
            self._maps[partial_only] = kernels.chunk_tokens(
                [self.src_blocks[i] for i in which],
                [self.dst_blocks[i] for i in which],
                [self.token_counts[i] for i in which],
                self._block_size,
                self._device,
            )
        return self._maps[partial_only]


def copy_chunks(
    srcs: Sequence[torch.Tensor],
    g_src: LayerGeometry,
    dsts: Sequence[torch.Tensor],
    g_dst: LayerGeometry,
    index: ChunkIndex,
    heads: tuple[int, int, int] | None = None,
) -> None:
    """Queue the copy of chunk i of `index` (`index.token_counts[i]` tokens) from block
    `index.src_blocks[i]` to `index.dst_blocks[i]` in each layer of `srcs` into the same
    of `dsts` (layers of the geometries `g_src` and `g_dst`, which hold the same cells,
    `layout_mismatch(..., cells=True)`); with `heads` (first, into, count), heads
    `first..` of the source's blocks into heads `into..` of the destination's, nothing
    else written.

    On one CUDA device, one kernel launch for all the layers moves the full chunks run by
    run, or, between two layouts or for some heads, every chunk cell by cell (a second
    launch moves the partial chunks' tokens). Elsewhere torch's indexing, layer by layer:
    full chunks in one gather/scatter per run of a whole block, or, between two layouts,
    one gather into the token-major order and one scatter out of it. Either way a partial
    chunk of a token-granular layer moves only its tokens, so nothing past them is
    written.
    """
    kern = kernels.device_kernels(srcs[0], dsts[0]) if srcs else None
    if kern is None:
        for src, dst in zip(srcs, dsts, strict=True):
            _torch_chunks(src, g_src, dst, g_dst, index, heads)
        return
    if heads is not None or g_src.block_shape() != g_dst.block_shape():
        kern.copy_cells(srcs, g_src, dsts, g_dst, index.tokens(partial_only=False), heads)
        return
    kern.copy_runs(srcs, g_src, dsts, g_dst, index.si, index.di)
    if index.partial:
        kern.copy_cells(srcs, g_src, dsts, g_dst, index.tokens(partial_only=True))


def _torch_chunks(
    src: torch.Tensor,
    g_src: LayerGeometry,
    dst: torch.Tensor,
    g_dst: LayerGeometry,
    index: ChunkIndex,
    heads: tuple[int, int, int] | None,
) -> None:
    """`copy_chunks` of one layer with torch's indexing."""
    si, di, full, partial = index.si, index.di, index.full, index.partial
    src_blocks, dst_blocks, token_counts = index.src_blocks, index.dst_blocks, index.token_counts
    if heads is not None:  # a consumer rank of another tensor-parallel size: these heads
        first, into, count = heads
        src_cells = cell_view(src, g_src)[:, :, first : first + count]
        dst_cells = cell_view(dst, g_dst)[:, :, into : into + count]
        if full:  # [k, kernel, heads, tokens, cell] -> the same in the other's kernel split
            cells = src_cells.index_select(0, si).permute(0, 1, 3, 2, 4)
            image = cells.reshape(len(si), g_dst.kernel_blocks, g_dst.kernel_tokens, count, -1)
            dst_cells.index_copy_(0, di, image.permute(0, 1, 3, 2, 4).to(dst.device))
        for i in partial:
            copy_tokens(
                dst_cells[dst_blocks[i]], g_dst, src_cells[src_blocks[i]], g_src, token_counts[i]
            )
        return
    if g_src.block_shape() != g_dst.block_shape():  # the same cells in another order
        src_cells, dst_cells = cell_view(src, g_src), cell_view(dst, g_dst)
        if full:
            image = to_token_major(src_cells.index_select(0, si), g_src)
            dst_cells.index_copy_(0, di, from_token_major(image.to(dst.device), g_dst))
        for i in partial:
            copy_tokens(
                dst_cells[dst_blocks[i]], g_dst, src_cells[src_blocks[i]], g_src, token_counts[i]
            )
        return
    views = list(zip(block_views(src, g_src), block_views(dst, g_dst), strict=True))
    if full:
        for s, d in views:
            d.index_copy_(0, di, s.index_select(0, si).to(dst.device, non_blocking=True))
    for i in partial:
        n, sb, db = token_counts[i], src_blocks[i], dst_blocks[i]
        for (so, length), (do, _) in zip(g_src.runs(n), g_dst.runs(n), strict=True):
            s0, d0 = sb * g_src.block_stride + so, db * g_dst.block_stride + do
            dst[d0 : d0 + length].copy_(src[s0 : s0 + length], non_blocking=True)


def stream_map(
    src: torch.Tensor,
    g_src: LayerGeometry,
    src_blocks: Sequence[int],
    skip: int,
    dst: torch.Tensor,
    g_dst: LayerGeometry,
    dst_blocks: Sequence[int],
    token_counts: Sequence[int],
) -> torch.Tensor | None:
    """The token map `copy_stream`'s kernel takes (built once per pull), or None where
    it copies with torch's indexing."""
    if kernels.device_kernels(src, dst) is None:
        return None
    return kernels.stream_tokens(
        src_blocks, g_src.block_size, skip, dst_blocks, token_counts, g_dst.block_size, dst.device
    )


def copy_stream(
    srcs: Sequence[torch.Tensor],
    g_src: LayerGeometry,
    src_blocks: Sequence[int],
    skip: int,
    dsts: Sequence[torch.Tensor],
    g_dst: LayerGeometry,
    dst_blocks: Sequence[int],
    token_counts: Sequence[int],
    heads: tuple[int, int, int],
    tokens: torch.Tensor | None = None,
) -> None:
    """Queue the copy of a token stream between blocks of other sizes (each layer of
    `srcs` into the same of `dsts`): the tokens of `src_blocks` end to end from token
    `skip` on, `token_counts[i]` of them into block `dst_blocks[i]`, heads (first, into,
    count) of theirs into ours; nothing past the last chunk's tokens written. With
    `tokens` (`stream_map`: one CUDA device), one kernel launch for all the layers; else,
    layer by layer, one gather into the token-major order and one scatter out of it.
    """
    if not sum(token_counts) or not srcs:
        return
    kern = None if tokens is None else kernels.device_kernels(srcs[0], dsts[0])
    if kern is not None:
        kern.copy_cells(srcs, g_src, dsts, g_dst, tokens, heads)
        return
    for src, dst in zip(srcs, dsts, strict=True):
        _torch_stream(src, g_src, src_blocks, skip, dst, g_dst, dst_blocks, token_counts, heads)


def _torch_stream(
    src: torch.Tensor,
    g_src: LayerGeometry,
    src_blocks: Sequence[int],
    skip: int,
    dst: torch.Tensor,
    g_dst: LayerGeometry,
    dst_blocks: Sequence[int],
    token_counts: Sequence[int],
    heads: tuple[int, int, int],
) -> None:
    """`copy_stream` of one layer with torch's indexing."""
    first, into, count = heads
    cell, total = g_src.cell_bytes, sum(token_counts)
    src_cells = cell_view(src, g_src)[:, :, first : first + count]
    si = torch.tensor(list(src_blocks), dtype=torch.long, device=src.device)
    picked = src_cells.index_select(0, si).permute(0, 1, 3, 2, 4)  # [k, kb, kt, heads, cell]
    stream = picked.reshape(-1, count, cell)[skip : skip + total].to(dst.device)
    dst_cells = cell_view(dst, g_dst)[:, :, into : into + count]
    bs, kb, kt = g_dst.block_size, g_dst.kernel_blocks, g_dst.kernel_tokens
    full = next((i for i, n in enumerate(token_counts) if n != bs), len(token_counts))
    if full:
        image = stream[: full * bs].reshape(full, kb, kt, count, cell).permute(0, 1, 3, 2, 4)
        di = torch.tensor(list(dst_blocks[:full]), dtype=torch.long, device=dst.device)
        dst_cells.index_copy_(0, di, image)
    t = full * bs
    for b, n in zip(dst_blocks[full:], token_counts[full:], strict=True):  # token by token
        for k in range(-(-n // kt)):
            m = min(kt, n - k * kt)
            dst_cells[b, k, :, :m].copy_(stream[t : t + m].transpose(0, 1), non_blocking=True)
            t += m
