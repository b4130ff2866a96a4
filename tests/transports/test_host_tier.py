"""The host-memory tier (`kvflow.tiers`, `cpu_cache_gib`) in front of real `fs` stores:
the conformance suite, saves that give vLLM its blocks back before the store has them,
loads from host memory and promotion, the memory bound and pins, and the policies."""

from __future__ import annotations

import hashlib
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from kvflow.geometry.layout import KVLayout
from kvflow.observe.events import TierRead, TierWrite
from kvflow.testing.conformance import TransportConformance
from kvflow.testing.layouts import fill_blocks, make_layout
from kvflow.tiers import LRU, S3FIFO, HostCache, HostTier, with_host_tier
from kvflow.transport import (
    ChunkMissing,
    LoadJob,
    SaveJob,
    Transport,
    TransportContext,
    TransportError,
)
from kvflow_fs import FsOptions, FsTransport

MiB = 1 << 20


class TestHostTierConformance(TransportConformance):
    """The tier keeps every promise of the transport it fronts."""

    @pytest.fixture
    def make_transport(self, tmp_path: Path) -> Callable[[TransportContext], Transport]:
        def make(context: TransportContext) -> Transport:
            fs = FsTransport(FsOptions(path=str(tmp_path / "store")), context)
            return with_host_tier(fs, 4 * MiB, "s3fifo") if context.role == "worker" else fs

        return make


class GatedFs(FsTransport):
    """fs whose saves wait for `gate` before writing."""

    gate: trio.Event
    arrived = 0
    _arrival: trio.Event | None = None

    async def save(self, job: SaveJob) -> None:
        self.arrived += 1
        if self._arrival is not None:
            self._arrival.set()
        await self.gate.wait()
        await super().save(job)

    async def arrivals(self, n: int) -> None:
        """Until `n` saves have reached the gate (a host tier's copy runs in a thread:
        `wait_all_tasks_blocked` would not wait for it)."""
        with trio.fail_after(30):
            while self.arrived < n:
                self._arrival = trio.Event()
                await self._arrival.wait()


class StuckTouchFs(FsTransport):
    """fs whose `touch` records its keys, then hangs (`hang`) or raises."""

    hang = True
    touched: list[list[str]]

    async def touch(self, keys: Sequence[str]) -> None:
        self.touched.append(list(keys))
        if self.hang:
            await trio.sleep_forever()
        raise TransportError("the store is unreachable")


def ctx(kv: KVLayout | None, role: str = "worker") -> TransportContext:
    return TransportContext("e", role, "ns", "tp0of1pp0", ["tp0of1pp0"], kv)


def kv_layout() -> KVLayout:
    return make_layout(num_layers=3, num_blocks=16, block_size=4, heads=2)


def slot_bytes(kv: KVLayout) -> int:
    """A full chunk's bytes over every layer: one slot of the tier."""
    return sum(kv.geometries[i].chunk_nbytes(4) for i in range(kv.num_layers))


async def opened(t: Transport, kv: KVLayout | None) -> Transport:
    await t.open()
    if kv is not None:
        await t.register(kv)
    return t


def k(name: str) -> str:
    """A chunk key (32 hex characters) for a short name."""
    return hashlib.md5(name.encode()).hexdigest()


def save_job(kv: KVLayout, names: list[str], blocks: list[int], released: list[str]) -> SaveJob:
    keys = [k(n) for n in names]

    async def spans(layer: int) -> list[list[memoryview]]:
        return [kv.spans(layer, b, 4) for b in blocks]

    return SaveJob("r", keys, [4] * len(keys), kv.num_layers, spans, lambda: released.append("r"))


def load_job(kv: KVLayout, names: list[str], blocks: list[int]) -> LoadJob:
    keys = [k(n) for n in names]
    return LoadJob(
        "r", keys, [4] * len(keys), kv.num_layers,
        lambda i: [kv.spans(i, b, 4) for b in blocks], lambda _: None, None, blocks,
    )  # fmt: skip


def blocks_bytes(kv: KVLayout, blocks: list[int]) -> list[bytes]:
    return [b"".join(bytes(s) for b in blocks for s in kv.spans(i, b, 4)) for i in range(3)]


