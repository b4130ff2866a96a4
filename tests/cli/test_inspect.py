"""`kvflow inspect`: the state model, `--json` against a real runtime, the live view in a
real pseudo-terminal against a real vLLM engine."""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import io
import os
import random
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
from rich.console import Console

from kvflow.cli.inspect import human_bytes, render
from kvflow.cli.inspect_state import EVENT_KINDS, EventFilter, InspectState
from kvflow.observe.events import (
    BlocksReleased,
    Event,
    EventBus,
    LayerLoaded,
    LoadStarted,
    LookupAnswered,
    LookupRequested,
    Origin,
    RequestFinished,
    SaveStarted,
    TaskFailed,
    TierRead,
    TierWrite,
    TransferDone,
    TransferFailed,
)
from kvflow.observe.stream import discover, start_publisher
from kvflow.runtime import Runtime

MakeRuntime = Callable[..., Runtime]
WAIT = 20.0
A = Origin("engine-a", "worker", 0)
S = Origin("engine-a", "scheduler", 0)


def at(origin: Origin, ev: Event) -> Event:
    ev.origin = origin
    return ev


# -- the state model ----------------------------------------------------------


def test_a_save_then_a_load_become_rows_and_totals() -> None:
    st = InspectState()
    st.feed(at(S, LookupAnswered(req="r1", hit_tokens=0, elapsed_s=1e-3)), now=1.0)
    st.feed(at(A, SaveStarted(req="r1", chunks=3, tokens=96, nbytes=3 << 20, transport="fs")), 2.0)
    (row,) = st.transfers(now=2.5)
    assert (row.req, row.direction, row.transport, row.state) == ("r1", "save", "fs", "active")
    assert row.elapsed(2.5) == 0.5 and row.gbps(2.5) is None  # not known to have moved yet
    st.feed(
        at(A, TransferDone(req="r1", direction="save", chunks=3, nbytes=3 << 20, elapsed_s=0.01)),
        3.0,
    )
    st.feed(at(S, LookupAnswered(req="r2", hit_tokens=96, elapsed_s=1e-3)), 4.0)
    st.feed(at(A, LoadStarted(req="r2", chunks=3, tokens=95, nbytes=3 << 20, transport="fs")), 5.0)
    load, save = st.transfers(now=6.0)  # active first, then ended (newest first)
    assert (load.req, load.state, save.req, save.state) == ("r2", "active", "r1", "done")
    assert save.elapsed(100.0) == 0.01  # the publisher's own measure, frozen
    assert save.gbps(100.0) == pytest.approx((3 << 20) / 0.01 / 1e9)
    st.feed(
        at(A, TransferDone(req="r2", direction="load", chunks=3, nbytes=3 << 20, elapsed_s=0.02)),
        6.0,
    )
    assert [(t.req, t.state) for t in st.transfers(7.0)] == [("r2", "done"), ("r1", "done")]
    (tot,) = st.engines(7.0)
    assert (tot.engine, tot.runtimes) == ("engine-a", {("scheduler", 0), ("worker", 0)})
    assert (tot.lookups, tot.hits, tot.misses, tot.hit_tokens) == (2, 1, 1, 96)
    assert (tot.saves, tot.tokens_saved, tot.bytes_saved) == (1, 96, 3 << 20)
    assert (tot.loads, tot.tokens_loaded, tot.bytes_loaded) == (1, 95, 3 << 20)
    assert (tot.failures, tot.timeouts, st.errors(7.0)) == (0, 0, [])


def test_failures_timeouts_and_the_last_errors() -> None:
    st = InspectState(keep_errors=2)
    st.feed(at(A, LoadStarted(req="r1", chunks=1, tokens=32, nbytes=100, transport="fs")), 1.0)
    st.feed(at(A, TransferFailed(req="r1", direction="load", reason="ChunkMissing: k")), 1.5)
    st.feed(at(A, TransferFailed(req="r2", direction="save", reason="slow", timed_out=True)), 2.0)
    st.feed(at(S, LookupAnswered(req="r3", hit_tokens=0, elapsed_s=5, error="lookup timeout")), 3)
    r1 = next(t for t in st.transfers(4.0) if t.req == "r1")
    assert (r1.state, r1.reason, r1.elapsed(9.0), r1.gbps(9.0)) == (
        "failed",
        "ChunkMissing: k",
        0.5,
        None,
    )
    assert [t.state for t in st.transfers(4.0) if t.req == "r2"] == ["timeout"]
    (tot,) = st.engines(4.0)
    assert (tot.failures, tot.timeouts, tot.misses) == (3, 2, 1)
    assert [(e.req, e.what) for e in st.errors(4.0)] == [("r3", "lookup"), ("r2", "save")]


