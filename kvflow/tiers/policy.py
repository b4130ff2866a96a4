"""Which chunk a full host-memory tier gives up: `LRU`, or `S3FIFO` (Yang et al., SOSP
2023: a small FIFO that new keys enter, a main FIFO for keys used again, and a ghost
FIFO of keys recently dropped from the small one). A prefix cache sees scans (one-off
prompts, each chunk saved once and never read again) next to a few hot prefixes; S3-FIFO
lets a scan pass through the small queue without pushing the hot prefixes out, where LRU
would (bench/bench_tier.py replays a trace of both; docs/benchmarks.md).

A policy holds keys only. The tier asks it for a victim, passing the keys it must not
give up now (a chunk being written back or read).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

__all__ = ["LRU", "POLICIES", "S3FIFO", "Policy"]


class Policy(Protocol):
    """A set of at most `capacity` keys and the order in which they go."""

    def __len__(self) -> int: ...
    def __contains__(self, key: Hashable) -> bool: ...
    def insert(self, key: Hashable) -> None:
        """Add `key` (not held; the caller made room with `victim`)."""

    def touch(self, key: Hashable) -> None:
        """`key` (held) was read."""

    def remove(self, key: Hashable) -> None:
        """Forget `key` (held)."""

    def victim(self, pinned: Callable[[Hashable], bool]) -> Hashable | None:
        """Remove and return the key to give up next, skipping pinned ones; None when
        every held key is pinned."""


class LRU:
    """Least recently inserted or read goes first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def insert(self, key: Hashable) -> None:
        self._keys[key] = None

    def touch(self, key: Hashable) -> None:
        self._keys.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._keys[key]

    def victim(self, pinned: Callable[[Hashable], bool]) -> Hashable | None:
        for key in self._keys:
            if not pinned(key):
                del self._keys[key]
                return key
        return None


class S3FIFO:
    """S3-FIFO: keys enter a small FIFO (`small_share` of the capacity); a key read while there
    moves to the main FIFO when it reaches the head, one never read is dropped and
    remembered in a ghost FIFO; a key inserted again while remembered goes to the main
    FIFO directly. The main FIFO gives a key read since it last passed the head another
    round (its count, at most 3, goes down by one) and drops one that was not.

    The paper's small queue is a tenth of the cache. A prefix cache's chunks are read
    again a conversation turn later, often past a tenth of the cache: replaying
    Mooncake's conversation trace, a tenth lost to LRU at caches of 10-25 % of its
    chunks; half beats LRU at 2-10 % (0.114 against 0.079 at 2 %) and trails it by
    0.008 at 25 %, stays within 0.01 of it on Mooncake's synthetic trace, and beats it
    where one-off documents pass through (bench/bench_tier.py; docs/benchmarks.md)."""

    def __init__(self, capacity: int, small_share: float = 0.5) -> None:
        self.capacity = capacity
        self.small_cap = max(1, int(capacity * small_share))
        self._small: OrderedDict[Hashable, int] = OrderedDict()
        self._main: OrderedDict[Hashable, int] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._small or key in self._main

    def insert(self, key: Hashable) -> None:
        if key in self._ghost:  # dropped from the small queue lately: used again
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0

    def touch(self, key: Hashable) -> None:
        queue = self._small if key in self._small else self._main
        queue[key] = min(queue[key] + 1, 3)

    def remove(self, key: Hashable) -> None:
        if self._small.pop(key, None) is None:
            del self._main[key]

    def victim(self, pinned: Callable[[Hashable], bool]) -> Hashable | None:
        first_small = len(self._small) >= self.small_cap or not self._main
        for evict in (self._from_small, self._from_main)[:: 1 if first_small else -1]:
            if (key := evict(pinned)) is not None:
                return key
        return None

    def _from_small(self, pinned: Callable[[Hashable], bool]) -> Hashable | None:
        """The small queue's first key never read since it came (to the ghost queue);
        those read on the way move to the main queue, pinned ones wait a round."""
        for _ in range(len(self._small)):
            key, reads = self._small.popitem(last=False)
            if pinned(key):
                self._small[key] = reads
            elif reads:
                self._main[key] = 0
            else:
                self._ghost[key] = None
                if len(self._ghost) > self.capacity:
                    self._ghost.popitem(last=False)
                return key
        return None

    def _from_main(self, pinned: Callable[[Hashable], bool]) -> Hashable | None:
        """The main queue's first key not read since its last round; each key passes at
        most four times (its count goes down each time), pinned ones wait."""
        for _ in range(4 * len(self._main) + 1):
            if not self._main:
                break
            key, reads = self._main.popitem(last=False)
            if pinned(key):
                self._main[key] = reads
            elif reads:
                self._main[key] = reads - 1
            else:
                return key
        return None


POLICIES: dict[str, Callable[[int], Policy]] = {"s3fifo": S3FIFO, "lru": LRU}
"""By the name `cpu_cache_policy` takes."""