async def test_a_save_gives_the_blocks_back_before_the_store_has_them(tmp_path: Path) -> None:
    kv = kv_layout()
    fill_blocks(kv, [1, 2], seed=1)
    events: list[Any] = []
    fs = GatedFs(FsOptions(path=str(tmp_path)), ctx(kv))
    fs.context.tier_event = events.append
    fs.gate = trio.Event()
    tier = await opened(with_host_tier(fs, 4 * MiB, "s3fifo"), kv)
    scheduler = await opened(
        FsTransport(FsOptions(path=str(tmp_path)), ctx(None, "scheduler")), None
    )
    released: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tier.save, save_job(kv, ["a", "b"], [1, 2], released))
        await fs.arrivals(1)  # the write-back reached the store
        assert released == ["r"], "the blocks went back once the bytes were in host memory"
        assert await scheduler.lookup([k("a"), k("b")]) == 0, "the store does not have them yet"
        want = blocks_bytes(kv, [1, 2])
        fill_blocks(kv, [1, 2], seed=9)  # vLLM reuses the blocks
        fs.gate.set()
    assert await scheduler.lookup([k("a"), k("b")]) == 2
    other = await opened(FsTransport(FsOptions(path=str(tmp_path)), ctx(kv)), kv)
    await other.load(load_job(kv, ["a", "b"], [5, 6]))
    assert blocks_bytes(kv, [5, 6]) == want, "the store got the bytes saved, not vLLM's later ones"
    for t in (tier, scheduler, other):
        await t.aclose()


@pytest.mark.parametrize("hang", [True, False])
async def test_the_store_hears_of_cache_hits_without_holding_or_failing_the_load(
    tmp_path: Path, hang: bool
) -> None:
    """Issue 50, item 0: chunks served from the cache count as used in the store
    (`touch`), from a task of its own: a store that hangs or fails on it neither holds
    up the load (a forward waits for it) nor fails it."""
    kv = kv_layout()
    fill_blocks(kv, [1, 2], seed=3)
    want = blocks_bytes(kv, [1, 2])
    fs = StuckTouchFs(FsOptions(path=str(tmp_path)), ctx(kv))
    fs.hang, fs.touched = hang, []
    tier = await opened(with_host_tier(fs, 4 * MiB, "lru"), kv)
    await tier.save(save_job(kv, ["a", "b"], [1, 2], []))
    with trio.fail_after(30):  # a hang guard, not a timing check
        await tier.load(load_job(kv, ["a", "b"], [5, 6]))
        await trio.testing.wait_all_tasks_blocked()
    assert blocks_bytes(kv, [5, 6]) == want
    assert fs.touched == [[k("a"), k("b")]]
    await tier.aclose()


async def test_loads_come_from_host_memory_and_misses_are_promoted(tmp_path: Path) -> None:
    kv = kv_layout()
    fill_blocks(kv, [1, 2, 3], seed=2)
    want = blocks_bytes(kv, [1, 2, 3])
    plain = await opened(FsTransport(FsOptions(path=str(tmp_path)), ctx(kv)), kv)
    await plain.save(save_job(kv, ["c"], [3], []))  # saved by another engine: the store's
    events: list[Any] = []
    tiered_ctx = ctx(kv)
    tiered_ctx.tier_event = events.append
    tier = await opened(
        with_host_tier(FsTransport(FsOptions(path=str(tmp_path)), tiered_ctx), 4 * MiB, "lru"), kv
    )
    await tier.save(save_job(kv, ["a", "b"], [1, 2], []))
    await tier.load(load_job(kv, ["a", "b", "c"], [7, 8, 9]))
    assert blocks_bytes(kv, [7, 8, 9]) == want
    for fs in (plain, tier.inner):  # no bookkeeping of theirs writes into it meanwhile
        await fs.chores_done()  # type: ignore[attr-defined]
    shutil.rmtree(tmp_path)  # the store is gone: what the tier holds still loads
    await tier.load(load_job(kv, ["a", "b", "c"], [10, 11, 12]))
    assert blocks_bytes(kv, [10, 11, 12]) == want
    reads = [(e.hits, e.misses, e.promoted) for e in events if isinstance(e, TierRead)]
    assert reads == [(2, 1, 1), (3, 0, 0)]
    (write,) = [e for e in events if isinstance(e, TierWrite)]
    assert (write.stored, write.through, write.evicted) == (2, 0, 0)
    with pytest.raises(ChunkMissing) as info:
        await tier.load(load_job(kv, ["a", "d"], [13, 14]))
    assert info.value.chunk == 1, "the chunk the store lacks, numbered as in the job"
    await tier.aclose()
    await plain.aclose()


