"""Host staging: store transports, which move host memory, serve device KV caches.

When vLLM's KV cache is in CUDA memory and the transport moves host memory only
(`fs`, a Redis store, most user transports), the worker stages each job
through a compact host image of its blocks: a save gathers a layer's blocks
(once vLLM computed it) and hands the transport spans of the image; a load
hands the transport the image's spans and scatters each layer into the
device blocks as soon as the transport filled it, before the layer's gate
opens (synchronously: the scatter of one layer of one request, a few hundred
microseconds at PCIe speed, holds the worker's loop). Per layer and plane, one
gather (or scatter) on the device plus one copy between the device and pinned
host memory, on a side stream; a gather's completion is polled from trio. A
partial block moves whole to the host (a read), but only its tokens are written
back into the device.

The copies are plain torch indexing, so they run on any device; the CPU test
suite runs them on CPU tensors standing in for a CUDA cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import trio

from .layout import KVLayout, LayerGeometry
from .runtime import poll_until

__all__ = ["HostStage", "block_views", "event_done", "mark"]


def block_views(flat: Any, g: LayerGeometry) -> list[Any]:
    """One `[num_blocks, run]` view per plane of a flat uint8 layer tensor: row b is
    block b's run in that plane (the whole block, if block-granular)."""
    run = g.block_bytes or g.block_size * g.token_bytes
    base = flat.storage_offset()
    return [
        flat.as_strided((g.num_blocks, run), (g.block_stride, 1), base + off)
        for off in g.plane_offsets
    ]


async def event_done(event: Any) -> None:
    """Wait for a CUDA event from trio (completion is poll-only); None: nothing to wait
    for."""
    if event is not None:
        await poll_until(event.query)


def mark(layout: KVLayout) -> Any:
    """A CUDA event on the calling thread's current stream (vLLM's, when called from
    its thread), for staging copies to wait on; None for other memory."""
    if not layout.tensors or layout.tensors[0].device.type != "cuda":
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


class HostStage:
    """One job's blocks in a compact host image: chunk `c` of layer `l` is
    `host[l][plane, c]`, a whole block's run per plane."""

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
                (
                    len(g.plane_offsets),
                    len(self.block_ids),
                    g.block_bytes or g.block_size * g.token_bytes,
                ),
                dtype=torch.uint8,
                pin_memory=self._cuda,
            )
            for g in layout.geometries
        ]
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        with self._on_stream():  # allocated on the stream that uses it
            self._index = torch.tensor(self.block_ids, dtype=torch.long, device=self.device)

    # -- what the transport sees ------------------------------------------------
    def spans(self, layer: int) -> list[list[memoryview]]:
        """Each chunk's runs in the host image: its tokens of every plane."""
        g = self.layout.geometries[layer]
        host = self._host[layer].numpy()
        return [
            [host[p, c, : g.block_bytes or n * g.token_bytes].data for p in range(len(host))]
            for c, n in enumerate(self.token_counts)
        ]

    # -- device <-> host ---------------------------------------------------------
    async def gather(self, layer: int) -> None:
        """Copy the job's blocks of `layer` from the device into the host image."""
        views = block_views(self.layout.tensors[layer], self.layout.geometries[layer])
        with self._on_stream():
            for p, view in enumerate(views):
                self._host[layer][p].copy_(view.index_select(0, self._index), non_blocking=True)
        await self._done()

    def scatter(self, layer: int, after: Any = None) -> None:
        """Copy the host image of `layer` into the job's device blocks, each partial
        block's tokens only; `after`: an event (`mark`) the copy must follow. Returns
        once the copy landed: the caller opens the layer's gate next."""
        import torch

        g = self.layout.geometries[layer]
        views = block_views(self.layout.tensors[layer], g)
        whole = list(range(len(self.block_ids))) if g.block_bytes else self._whole
        keep = set(whole)
        partial = [c for c in range(len(self.block_ids)) if c not in keep]
        with self._on_stream():
            if after is not None and self._stream is not None:
                self._stream.wait_event(after)
            staged = self._host[layer].to(self.device, non_blocking=True)
            chunks = torch.tensor(whole, dtype=torch.long, device=self.device)
            for p, view in enumerate(views):
                if whole:
                    view.index_copy_(0, self._index[chunks], staged[p].index_select(0, chunks))
                for c in partial:
                    n = self.token_counts[c] * g.token_bytes
                    view[self.block_ids[c], :n].copy_(staged[p, c, :n], non_blocking=True)
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
        """Wait (polling from trio, never blocking the loop) until the copies landed."""
        if self._stream is None:
            await trio.lowlevel.checkpoint()
            return
        import torch

        event = torch.cuda.Event()
        event.record(self._stream)
        await event_done(event)
