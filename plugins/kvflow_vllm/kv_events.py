"""kvflow's saves and evictions on vLLM's KV event stream (`--kv-events-config`).

A router that places requests where their prefix is cached (llm-d, NVIDIA Dynamo)
reads vLLM's `BlockStored` / `BlockRemoved` events. kvflow adds its own, with the
engine's own block hashes and a medium per tier (`media`: `kvflow:cpu` for the host
tier, `kvflow:<transport>` for each store), so a router can tell a block kvflow holds,
and where, from one in vLLM's cache:

- `BlockStored` in a tier's medium once every saving worker (tensor x pipeline parallel
  rank; replicas of a head save nothing) stored a block's chunk there; a chunk kvflow
  stores is one vLLM block (a partial last block has no vLLM hash and no event);
- `BlockRemoved` in a tier's medium when that tier deleted one of those chunks to make
  room.

Events are built in the scheduler (vLLM publishes from there, and `MultiConnector`
forwards only the scheduler's events): workers report what their saves stored, failed
to store and what their store evicted as `KVFlowWorkerMeta`, which vLLM sums over
workers and hands to the scheduler's connector. An engine publishes only what it
wrote: engines sharing a store each announce their own chunks on their own stream.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvflow.config import KVFlowConfig
from kvflow.engine.worker import ChunkOutcomes
from kvflow.keys import ChunkKey

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["ChunkReport", "KVEventTracker", "KVFlowWorkerMeta", "events_enabled", "media"]

REMEMBERED = 1 << 18
"""Stored blocks remembered for their `BlockRemoved`, per medium (the oldest are
forgotten first: ~50 MB each; a block forgotten and later evicted gets no
`BlockRemoved`)."""
RELEASED = 1 << 16
"""Planned chunks kept after their requests' blocks went back to vLLM, for reports that
come later (a host tier hands blocks back before its write-back ends); the oldest are
dropped first, unannounced."""


def events_enabled(vllm_config: Any) -> bool:
    kec = getattr(vllm_config, "kv_events_config", None)
    return bool(kec is not None and kec.enable_kv_cache_events)


def media(config: KVFlowConfig) -> list[str]:
    """The `medium` of each tier kvflow saves to, top first, as its events name them:
    `kvflow:cpu` for the host tier (`cpu_cache_gib`), `kvflow:<transport>` for each store
    (`transport`, then `tiers`), `.<i>` after a name a store above has too (`i`: its
    place among the stores, `transport` 0)."""
    stores = [config.transport, *(t.transport for t in config.tiers)]
    named = [f"kvflow:{n}" + (f".{i}" if n in stores[:i] else "") for i, n in enumerate(stores)]
    return ["kvflow:cpu", *named] if config.cpu_cache_gib else named


class ChunkReport(msgspec.Struct, array_like=True):
    """One KV cache group's chunk outcomes, merged over workers."""

    saved: dict[str, dict[str, list[int]]] = {}
    """Medium -> key -> the workers (shard ranks) that stored their shard of it there."""
    unsaved: list[str] = []
    evicted: dict[str, list[str]] = {}
    """Medium -> the keys a tier of it evicted."""

    @classmethod
    def of(cls, outcomes: ChunkOutcomes | None, rank: int, tiers: dict[int, str]) -> ChunkReport:
        """A worker's outcomes; `tiers`: the medium of each of its tiers (by `id`), whose
        saves alone count (a replica rank's store is none: another rank saves for it)."""
        if outcomes is None:
            return cls()
        saved: dict[str, dict[str, list[int]]] = {}
        for keys, stored_in in outcomes.saved:
            for tier in stored_in:
                if (medium := tiers.get(id(tier))) is not None:
                    saved.setdefault(medium, {}).update((k, [rank]) for k in keys)
        evicted: dict[str, list[str]] = {}
        for medium, keys in outcomes.evicted:
            evicted.setdefault(medium, []).extend(keys)
        return cls(saved, outcomes.unsaved, evicted)

    def merge(self, other: ChunkReport) -> ChunkReport:
        saved = {m: dict(by_key) for m, by_key in self.saved.items()}
        for medium, by_key in other.saved.items():
            mine = saved.setdefault(medium, {})
            for key, ranks in by_key.items():
                mine[key] = mine.get(key, []) + ranks
        evicted = {m: list(keys) for m, keys in self.evicted.items()}
        for medium, keys in other.evicted.items():
            evicted.setdefault(medium, []).extend(keys)
        return ChunkReport(saved, self.unsaved + other.unsaved, evicted)

    def is_empty(self) -> bool:
        return not (self.saved or self.unsaved or self.evicted)


_reports = msgspec.msgpack.Decoder(list[ChunkReport])


class KVFlowWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once a step: a `ChunkReport` per KV cache group. Pickles as
    its msgspec bytes, nothing else."""

    def __init__(self, reports: list[ChunkReport]) -> None:
        self.reports = reports

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVFlowWorkerMeta)
        return KVFlowWorkerMeta(
            [a.merge(b) for a, b in zip(self.reports, other.reports, strict=True)]
        )

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (_meta_from_bytes, (msgspec.msgpack.encode(self.reports),))


def _meta_from_bytes(data: bytes) -> KVFlowWorkerMeta:
    return KVFlowWorkerMeta(_reports.decode(data))


class KVEventTracker:
    """One KV cache group's events, in the scheduler: what a planned save will store, the
    workers' reports, the events ready for vLLM to publish (one `BlockStored` per tier
    that stored a block, with its medium; a `BlockRemoved` per tier that evicted it)."""

    def __init__(self, *, media: list[str], block_size: int, workers: int, group: int) -> None:
        self.media = media
        self.block_size = block_size
        self.workers = workers
        """The workers a block's chunk has shards on (each stores its own)."""
        self.group = group
        self._planned: dict[ChunkKey, tuple[BlockStored, dict[str, set[int] | None], set[str]]]
        self._planned = {}
        """A chunk a save will store -> its event, the workers that stored it so far in
        each medium (None: never to be announced there, it was evicted first) and the
        requests whose saves store it."""
        self._by_req: dict[str, list[ChunkKey]] = {}
        self._released: OrderedDict[ChunkKey, None] = OrderedDict()
        """Planned chunks whose requests all ended, awaiting late reports (`RELEASED`)."""
        self._stored: OrderedDict[tuple[str, ChunkKey], int | bytes] = OrderedDict()
        """(medium, chunk) announced as stored -> its block hash (for `BlockRemoved`)."""
        self._events: list[KVCacheEvent] = []

    def planned(
        self,
        request: Request,
        keys: Iterable[ChunkKey],
        counts: Iterable[int],
        chunks: list[ChunkKey],
        hash_block: int,
    ) -> None:
        """A save of `request`'s chunks `keys` (holding `counts` tokens) was planned
        (`chunks`: all its chunk keys, in order; `hash_block`: the tokens of each of
        `request.block_hashes`, a divisor of the block size)."""
        index = {k: i for i, k in enumerate(chunks)}
        scale = self.block_size // hash_block
        hashes = request.block_hashes
        lora = request.lora_request
        req = request.request_id
        for key, count in zip(keys, counts, strict=True):
            i = index.get(key)
            if i is None or count < self.block_size or (i + 1) * scale > len(hashes):
                continue  # a partial block: vLLM does not hash it
            self._by_req.setdefault(req, []).append(key)
            if (entry := self._planned.get(key)) is not None:
                entry[2].add(req)  # another request's save of the same chunk
                self._released.pop(key, None)
                continue
            parent = None if i == 0 else maybe_convert_block_hash(hashes[i * scale - 1])
            start = i * self.block_size
            event = BlockStored(
                block_hashes=[maybe_convert_block_hash(hashes[(i + 1) * scale - 1])],
                parent_block_hash=parent,
                token_ids=list(request.all_token_ids[start : start + self.block_size]),
                block_size=self.block_size,
                lora_id=lora.adapter_id if lora else None,
                medium=self.media[0],
                lora_name=lora.name if lora else None,
                group_idx=self.group,
            )
            self._planned[key] = (event, {}, {req})

    def report(self, report: ChunkReport) -> None:
        """What the workers' saves and tiers did (one step's reports, merged)."""
        for key in report.unsaved:  # one shard missing: the chunk is not whole
            self._drop(key)
        for medium, by_key in report.saved.items():
            for key, ranks in by_key.items():
                self._stored_in(medium, key, ranks)
        for medium, keys in report.evicted.items():
            removed = []
            for key in keys:
                if (h := self._stored.pop((medium, key), None)) is not None:
                    removed.append(h)
                elif (entry := self._planned.get(key)) is not None:
                    entry[1][medium] = None  # gone from it before it was whole there
                    self._settle(key)
            if removed:
                self._events.append(
                    BlockRemoved(block_hashes=removed, medium=medium, group_idx=self.group)
                )

    def _stored_in(self, medium: str, key: ChunkKey, ranks: list[int]) -> None:
        """Workers `ranks` stored their shard of a chunk in `medium`: once all have, its
        `BlockStored` with that medium (once per medium)."""
        entry = self._planned.get(key)
        if entry is None:
            return
        event, done, _ = entry
        by = done.setdefault(medium, set())
        if by is None or len(by) >= self.workers:
            return  # evicted from it first, or announced
        by.update(ranks)
        if len(by) < self.workers:
            return
        self._events.append(msgspec.structs.replace(event, medium=medium))
        self._stored[(medium, key)] = event.block_hashes[0]
        self._stored.move_to_end((medium, key))
        if len(self._stored) > REMEMBERED * len(self.media):
            self._stored.popitem(last=False)
        self._settle(key)

    def _settle(self, key: ChunkKey) -> None:
        """Forget a planned chunk once every medium announced it or never will."""
        done = self._planned[key][1]
        if all((by := done.get(m, ())) is None or len(by) >= self.workers for m in self.media):
            self._drop(key)

    def _drop(self, key: ChunkKey) -> None:
        self._planned.pop(key, None)
        self._released.pop(key, None)

    def forget(self, req: str) -> None:
        """`req`'s blocks went back to vLLM. Its planned chunks stay for late reports
        (a host tier's write-back ends after that), the oldest `RELEASED` of them."""
        for key in self._by_req.pop(req, ()):
            if (entry := self._planned.get(key)) is None:
                continue
            entry[2].discard(req)
            if not entry[2]:
                self._released[key] = None
        while len(self._released) > RELEASED:
            key, _ = self._released.popitem(last=False)
            self._planned.pop(key, None)

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
