"""kvflow.engine.cpu_pinning against real processes: real CPU affinities, real discovery records."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvflow.engine.cpu_pinning import pinned_neighbours
from kvflow.observe.stream import Registration, _proc_start

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs 2 cores"
)


@pytest.fixture
def rdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvn"))


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    yield proc
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(30)


def _register(rdir: Path, pid: int, engine: str, role: str = "worker") -> None:
    reg = Registration(
        engine=engine,
        role=role,
        rank=0,
        pid=pid,
        endpoint="ipc:///x",
        started=0.0,
        proc_start=_proc_start(pid),
    )
    (rdir / f"{engine}-{role}-{pid}.json").write_bytes(msgspec.json.encode(reg))


def test_a_worker_of_another_engine_on_the_same_core_is_found(
    rdir: Path, child: subprocess.Popen[bytes]
) -> None:
    os.sched_setaffinity(child.pid, {0})
    _register(rdir, child.pid, "other")
    (found,) = pinned_neighbours("mine", own={0}, directory=rdir)
    assert found[0].pid == child.pid and found[1] == {0}
    # its own core each: no clash; a scheduler process is no worker; nor is our own engine
    assert pinned_neighbours("mine", own={1}, directory=rdir) == []
    assert pinned_neighbours("other", own={0}, directory=rdir) == []


def test_unpinned_processes_never_clash(rdir: Path, child: subprocess.Popen[bytes]) -> None:
    everywhere = os.sched_getaffinity(1)
    _register(rdir, child.pid, "other")  # the child runs on every core
    assert pinned_neighbours("mine", own={0}, directory=rdir) == []
    os.sched_setaffinity(child.pid, {0})
    assert pinned_neighbours("mine", own=everywhere, directory=rdir) == []
    _register(rdir, child.pid, "sched", role="scheduler")
    assert [r.engine for r, _ in pinned_neighbours("mine", own={0}, directory=rdir)] == ["other"]


def test_a_dead_workers_record_is_ignored(rdir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    _register(rdir, proc.pid, "gone")
    assert pinned_neighbours("mine", own={0}, directory=rdir) == []
