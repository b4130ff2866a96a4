"""Chunks a store holds for engines of another block size: which to look up, which of
them hold a load's tokens, and how their bytes land in this engine's blocks.

A device cache is stored token-major (`kvflow.engine.staging`): a chunk of n tokens is
`[tokens, heads, cell]` whatever the block size, so the chunks of a run of tokens,
end to end, are the same bytes at any block size. Such engines share a namespace
across block sizes (the fingerprint leaves the block size out) and each keys its
chunks by its own block size (`kvflow.keys.chunk_keys`). A scheduler whose own keys
miss looks up the key chain of each other size in `STORE_BLOCK_SIZES` that divides or
is a multiple of its own (`lookup_blocks`); a load from one (`LoadSpec.stored`, a
`StoredRun`) reads those chunks end to end into its chunks' token-major images,
dropping the tokens before its first block or past its last (`load_reblocked`).

vLLM's CPU cache packs its blocks per instruction set: they do not split into tokens,
and its namespace keeps the block size (no chunk of another size is looked for).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec
import numpy as np
import trio

from ..geometry.cells import slices
from ..keys import ChunkKey, chunk_keys, chunk_token_counts
from ..transport import LoadJob, Transport, TransportError

__all__ = [
    "STORE_BLOCK_SIZES",
    "StoredRun",
    "load_reblocked",
    "load_window",
    "lookup_blocks",
    "other_block_sizes",
]

STORE_BLOCK_SIZES = (16, 32, 64, 128, 256)
"""The block sizes whose chunks an engine of another block size looks for."""


def other_block_sizes(block_size: int) -> list[int]:
    """The sizes in `STORE_BLOCK_SIZES` other than `block_size` that divide it or that
    it divides (a block is then whole chunks, or a chunk whole blocks)."""
    return [
        b
        for b in STORE_BLOCK_SIZES
        if b != block_size and (b % block_size == 0 or block_size % b == 0)
    ]


class StoredRun(msgspec.Struct, frozen=True, array_like=True):
    """Chunks a store holds at `block_size` tokens each, end to end, holding a load's
    tokens: the load's first token is token `skip` of the first chunk."""

    block_size: int
    keys: list[ChunkKey]
    token_counts: list[int]
    skip: int = 0

    def window(self, start: int, num_tokens: int) -> StoredRun:
        """The chunks holding tokens `[start, start + num_tokens)` of this run's
        (`skip` 0); a `ValueError` past its end."""
        first, skip = divmod(start, self.block_size)
        last = -(-(start + num_tokens) // self.block_size)
        if self.skip or start < 0 or start + num_tokens > sum(self.token_counts):
            raise ValueError(f"tokens {start}..{start + num_tokens} are not in this run")
        return StoredRun(
            self.block_size, self.keys[first:last], self.token_counts[first:last], skip
        )


async def lookup_blocks(
    transport: Transport,
    namespace: str,
    token_ids: Sequence[int],
    salt: str,
    partial: bool,
    counts: Sequence[int],
    sizes: Sequence[int],
) -> tuple[int, StoredRun | None]:
    """The most leading chunks of `counts` (this engine's) that the chunks of one of
    `sizes` hold, and those chunks: one lookup a size, all at once (a request waits for
    the slowest, not for their sum)."""
    runs: list[StoredRun] = []
    store_key = transport.context.store_key  # keyed chunk keys, as the engine's own

    async def look(size: int) -> None:
        keys = chunk_keys(
            namespace, token_ids, size, salt=salt, include_partial=partial, store_key=store_key
        )
        found = max(0, min(await transport.lookup(keys), len(keys)))
        runs.append(StoredRun(size, keys[:found], chunk_token_counts(len(token_ids), size)[:found]))

    async with trio.open_nursery() as nursery:
        for size in sizes:
            nursery.start_soon(look, size)
    best, found_run = 0, None
    for run in sorted(runs, key=lambda r: r.block_size):
        held = sum(run.token_counts)
        ours = sum(1 for end in itertools.accumulate(counts) if end <= held)
        if ours > best:
            best, found_run = ours, run
    return best, found_run


def load_window(
    run: StoredRun | None, counts: Sequence[int], chunks: Sequence[int]
) -> tuple[StoredRun | None, str]:
    """The chunks of `run` (a lookup's) holding the chunks `chunks` of an engine's
    `counts`, or why they cannot be loaded from it; (None, "") without a run."""
    if run is None or not chunks:
        return None, ""
    if list(chunks) != list(range(chunks[0], chunks[-1] + 1)):  # a sliding window's nulls
        return None, (
            f"the store holds these tokens in chunks of {run.block_size}: a window with "
            "gaps is not loaded across them"
        )
    return run.window(sum(counts[: chunks[0]]), sum(counts[i] for i in chunks)), ""


async def load_reblocked(transport: Transport, job: LoadJob, run: StoredRun) -> None:
    """`transport.load(job)` from the chunks `run` names: each one's token-major bytes
    land end to end in the job's chunk images, tokens outside them in scratch. A
    failure names the first chunk of the job not intact."""
    layout = transport.context.layout
    assert layout is not None, "a store loads into registered KV caches"
    images = [layout.image(layer) for layer in range(layout.num_layers)]
    if layout.memory == "cpu" or any(g.block_bytes for g in images):
        raise TransportError(
            f"chunks saved at block size {run.block_size}: this engine's cache is stored "
            f"as it lies ({layout.describe()}), not token-major; only device caches load "
            "chunks of another block size"
        )
    total = sum(job.token_counts)
    if run.skip + total > sum(run.token_counts) or len(run.keys) != len(run.token_counts):
        raise TransportError(f"chunks saved at block size {run.block_size} miss tokens")
    starts = list(itertools.accumulate(run.token_counts, initial=-run.skip))

    def spans(layer: int) -> list[list[memoryview]]:
        ours = [s for chunk in job.spans(layer) for s in chunk]
        at = list(itertools.accumulate((len(s) for s in ours), initial=0))
        per = images[layer].chunk_nbytes(1)
        out = []
        for start, n in zip(starts, run.token_counts, strict=False):
            a = min(max(-start, 0), n)  # this chunk's tokens [a, b) are the job's
            b = min(max(total - start, a), n)
            pieces = [_scratch(a * per)] if a else []
            pieces += [
                ours[i][off : off + k] for i, off, k in slices(at, (start + a) * per, (b - a) * per)
            ]
            pieces += [_scratch((n - b) * per)] if b < n else []
            out.append(pieces)
        return out

    stored = LoadJob(
        job.req, run.keys, run.token_counts, job.num_layers, spans, job.layer_loaded,
        layerwise=job.layerwise,
    )  # fmt: skip
    try:
        await transport.load(stored)
    except TransportError as exc:  # the job's chunk holding the failed chunk's first token
        first = max(0, starts[max(0, exc.chunk)])
        exc.chunk = sum(1 for end in itertools.accumulate(job.token_counts) if end <= first)
        raise


def _scratch(nbytes: int) -> memoryview:
    """Where bytes of a stored chunk that the job does not load are read (and dropped)."""
    return np.empty(nbytes, np.uint8).data
