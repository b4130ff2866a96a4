"""`kvflow inspect`: subscribe to running engines' live events; render them, or print JSON lines.

A plain loop over `zmq.Poller`, not trio: the CLI's only concurrency is "wait on N
SUB sockets or the next redraw / re-scan", which one poll call with a timeout does
directly; one socket per publisher keeps each publisher's sequence numbers apart so
missed events are counted per engine. The state lives in `inspect_state` (pure);
this module owns the sockets and the rich rendering.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..observe.log import read_event_log
from ..observe.stream import (
    Registration,
    SeqTracker,
    decode_envelope,
    discover,
    open_subscriber,
    runtime_dir,
)
from ..observe.timeline import Timeline, spread, timelines
from .inspect_state import EVENT_KINDS, EngineTotals, EventFilter, InspectState

__all__ = ["add_parser", "render", "run_inspect", "show_timeline"]

RESCAN_S = 1.0


# -- subscriptions -------------------------------------------------------------
@dataclass
class _Conn:
    endpoint: str
    sock: zmq.Socket[Any]
    reg: Registration | None = None
    engine: str = ""
    seq: SeqTracker = field(default_factory=SeqTracker)


class Subscriptions:
    """One SUB socket per publisher: `--connect` endpoints, or those `discover` finds."""

    def __init__(self, connect: list[str], directory: Path | None) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.directory = directory
        self.discovering = not connect
        self.conns: dict[str, _Conn] = {}
        self.poller = zmq.Poller()
        self._by_sock: dict[Any, _Conn] = {}
        for ep in connect:
            self._open(ep, None)

    def _open(self, endpoint: str, reg: Registration | None) -> _Conn:
        conn = _Conn(endpoint, open_subscriber(endpoint, self.ctx), reg, reg.engine if reg else "")
        self.conns[endpoint] = conn
        self._by_sock[conn.sock] = conn
        self.poller.register(conn.sock, zmq.POLLIN)
        return conn

    def rescan(self) -> tuple[list[_Conn], list[_Conn]]:
        """Connect to new publishers, drop those whose process died: (added, removed)."""
        if not self.discovering:
            return [], []
        regs = {r.endpoint: r for r in discover(self.directory)}
        added = [self._open(ep, r) for ep, r in regs.items() if ep not in self.conns]
        removed = [c for ep, c in self.conns.items() if ep not in regs]
        for c in removed:
            del self.conns[c.endpoint]
            del self._by_sock[c.sock]
            self.poller.unregister(c.sock)
            c.sock.close(linger=0)
        return added, removed

    def poll(self, timeout_s: float, batch: int = 2000) -> Iterator[tuple[_Conn, bytes]]:
        """Messages ready within `timeout_s` (at most `batch` per socket: redraws go on)."""
        for sock, _ in self.poller.poll(max(0, int(timeout_s * 1000))):
            conn = self._by_sock[sock]
            for _ in range(batch):
                try:
                    yield conn, sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break

    def close(self) -> None:
        for c in self.conns.values():
            c.sock.close(linger=0)
        self.ctx.term()


# -- rendering ---------------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def _short(engine: str) -> str:
    return engine[:12]


_STATE_STYLE = {
    "active": "cyan",
    "done": "green",
    "failed": "red",
    "timeout": "red",
    "lost": "yellow",
}


def render(state: InspectState, now: float, *, where: str = "", max_rows: int = 20) -> Group:
    """The live view: per-engine totals, transfers, the last errors."""
    engines = state.engines(now)
    live = sum(1 for e in engines if e.gone_at is None)
    head = Text.assemble(
        ("kvflow inspect", "bold"),
        f"  {live} engine(s) live  {state.events} events  ",
        (where, "dim"),
    )
    parts: list[Any] = [head, _engines_table(engines)]
    if any(e.tiers for e in engines):
        parts.append(_tiers_table(engines))
    parts.append(_transfers_table(state, now, max_rows))
    errors = state.errors(now)
    if errors:
        xt = Table(title="last errors", title_justify="left")
        for col in ("age", "engine", "request", "what", "reason"):
            xt.add_column(col)
        for x in errors:
            xt.add_row(f"{now - x.at:.0f}s", _short(x.engine), x.req, x.what, Text(x.reason, "red"))
        parts.append(xt)
    if not engines:
        parts.append(Text("no engines yet (vLLM with KVFlowConnector and inspect: true)", "dim"))
    return Group(*parts)


_ENGINE_COLUMNS = (
    "engine",
    "runtimes",
    "lookups",
    "hits",
    "misses",
    "tok loaded",
    "tok saved",
    "loaded",
    "saved",
    "sent",
    "exports",
    "failures",
    "timeouts",
    "lent",
    "dropped",
)


def _engines_table(engines: list[EngineTotals]) -> Table:
    et = Table(title="engines", title_justify="left", expand=False)
    for col in _ENGINE_COLUMNS:
        et.add_column(col, justify="left" if col == "engine" else "right")
    for e in engines:
        roles = sorted(e.runtimes)
        et.add_row(
            _short(e.engine) + (" (gone)" if e.gone_at is not None else ""),
            ",".join(f"{r[0][0]}{r[1]}" for r in roles),
            str(e.lookups),
            str(e.hits),
            str(e.misses),
            str(e.tokens_loaded),
            str(e.tokens_saved),
            human_bytes(e.bytes_loaded),
            human_bytes(e.bytes_saved),
            human_bytes(e.bytes_sent),
            str(e.exports),
            Text(str(e.failures), style="red" if e.failures else ""),
            Text(str(e.timeouts), style="red" if e.timeouts else ""),
            str(sum(e.lent.values())),
            Text(str(e.dropped), style="yellow" if e.dropped else ""),
            style="dim" if e.gone_at is not None else "",
        )
    return et


_TIER_COLUMNS = (
    "engine", "tier", "hits", "misses", "promoted", "stored", "through", "evicted", "read",
    "written",
)  # fmt: skip


def _tiers_table(engines: list[EngineTotals]) -> Table:
    """Each engine's tiers: the host tier (`cpu`) and a stack's top store."""
    tt = Table(title="tiers", title_justify="left", expand=False)
    for col in _TIER_COLUMNS:
        tt.add_column(col, justify="left" if col in ("engine", "tier") else "right")
    for e in engines:
        for name, t in sorted(e.tiers.items()):
            counts = (t.hits, t.misses, t.promoted, t.stored, t.through, t.evicted)
            tt.add_row(
                _short(e.engine), name, *map(str, counts),
                human_bytes(t.bytes_read), human_bytes(t.bytes_written),
            )  # fmt: skip
    return tt


def _transfers_table(state: InspectState, now: float, max_rows: int) -> Table:
    tt = Table(title="transfers", title_justify="left")
    for col in ("engine", "rank", "request", "dir", "transport", "chunks", "tokens", "bytes"):
        tt.add_column(
            col, justify="right" if col in ("rank", "chunks", "tokens", "bytes") else "left"
        )
    for col in ("elapsed", "GB/s", "state"):
        tt.add_column(col, justify="right" if col != "state" else "left")
    for t in state.transfers(now)[:max_rows]:
        gbps = t.gbps(now)
        tt.add_row(
            _short(t.engine),
            str(t.rank),
            t.req,
            t.direction,
            t.transport,
            str(t.chunks),
            str(t.tokens),
            human_bytes(t.nbytes),
            f"{t.elapsed(now) * 1000:.1f} ms",
            "" if gbps is None else f"{gbps:.2f}",
            Text(t.state, style=_STATE_STYLE.get(t.state, "")),
        )
    return tt


# -- the command -------------------------------------------------------------
def _split(values: list[str]) -> list[str]:
    return [v for arg in values for v in arg.split(",") if v]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show live kvflow events of running engines",
        description="Live view of running engines' kvflow transfers (or their events as JSON).",
    )
    p.add_argument(
        "--connect",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="subscribe to this publisher (repeatable); default: discover local engines",
    )
    p.add_argument(
        "--dir", default="", help="discovery directory (default: $KVFLOW_RUNTIME_DIR, ...)"
    )
    p.add_argument("--json", action="store_true", help="print one event per line, as JSON")
    p.add_argument("--engine", action="append", default=[], help="engine id prefix (repeatable)")
    p.add_argument("--req", action="append", default=[], help="request id prefix (repeatable)")
    p.add_argument(
        "--kind", action="append", default=[], help=f"event kind(s): {', '.join(EVENT_KINDS)}"
    )
    p.add_argument("--duration", type=float, default=0.0, help="exit after S seconds (0: never)")
    p.add_argument("--count", type=int, default=0, help="--json: exit after N events")
    p.add_argument("--refresh", type=float, default=0.25, help="seconds between redraws")
    p.add_argument(
        "--timeline",
        nargs="?",
        const="",
        default=None,
        metavar="REQ",
        help="P/D requests' timelines from --log: request REQ's (an id prefix, on either "
        "instance), or the spread of each gap over every request",
    )
    p.add_argument(
        "--log", default="", metavar="FILE", help="an event log (event_log, or --json's lines)"
    )
    p.set_defaults(fn=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    if args.timeline is not None:
        return show_timeline(args.log, args.timeline)
    try:
        filt = EventFilter(_split(args.engine), _split(args.req), set(_split(args.kind)))
    except ValueError as exc:
        print(f"kvflow inspect: {exc}", file=sys.stderr)
        return 2
    subs = Subscriptions(args.connect, Path(args.dir) if args.dir else None)
    try:
        return _loop(args, filt, subs)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `kvflow inspect --json | head`: the reader is done
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - so exit's flush is quiet
        return 0
    finally:
        subs.close()


def _loop(args: argparse.Namespace, filt: EventFilter, subs: Subscriptions) -> int:
    state = InspectState()
    out = sys.stdout
    encode = msgspec.json.Encoder().encode
    start = time.monotonic()
    deadline = start + args.duration if args.duration > 0 else math.inf
    next_scan = next_draw = start
    printed = 0
    where = ", ".join(args.connect) or str(subs.directory or runtime_dir())
    live = None if args.json else Live(console=Console(), auto_refresh=False)
    with live or contextlib.nullcontext():
        while True:
            now = time.monotonic()
            if now >= deadline:
                return 0
            if now >= next_scan:
                next_scan = now + RESCAN_S
                added, removed = subs.rescan()
                for c in added:
                    assert c.reg is not None
                    if filt.engine_ok(c.reg.engine):
                        state.engine_live(c.reg.engine, c.reg.role, c.reg.rank)
                    if args.json:
                        print(f"# subscribed {c.endpoint}", file=sys.stderr, flush=True)
                live_engines = {c.engine for c in subs.conns.values()}
                for c in removed:
                    if c.engine not in live_engines:
                        state.engine_gone(c.engine, now)
            wake = min(next_scan, deadline, next_draw if live else math.inf)
            for conn, data in subs.poll(wake - now):
                try:
                    env = decode_envelope(data)
                except msgspec.DecodeError:  # not kvflow's, or a newer kvflow's event
                    continue
                ev = env.event
                conn.engine = conn.engine or ev.origin.engine
                if (conn.seq.see(env) or env.dropped) and filt.engine_ok(conn.engine):
                    state.set_dropped(conn.engine, conn.endpoint, conn.seq.dropped)
                if not filt.match(ev):
                    continue
                if live is None:
                    out.write(encode(ev).decode() + "\n")
                    out.flush()
                    printed += 1
                    if args.count and printed >= args.count:
                        return 0
                else:
                    state.feed(ev, time.monotonic())
            now = time.monotonic()
            if live is not None and now >= next_draw:
                next_draw = now + args.refresh
                live.update(render(state, now, where=where), refresh=True)


# -- timelines ---------------------------------------------------------------
def show_timeline(log: str, req: str, console: Console | None = None) -> int:
    """`--timeline`: one P/D request's stages (the first whose consumer or producer
    request id starts with `req`), or, with `req` "", each gap's spread over the log."""
    console = console or Console()
    if not log:
        print("kvflow inspect: --timeline reads an event log: give --log FILE", file=sys.stderr)
        return 2
    try:
        lines = timelines(read_event_log(log))
    except (OSError, msgspec.DecodeError) as exc:
        print(f"kvflow inspect: {log}: {exc}", file=sys.stderr)
        return 2
    if not req:
        console.print(_spread_table(lines, log))
        return 0
    found = [t for t in lines if t.req.startswith(req) or t.producer_req.startswith(req)]
    if not found:
        print(f"kvflow inspect: no P/D request {req!r} in {log}", file=sys.stderr)
        return 1
    console.print(_timeline_table(found[0]))
    return 0


def _timeline_table(t: Timeline) -> Table:
    table = Table(title=f"{t.req} (producer: {t.producer_req or '?'})", title_justify="left")
    for col in ("ms", "+ms", "stage", "where", "detail"):
        table.add_column(col, justify="right" if "ms" in col else "left")
    t0 = prev = t.marks[0].ts
    for m in t.marks:
        table.add_row(
            f"{(m.ts - t0) * 1e3:.1f}", f"{(m.ts - prev) * 1e3:.1f}", m.stage, m.where, m.detail
        )
        prev = m.ts
    return table


def _spread_table(lines: list[Timeline], log: str) -> Table:
    table = Table(title=f"{len(lines)} P/D requests in {log} (ms)", title_justify="left")
    for col in ("gap", "requests", "p50", "p90", "p99", "max"):
        table.add_column(col, justify="left" if col == "gap" else "right")
    for s in spread(lines):
        ms = (f"{v * 1e3:.1f}" for v in (s.p50, s.p90, s.p99, s.max))
        table.add_row(s.name, str(s.n), *ms)
    return table
