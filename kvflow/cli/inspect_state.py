"""What `kvflow inspect` knows, built from events alone: transfers, per-engine totals, errors.

Pure (no I/O, no clock: callers pass `now`), so it is tested by feeding events and
reading the rows back; `kvflow.cli.inspect` only renders it.
"""

from __future__ import annotations

import typing
from collections import deque
from dataclasses import dataclass, field

from ..observe.events import (
    BlocksReleased,
    Event,
    LoadStarted,
    LookupAnswered,
    RequestFinished,
    SaveStarted,
    TaskFailed,
    TierRead,
    TierWrite,
    TransferDone,
    TransferFailed,
)

__all__ = [
    "EVENT_KINDS",
    "EngineTotals",
    "ErrorRow",
    "EventFilter",
    "InspectState",
    "TierTotals",
    "Transfer",
]

EVENT_KINDS: tuple[str, ...] = tuple(t.__name__ for t in typing.get_args(Event))


def _save_kind(ev: SaveStarted) -> str:
    """A KV save is a `save`; a request's hidden states going to the store an `export`."""
    return "save" if ev.what == "kv" else "export"


@dataclass
class EventFilter:
    """`--engine` / `--req` (prefixes: ids are long) and `--kind` (exact class names)."""

    engines: list[str] = field(default_factory=list)
    reqs: list[str] = field(default_factory=list)
    kinds: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        bad = self.kinds - set(EVENT_KINDS)
        if bad:
            raise ValueError(
                f"unknown event kind(s) {', '.join(sorted(bad))}; valid: {', '.join(EVENT_KINDS)}"
            )

    def engine_ok(self, engine: str) -> bool:
        return not self.engines or engine.startswith(tuple(self.engines))

    def match(self, ev: Event) -> bool:
        return (
            (not self.kinds or type(ev).__name__ in self.kinds)
            and self.engine_ok(ev.origin.engine)
            and (not self.reqs or ev.req.startswith(tuple(self.reqs)))
        )


@dataclass
class Transfer:
    """One load, save or send, from its start event (or its end, for `send`) to its end."""

    engine: str
    rank: int
    req: str
    direction: str
    transport: str = ""
    chunks: int = 0
    tokens: int = 0
    nbytes: int = 0
    started: float = 0.0
    """Local time it was seen to start (the reader's clock: the publisher's may differ)."""
    elapsed_s: float | None = None
    """The publisher's measured duration, once ended."""
    state: str = "active"
    """active, done, failed, timeout, or lost (its engine vanished)."""
    reason: str = ""

    def elapsed(self, now: float) -> float:
        return self.elapsed_s if self.elapsed_s is not None else max(0.0, now - self.started)

    def gbps(self, now: float) -> float | None:
        """Bytes over time; None while active (the bytes are not known to have moved yet)."""
        t = self.elapsed(now)
        return self.nbytes / t / 1e9 if self.state == "done" and t > 0 else None


@dataclass
class TierTotals:
    """One tier's chunks and bytes (`TierRead` / `TierWrite` events, `kvflow.tiers`)."""

    hits: int = 0
    misses: int = 0
    promoted: int = 0
    stored: int = 0
    through: int = 0
    evicted: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass
class EngineTotals:
    engine: str
    runtimes: set[tuple[str, int]] = field(default_factory=set)
    gone_at: float | None = None
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    loads: int = 0
    tokens_loaded: int = 0
    bytes_loaded: int = 0
    saves: int = 0
    tokens_saved: int = 0
    bytes_saved: int = 0
    sends: int = 0
    bytes_sent: int = 0
    exports: int = 0
    """Hidden-state saves done (`kvflow.hidden_states`)."""
    failures: int = 0
    timeouts: int = 0
    lent: dict[str, int] = field(default_factory=dict)
    """Blocks vLLM lent to kvflow, by request, not released yet."""
    dropped_by: dict[str, int] = field(default_factory=dict)
    """Events this reader missed, per publisher endpoint."""
    tiers: dict[str, TierTotals] = field(default_factory=dict)
    """By tier name (`cpu`, a stack's top store)."""

    @property
    def dropped(self) -> int:
        return sum(self.dropped_by.values())


@dataclass
class ErrorRow:
    at: float
    engine: str
    req: str
    what: str
    reason: str


_Key = tuple[str, int, str, str]


def _tier(t: TierTotals, ev: TierRead | TierWrite) -> None:
    t.evicted += ev.evicted
    if isinstance(ev, TierRead):
        t.hits += ev.hits
        t.misses += ev.misses
        t.promoted += ev.promoted
        t.bytes_read += ev.nbytes
    else:
        t.stored += ev.stored
        t.through += ev.through
        t.bytes_written += ev.nbytes


