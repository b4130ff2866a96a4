"""Host staging: store transports, which move host memory, serve device KV caches.

When vLLM's KV cache is in CUDA memory and the transport moves host memory only
(`fs`, a Redis store, most user transports), the worker stages each job
through a compact host image of its blocks: a save gathers a layer's blocks
(once vLLM computed it) and hands the transport spans of the image; a load
hands the transport the image's spans and scatters each layer into the
device blocks as soon as the transport filled it, before the layer's gate
opens (synchronously: the scatter of one layer of one request, a few hundred
microseconds at PCIe speed, holds the worker's loop). Per layer, one gather (or
scatter) on the device (a Triton kernel on a GPU, `kvflow.geometry.kernels`) plus one
copy between the device and pinned host memory, on a side stream; a gather's
completion is awaited from trio (`event_done`: a thread waits on its event). The
image is token-major (`[tokens, heads, cell]` per chunk) whatever vLLM's layout,
so bytes a store holds read back into a cache of any layout. A partial block
moves whole to the host (a read), but only its tokens are written back into the
device.

Off a GPU the copies are torch's indexing, which runs on any device; the CPU test
suite runs them, and the kernels in Triton's interpreter, on CPU tensors standing in
for a CUDA cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import trio

from .._moved import old_names
from ..geometry import kernels
from ..geometry.layout import KVLayout, LayerGeometry
from ..geometry.views import block_views, cell_view, copy_tokens, from_token_major, to_token_major
from ..runtime import cuda_event, event_done

__all__ = ["HostStage", "mark"]


def mark(layout: KVLayout) -> Any:
    """A CUDA event on the calling thread's current stream (vLLM's, when called from
    its thread), for staging copies to wait on; None for other memory."""
    if not layout.tensors or layout.tensors[0].device.type != "cuda":
        return None
    event = cuda_event()
    event.record()
    return event


class HostStage:
    """One job's blocks in a compact host image: chunk `c` of layer `l` is `host[l][c]`,
    token-major `[block_size, heads, cell]` whatever vLLM's layout (so a store's bytes
    read back into any layout), or the opaque block of a block-granular layer."""

    def __init__(
        self, layout: KVLayout, block_ids: Sequence[int], token_counts: Sequence[int]
    ) -> None:
        import torch

        self.layout = layout
        self.block_ids = list(block_ids)
        self.token_counts = list(token_counts)
        self.device = layout.tensors[0].device
        self._cuda = self.device.type == "cuda"
        for g in layout.geometries:
            g.check_blocks(self.block_ids, "staged")
        self._whole = [c for c, n in enumerate(self.token_counts) if n >= layout.block_size]
        """Chunks that fill their block (in a block-granular layer every chunk does)."""
        self._host = [
            torch.empty(
                (len(self.block_ids), g.chunk_nbytes(g.block_size)),
                dtype=torch.uint8,
                pin_memory=self._cuda,
            )
            for g in layout.geometries
        ]
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        with self._on_stream():  # allocated on the stream that uses it
            self._index = torch.tensor(self.block_ids, dtype=torch.long, device=self.device)
        self._device_image: Any = None
        self._maps: dict[bool, Any] = {}

    # -- what the transport sees ------------------------------------------------
    def spans(self, layer: int) -> list[list[memoryview]]:
        """Each chunk's bytes in the host image: one span (its tokens, token-major)."""
        g = self.layout.geometries[layer]
        host = self._host[layer].numpy()
        return [[host[c, : g.chunk_nbytes(n)].data] for c, n in enumerate(self.token_counts)]

    # -- device <-> host ---------------------------------------------------------
    async def gather(self, layer: int) -> None:
        """Copy the job's blocks of `layer` from the device into the host image."""
        g, flat, host = self.layout.geometries[layer], self.layout.tensors[layer], self._host[layer]
        with self._on_stream():
            k = None if g.block_bytes else kernels.device_kernels(flat, flat)
            if k is not None:  # one launch into a device image, one copy to the host
                image = self._image(layer)
                g_image, tokens = self._image_geometry(g), self._tokens(gather=True)
                k.copy_cells([flat], g, [image], g_image, tokens)
                host.copy_(image.view(host.shape), non_blocking=True)
            elif g.block_bytes:
                (view,) = block_views(flat, g)
                host.copy_(view.index_select(0, self._index), non_blocking=True)
            else:
                image = to_token_major(cell_view(flat, g).index_select(0, self._index), g)
                host.copy_(image.reshape(len(host), -1), non_blocking=True)
        await self._done()

    def scatter(self, layer: int, after: Any = None) -> None:
        """Copy the host image of `layer` into the job's device blocks, each partial
        block's tokens only; `after`: an event (`mark`) the copy must follow. Returns
        once the copy landed: the caller opens the layer's gate next."""
        import torch

        g = self.layout.geometries[layer]
        flat = self.layout.tensors[layer]
        whole = list(range(len(self.block_ids))) if g.block_bytes else self._whole
        keep = set(whole)
        partial = [c for c in range(len(self.block_ids)) if c not in keep]
        with self._on_stream():
            if after is not None and self._stream is not None:
                self._stream.wait_event(after)
            k = None if g.block_bytes else kernels.device_kernels(flat, flat)
            if k is not None:  # one copy to a device image, one launch out of it
                image = self._image(layer)
                image.view(self._host[layer].shape).copy_(self._host[layer], non_blocking=True)
                g_image, tokens = self._image_geometry(g), self._tokens(gather=False)
                k.copy_cells([image], g_image, [flat], g, tokens)
                return self._synchronize()
            staged = self._host[layer].to(self.device, non_blocking=True)
            chunks = torch.tensor(whole, dtype=torch.long, device=self.device)
            if g.block_bytes:
                (view,) = block_views(flat, g)
                view.index_copy_(0, self._index[chunks], staged.index_select(0, chunks))
                return self._synchronize()
            image = staged.reshape(len(staged), g.block_size, g.heads, g.cell_bytes)
            cells, theirs = cell_view(flat, g), from_token_major(image, g)
            if whole:
                cells.index_copy_(0, self._index[chunks], theirs.index_select(0, chunks))
            for c in partial:
                copy_tokens(cells[self.block_ids[c]], g, theirs[c], g, self.token_counts[c])
        self._synchronize()

    def _image(self, layer: int) -> Any:
        """A device buffer of one layer's image (the kernel path; one per stage, reused
        layer after layer: the stream orders each use after the last)."""
        import torch

        nbytes = self._host[layer].numel()
        if self._device_image is None or self._device_image.numel() < nbytes:
            self._device_image = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._device_image[:nbytes]

    def _image_geometry(self, g: LayerGeometry) -> LayerGeometry:
        """The host image's layout of `g`'s chunks: dense, token-major."""
        return LayerGeometry(
            num_blocks=len(self.block_ids),
            block_size=g.block_size,
            block_stride=g.chunk_nbytes(g.block_size),
            heads=g.heads,
            head_stride=g.cell_bytes,
            token_stride=g.heads * g.cell_bytes,
            cell_bytes=g.cell_bytes,
        )

    def _tokens(self, gather: bool) -> Any:
        """The kernels' token map: every block whole into its chunk of the image
        (gather), or each chunk's tokens out of it into its block (scatter)."""
        if gather not in self._maps:
            chunks, bs = range(len(self.block_ids)), self.layout.block_size
            self._maps[gather] = (
                kernels.chunk_tokens(self.block_ids, chunks, [bs] * len(chunks), bs, self.device)
                if gather
                else kernels.chunk_tokens(
                    chunks, self.block_ids, self.token_counts, bs, self.device
                )
            )
        return self._maps[gather]

    def _synchronize(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        import torch

        with torch.cuda.stream(self._stream):
            yield

    async def _done(self) -> None:
        """Wait (from trio, never blocking the loop: `event_done`) until the copies landed."""
        if self._stream is None:
            await trio.lowlevel.checkpoint()
            return
        event = cuda_event()
        event.record(self._stream)
        await event_done(event)


# What 0.4 moved out of staging and renamed, by its old name until 0.5 (the other views
# it held are imported here, and answer as before).
__getattr__ = old_names(__name__, {"token_major": "kvflow.geometry.views:to_token_major"})
