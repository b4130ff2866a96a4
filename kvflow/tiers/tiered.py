"""A host-memory tier in front of a store transport (`cpu_cache_gib`; decision 61).

`HostTier` wraps the configured store transport (its name, options and capabilities)
and keeps a `HostCache` on each worker:

- **save**: each layer's chunk bytes are copied into cache slots as vLLM computes them;
  then the job's `release()` hands vLLM its blocks back, and the chunks are written to
  the store from the cache (a save still returns only once the store holds them, so
  what a save returns is visible to every instance, as before). While written back the
  chunks are pinned. When the cache cannot give every chunk of a save a slot (too few
  free of pins), the save writes through from vLLM's blocks, as without the tier, and
  evicts nothing.
- **load**: chunks the cache holds are copied from it; the others are loaded from the
  store at the same time, layer by layer, and, where a slot can be had, kept in the
  cache before their layer is signalled (after the signal the layer is vLLM's again).
- **lookup** asks the store. A chunk whose write-back failed stays in the cache but is a
  miss for the scheduler, as it is without the tier. So that the store keeps what the
  cache serves, each chunk a load takes from the cache counts as used in the store
  (`kvflow.tiers.recency`, off the load's path): the store's own recency saw only its
  own reads, and evicted a prefix read from the cache after every other prompt as its
  coldest.

A save says which tiers hold its chunks (`SaveJob.stored_in`: this one and the store's,
or only the store's when it wrote through), and what the cache evicts goes to the
`evicted` hook, for vLLM's KV events (`kvflow:cpu`).

The scheduler's instance holds no cache (it only looks up).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import trio

from ..geometry.layout import KVLayout
from ..keys import ChunkKey
from ..observe.events import TierRead, TierWrite
from ..transport import LoadJob, SaveJob, Transport, TransportError, wrapper_class
from .host import HostCache
from .recency import Recency

TIER = "cpu"
"""The tier's name in events, stats and metrics (`vllm:kvflow_tier_*{tier="cpu"}`)."""

__all__ = ["HostTier", "with_host_tier"]

log = logging.getLogger("kvflow.tiers")


def with_host_tier(inner: Transport, nbytes: int, policy: str) -> Transport:
    """`inner` behind a host-memory tier of `nbytes` per worker (a class named, described
    and capable as `inner`'s)."""
    return wrapper_class(HostTier, type(inner))(inner, nbytes, policy)