class InspectState:
    """Feed events (`feed`) and engine comings and goings; read rows, totals, errors."""

    def __init__(self, *, keep_done: int = 12, keep_errors: int = 8, forget_s: float = 30.0):
        self.forget_s = forget_s
        self._engines: dict[str, EngineTotals] = {}
        self._active: dict[_Key, deque[Transfer]] = {}
        self._done: deque[Transfer] = deque(maxlen=keep_done)
        self._errors: deque[ErrorRow] = deque(maxlen=keep_errors)
        self.events = 0

    # -- input -------------------------------------------------------------
    def engine(self, engine: str) -> EngineTotals:
        tot = self._engines.get(engine)
        if tot is None:
            tot = self._engines[engine] = EngineTotals(engine)
        return tot

    def engine_live(self, engine: str, role: str, rank: int) -> None:
        tot = self.engine(engine)
        tot.runtimes.add((role, rank))
        tot.gone_at = None

    def engine_gone(self, engine: str, now: float) -> None:
        """Its processes died: its unfinished transfers will never end."""
        tot = self._engines.get(engine)
        if tot is None or tot.gone_at is not None:
            return
        tot.gone_at = now
        for key in [k for k in self._active if k[0] == engine]:
            for t in self._active.pop(key):
                t.state, t.reason = "lost", "engine gone"
                self._done.append(t)

    def set_dropped(self, engine: str, endpoint: str, n: int) -> None:
        self.engine(engine).dropped_by[endpoint] = n

    def feed(self, ev: Event, now: float) -> None:
        self.events += 1
        o = ev.origin
        tot = self.engine(o.engine)
        tot.runtimes.add((o.role, o.rank))
        if isinstance(ev, LookupAnswered):
            tot.lookups += 1
            if ev.hit_tokens > 0:
                tot.hits += 1
                tot.hit_tokens += ev.hit_tokens
            else:
                tot.misses += 1
            if ev.error:
                tot.failures += 1
                tot.timeouts += "timeout" in ev.error
                self._errors.append(ErrorRow(now, o.engine, ev.req, "lookup", ev.error))
        elif isinstance(ev, (LoadStarted, SaveStarted)):
            direction = "load" if isinstance(ev, LoadStarted) else _save_kind(ev)
            t = Transfer(
                o.engine, o.rank, ev.req, direction, ev.transport, ev.chunks, ev.tokens, ev.nbytes
            )
            t.started = now
            self._active.setdefault((o.engine, o.rank, ev.req, direction), deque()).append(t)
        elif isinstance(ev, (TransferDone, TransferFailed)):
            self._end(tot, ev, now)
        elif isinstance(ev, RequestFinished):
            if ev.lent:
                tot.lent[ev.req] = ev.blocks
        elif isinstance(ev, BlocksReleased):
            tot.lent.pop(ev.req, None)
        elif isinstance(ev, (TierRead, TierWrite)):
            _tier(tot.tiers.setdefault(ev.tier, TierTotals()), ev)
        elif isinstance(ev, TaskFailed):  # a supervised task: restarted, or the engine stops
            then = "given up: the engine stops" if ev.given_up else "started again"
            self._errors.append(ErrorRow(now, o.engine, "", ev.task, f"{ev.error} ({then})"))

    def _end(self, tot: EngineTotals, ev: TransferDone | TransferFailed, now: float) -> None:
        o = ev.origin
        direction = ev.direction if ev.what == "kv" else "export"
        key = (o.engine, o.rank, ev.req, direction)
        queue = self._active.get(key)
        if queue:
            t = queue.popleft()  # same request, same direction: they end in start order
            if not queue:
                del self._active[key]
        else:  # `send` has no start event; or we joined after it started
            t = Transfer(o.engine, o.rank, ev.req, direction, started=now)
        if isinstance(ev, TransferDone):
            t.state, t.elapsed_s, t.chunks, t.nbytes = "done", ev.elapsed_s, ev.chunks, ev.nbytes
            if direction == "export":
                tot.exports += 1
            elif ev.direction == "load":
                tot.loads += 1
                tot.tokens_loaded += t.tokens
                tot.bytes_loaded += t.nbytes
            elif ev.direction == "save":
                tot.saves += 1
                tot.tokens_saved += t.tokens
                tot.bytes_saved += t.nbytes
            else:
                tot.sends += 1
                tot.bytes_sent += t.nbytes
        else:
            t.state = "timeout" if ev.timed_out else "failed"
            t.elapsed_s, t.reason = max(0.0, now - t.started), ev.reason
            tot.failures += 1
            tot.timeouts += ev.timed_out
            self._errors.append(ErrorRow(now, o.engine, ev.req, direction, ev.reason))
        self._done.append(t)

    # -- output ------------------------------------------------------------
    def expire(self, now: float) -> None:
        """Forget engines gone for `forget_s`, with their rows and errors."""
        old = [
            e
            for e, t in self._engines.items()
            if t.gone_at is not None and now - t.gone_at >= self.forget_s
        ]
        if not old:
            return
        for name in old:
            del self._engines[name]
        gone = set(old)
        self._done = deque((t for t in self._done if t.engine not in gone), self._done.maxlen)
        self._errors = deque((e for e in self._errors if e.engine not in gone), self._errors.maxlen)

    def transfers(self, now: float) -> list[Transfer]:
        """Active transfers (oldest first), then the recently ended ones (newest first)."""
        self.expire(now)
        active = sorted((t for q in self._active.values() for t in q), key=lambda t: t.started)
        return active + list(reversed(self._done))

    def engines(self, now: float) -> list[EngineTotals]:
        """Per-engine totals, by engine id."""
        self.expire(now)
        return sorted(self._engines.values(), key=lambda t: t.engine)

    def errors(self, now: float) -> list[ErrorRow]:
        """The last errors, newest first."""
        self.expire(now)
        return list(reversed(self._errors))
