"""A store serves engines of another tensor-parallel size (`kvflow.shapes.reshape`), on real
`fs` files: what TP=2 ranks saved loads into a TP=1 engine's blocks and back, each head
where the other size keeps it, in every layout vLLM lays KV out in."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.engine.staging import HostStage
from kvflow.geometry.cells import head_copy_runs
from kvflow.geometry.layout import KVLayout, LayoutError
from kvflow.keys import chunk_keys
from kvflow.shapes import reshape
from kvflow.shapes.reshape import (
    load_reshaped,
    lookup_sources,
    other_shapes,
    shard_name,
)
from kvflow.testing.layouts import LAYOUTS, fill_blocks, make_layout
from kvflow.transport import ChunkCorrupt, ChunkMissing, LoadJob, SaveJob, TransportContext
from kvflow_fs import FsOptions, FsTransport

HEADS = 4
COUNTS = [8, 8, 5]
SRC, DST = [1, 2, 3], [9, 10, 11]
KEYS = chunk_keys("ns", list(range(sum(COUNTS))), 8)
KINDS = ["block-granular", *LAYOUTS, "LBHNC/kernel", "LBNHC/kernel"]


def _layout(kind: str, heads: int) -> KVLayout:
    name, _, kernel = kind.partition("/")
    return make_layout(
        num_layers=3,
        block_size=8,
        heads=heads,
        head_dim=4,
        block_granular=kind == "block-granular",
        layout="" if kind == "block-granular" else name,
        kernel_block_size=4 if kernel else 0,
    )


async def _store(root: Path, layout: KVLayout, rank: int, size: int) -> FsTransport:
    shards = [shard_name(r, size, 0) for r in range(size)]
    ctx = TransportContext(
        "e", "worker", "ns", shards[rank], shards, tp_rank=rank, tp_size=size, kv_heads=HEADS
    )
    t = FsTransport(FsOptions(path=str(root)), ctx)
    await t.open()
    await t.register(layout)
    return t


async def _save(t: FsTransport, chunks: int = len(KEYS)) -> None:
    layout = t.context.layout
    assert layout is not None

    async def spans(layer: int) -> list[list[memoryview]]:
        return layout.chunk_spans(layer, SRC[:chunks], COUNTS[:chunks])

    await t.save(SaveJob("save", KEYS[:chunks], COUNTS[:chunks], layout.num_layers, spans))


def _job(layout: KVLayout, signalled: list[int]) -> LoadJob:
    def spans(layer: int) -> list[list[memoryview]]:
        return layout.chunk_spans(layer, DST, COUNTS)

    return LoadJob("load", KEYS, COUNTS, layout.num_layers, spans, signalled.append, None, DST)


def _head(layout: KVLayout, blocks: list[int], head: int) -> list[bytes]:
    """Each layer's bytes of one head of `blocks`' first `COUNTS` tokens."""
    return [
        b"".join(bytes(s) for c in layout.head_spans(layer, blocks, COUNTS, head, 1) for s in c)
        for layer in range(layout.num_layers)
    ]


@pytest.fixture(params=["direct", "buffered"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Read straight into the blocks' runs, or through a buffer and a copy (`DIRECT_RUNS`)."""
    monkeypatch.setattr(reshape, "DIRECT_RUNS", 1 << 30 if request.param == "direct" else 0)
    return str(request.param)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_tp1_engine_loads_what_tp2_ranks_saved(
    tmp_path: Path, kind: str, path: str
) -> None:
    savers = [await _store(tmp_path, _layout(kind, HEADS // 2), r, 2) for r in range(2)]
    for r, t in enumerate(savers):
        assert t.context.layout is not None
        fill_blocks(t.context.layout, SRC, seed=r + 1)
        await _save(t)
    reader = await _store(tmp_path, _layout(kind, HEADS), 0, 1)
    shapes = other_shapes(HEADS, 1, 1)
    assert await reader.lookup(KEYS) == 0  # not under its own shard
    assert await lookup_sources(reader, KEYS, shapes) == [2, 2, 2]
    layout = reader.context.layout
    assert layout is not None
    signalled: list[int] = []
    await load_reshaped(reader, _job(layout, signalled), [2, 2, 2])
    assert signalled == [0, 1, 2]
    for h in range(HEADS):
        rank, local = divmod(h, HEADS // 2)
        saved = savers[rank].context.layout
        assert saved is not None
        assert _head(layout, DST, h) == _head(saved, SRC, local), f"head {h}"


@pytest.mark.parametrize("kind", KINDS)
async def test_tp2_ranks_load_what_a_tp1_engine_saved(tmp_path: Path, kind: str, path: str) -> None:
    saver = await _store(tmp_path, _layout(kind, HEADS), 0, 1)
    assert saver.context.layout is not None
    fill_blocks(saver.context.layout, SRC, seed=5)
    await _save(saver)
    for r in range(2):
        reader = await _store(tmp_path, _layout(kind, HEADS // 2), r, 2)
        assert await lookup_sources(reader, KEYS, other_shapes(HEADS, 2, 1)) == [1, 1, 1]
        layout = reader.context.layout
        assert layout is not None
        await load_reshaped(reader, _job(layout, []), [1, 1, 1])
        for local in range(HEADS // 2):
            want = _head(saver.context.layout, SRC, r * HEADS // 2 + local)
            assert _head(layout, DST, local) == want, f"rank {r} head {local}"


async def test_chunks_of_the_own_size_load_as_they_lie_next_to_others(tmp_path: Path) -> None:
    """Chunk 0 under the reader's own shard, chunks 1-2 under TP=2 shards: one load."""
    savers = [await _store(tmp_path, _layout("LBHNC", HEADS // 2), r, 2) for r in range(2)]
    for r, t in enumerate(savers):
        assert t.context.layout is not None
        fill_blocks(t.context.layout, SRC, seed=r + 1)
        await _save(t)
    own = await _store(tmp_path, _layout("LBHNC", HEADS), 0, 1)
    assert own.context.layout is not None
    fill_blocks(own.context.layout, SRC, seed=9)
    await _save(own, chunks=1)
    reader = await _store(tmp_path, _layout("LBHNC", HEADS), 0, 1)
    assert await lookup_sources(reader, KEYS, other_shapes(HEADS, 1, 1)) == [0, 2, 2]
    layout = reader.context.layout
    assert layout is not None
    await load_reshaped(reader, _job(layout, []), [0, 2, 2])
    for h in range(HEADS):
        got = _head(layout, DST, h)
        mine = _head(own.context.layout, SRC, h)
        theirs = _head(savers[h // 2].context.layout, SRC, h % 2)
        for layer in range(layout.num_layers):
            cut = COUNTS[0] * len(got[layer]) // sum(COUNTS)
            assert got[layer][:cut] == mine[layer][:cut], f"head {h} chunk 0"
            assert got[layer][cut:] == theirs[layer][cut:], f"head {h} chunks 1-2"


@pytest.mark.parametrize("kind", ["block-granular", "LBNHC"])
async def test_a_missing_piece_fails_the_load_from_its_chunk_on(
    tmp_path: Path, kind: str, path: str
) -> None:
    """Rank 1's file of chunk 1 is gone: the load names chunk 1 (a key and a missing
    file), and chunk 0, whole in both ranks' files, has every head."""
    savers = [await _store(tmp_path, _layout(kind, HEADS // 2), r, 2) for r in range(2)]
    for r, t in enumerate(savers):
        assert t.context.layout is not None
        fill_blocks(t.context.layout, SRC, seed=r + 1)
        await _save(t)
    savers[1].path(KEYS[1]).unlink()
    reader = await _store(tmp_path, _layout(kind, HEADS), 0, 1)
    layout = reader.context.layout
    assert layout is not None
    assert await lookup_sources(reader, KEYS, other_shapes(HEADS, 1, 1)) == [2]
    with pytest.raises(ChunkMissing, match="missing file") as caught:
        await load_reshaped(reader, _job(layout, []), [2, 2, 2])
    assert caught.value.chunk == 1 and caught.value.key == KEYS[1]
    for h in range(HEADS):
        saved = savers[h // 2].context.layout
        assert saved is not None
        for layer in range(layout.num_layers):
            got = layout.head_spans(layer, DST[:1], COUNTS[:1], h, 1)[0]
            want = saved.head_spans(layer, SRC[:1], COUNTS[:1], h % 2, 1)[0]
            assert [bytes(s) for s in got] == [bytes(s) for s in want], f"head {h}"


async def test_a_chunk_of_another_layout_is_refused_and_left_for_its_engine(
    tmp_path: Path,
) -> None:
    """An HND engine finds an NHD engine's TP=2 chunks: refused as another layout (never
    loaded as if they were its own), and the other engine's files stay."""
    for r in range(2):
        t = await _store(tmp_path, _layout("LBNHC", HEADS // 2), r, 2)
        await _save(t)
    reader = await _store(tmp_path, _layout("LBHNC", HEADS), 0, 1)
    assert reader.context.layout is not None
    with pytest.raises(ChunkCorrupt, match="another KV layout") as caught:
        await load_reshaped(reader, _job(reader.context.layout, []), [2, 2, 2])
    assert caught.value.chunk == 0
    assert len(list(tmp_path.rglob("*.kv"))) == 6


def test_other_shapes_are_the_sizes_that_split_the_heads() -> None:
    assert [s.tp_size for s in other_shapes(4, 2, 1)] == [1, 4, 8, 16]
    assert other_shapes(4, 2, 1)[0].shards == ["tp0of1pp0"]
    # TP=8 over 4 heads replicates each: a TP=1 reader needs one replica of each
    eight = next(s for s in other_shapes(4, 1, 1) if s.tp_size == 8)
    assert eight.shards == ["tp0of8pp0", "tp2of8pp0", "tp4of8pp0", "tp6of8pp0"]
    assert [s.tp_size for s in other_shapes(6, 2, 1)] == [1]  # 6 heads: only sizes 1, 2, 3, 6
    assert other_shapes(0, 1, 1) == []  # heads not known: nothing else looked for


@pytest.mark.parametrize("kind", KINDS)
def test_with_heads_is_the_geometry_a_rank_of_that_many_heads_has(kind: str) -> None:
    """The same description and the same image (its runs in memory order: dense, where
    vLLM may keep heads a whole layer apart)."""
    for have, want in ((4, 2), (2, 4), (1, 2), (2, 1), (4, 1)):
        got = _layout(kind, have).geometries[0].with_heads(want)
        real = _layout(kind, want).geometries[0]
        assert got.describe() == real.describe(), (have, want)
        whole = real.chunk_nbytes(8)  # the same image: all heads copy as one run
        assert head_copy_runs(got, 0, real, 0, want, 8) == ((0, 0, whole),), (have, want)


def test_heads_copy_between_orders_cell_by_cell() -> None:
    """NHD into HND: one run per token and head; HND into HND: one per head."""
    nhd, hnd = _layout("LBNHC", 2).geometries[0], _layout("LBHNC", 2).geometries[0]
    cell = hnd.cell_bytes
    assert len(head_copy_runs(nhd, 0, hnd, 0, 2, 8)) == 16
    assert head_copy_runs(hnd, 1, hnd, 0, 1, 8) == ((8 * cell, 0, 8 * cell),)
    with pytest.raises(LayoutError, match="cannot copy"):
        head_copy_runs(_layout("block-granular", 2).geometries[0], 0, hnd, 0, 1, 8)


def _device(kind: str, heads: int) -> KVLayout:
    """A cache standing in for a CUDA one (memory 'cuda'; `buffers` alias its tensors
    so the test reads its bytes), staged token-major for the store (`kvflow.engine.staging`)."""
    layout = _layout(kind, heads)
    layout.memory = "cuda"
    layout.tensors = [torch.frombuffer(b, dtype=torch.uint8) for b in layout.buffers]
    return layout


@pytest.mark.parametrize("kind", ["LBNHC", "LBHNC", "LBHNC/kernel", "block-granular"])
async def test_a_device_cache_loads_what_another_size_saved_through_its_staging(
    tmp_path: Path, kind: str, path: str
) -> None:
    savers = []
    for r in range(2):
        t = await _store(tmp_path, _device(kind, HEADS // 2), r, 2)
        assert t.context.layout is not None
        fill_blocks(t.context.layout, SRC, seed=r + 1)
        stage = HostStage(t.context.layout, SRC, COUNTS)

        async def spans(layer: int, stage: HostStage = stage) -> list[list[memoryview]]:
            await stage.gather(layer)
            return stage.spans(layer)

        await t.save(SaveJob("save", KEYS, COUNTS, 3, spans))
        savers.append(t.context.layout)
    reader = await _store(tmp_path, _device(kind, HEADS), 0, 1)
    layout = reader.context.layout
    assert layout is not None
    into = HostStage(layout, DST, COUNTS)
    job = LoadJob("load", KEYS, COUNTS, 3, into.spans, lambda layer: None, None, DST)
    await load_reshaped(reader, job, [2, 2, 2])
    for layer in range(layout.num_layers):
        into.scatter(layer)
    for h in range(HEADS):
        assert _head(layout, DST, h) == _head(savers[h // 2], SRC, h % 2), f"head {h}"
