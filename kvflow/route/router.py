"""Which instance a request goes to: by prefix (`kvflow.route.index`) within a bound on
load, round robin, or at random.

`least-loaded`: the healthy instance with the fewest requests in flight, then in turn
(a P/D proxy's decode servers under `--route prefix`).

`prefix`: among the healthy instances with at most `max_skew` requests in flight more
than the least loaded one, the one with the least prompt work ahead of the request's
first token: the prompt tokens it would compute (those not in its weighted run of the
prompt's leading blocks: GPU above host memory above a store,
`kvflow.route.index.weight`) plus, for each request in flight there, the prompt tokens
a request routed recently computed (the mean of the last `RECENT`). So a long history
outweighs a short queue, and a short shared prefix (a system prompt) does not pile
requests on the instance holding it. Ties go in turn. A hot prefix held by one instance
never gives it more than `max_skew` + 1 requests in flight above the least loaded.

An instance found unhealthy is left out until it is healthy again, and its blocks are
forgotten (a restarted instance starts empty).
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from .index import Match, PrefixIndex

__all__ = ["MAX_SKEW", "POLICIES", "Decision", "Router", "ServerState"]

POLICIES = ("prefix", "least-loaded", "round-robin", "random")
MAX_SKEW = 4
"""Requests in flight an instance may have above the least loaded one and still be
chosen for its prefix, by default (`--max-skew`)."""
KEPT_DECISIONS = 256
RECENT = 64
"""How many routed requests' computed prompt tokens weigh a request in flight."""


@dataclass
class Decision:
    server: str
    prompt_tokens: int
    """Tokens of the prompt (0: not known, the request was routed by load)."""
    predicted_tokens: int
    """Of those, the tokens the index says `server` holds in leading blocks."""
    in_flight: dict[str, int]
    """Requests in flight at each instance when it was chosen."""
    at: float = field(default_factory=time.time)


@dataclass
class ServerState:
    url: str
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    predicted_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens the instance reported it served from cache (`usage`), when it did."""


class Router:
    """Thread-safe (the proxy calls it from its trio loop, tests from their threads)."""

    def __init__(
        self,
        servers: Sequence[str],
        policy: str = "prefix",
        index: PrefixIndex | None = None,
        max_skew: int = MAX_SKEW,
        seed: int | None = None,
    ) -> None:
        if not servers:
            raise ValueError("a router needs at least one server")
        if policy not in POLICIES:
            raise ValueError(f"route {policy!r}: choose one of {', '.join(POLICIES)}")
        if max_skew < 0:
            raise ValueError(f"max_skew must be 0 or more, not {max_skew}")
        self.policy = policy
        self.index = index if index is not None else PrefixIndex()
        self.max_skew = max_skew
        self.servers = {url: ServerState(url) for url in servers}
        self._order = list(self.servers)
        self._turn = 0
        self._random = random.Random(seed)
        self.decisions: deque[Decision] = deque(maxlen=KEPT_DECISIONS)
        self._computed: deque[int] = deque(maxlen=RECENT)
        """Prompt tokens each recent request was predicted to compute where it went."""
        self._lock = threading.Lock()

    def choose(
        self, tokens: Sequence[int] | None = None, lora: str | None = None, avoid: str = ""
    ) -> Decision:
        """The server for a request whose prompt is `tokens` (None: not known), counted
        in flight until `done`; not `avoid` if another is healthy (a P/D request's
        decode server, other than its prefill server)."""
        found = self.index.match(tokens, lora) if tokens and self.policy == "prefix" else {}
        with self._lock:
            up = [s for s in self._order if self.servers[s].healthy] or self._order
            up = [s for s in up if s != avoid] or up
            if self.policy == "random":
                server = self._random.choice(up)
            elif self.policy == "round-robin":
                server = self._next(up)
            else:  # prefix; least-loaded, which has no index: `found` is empty
                server = self._by_prefix(up, found, len(tokens or ()))
            state = self.servers[server]
            loads = {s: self.servers[s].in_flight for s in self._order}
            predicted = found.get(server, Match()).tokens
            if tokens and self.policy == "prefix":
                self._computed.append(len(tokens) - predicted)
            state.in_flight += 1
            state.requests += 1
            state.predicted_tokens += predicted
            decision = Decision(server, len(tokens or ()), predicted, loads)
            self.decisions.append(decision)
            return decision

    def _by_prefix(self, up: list[str], found: dict[str, Match], prompt: int) -> str:
        least = min(self.servers[s].in_flight for s in up)
        fair = [s for s in up if self.servers[s].in_flight <= least + self.max_skew]
        queued = max(1.0, sum(self._computed) / len(self._computed)) if self._computed else 1.0

        def ahead(s: str) -> float:  # prompt tokens computed before this one's first token
            return prompt - found.get(s, Match()).weighted + self.servers[s].in_flight * queued

        low = min(ahead(s) for s in fair)
        return self._next([s for s in fair if ahead(s) == low])

    def _next(self, among: list[str]) -> str:
        """The first of `among` from the current turn on, in configured order."""
        n = len(self._order)
        for i in range(n):
            server = self._order[(self._turn + i) % n]
            if server in among:
                self._turn = (self._turn + i + 1) % n
                return server
        raise AssertionError("no server to choose from")  # `among` is never empty

    def least_loaded(self) -> str:
        """A healthy server with the fewest requests in flight (any, if none is healthy)."""
        with self._lock:
            up = [s for s in self._order if self.servers[s].healthy] or self._order
            return min(up, key=lambda s: self.servers[s].in_flight)

    def done(self, server: str, cached_tokens: int | None = None) -> None:
        with self._lock:
            state = self.servers[server]
            state.in_flight -= 1
            state.cached_tokens += cached_tokens or 0

    def set_healthy(self, server: str, healthy: bool) -> None:
        with self._lock:
            state = self.servers[server]
            was, state.healthy = state.healthy, healthy
        if was and not healthy:
            self.index.forget(server)

    def view(self) -> dict[str, object]:
        """What `/routes` shows: each server, the index, the latest decisions."""
        with self._lock:
            return {
                "policy": self.policy,
                "max_skew": self.max_skew,
                "servers": [asdict(s) for s in self.servers.values()],
                "index": asdict(self.index.stats) | {"block_sizes": sorted(self.index.block_sizes)},
                "decisions": [asdict(d) for d in self.decisions],
            }
