"""Block copies on a CUDA device, one Triton launch for a layer or for every layer of a
pull: the fast path of `kvflow.geometry.views` for copies that stay on one GPU (CUDA IPC
pulls, host staging).

Torch's indexing copies a layer's blocks in two passes through an intermediate image
(`index_select`, then `index_copy_`) and moves a flat uint8 layer one byte per element:
on an H200 a CUDA IPC pull of 1 GiB that way ran at 0.05-0.07 of one `copy_`. Here a
launch moves every chunk of its layers straight from source to destination in the
widest words the addresses allow (8 bytes where every offset and size is a multiple of
8), each layer found by its offset from the first (a table on the device):

- `copy_runs`: whole blocks of the same shape, run by run (`LayerGeometry.block_runs`);
- `copy_cells`: cells (a token of a head) by a token map (`chunk_tokens`,
  `stream_tokens`): another layout, kernel block size or block size, heads of another
  tensor-parallel size, and the tokens of partial chunks. Nothing but the mapped cells
  is written.

Everything a kernel indexes with is built and bounded on the host first (block ids
against each side's blocks, tokens against its block size, heads against its heads),
so no launch can read or write past a layer. The kernels are plain Python under
`triton.jit`; `build(interpret=True)` runs the same source in Triton's interpreter on
CPU tensors, which is how the CPU test suite checks every byte they move.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from .layout import LayerGeometry, LayoutError

__all__ = ["Kernels", "build", "chunk_tokens", "device_kernels", "stream_tokens"]

RUN_WORDS = 1024
"""Words a program of `copy_runs` moves (8 KiB of int64)."""
CELL_WORDS = 4096
"""Words a program of `copy_cells` moves (rows of whole cells)."""
MAX_GRID = 65535
"""CUDA's bound on a launch's second and third grid dimensions."""


class Kernels:
    """The two copies, compiled for the device (`build()`) or interpreted on the CPU."""

    def __init__(self, runs: Any, cells: Any) -> None:
        self._runs, self._cells = runs, cells

    def copy_runs(
        self,
        srcs: Sequence[Any],
        g_src: LayerGeometry,
        dsts: Sequence[Any],
        g_dst: LayerGeometry,
        si: Any,
        di: Any,
    ) -> None:
        """Queue the copy of whole block `si[i]` of each layer of `srcs` into block `di[i]`
        of the same layer of `dsts` (flat uint8 layers, every one of the same block shape;
        `si`, `di`: int64 tensors on the device, checked against each side's blocks by the
        caller), one launch for all layers."""
        runs_s, runs_d = g_src.block_runs(), g_dst.block_runs()
        if [n for _, n in runs_s] != [n for _, n in runs_d]:
            raise LayoutError(f"{g_src.describe()} and {g_dst.describe()}: other runs")
        if not len(si) or not srcs:
            return
        sizes = [o for o, _ in runs_s] + [o for o, _ in runs_d] + [n for _, n in runs_s]
        strides = (g_src.block_stride, g_dst.block_stride)
        w = _word(srcs, dsts, *strides, *sizes)
        table = _run_table(g_src, g_dst, w, srcs[0].device)
        s_words, d_words = _layer_words(srcs, w), _layer_words(dsts, w)
        align = math.gcd(16 // w, *(x // w for x in (*sizes, *strides)), *s_words, *d_words)
        s_layer = _layer_table(s_words, srcs[0].device)
        d_layer = _layer_table(d_words, dsts[0].device)
        tiles = math.ceil(max(n for _, n in runs_s) // w / RUN_WORDS)
        grid = (len(si), len(runs_s) * tiles, len(srcs))
        if max(grid[1:]) > MAX_GRID:
            raise LayoutError(f"{g_src.describe()}: {grid[1]} pieces a block, {grid[2]} layers")
        self._runs[grid](
            _words(srcs[0], w), _words(dsts[0], w), si, di, s_layer, d_layer,
            table[0], table[1], table[2], g_src.block_stride // w, g_dst.block_stride // w,
            tiles, BLOCK=RUN_WORDS, ALIGN=align,
        )  # fmt: skip

    def copy_cells(
        self,
        srcs: Sequence[Any],
        g_src: LayerGeometry,
        dsts: Sequence[Any],
        g_dst: LayerGeometry,
        tokens: Any,
        heads: tuple[int, int, int] | None = None,
    ) -> None:
        """Queue the copy of the cells `tokens` maps (`chunk_tokens`, `stream_tokens`: a
        `[4, n]` int64 tensor of source block, source token, destination block,
        destination token) of heads (first, into, count) of each layer of `srcs` into the
        same layer of `dsts` (all heads if None), one launch for all layers."""
        first, into, count = (0, 0, g_src.heads) if heads is None else heads
        for g, at, side in ((g_src, first, "source"), (g_dst, into, "destination")):
            if g.block_bytes or not 0 <= at < at + count <= g.heads:
                raise LayoutError(f"{side} {g.describe()}: no cells of heads {at}..+{count}")
        if g_src.cell_bytes != g_dst.cell_bytes:
            raise LayoutError(f"cells of {g_src.cell_bytes} and {g_dst.cell_bytes} bytes")
        n = tokens.shape[1]
        if not n or not srcs:
            return
        strides = (g_src.block_stride, g_src.kernel_stride, g_src.head_stride, g_src.token_stride)
        strides_d = (g_dst.block_stride, g_dst.kernel_stride, g_dst.head_stride, g_dst.token_stride)
        w = _word(srcs, dsts, g_src.cell_bytes, *strides, *strides_d)
        cell = g_src.cell_bytes // w
        words = [x // w for x in (*strides, *strides_d)]
        s_words, d_words = _layer_words(srcs, w), _layer_words(dsts, w)
        align = math.gcd(16 // w, *words, *s_words, *d_words)
        width = 1 << max(0, (cell - 1).bit_length())
        rows = max(1, CELL_WORDS // width)
        grid = (math.ceil(n * count / rows), len(srcs))
        if grid[1] > MAX_GRID:
            raise LayoutError(f"{len(srcs)} layers in one launch")
        self._cells[grid](
            _words(srcs[0], w), _words(dsts[0], w),
            _layer_table(s_words, srcs[0].device), _layer_table(d_words, dsts[0].device),
            tokens, n * count, n, *words[:4], first, *words[4:], into,
            HEADS=count, S_KT=g_src.kernel_tokens, D_KT=g_dst.kernel_tokens, CELL=cell,
            WIDTH=width, ROWS=rows, ALIGN=align,
        )  # fmt: skip


@functools.cache
def build(interpret: bool = False) -> Kernels:
    """The kernels: `triton.jit`, or Triton's interpreter (CPU tensors; tests)."""
    import triton

    from . import _triton

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return Kernels(InterpretedFunction(_triton.runs), InterpretedFunction(_triton.cells))
    return Kernels(triton.jit(_triton.runs), triton.jit(_triton.cells))