class HostTier(Transport):
    """See the module text."""

    def __init__(self, inner: Transport, nbytes: int, policy: str) -> None:
        super().__init__(inner.options, inner.context)
        self.inner = inner
        self._recency = Recency(inner)
        self.nbytes = nbytes
        self.policy = policy
        self.cache: HostCache | None = None
        """The worker's cache (None on the scheduler, and until `register`)."""
        self.evicted: Callable[[list[ChunkKey]], None] | None = None
        """Set by kvflow's vLLM adapter when vLLM publishes KV events: called with the
        chunks this tier evicted (as `TransportContext.evicted` is by a store)."""

    async def open(self) -> None:
        await self.inner.open()

    async def register(self, layout: KVLayout) -> None:
        await self.inner.register(layout)
        self.context.layout = layout
        slot = sum(
            layout.image(i).chunk_nbytes(layout.block_size) for i in range(layout.num_layers)
        )
        # pinning gigabytes takes a while: not on the loop's thread
        self.cache = await trio.to_thread.run_sync(HostCache, self.nbytes, slot, self.policy)
        self.cache.victims = []  # for `evicted`
        if not self.cache.slots:
            log.warning(
                "kvflow host tier: %d bytes for this worker hold no chunk of %d bytes; "
                "raise cpu_cache_gib (the tier holds nothing)",
                self.nbytes,
                slot,
            )

    async def aclose(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        await self.inner.aclose()

    async def lookup(self, keys: Sequence[ChunkKey], *shards: Any) -> int:
        return await self.inner.lookup(keys, *shards)

    # -- save --------------------------------------------------------------------
    async def save(self, job: SaveJob) -> None:
        cache = self.cache
        if cache is None or not cache.room(len(job.keys)):  # through, as without the tier
            await self.inner.save(job)
            job.stored_in = job.stored_in or [self.inner]
            if cache is not None:
                self.context.emit_tier_event(
                    TierWrite(
                        req=job.req, tier=TIER, stored=0, through=len(job.keys), evicted=0, nbytes=0
                    )
                )
            return
        taken: list[int] = []
        for _ in job.keys:
            slot = cache.reserve()
            assert slot is not None  # `room` said so, and nothing ran in between
            taken.append(slot)
        evicted = self._report_evicted(cache)  # (no await since: this save's own)
        sizes = await self._copy_in(cache, job, taken)
        for key, slot, size in zip(job.keys, taken, sizes, strict=True):
            cache.commit(key, slot, size)
            cache.pin(key)
        nbytes = sum(sum(s) for s in sizes)
        stored = len(job.keys)
        self.context.emit_tier_event(
            TierWrite(
                req=job.req, tier=TIER, stored=stored, through=0, evicted=evicted, nbytes=nbytes
            )
        )
        try:
            job.release()  # vLLM may have its blocks back
            from_cache = SaveJob(
                job.req, list(job.keys), list(job.token_counts), job.num_layers,
                self._spans_of(cache, job.keys),
            )  # fmt: skip
            await self.inner.save(from_cache)
            job.stored_in = [self, *(from_cache.stored_in or [self.inner])]
        finally:
            for key in job.keys:
                cache.unpin(key)

    def _report_evicted(self, cache: HostCache) -> int:
        """Hand the chunks evicted since the last call to `evicted`; how many."""
        if (victims := cache.take_victims()) and self.evicted is not None:
            self.evicted([str(k) for k in victims])
        return len(victims)

    async def _copy_in(self, cache: HostCache, job: SaveJob, slots: list[int]) -> list[list[int]]:
        """Copy each layer's chunks into `slots` as it is given; each chunk's layer sizes.
        The slots go back if the save ends before every layer is in."""
        sizes: list[list[int]] = [[] for _ in slots]
        done = False
        try:
            for layer in range(job.num_layers):
                chunks = await job.layer(layer)
                places = []
                for c, runs in enumerate(chunks):
                    at = sum(sizes[c])
                    n = sum(len(r) for r in runs)
                    if at + n > cache.slot_bytes:
                        raise TransportError(f"chunk {c} exceeds a host tier slot", chunk=c)
                    places.append((cache.view(slots[c]), at, runs))
                    sizes[c].append(n)
                # off the loop's thread, numpy copying without the GIL: vLLM's thread, in
                # this process, runs on meanwhile (a cancelled save waits for the copy)
                await trio.to_thread.run_sync(_to_slots, places)
            done = True
        finally:
            if not done:
                for slot in slots:
                    cache.unreserve(slot)
        return sizes

    @staticmethod
    def _spans_of(cache: HostCache, keys: Sequence[ChunkKey]) -> Any:
        """A `SaveJob.layer_spans` over the cached chunks of `keys` (pinned)."""
        entries = [(cache.view(e.slot), e.sizes, _offsets(e.sizes)) for e in map(cache.entry, keys)]

        async def layer_spans(layer: int) -> list[list[memoryview]]:
            return [[view[at[layer] : at[layer] + sizes[layer]]] for view, sizes, at in entries]

        return layer_spans

    # -- load --------------------------------------------------------------------
    async def load(self, job: LoadJob) -> None:
        cache = self.cache
        if cache is None or job.shard not in ("", self.context.shard) or job.layout is not None:
            await self.inner.load(job)  # another shard's bytes: the store's
            return
        spans = [job.spans(layer) for layer in range(job.num_layers)]
        sizes = [tuple(sum(len(r) for r in s[c]) for s in spans) for c in range(len(job.keys))]
        held = {}
        for c, key in enumerate(job.keys):
            if (entry := cache.get(key, sizes[c])) is not None:
                held[c] = entry
                cache.pin(key)
        missing = [c for c in range(len(job.keys)) if c not in held]
        promote = {}
        for c in missing:
            if sum(sizes[c]) <= cache.slot_bytes and (slot := cache.reserve()) is not None:
                promote[c] = slot
        evicted = self._report_evicted(cache)  # (no await since: this load's own)
        done = False
        try:
            await self._load_from_both(cache, job, (spans, sizes), held, missing, promote)
            done = True
        finally:
            for c in held:
                cache.unpin(job.keys[c])
            kept = 0
            for c, slot in promote.items():
                if done:
                    kept += cache.commit(job.keys[c], slot, sizes[c])
                else:
                    cache.unreserve(slot)
        nbytes = sum(sum(e.sizes) for e in held.values())
        self.context.emit_tier_event(
            TierRead(
                req=job.req, tier=TIER, hits=len(held), misses=len(missing), promoted=kept,
                nbytes=nbytes, evicted=evicted,
            )
        )  # fmt: skip
        if held:  # used here, so used in the store: it must not evict them as cold
            self._recency.used([job.keys[c] for c in held])

    async def _load_from_both(
        self,
        cache: HostCache,
        job: LoadJob,
        where: tuple[list[list[list[memoryview]]], list[tuple[int, ...]]],
        held: dict[int, Any],
        missing: list[int],
        promote: dict[int, int],
    ) -> None:
        """Chunks `held` from the cache, `missing` ones from the store at the same time,
        each layer signalled once both landed (and promoted ones copied into their
        slots); `where`: each layer's spans of each chunk, and each chunk's layer sizes."""
        spans, sizes = where
        landed = [trio.Event() for _ in range(job.num_layers)]
        sub = LoadJob(
            job.req, [job.keys[c] for c in missing], [job.token_counts[c] for c in missing],
            job.num_layers, lambda i: [spans[i][c] for c in missing],
            lambda i: landed[i].set(), None,
            [job.block_ids[c] for c in missing] if job.block_ids else [], job.layerwise,
        )  # fmt: skip

        failed: list[TransportError] = []
        held_at = {c: (cache.view(e.slot), _offsets(e.sizes)) for c, e in held.items()}
        promoted_at = {c: (cache.view(s), _offsets(sizes[c])) for c, s in promote.items()}
        copied = 0  # layers whose held chunks are copied

        def copy_held(layer: int) -> None:
            for c, (view, starts) in held_at.items():
                _from_slot(view, starts[layer], spans[layer][c])
            cache.counters.bytes_out += sum(e.sizes[layer] for e in held.values())

        async def from_store() -> None:
            try:
                await self.inner.load(sub)
            except TransportError as exc:  # its chunk numbers are the job's `missing`
                exc.chunk = missing[min(exc.chunk, len(missing) - 1)]
                failed.append(exc)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            if missing:
                nursery.start_soon(from_store)
            for layer in range(job.num_layers):
                copy_held(layer)
                copied = layer + 1
                if missing:
                    await landed[layer].wait()
                for c, (view, starts) in promoted_at.items():
                    _to_slot(view, starts[layer], spans[layer][c])
                job.layer_loaded(layer)
                await trio.lowlevel.checkpoint()
        if failed:  # the chunks before the one that failed are intact: held ones too
            for layer in range(copied, job.num_layers):
                copy_held(layer)
            raise failed[0]


def _offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of `sizes` starts when laid end to end."""
    return list(itertools.accumulate(sizes[:-1], initial=0))


def _to_slots(places: list[tuple[memoryview, int, list[memoryview]]]) -> None:
    """`_to_slot` for each (slot view, from byte, runs)."""
    for view, at, runs in places:
        _to_slot(view, at, runs)


def _to_slot(view: memoryview, at: int, runs: list[memoryview]) -> None:
    """Copy `runs`, end to end, into a slot's `view` from byte `at` on, by numpy (which
    copies without holding the GIL)."""
    dst = np.frombuffer(view, np.uint8)
    for r in runs:
        np.copyto(dst[at : at + len(r)], np.frombuffer(r, np.uint8))
        at += len(r)


def _from_slot(view: memoryview, at: int, runs: list[memoryview]) -> None:
    """Fill `runs`, in order, from a slot's `view` from byte `at` on."""
    for r in runs:
        r[:] = view[at : at + len(r)]
        at += len(r)
