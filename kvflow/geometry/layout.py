"""KV memory geometry as byte spans.

vLLM describes a layer's paged KV cache as a logical `[blocks, heads, tokens,
content]` view (`create_kv_cache_views`), laid out in memory in one of several
orders (its `KVCacheLayout`: tokens inside heads for HND, heads inside tokens
for NHD, with the layer and head dimensions inside or outside the blocks). One
*cell*, a token of a head (its K and V content), is always contiguous. A
manager block may be stored as several *kernel blocks* (vLLM's kernel block
splitting: a block of 64 tokens as two of 32).

`LayerGeometry` records exactly that description in bytes: the sizes and
strides of the block, head, kernel-block and token dimensions and the cell
size. From it follow the contiguous *runs* holding the first `n` tokens of a
block, so transports move `memoryview` spans and never learn backend shapes.
Dimensions are known by their position in vLLM's logical view, never guessed
from their sizes.

Some backends pack a block so that tokens are not separable (vLLM's CPU
attention stores K transposed inside each block). Their geometry is
*block-granular*: a chunk is always its whole block, one opaque run, and a
partial chunk carries the whole block too (the slots past its tokens are
never read: vLLM overwrites them as it computes those positions).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

__all__ = [
    "KVLayout",
    "LayerGeometry",
    "LayoutError",
    "block_geometry",
    "layout_mismatch",
    "peer_cells_problem",
    "peer_layout_problem",
    "view_extent",
    "view_geometry",
]


MAX_LAYER_BYTES = 1 << 48
"""No layer of a peer's geometry may span more (a bound on the strides it sends)."""
MAX_PEER_BLOCKS = 1 << 22
"""Nor have more blocks (a consumer may prepare a descriptor per block)."""
MAX_BLOCK_CELLS = 1 << 18
"""Nor more cells (tokens x heads) a block: listing a block's runs costs that many."""


class LayoutError(ValueError):
    """Registered KV memory that kvflow cannot describe as spans."""


class LayerGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """Where one layer's tokens live in its buffer, in bytes (see the module text)."""

    num_blocks: int
    block_size: int
    """Tokens in a (manager) block; 0 when block-granular."""
    block_stride: int
    heads: int = 1
    head_stride: int = 0
    token_stride: int = 0
    cell_bytes: int = 0
    """Contiguous bytes of one token of one head (0 when block-granular)."""
    kernel_blocks: int = 1
    """Kernel blocks a block is stored as (vLLM's kernel block splitting)."""
    kernel_stride: int = 0
    block_bytes: int = 0
    """Non-zero for block-granular layouts: a block is one opaque run of this size."""

    @property
    def kernel_tokens(self) -> int:
        return self.block_size // self.kernel_blocks

    def chunk_nbytes(self, num_tokens: int) -> int:
        """Bytes a chunk of `num_tokens` tokens occupies in this layer."""
        if self.block_bytes:
            return self.block_bytes
        return num_tokens * self.heads * self.cell_bytes

    def order(self) -> tuple[str, ...]:
        """The in-block dimensions from outermost to innermost in memory (those of size
        above one): what, with the sizes, fixes where each cell of a block lies."""
        dims = [
            ("kernel", self.kernel_blocks, self.kernel_stride),
            ("head", self.heads, self.head_stride),
            ("token", self.kernel_tokens, self.token_stride),
        ]
        return tuple(name for name, n, s in sorted(dims, key=lambda d: -d[2]) if n > 1)

    def describe(self) -> str:
        """Readable and stable (fingerprints, errors naming two layouts)."""
        if self.block_bytes:
            return f"block_bytes={self.block_bytes}"
        order = [d for d in self.order() if d != "kernel"]
        kinds: dict[tuple[str, ...], str] = {("head", "token"): "HND", ("token", "head"): "NHD"}
        kind = "one head" if self.heads == 1 else kinds.get(tuple(order), ">".join(order))
        kernel = f" in {self.kernel_blocks} kernel blocks" if self.kernel_blocks > 1 else ""
        return f"{kind} block={self.block_size}{kernel} heads={self.heads} cell={self.cell_bytes}B"

    def describe_cells(self, block: bool = True) -> str:
        """`describe()` of the token-major image of a block (any order of the same cells);
        without `block`, of any run of tokens (a store's chunks: `kvflow.shapes.reblock`)."""
        if self.block_bytes:
            return self.describe()
        size = f" block={self.block_size}" if block else ""
        return f"token-major{size} heads={self.heads} cell={self.cell_bytes}B"

    def runs(self, num_tokens: int) -> tuple[tuple[int, int], ...]:
        """(offset within a block, length) of the runs holding its first `num_tokens`
        tokens, in memory order, neighbours merged (a dense block is one run)."""
        return _runs(self, num_tokens)

    def ranges(self, block_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """(byte offset, length) of each run holding the first `num_tokens` tokens of
        `block_id`, relative to the layer's first byte."""
        if not 0 <= block_id < self.num_blocks:
            raise LayoutError(f"block {block_id} out of range (the layer has {self.num_blocks})")
        base = block_id * self.block_stride
        return [(base + off, n) for off, n in _runs(self, num_tokens)]

    def check_blocks(self, block_ids: Sequence[int], side: str) -> None:
        """Refuse out-of-range block ids on the host (on a device an out-of-range index
        is an assertion that takes the whole CUDA context down)."""
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise LayoutError(
                f"{side} block ids {list(block_ids)} outside 0..{self.num_blocks - 1}"
            )

    def block_shape(self) -> tuple[Any, ...]:
        """What must match for a block of one cache to be copied run by run into a block
        of another: everything but the number of blocks and where the runs start (a
        layout with heads outside the blocks has them a whole layer apart)."""
        runs = tuple(n for _, n in self.block_runs())
        return (
            self.block_size,
            self.heads,
            self.cell_bytes,
            self.kernel_blocks,
            self.block_bytes,
            self.order(),
            runs,
        )

    def extent(self) -> int:
        """Bytes from the layer's first byte to the end of its last block's last cell
        (above `MAX_LAYER_BYTES` if a stride is negative)."""
        strides = (self.block_stride, self.kernel_stride, self.head_stride, self.token_stride)
        if min(strides) < 0:
            return MAX_LAYER_BYTES + 1
        last = (self.num_blocks - 1) * self.block_stride
        if self.block_bytes:
            return last + self.block_bytes
        inner = (
            (self.kernel_blocks - 1) * self.kernel_stride
            + (self.heads - 1) * self.head_stride
            + (self.kernel_tokens - 1) * self.token_stride
        )
        return last + inner + self.cell_bytes

    def head_runs(self, first: int, count: int, num_tokens: int) -> tuple[tuple[int, int], ...]:
        """(offset within a block, length) of the runs holding heads `[first, first +
        count)` of its first `num_tokens` tokens, in memory order (what a rank of another
        tensor-parallel size reads or writes of this block). A block-granular block splits
        by head only when each head is one dense run of it (vLLM's CPU cache)."""
        if not 0 <= first < first + count <= self.heads:
            raise LayoutError(f"heads {first}..{first + count - 1} out of range ({self.heads})")
        if count == self.heads:
            return _runs(self, num_tokens)
        if self.block_bytes:
            per = self.head_run_bytes()
            return ((first * per, count * per),)
        return _runs(self, num_tokens, first, count)

    def head_run_bytes(self) -> int:
        """The bytes of one head of a block-granular block, each head one dense run of it
        (vLLM's CPU cache); a `LayoutError` when its heads are not."""
        per = self.head_stride if self.heads > 1 else self.block_bytes
        if not self.block_bytes or per * self.heads != self.block_bytes:
            raise LayoutError(f"blocks of {self.describe()} do not split by head")
        return per

    def head_shape(self, count: int) -> tuple[Any, ...]:
        """What must match for `count` heads of a block of one cache to be copied run by
        run into `count` heads of a block of another (`block_shape` of a head slice)."""
        runs = tuple(n for _, n in self.head_runs(0, count, self.block_size or 1))
        order = self.with_heads(count).order()  # runs of one size may hold cells otherwise
        return (
            self.block_size, self.cell_bytes, self.kernel_blocks, bool(self.block_bytes), runs,
            order,
        )  # fmt: skip

    def with_heads(self, count: int) -> LayerGeometry:
        """A block of this layout holding `count` heads, dense (one block): what a rank of
        another tensor-parallel size holds. A block-granular block splits by head only
        when each head is one dense run of it (vLLM's CPU cache)."""
        if count < 1:
            raise LayoutError(f"{count} heads")
        if self.block_bytes:
            per = self.head_run_bytes()
            return LayerGeometry(
                num_blocks=1,
                block_size=0,
                block_stride=per * count,
                block_bytes=per * count,
                heads=count,
                head_stride=per if count > 1 else 0,
            )
        sizes = {"kernel": self.kernel_blocks, "head": count, "token": self.kernel_tokens}
        stride, strides = self.cell_bytes, {}
        for dim in _inner_first(self):
            strides[dim] = stride
            stride *= sizes[dim]
        return LayerGeometry(
            num_blocks=1,
            block_size=self.block_size,
            block_stride=stride,
            heads=count,
            head_stride=strides["head"],
            token_stride=strides["token"] if self.kernel_tokens > 1 else 0,
            cell_bytes=self.cell_bytes,
            kernel_blocks=self.kernel_blocks,
            kernel_stride=strides["kernel"] if self.kernel_blocks > 1 else 0,
        )

    def token_major(self) -> LayerGeometry:
        """The token-major image of a block of this layout (`[tokens, heads, cell]`, as
        `kvflow.engine.staging` stages a device cache for a store)."""
        return LayerGeometry(
            num_blocks=1,
            block_size=self.block_size,
            block_stride=self.block_size * self.heads * self.cell_bytes,
            heads=self.heads,
            head_stride=self.cell_bytes,
            token_stride=self.heads * self.cell_bytes,
            cell_bytes=self.cell_bytes,
        )

    def block_runs(self) -> list[tuple[int, int]]:
        """(offset within a block, length) of the runs of one whole block: what moves a
        full block with the fewest descriptors."""
        return list(_runs(self, self.block_size))


def _inner_first(g: LayerGeometry) -> list[str]:
    """The in-block dimensions from innermost to outermost in memory, those of size one
    too (a view keeps their strides); on a tie heads are inside tokens (one head, NHD)."""
    kernel = g.kernel_stride if g.kernel_blocks > 1 else MAX_LAYER_BYTES
    rank = {"head": (g.head_stride, 1), "token": (g.token_stride, 2), "kernel": (kernel, 3)}
    return sorted(rank, key=rank.__getitem__)


@functools.lru_cache(maxsize=4096)
def _runs(
    g: LayerGeometry, num_tokens: int, first_head: int = 0, heads: int = 0
) -> tuple[tuple[int, int], ...]:
    """`LayerGeometry.runs`, of heads `[first_head, first_head + heads)` (all if 0)."""
    if g.block_bytes:
        return ((0, g.block_bytes),)
    if not 0 < num_tokens <= g.block_size:
        raise LayoutError(f"{num_tokens} tokens out of range (a block holds {g.block_size})")
    cell, per_kernel = g.cell_bytes, g.kernel_tokens
    pieces: list[tuple[int, int]] = []
    for k in range(-(-num_tokens // per_kernel)):
        m = min(per_kernel, num_tokens - k * per_kernel)
        base = k * g.kernel_stride + first_head * g.head_stride
        (outer, n_outer), (inner, n_inner) = sorted(
            [(g.head_stride, heads or g.heads), (g.token_stride, m)], reverse=True
        )
        if n_inner == 1 or inner == cell:  # the inner dimension's cells touch
            pieces += [(base + i * outer, n_inner * cell) for i in range(n_outer)]
        else:
            pieces += [
                (base + i * outer + j * inner, cell) for i in range(n_outer) for j in range(n_inner)
            ]
    merged: list[tuple[int, int]] = []
    for off, n in sorted(pieces):
        if merged and sum(merged[-1]) == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((off, n))
    return tuple(merged)


def layout_mismatch(
    producer: Sequence[LayerGeometry], consumer: Sequence[LayerGeometry], *, cells: bool = False
) -> str:
    """Why a consumer cannot copy a producer's blocks, naming both layouts; "" when it
    can. By default every layer's blocks must match byte for byte
    (`LayerGeometry.block_shape`); with `cells`, a copier that converts between orders
    (`kvflow.geometry.views.copy_tokens`) needs only the same cells in blocks of the same size."""
    if len(producer) != len(consumer):
        return f"the producer has {len(producer)} KV layers, the consumer {len(consumer)}"
    for i, (p, c) in enumerate(zip(producer, consumer, strict=True)):
        same = (
            p.describe_cells() == c.describe_cells()
            if cells
            else p.block_shape() == c.block_shape()
        )
        if not same:
            return _differ(i, p, c, cells)
    return ""


def _differ(layer: int, p: LayerGeometry, c: LayerGeometry, cells: bool) -> str:
    return (
        f"KV layouts differ (layer {layer}): producer {p.describe()}, consumer "
        f"{c.describe()}; give both instances the same --block-size"
        + ("" if cells else " and VLLM_KV_CACHE_LAYOUT")
    )


def peer_layout_problem(
    theirs: Sequence[LayerGeometry],
    ours: Sequence[LayerGeometry],
    *,
    cells: bool = False,
    producer: bool = True,
) -> str:
    """`layout_mismatch` for geometries a peer sent (`producer`: they are the
    producer's), checked first in O(layers) without trusting them: every number within
    bounds, and blocks of our size, heads and cell (and kernel blocks, unless `cells`)
    before anything costs more than our own layout does. "" when our blocks can be
    copied from (or into) theirs."""
    pair = (theirs, ours) if producer else (ours, theirs)
    if len(theirs) != len(ours):
        return f"the producer has {len(pair[0])} KV layers, the consumer {len(pair[1])}"
    for i, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        if not _in_bounds(t):
            return f"the peer's layer {i} has sizes or strides out of bounds"
        sizes = (t.block_size, t.heads, t.cell_bytes, t.block_bytes)
        if sizes != (o.block_size, o.heads, o.cell_bytes, o.block_bytes) or (
            not cells and t.kernel_blocks != o.kernel_blocks
        ):
            p, c = (t, o) if producer else (o, t)
            return _differ(i, p, c, cells)
    return layout_mismatch(*pair, cells=cells)


def peer_cells_problem(
    theirs: Sequence[LayerGeometry],
    ours: Sequence[LayerGeometry],
    *,
    producer: bool = True,
    any_block_size: bool = False,
    same_heads: bool = False,
) -> str:
    """Why cells cannot move between a peer's layers (`theirs`; `producer`: the
    producer's) and ours in any order or head count (`kvflow.geometry.cells`), checked in
    O(layers) without trusting them: "" when each is within bounds and holds cells of our
    size in blocks of our tokens (`any_block_size`: of any tokens; block-granular blocks:
    heads of our size, or blocks of our shape), and, with `same_heads`, as many heads."""
    if len(theirs) != len(ours):
        p, c = (theirs, ours) if producer else (ours, theirs)
        return f"the producer has {len(p)} KV layers, the consumer {len(c)}"
    for i, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        if not _in_bounds(t):
            return f"the peer's layer {i} has sizes or strides out of bounds"
        sane = max(t.block_size, 1) * t.heads <= MAX_BLOCK_CELLS  # listing its runs' cost
        other = any_block_size and t.block_size > 0 and not o.block_bytes
        tokens = t.block_size if other else o.block_size
        same = sane and (t.block_size, t.cell_bytes, bool(t.block_bytes)) == (
            tokens,
            o.cell_bytes,
            bool(o.block_bytes),
        )
        if same and t.block_bytes and (t.block_bytes, t.heads) != (o.block_bytes, o.heads):
            try:
                same = t.head_run_bytes() == o.head_run_bytes()
            except LayoutError:
                same = False
        if not same or (same_heads and t.heads != o.heads):
            return _differ(i, *((t, o) if producer else (o, t)), True)
    return ""


def _in_bounds(g: LayerGeometry) -> bool:
    """Whether a peer's `g` can be described and compared without dividing by zero or
    spanning more than `MAX_LAYER_BYTES` / `MAX_PEER_BLOCKS`."""
    return (
        0 < g.num_blocks <= MAX_PEER_BLOCKS
        and g.kernel_blocks >= 1
        and g.block_size >= 0
        and g.block_size % g.kernel_blocks == 0
        and min(g.heads, g.cell_bytes, g.block_bytes) >= 0
        and g.extent() <= MAX_LAYER_BYTES
    )


def _check_disjoint(dims: Sequence[tuple[int, int]], cell: int, what: str) -> None:
    """Refuse (size, byte stride) dimensions whose cells would overlap."""
    extent = cell
    for n, stride in sorted((d for d in dims if d[0] > 1), key=lambda d: d[1]):
        if stride < extent:
            raise LayoutError(f"{what}: dimensions overlap (stride {stride} < {extent} bytes)")
        extent = stride * (n - 1) + extent


def view_extent(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """Bytes from a strided view's first element to the end of its last (the layer's own
    bytes: layers may share one storage, interleaved)."""
    return (1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))) * itemsize


def view_geometry(
    shape: Sequence[int], strides: Sequence[int], itemsize: int, num_blocks: int
) -> LayerGeometry:
    """Describe a layer from vLLM's logical view `[blocks, heads, tokens, content]`
    (strides in elements), where `num_blocks` manager blocks may be split into
    `shape[0] // num_blocks` kernel blocks of `shape[2]` tokens each."""
    what = f"KV view {tuple(shape)} strides {tuple(strides)}"
    if len(shape) != 4 or len(strides) != 4:
        raise LayoutError(f"{what}: expected vLLM's [blocks, heads, tokens, content]")
    kernel_blocks, heads, tokens, content = shape
    if num_blocks < 1 or kernel_blocks % num_blocks:
        raise LayoutError(
            f"{what}: expected {num_blocks} blocks first (or a multiple: kernel blocks)"
        )
    if content > 1 and strides[3] != 1:
        raise LayoutError(f"{what}: a token's content is not contiguous")
    ratio = kernel_blocks // num_blocks
    kstride, hstride, tstride = (s * itemsize for s in strides[:3])
    cell = content * itemsize
    dims = [(num_blocks, kstride * ratio), (ratio, kstride), (heads, hstride), (tokens, tstride)]
    _check_disjoint(dims, cell, what)
    return LayerGeometry(
        num_blocks=num_blocks,
        block_size=ratio * tokens,
        block_stride=kstride * ratio,
        heads=heads,
        head_stride=hstride,  # also of one head: where a rank of more heads has them
        token_stride=tstride if tokens > 1 else 0,
        cell_bytes=cell,
        kernel_blocks=ratio,
        kernel_stride=kstride if ratio > 1 else 0,
    )


def block_geometry(
    shape: Sequence[int], strides: Sequence[int], itemsize: int, num_blocks: int | None = None
) -> LayerGeometry:
    """Describe a tensor whose blocks (dimension 0, `num_blocks` blocks, each stored as
    `shape[0] // num_blocks` kernel blocks) are each one dense run."""
    num_blocks = num_blocks or shape[0]
    if shape[0] % num_blocks:
        raise LayoutError(
            f"shape {tuple(shape)}: expected {num_blocks} blocks first (or a multiple: "
            "kernel blocks)"
        )
    expect = itemsize
    for size, stride in zip(reversed(shape[1:]), reversed(strides[1:]), strict=True):
        if size > 1 and stride * itemsize != expect:
            raise LayoutError(f"blocks are not dense in shape {tuple(shape)}")
        expect *= size
    ratio = shape[0] // num_blocks
    if ratio > 1 and strides[0] * itemsize != expect:
        raise LayoutError(f"kernel blocks of a block are not adjacent in shape {tuple(shape)}")
    heads = shape[1] if len(shape) == 4 and ratio == 1 else 1
    head_major = heads > 1 and strides[1] * itemsize * heads == expect
    return LayerGeometry(  # heads recorded when each is one run of the block (head-major)
        num_blocks=num_blocks,
        block_size=0,
        block_stride=strides[0] * itemsize * ratio,
        block_bytes=expect * ratio,
        heads=heads if head_major else 1,
        head_stride=strides[1] * itemsize if head_major else 0,
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
        self._described = ""
        self._layer_nbytes: dict[int, list[int]] = {}

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def describe(self) -> str:
        """Stable text for chunk headers: what makes the bytes a store holds incompatible.
        Host memory is stored as it lies; device memory is staged token-major
        (`kvflow.engine.staging`), so only its cells count, not the order vLLM keeps them in nor
        its block size (chunks of any block size line up: `kvflow.shapes.reblock`).
        Made once (a store's reader checks it for every chunk)."""
        if not self._described:
            if self.memory == "cpu":
                kinds = sorted({g.describe() for g in self.geometries})
            else:
                kinds = sorted({g.describe_cells(block=False) for g in self.geometries})
            self._described = f"{self.memory};layers={self.num_layers};" + "|".join(kinds)
        return self._described

    block_size: int = 0
    tensors: list[Any] = field(default_factory=list)
    """Flat uint8 torch tensors, one per layer (device memory; optional for host)."""

    def with_heads(self, count: int) -> KVLayout:
        """This layout as a rank holding `count` heads has it, without memory: what a chunk
        a store holds for an engine of another tensor-parallel size is (`kvflow.shapes.reshape`)."""
        return KVLayout(
            names=list(self.names),
            geometries=[g.with_heads(count) for g in self.geometries],
            buffers=[],
            memory=self.memory,
            block_size=self.block_size,
        )

    def image(self, layer: int) -> LayerGeometry:
        """The geometry of a chunk's bytes of `layer` as a store holds them: host memory
        and opaque blocks as they lie, device memory token-major (`kvflow.engine.staging`)."""
        g = self.geometries[layer]
        return g if self.memory == "cpu" or g.block_bytes else g.token_major()

    @property
    def nbytes_registered(self) -> int:
        if self.buffers:
            return sum(len(b) for b in self.buffers)
        return sum(int(t.numel()) for t in self.tensors)

    def chunk_nbytes(self, layer: int, num_tokens: int) -> int:
        return self.geometries[layer].chunk_nbytes(num_tokens)

    def layer_nbytes(self, num_tokens: int) -> list[int]:
        """`chunk_nbytes` of every layer, made once per token count (a store's reader
        checks it for every chunk; a few counts occur: full chunks and a prompt's
        tail). Not to be changed by the caller."""
        sizes = self._layer_nbytes.get(num_tokens)
        if sizes is None:
            sizes = [g.chunk_nbytes(num_tokens) for g in self.geometries]
            if len(self._layer_nbytes) < 1024:
                self._layer_nbytes[num_tokens] = sizes
        return sizes

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

    def head_spans(
        self,
        layer: int,
        block_ids: Sequence[int],
        token_counts: Sequence[int],
        first: int,
        count: int,
    ) -> list[list[memoryview]]:
        """`chunk_spans` of heads `[first, first + count)` only (a peer of another
        tensor-parallel size holds those: `LayerGeometry.head_runs`)."""
        g = self.geometries[layer]
        if not self.buffers:
            raise LayoutError(f"{self.memory} memory has no host spans; use `tensors`")
        buf = self.buffers[layer]
        g.check_blocks(block_ids, "the")
        out = []
        for b, n in zip(block_ids, token_counts, strict=True):
            base = b * g.block_stride
            out.append([buf[base + o : base + o + k] for o, k in g.head_runs(first, count, n)])
        return out

    def spans(self, layer: int, block_id: int, num_tokens: int) -> list[memoryview]:
        """The runs holding the first `num_tokens` tokens of `block_id` in `layer`."""
        if not self.buffers:
            raise LayoutError(f"{self.memory} memory has no host spans; use `tensors`")
        buf = self.buffers[layer]
        return [buf[off : off + n] for off, n in self.ranges(layer, block_id, num_tokens)]
