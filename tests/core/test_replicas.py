"""Ranks that replicate KV heads keep them in a store once (`kvflow.shapes.replicas`): the first
rank holding them saves, the others read its shard. The engine-level check (a real TP=2
engine over one KV head) is in tests/engine/test_tp.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvflow.geometry.layout import KVLayout
from kvflow.geometry.topology import HeadRead, first_replica, plan_reads, readers
from kvflow.shapes.replicas import ReplicaStore, as_replica, store_shards
from kvflow.shapes.reshape import StoreShape, other_shapes
from kvflow.testing.layouts import fill_blocks, make_layout
from kvflow.tiers import stacked
from kvflow.transport import LoadJob, SaveJob, TransportContext
from kvflow_fs import FsOptions, FsTransport


def test_the_first_replica_of_each_head_holds_it_in_a_store() -> None:
    assert [first_replica(2, 4, r) for r in range(4)] == [0, 0, 2, 2]
    assert [first_replica(1, 8, r) for r in range(8)] == [0] * 8  # MLA: one latent
    assert [first_replica(4, 2, r) for r in range(2)] == [0, 1]  # no replicas
    assert store_shards(1, 2, 1, 1, 0) == ("tp0of2pp0", ["tp0of2pp0"])
    assert store_shards(2, 4, 2, 3, 1) == (
        "tp2of4pp1",
        ["tp0of4pp0", "tp2of4pp0", "tp0of4pp1", "tp2of4pp1"],
    )
    assert store_shards(4, 2, 1, 1, 0) == ("tp1of2pp0", ["tp0of2pp0", "tp1of2pp0"])
    assert store_shards(0, 2, 1, 1, 0)[0] == "tp1of2pp0", "heads not known: each its own"
    # decode context parallelism: ranks sharing a head hold other tokens of it
    assert store_shards(1, 8, 1, 3, 0, context_parallel=8) == (
        "tp3of8pp0",
        [f"tp{r}of8pp0" for r in range(8)],
    )


def test_reads_from_a_store_take_the_first_replica_and_peers_spread() -> None:
    assert plan_reads(1, 2, 4, 3) == [HeadRead(1, 0, 1, 0)]  # a peer: spread over replicas
    assert plan_reads(1, 2, 4, 3, spread=False) == [HeadRead(0, 0, 1, 0)]
    assert readers(1, 4, 2) == [1, 1, 0, 0]
    assert readers(1, 4, 2, spread=False) == [2, 0, 0, 0]
    # an engine of TP=2 over one head looks for chunks of TP=4 in the one shard saved
    assert StoreShape(4, ["tp0of4pp0"]) in other_shapes(1, 2, 1)


def _layout(seed: int) -> KVLayout:
    layout = make_layout(num_layers=2, num_blocks=8, block_size=4, block_granular=False)
    fill_blocks(layout, [0, 1], seed=seed)
    return layout


def _bytes(layout: KVLayout, blocks: list[int]) -> list[bytes]:
    return [
        bytes(s) for i in range(layout.num_layers) for b in blocks for s in layout.spans(i, b, 4)
    ]


@pytest.mark.trio
async def test_a_replica_saves_nothing_and_loads_the_first_ranks_shard(tmp_path: Path) -> None:
    """TP=2 over one KV head: both ranks save the same bytes, one file per chunk is
    written (rank 0's), the scheduler's lookup needs only it, and rank 1 loads it."""
    keys = ["a" * 32, "b" * 32]
    ranks = []
    for rank in (0, 1):
        own, shards = store_shards(1, 2, 1, rank, 0)
        layout = _layout(seed=3)  # replicas hold the same bytes
        ctx = TransportContext("e", "worker", "ns", own, shards, layout, tp_rank=rank, tp_size=2)
        store = FsTransport(FsOptions(path=str(tmp_path)), ctx)
        ranks.append((as_replica(store) if rank else store, layout))
    assert isinstance(ranks[1][0], ReplicaStore) and ranks[1][0].name == "fs"
    for store, layout in ranks:
        await store.open()
        await store.register(layout)

        async def spans(i: int, layout: KVLayout = layout) -> list[list[memoryview]]:
            return layout.chunk_spans(i, [0, 1], [4, 4])

        await store.save(SaveJob("r", keys, [4, 4], layout.num_layers, spans))
    assert sorted(p.name.split(".")[1] for p in tmp_path.rglob("*.kv")) == ["tp0of2pp0"] * 2
    _, shards = store_shards(1, 2, 1, 0, 0)
    sched = FsTransport(
        FsOptions(path=str(tmp_path)), TransportContext("e", "scheduler", "ns", shards[0], shards)
    )
    await sched.open()
    assert await sched.lookup(keys) == 2
    replica, layout = ranks[1]
    seen: list[int] = []
    dst = [4, 5]
    spans = lambda i: layout.chunk_spans(i, dst, [4, 4])  # noqa: E731
    await replica.load(LoadJob("r", keys, [4, 4], layout.num_layers, spans, seen.append))
    assert _bytes(layout, dst) == _bytes(ranks[0][1], [0, 1]) and seen == [0, 1]
    for t in (sched, *(s for s, _ in ranks)):
        await t.aclose()


@pytest.mark.trio
async def test_a_replica_reads_a_stack_without_copying_into_its_upper_tier(
    tmp_path: Path,
) -> None:
    """The first replica saved below only (e.g. another machine's store): a replica's
    load reads it from there and writes nothing into the tier above (its shard is the
    first replica's, whose own loads copy it up)."""
    keys = ["c" * 32, "d" * 32]
    own, shards = store_shards(1, 2, 1, 0, 0)
    layout = _layout(seed=4)
    ctx = TransportContext("e", "worker", "ns", own, shards, layout, tp_rank=0, tp_size=2)
    lower = FsTransport(FsOptions(path=str(tmp_path / "lower")), ctx)
    await lower.open()

    async def spans(i: int) -> list[list[memoryview]]:
        return layout.chunk_spans(i, [0, 1], [4, 4])

    await lower.save(SaveJob("r", keys, [4, 4], layout.num_layers, spans))
    own, shards = store_shards(1, 2, 1, 1, 0)
    mine = _layout(seed=4)
    ctx = TransportContext("e", "worker", "ns", own, shards, mine, tp_rank=1, tp_size=2)
    fs = lambda d: FsTransport(FsOptions(path=str(tmp_path / d)), replace(ctx))  # noqa: E731
    replica = as_replica(stacked([fs("upper"), fs("lower")]))
    await replica.open()
    await replica.register(mine)
    seen: list[int] = []
    dst = [4, 5]
    await replica.load(
        LoadJob("r", keys, [4, 4], mine.num_layers, lambda i: mine.chunk_spans(i, dst, [4, 4]),
                seen.append)
    )  # fmt: skip
    assert _bytes(mine, dst) == _bytes(layout, [0, 1]) and seen == [0, 1]
    assert not list((tmp_path / "upper").rglob("*.kv")), "the replica copied chunks up"
    for t in (lower, replica):
        await t.aclose()
