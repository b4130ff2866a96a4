"""A bounded cache of chunks in host memory: one region allocated at start (pinned when
CUDA is present), cut into slots of one full chunk's bytes (every layer), and an index
of which chunk each slot holds. Nothing is ever allocated past the region: a full cache
gives up a chunk its `Policy` picks, never one that is pinned (being read or written
back), and when every chunk is pinned it takes no new one.

One `HostCache` per transport instance: it holds its worker's shard of each chunk (the
ranks of an engine each hold their own slice, none another's).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .policy import POLICIES, Policy

__all__ = ["Entry", "HostCache", "TierCounters"]

log = logging.getLogger("kvflow.tiers")


@dataclass(frozen=True)
class Entry:
    """Where a chunk lies: its slot and each layer's bytes (in order from the slot's
    start)."""

    slot: int
    sizes: tuple[int, ...]


@dataclass
class TierCounters:
    """What a tier did since it started."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    evicted: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class HostCache:
    """Slots of `slot_bytes` in a region of at most `nbytes`."""

    nbytes: int
    slot_bytes: int
    policy_name: str = "s3fifo"
    counters: TierCounters = field(default_factory=TierCounters)

    def __post_init__(self) -> None:
        self.slots = self.nbytes // self.slot_bytes if self.slot_bytes else 0
        self.region = _allocate(self.slots * self.slot_bytes)
        self._free = list(range(self.slots - 1, -1, -1))
        self._index: dict[Hashable, Entry] = {}
        self._policy: Policy = POLICIES[self.policy_name](max(self.slots, 1))
        self._pins: dict[Hashable, int] = {}
        self._reserved: set[int] = set()

    def __len__(self) -> int:
        return len(self._index)

    def get(self, key: Hashable) -> Entry | None:
        """The chunk's entry, counted as read (None: not held)."""
        entry = self._index.get(key)
        if entry is None:
            self.counters.misses += 1
            return None
        self._policy.touch(key)
        self.counters.hits += 1
        return entry

    def entry(self, key: Hashable) -> Entry:
        """A held chunk's entry (not counted as read)."""
        return self._index[key]

    def reserve(self) -> int | None:
        """A slot to write a chunk into (a free one, else one given up by the policy);
        None when every held chunk is pinned."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = self._policy.victim(lambda k: k in self._pins)
            if victim is None:
                return None
            slot = self._index.pop(victim).slot
            self.counters.evicted += 1
        self._reserved.add(slot)
        return slot

    def commit(self, key: Hashable, slot: int, sizes: Sequence[int]) -> None:
        """The chunk's bytes are in `slot` (reserved): index it. A chunk already held
        (another save of the same bytes) keeps its slot; this one goes back."""
        self._reserved.remove(slot)
        if key in self._index:
            self._free.append(slot)
            return
        self._index[key] = Entry(slot, tuple(sizes))
        self._policy.insert(key)
        self.counters.stored += 1
        self.counters.bytes_in += sum(sizes)

    def unreserve(self, slot: int) -> None:
        """A reserved slot's write did not complete: it is free again."""
        self._reserved.remove(slot)
        self._free.append(slot)

    def pin(self, key: Hashable) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: Hashable) -> None:
        if (left := self._pins.pop(key) - 1) > 0:
            self._pins[key] = left

    def view(self, slot: int) -> memoryview:
        """The slot's bytes."""
        return self.region[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]


def _allocate(nbytes: int) -> memoryview:
    """The cache's region: pinned host memory where CUDA is present (copies to and from
    a GPU then need no staging of their own), else plain pages (touched on first use)."""
    buf: Any
    try:
        import torch

        if torch.cuda.is_available():
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        else:
            buf = np.empty(nbytes, np.uint8)
    except Exception as exc:  # no pinned memory to spare: plain pages still serve
        log.warning("kvflow host tier: %d bytes of pinned memory not available (%s)", nbytes, exc)
        buf = np.empty(nbytes, np.uint8)
    return memoryview(buf).cast("B")
