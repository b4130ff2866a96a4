"""Torch views of a layer's KV memory, whatever vLLM's layout: the device side of
`kvflow.geometry.layout` and `kvflow.geometry.cells`.

A flat uint8 tensor of one layer seen as whole-block runs (`block_views`) or as cells
(`cell_view`: `[blocks, kernel blocks, heads, kernel tokens, cell]`), the canonical
token-major image of blocks (`to_token_major`, `from_token_major`: `[blocks,
block_size, heads, cell]`, what host staging stores and CUDA IPC sends), and copies of
a block's tokens between layouts (`copy_tokens`). Plain torch indexing: they run on any
device (the CPU test suite runs them on CPU tensors standing in for a CUDA cache).
"""

from __future__ import annotations

from typing import Any

from .layout import LayerGeometry

__all__ = ["block_views", "cell_view", "copy_tokens", "from_token_major", "to_token_major"]


def block_views(flat: Any, g: LayerGeometry) -> list[Any]:
    """One `[num_blocks, run length]` view per run of a whole block of a flat uint8
    layer tensor (`LayerGeometry.block_runs`): row b is that run of block b."""
    base = flat.storage_offset()
    return [
        flat.as_strided((g.num_blocks, n), (g.block_stride, 1), base + off)
        for off, n in g.block_runs()
    ]


def cell_view(flat: Any, g: LayerGeometry) -> Any:
    """A token-granular layer as `[blocks, kernel blocks, heads, kernel tokens, cell]`
    (a strided view of the flat uint8 tensor, whatever vLLM's layout)."""
    return flat.as_strided(
        (g.num_blocks, g.kernel_blocks, g.heads, g.kernel_tokens, g.cell_bytes),
        (g.block_stride, g.kernel_stride, g.head_stride, g.token_stride, 1),
        flat.storage_offset(),
    )


def to_token_major(cells: Any, g: LayerGeometry) -> Any:
    """`[k, kernel blocks, heads, kernel tokens, cell]` cells of k blocks as the canonical
    image `[k, block_size, heads, cell]` (a view when the layout is NHD, else a copy)."""
    return cells.permute(0, 1, 3, 2, 4).reshape(len(cells), g.block_size, g.heads, g.cell_bytes)


def from_token_major(image: Any, g: LayerGeometry) -> Any:
    """The canonical image `[k, block_size, heads, cell]` as `g`'s cells (a view)."""
    k = len(image)
    shape = (k, g.kernel_blocks, g.kernel_tokens, g.heads, g.cell_bytes)
    return image.reshape(shape).permute(0, 1, 3, 2, 4)


def copy_tokens(dst: Any, g_dst: LayerGeometry, src: Any, g_src: LayerGeometry, n: int) -> None:
    """Copy the first `n` tokens of one block's cells (`cell_view(...)[b]`) into another's,
    kernel blocks of either size, nothing past them written."""
    t = 0
    while t < n:
        ks, ts = divmod(t, g_src.kernel_tokens)
        kd, td = divmod(t, g_dst.kernel_tokens)
        m = min(n - t, g_src.kernel_tokens - ts, g_dst.kernel_tokens - td)
        dst[kd, :, td : td + m].copy_(src[ks, :, ts : ts + m], non_blocking=True)
        t += m
