"""Chunks a store holds for another tensor-parallel size: which shards to look up, which
to read, and how a rank takes its heads from them.

A store keeps each rank's slice of a chunk under that rank's shard (`shard_name`):
the KV heads the rank holds (`kvflow.pd.topology.held_heads`), its bytes as they lie
(a device cache token-major). The namespace does not depend on the tensor-parallel size,
so an engine of another size computes the same chunk keys. Its scheduler looks up its
own shards first, then, from the first chunk they miss, the shards of each other size
in `STORE_TP_SIZES` that splits the model's heads (`other_shapes`), and says per chunk
which size holds it (`lookup_sources`, `LoadSpec.tp_sizes`). A worker reads the shards
holding its heads (`plan_reads`, as a P/D consumer does) into images shaped as the
saving rank's (`KVLayout.with_heads`), checked as any load checks them (the job names
the shard and the layout), and copies its heads into its blocks (`head_copy_runs`).

Nothing is converted when the sizes match: those chunks load as they always did.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import trio

from .layout import KVLayout, LayerGeometry, LayoutError
from .pd.topology import HeadRead, TopologyError, held_heads, plan_reads, readers
from .transport import LoadJob, Transport, TransportError

__all__ = [
    "STORE_TP_SIZES",
    "StoreShape",
    "head_copy_runs",
    "load_reshaped",
    "lookup_sources",
    "other_shapes",
    "shard_name",
]

STORE_TP_SIZES = (1, 2, 4, 8, 16)
"""The tensor-parallel sizes whose chunks an engine of another size looks for."""

BOUNCE_BYTES = 64 << 20
"""At most this many bytes of other shards' images are held at once per load."""


def shard_name(tp_rank: int, tp_size: int, pp_rank: int) -> str:
    """A worker's shard, as stores name its part of a chunk (`tp0of2pp0`)."""
    return f"tp{tp_rank}of{tp_size}pp{pp_rank}"


@dataclass(frozen=True)
class StoreShape:
    """Another tensor-parallel size whose chunks this engine can load: the shards of it
    that hold heads this engine's ranks read."""

    tp_size: int
    shards: list[str]


def other_shapes(kv_heads: int, tp_size: int, pp_size: int) -> list[StoreShape]:
    """The sizes in `STORE_TP_SIZES` other than `tp_size` whose split of `kv_heads` heads
    this engine's ranks can read ([] when the heads are not known)."""
    shapes = []
    for size in STORE_TP_SIZES:
        if size == tp_size or kv_heads < 1:
            continue
        try:
            count = readers(kv_heads, size, tp_size)
        except TopologyError:
            continue
        shards = [shard_name(r, size, p) for p in range(pp_size) for r in range(size) if count[r]]
        shapes.append(StoreShape(size, shards))
    return shapes


async def lookup_sources(
    transport: Transport, keys: Sequence[str], shapes: Sequence[StoreShape]
) -> list[int]:
    """For each leading chunk held, the tensor-parallel size holding it (0: this engine's
    own shards, looked up first); a chunk of another size only where the own shards miss."""
    sources: list[int] = []
    while len(sources) < len(keys):
        rest = keys[len(sources) :]
        found = await transport.lookup(rest)
        sources += [0] * found
        if found:
            continue
        for shape in shapes:
            if found := await transport.lookup(rest, shape.shards):  # type: ignore[call-arg]
                sources += [shape.tp_size] * found
                break
        if not found:
            break
    return sources


# -- copying heads between images --------------------------------------------------


