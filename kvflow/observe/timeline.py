"""A P/D request's way through both instances, from kvflow's events (an event log, or
`kvflow inspect --json`'s lines): when each stage happened, and the gaps between.

The consumer's events name its request id; the producer's name its own. The offer id
ties them: the producer's `RequestFinished` carries the offer it made (streamed: its
`OfferStreamed`, made as the prefill is scheduled; its `RequestFinished` is then the
"prefill done" mark), the consumer's `RequestArrived` the offer its params name.
Times are the events' `ts` (`time.monotonic()`, one clock for every process of a
host): a producer on another host has its own clock, and the gaps that cross hosts
are then meaningless (those within one instance stay right).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from .events import (
    BlocksAllocated,
    ClaimSeen,
    ClaimSent,
    Event,
    FirstToken,
    LayerLoaded,
    LoadReported,
    LoadStarted,
    LookupAnswered,
    OfferStreamed,
    RequestArrived,
    RequestFinished,
    RequestScheduled,
    TransferDone,
    TransferFailed,
)

__all__ = ["SPANS", "Mark", "Timeline", "spread", "timelines"]


@dataclass(frozen=True)
class Mark:
    """One stage of a request: what, when (`ts`), and where (engine, role, rank)."""

    stage: str
    ts: float
    where: str
    detail: str = ""


SPANS: tuple[tuple[str, str, str], ...] = (
    ("offer to arrival", "offered", "arrived"),
    ("claim", "arrived", "claim answered"),
    ("claim to pull", "claim answered", "pull started"),
    ("pull", "pull started", "pull done"),
    ("pull to report", "pull done", "load reported"),
    ("report to schedule", "load reported", "scheduled"),
    ("first step", "scheduled", "first token"),
    ("offer to first token", "offered", "first token"),
    ("pull past prefill", "prefill done", "pull done"),
)
"""The gaps a timeline names: (name, from stage, to stage). A stage seen several times
(a pull per tensor-parallel rank) counts from its first mark to its last."""


@dataclass
class Timeline:
    """One P/D request: the consumer's request id, the offer, the producer's request id,
    and every mark, oldest first."""

    req: str
    offer: str
    producer_req: str = ""
    marks: list[Mark] = field(default_factory=list)

    def first(self, stage: str) -> float | None:
        return min((m.ts for m in self.marks if m.stage == stage), default=None)

    def last(self, stage: str) -> float | None:
        return max((m.ts for m in self.marks if m.stage == stage), default=None)

    def gaps(self) -> dict[str, float]:
        """Each of `SPANS` this timeline has both ends of, in seconds."""
        out = {}
        for name, start, end in SPANS:
            a, b = self.first(start), self.last(end)
            if a is not None and b is not None:
                out[name] = b - a
        return out


def _where(ev: Event) -> str:
    o = ev.origin
    return f"{o.engine[:12]} {o.role} {o.rank}"


def _consumer_stage(ev: Event) -> tuple[str, str] | None:
    """The stage a consumer event marks, and its detail; None for other events."""
    if isinstance(ev, ClaimSent):
        return "claim sent", ""
    if isinstance(ev, LookupAnswered):
        return "claim answered", ev.error or f"{ev.hit_tokens} tokens held"
    if isinstance(ev, BlocksAllocated):
        return "blocks allocated", f"{ev.num_blocks} blocks"
    if isinstance(ev, LoadStarted):
        return "pull started", f"{ev.nbytes} bytes, {ev.transport}"
    if isinstance(ev, LayerLoaded):
        return "layer landed", f"layer {ev.layer}"
    if isinstance(ev, TransferDone) and ev.direction == "load":
        return "pull done", f"{ev.elapsed_s * 1e3:.1f} ms"
    if isinstance(ev, TransferFailed) and ev.direction == "load":
        return "pull failed", ev.reason
    if isinstance(ev, LoadReported):
        return "load reported", "" if ev.ok else "failed"
    if isinstance(ev, RequestScheduled):
        return "scheduled", f"step {ev.step}"
    if isinstance(ev, FirstToken):
        return "first token", f"step {ev.step}"
    return None


def _producer_stage(ev: Event) -> tuple[str, str] | None:
    if isinstance(ev, ClaimSeen):
        return "claim seen", ""
    if isinstance(ev, TransferDone) and ev.direction == "send":
        return "pull served", f"{ev.nbytes} bytes"
    if isinstance(ev, TransferFailed) and ev.direction == "send":
        return "offer ended unpulled", ev.reason
    return None


def timelines(events: Iterable[Event]) -> list[Timeline]:
    """The P/D requests among `events` (a consumer's `RequestArrived` with an offer), in
    arrival order, each with the marks of both instances' events."""
    events = list(events)
    by_offer: dict[str, Timeline] = {}
    by_req: dict[str, Timeline] = {}
    made: dict[str, tuple[str, Mark]] = {}  # offer -> (producer request, its mark)
    done: dict[str, Mark] = {}  # a streamed offer -> its prefill's end
    for ev in events:
        if isinstance(ev, RequestArrived) and ev.offer:
            t = Timeline(ev.req, ev.offer)
            t.marks.append(Mark("arrived", ev.ts, _where(ev), f"{ev.tokens} tokens"))
            by_offer[ev.offer] = by_req[ev.req] = t
        elif isinstance(ev, OfferStreamed):
            made[ev.offer] = (
                ev.req,
                Mark("offered", ev.ts, _where(ev), f"streamed, step {ev.step}"),
            )
        elif isinstance(ev, RequestFinished) and ev.offer in made:  # streamed
            done[ev.offer] = Mark("prefill done", ev.ts, _where(ev), f"{ev.blocks} blocks")
        elif isinstance(ev, RequestFinished) and ev.offer:
            made[ev.offer] = (ev.req, Mark("offered", ev.ts, _where(ev), f"{ev.blocks} blocks"))
    by_producer_req: dict[str, Timeline] = {}
    for offer, (producer_req, mark) in made.items():
        if (found := by_offer.get(offer)) is not None:
            found.producer_req = producer_req
            found.marks.append(mark)
            if offer in done:
                found.marks.append(done[offer])
            by_producer_req[producer_req] = found
    for ev in events:
        stage, line = _consumer_stage(ev), by_req.get(ev.req)
        if stage is None or line is None:
            stage, line = _producer_stage(ev), by_producer_req.get(ev.req)
        if stage is not None and line is not None:
            line.marks.append(Mark(stage[0], ev.ts, _where(ev), stage[1]))
    out = sorted(by_req.values(), key=lambda t: t.marks[0].ts)
    for t in out:
        t.marks.sort(key=lambda m: m.ts)
    return out


@dataclass(frozen=True)
class Spread:
    """One span over many requests, in seconds."""

    name: str
    n: int
    p50: float
    p90: float
    p99: float
    max: float


def spread(lines: Iterable[Timeline]) -> list[Spread]:
    """Each of `SPANS` over `lines`: how many requests have it, its quantiles, its max."""
    values: dict[str, list[float]] = {name: [] for name, _, _ in SPANS}
    for t in lines:
        for name, v in t.gaps().items():
            values[name].append(v)
    out = []
    for name, vs in values.items():
        if not vs:
            continue
        q = statistics.quantiles(vs, n=100, method="inclusive") if len(vs) > 1 else vs * 99
        out.append(Spread(name, len(vs), q[49], q[89], q[98], max(vs)))
    return out
