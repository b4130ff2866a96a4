"""Stores one below another (`kvflow.tiers.stacked`, the `tiers` option): the whole store
conformance suite on `fs` over `fs` (and under the host-memory tier), loads split
between the tiers with what came from below promoted, and a lower tier that fails."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from kvflow.geometry.layout import KVLayout
from kvflow.observe.events import TierRead
from kvflow.testing.conformance import TransportConformance
from kvflow.testing.layouts import fill_blocks, make_layout
from kvflow.tiers import StackedStore, stack_of, stacked, with_host_tier
from kvflow.transport import LoadJob, SaveJob, Transport, TransportContext, TransportError
from kvflow_fs import FsOptions, FsTransport

pytestmark = pytest.mark.trio


def _fs(path: Path, context: TransportContext) -> FsTransport:
    return FsTransport(FsOptions(path=str(path)), context)


class TestFsOverFsConformance(TransportConformance):
    @pytest.fixture
    def make_transport(self, tmp_path: Path) -> Callable[[TransportContext], Transport]:
        def make(context: TransportContext) -> Transport:
            return stacked([_fs(tmp_path / "upper", context), _fs(tmp_path / "lower", context)])

        return make


class TestHostTierOverFsOverFsConformance(TransportConformance):
    @pytest.fixture
    def make_transport(self, tmp_path: Path) -> Callable[[TransportContext], Transport]:
        def make(context: TransportContext) -> Transport:
            store = stacked([_fs(tmp_path / "up", context), _fs(tmp_path / "down", context)])
            return with_host_tier(store, 4 << 20, "s3fifo") if context.role == "worker" else store

        return make


def _layout() -> KVLayout:
    return make_layout(num_layers=3, num_blocks=32, block_size=4, block_granular=False)


def _context(layout: KVLayout | None = None) -> TransportContext:
    return TransportContext("e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout=layout)


def _save(layout: KVLayout, keys: list[str], blocks: list[int]) -> SaveJob:
    async def spans(i: int) -> list[list[memoryview]]:
        return layout.chunk_spans(i, blocks, [4] * len(blocks))

    return SaveJob("r", keys, [4] * len(keys), layout.num_layers, spans)


def _load(layout: KVLayout, keys: list[str], blocks: list[int], seen: list[int]) -> LoadJob:
    return LoadJob(
        "r", keys, [4] * len(keys), layout.num_layers,
        lambda i: layout.chunk_spans(i, blocks, [4] * len(blocks)), seen.append,
    )  # fmt: skip


def _bytes(layout: KVLayout, blocks: list[int]) -> list[bytes]:
    return [
        bytes(s) for i in range(layout.num_layers) for b in blocks for s in layout.spans(i, b, 4)
    ]


async def _opened(t: Transport, layout: KVLayout) -> Transport:
    await t.open()
    await t.register(layout)
    return t


async def test_a_load_takes_what_the_upper_tier_holds_and_promotes_the_rest(
    tmp_path: Path,
) -> None:
    layout = _layout()
    fill_blocks(layout, [0, 1, 2, 3], seed=1)
    want = _bytes(layout, [0, 1, 2, 3])
    keys = ["a" * 32, "b" * 32, "c" * 32, "d" * 32]
    upper = await _opened(_fs(tmp_path / "upper", _context()), layout)
    lower = await _opened(_fs(tmp_path / "lower", _context()), layout)
    await upper.save(_save(layout, keys[:2], [0, 1]))  # the first two, in both
    await lower.save(_save(layout, keys, [0, 1, 2, 3]))  # e.g. saved by another machine
    events: list[Any] = []
    ctx = _context()
    ctx.tier_event = events.append
    stack = await _opened(
        stacked([_fs(tmp_path / "upper", ctx), _fs(tmp_path / "lower", ctx)]), layout
    )
    assert isinstance(stack, StackedStore)
    assert await stack.lookup(keys) == 4
    seen: list[int] = []
    await stack.load(_load(layout, keys, [4, 5, 6, 7], seen))
    assert _bytes(layout, [4, 5, 6, 7]) == want and seen == [0, 1, 2]
    (read,) = [e for e in events if isinstance(e, TierRead)]
    assert (read.tier, read.hits, read.misses, read.promoted) == ("fs", 2, 2, 2)
    assert await upper.lookup(keys) == 4, "what came from below is in the upper tier now"
    for t in (stack, upper, lower):
        await t.aclose()


async def test_a_lookup_counts_what_a_load_would_read_from_each_tier(tmp_path: Path) -> None:
    layout = _layout()
    keys = [f"{c}" * 32 for c in "abcdef"]
    upper = await _opened(_fs(tmp_path / "upper", _context()), layout)
    lower = await _opened(_fs(tmp_path / "lower", _context()), layout)
    await upper.save(_save(layout, [keys[0], keys[1], keys[3]], [0, 1, 3]))
    await lower.save(_save(layout, [keys[2]], [2]))  # the gap; "e" nowhere
    stack = await _opened(
        stacked([_fs(tmp_path / "upper", _context()), _fs(tmp_path / "lower", _context())]), layout
    )
    # a load reads the upper tier's leading run (a, b) from it and the rest from below
    # (c; d, held above only past the gap, is not read): the lookup counts as much
    assert await stack.lookup(keys) == 3
    fill_blocks(layout, [0, 1, 2], seed=5)
    await lower.save(_save(layout, keys[:3], [0, 1, 2]))  # the common case: below has all
    assert await stack.lookup(keys) == 3
    for t in (stack, upper, lower):
        await t.aclose()


class Broken(FsTransport):
    """A lower tier that is down: every call fails as a store's network would."""

    async def lookup(self, keys: Any, *shards: Any) -> int:
        raise TransportError("the store is down")

    async def save(self, job: SaveJob) -> None:
        raise TransportError("the store is down")

    async def load(self, job: LoadJob) -> None:
        raise TransportError("the store is down", chunk=0)