def test_concurrent_saves_of_one_request_end_in_order_and_sends_have_no_start() -> None:
    st = InspectState()
    for i, tokens in enumerate((64, 32)):
        ev = SaveStarted(req="r", chunks=2 - i, tokens=tokens, nbytes=tokens, transport="fs")
        st.feed(at(A, ev), float(i))
    st.feed(at(A, TransferDone(req="r", direction="save", chunks=2, nbytes=64, elapsed_s=1)), 3)
    (active,) = [t for t in st.transfers(4) if t.state == "active"]
    assert active.tokens == 32
    st.feed(at(A, TransferDone(req="p", direction="send", chunks=4, nbytes=512, elapsed_s=2)), 5)
    send = st.transfers(6)[1]
    assert (send.req, send.direction, send.nbytes, send.state) == ("p", "send", 512, "done")
    (tot,) = st.engines(6)
    assert (tot.saves, tot.tokens_saved, tot.sends, tot.bytes_sent) == (1, 64, 1, 512)


def test_a_hidden_state_export_is_an_export_next_to_the_kv_save_of_its_request() -> None:
    st = InspectState()
    kv = SaveStarted(req="r", chunks=2, tokens=64, nbytes=64, transport="fs")
    hs = SaveStarted(req="r", chunks=2, tokens=63, nbytes=9, transport="fs", what="hidden_states")
    st.feed(at(A, kv), 1.0)
    st.feed(at(A, hs), 1.1)
    done = TransferDone(req="r", direction="save", chunks=2, nbytes=9, elapsed_s=1)
    st.feed(at(A, msgspec.structs.replace(done, what="hidden_states")), 2.0)
    active, export = st.transfers(3.0)
    assert (active.direction, active.state, export.direction, export.tokens) == (
        "save",
        "active",
        "export",
        63,
    )
    (tot,) = st.engines(3.0)
    assert (tot.saves, tot.exports, tot.bytes_saved) == (0, 1, 0)


def test_lent_blocks_until_released_and_dropped_events_per_publisher() -> None:
    st = InspectState()
    st.feed(at(S, RequestFinished(req="r1", lent=True, blocks=3)), 1)
    st.feed(at(S, RequestFinished(req="r2", lent=True, blocks=5)), 1)
    st.feed(at(S, RequestFinished(req="r3", lent=False)), 1)
    st.feed(at(A, BlocksReleased(req="r1")), 2)
    st.set_dropped("engine-a", "ipc://a", 5)
    st.set_dropped("engine-a", "ipc://b", 2)
    st.set_dropped("engine-a", "ipc://a", 7)
    (tot,) = st.engines(3)
    assert (tot.lent, tot.dropped) == ({"r2": 5}, 9)


def test_an_engine_that_vanishes_loses_its_transfers_and_is_forgotten() -> None:
    st = InspectState(forget_s=10)
    b = Origin("engine-b", "worker", 1)
    st.engine_live("engine-a", "worker", 0)
    st.feed(at(A, LoadStarted(req="a1", chunks=1, tokens=1, nbytes=1, transport="fs")), 1)
    st.feed(at(b, LoadStarted(req="b1", chunks=1, tokens=1, nbytes=1, transport="fs")), 1)
    st.feed(at(b, TransferFailed(req="b0", direction="save", reason="x")), 1)
    st.engine_gone("engine-b", now=2)
    assert {(t.req, t.state) for t in st.transfers(3)} == {
        ("a1", "active"),
        ("b1", "lost"),
        ("b0", "failed"),
    }
    assert [(e.engine, e.gone_at) for e in st.engines(3)] == [("engine-a", None), ("engine-b", 2)]
    assert [t.req for t in st.transfers(12)] == ["a1"]  # forgotten with its rows and errors
    assert [e.engine for e in st.engines(12)] == ["engine-a"] and st.errors(12) == []
    st.engine_live("engine-b", "worker", 1)  # back again (restarted with the same id)
    assert [e.engine for e in st.engines(13)] == ["engine-a", "engine-b"]


