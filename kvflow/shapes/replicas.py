"""Ranks that replicate KV heads keep them in a store once.

With more tensor-parallel ranks than KV heads (`tp_size > heads`), and for an MLA latent
(one "head" every rank holds whole), several ranks of an engine hold the same bytes,
unless vLLM also splits tokens over them (decode or prefill context parallelism: then
each keeps its own shard). A store keeps them once, under the shard of the first rank
holding them (`kvflow.geometry.topology.first_replica`): that rank saves them; the others'
saves write nothing (`as_replica`) and their lookups and loads name that rank's shard
(`store_shards`). The host tier (`cpu_cache_gib`) is on the saving ranks only, so host
memory holds each chunk once too; the other ranks read the store below it (for `fs`,
from the page cache the first rank's reads fill).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ..geometry.layout import KVLayout
from ..geometry.topology import TopologyError, first_replica
from ..keys import ChunkKey
from ..transport import LoadJob, SaveJob, Transport, wrapper_class
from .reshape import shard_name

__all__ = ["ReplicaStore", "as_replica", "store_shards"]


def store_shards(
    kv_heads: int,
    tp_size: int,
    pp_size: int,
    tp_rank: int,
    pp_rank: int,
    context_parallel: int = 1,
) -> tuple[str, list[str]]:
    """Rank (`tp_rank`, `pp_rank`)'s shard in a store, and every shard a chunk has there
    (each rank's own when no heads are replicated, their number is not known, or the
    ranks are split for context parallelism too: `context_parallel` > 1, the product of
    vLLM's decode and prefill context-parallel sizes, whose ranks sharing a head hold
    other tokens of it)."""

    def first(rank: int) -> int:
        if context_parallel > 1:
            return rank
        try:
            return first_replica(kv_heads, tp_size, rank)
        except TopologyError:  # heads not known (0) or not split as vLLM splits them
            return rank

    shards = [shard_name(first(r), tp_size, p) for p in range(pp_size) for r in range(tp_size)]
    return shard_name(first(tp_rank), tp_size, pp_rank), list(dict.fromkeys(shards))


def as_replica(inner: Transport) -> Transport:
    """`inner` as a rank whose heads another rank saves sees it (a class named, optioned
    and capable as `inner`'s)."""
    return wrapper_class(ReplicaStore, type(inner))(inner)


class ReplicaStore(Transport):
    """A store whose saves write nothing: the first rank holding the same heads saves
    the same bytes. Lookups and loads are the store's (its context names that rank's
    shard), and a load names that shard, so that no tier copies it up from here."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.options, inner.context)
        self.inner = inner

    async def open(self) -> None:
        await self.inner.open()

    async def register(self, layout: KVLayout) -> None:
        await self.inner.register(layout)
        self.context.layout = layout

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def lookup(self, keys: Sequence[ChunkKey], *shards: Any) -> int:
        return await self.inner.lookup(keys, *shards)

    async def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Nothing: the first replica's chunks are its own to count as used."""

    async def save(self, job: SaveJob) -> None:
        """Nothing to write: another rank saves these bytes."""

    async def load(self, job: LoadJob) -> None:
        """The store's load of the first replica's shard, named where the store takes
        shard names (`Capabilities.reshape`): a stack then copies nothing up into its
        upper tier from here (the first replica's own loads do)."""
        if type(self).capabilities.reshape and not job.shard:
            job = replace(job, shard=self.context.shard)
        await self.inner.load(job)