async def test_the_cache_never_holds_more_than_its_bound_and_keeps_pinned_chunks(
    tmp_path: Path,
) -> None:
    kv = kv_layout()
    slot = slot_bytes(kv)
    events: list[Any] = []
    fs = GatedFs(FsOptions(path=str(tmp_path)), ctx(kv))
    fs.context.tier_event = events.append
    fs.gate = trio.Event()
    tier = await opened(with_host_tier(fs, 3 * slot + slot // 2, "s3fifo"), kv)
    assert isinstance(tier, HostTier) and tier.cache is not None
    cache = tier.cache
    assert cache.slots == 3 and len(cache.region) == 3 * slot, "the bound, allocated once"
    fill_blocks(kv, list(range(16)), seed=3)
    released: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tier.save, save_job(kv, ["p", "q", "r"], [0, 1, 2], released))
        await fs.arrivals(1)  # three chunks pinned, writing back
        assert released == ["r"] and len(cache) == 3
        nursery.start_soon(tier.save, save_job(kv, ["s"], [3], released))
        await fs.arrivals(2)
        assert released == ["r"], "no slot free of pins: this save writes through"
        assert {n for n in ("p", "q", "r") if cache.get(k(n))} == {"p", "q", "r"}
        fs.gate.set()
    assert released == ["r"], "the save written through never gave its blocks back early"
    for i in range(4, 14):  # many more chunks than slots
        await tier.save(save_job(kv, [f"k{i}"], [i], []))
        assert len(cache) <= 3
    assert cache.counters.evicted >= 10 - 3
    writes = [e for e in events if isinstance(e, TierWrite)]
    assert sum(e.evicted for e in writes) == cache.counters.evicted, "every eviction reported"
    assert [e.through for e in writes] == [0, 1] + [0] * 10, "'s' was written through"
    await tier.aclose()


class FailingFs(FsTransport):
    """fs whose loads fail at once, naming their first chunk (as a store that lost its
    connection does)."""

    async def load(self, job: LoadJob) -> None:
        raise ChunkMissing("the store is gone", chunk=0)


async def test_a_store_that_fails_at_once_leaves_the_cached_chunks_before_it_whole(
    tmp_path: Path,
) -> None:
    """Chunk 0 from the cache, chunk 1 from a store that fails before anything: the
    error names chunk 1, so chunk 0 must be whole in every layer (vLLM keeps it)."""
    kv = kv_layout()
    fill_blocks(kv, [1], seed=2)
    want = blocks_bytes(kv, [1])
    tier = await opened(
        with_host_tier(FailingFs(FsOptions(path=str(tmp_path)), ctx(kv)), 4 * MiB, "lru"), kv
    )
    await tier.save(save_job(kv, ["a"], [1], []))
    fill_blocks(kv, [13, 14], seed=7)
    with pytest.raises(ChunkMissing) as info:
        await tier.load(load_job(kv, ["a", "d"], [13, 14]))
    assert info.value.chunk == 1
    assert blocks_bytes(kv, [13]) == want, "every layer of the cached chunk landed"
    await tier.aclose()


async def test_a_save_larger_than_the_room_left_writes_through_and_evicts_nothing(
    tmp_path: Path,
) -> None:
    kv = kv_layout()
    slot = slot_bytes(kv)
    tier = await opened(
        with_host_tier(FsTransport(FsOptions(path=str(tmp_path)), ctx(kv)), 4 * slot, "s3fifo"), kv
    )
    assert isinstance(tier, HostTier) and tier.cache is not None
    fill_blocks(kv, list(range(9)), seed=4)
    await tier.save(save_job(kv, ["a", "b", "c", "d"], [0, 1, 2, 3], []))
    released: list[str] = []
    await tier.save(save_job(kv, ["e", "f", "g", "h", "i"], [4, 5, 6, 7, 8], released))
    assert released == [] and tier.cache.counters.evicted == 0
    assert all(tier.cache.get(k(n)) for n in "abcd"), "the four cached chunks stay"
    assert await tier.lookup([k(n) for n in "efghi"]) == 5, "the store has the big save"
    await tier.aclose()


def test_s3fifo_keeps_hot_prefixes_through_a_scan_where_lru_loses_them() -> None:
    """A few hot keys read again and again, then a scan of one-off keys as long as the
    cache: S3-FIFO keeps the hot keys in its main queue, LRU gives them up."""
    kept = {}
    for name, policy in (("s3fifo", S3FIFO(100)), ("lru", LRU(100))):
        cache = HostCache(100, 1, name)
        cache._policy = policy
        for key in range(10):
            cache.commit(key, cache.reserve() or 0, [1])
        for _ in range(3):
            for key in range(10):
                assert cache.get(key) is not None
        for key in range(1000, 1100):
            slot = cache.reserve()
            assert slot is not None
            cache.commit(key, slot, [1])
        kept[name] = sum(cache.get(k) is not None for k in range(10))
    assert kept == {"s3fifo": 10, "lru": 0}


@pytest.mark.parametrize("policy", [S3FIFO, LRU])
def test_a_policy_never_gives_up_a_pinned_key_and_ends_when_all_are(policy: type) -> None:
    p = policy(8)
    rng = random.Random(5)
    held: set[int] = set()
    for step in range(2000):
        key = rng.randrange(40)
        if key in held:
            p.touch(key)
            continue
        if len(p) == 8:
            pinned = set(rng.sample(sorted(held), 3))
            victim = p.victim(lambda k, pinned=pinned: k in pinned)  # type: ignore[misc]
            assert victim in held and victim not in pinned, step
            held.remove(victim)
        p.insert(key)
        held.add(key)
    assert p.victim(lambda k: True) is None
    assert len(p) == 8
