"""Stores one below another (`tiers` in kvflow's configuration; decision 63): e.g. `fs`
on a local NVMe in front of `redis` shared by many machines, and the host-memory tier in
front of both.

`stacked([upper, lower, ...])` is one store transport built of two or more (each any
installed store transport); a stack of three is `upper` over the stack of the rest:

- **lookup**: the upper tier's leading run of chunks, then the lower tier's run from
  there: exactly what a load reads from each (both asked at once; the lower again from
  the run's end only when its first answer stopped short of it). A tier that fails to
  answer counts as holding nothing; both failing is an error.
- **save**: every tier saves the chunks at once, from vLLM's blocks (or the host tier's
  slots); the save returns when all did. Only the upper tier's failure fails it (its
  lookups say what it holds); a lower tier's is logged: the chunk is still found in the
  upper one.
- **load**: the upper tier's leading run of chunks (one lookup) is loaded from it while
  the rest come from below at the same time, and each layer is signalled once both
  landed. Then the chunks that came from below intact are saved into the upper tier
  (`promoted`), before the load returns (vLLM owns the blocks again once it has; a chunk
  a failed load did not deliver is never copied up). Each load is a `TierRead` of the
  upper tier's name.

`stack_of` builds a stack from transport classes and options, giving the lowest tier
the stack's context and each tier above a copy, so that kvflow's adapter can hook each
tier's evictions to its own medium in vLLM's KV events (`tiers_of` lists the tiers). A
save says which tiers hold its chunks (`SaveJob.stored_in`: the upper tier, and the
lower one unless its save failed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import trio

from ..geometry.layout import KVLayout
from ..keys import ChunkKey
from ..observe.events import TierRead
from ..transport import (
    Capabilities,
    LoadJob,
    SaveJob,
    Transport,
    TransportContext,
    TransportError,
    one_error,
    wrapper_class,
)
from .recency import Recency

__all__ = ["StackedStore", "stack_of", "stacked", "tiers_of"]

log = logging.getLogger("kvflow.tiers")


def stacked(tiers: Sequence[Transport]) -> Transport:
    """`tiers[0]` over `tiers[1]` over ...: one store (named and optioned as `tiers[0]`,
    capable of what all of them are)."""
    if len(tiers) == 1:
        return tiers[0]
    upper, lower = tiers[0], stacked(tiers[1:])
    a, b = type(upper).capabilities, type(lower).capabilities
    caps = Capabilities(
        store=True, peer=False, memory=a.memory & b.memory, reshape=a.reshape and b.reshape
    )
    return wrapper_class(StackedStore, type(upper), caps)(upper, lower)


def stack_of(parts: Sequence[tuple[type[Transport], Any]], context: TransportContext) -> Transport:
    """Each (transport class, options) of `parts`, top first, stacked. Each tier but the
    lowest gets a copy of `context`; the lowest gets `context`, the stack's own. A hook
    set on a tier's context (`evicted`) reaches that tier only."""
    last = len(parts) - 1
    return stacked(
        [
            cls(opts, context if i == last else replace(context))
            for i, (cls, opts) in enumerate(parts)
        ]
    )


def tiers_of(transport: Transport) -> list[Transport]:
    """The tiers holding what `transport` saves, top first: the host tier, then each
    store of a stack (a store alone: itself; a replica rank's store: none, it saves
    nothing)."""
    from ..shapes.replicas import ReplicaStore
    from .tiered import HostTier

    if isinstance(transport, ReplicaStore):
        return []
    if isinstance(transport, HostTier):
        return [transport, *tiers_of(transport.inner)]
    if isinstance(transport, StackedStore):
        return [*tiers_of(transport.upper), *tiers_of(transport.lower)]
    return [transport]


