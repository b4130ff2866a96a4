"""Synthetic KV memory for tests: real buffers laid out as vLLM lays out its paged caches."""

from __future__ import annotations

import numpy as np
import torch

from ..geometry.layout import KVLayout, block_geometry, view_extent, view_geometry

__all__ = ["LAYOUTS", "device_layout", "fill_blocks", "make_layout", "token_bytes"]

LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
"""vLLM's `KVCacheLayout` members: the memory order of the logical `[layers, blocks,
heads, tokens, content]` dimensions, outermost first."""


def _vllm_strides(
    name: str, num_layers: int, num_blocks: int, heads: int, block_size: int, kernel: int, cell: int
) -> tuple[tuple[int, ...], list[int], int]:
    """The logical `[layers, kernel blocks, heads, tokens, content]` shape, its strides in
    elements as vLLM's `compute_layout_strides` gives them for layout `name`, and the
    elements of the backing buffer."""
    order = LAYOUTS[name]
    ratio = block_size // kernel
    if ratio > 1 and order[:2] != (0, 1):  # as vLLM refuses it
        raise ValueError(f"{name} does not store blocks as dense pages: no kernel blocks")
    shape = (num_layers, num_blocks * ratio, heads, kernel, cell)
    strides = [0] * 5
    size = 1
    for dim in reversed(order):
        strides[dim] = size
        size *= shape[dim]
    return shape, strides, size


def make_layout(
    *,
    num_layers: int = 2,
    num_blocks: int = 16,
    block_size: int = 4,
    heads: int = 2,
    head_dim: int = 8,
    block_granular: bool = False,
    hnd: bool = False,
    layout: str = "",
    kernel_block_size: int = 0,
    dtype: str = "float32",
) -> KVLayout:
    """All layers in one zeroed numpy buffer, each viewed as vLLM's
    `create_kv_cache_views` views it: logical `[blocks, heads, tokens, 2*head_dim]` (K
    and V side by side in a cell) in the memory order of `layout` (a `LAYOUTS` name;
    default LBNHC, vLLM's NHD default, or LBHNC with `hnd=True`), each block stored
    as `block_size // kernel_block_size` kernel blocks.

    `block_granular=True` describes the blocks as opaque, as vLLM's CPU attention
    packs them.
    """
    name = layout or ("LBHNC" if hnd or block_granular else "LBNHC")
    kernel = kernel_block_size or block_size
    shape, strides, size = _vllm_strides(
        name, num_layers, num_blocks, heads, block_size, kernel, 2 * head_dim
    )
    backing = np.zeros(size, dtype=dtype)
    raw = backing.view(np.uint8)
    itemsize = backing.itemsize
    extent = view_extent(shape[1:], strides[1:], itemsize)
    geometry = block_geometry if block_granular else view_geometry
    names, geos, bufs = [], [], []
    for i in range(num_layers):
        start = i * strides[0] * itemsize
        names.append(f"model.layers.{i}.self_attn.attn")
        geos.append(geometry(shape[1:], strides[1:], itemsize, num_blocks))
        bufs.append(memoryview(raw[start : start + extent]))  # type: ignore[arg-type]
    return KVLayout(names=names, geometries=geos, buffers=bufs, memory="cpu", block_size=block_size)


def device_layout(
    device: str = "cpu",
    *,
    layout: str = "LBNHC",
    num_layers: int = 4,
    num_blocks: int = 64,
    block_size: int = 16,
    heads: int = 8,
    head_dim: int = 128,
    kernel_block_size: int = 0,
    seed: int = 0,
) -> tuple[KVLayout, list[torch.Tensor]]:
    """fp16 caches on `device` as vLLM's GPU runner allocates them (one backing buffer,
    each layer a `[blocks, heads, tokens, 2*head_dim]` view in `layout`'s memory order),
    filled from `seed`, and those views. The `KVLayout` is what the worker sees of a GPU
    cache (memory "cuda", flat uint8 `tensors`) whatever the device, so the CPU suite
    runs the device code paths."""
    kernel = kernel_block_size or block_size
    shape, strides, size = _vllm_strides(
        layout, num_layers, num_blocks, heads, block_size, kernel, 2 * head_dim
    )
    gen = torch.Generator(device=device).manual_seed(seed)
    backing = torch.randn(size, generator=gen, device=device).half()
    raw = backing.view(torch.uint8)
    extent = view_extent(shape[1:], strides[1:], 2)
    views, geos, flat = [], [], []
    for i in range(num_layers):
        views.append(backing.as_strided(shape[1:], strides[1:], i * strides[0]))
        geos.append(view_geometry(shape[1:], strides[1:], 2, num_blocks))
        flat.append(raw[2 * i * strides[0] : 2 * i * strides[0] + extent])
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    return KVLayout(names, geos, [], "cuda", block_size, flat), views


def token_bytes(layout: KVLayout, layer: int, block: int, num_tokens: int) -> bytes:
    """The first `num_tokens` tokens of a block in any layout, token by token and head by
    head (read by address arithmetic on the geometry, not through kvflow's own copies); a
    block-granular block whole. Equal for the same KV in any two layouts."""
    g, buf = layout.geometries[layer], layout.buffers[layer]
    if g.block_bytes:
        return bytes(buf[block * g.block_stride :][: g.block_bytes])
    out = bytearray()
    for t in range(num_tokens):
        k, i = divmod(t, g.kernel_tokens)
        for h in range(g.heads):
            at = block * g.block_stride + k * g.kernel_stride + h * g.head_stride
            at += i * g.token_stride
            out += buf[at : at + g.cell_bytes]
    return bytes(out)


def fill_blocks(layout: KVLayout, block_ids: list[int], seed: int = 0) -> None:
    """Write distinct pseudo-random bytes into every layer of `block_ids`."""
    rng = np.random.default_rng(seed)
    for layer in range(layout.num_layers):
        for b in block_ids:
            for span in layout.spans(layer, b, layout.block_size):
                span[:] = rng.integers(0, 256, len(span), dtype=np.uint8).tobytes()