def device_kernels(src: Any, dst: Any) -> Kernels | None:
    """The compiled kernels when both tensors (a layer of each side) are on one CUDA
    device and Triton is here (every GPU install of vLLM has it); None: copy with
    torch's indexing."""
    if src.device.type != "cuda" or src.device != dst.device or not _have_triton():
        return None
    return build()


@functools.cache
def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def chunk_tokens(
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    counts: Sequence[int],
    block_size: int,
    device: Any,
) -> Any:
    """The token map (`Kernels.copy_cells`) of tokens `0..counts[i]` of `src_blocks[i]`
    into the same tokens of `dst_blocks[i]`, on `device`."""
    torch = _torch()
    chunk, tok = _positions(counts, block_size)
    src = torch.tensor(list(src_blocks), dtype=torch.int64)[chunk]
    dst = torch.tensor(list(dst_blocks), dtype=torch.int64)[chunk]
    return torch.stack([src, tok, dst, tok]).to(device)


def stream_tokens(
    src_blocks: Sequence[int],
    src_block_size: int,
    skip: int,
    dst_blocks: Sequence[int],
    counts: Sequence[int],
    dst_block_size: int,
    device: Any,
) -> Any:
    """The token map of a token stream between blocks of other sizes: the tokens of
    `src_blocks` end to end from token `skip` on, `counts[i]` of them into block
    `dst_blocks[i]` from its first token."""
    torch = _torch()
    chunk, tok = _positions(counts, dst_block_size)
    if skip < 0:
        raise LayoutError(f"a token stream from token {skip}")
    total = len(tok)
    if skip + total > len(src_blocks) * src_block_size:
        raise LayoutError(
            f"{total} tokens from token {skip} of {len(src_blocks)} blocks of {src_block_size}"
        )
    q = skip + torch.arange(total)
    src = torch.tensor(list(src_blocks), dtype=torch.int64)[q // src_block_size]
    dst = torch.tensor(list(dst_blocks), dtype=torch.int64)[chunk]
    return torch.stack([src, q % src_block_size, dst, tok]).to(device)


def _positions(counts: Sequence[int], block_size: int) -> tuple[Any, Any]:
    """For each of the `sum(counts)` tokens of chunks holding `counts[i]` tokens each
    (at most `block_size`), its chunk and its place in the chunk (host tensors)."""
    torch = _torch()
    if any(not 0 <= n <= block_size for n in counts):
        raise LayoutError(f"token counts {list(counts)[:8]} outside 0..{block_size}")
    c = torch.tensor(list(counts), dtype=torch.int64)
    total = int(c.sum())
    chunk = torch.repeat_interleave(torch.arange(len(c)), c, output_size=total)
    return chunk, torch.arange(total) - (torch.cumsum(c, 0) - c)[chunk]


@functools.lru_cache(maxsize=256)
def _run_table(g_src: LayerGeometry, g_dst: LayerGeometry, w: int, device: Any) -> Any:
    """`[3, runs]` on `device`: each run's offset in a source block and in a destination
    block and its length, in words (one copy to the device per pair of geometries)."""
    runs_s, runs_d = g_src.block_runs(), g_dst.block_runs()
    rows = [[o // w for o, _ in runs_s], [o // w for o, _ in runs_d], [n // w for _, n in runs_s]]
    return _torch().tensor(rows, dtype=_torch().int64).to(device)


def _word(srcs: Sequence[Any], dsts: Sequence[Any], *sizes: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) dividing every layer's address and size and
    every byte offset and size given."""
    g = 8
    for t in (*srcs, *dsts):
        g = math.gcd(g, t.data_ptr(), t.numel())
    return math.gcd(g, *sizes)


def _layer_words(layers: Sequence[Any], w: int) -> tuple[int, ...]:
    """Each layer's first word, counted from the first layer's."""
    base = layers[0].data_ptr()
    return tuple((t.data_ptr() - base) // w for t in layers)


@functools.lru_cache(maxsize=1024)
def _layer_table(words: tuple[int, ...], device: Any) -> Any:
    """`_layer_words` as an int64 tensor on `device` (one copy to the device per set of
    layers: a pull's are the same every time)."""
    return _torch().tensor(words, dtype=_torch().int64).to(device)


def _words(flat: Any, w: int) -> Any:
    torch = _torch()
    return flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[w])


def _torch() -> Any:
    import torch

    return torch
