"""A consumer's bounce buffer: where a pull whose cells lie in many small runs (NHD
blocks of another head count: a run per token; NHD against HND: a run per cell) READs
the producer's whole blocks, run for run as the prepared lists hold them, then takes the
cells it needs with one gather and scatter per piece (`kvflow.geometry.cells`). One READ
descriptor per block and run instead of one per token or cell: UCX moves few large
descriptors far faster than many small ones (bench/bench_convert.py; on an H100, a
strided READ per cell ran at 0.09x of an unconverted pull, bench_convert_cuda.py).

One registered region per consumer transport, `BOUNCE_BYTES`, in the memory of the
consumer's cache, allocated on first use and used by one pull at a time; a pull moves
its layers through it in windows, each READ then scattered: by numpy in a thread for
host memory (a READ on one host copies inside NIXL's call, in the loop's thread, and
the two did not overlap when tried), by torch on the device for device memory (queued,
then waited for, shielded: it writes into our blocks and reads the region). A READ
still in flight when a pull ends (cancelled) and does not leave PROC within the drain
wait leaves the region broken: it is never used again (a later pull registers a new
one).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

from kvflow.geometry.cells import cell_index, cell_offsets, cells_of, put_cells
from kvflow.geometry.layout import LayerGeometry, LayoutError
from kvflow.transport import TransportError

__all__ = [
    "BOUNCE_BYTES",
    "MANY_RUNS",
    "Bounce",
    "Piece",
    "bounce_cells",
    "scatter_cells",
    "scatter_on_device",
    "scatter_stream",
    "windows",
]

log = logging.getLogger("kvflow.nixl")

BOUNCE_BYTES = 16 << 20
"""The bounce region's size: a pull's window of producer blocks."""
MANY_RUNS = 8
"""A chunk whose cells lie in more runs than this (per layer) goes through the bounce."""
MAX_BROKEN = 4
"""Broken regions kept (registered) before pulls stop using a bounce buffer."""

Piece = tuple[int, int, int]
"""(layer, first chunk, end chunk) of a pull: what one window READs of one layer."""


class Bounce:
    """The registered region (see the module text); `lock` gives it to one pull at a time."""

    def __init__(self, agent: Any, backend: str, device: Any = None) -> None:
        self.agent = agent
        self.backend = backend
        self.device = device
        """None: host memory, a numpy region; a torch device: a uint8 tensor there,
        gathered and scattered by torch (`scatter_on_device`)."""
        self.memory = "DRAM" if device is None or device.type == "cpu" else "VRAM"
        self.device_id = 0 if device is None or device.index is None else int(device.index)
        self.lock = trio.Lock()
        self.buf: Any = None
        self.address = 0
        self._reg: Any = None
        self._broken: list[tuple[Any, Any]] = []
        """Regions a READ may still write into: kept (registered, alive) until close."""

    @property
    def usable(self) -> bool:
        """False once `MAX_BROKEN` regions broke (pulls then READ cell runs directly)."""
        return len(self._broken) < MAX_BROKEN

    def region(self) -> Any:
        """The region (a numpy array, or a torch tensor on `device`), registered on first
        use."""
        if self.buf is None:
            if self.device is None:
                buf: Any = np.empty(BOUNCE_BYTES, np.uint8)
                address = int(buf.ctypes.data)
            else:
                import torch

                buf = torch.empty(BOUNCE_BYTES, dtype=torch.uint8, device=self.device)
                address = int(buf.data_ptr())
            try:
                self._reg = self.agent.register_memory(
                    [(address, BOUNCE_BYTES, self.device_id, "")], self.memory, [self.backend]
                )
            except Exception as exc:
                raise TransportError(f"NIXL cannot register a bounce buffer: {exc}") from None
            self.buf, self.address = buf, address
        return self.buf

    def broken(self) -> None:
        """A READ into the region may still be in flight: never use it again."""
        if self.buf is not None:
            self._broken.append((self.buf, self._reg))
            self.buf, self._reg, self.address = None, None, 0

    def close(self) -> None:
        regions = [*self._broken, (self.buf, self._reg)]
        for _, reg in regions:
            if reg is not None:
                try:
                    self.agent.deregister_memory(reg, [self.backend])
                except Exception as exc:
                    log.warning("kvflow nixl: deregistering a bounce buffer: %s", exc)
        self._broken.clear()
        self.buf, self._reg = None, None


def windows(
    geometries: Sequence[LayerGeometry], chunks: int, limit: int = BOUNCE_BYTES
) -> list[list[Piece]]:
    """A pull's layers x chunks as windows of pieces that each fit `limit` bytes of whole
    producer blocks (`geometries`: the producer's), layer by layer, in order."""
    out: list[list[Piece]] = [[]]
    used = 0
    for layer, g in enumerate(geometries):
        per = sum(n for _, n in g.block_runs())
        if per > limit:
            raise TransportError(f"a producer block of {per} bytes exceeds the bounce buffer")
        c = 0
        while c < chunks:
            take = min(chunks - c, (limit - used) // per)
            if take == 0:
                out.append([])
                used = 0
                continue
            out[-1].append((layer, c, c + take))
            used += take * per
            c += take
    return [w for w in out if w]


def bounce_cells(
    g: LayerGeometry, token_counts: Sequence[int], first: int, count: int, base: int
) -> np.ndarray:
    """Where heads `[first, first + count)` of each chunk's first tokens lie in the bounce,
    as cell indices, token-major (the order of `kvflow.geometry.cells.cell_index`), when its
    blocks' runs were READ from `base` on run by run (run r of chunk i at `base + sum of
    the runs before r times the chunks + i * its length`)."""
    runs = g.block_runs()
    starts = np.array([o for o, _ in runs], np.int64)
    lengths = np.array([n for _, n in runs], np.int64)
    k = len(token_counts)
    before = np.concatenate([[0], np.cumsum(lengths * k)[:-1]])
    cell = g.cell_bytes
    if not cell or (starts % cell).any() or (lengths % cell).any() or base % cell:
        raise LayoutError(f"blocks of {g.describe()} do not lie on a grid of cells")
    offsets, _ = cell_offsets(g, g.block_size)
    parts, at = [], 0
    for n, run in itertools.groupby(token_counts):
        m = len(list(run))
        o = offsets[:n, first : first + count].reshape(-1)
        r = np.searchsorted(starts, o, side="right") - 1
        where = base + before[r] + (o - starts[r])  # chunk 0 of this group
        chunk = np.arange(at, at + m, dtype=np.int64)[:, None] * lengths[r][None, :]
        parts.append(((where[None, :] + chunk) // cell).reshape(-1))
        at += m
    return np.concatenate(parts)


def scatter_cells(
    buf: memoryview,
    g: LayerGeometry,
    base: int,
    first: int,
    count: int,
    token_counts: Sequence[int],
    into: tuple[memoryview, LayerGeometry, Sequence[int], int],
) -> None:
    """Copy heads `[first, first + count)` of the chunks READ into `buf` from `base` on
    (blocks of the producer's `g`, run by run) into heads `into[3]..` of blocks `into[2]`
    of our layer `into[0]` (of geometry `into[1]`): a strided copy a chunk where both
    blocks are grids of cells (a dense block, one kernel block), else one gather and
    scatter of every cell (`kvflow.geometry.cells.cell_index`)."""
    ours, og, blocks, at = into
    runs = g.block_runs()
    cell = g.cell_bytes
    if g.kernel_blocks == 1 == og.kernel_blocks and len(runs) == 1 and runs[0][0] == 0:
        size = runs[0][1]
        for i, (b, n) in enumerate(zip(blocks, token_counts, strict=True)):
            shape = (n, count, cell)
            src = base + i * size + first * g.head_stride
            dst = b * og.block_stride + at * og.head_stride
            theirs = np.ndarray(shape, np.uint8, buf, src, (g.token_stride, g.head_stride, 1))
            mine = np.ndarray(shape, np.uint8, ours, dst, (og.token_stride, og.head_stride, 1))
            mine[...] = theirs
        return
    src_idx = bounce_cells(g, token_counts, first, count, base)
    dst_idx = cell_index(og, blocks, token_counts, at, count)
    cells_of(ours, og.cell_bytes)[dst_idx] = cells_of(buf, cell)[src_idx]


def scatter_stream(
    buf: memoryview,
    g: LayerGeometry,
    piece: tuple[int, int, int, Sequence[int]],
    ours: memoryview,
    cell: int,
    dst: np.ndarray,
    at: int,
) -> None:
    """A producer of another block size: copy the cells of one piece READ into `buf`
    (`piece`: its base, first head, heads and its chunks' tokens; blocks of `g`) into our
    layer `ours`, where they are cells `[at, ...)` of `dst` (every cell the load fills,
    token-major: `cell_index`); cells before 0 or past `dst` (tokens we skip or do not
    load) are left."""
    base, first, count, token_counts = piece
    src = bounce_cells(g, token_counts, first, count, base)
    put_cells(cells_of(ours, cell), dst, cells_of(buf, g.cell_bytes)[src], at)


def scatter_on_device(
    buf: Any,
    g: LayerGeometry,
    piece: tuple[int, int, int, Sequence[int]],
    ours: Any,
    dst: np.ndarray,
    at: int,
) -> None:
    """`scatter_cells` and `scatter_stream` for torch tensors (the bounce region `buf` and
    our flat uint8 layer `ours`, on one device): queue one gather of the piece's cells
    READ from `piece[0]` on (its first head, heads and chunks' tokens; blocks of `g`) and
    one scatter of them to cells `[at, ...)` of `dst` (`cell_index` order); cells before
    0 or past `dst` are left."""
    import torch

    base, first, count, token_counts = piece
    src = bounce_cells(g, token_counts, first, count, base)
    lo, hi = max(at, 0), min(at + len(src), len(dst))
    if lo >= hi:
        return
    s = torch.from_numpy(src[lo - at : hi - at]).to(buf.device)
    d = torch.from_numpy(dst[lo:hi]).to(ours.device)
    cell = g.cell_bytes
    theirs = buf.as_strided((buf.numel() // cell, cell), (cell, 1), buf.storage_offset())
    mine = ours.as_strided((ours.numel() // cell, cell), (cell, 1), ours.storage_offset())
    mine.index_copy_(0, d, theirs.index_select(0, s))
