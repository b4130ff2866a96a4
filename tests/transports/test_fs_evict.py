"""An `fs` eviction of a large store looks at a small part of it (issue 50, item 1): it
samples key prefix directories at random, deletes only files among the least recently
used of its sample, and still frees what the store holds over its cap."""

from __future__ import annotations

import math
import os
import secrets
from pathlib import Path

import pytest

from kvflow_fs._usage import EVICT_SHARE, EVICT_TO, SAMPLE_FILES, USAGE_FILE, StoreUsage

FILES = 16 * SAMPLE_FILES
SIZE = 64


def _store(root: Path, n: int = FILES) -> list[str]:
    """`n` chunk files in one namespace, used one second apart: oldest first."""
    paths = []
    for i in range(n):
        key = secrets.token_hex(16)
        d = root / "ns" / key[:2]
        d.mkdir(parents=True, exist_ok=True)
        path = str(d / f"{key}.tp0of1pp0.kv")
        with open(path, "wb") as f:
            f.write(b"x" * SIZE)
        os.utime(path, (1e9 + i, 1e9 + i))
        paths.append(path)
    (root / USAGE_FILE).write_text(str(n * SIZE))
    return paths


@pytest.mark.parametrize("over", [1.001, 2.0])
def test_an_eviction_looks_at_a_part_of_the_store_and_deletes_the_least_recently_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, over: float
) -> None:
    """`over`: the store's size against its cap: a save past it (a store at its cap, as
    saves keep it: one step of eviction), or twice it (a cap lowered)."""
    paths = _store(tmp_path)
    usage = StoreUsage(tmp_path, int(FILES * SIZE / over), lambda: None)
    listed: list[str] = []
    scandir = os.scandir

    def counted(path: str) -> object:
        listed.append(str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", counted)
    usage.account()
    monkeypatch.undo()

    gone = [i for i, p in enumerate(paths) if not os.path.exists(p)]
    left = (FILES - len(gone)) * SIZE
    assert left <= usage.max_bytes * EVICT_TO, "it freed too little"
    assert int((tmp_path / USAGE_FILE).read_text()) == left
    # only files among the least recently used share it sampled
    share = min(1.0, max(EVICT_SHARE, 1.25 * (1 - EVICT_TO / over)))
    slack = 4 * math.sqrt(share * (1 - share) / SAMPLE_FILES)  # the sample's quantile
    assert max(gone) < (share + slack) * FILES, "a recently used file was deleted"
    if over < 1.01:  # a step: it looked at a part of the store only (a walk lists all)
        # It lists the directories of its sample, then more until it found files older
        # than the cutoff worth what it frees: typically a third of them, more when the
        # sample's cutoff fell low (over half, once, in a run of the whole suite).
        prefixes = {p.rsplit("/", 2)[-2] for p in paths}
        chunk_dirs = [d for d in listed if d.rsplit("/", 1)[-1] in prefixes]
        assert len(chunk_dirs) < len(prefixes) * 3 / 4, "it listed most of the store"
        assert usage.last_pass is not None
        assert usage.last_pass.looked_at < FILES * 3 / 4


def test_a_store_within_the_sample_is_evicted_exactly_oldest_first(tmp_path: Path) -> None:
    paths = _store(tmp_path, SAMPLE_FILES)
    usage = StoreUsage(tmp_path, int(SAMPLE_FILES * SIZE / 1.1), lambda: None)
    usage.account()
    gone = [i for i, p in enumerate(paths) if not os.path.exists(p)]
    assert gone == list(range(len(gone))) and gone, "not exactly the oldest"
