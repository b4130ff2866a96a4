"""Chunks a store holds for another tensor-parallel size: which shards to look up, which
to read, and how a rank takes its heads from them.

A store keeps each rank's slice of a chunk under that rank's shard (`shard_name`):
the KV heads the rank holds (`kvflow.geometry.topology.held_heads`), its bytes as they lie
(a device cache token-major); ranks that replicate heads (more ranks than KV heads;
MLA) keep them once, under the first of them (`kvflow.shapes.replicas`). The namespace does
not depend on the tensor-parallel size, so an engine of another size computes the same
chunk keys. Its scheduler looks up its own shards first, then, from the first chunk
they miss, the shards of each other size in `STORE_TP_SIZES` that splits the model's
heads (`other_shapes`), and says per chunk which size holds it (`lookup_sources`,
`LoadSpec.tp_sizes`). A worker reads the shards holding its heads (`plan_reads`, as a
P/D consumer does, but from the first replica of a replicated head) into images shaped
as the saving rank's (`KVLayout.with_heads`), checked as any load checks them (the job
names the shard and the layout): each stored byte lands where its head goes in this
rank's blocks (`head_copy_runs`), or in scratch when this rank does not hold that head.

Nothing is converted when the sizes match: those chunks load as they always did.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import trio

from ..geometry.cells import copy_heads, head_copy_runs, slices
from ..geometry.layout import KVLayout, LayerGeometry, LayoutError
from ..geometry.topology import HeadRead, TopologyError, held_heads, plan_reads, readers
from ..transport import LoadJob, Transport, TransportError

__all__ = [
    "STORE_TP_SIZES",
    "StoreShape",
    "load_reshaped",
    "lookup_sources",
    "other_shapes",
    "shard_name",
]

STORE_TP_SIZES = (1, 2, 4, 8, 16)
"""The tensor-parallel sizes whose chunks an engine of another size looks for."""

DIRECT_RUNS = 8
"""A stored image whose heads land in at most this many runs of a chunk is read straight
into them; one of more goes through a buffer (reading to many small spans is slower)."""
SCRATCH_BYTES = 64 << 20
"""A load of another size's chunks reads at most this many bytes a window (what of them
this rank does not hold goes through scratch memory)."""


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
            count = readers(kv_heads, size, tp_size, spread=False)
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
        others = await _lookup_each(transport, rest, shapes)  # a miss is one round
        hit = next((i for i, n in enumerate(others) if n), None)
        if hit is None:
            break
        sources += [shapes[hit].tp_size] * others[hit]
    return sources


async def _lookup_each(
    transport: Transport, keys: Sequence[str], shapes: Sequence[StoreShape]
) -> list[int]:
    """The leading `keys` each of `shapes` holds, asked together."""
    found = [0] * len(shapes)

    async def ask(i: int) -> None:
        found[i] = await transport.lookup(keys, shapes[i].shards)  # type: ignore[call-arg]

    async with trio.open_nursery() as nursery:
        for i in range(len(shapes)):
            nursery.start_soon(ask, i)
    return found


# -- copying heads between images --------------------------------------------------


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
    time (at most `SCRATCH_BYTES` of heads this rank does not hold in flight)."""
    ctx, layout = transport.context, transport.context.layout
    assert layout is not None, "a store loads into registered KV caches"
    try:
        reads = plan_reads(ctx.kv_heads, tp_size, ctx.tp_size, ctx.tp_rank, spread=False)
        held = [len(held_heads(ctx.kv_heads, tp_size, r.rank)) for r in reads]
        shapes = [layout.with_heads(c) for c in held]
    except (TopologyError, LayoutError) as exc:
        raise TransportError(f"chunks saved at tensor parallel size {tp_size}: {exc}") from None
    per_chunk = sum(s.nbytes([max(job.token_counts)]) for s in shapes)
    window = max(1, SCRATCH_BYTES // max(1, per_chunk))
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
    """Read the shards `reads` names at once and put each one's heads where this rank
    keeps them; raise the failure at the earliest chunk (every piece of the chunks before
    it arrived, checked). A layer whose heads lie in a few long runs is read straight
    into them (`_read_spans`); one of many short runs (NHD: a run per token) is read
    whole into a buffer, then copied by numpy (`kvflow.geometry.cells.copy_heads`)."""
    ours = transport.context.layout
    assert ours is not None
    errors: list[TransportError] = []
    mine = functools.cache(job.spans)  # this rank's spans of a layer, for every piece

    async def read(i: int) -> None:
        r = reads[i]
        bounced: dict[int, list[memoryview]] = {}  # layers read whole into a buffer

        def spans(layer: int) -> list[list[memoryview]]:
            dst, src, counts = ours.image(layer), shapes[i].image(layer), job.token_counts
            runs = head_copy_runs(src, r.first, dst, r.into, r.count, max(counts))
            if len(runs) > DIRECT_RUNS:
                bounced[layer] = [np.empty(src.chunk_nbytes(n), np.uint8).data for n in counts]
                return [[b] for b in bounced[layer]]
            return [
                _read_spans(into, src, dst, r, n)
                for into, n in zip(mine(layer), counts, strict=True)
            ]

        def landed(layer: int) -> None:
            """Copy a buffered layer as soon as it landed, while the next ones are read
            (a chunk that failed is copied too: its blocks are reported and recomputed)."""
            if (buffers := bounced.pop(layer, None)) is not None:
                dst, src = ours.image(layer), shapes[i].image(layer)
                for c, (into, n) in enumerate(zip(mine(layer), job.token_counts, strict=True)):
                    copy_heads(buffers[c], src, into, dst, r, n)

        shard = shard_name(r.rank, tp_size, transport.context.pp_rank)
        part = _part(job, 0, len(job.keys), spans=spans, shard=shard, layout=shapes[i])
        part.layer_loaded = landed
        try:
            await transport.load(part)
        except TransportError as exc:
            errors.append(exc)
        finally:  # layers a transport that stopped early never signalled: what arrived
            for layer in sorted(bounced):
                landed(layer)

    async with trio.open_nursery() as nursery:
        for i in range(len(reads)):
            nursery.start_soon(read, i)
    if errors:
        raise min(errors, key=lambda e: e.chunk)


def _read_spans(
    spans: list[memoryview], src: LayerGeometry, dst: LayerGeometry, read: HeadRead, n: int
) -> list[memoryview]:
    """Where a stored image of `src`'s heads lands, in its byte order: the pieces of this
    rank's chunk (`spans`, an image of `dst`) its heads go to, and scratch for the heads
    it does not hold (read, hashed with the rest, then dropped)."""
    plan = _read_plan(src, dst, read, n, tuple(len(s) for s in spans))
    return [
        spans[i][off : off + length] if i >= 0 else np.empty(length, dtype=np.uint8).data
        for i, off, length in plan
    ]


@functools.lru_cache(maxsize=1024)
def _read_plan(
    src: LayerGeometry, dst: LayerGeometry, read: HeadRead, n: int, sizes: tuple[int, ...]
) -> tuple[tuple[int, int, int], ...]:
    """`_read_spans` as (span index or -1 for scratch, offset, length)."""
    if sum(sizes) != dst.chunk_nbytes(n):
        raise TransportError(f"a chunk's spans do not hold {dst.chunk_nbytes(n)} bytes")
    runs = sorted(head_copy_runs(src, read.first, dst, read.into, read.count, n))
    starts = list(itertools.accumulate(sizes, initial=0))
    out: list[tuple[int, int, int]] = []
    at, end = 0, src.chunk_nbytes(n)
    for s, d, length in [*runs, (end, 0, 0)]:
        if s > at:  # bytes of heads this rank does not hold
            out.append((-1, 0, s - at))
        out += slices(starts, d, length)
        at = s + length
    return tuple(out)
