"""KV memory geometry as byte spans.

A layer's paged KV buffer is some strided tensor with a block dimension and a
token dimension (e.g. `[2, num_blocks, block_size, heads, head_dim]` for NHD,
`[2, num_blocks, heads, block_size, head_dim]` for HND). Whatever the attention
backend, the bytes of `n` tokens of one block are a few contiguous *runs*, one
per *plane* (a K or V half, a head in HND). `LayerGeometry` records planes by
byte offset and strides, so transports move `memoryview` spans and never learn
backend shapes.

Some backends pack a block so that tokens are not separable (vLLM's CPU
attention stores K transposed inside each block). Their geometry is
*block-granular*: a chunk is always its whole block, one opaque run, and a
partial chunk carries the whole block too (the slots past its tokens are
never read: vLLM overwrites them as it computes those positions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = [
    "KVLayout",
    "LayerGeometry",
    "LayoutError",
    "block_geometry",
    "geometry_from_strides",
]


class LayoutError(ValueError):
    """Registered KV memory that kvflow cannot describe as spans."""


class LayerGeometry(msgspec.Struct, frozen=True):
    """Where one layer's tokens live in its buffer, in bytes."""

    num_blocks: int
    block_size: int
    plane_offsets: tuple[int, ...]
    block_stride: int
    token_bytes: int
    """Contiguous bytes of one token in one plane (0 when block-granular)."""
    block_bytes: int = 0
    """Non-zero for block-granular layouts: a block is one opaque run of this size."""

    def chunk_nbytes(self, num_tokens: int) -> int:
        """Bytes a chunk of `num_tokens` tokens occupies in this layer."""
        if self.block_bytes:
            return self.block_bytes
        return num_tokens * len(self.plane_offsets) * self.token_bytes

    def describe(self) -> str:
        if self.block_bytes:
            return f"block_bytes={self.block_bytes}"
        return f"planes={len(self.plane_offsets)},token_bytes={self.token_bytes}"

    def ranges(self, block_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """(byte offset, length) of each run holding the first `num_tokens` tokens of
        `block_id`, relative to the layer's first byte."""
        if not 0 <= block_id < self.num_blocks:
            raise LayoutError(f"block {block_id} out of range (the layer has {self.num_blocks})")
        base = block_id * self.block_stride
        if self.block_bytes:
            return [(base, self.block_bytes)]
        n = num_tokens * self.token_bytes
        return [(base + off, n) for off in self.plane_offsets]

    def check_blocks(self, block_ids: Sequence[int], side: str) -> None:
        """Refuse out-of-range block ids on the host (on a device an out-of-range index
        is an assertion that takes the whole CUDA context down)."""
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise LayoutError(
                f"{side} block ids {list(block_ids)} outside 0..{self.num_blocks - 1}"
            )

    def block_shape(self) -> tuple[int, ...]:
        """What must match for a block of one cache to be copied into a block of another:
        everything but the number of blocks and where the planes start (NHD's V half
        starts after all K blocks, so it moves with `num_blocks`). With one block the
        K and V halves touch and merge into one run: a one-block cache matches no other."""
        runs = [n for _, n in self.block_runs()]
        return (self.block_size, self.token_bytes, self.block_bytes, len(self.plane_offsets), *runs)

    def block_runs(self) -> list[tuple[int, int]]:
        """(offset within a block, length) of the runs of one whole block, neighbouring
        planes merged (HND's heads of one K or V half are one run): what moves a full
        block with the fewest descriptors."""
        if self.block_bytes:
            return [(0, self.block_bytes)]
        runs: list[tuple[int, int]] = []
        n = self.block_size * self.token_bytes
        for off in sorted(self.plane_offsets):
            if runs and sum(runs[-1]) == off:
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            else:
                runs.append((off, n))
        return runs


def geometry_from_strides(
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    *,
    block_dim: int,
    token_dim: int,
) -> LayerGeometry:
    """Describe a strided tensor whose `block_dim` indexes blocks and `token_dim` tokens.

    Dimensions after `token_dim` must be dense (one token is one run); every
    other dimension becomes a plane.
    """
    if not 0 <= block_dim < token_dim < len(shape):
        raise LayoutError(f"need block_dim < token_dim in shape {tuple(shape)}")
    inner = shape[token_dim + 1 :]
    expect = itemsize
    for size, stride in zip(reversed(inner), reversed(strides[token_dim + 1 :]), strict=True):
        if size > 1 and stride * itemsize != expect:
            raise LayoutError(f"token data is not contiguous in shape {tuple(shape)}")
        expect *= size
    token_bytes = itemsize * math.prod(inner)
    if shape[token_dim] > 1 and strides[token_dim] * itemsize != token_bytes:
        raise LayoutError(f"tokens of a block are not adjacent in shape {tuple(shape)}")
    plane_dims = [d for d in range(token_dim) if d != block_dim]
    offsets = [0]
    for d in plane_dims:
        offsets = [o + i * strides[d] * itemsize for o in offsets for i in range(shape[d])]
    return LayerGeometry(
        num_blocks=shape[block_dim],
        block_size=shape[token_dim],
        plane_offsets=tuple(offsets),
        block_stride=strides[block_dim] * itemsize,
        token_bytes=token_bytes,
    )


def block_geometry(
    shape: Sequence[int], strides: Sequence[int], itemsize: int, *, block_dim: int = 0
) -> LayerGeometry:
    """Describe a tensor whose blocks (index `block_dim`) are each one dense run."""
    if block_dim != 0:
        raise LayoutError("block-granular layouts need the block dimension first")
    expect = itemsize
    for size, stride in zip(reversed(shape[1:]), reversed(strides[1:]), strict=True):
        if size > 1 and stride * itemsize != expect:
            raise LayoutError(f"blocks are not dense in shape {tuple(shape)}")
        expect *= size
    return LayerGeometry(
        num_blocks=shape[0],
        block_size=0,
        plane_offsets=(0,),
        block_stride=strides[0] * itemsize,
        token_bytes=0,
        block_bytes=expect,
    )


@dataclass
class KVLayout:
    """All registered layers: names in forward order, geometry and a flat byte view each.

    Host memory (`memory == "cpu"`) is reached through `buffers`, one memoryview
    per layer. Device memory has no memoryview: `buffers` is empty and
    `tensors` holds each layer as a flat uint8 torch tensor, for transports
    whose capabilities include that memory kind (CUDA IPC, NIXL VRAM).
    """

    names: list[str]
    geometries: list[LayerGeometry]
    buffers: list[memoryview]
    memory: str = "cpu"

    def __post_init__(self) -> None:
        self.index = {name: i for i, name in enumerate(self.names)}

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def describe(self) -> str:
        """Stable text for fingerprints: what makes bytes of two layouts incompatible."""
        kinds = sorted({g.describe() for g in self.geometries})
        return f"{self.memory};layers={self.num_layers};" + "|".join(kinds)

    block_size: int = 0
    tensors: list[Any] = field(default_factory=list)
    """Flat uint8 torch tensors, one per layer (device memory; optional for host)."""

    @property
    def nbytes_registered(self) -> int:
        if self.buffers:
            return sum(len(b) for b in self.buffers)
        return sum(int(t.numel()) for t in self.tensors)

    def chunk_nbytes(self, layer: int, num_tokens: int) -> int:
        return self.geometries[layer].chunk_nbytes(num_tokens)

    def chunk_spans(
        self, layer: int, block_ids: Sequence[int], token_counts: Sequence[int]
    ) -> list[list[memoryview]]:
        """`spans` of each chunk (block `block_ids[i]` holding `token_counts[i]` tokens)."""
        g = self.geometries[layer]
        if g.block_bytes and self.buffers:  # the hot case (vLLM's CPU cache): 6x faster
            if len(block_ids) != len(token_counts):
                raise LayoutError(f"{len(block_ids)} blocks for {len(token_counts)} chunks")
            buf, st, bb = self.buffers[layer], g.block_stride, g.block_bytes
            if any(not 0 <= b < g.num_blocks for b in block_ids):
                raise LayoutError(f"block ids {list(block_ids)} out of range")
            return [[buf[b * st : b * st + bb]] for b in block_ids]
        return [self.spans(layer, b, n) for b, n in zip(block_ids, token_counts, strict=True)]

    def nbytes(self, token_counts: Sequence[int]) -> int:
        """Bytes of chunks holding `token_counts` tokens, over all layers."""
        return sum(g.chunk_nbytes(n) for g in self.geometries for n in token_counts)

    def is_block_granular(self) -> bool:
        return any(g.block_bytes for g in self.geometries)

    def ranges(self, layer: int, block_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """(byte offset, length) of each run holding the first `num_tokens` tokens of
        `block_id` in `layer`, relative to the layer's buffer."""
        if not 0 < num_tokens <= self.block_size:  # the geometry checks the block id
            raise LayoutError(f"block {block_id} / {num_tokens} tokens out of range")
        return self.geometries[layer].ranges(block_id, num_tokens)

    def spans(self, layer: int, block_id: int, num_tokens: int) -> list[memoryview]:
        """The runs holding the first `num_tokens` tokens of `block_id` in `layer`."""
        if not self.buffers:
            raise LayoutError(f"{self.memory} memory has no host spans; use `tensors`")
        buf = self.buffers[layer]
        return [buf[off : off + n] for off, n in self.ranges(layer, block_id, num_tokens)]