@functools.lru_cache(maxsize=256)
def _positions(g: LayerGeometry, num_tokens: int) -> tuple[np.ndarray, int]:
    """Where each unit of a chunk's image lies (bytes, `[tokens, heads]`), and the unit's
    size: a cell (a token of a head), or a head's run of a block-granular block (`[1,
    heads]`). The image is the chunk's runs in memory order (`LayerGeometry.runs`)."""
    if g.block_bytes:
        per = g.head_stride if g.heads > 1 else g.block_bytes
        if per * g.heads != g.block_bytes:
            raise LayoutError(f"blocks of {g.describe()} do not split by head")
        return np.arange(g.heads, dtype=np.int64)[None, :] * per, per
    t = np.arange(num_tokens, dtype=np.int64)
    h = np.arange(g.heads, dtype=np.int64)
    kt = g.kernel_tokens
    offsets = (t // kt * g.kernel_stride + t % kt * g.token_stride)[:, None]
    offsets = offsets + h[None, :] * g.head_stride
    order = np.argsort(offsets, axis=None, kind="stable")
    pos = np.empty(offsets.size, dtype=np.int64)
    pos[order] = np.arange(offsets.size, dtype=np.int64) * g.cell_bytes
    return pos.reshape(offsets.shape), g.cell_bytes


@functools.lru_cache(maxsize=1024)
def head_copy_runs(
    src: LayerGeometry, src_first: int, dst: LayerGeometry, dst_first: int, count: int, n: int
) -> tuple[tuple[int, int, int], ...]:
    """(source offset, destination offset, length) of the byte runs that copy heads
    `[src_first, src_first + count)` of an `n`-token chunk image of `src` into heads
    `[dst_first, dst_first + count)` of one of `dst`: neighbouring units merged."""
    sp, su = _positions(src, n)
    dp, du = _positions(dst, n)
    if su != du or sp.shape[0] != dp.shape[0]:
        raise LayoutError(f"cannot copy heads of {src.describe()} into {dst.describe()}")
    if src_first + count > src.heads or dst_first + count > dst.heads:
        raise LayoutError(f"heads out of range copying {src.describe()} into {dst.describe()}")
    s = sp[:, src_first : src_first + count].ravel()
    d = dp[:, dst_first : dst_first + count].ravel()
    order = np.argsort(d, kind="stable")
    s, d = s[order], d[order]
    breaks = np.flatnonzero((np.diff(s) != su) | (np.diff(d) != su)) + 1
    edges = [0, *breaks.tolist(), len(s)]
    return tuple((int(s[a]), int(d[a]), (b - a) * su) for a, b in itertools.pairwise(edges))


# -- loading -------------------------------------------------------------------------


def _part(job: LoadJob, start: int, end: int, **changes: object) -> LoadJob:
    """Chunks `[start, end)` of `job`, whose layers the caller signals."""
    fields: dict[str, object] = {
        "req": job.req,
        "keys": job.keys[start:end],
        "token_counts": job.token_counts[start:end],
        "num_layers": job.num_layers,
        "spans": lambda layer: job.spans(layer)[start:end],
        "layer_loaded": lambda layer: None,
        "block_ids": job.block_ids[start:end],
        "layerwise": job.layerwise,
    }
    fields.update(changes)
    return LoadJob(**fields)  # type: ignore[arg-type]


async def load_reshaped(transport: Transport, job: LoadJob, tp_sizes: Sequence[int]) -> None:
    """`transport.load(job)` where chunk i is held for tensor-parallel size `tp_sizes[i]`
    (0: this engine's own): each run of chunks of one size loads in turn; the layers are
    signalled once every run has landed. A failure names the first chunk not intact."""
    start = 0
    for size, run in itertools.groupby(tp_sizes):
        end = start + len(list(run))
        try:
            if size == 0:
                await transport.load(_part(job, start, end))
            else:
                await _load_other(transport, _part(job, start, end), size)
        except TransportError as exc:
            exc.chunk += start
            raise
        start = end
    for layer in range(job.num_layers):
        job.layer_loaded(layer)


async def _load_other(transport: Transport, job: LoadJob, tp_size: int) -> None:
    """Load `job`, every chunk of it held by ranks of `tp_size`, a window of chunks at a
    time (at most `BOUNCE_BYTES` of their images)."""
    ctx, layout = transport.context, transport.context.layout
    assert layout is not None, "a store loads into registered KV caches"
    try:
        reads = plan_reads(ctx.kv_heads, tp_size, ctx.tp_size, ctx.tp_rank)
        held = [len(held_heads(ctx.kv_heads, tp_size, r.rank)) for r in reads]
        shapes = [layout.with_heads(c) for c in held]
    except (TopologyError, LayoutError) as exc:
        raise TransportError(f"chunks saved at tensor parallel size {tp_size}: {exc}") from None
    per_chunk = sum(s.nbytes([max(job.token_counts)]) for s in shapes)
    window = max(1, BOUNCE_BYTES // max(1, per_chunk))
    for w in range(0, len(job.keys), window):
        part = _part(job, w, min(w + window, len(job.keys)))
        try:
            await _load_window(transport, part, tp_size, reads, shapes)
        except TransportError as exc:
            exc.chunk += w
            raise


async def _load_window(
    transport: Transport,
    job: LoadJob,
    tp_size: int,
    reads: list[HeadRead],
    shapes: list[KVLayout],
) -> None:
    """Read each shard `reads` names into images of its rank's shape, all at once; copy
    the heads of every chunk before the first that failed; raise that failure."""
    images = [_images(shape, job.token_counts) for shape in shapes]
    errors: list[TransportError] = []

    async def read(i: int) -> None:
        part = _part(
            job,
            0,
            len(job.keys),
            spans=lambda layer: [[memoryview(b)] for b in images[i][layer]],
            shard=shard_name(reads[i].rank, tp_size, transport.context.pp_rank),
            layout=shapes[i],
        )
        try:
            await transport.load(part)
        except TransportError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for i in range(len(reads)):
            nursery.start_soon(read, i)
    first = min(errors, key=lambda e: e.chunk, default=None)
    intact = len(job.keys) if first is None else max(0, first.chunk)
    ours = transport.context.layout
    assert ours is not None
    for layer in range(job.num_layers):
        spans = job.spans(layer)
        for c in range(intact):
            sources = [
                (im[layer][c], sh.image(layer), r)
                for im, sh, r in zip(images, shapes, reads, strict=True)
            ]
            _assemble(spans[c], ours.image(layer), sources, job.token_counts[c])
    if first is not None:
        raise first


def _images(shape: KVLayout, token_counts: Sequence[int]) -> list[list[bytearray]]:
    """An empty image per layer and chunk of `shape`."""
    return [
        [bytearray(shape.chunk_nbytes(layer, n)) for n in token_counts]
        for layer in range(shape.num_layers)
    ]


def _assemble(
    spans: list[memoryview],
    dst: LayerGeometry,
    sources: Sequence[tuple[bytearray, LayerGeometry, HeadRead]],
    num_tokens: int,
) -> None:
    """Copy each source's heads into the chunk whose image is `spans` (of geometry `dst`)."""
    image = spans[0] if len(spans) == 1 else memoryview(bytearray(sum(len(s) for s in spans)))
    if len(image) != dst.chunk_nbytes(num_tokens):
        raise TransportError(
            f"a chunk's spans hold {len(image)} bytes, not {dst.chunk_nbytes(num_tokens)}"
        )
    for src, geometry, r in sources:
        for s, d, n in head_copy_runs(geometry, r.first, dst, r.into, r.count, num_tokens):
            image[d : d + n] = src[s : s + n]
    if len(spans) > 1:
        offset = 0
        for span in spans:
            span[:] = image[offset : offset + len(span)]
            offset += len(span)
