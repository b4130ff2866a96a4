"""Host staging: store transports, which move host memory, serve device KV caches.

When vLLM's KV cache is in CUDA memory and the transport moves host memory only
(`fs`, a Redis store, most user transports), the worker stages each job
through a compact host image of its blocks: a save gathers a layer's blocks
(once vLLM computed it) and hands the transport spans of the image; a load
hands the transport the image's spans and scatters each layer into the
device blocks as soon as the transport filled it, before the layer's gate
opens (synchronously: the scatter of one layer of one request, a few hundred
microseconds at PCIe speed, holds the worker's loop). Per layer and run of a
whole block (`LayerGeometry.block_runs`), one gather (or scatter) on the device
plus one copy between the device and pinned host memory, on a side stream; a
gather's completion is polled from trio. A partial block moves whole to the
host (a read), but only its tokens are written back into the device.

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
    """One `[num_blocks, run length]` view per run of a whole block of a flat uint8
    layer tensor (`LayerGeometry.block_runs`): row b is that run of block b."""
    base = flat.storage_offset()
    return [
        flat.as_strided((g.num_blocks, n), (g.block_stride, 1), base + off)
        for off, n in g.block_runs()
    ]


def image_ranges(g: LayerGeometry, num_tokens: int) -> list[tuple[int, int, int]]:
    """(offset in the block, offset in the block's image, length) of each run holding
    the first `num_tokens` tokens: the image of a block is its whole-block runs end to
    end (`block_views` order)."""
    starts, at = [], 0
    for off, n in g.block_runs():
        starts.append((off, at, n))
        at += n
    out = []
    for off, n in g.runs(num_tokens):
        run_off, img, _ = next(r for r in starts if r[0] <= off < r[0] + r[2])
        out.append((off, img + off - run_off, n))
    return out


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
    `host[l][c]`, its block's whole-block runs end to end (`image_ranges`)."""

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
                (len(self.block_ids), sum(n for _, n in g.block_runs())),
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
        """Each chunk's runs in the host image: the runs of its tokens."""
        g = self.layout.geometries[layer]
        host = self._host[layer].numpy()
        return [
            [host[c, img : img + n].data for _, img, n in image_ranges(g, count)]
            for c, count in enumerate(self.token_counts)
        ]

    # -- device <-> host ---------------------------------------------------------
    async def gather(self, layer: int) -> None:
        """Copy the job's blocks of `layer` from the device into the host image."""
        views = block_views(self.layout.tensors[layer], self.layout.geometries[layer])
        host, at = self._host[layer], 0
        with self._on_stream():
            for view in views:
                n = view.shape[1]
                host[:, at : at + n].copy_(view.index_select(0, self._index), non_blocking=True)
                at += n
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
            staged = self._host[layer].to(self.device, non_blocking=True)
            if whole:
                chunks = torch.tensor(whole, dtype=torch.long, device=self.device)
                at = 0
                for view in block_views(flat, g):
                    n = view.shape[1]
                    rows = staged[:, at : at + n].index_select(0, chunks)
                    view.index_copy_(0, self._index[chunks], rows)
                    at += n
            for c in partial:
                base = self.block_ids[c] * g.block_stride
                for off, img, n in image_ranges(g, self.token_counts[c]):
                    flat[base + off : base + off + n].copy_(
                        staged[c, img : img + n], non_blocking=True
                    )
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
