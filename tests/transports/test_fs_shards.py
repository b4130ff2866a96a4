"""`fs` knows which shards a namespace holds files of (`.shards` markers, written by each
worker's scan), so a lookup of another tensor-parallel size the store holds nothing of
asks no file; a size whose worker opened the store is asked within `FRESH_S`, and a
store without markers (an older kvflow's) is asked as before."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import trio
import trio.testing

from kvflow.transport import TransportContext
from kvflow_fs import FsTransport
from kvflow_fs._shards import FRESH_S, SHARDS_DIR
from kvflow_fs._transport import FsOptions

OWN = ["tp0of1pp0"]
OTHER = ["tp0of2pp0", "tp1of2pp0"]
KEY = "ab" * 16


async def _opened(store: Path, role: str, shard: str) -> FsTransport:
    t = FsTransport(FsOptions(path=str(store)), TransportContext("e", role, "ns", shard, [shard]))
    await t.open()
    await t.usage.chores_done()  # a worker's scan: it marks its shard
    return t


def _plant(t: FsTransport, shards: list[str]) -> None:
    """Files of `KEY` for `shards`, as an engine of that size would have saved them."""
    for shard in shards:
        path = t.path(KEY, shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"chunk")


async def test_a_size_the_store_holds_no_file_of_is_not_asked_until_its_worker_opens(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    await _opened(tmp_path, "worker", OWN[0])  # this engine's worker: marks its own shard
    sched = await _opened(tmp_path, "scheduler", OWN[0])
    _plant(sched, OTHER)  # files the markers do not name (saved since the last scan)
    assert await sched.lookup([KEY], OTHER) == 0, "a shard with no marker was asked"
    for shard in OTHER:  # that size's workers open the store: their scans mark it
        await _opened(tmp_path, "worker", shard)
    await trio.sleep(FRESH_S)
    assert await sched.lookup([KEY], OTHER) == 1


async def test_a_store_without_markers_asks_every_size(tmp_path: Path) -> None:
    await _opened(tmp_path, "worker", OWN[0])
    sched = await _opened(tmp_path, "scheduler", OWN[0])
    _plant(sched, OTHER)
    shutil.rmtree(Path(sched.path(KEY)).parents[1] / SHARDS_DIR)  # as an older kvflow left it
    assert await sched.lookup([KEY], OTHER) == 1


async def test_a_stray_file_names_no_shard(tmp_path: Path) -> None:
    sched = await _opened(tmp_path, "scheduler", OWN[0])
    prefix = Path(sched.path(KEY)).parent
    prefix.mkdir(parents=True)
    for name in ("x..kv", "x.a.b.kv", f"{KEY}.{OTHER[0]}.kv"):  # two strays, one chunk
        (prefix / name).write_bytes(b"chunk")
    await _opened(tmp_path, "worker", OWN[0])
    assert sorted(os.listdir(prefix.parent / SHARDS_DIR)) == sorted([OWN[0], OTHER[0]])
