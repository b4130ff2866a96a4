"""Which bytes of one block go where in a block of another layout or head count.

A KV *cell*, one token of one head (`kvflow.geometry.layout`), is contiguous in every layout
vLLM has; caches of other layouts (NHD, HND, split kernel blocks) or of other
tensor-parallel sizes (other heads per rank) hold the same cells at other offsets.
`head_copy_runs` pairs them: the (source, destination, length) byte runs that copy some
heads of a chunk of one geometry into heads of a chunk of another, neighbouring cells
merged wherever both sides are contiguous: a single run when the two match, one per
head and block when both keep a head's tokens together (HND, vLLM's CPU blocks), one
per cell when their orders differ. Offsets are within a chunk's *image* (its runs in
memory order, as a store holds it) or, with `in_blocks`, within the block itself (as a
transport that moves bytes by address, a NIXL READ, needs them).

A block-granular block (vLLM's CPU cache) is not split into cells: its unit is a
head's dense run of the block (`LayerGeometry.head_run_bytes`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence

import numpy as np

from .layout import LayerGeometry, LayoutError
from .topology import HeadRead

__all__ = [
    "cell_index",
    "cell_offsets",
    "cells_of",
    "copy_heads",
    "head_copy_runs",
    "is_token_major",
    "positions",
    "put_cells",
    "slices",
]


@functools.lru_cache(maxsize=256)
def cell_offsets(g: LayerGeometry, num_tokens: int) -> tuple[np.ndarray, int]:
    """Where each unit of a block's first `num_tokens` tokens lies within the block
    (bytes, `[tokens, heads]`), and the unit's size: a cell, or a head's run of a
    block-granular block (`[1, heads]`)."""
    if g.block_bytes:
        per = g.head_run_bytes()
        return np.arange(g.heads, dtype=np.int64)[None, :] * per, per
    if not 0 < num_tokens <= g.block_size:
        raise LayoutError(f"{num_tokens} tokens out of range (a block holds {g.block_size})")
    t = np.arange(num_tokens, dtype=np.int64)
    h = np.arange(g.heads, dtype=np.int64)
    kt = g.kernel_tokens
    offsets = (t // kt * g.kernel_stride + t % kt * g.token_stride)[:, None]
    return offsets + h[None, :] * g.head_stride, g.cell_bytes


@functools.lru_cache(maxsize=256)
def positions(g: LayerGeometry, num_tokens: int) -> tuple[np.ndarray, int]:
    """Where each unit (see `cell_offsets`) of an `num_tokens`-token chunk's image lies: the
    image is the chunk's runs in memory order (`LayerGeometry.runs`)."""
    offsets, unit = cell_offsets(g, num_tokens)
    order = np.argsort(offsets, axis=None, kind="stable")
    pos = np.empty(offsets.size, dtype=np.int64)
    pos[order] = np.arange(offsets.size, dtype=np.int64) * unit
    return pos.reshape(offsets.shape), unit


