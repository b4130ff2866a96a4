"""The fs store against other local users (issue 46): a held lock delays no save and no
shutdown, the store's directories and bookkeeping files are owner-only (or what
`file_mode` grants), a directory another user owns or can write is refused at open,
and the store's walks never follow a symbolic link out of it.

Real files, real processes, real owners (`chown`, where this runs as root)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvflow.testing.conformance import Harness, TransportConformance
from kvflow.transport import TransportContext, TransportError
from kvflow_fs import FsOptions, FsTransport
from kvflow_fs import _usage as usage_module
from kvflow_fs._format import HEADER_SIZE

from ..support.fs_store import Factory, fs_worker

ROOT = os.geteuid() == 0
OTHER_UID = 4242
"""A user id that is not this process's (the tests chown to it as root)."""


@pytest.fixture
def factory(tmp_path: Path) -> Factory:
    return Factory(tmp_path / "store")


@pytest.fixture
async def kv(factory: Factory) -> AsyncIterator[Harness]:
    suite = TransportConformance()
    async with suite.harness(factory, suite.build_layout(False)) as harness:
        yield harness


def chunk_files(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*.kv") if p.is_file() and not p.is_symlink())


def file_bytes(kv: Harness) -> int:
    return HEADER_SIZE + kv.layout.nbytes([kv.layout.block_size])


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


# -- M4: a lock another process holds ------------------------------------------------------

HOLDER = """
import fcntl, os, sys, threading
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
# held until the test closes stdin; a safety net of 60 s (then it says so) turns a save
# that waits for this lock into a failure rather than a hung test
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
if not done.wait(60):
    open(sys.argv[2], "w").close()
"""


@pytest.fixture
def held_lock(factory: Factory) -> Iterator[tuple[Path, Any]]:
    """Another process holding `.usage.lock` of the store: (its give-up marker, release)."""
    factory.store.mkdir(mode=0o700, exist_ok=True)  # the harness's first open made it
    gave_up = factory.store.parent / "holder-gave-up"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(factory.store / ".usage.lock"), str(gave_up)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"

    def release() -> None:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(60)

    try:
        yield gave_up, release
    finally:
        if holder.poll() is None:
            release()


async def test_a_held_usage_lock_delays_no_save_and_no_close_and_the_count_catches_up(
    kv: Harness,
    factory: Factory,
    held_lock: tuple[Path, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process (another user, before the lock file was owner-only) holds the
    store's `.usage.lock` for good: saves return, their chores (count, eviction) give up
    at the deadline, and the transport closes; once the lock is free the next save's
    open counts every save and evicts."""
    gave_up, release = held_lock
    monkeypatch.setattr(usage_module, "LOCK_WAIT_S", 0.05, raising=False)  # a quick test
    factory.options["max_gb"] = 4.2 * file_bytes(kv) / (1 << 30)  # room for 4 files, not 6
    worker = await fs_worker(kv)
    await worker.chores_done()  # the scan at open gave up on the lock too
    for _ in range(6):
        await kv.save(worker, kv.chunks(1))
    await worker.chores_done()
    assert not gave_up.exists(), "the saves waited for the lock until its holder gave up"
    assert len(chunk_files(factory.store)) == 6, "nothing evicted: the chore was skipped"
    assert worker.usage.lock_skips >= 1
    await kv.close(worker)  # closes, chores ended
    release()
    again = await fs_worker(kv)
    await again.chores_done()  # its open counts the store, the 6 files, and evicts
    assert again.evictions == 1
    on_disk = sum(p.stat().st_size for p in chunk_files(factory.store))
    assert on_disk <= usage_module.EVICT_TO * 4.2 * file_bytes(kv)
    await kv.save(again, kv.chunks(1))
    await again.chores_done()
    on_disk = sum(p.stat().st_size for p in chunk_files(factory.store))
    assert int((factory.store / ".usage").read_text()) == on_disk


async def test_a_count_skipped_for_a_held_lock_is_added_by_the_next_chore(
    kv: Harness,
    factory: Factory,
    held_lock: tuple[Path, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same worker: what its saves wrote while the lock was held is counted (not
    lost) by its first chore after the lock is free."""
    gave_up, release = held_lock
    monkeypatch.setattr(usage_module, "LOCK_WAIT_S", 0.05, raising=False)
    worker = await fs_worker(kv)
    await worker.chores_done()
    for _ in range(3):
        await kv.save(worker, kv.chunks(1))
    await worker.chores_done()
    assert not gave_up.exists(), "the saves waited for the lock until its holder gave up"
    release()
    await kv.save(worker, kv.chunks(1))
    await worker.chores_done()
    on_disk = sum(p.stat().st_size for p in chunk_files(factory.store))
    assert int((factory.store / ".usage").read_text()) == on_disk == 4 * file_bytes(kv)


@pytest.mark.parametrize(
    ("file_mode", "dir_mode"), [("0600", 0o700), ("0640", 0o750), ("0660", 0o770)]
)
async def test_the_store_root_and_its_bookkeeping_files_get_the_modes_file_mode_implies(
    kv: Harness, factory: Factory, file_mode: str, dir_mode: int
) -> None:
    """Under the common umask (022) the root, not only the directories below it, is
    owner-only by default, and so are `.usage` and its lock (a lock others can open is
    a lock others can hold)."""
    factory.store = factory.store / "deeper" / "store"
    factory.options.update(file_mode=file_mode, max_gb=2.5 * file_bytes(kv) / (1 << 30))
    umask = os.umask(0o002 if file_mode == "0660" else 0o022)
    try:
        worker = await fs_worker(kv)
        for _ in range(3):  # over the cap: the eviction lock too
            await kv.save(worker, kv.chunks(1))
        await worker.chores_done()
    finally:
        os.umask(umask)
    assert worker.evictions == 1
    assert {mode(d) for d in [factory.store, worker.dir]} == {dir_mode}
    own = [p for p in factory.store.iterdir() if p.name.startswith(".")]
    assert {p.name for p in own} == {".usage", ".usage.lock", ".evict.lock"}
    assert {p.name: mode(p) for p in own} == dict.fromkeys([p.name for p in own], int(file_mode, 8))


async def test_an_old_stores_world_readable_lock_files_are_made_owner_only(
    kv: Harness, factory: Factory
) -> None:
    """A store an older kvflow made: its lock files were 0644, which anyone who can reach
    them may open and hold; the owner's next chore takes that away."""
    assert factory.store.is_dir()  # the harness's first open made it
    for name in (".usage.lock", ".usage"):
        (factory.store / name).write_text("")
        (factory.store / name).chmod(0o644)
    worker = await fs_worker(kv)
    await kv.save(worker, kv.chunks(1))
    await worker.chores_done()
    assert mode(factory.store / ".usage.lock") == 0o600
    assert mode(factory.store / ".usage") == 0o600


# -- item 2: directories another user owns or can write -----------------------------------


def transport(path: Path, **options: Any) -> FsTransport:
    ctx = TransportContext("e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"])
    return FsTransport(FsOptions(path=str(path), **options), ctx)


async def refused(path: Path, named: Path, *words: str, **options: Any) -> str:
    with pytest.raises(TransportError) as caught:
        await transport(path, **options).open()
    message = str(caught.value)
    assert str(named) in message, message
    for word in words:
        assert word in message, message
    return message


@pytest.mark.parametrize("where", ["root", "namespace"])
@pytest.mark.parametrize(("bits", "who"), [(0o770, "its group"), (0o757, "every user")])
async def test_a_store_directory_writable_beyond_file_mode_is_refused_at_open(
    tmp_path: Path, where: str, bits: int, who: str
) -> None:
    """A co-tenant who can write the root or a namespace could plant chunk files every
    engine loads: refused, naming the directory, its mode and the fix; nothing written."""
    root = tmp_path / "store"
    target = root if where == "root" else root / "ns"
    target.mkdir(parents=True)
    target.chmod(bits)
    message = await refused(root, target, f"{bits:04o}", f"writable by {who}", "chmod", "0600")
    assert re.search(r"chmod (go|g|o)-w", message), message
    assert sorted(p.name for p in root.rglob("*")) == ([] if where == "root" else ["ns"])
    # the same mode is what a group-shared store wants, and is kept
    if bits == 0o770:
        await transport(root, file_mode="0660").open()


@pytest.mark.parametrize("where", ["root", "namespace"])
async def test_a_store_directory_owned_by_another_user_is_refused_at_open(
    tmp_path: Path, where: str
) -> None:
    """A namespace directory a co-tenant made under a shared root (or a root of theirs):
    refused, naming its owner, even when its mode is owner-only."""
    root = tmp_path / "store"
    if not ROOT:
        if where == "namespace":
            pytest.skip("making a directory of another user's needs root")
        root = Path("/")  # a real directory of another user's (root's): refused unwritten
        await refused(root, root, "owned by uid 0", "not by this user")
        return
    target = root if where == "root" else root / "ns"
    target.mkdir(parents=True, mode=0o700)
    os.chown(target, OTHER_UID, OTHER_UID)
    await refused(root, target, f"owned by uid {OTHER_UID}", "not by this user")
    assert sorted(p.name for p in root.rglob("*")) == ([] if where == "root" else ["ns"])


@pytest.mark.skipif(not ROOT, reason="making a directory of another user's needs root")
async def test_a_group_shared_store_accepts_a_directory_a_member_of_its_group_made(
    tmp_path: Path,
) -> None:
    """`file_mode` "0660": the users of the store's group all write it, so a namespace
    another member made is theirs to make; with "0600" it is refused."""
    root = tmp_path / "store"
    (root / "ns").mkdir(parents=True, mode=0o770)
    os.chown(root / "ns", OTHER_UID, os.getegid())
    await transport(root, file_mode="0660").open()
    await refused(root, root / "ns", f"owned by uid {OTHER_UID}")
    os.chown(root / "ns", OTHER_UID, OTHER_UID)  # not a group of this user's
    await refused(root, root / "ns", f"owned by uid {OTHER_UID}", file_mode="0660")


async def test_a_namespace_that_is_a_symbolic_link_is_refused_at_open(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "store").mkdir(mode=0o700)
    (tmp_path / "store" / "ns").symlink_to(tmp_path / "elsewhere")
    await refused(tmp_path / "store", tmp_path / "store" / "ns", "symbolic link")
    assert list((tmp_path / "elsewhere").iterdir()) == []


# -- item 3: symbolic links in the store -------------------------------------------------


async def test_scan_and_eviction_never_follow_a_symbolic_link_out_of_the_store(
    kv: Harness, factory: Factory, tmp_path: Path
) -> None:
    """Links in the store (a namespace, a key directory, a chunk file) to a directory
    outside it, holding old chunk-named files: not counted, never deleted."""
    outside = tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    victims = [outside / "ab" / f"{'ab' * 16}.tp0of1pp0.kv", outside / "ab" / f"{'ab' * 15}cd.s.kv"]
    past = time.time() - 10_000
    for v in victims:
        v.write_bytes(b"x" * file_bytes(kv))  # as big as a chunk file, older than any
        os.utime(v, (past, past))
    first = await fs_worker(kv)
    await first.chores_done()
    (factory.store / "linked-ns").symlink_to(outside)
    (first.dir / "zz").symlink_to(outside / "ab")
    (first.dir / "cd").mkdir()
    (first.dir / "cd" / f"{'cd' * 16}.tp0of1pp0.kv").symlink_to(victims[0])
    factory.options["max_gb"] = 4.2 * file_bytes(kv) / (1 << 30)  # room for 4 chunk files
    worker = await fs_worker(kv)  # its open counts the store, links and all
    await worker.chores_done()
    assert int((factory.store / ".usage").read_text()) == 0, "nothing outside is counted"
    for _ in range(5):
        await kv.save(worker, kv.chunks(1))
    await worker.chores_done()
    assert worker.evictions == 1
    assert all(v.read_bytes() == b"x" * file_bytes(kv) for v in victims), "deleted outside"
    assert (first.dir / "cd" / f"{'cd' * 16}.tp0of1pp0.kv").is_symlink()
    on_disk = sum(p.stat().st_size for p in chunk_files(first.dir))
    assert int((factory.store / ".usage").read_text()) == on_disk <= 4.2 * file_bytes(kv)