def test_filters_match_prefixes_and_event_kinds() -> None:
    ev = at(A, LayerLoaded(req="cmpl-12-0", layer=3))
    assert EventFilter().match(ev)
    assert EventFilter(engines=["engine-"], reqs=["cmpl-1"], kinds={"LayerLoaded"}).match(ev)
    assert not EventFilter(engines=["engine-b"]).match(ev)
    assert EventFilter(engines=["x", "engine-a"]).engine_ok("engine-a")
    assert not EventFilter(reqs=["cmpl-2"]).match(ev)
    assert not EventFilter(kinds={"LoadStarted"}).match(ev)
    with pytest.raises(ValueError, match=r"unknown event kind.*Nope.*valid: LookupRequested"):
        EventFilter(kinds={"Nope"})
    assert "TransferDone" in EVENT_KINDS and len(EVENT_KINDS) == 25


def test_render_shows_engines_transfers_and_errors() -> None:
    st = InspectState()
    st.feed(at(A, SaveStarted(req="r1", chunks=3, tokens=96, nbytes=3 << 20, transport="fs")), 1)
    st.feed(
        at(A, TransferDone(req="r1", direction="save", chunks=3, nbytes=3 << 20, elapsed_s=0.002)),
        2,
    )
    st.feed(at(A, TransferFailed(req="r9", direction="load", reason="ChunkCorrupt: crc")), 2)
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(render(st, 3.0))
    text = console.export_text()
    assert "engine-a" in text and "w0" in text
    row = next(line for line in text.splitlines() if " r1 " in line)
    assert "save" in row and "3.0 MiB" in row and "done" in row and "1.57" in row  # GB/s
    assert "ChunkCorrupt: crc" in text and "last errors" in text
    assert human_bytes(0) == "0 B" and human_bytes(1536) == "1.5 KiB"


def test_tier_reads_and_writes_are_totals_per_engine_and_tier() -> None:
    """The host tier's and a stack's `TierRead` / `TierWrite` events: a "tiers" table."""
    st = InspectState()
    write = TierWrite(req="s", tier="cpu", stored=7, through=1, evicted=2, nbytes=7 << 20)
    st.feed(at(A, write), 1)
    st.feed(at(A, TierRead(req="l", tier="cpu", hits=5, misses=2, promoted=2, nbytes=5 << 20)), 2)
    st.feed(at(A, TierRead(req="l", tier="fs", hits=1, misses=1, promoted=1, nbytes=0)), 2)
    cpu = st.engines(3.0)[0].tiers["cpu"]
    assert (cpu.hits, cpu.misses, cpu.promoted, cpu.stored, cpu.through, cpu.evicted) == (
        5, 2, 2, 7, 1, 2,
    )  # fmt: skip
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(render(st, 3.0))
    text = console.export_text()
    row = next(line for line in text.splitlines() if " cpu " in line)
    cells = [c.strip() for c in row.split("│") if c.strip()]
    assert cells[2:] == ["5", "2", "2", "7", "1", "2", "5.0 MiB", "7.0 MiB"], row
    assert "tiers" in text and any(" fs " in line for line in text.splitlines())


# -- --json against a real runtime --------------------------------------------


@pytest.fixture
def rdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvr"))  # short: ipc paths are limited to ~107 bytes