def cell_index(
    g: LayerGeometry,
    block_ids: Sequence[int],
    token_counts: Sequence[int],
    first: int,
    count: int,
) -> np.ndarray:
    """Where heads `[first, first + count)` of each chunk's first tokens lie in a layer's
    buffer, as indices into its cells (`cells_of`), token-major: chunk by chunk, token
    by token, head by head. Gathering them writes, and scattering them reads, a cache of
    any layout in one order (`[tokens, heads, cell]` per chunk)."""
    if g.block_bytes or not g.cell_bytes:
        raise LayoutError(f"blocks of {g.describe()} do not split into cells")
    if not 0 <= first < first + count <= g.heads:
        raise LayoutError(f"heads {first}..{first + count - 1} out of range ({g.heads})")
    g.check_blocks(block_ids, "the")
    offsets, cell = cell_offsets(g, g.block_size)
    if (offsets % cell).any() or g.block_stride % cell:
        raise LayoutError(f"cells of {g.describe()} do not lie on a grid of cells")
    cells = offsets[:, first : first + count] // cell
    parts = []
    at = 0
    for n, run in itertools.groupby(token_counts):
        k = len(list(run))
        if not 0 < n <= g.block_size:
            raise LayoutError(f"{n} tokens out of range (a block holds {g.block_size})")
        base = np.asarray(block_ids[at : at + k], np.int64) * (g.block_stride // cell)
        parts.append((base[:, None, None] + cells[None, :n, :]).reshape(-1))
        at += k
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def is_token_major(g: LayerGeometry, first: int, count: int) -> bool:
    """Whether heads `[first, first + count)` of a block of `g` lie token-major in one run
    (NHD with every head: the cells `cell_index` lists are the block's own bytes, in
    order, and need no gather or scatter)."""
    return (
        not g.block_bytes
        and g.kernel_blocks == 1
        and (count == 1 or g.head_stride == g.cell_bytes)
        and (g.block_size == 1 or g.token_stride == count * g.cell_bytes)
    )


def put_cells(ours: np.ndarray, dst: np.ndarray, cells: np.ndarray, at: int) -> None:
    """Write `cells`, stream cells `[at, at + len)` of a token-major stream, where they go
    among `dst` (the cells of `ours` the stream fills, `cell_index` order); those before
    0 or past `dst` (tokens skipped, or not loaded) are dropped."""
    lo, hi = max(at, 0), min(at + len(cells), len(dst))
    if lo < hi:
        ours[dst[lo:hi]] = cells[lo - at : hi - at]


def cells_of(buffer: memoryview, cell_bytes: int) -> np.ndarray:
    """A layer's buffer as `[cells, cell_bytes]` (what `cell_index` indexes)."""
    flat = np.frombuffer(buffer, np.uint8)
    return np.lib.stride_tricks.as_strided(
        flat, (len(flat) // cell_bytes, cell_bytes), (cell_bytes, 1), writeable=not buffer.readonly
    )


@functools.lru_cache(maxsize=1024)
def head_copy_runs(
    src: LayerGeometry,
    src_first: int,
    dst: LayerGeometry,
    dst_first: int,
    count: int,
    n: int,
    in_blocks: bool = False,
    src_at: int = 0,
    dst_at: int = 0,
) -> tuple[tuple[int, int, int], ...]:
    """(source offset, destination offset, length) of the byte runs that copy heads
    `[src_first, src_first + count)` of an `n`-token chunk of `src` into heads
    `[dst_first, dst_first + count)` of one of `dst`, in the destination's order:
    offsets within the chunks' images, or within their blocks (`in_blocks`; then the
    `n` tokens from token `src_at` of the source block to token `dst_at` on of the
    destination's: blocks of other sizes). A `LayoutError` when the chunks hold other
    cells (sizes, tokens) or too few heads."""
    if (src_at or dst_at) and not in_blocks:
        raise LayoutError("token offsets are within blocks only")
    where = cell_offsets if in_blocks else positions
    if bool(src.block_bytes) != bool(dst.block_bytes) or src.cell_bytes != dst.cell_bytes:
        raise LayoutError(f"cannot copy heads of {src.describe()} into {dst.describe()}")
    if not (src_first >= 0 and dst_first >= 0 and count > 0) or (
        src_first + count > src.heads or dst_first + count > dst.heads
    ):
        raise LayoutError(f"heads out of range copying {src.describe()} into {dst.describe()}")
    sp, su = where(src, src_at + n)
    dp, du = where(dst, dst_at + n)
    sp, dp = sp[src_at:], dp[dst_at:]  # block-granular: one row, and no offsets
    if su != du:
        raise LayoutError(f"cannot copy heads of {src.describe()} into {dst.describe()}")
    s = sp[:, src_first : src_first + count].ravel()
    d = dp[:, dst_first : dst_first + count].ravel()
    order = np.argsort(d, kind="stable")
    s, d = s[order], d[order]
    breaks = np.flatnonzero((np.diff(s) != su) | (np.diff(d) != su)) + 1
    edges = [0, *breaks.tolist(), len(s)]
    return tuple((int(s[a]), int(d[a]), (b - a) * su) for a, b in itertools.pairwise(edges))


@functools.lru_cache(maxsize=256)
def _grid(g: LayerGeometry, n: int) -> tuple[int, int, int] | None:
    """(token stride, head stride, unit) when the image of an `n`-token chunk of `g` is a
    strided `[tokens, heads, unit]` array; None when it is not (split kernel blocks)."""
    pos, unit = positions(g, n)
    t, h = pos.shape
    a = int(pos[1, 0] - pos[0, 0]) if t > 1 else 0
    b = int(pos[0, 1] - pos[0, 0]) if h > 1 else 0
    affine = pos[0, 0] + np.arange(t)[:, None] * a + np.arange(h)[None, :] * b
    return (a, b, unit) if pos[0, 0] == 0 and (pos == affine).all() else None


def copy_heads(
    src: memoryview,
    src_geo: LayerGeometry,
    spans: list[memoryview],
    dst_geo: LayerGeometry,
    read: HeadRead,
    n: int,
) -> None:
    """Copy `read`'s heads of one stored chunk image (`src`) into this rank's chunk."""
    sg, dg = _grid(src_geo, n), _grid(dst_geo, n)
    if sg and dg and len(spans) == 1:  # one strided copy
        tokens = positions(src_geo, n)[0].shape[0]
        a = np.ndarray((tokens, src_geo.heads, sg[2]), np.uint8, src, 0, (sg[0], sg[1], 1))
        b = np.ndarray((tokens, dst_geo.heads, dg[2]), np.uint8, spans[0], 0, (dg[0], dg[1], 1))
        b[:, read.into : read.into + read.count] = a[:, read.first : read.first + read.count]
        return
    starts = list(itertools.accumulate((len(s) for s in spans), initial=0))
    for s, d, length in head_copy_runs(src_geo, read.first, dst_geo, read.into, read.count, n):
        for i, off, take in slices(starts, d, length):
            spans[i][off : off + take] = src[s : s + take]
            s += take


def slices(starts: list[int], at: int, length: int) -> list[tuple[int, int, int]]:
    """Bytes `[at, at + length)` of spans that start at `starts` (their sizes' running
    sum), as (span index, offset in it, length)."""
    out = []
    i = bisect.bisect_right(starts, at) - 1
    while length > 0:
        off = at - starts[i]
        take = min(length, starts[i + 1] - at)
        out.append((i, off, take))
        at, length, i = at + take, length - take, i + 1
    return out


def __getattr__(name: str) -> object:
    """`token_major`, 0.4's `is_token_major`, until 0.5 (it warns)."""
    if name == "token_major":
        import warnings

        warnings.warn(
            "kvflow.geometry.cells.token_major is kvflow.geometry.cells.is_token_major now; the "
            "old name goes in kvflow 0.5",
            DeprecationWarning,
            stacklevel=2,
        )
        return is_token_major
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
