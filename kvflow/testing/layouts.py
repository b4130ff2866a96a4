"""Synthetic KV memory for tests: real buffers shaped like vLLM's paged caches."""

from __future__ import annotations

import numpy as np

from ..layout import KVLayout, block_geometry, geometry_from_strides

__all__ = ["fill_blocks", "make_layout"]


def make_layout(
    *,
    num_layers: int = 2,
    num_blocks: int = 16,
    block_size: int = 4,
    heads: int = 2,
    head_dim: int = 8,
    block_granular: bool = False,
    hnd: bool = False,
    dtype: str = "float32",
) -> KVLayout:
    """A layout over zeroed numpy buffers.

    `block_granular=True` mimics vLLM's CPU cache `[blocks, heads, block_size, 2*head_dim]`
    (blocks opaque); `hnd=True` an HND cache `[2, blocks, heads, block_size, head_dim]`
    (one plane per K/V head); otherwise an NHD cache `[2, blocks, block_size, heads,
    head_dim]`.
    """
    names, geos, bufs = [], [], []
    for i in range(num_layers):
        if block_granular:
            arr = np.zeros((num_blocks, heads, block_size, 2 * head_dim), dtype=dtype)
            strides = [s // arr.itemsize for s in arr.strides]
            geo = block_geometry(arr.shape, strides, arr.itemsize)
        elif hnd:
            arr = np.zeros((2, num_blocks, heads, block_size, head_dim), dtype=dtype)
            strides = [s // arr.itemsize for s in arr.strides]
            geo = geometry_from_strides(arr.shape, strides, arr.itemsize, block_dim=1, token_dim=3)
        else:
            arr = np.zeros((2, num_blocks, block_size, heads, head_dim), dtype=dtype)
            strides = [s // arr.itemsize for s in arr.strides]
            geo = geometry_from_strides(arr.shape, strides, arr.itemsize, block_dim=1, token_dim=2)
        names.append(f"model.layers.{i}.self_attn.attn")
        geos.append(geo)
        bufs.append(memoryview(arr.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
    return KVLayout(names=names, geometries=geos, buffers=bufs, memory="cpu", block_size=block_size)


def fill_blocks(layout: KVLayout, block_ids: list[int], seed: int = 0) -> None:
    """Write distinct pseudo-random bytes into every layer of `block_ids`."""
    rng = np.random.default_rng(seed)
    for layer in range(layout.num_layers):
        for b in block_ids:
            for span in layout.spans(layer, b, layout.block_size):
                span[:] = rng.integers(0, 256, len(span), dtype=np.uint8).tobytes()