async def test_a_lower_tier_that_is_down_costs_only_what_it_alone_held(tmp_path: Path) -> None:
    layout = _layout()
    fill_blocks(layout, [0, 1], seed=2)
    want = _bytes(layout, [0, 1])
    keys = ["a" * 32, "b" * 32]
    ctx = _context()
    stack = await _opened(
        stacked([_fs(tmp_path / "upper", ctx), Broken(FsOptions(path=str(tmp_path / "x")), ctx)]),
        layout,
    )
    await stack.save(_save(layout, keys, [0, 1]))  # the upper tier has them: saved
    assert await stack.lookup(keys) == 2
    seen: list[int] = []
    await stack.load(_load(layout, keys, [2, 3], seen))
    assert _bytes(layout, [2, 3]) == want
    with trio.fail_after(10), pytest.raises(TransportError) as err:
        await stack.load(_load(layout, [*keys, "c" * 32], [4, 5, 6], []))
    assert err.value.chunk == 2, "the chunks the upper tier held loaded; the third failed"
    await stack.aclose()


async def test_a_chunk_that_fails_below_is_not_copied_up(tmp_path: Path) -> None:
    """The lower copy of chunk 1 is corrupt: the load fails there, chunk 0 is copied into
    the upper tier, chunk 1 never is (its spans hold unverified bytes)."""
    layout = _layout()
    fill_blocks(layout, [0, 1], seed=3)
    keys = ["a" * 32, "b" * 32]
    lower = await _opened(_fs(tmp_path / "lower", _context()), layout)
    await lower.save(_save(layout, keys, [0, 1]))
    (bad,) = [f for f in (tmp_path / "lower").rglob("*.kv") if f.name.startswith("b")]
    data = bytearray(bad.read_bytes())
    data[-200] ^= 0xFF
    bad.write_bytes(bytes(data))
    upper_path = tmp_path / "upper"
    stack = await _opened(
        stacked([_fs(upper_path, _context()), _fs(tmp_path / "lower", _context())]), layout
    )
    with pytest.raises(TransportError) as err:
        await stack.load(_load(layout, keys, [2, 3], []))
    assert err.value.chunk == 1
    upper = await _opened(_fs(upper_path, _context()), layout)
    assert await upper.lookup(keys) == 1, "chunk 0 promoted, the corrupt chunk 1 not"
    for t in (stack, upper, lower):
        await t.aclose()


async def test_a_load_of_another_shard_reads_the_upper_tier_that_holds_it(tmp_path: Path) -> None:
    """`LoadJob.shard` (another tensor-parallel size's chunk): the upper tier is asked
    about that shard, so a chunk only it holds loads from it."""
    layout = _layout()
    fill_blocks(layout, [0], seed=4)
    want = _bytes(layout, [0])
    other = TransportContext("e", "worker", "ns", "tp1of2pp0", ["tp0of2pp0", "tp1of2pp0"])
    writer = await _opened(_fs(tmp_path / "upper", other), layout)
    await writer.save(_save(layout, ["a" * 32], [0]))
    stack = await _opened(
        stacked([_fs(tmp_path / "upper", _context()), _fs(tmp_path / "lower", _context())]), layout
    )
    job = _load(layout, ["a" * 32], [1], [])
    job.shard = "tp1of2pp0"
    await stack.load(job)
    assert _bytes(layout, [1]) == want
    for t in (stack, writer):
        await t.aclose()


async def test_only_the_lowest_tier_reports_what_it_evicted(tmp_path: Path) -> None:
    """`stack_of` (what the connector builds): the top tier evicting a chunk loses
    nothing (it is below too), so only the lowest tier's evictions reach `evicted`, the
    callback vLLM's KV events hang on."""
    layout = _layout()
    fill_blocks(layout, list(range(6)), seed=6)
    chunk_bytes = 1024 + layout.nbytes([4])  # a header, then the payload
    capped = FsOptions(path=str(tmp_path / "upper"), max_gb=2.5 * chunk_bytes / (1 << 30))
    ctx = _context()
    stack = stack_of(
        [(FsTransport, capped), (FsTransport, FsOptions(path=str(tmp_path / "low")))], ctx
    )
    evicted: list[str] = []
    stack.context.evicted = lambda ns, keys: evicted.extend(keys)
    stack = await _opened(stack, layout)
    keys = [f"{c}" * 32 for c in "abcdef"]
    for k, b in zip(keys, range(6), strict=True):
        await stack.save(_save(layout, [k], [b]))
    assert isinstance(stack, StackedStore) and isinstance(stack.upper, FsTransport)
    await stack.upper.chores_done()
    upper = await _opened(_fs(tmp_path / "upper", _context()), layout)
    assert await upper.lookup(keys[:1]) == 0, "the capped top tier evicted the oldest"
    assert await stack.lookup(keys) == 6 and evicted == [], "all below: nothing announced"
    for t in (stack, upper):
        await t.aclose()
    capped.path = str(tmp_path / "low2")  # now the lowest tier is the capped one
    low = stack_of(
        [(FsTransport, FsOptions(path=str(tmp_path / "up2"))), (FsTransport, capped)], ctx
    )
    low.context.evicted = lambda ns, keys: evicted.extend(keys)
    low = await _opened(low, layout)
    for k, b in zip(keys, range(6), strict=True):
        await low.save(_save(layout, [k], [b]))
    assert isinstance(low, StackedStore) and isinstance(low.lower, FsTransport)
    await low.lower.chores_done()  # fs evicts in a chore after the save
    assert keys[0] in evicted, "the lowest tier's evictions are announced"
    await low.aclose()
