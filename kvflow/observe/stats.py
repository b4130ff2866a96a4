"""Transfer statistics for vLLM's metrics: collected from events, merged across workers.

vLLM asks each worker (and the scheduler) for the stats of the last interval,
merges them with `aggregate`, and reduces the merge to a few numbers. The
data is a plain dict of lists and counters (it crosses process boundaries as
is). Throughput is bytes over the *wall time during which transfers of that
direction were in flight* (the union of their [start, end] intervals, from the
host-wide monotonic clock), so two workers each moving 1 GB in the same second
report 2 GB/s, not 1 GB/s (averaging) or 4 GB/s (summing overlapping
durations).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from .events import (
    Event,
    LoadStarted,
    LookupAnswered,
    LookupRequested,
    Rejected,
    RequestFinished,
    SaveStarted,
    TaskFailed,
    TierRead,
    TierWrite,
    TransferDone,
    TransferFailed,
)

__all__ = ["StatsCollector", "busy_seconds", "empty", "merge", "reduce"]

DIRECTIONS = ("load", "save", "send")
COUNTERS = (
    "lookups",
    "hit_tokens",
    "miss_tokens",
    "requests_lent",
    "failures",
    "timeouts",
    *(f"{d}_tokens" for d in DIRECTIONS),
)


def empty() -> dict[str, Any]:
    """Stats of an interval in which nothing happened."""
    data: dict[str, Any] = {c: 0 for c in COUNTERS}
    data["transfers"] = []  # [direction, nbytes, start, end] per finished transfer
    data["rejected"] = {}  # reason -> inputs from outside refused (kvflow.pd.security)
    data["task_restarts"] = {}  # task -> restarts of a supervised task (kvflow.runtime)
    data["tiers"] = {}  # tier -> {outcome: chunks, "bytes"/"bytes_in": bytes} (kvflow.tiers)
    return data


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add `other`'s observations to `into` (returned)."""
    for c in COUNTERS:
        into[c] = into.get(c, 0) + other.get(c, 0)
    into.setdefault("transfers", []).extend(other.get("transfers", []))
    for field in ("rejected", "task_restarts"):
        _add(into.setdefault(field, {}), other.get(field, {}))
    tiers = into.setdefault("tiers", {})
    for tier, counts in other.get("tiers", {}).items():
        _add(tiers.setdefault(tier, {}), counts)
    return into


def _add(into: dict[str, int], other: dict[str, int]) -> None:
    """Add `other`'s counts to `into`'s, name by name."""
    for name, n in other.items():
        into[name] = into.get(name, 0) + n


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


TIER_COUNTS: dict[type, dict[str, str]] = {
    TierRead: {"hits": "hits", "misses": "misses", "promoted": "promoted", "evicted": "evicted",
               "bytes": "nbytes"},
    TierWrite: {"stored": "stored", "through": "through", "evicted": "evicted",
                "bytes_in": "nbytes"},
}  # fmt: skip
"""A tier event's counts in `tiers[tier]`: stats key -> event field."""


def reduce(data: dict[str, Any]) -> dict[str, int | float]:
    """The interval in a few numbers, for vLLM's periodic log line."""
    out: dict[str, int | float] = {c: data.get(c, 0) for c in COUNTERS}
    out["rejected"] = sum(data.get("rejected", {}).values())
    out["task_restarts"] = sum(data.get("task_restarts", {}).values())
    for tier, counts in data.get("tiers", {}).items():
        for name, n in counts.items():
            out[f"tier_{tier}_{name}"] = n
    for d in DIRECTIONS:
        mine = [t for t in data.get("transfers", []) if t[0] == d]
        nbytes = sum(t[1] for t in mine)
        busy = busy_seconds((t[2], t[3]) for t in mine)
        out[f"{d}_transfers"] = len(mine)
        out[f"{d}_MB"] = round(nbytes / 1e6, 3)
        out[f"{d}_GBps"] = round(nbytes / busy / 1e9, 3) if busy > 0 else 0.0
    return out


def is_empty(data: dict[str, Any]) -> bool:
    return (
        not data.get("transfers")
        and not data.get("rejected")
        and not data.get("task_restarts")
        and not data.get("tiers")
        and not any(data.get(c, 0) for c in COUNTERS)
    )


_COUNTED = frozenset(
    {
        LookupRequested,
        LookupAnswered,
        LoadStarted,
        SaveStarted,
        TransferDone,
        TransferFailed,
        RequestFinished,
        Rejected,
        TaskFailed,
        TierRead,
        TierWrite,
    }
)


class StatsCollector:
    """An EventBus subscriber (trio thread) whose `take()` (any thread) returns and
    resets the observations since the last call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()
        self._tokens: dict[tuple[str, str], int] = {}
        """(request, direction) -> tokens of a transfer in flight."""
        self._asked: dict[str, int] = {}
        """Request -> prompt tokens of a lookup in flight."""

    def __call__(self, event: Event) -> None:
        if type(event) not in _COUNTED:  # per-layer events: no lock, no work
            return
        if getattr(event, "what", "kv") != "kv":  # hidden states are not KV traffic
            return
        with self._lock:
            d = self._data
            if isinstance(event, LookupRequested):
                self._asked[event.req] = event.num_tokens
            elif isinstance(event, LookupAnswered):
                asked = self._asked.pop(event.req, event.hit_tokens)
                d["lookups"] += 1
                d["hit_tokens"] += event.hit_tokens
                d["miss_tokens"] += max(0, asked - event.hit_tokens)
            elif isinstance(event, LoadStarted | SaveStarted):
                direction = "load" if isinstance(event, LoadStarted) else "save"
                key = (event.req, direction)  # overlapping saves of one request add up
                self._tokens[key] = self._tokens.get(key, 0) + event.tokens
            elif isinstance(event, TransferDone):
                d[f"{event.direction}_tokens"] += self._tokens.pop((event.req, event.direction), 0)
                d["transfers"].append(
                    [event.direction, event.nbytes, event.ts - event.elapsed_s, event.ts]
                )
            elif isinstance(event, TransferFailed):
                self._tokens.pop((event.req, event.direction), None)
                d["failures"] += 1
                d["timeouts"] += int(event.timed_out)
            elif isinstance(event, Rejected):
                d["rejected"][event.reason] = d["rejected"].get(event.reason, 0) + 1
            elif isinstance(event, TaskFailed) and not event.given_up:
                d["task_restarts"][event.task] = d["task_restarts"].get(event.task, 0) + 1
            elif isinstance(event, TierRead | TierWrite):
                fields = TIER_COUNTS[type(event)].items()
                counts = {key: getattr(event, field) for key, field in fields}
                _add(d["tiers"].setdefault(event.tier, {}), counts)
            elif isinstance(event, RequestFinished) and event.lent:
                d["requests_lent"] += 1

    def take(self) -> dict[str, Any] | None:
        """The observations since the last `take()`, or None if there were none."""
        with self._lock:
            data, self._data = self._data, empty()
        return None if is_empty(data) else data
