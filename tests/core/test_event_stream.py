"""kvflow.observe.stream on real runtimes: events reach a SUB, discovery, cleanup, stalled
readers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import zmq

from kvflow.observe.events import (
    Event,
    EventBus,
    LoadStarted,
    LookupRequested,
    Origin,
    TransferDone,
    TransferFailed,
)
from kvflow.observe.stream import (
    Envelope,
    EventPublisher,
    Registration,
    SeqTracker,
    decode_envelope,
    discover,
    open_subscriber,
    pid_alive,
    runtime_dir,
    start_publisher,
)
from kvflow.runtime import Runtime
from kvflow.zmqio import TrioSocket

MakeRuntime = Callable[..., Runtime]
WAIT = 10.0


@pytest.fixture
def rdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short runtime dir (ipc paths are limited to ~107 bytes)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="kvr"))


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    c.destroy(linger=0)


def probe() -> LookupRequested:
    return LookupRequested(req="probe", num_tokens=0, num_chunks=0)


def join(rt: Runtime, bus: EventBus, sub: zmq.Socket[Any], timeout: float = WAIT) -> None:
    """Emit probes until `sub` gets one: a SUB misses what is sent before it has joined."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rt.submit(bus.emit, probe())
        if sub.poll(20):
            return
    raise TimeoutError("subscriber never joined")


def recv_all(sub: zmq.Socket[Any], until: Callable[[Event], bool]) -> list[Envelope]:
    """Envelopes (probes left out) up to and including the first `until(event)`."""
    got: list[Envelope] = []
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if not sub.poll(int((deadline - time.monotonic()) * 1000) + 1):
            break
        env = decode_envelope(sub.recv())
        if env.event.req != "probe":
            got.append(env)
            if until(env.event):
                return got
    raise TimeoutError(f"stream ended early after {len(got)} events")


def make_events(n: int) -> list[Event]:
    evs: list[Event] = []
    for i in range(n):
        evs.append(LoadStarted(req=f"r{i}", chunks=2, tokens=64, nbytes=1 << 20, transport="fs"))
        evs.append(
            TransferDone(req=f"r{i}", direction="load", chunks=2, nbytes=1 << 20, elapsed_s=1e-3)
        )
    evs.append(TransferFailed(req="last", direction="save", reason="boom", block_ids=[1, 2]))
    return evs


def test_events_reach_a_subscriber_discovery_lists_it_shutdown_removes_it(
    make_runtime: MakeRuntime, rdir: Path, ctx: zmq.Context[Any]
) -> None:
    rt = make_runtime("pub")
    bus = EventBus(Origin("eng-1", "worker", 3))
    pub = start_publisher(rt, bus, directory=rdir)
    assert pub is not None
    (reg,) = discover(rdir)
    assert (reg.engine, reg.role, reg.rank, reg.pid) == ("eng-1", "worker", 3, os.getpid())
    assert reg.endpoint == f"ipc://{rdir}/eng-1-worker-3-{os.getpid()}.sock"
    assert abs(reg.started - time.time()) < 60
    assert rdir.stat().st_mode & 0o777 == 0o700

    sub = open_subscriber(reg.endpoint, ctx)
    join(rt, bus, sub)
    sent = make_events(50)
    for ev in sent:
        rt.submit(bus.emit, ev)
    got = recv_all(sub, lambda e: e.req == "last")
    assert [e.event for e in got] == sent  # same events, same order, origin stamped
    assert all(e.event.origin == Origin("eng-1", "worker", 3) for e in got)
    seqs = [e.seq for e in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(sent)))  # nothing missed
    assert all(e.dropped == 0 for e in got)

    twin = EventPublisher(bus.origin, directory=rdir)  # same origin, same process
    assert twin.endpoint == reg.endpoint.replace(".sock", "~2.sock")
    assert len(discover(rdir)) == 2
    twin.close()
    assert rt.shutdown(timeout=WAIT)
    assert discover(rdir) == []
    assert list(rdir.iterdir()) == []  # record and socket file are gone