def _env(rdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return dict(env, KVFLOW_RUNTIME_DIR=str(rdir), PYTHONUNBUFFERED="1")


class Lines:
    """Lines of a trio process's stdout, with bounded waits."""

    def __init__(self, proc: trio.Process) -> None:
        assert proc.stdout is not None
        self.stream = proc.stdout
        self.buf = b""

    async def next(self, timeout: float) -> str | None:
        with trio.move_on_after(timeout):
            while b"\n" not in self.buf:
                data = await self.stream.receive_some()
                if not data:
                    raise EOFError(self.buf)
                self.buf += data
            line, _, self.buf = self.buf.partition(b"\n")
            return line.decode()
        return None


@pytest.mark.parametrize("filtered", [False, True])
async def test_json_prints_each_published_event_as_a_line(
    make_runtime: MakeRuntime, rdir: Path, filtered: bool
) -> None:
    rt = make_runtime("jsonpub")
    bus = EventBus(Origin("eng-1", "worker", 2))
    pub = start_publisher(rt, bus, directory=rdir)
    assert pub is not None
    sent: list[Event] = [
        LoadStarted(req="r1-x", chunks=2, tokens=64, nbytes=1 << 20, transport="fs"),
        LayerLoaded(req="r1-x", layer=0),
        TransferDone(req="r1-x", direction="load", chunks=2, nbytes=1 << 20, elapsed_s=1e-3),
        TransferDone(req="r2-x", direction="save", chunks=1, nbytes=5, elapsed_s=2e-3),
        TransferFailed(req="last", direction="save", reason="boom", block_ids=[4], timed_out=True),
    ]
    if filtered:  # found by discovery
        args = ["--kind", "LookupRequested,TransferDone", "--kind", "TransferFailed"]
        args += ["--req", "probe", "--req", "r1", "--req", "last", "--engine", "eng-"]
    else:  # named
        args = ["--connect", pub.endpoint]
    cmd = [sys.executable, "-m", "kvflow.cli.main", "inspect", "--json", "--duration", "60"]
    proc = await trio.lowlevel.open_process(cmd + args, stdout=subprocess.PIPE, env=_env(rdir))
    try:
        lines = Lines(proc)
        with trio.fail_after(WAIT):  # probe until the CLI has joined (a SUB misses earlier ones)
            while (line := await lines.next(0.05)) is None:
                rt.submit(bus.emit, LookupRequested(req="probe", num_tokens=0, num_chunks=0))
        for ev in sent:
            rt.submit(bus.emit, ev)
        got: list[Event] = []
        decode = msgspec.json.Decoder(Event).decode
        with trio.fail_after(WAIT):
            while not got or got[-1].req != "last":
                line = await lines.next(WAIT)
                assert line is not None
                ev = decode(line)
                if ev.req != "probe":
                    got.append(ev)
    finally:
        proc.kill()
        await proc.wait()
    want = [sent[2], sent[4]] if filtered else sent
    assert got == want  # every field, timestamps and origin included
    assert all(e.origin == Origin("eng-1", "worker", 2) for e in got)


def test_a_bad_kind_is_refused_with_the_valid_ones(rdir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "inspect", "--kind", "Bogus", "--json"],
        capture_output=True,
        text=True,
        env=_env(rdir),
        timeout=60,
    )
    assert done.returncode == 2
    assert "unknown event kind(s) Bogus; valid: LookupRequested" in done.stderr


# -- the live view in a pseudo-terminal, against a real vLLM engine ------------


class Screen:
    """Enough of a terminal for rich.live: text, CR/LF, cursor up, erase line; no colours."""

    CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")  # chunks split chars
        self.lines: list[str] = [""]
        self.row = 0
        self.col = 0

    def feed(self, data: bytes) -> None:
        text = self.decoder.decode(data)
        pos = 0
        for m in self.CSI.finditer(text):
            self._text(text[pos : m.start()])
            pos = m.end()
            arg, op = m.group(1), m.group(2)
            if op == "A":
                self.row = max(0, self.row - int(arg or 1))
            elif op == "K":
                self.lines[self.row] = "" if arg == "2" else self.lines[self.row][: self.col]
            elif op == "G":
                self.col = int(arg or 1) - 1
        self._text(text[pos:])

    def _text(self, s: str) -> None:
        for part in re.split(r"(\r|\n)", s):
            if part == "\r":
                self.col = 0
            elif part == "\n":
                self.row, self.col = self.row + 1, 0
                if self.row == len(self.lines):
                    self.lines.append("")
            elif part:
                line = self.lines[self.row].ljust(self.col)
                self.lines[self.row] = line[: self.col] + part + line[self.col + len(part) :]
                self.col += len(part)

    @property
    def text(self) -> str:
        return "\n".join(line.rstrip() for line in self.lines).strip("\n")


class PtyInspect:
    """`kvflow inspect` on a real pseudo-terminal of 60 x 200."""

    def __init__(self, rdir: Path, *args: str) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 200, 0, 0))
        env = dict(_env(rdir), TERM="xterm-256color")
        env.pop("NO_COLOR", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvflow.cli.main", "inspect", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            close_fds=True,
        )
        os.close(slave)
        self.master = master
        self.screen = Screen()
        self.raw = b""

    def _read(self, timeout: float) -> bool:
        if not select.select([self.master], [], [], timeout)[0]:
            return True
        try:
            data = os.read(self.master, 1 << 16)
        except OSError:  # EIO: the process closed the terminal
            return False
        self.raw += data
        self.screen.feed(data)
        return bool(data)

    def wait_for(self, what: str, ok: Callable[[str], bool], timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while not ok(self.screen.text):
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.5)):
                raise AssertionError(f"screen never showed {what}:\n{self.screen.text}")
        return self.screen.text

    def stop(self) -> str:
        """SIGINT, like a user's Ctrl-C; the last frame stays on the screen."""
        self.proc.send_signal(signal.SIGINT)
        with contextlib.suppress(AssertionError):
            self.wait_for("exit", lambda _: self.proc.poll() is not None, timeout=20)
        while self._read(0.1) and select.select([self.master], [], [], 0)[0]:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)
        return self.screen.text


