"""kvflow's saves and evictions on vLLM's KV event stream (`--kv-events-config`).

A router that places requests where their prefix is cached (llm-d, NVIDIA Dynamo)
reads vLLM's `BlockStored` / `BlockRemoved` events. kvflow adds its own, with the
engine's own block hashes and `medium="kvflow:<transport>"`, so a router can tell a
block kvflow's store holds from one in vLLM's cache:

- `BlockStored` once every worker (tensor x pipeline parallel rank) stored a block's
  chunk; a chunk kvflow stores is one vLLM block (a partial last block has no vLLM
  hash and no event);
- `BlockRemoved` when the store deleted one of those chunks to make room.

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

from kvflow.keys import ChunkKey
from kvflow.worker import ChunkOutcomes

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["ChunkReport", "KVEventTracker", "KVFlowWorkerMeta", "events_enabled"]

REMEMBERED = 1 << 18
"""Stored blocks remembered for their `BlockRemoved` (the oldest are forgotten first:
~50 MB; a block forgotten and later evicted gets no `BlockRemoved`)."""


def events_enabled(vllm_config: Any) -> bool:
    kec = getattr(vllm_config, "kv_events_config", None)
    return bool(kec is not None and kec.enable_kv_cache_events)


class ChunkReport(msgspec.Struct, array_like=True):
    """One KV cache group's chunk outcomes, merged over workers."""

    saved: dict[str, list[int]] = {}
    """Key -> the workers (shard ranks) that stored their shard of it."""
    unsaved: list[str] = []
    evicted: list[str] = []

    @classmethod
    def of(cls, outcomes: ChunkOutcomes | None, rank: int) -> ChunkReport:
        if outcomes is None:
            return cls()
        return cls({k: [rank] for k in outcomes.saved}, outcomes.unsaved, outcomes.evicted)

    def merge(self, other: ChunkReport) -> ChunkReport:
        saved = dict(self.saved)
        for key, ranks in other.saved.items():
            saved[key] = saved.get(key, []) + ranks
        return ChunkReport(saved, self.unsaved + other.unsaved, self.evicted + other.evicted)

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
    workers' reports, the events ready for vLLM to publish."""

    def __init__(self, *, medium: str, block_size: int, workers: int, group: int) -> None:
        self.medium = medium
        self.block_size = block_size
        self.workers = workers
        self.group = group
        self._planned: dict[ChunkKey, tuple[BlockStored, set[int], set[str]]] = {}
        """A chunk a save will store -> its event, the workers that stored it so far and
        the requests whose saves store it."""
        self._stored: OrderedDict[ChunkKey, int | bytes] = OrderedDict()
        """Chunks announced as stored -> their block hash (for `BlockRemoved`)."""
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
            if (entry := self._planned.get(key)) is not None:
                entry[2].add(req)  # another request's save of the same chunk
                continue
            parent = None if i == 0 else maybe_convert_block_hash(hashes[i * scale - 1])
            start = i * self.block_size
            event = BlockStored(
                block_hashes=[maybe_convert_block_hash(hashes[(i + 1) * scale - 1])],
                parent_block_hash=parent,
                token_ids=list(request.all_token_ids[start : start + self.block_size]),
                block_size=self.block_size,
                lora_id=lora.adapter_id if lora else None,
                medium=self.medium,
                lora_name=lora.name if lora else None,
                group_idx=self.group,
            )
            self._planned[key] = (event, set(), {req})

    def report(self, report: ChunkReport) -> None:
        """What the workers' saves and stores did (one step's reports, merged)."""
        for key in report.unsaved:  # one shard missing: the chunk is not whole
            self._planned.pop(key, None)
        for key, ranks in report.saved.items():
            entry = self._planned.get(key)
            if entry is None:
                continue
            event, done, _ = entry
            done.update(ranks)
            if len(done) < self.workers:
                continue
            del self._planned[key]
            self._events.append(event)
            self._stored[key] = event.block_hashes[0]
            self._stored.move_to_end(key)
            if len(self._stored) > REMEMBERED:
                self._stored.popitem(last=False)
        removed = [h for key in report.evicted if (h := self._stored.pop(key, None)) is not None]
        if removed:
            self._events.append(
                BlockRemoved(block_hashes=removed, medium=self.medium, group_idx=self.group)
            )

    def forget(self, req: str) -> None:
        """`req`'s saves are over (its blocks went back to vLLM): what they did not
        store is not coming."""
        for key in [k for k, (_, _, reqs) in self._planned.items() if req in reqs]:
            reqs = self._planned[key][2]
            reqs.discard(req)
            if not reqs:
                del self._planned[key]

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