def test_discovery_ignores_and_cleans_dead_or_reused_pids(rdir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead_pid = int(done.stdout)
    assert not pid_alive(dead_pid)

    def record(name: str, pid: int, proc_start: int = 0) -> Path:
        reg = Registration(
            engine=name, role="scheduler", rank=0, pid=pid,
            endpoint=f"ipc://{rdir}/{name}.sock", started=time.time(), proc_start=proc_start,
        )  # fmt: skip
        (rdir / f"{name}.sock").write_bytes(b"")
        path = rdir / f"{name}.json"
        path.write_bytes(msgspec.json.encode(reg))
        return path

    dead = record("dead", dead_pid)
    reused = record("reused", os.getpid(), proc_start=1)  # our pid, another process's start
    alive = record("alive", os.getpid())
    (rdir / "junk.json").write_bytes(b"not json")

    assert [r.engine for r in discover(rdir, clean=False)] == ["alive"]
    assert dead.exists() and reused.exists()
    assert [r.engine for r in discover(rdir)] == ["alive"]
    assert not dead.exists() and not (rdir / "dead.sock").exists()
    assert not reused.exists() and alive.exists()
    assert (rdir / "junk.json").exists()  # not ours to delete


def test_runtime_dir_choices(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVFLOW_RUNTIME_DIR", str(tmp_path / "x"))
    assert runtime_dir() == tmp_path / "x"
    monkeypatch.delenv("KVFLOW_RUNTIME_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert runtime_dir() == tmp_path / "xdg" / "kvflow"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    assert runtime_dir() == tmp_path / f"kvflow-{os.getuid()}"


def test_a_dir_of_another_user_or_a_bad_path_disables_publishing_with_a_warning(
    make_runtime: MakeRuntime, rdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rt = make_runtime("nopub")
    bus = EventBus(Origin("e", "scheduler"))
    caplog.set_level(logging.WARNING, "kvflow.event_stream")
    too_long = rdir / ("d" * 120)  # longer than an ipc path may be
    assert start_publisher(rt, bus, directory=too_long) is None
    if os.getuid() == 0:  # only root can hand a directory to someone else
        other = rdir / "other"
        other.mkdir(mode=0o700)
        os.chown(other, 4242, -1)
        assert start_publisher(rt, bus, directory=other) is None
        assert "belongs to uid 4242" in caplog.text
    assert "live events (inspect) disabled" in caplog.text
    bus.emit(probe())  # no subscriber was attached: emitting still works


def test_publisher_side_drops_are_counted_and_carried_in_the_next_message(
    make_runtime: MakeRuntime, rdir: Path, ctx: zmq.Context[Any]
) -> None:
    rt = make_runtime("drops")
    bus = EventBus(Origin("e", "worker"))
    pub = start_publisher(rt, bus, directory=rdir)
    assert pub is not None
    sub = open_subscriber(pub.endpoint, ctx)
    join(rt, bus, sub)
    real = pub._sock
    assert real is not None

    class Full:  # what a socket at its high-water mark answers (PUB itself drops silently)
        def send(self, data: bytes, flags: int) -> None:
            raise zmq.Again()

    def stall(n: int) -> None:
        pub._sock = Full()  # type: ignore[assignment]
        for _ in range(n):
            bus.emit(probe())
        pub._sock = real

    rt.submit(stall, 7)
    rt.submit(bus.emit, TransferFailed(req="after", direction="load", reason="x"))
    (env,) = recv_all(sub, lambda e: e.req == "after")
    assert pub.dropped == 7 and env.dropped == 7
    tracker = SeqTracker()
    tracker.see(Envelope(env.seq - 8, 0, probe()))
    assert tracker.see(env) == 7 and tracker.dropped == 7 + 7
    assert rt.shutdown(timeout=WAIT)
    bus.emit(probe())  # after close: counted, not raised
    assert pub.dropped == 8


def _emit_burst(rt: Runtime, bus: EventBus, n: int) -> None:
    """`n` events emitted back to back on the runtime's thread."""
    ev = TransferDone(
        req="cmpl-3f2a9c-0", direction="save", chunks=8, nbytes=1 << 22, elapsed_s=0.01
    )

    async def burst() -> None:
        for _ in range(n):
            bus.emit(ev)

    rt.call(burst, timeout=60)


class Reader(threading.Thread):
    """A subscriber that keeps up: a thread draining its own SUB socket."""

    def __init__(self, endpoint: str, ctx: zmq.Context[Any]) -> None:
        super().__init__(daemon=True)
        self.sock = open_subscriber(endpoint, ctx)
        self.received = 0
        self.stop = threading.Event()
        self.first = threading.Event()
        self.last_req = ""
        self.got_marker = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(20):
                while True:
                    try:
                        msg = self.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.received += 1
                    self.first.set()
                    if decode_envelope(msg).event.req == "marker":
                        self.got_marker.set()
        self.sock.close(linger=0)

    def join_publisher(self, rt: Runtime, bus: EventBus) -> None:
        deadline = time.monotonic() + WAIT
        while not self.first.wait(0.02):
            assert time.monotonic() < deadline, "reader never joined"
            rt.submit(bus.emit, probe())


def test_a_stalled_reader_does_not_hold_up_the_others_and_its_misses_are_counted(
    make_runtime: MakeRuntime, rdir: Path, ctx: zmq.Context[Any]
) -> None:
    # What emitting costs (with and without readers) is measured, not asserted:
    # `python bench/bench_event_stream.py`, figures in docs/inspect.md.
    n = 20_000  # per round; > SNDHWM + RCVHWM, so the stalled reader's queue overflows
    rt = make_runtime("stall")
    bus = EventBus(Origin("e", "worker"))
    pub = start_publisher(rt, bus, directory=rdir)
    assert pub is not None
    reader = Reader(pub.endpoint, ctx)
    reader.start()
    try:
        reader.join_publisher(rt, bus)
        stalled = open_subscriber(pub.endpoint, ctx, rcvhwm=1000)  # never read during bursts
        join(rt, bus, stalled)
        for _ in range(5):
            _emit_burst(rt, bus, n)
        # the stalled reader's queues are full: delivery to the live one goes on
        # (re-sent: a live reader that fell behind a burst may itself miss one)
        deadline = time.monotonic() + WAIT
        while not reader.got_marker.wait(0.05):
            assert time.monotonic() < deadline, "the live reader was held up by the stalled one"
            rt.submit(bus.emit, TransferFailed(req="marker", direction="load", reason="x"))
    finally:
        reader.stop.set()
        reader.join(WAIT)
    assert pub.dropped == 0  # PUB drops per subscriber, never at the publisher

    # what the stalled reader finally reads: what fitted in its queues, then a gap
    tracker = SeqTracker()
    first, received = 0, 0
    while stalled.poll(200):
        env = decode_envelope(stalled.recv())
        first = first or env.seq
        tracker.see(env)
        received += 1
    assert received + tracker.missed == tracker.last - first + 1
    assert received < n  # the tail of the bursts was dropped for this reader
    rt.submit(bus.emit, TransferFailed(req="after", direction="load", reason="x"))
    assert stalled.poll(int(WAIT * 1000))
    env = decode_envelope(stalled.recv())
    assert env.event.req == "after"
    tracker.see(env)
    # every event is either received or counted as missed: the count is exact
    assert received + 1 + tracker.missed == env.seq - first + 1
    assert tracker.missed > 4 * n


def test_readers_coming_and_going_switch_publishing_on_and_off(
    make_runtime: MakeRuntime, rdir: Path, ctx: zmq.Context[Any]
) -> None:
    rt = make_runtime("onoff")
    bus = EventBus(Origin("e", "worker"))
    pub = start_publisher(rt, bus, directory=rdir)
    assert pub is not None and not pub.watched
    for _ in range(2):
        sub = open_subscriber(pub.endpoint, ctx)
        join(rt, bus, sub)
        assert pub.watched
        sub.close(linger=0)
        deadline = time.monotonic() + WAIT  # the watcher learns of it asynchronously
        while pub.watched:
            assert time.monotonic() < deadline, "unsubscribe never seen"
            rt.call(trio.sleep, 0.01, timeout=WAIT)
    seq = pub._seq
    rt.call(_emit_many, bus, 100, timeout=WAIT)
    assert pub._seq == seq  # nobody watches: nothing encoded or sent


async def _emit_many(bus: EventBus, n: int) -> None:
    for _ in range(n):
        bus.emit(probe())


async def test_a_trio_subscriber_receives_events(
    make_runtime: MakeRuntime, rdir: Path, ctx: zmq.Context[Any]
) -> None:
    """The inspect CLI reads with a plain poll loop; a trio reader (TrioSocket) works too."""
    rt = make_runtime("triosub")
    bus = EventBus(Origin("e", "scheduler"))
    pub = start_publisher(rt, bus, directory=rdir)
    assert pub is not None
    sub = TrioSocket(open_subscriber(pub.endpoint, ctx))
    with trio.fail_after(WAIT):
        while True:
            rt.submit(bus.emit, probe())
            with trio.move_on_after(0.02):
                await sub.recv_multipart()
                break
        rt.submit(
            bus.emit, TransferDone(req="x", direction="load", chunks=1, nbytes=5, elapsed_s=1)
        )
        while True:
            (data,) = await sub.recv_multipart()
            if decode_envelope(data).event.req == "x":
                break
    sub.close()
    assert isinstance(pub, EventPublisher)