def _row(text: str, req: str, direction: str) -> str | None:
    for line in text.splitlines():
        if req in line and f" {direction} " in line and " done" in line:
            return line
    return None


def _nonzero_bytes(line: str) -> bool:
    m = re.search(r"(\d+(?:\.\d+)?) (B|KiB|MiB|GiB) ", line)
    return m is not None and float(m.group(1)) > 0


@pytest.fixture(scope="module")
def engine_env() -> Iterator[dict[str, Any]]:
    """One real vLLM engine (fs transport, prefix caching off) publishing to a fresh dir."""
    from ..support.vllm_engines import ServingEngine

    tmp = Path(tempfile.mkdtemp(prefix="kvi"))
    rdir = tmp / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVFLOW_RUNTIME_DIR", str(rdir))
        engine = ServingEngine(
            tmp, "inspect", extra_config={"transport": "fs", "options": {"path": str(tmp / "kv")}}
        )
    try:
        engine.wait_ready()
        yield {"engine": engine, "rdir": rdir, "tmp": tmp}
    finally:
        engine.close()


@pytest.mark.engine
def test_live_view_in_a_terminal_shows_a_real_engines_save_and_load(
    engine_env: dict[str, Any],
) -> None:
    engine, rdir = engine_env["engine"], engine_env["rdir"]
    regs = discover(rdir)
    assert {r.role for r in regs} == {"scheduler", "worker"}, regs
    engine_id = regs[0].engine
    view = PtyInspect(rdir, "--refresh", "0.2", "--duration", "300")
    try:
        view.wait_for("the engine", lambda s: engine_id[:12] in s and "s0,w0" in s)
        rng = random.Random(5)
        # warm up until a save shows: the view joins each publisher asynchronously
        for _ in range(5):
            rid = engine.ask([rng.randrange(3, 1000) for _ in range(70)], max_tokens=2).request_id
            with contextlib.suppress(AssertionError):
                view.wait_for("a warm-up save", lambda s, r=rid: bool(_row(s, r, "save")), 15)
                break
        else:
            raise AssertionError("no save shown after 5 requests")
        prompt = [rng.randrange(3, 1000) for _ in range(200)]
        cold = engine.ask(prompt, max_tokens=4)
        warm2 = engine.ask(prompt, max_tokens=4)  # prefix caching is off: loaded from fs
        assert not cold.error and not warm2.error and cold.tokens == warm2.tokens
        text = view.wait_for(
            "a done save and a done load",
            lambda s: _row(s, cold.request_id, "save") and _row(s, warm2.request_id, "load"),
        )
        save, load = _row(text, cold.request_id, "save"), _row(text, warm2.request_id, "load")
        assert save is not None and load is not None
        assert " fs " in save and _nonzero_bytes(save), save
        assert " fs " in load and _nonzero_bytes(load), load
        engine_line = next(line for line in text.splitlines() if engine_id[:12] in line)
        cells = [c.strip() for c in engine_line.split("│")[1:-1]]
        assert cells[1] == "s0,w0", engine_line
        lookups, hits, misses, tok_loaded, tok_saved = map(int, cells[2:7])
        assert lookups >= 3 and hits >= 1 and misses >= 2, engine_line
        assert tok_loaded >= 199 and tok_saved >= 270, engine_line
        assert cells[10:12] == ["0", "0"], engine_line  # no failures, no timeouts
        shown = view.wait_for("a whole frame", lambda s: s.endswith("┘"))
        # then the engine goes away: the view says so, and discovery forgets it
        engine.close()
        gone = view.wait_for("the engine gone", lambda s: "(gone)" in s and s.endswith("┘"))
        assert discover(rdir) == []
    finally:
        final = view.stop()
    capture = engine_env["tmp"] / "inspect-screen.txt"
    capture.write_text(f"{shown}\n\n{gone}\n\n{final}\n")
    print(f"\n{shown}\n\nafter the engine exited:\n{gone}\n(saved to {capture})")


def test_a_failed_task_is_an_error_row() -> None:
    state = InspectState()
    state.feed(at(A, TaskFailed(task="zmq:serve", error="OSError: gone")), 1.0)
    state.feed(at(A, TaskFailed(task="zmq:serve", error="OSError: gone", given_up=True)), 2.0)
    rows = state.errors(3.0)
    assert [(r.what, r.reason) for r in rows] == [
        ("zmq:serve", "OSError: gone (given up: the engine stops)"),
        ("zmq:serve", "OSError: gone (started again)"),
    ]
