"""A bounded cache of chunks in host memory: one region allocated at start (pinned with
`cudaHostRegister` where CUDA is present: exactly its size, where torch's pinned
allocator would round up to a power of two), cut into slots of one full chunk's bytes
(every layer), and an index of which chunk each slot holds. Nothing is ever allocated
past the region: a full cache gives up a chunk its `Policy` picks, never one that is
pinned (being read or written back), and when too few chunks are free of pins it takes
no new one.

One `HostCache` per transport instance: it holds its worker's shard of each chunk (the
ranks of an engine each hold their own slice, none another's).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

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
        self.region, self._pinned = _allocate(self.slots * self.slot_bytes)
        self._free = list(range(self.slots - 1, -1, -1))
        self._index: dict[Hashable, Entry] = {}
        self._policy: Policy = POLICIES[self.policy_name](max(self.slots, 1))
        self._pins: dict[Hashable, int] = {}
        self._reserved: set[int] = set()
        self.victims: list[Hashable] | None = None
        """Set to a list by an owner that wants them: chunks evicted since it last took
        them (`take_victims`)."""

    def take_victims(self) -> list[Hashable]:
        if not self.victims:
            return []
        victims, self.victims = self.victims, []
        return victims

    def __len__(self) -> int:
        return len(self._index)

    def get(self, key: Hashable, sizes: Sequence[int] | None = None) -> Entry | None:
        """The chunk's entry, counted as read (None: not held, or held with other layer
        sizes than `sizes`)."""
        entry = self._index.get(key)
        if entry is None or (sizes is not None and entry.sizes != tuple(sizes)):
            self.counters.misses += 1
            return None
        self._policy.touch(key)
        self.counters.hits += 1
        return entry

    def room(self, n: int) -> bool:
        """Whether `n` slots can be had now (free, or holding a chunk no one pins: every
        pinned chunk is held, since a pinned chunk is never evicted)."""
        return len(self._free) + len(self._index) - len(self._pins) >= n

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
            if self.victims is not None:
                self.victims.append(victim)
        self._reserved.add(slot)
        return slot

    def commit(self, key: Hashable, slot: int, sizes: Sequence[int]) -> bool:
        """The chunk's bytes are in `slot` (reserved): index it. A chunk already held
        (another save or load of the same key: the same bytes, keys name their content)
        keeps its slot, and this one goes back (False)."""
        self._reserved.remove(slot)
        if key in self._index:
            self._free.append(slot)
            return False
        self._index[key] = Entry(slot, tuple(sizes))
        self._policy.insert(key)
        self.counters.stored += 1
        self.counters.bytes_in += sum(sizes)
        return True

    def unreserve(self, slot: int) -> None:
        """A reserved slot's write did not complete: it is free again."""
        self._reserved.remove(slot)
        self._free.append(slot)

    def pin(self, key: Hashable) -> None:
        """Keep a held chunk from eviction until as many `unpin`s."""
        assert key in self._index
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: Hashable) -> None:
        if (left := self._pins.pop(key) - 1) > 0:
            self._pins[key] = left

    def close(self) -> None:
        """Unpin the region (it is freed with the cache)."""
        _unpin(self._pinned)
        self._pinned = 0

    def view(self, slot: int) -> memoryview:
        """The slot's bytes."""
        return self.region[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]


def _allocate(nbytes: int) -> tuple[memoryview, int]:
    """The cache's region, and its address if it was pinned (`cudaHostRegister`, where
    CUDA is present: copies to and from a GPU then need no staging of their own); else
    plain pages. Every page is touched here, so saves do not fault them in."""
    buf = np.empty(nbytes, np.uint8)
    buf[:: mmap.PAGESIZE] = 0  # every page now, not under the first saves
    pinned = 0
    try:
        import torch

        if nbytes and torch.cuda.is_available():
            address = int(buf.ctypes.data)
            rc = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister returned {rc}")
            pinned = address
    except Exception as exc:  # no pinned memory to spare: plain pages still serve
        log.warning("kvflow host tier: %d bytes not pinned (%s)", nbytes, exc)
    return buf.data.cast("B"), pinned


def _unpin(address: int) -> None:
    if address:
        import torch

        torch.cuda.cudart().cudaHostUnregister(address)