class StackedStore(Transport):
    """See the module text."""

    def __init__(self, upper: Transport, lower: Transport) -> None:
        super().__init__(upper.options, lower.context)
        self.upper, self.lower = upper, lower
        self._recency = Recency(lower)

    @property
    def tier(self) -> str:
        return type(self.upper).name

    async def open(self) -> None:
        await self.upper.open()
        try:
            await self.lower.open()
        except BaseException:
            await self.upper.aclose()
            raise

    async def register(self, layout: KVLayout) -> None:
        await self.upper.register(layout)
        await self.lower.register(layout)
        self.context.layout = layout

    async def aclose(self) -> None:
        try:
            await self.upper.aclose()
        finally:
            await self.lower.aclose()

    # -- lookup ------------------------------------------------------------------
    async def lookup(self, keys: Sequence[ChunkKey], *shards: Any) -> int:
        """The upper tier's leading run, then the lower tier's from there: what a load
        reads from each (a chunk only the upper tier holds past a gap does not count)."""
        upper, lower = await self._both(lambda t: t.lookup(keys, *shards))
        if isinstance(upper, TransportError) and isinstance(lower, TransportError):
            raise upper
        held = 0 if isinstance(upper, TransportError) else upper
        if isinstance(lower, int) and lower >= held:
            return lower  # the lower tier holds the rest of the run too
        if held == len(keys) or isinstance(lower, TransportError):
            return held
        try:
            return held + await self.lower.lookup(keys[held:], *shards)
        except TransportError as exc:
            log.warning("kvflow tier %s: %s", type(self.lower).name, exc)
            return held

    async def _both(self, call: Any) -> list[Any]:
        """`call(upper)` and `call(lower)` at once: each its answer or its TransportError."""
        out: list[Any] = [None, None]

        async def one(i: int, t: Transport) -> None:
            try:
                out[i] = await call(t)
            except TransportError as exc:
                log.warning("kvflow tier %s: %s", type(t).name, exc)
                out[i] = exc

        with one_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0, self.upper)
                nursery.start_soon(one, 1, self.lower)
        return out

    async def touch(self, keys: Sequence[ChunkKey]) -> None:
        await self._both(lambda t: t.touch(keys))

    # -- save --------------------------------------------------------------------
    async def save(self, job: SaveJob) -> None:
        def sub() -> SaveJob:  # the blocks are read until both saves end: no early release
            return SaveJob(job.req, job.keys, job.token_counts, job.num_layers, job.layer_spans)

        jobs = {id(self.upper): sub(), id(self.lower): sub()}
        upper, lower = await self._both(lambda t: t.save(jobs[id(t)]))  # lower's: logged
        if isinstance(upper, TransportError):
            raise upper
        job.stored_in = jobs[id(self.upper)].stored_in or [self.upper]
        if not isinstance(lower, TransportError):
            job.stored_in += jobs[id(self.lower)].stored_in or [self.lower]

    # -- load --------------------------------------------------------------------
    async def load(self, job: LoadJob) -> None:
        try:
            held = await self.upper.lookup(job.keys, *([[job.shard]] if job.shard else []))
        except TransportError as exc:
            log.warning("kvflow tier %s: %s", self.tier, exc)
            held = 0
        n = len(job.keys)
        if held >= n:
            await self.upper.load(job)
            promoted = 0
        else:
            promoted = await self._load_split(job, held)
        read = TierRead(req=job.req, tier=self.tier, hits=held, misses=n - held,
                        promoted=promoted, nbytes=0)  # fmt: skip
        self.context.emit_tier_event(read)
        if held and job.shard in ("", self.context.shard):  # the upper tier's chunks are
            self._recency.used(job.keys[: min(held, n)])  # used below too

    async def _load_split(self, job: LoadJob, held: int) -> int:
        """The first `held` chunks from the upper tier, the rest from below (`_load_parts`);
        the chunks promoted."""
        landed = [[trio.Event() for _ in range(job.num_layers)] for _ in range(2)]
        parts = [range(0, held), range(held, len(job.keys))]

        def part(p: int) -> LoadJob:
            idx = parts[p]
            return LoadJob(
                job.req, [job.keys[c] for c in idx], [job.token_counts[c] for c in idx],
                job.num_layers, lambda i: [job.spans(i)[c] for c in idx],
                lambda i: landed[p][i].set(), job.source,
                [job.block_ids[c] for c in idx] if job.block_ids else [], job.layerwise,
                job.shard, job.layout,
            )  # fmt: skip

        return await self._load_parts(job, part, landed, held)

    async def _load_parts(
        self, job: LoadJob, part: Any, landed: list[list[trio.Event]], held: int
    ) -> int:
        """Part 0 from the upper tier, part 1 from below, each layer signalled once both
        landed; then the chunks of part 1 that arrived intact are saved into the upper
        tier, before the load returns (vLLM's blocks are ours until then, and a chunk a
        failed load left unverified is never promoted). The chunks promoted."""
        failed: list[TransportError] = []

        async def load(p: int, t: Transport) -> None:
            try:
                await t.load(part(p))
            except TransportError as exc:
                exc.chunk += held if p else 0  # numbered as in the job
                failed.append(exc)
                if p == 0:  # nothing past its chunk matters
                    nursery.cancel_scope.cancel()
                else:  # the upper part, all before it, loads on: it must end intact
                    for event in landed[1]:
                        event.set()  # no layer waits for it any more

        with one_error():
            async with trio.open_nursery() as nursery:
                if held:
                    nursery.start_soon(load, 0, self.upper)
                nursery.start_soon(load, 1, self.lower)
                for i in range(job.num_layers):
                    if held:
                        await landed[0][i].wait()
                    await landed[1][i].wait()
                    if failed:
                        break
                    job.layer_loaded(i)
        first = min(failed, key=lambda e: e.chunk) if failed else None
        intact = len(job.keys) if first is None else first.chunk
        promoted = 0
        if intact > held and not job.shard and job.layout is None:  # another shape's: below
            below = part(1)
            keep = intact - held

            async def spans(i: int) -> list[list[memoryview]]:
                return below.spans(i)[:keep]

            save = SaveJob(job.req, below.keys[:keep], below.token_counts[:keep],
                           job.num_layers, spans)  # fmt: skip
            try:
                await self.upper.save(save)
                promoted = keep
            except TransportError as exc:
                log.warning("kvflow tier %s: promotion failed: %s", self.tier, exc)
        if first is not None:
            raise first
        return promoted
