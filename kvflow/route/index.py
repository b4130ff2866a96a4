"""Which instance holds which prompt prefix, and in which medium: an index built from the
instances' KV events (`kvflow.route.events`), asked with a prompt's token ids.

Blocks are keyed by a chain hash over their token ids (BLAKE2b-128 of the parent's key and
the block's tokens, from a root naming the block size and LoRA adapter), computed the same
way from an event's `token_ids` and from a prompt: the router needs neither vLLM's hash
function nor its seed (`PYTHONHASHSEED`, `--prefix-caching-hash-algo`), and instances
with different ones still agree. vLLM's own hashes are kept per instance only to follow
its `BlockRemoved` events and the parent of a stored run.

Blocks whose vLLM key holds more than the adapter (multimodal inputs, a `cache_salt`,
prompt embeddings) and blocks of other KV cache groups than the first are not indexed: a
request that needs them is routed by load alone. The index holds at most `max_blocks`
blocks and forgets the least recently stored first.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from hashlib import blake2b

from .events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

__all__ = [
    "MAX_BLOCKS",
    "MEDIUM_WEIGHTS",
    "STORE_WEIGHT",
    "IndexStats",
    "Match",
    "PrefixIndex",
    "block_key",
    "prompt_keys",
    "root_key",
    "weight",
]

GPU = "GPU"
MEDIUM_WEIGHTS = {GPU: 1.0, "CPU": 0.8, "kvflow:cpu": 0.8}
"""How much a block held in a medium is worth to a request: vLLM's GPU cache most, host
memory (vLLM's CPU offloading, kvflow's host tier) next; any other (a kvflow store,
`kvflow:fs`, `STORAGE`) `STORE_WEIGHT`."""
STORE_WEIGHT = 0.5
MAX_BLOCKS = 1 << 20
"""Blocks indexed by default (about 0.3 GB with two instances each)."""
MAX_LORAS = 4096


def weight(medium: str) -> float:
    return MEDIUM_WEIGHTS.get(medium, STORE_WEIGHT)


def root_key(block_size: int, lora: str | None) -> bytes:
    return blake2b(f"kvflow route|{block_size}|{lora or ''}".encode(), digest_size=16).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return blake2b(parent + array("I", tokens).tobytes(), digest_size=16).digest()


def prompt_keys(tokens: Sequence[int], block_size: int, lora: str | None) -> list[bytes]:
    """The keys of each full block of a prompt."""
    keys, parent = [], root_key(block_size, lora)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass
class Match:
    tokens: int = 0
    """Tokens of the prompt's leading full blocks the instance holds, in any medium."""
    weighted: float = 0.0
    """Those tokens, each block's by its best medium's `weight`."""


@dataclass
class IndexStats:
    blocks: int = 0
    stored: int = 0
    removed: int = 0
    skipped: int = 0
    """Blocks of events not indexed: another KV cache group, extra keys, an unknown parent."""
    evicted: int = 0
    """Blocks forgotten for the memory bound."""


class PrefixIndex:
    """Block key -> the instances holding it, with their media. Thread-safe."""

    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, not {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, dict[str, set[str]]] = OrderedDict()
        self._theirs: dict[str, OrderedDict[BlockHash, bytes]] = {}
        """Per instance: vLLM's hash of each block it announced -> its key."""
        self.block_sizes: set[int] = set()
        self.loras: set[str] = set()
        """Adapter names blocks were stored under (a request's `model` among them names one)."""
        self.stats = IndexStats()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, instance: str, events: Iterable[Event]) -> None:
        with self._lock:
            for event in events:
                if isinstance(event, BlockStored):
                    self._stored(instance, event)
                elif isinstance(event, BlockRemoved):
                    self._removed(instance, event)
                elif isinstance(event, AllBlocksCleared):
                    self._drop(instance, GPU)
            self.stats.blocks = len(self._blocks)

    def forget(self, instance: str) -> None:
        """Everything `instance` announced (it restarted, lost events, or is gone)."""
        with self._lock:
            self._drop(instance, None)
            self._theirs.pop(instance, None)
            self.stats.blocks = len(self._blocks)

    def match(self, tokens: Sequence[int], lora: str | None) -> dict[str, Match]:
        """Per instance, the leading blocks of `tokens` it holds (instances holding none
        are left out), at each block size an instance announced."""
        with self._lock:
            sizes = sorted(self.block_sizes)
        out: dict[str, Match] = {}
        for size in sizes:
            keys = prompt_keys(tokens, size, lora)
            with self._lock:
                found = self._match(keys)
            for name, m in found.items():
                if name not in out or m.weighted * size > out[name].weighted:
                    out[name] = Match(m.tokens * size, m.weighted * size)
        return out

    def _match(self, keys: list[bytes]) -> dict[str, Match]:
        found: dict[str, Match] = {}
        alive: set[str] | None = None
        for key in keys:
            entry = self._blocks.get(key)
            if not entry:
                break
            alive = set(entry) if alive is None else alive & entry.keys()
            if not alive:
                break
            for name in alive:
                m = found.setdefault(name, Match())  # in blocks: `match` makes them tokens
                m.tokens += 1
                m.weighted += max(weight(medium) for medium in entry[name])
        return found

    def _stored(self, instance: str, event: BlockStored) -> None:
        n = len(event.block_hashes)
        if event.group_idx not in (None, 0) or not _plain(event):
            self.stats.skipped += n
            return
        theirs = self._theirs.setdefault(instance, OrderedDict())
        size = event.block_size
        if event.parent_block_hash is None:
            parent = root_key(size, event.lora_name)
        elif (known := theirs.get(event.parent_block_hash)) is not None:
            parent = known
        else:
            self.stats.skipped += n
            return
        self.block_sizes.add(size)
        if event.lora_name and len(self.loras) < MAX_LORAS:
            self.loras.add(event.lora_name)
        medium = event.medium or GPU
        for i, h in enumerate(event.block_hashes):
            parent = block_key(parent, event.token_ids[i * size : (i + 1) * size])
            theirs[h] = parent
            theirs.move_to_end(h)
            self._blocks.setdefault(parent, {}).setdefault(instance, set()).add(medium)
            self._blocks.move_to_end(parent)
        self.stats.stored += n
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            self.stats.evicted += 1
        while len(theirs) > self.max_blocks:
            theirs.popitem(last=False)

    def _removed(self, instance: str, event: BlockRemoved) -> None:
        theirs: dict[BlockHash, bytes] = self._theirs.get(instance, {})
        medium = event.medium or GPU
        for h in event.block_hashes:
            key = theirs.get(h)
            entry = self._blocks.get(key) if key is not None else None
            held = entry.get(instance) if entry else None
            if entry is None or held is None:
                continue
            held.discard(medium)
            self.stats.removed += 1
            if not held:
                del entry[instance]
            if not entry:
                del self._blocks[key]  # type: ignore[arg-type]

    def _drop(self, instance: str, medium: str | None) -> None:
        """`instance`'s blocks in `medium` (None: in every medium)."""
        for key in [k for k, e in self._blocks.items() if instance in e]:
            entry = self._blocks[key]
            if medium is not None:
                entry[instance].discard(medium)
            if medium is None or not entry[instance]:
                del entry[instance]
            if not entry:
                del self._blocks[key]


def _plain(event: BlockStored) -> bool:
    """Whether the blocks' vLLM keys hold nothing but their tokens and adapter."""
    if not event.extra_keys:
        return True
    lora = [event.lora_name] if event.lora_name else []
    return all(e is None or list(e) == lora for e in event.extra_keys)
