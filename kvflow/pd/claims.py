"""P/D consumer: claim a request's prompt KV on its producer as soon as the request
arrives, and keep the claim alive while the request waits to be pulled.

A decode instance may queue a request long after the prefill instance finished
it. The scheduler adds a claim when a request with P/D params arrives and drops
it when the request ends. A new claim is asked at once, never behind a round in
flight (one `Transport.renew` per producer worker for the new claims that came
together); one task renews every claim in rounds, every `lease_s / 3`, one
`Transport.renew` per producer worker carrying all of its requests. The producer holds
each claimed request `lease_s` from its latest renewal, past its own hold timeout; a
consumer that dies lets the claim lapse.

The first answer decides the request: held, and it is pulled; refused,
unreachable, or no answer within `answer_s` (a producer answers a renewal at once:
one that does not is dead or hung), and its load fails at once with that reason
(vLLM recomputes or fails the request, as its load-failure policy says) instead of
waiting `load_timeout_s` on a producer that is gone. A producer that has not offered
the request yet (its worker learns of the offer a step after its API server
answered) says so; the claim asks again, backing off, until the offer is there or
`timeout_s` after the claim. The deciding answer is the P/D request's
`LookupAnswered` event. A refusal ends a claim (after its pull the producer has let
go: nothing is left to hold), and so does a later renewal that fails or goes
unanswered: a request not pulled yet then fails its load at once.

A request that ends before its pull (aborted while it waits, refused for its shape),
or whose pull failed, lets go of its offer: the next round tells the producer, which
hands the blocks back at once instead of at its hold timeout or when the claim lapses.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from ..observe.events import ClaimSent, EventBus, LookupAnswered, TaskFailed
from ..runtime import Backoff, Report, Runtime, supervised
from ..transport import Renewed, Transport
from .params import PdParams, PdParamsError, decode_streamed

__all__ = ["Claim", "Claims"]

log = logging.getLogger("kvflow.pd.claims")

PENDING_ASK_MAX_S = 0.05
"""A claim its producer has not offered yet is asked again at most this far apart (from
5 ms, doubling): the offer comes with the producer's next step, and each ask after it
lands adds to the request's time to first token (250 ms, before, cost up to that)."""


@dataclass
class Claim:
    """One request's claim; written by the loop, read by vLLM's thread."""

    req: str
    """The request id on the producer."""
    tokens: int
    """Prompt tokens the producer holds."""
    addresses: list[str]
    """The producer's worker endpoints (one per shard): each holds its shard's blocks."""
    unanswered: set[str] = field(init=False)
    """Shards whose first answer has not come yet."""
    answered: bool = False
    """Every shard answered the first renewal, or one refused it or did not answer."""
    waiting: set[str] = field(default_factory=set)
    """Shards asked again because they have not offered the request yet."""
    error: str = ""
    """Why the request cannot be pulled ("" while it can)."""
    sent: bool = False
    """Its first renewal was sent (`ClaimSent`)."""
    params: PdParams | None = None
    """A streamed offer: its producer's params, from its first answer that held it
    (decoded and bounded here, checked by the scheduler; set before `answered`)."""
    since: float = field(default_factory=time.perf_counter)
    streamed: bool = False
    """Claimed as its request arrived, before its prefill began (`kvflow proxy --stream`):
    the offer may be missing as long as the prefill queues (`Claims.stream_timeout_s`)."""

    def __post_init__(self) -> None:
        self.unanswered = set(self.addresses)

    def settle(self, address: str, why: str) -> bool:
        """One shard's answer; True if it is the answer that decides the request."""
        self.unanswered.discard(address)
        if why and not self.error:
            self.error = why
        decided = not self.answered and (not self.unanswered or bool(self.error))
        self.answered = self.answered or decided
        return decided


class Claims:
    """The consumer scheduler's claims on producers' blocks, by consumer request id."""

    def __init__(
        self,
        transport: Transport,
        runtime: Runtime,
        bus: EventBus,
        *,
        lease_s: float,
        timeout_s: float,
        answer_s: float,
        stream_timeout_s: float = 0.0,
        gave_up: Report | None = None,
    ) -> None:
        self.transport = transport
        self.runtime = runtime
        self.bus = bus
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.stream_timeout_s = max(stream_timeout_s, timeout_s)
        """How long a streamed claim waits for its offer (`hold_timeout_s`: as long as a
        producer holds an offer nobody claimed)."""
        self.answer_s = min(answer_s, timeout_s)
        """How long one renewal waits for its answer (`progress_timeout_s`)."""
        self._claims: dict[str, Claim] = {}  # the loop thread's only
        self._releases: dict[str, list[str]] = {}  # address -> offers never to be pulled
        self._releasing: dict[str, list[str]] = {}  # address -> offers its task sends
        self._due = trio.Event()
        self._asks: trio.Nursery | None = None
        """Where first asks and asks again run (the renewal task's, while it runs)."""
        self._new: dict[str, list[tuple[str, Claim]]] = {}
        """address -> claims its first-ask task asks next, together."""
        self._pending: dict[str, list[tuple[str, Claim]]] = {}
        """address -> claims it has not offered yet, which its task asks again."""
        self._started = False
        self._gave_up = gave_up
        """Told if the renewals fail for good (the scheduler then stops the engine)."""

    # -- vLLM thread -------------------------------------------------------
    def add(
        self,
        req: str,
        producer_req: str,
        tokens: int,
        addresses: Sequence[str],
        streamed: bool = False,
    ) -> Claim:
        """Claim `producer_req` for the consumer request `req`; renewed until `drop`."""
        claim = Claim(producer_req, tokens, list(addresses), streamed=streamed)
        self._start()
        self.runtime.submit(self._add, req, claim)
        return claim

    def drop(self, req: str) -> None:
        """`req` ended or no longer needs its producer's blocks."""
        self.runtime.submit(self._claims.pop, req, None)

    def release(self, offer: str, addresses: Sequence[str]) -> None:
        """Tell the producer at `addresses` that this consumer will never pull `offer` (its
        request ended before its pull, or was refused), so it hands the blocks back now;
        a producer that does not hear it holds them until its hold timeout or lease."""
        self._start()
        self.runtime.submit(self._let_go, offer, list(addresses))

    def _start(self) -> None:
        if not self._started:
            self._started = True
            task = functools.partial(supervised, restarted=self._restarted, gave_up=self._gave_up)
            self.runtime.spawn(task, "pd-claims", self._renewals, name="pd-claims")

    def _restarted(self, task: str, error: str) -> None:
        self.bus.emit(TaskFailed(task=task, error=error))

    # -- loop --------------------------------------------------------------
    def _add(self, req: str, claim: Claim) -> None:
        """A new claim is asked at once, apart from the rounds (a round waits for every
        producer's answer: one slow producer held every new claim to every producer),
        with the new claims to the same producer that came meanwhile."""
        self._claims[req] = claim
        if self._asks is None:  # the renewal task is (re)starting: its first round asks
            self._due.set()
            return
        for address in claim.addresses:
            if address not in self._new:
                self._new[address] = []
                self._asks.start_soon(self._first_asks, self._asks, address)
            self._new[address].append((req, claim))

    async def _first_asks(self, waits: trio.Nursery, address: str) -> None:
        """Ask `address` for the new claims queued for it, all at once, until none is left."""
        try:
            while batch := self._new[address]:
                self._new[address] = []
                await self._renew_at(waits, address, batch)
        finally:
            self._new.pop(address, None)

    def _let_go(self, offer: str, addresses: list[str]) -> None:
        for address in addresses:
            self._releases.setdefault(address, []).append(offer)
        self._due.set()

    async def _renewals(self) -> None:
        for claim in self._claims.values():  # started again after a failure: the asks
            claim.waiting.clear()  # of offers not made yet ended with the last run
        self._new, self._pending = {}, {}
        if self._claims or self._releases:  # and the round is due at once
            self._due.set()
        async with trio.open_nursery() as waits:  # first asks, asks of offers not made
            self._asks = waits  # yet, releases
            try:
                await self._rounds(waits)
            finally:
                self._asks = None

    async def _rounds(self, waits: trio.Nursery) -> None:
        """Renew every claim each `lease_s / 3` (and tell producers of releases)."""
        while True:
            with trio.move_on_after(self.lease_s / 3):
                await self._due.wait()
            self._due = trio.Event()
            by_address: dict[str, list[tuple[str, Claim]]] = {}
            for req, claim in self._claims.items():
                for address in claim.addresses:
                    by_address.setdefault(address, []).append((req, claim))
            releases, self._releases = self._releases, {}
            for address, offers in releases.items():  # one task per producer, apart
                if address not in self._releasing:  # from the rounds (it retries)
                    self._releasing[address] = []
                    waits.start_soon(self._release_at, address)
                self._releasing[address] += offers
            async with trio.open_nursery() as nursery:
                for address, claims in by_address.items():
                    nursery.start_soon(self._renew_at, waits, address, claims)

    async def _release_at(self, address: str) -> None:
        """Tell `address` this consumer will not pull the offers in `_releasing[address]`
        (more may join while it runs); a producer that does not answer (hung,
        partitioned) is told again until it does, for at most a lease: past that it has
        let them go by itself (its hold timeout, or the lapsed claim)."""
        offers = self._releasing[address]
        try:
            with trio.move_on_after(self.lease_s):
                while offers:
                    sent = list(offers)
                    with trio.move_on_after(self.answer_s):
                        try:
                            await self.transport.renew(address, [], self.lease_s, release=sent)
                            del offers[: len(sent)]
                            continue
                        except Exception as exc:
                            why = f"{type(exc).__name__}: {exc}"
                            log.info("kvflow: releasing offers at %s: %s", address, why)
                            await trio.sleep(self.answer_s)  # refused at once: not a spin
        finally:
            del self._releasing[address]

    async def _renew_at(
        self, waits: trio.Nursery, address: str, claims: list[tuple[str, Claim]]
    ) -> None:
        pending = await self._ask(address, claims)
        new = [(req, c) for req, c in pending if address not in c.waiting]
        for _, claim in new:
            claim.waiting.add(address)
        if new and address not in self._pending:
            self._pending[address] = []
            waits.start_soon(self._wait_for_offers, address)
        self._pending.get(address, []).extend(new)

    async def _wait_for_offers(self, address: str) -> None:
        """Ask `address` again, together, for the claims it has not offered yet
        (`_pending[address]`; later ones join), until it has, or until `timeout_s` after
        each claim (that claim then fails, naming the producer)."""
        backoff = Backoff(0.005, PENDING_ASK_MAX_S)
        try:
            while claims := self._pending[address]:
                waiting = []
                for req, claim in claims:
                    if self._claims.get(req) is not claim or address not in claim.unanswered:
                        continue  # dropped, or answered meanwhile
                    if time.perf_counter() - claim.since < self._timeout(claim):
                        waiting.append((req, claim))
                        continue
                    why = f"producer {address} has not offered {claim.req} within "
                    setting = "hold_timeout_s" if claim.streamed else "lookup_timeout_s"
                    self._settle(req, claim, address, f"{why}{self._timeout(claim)}s ({setting})")
                self._pending[address] = []
                if waiting:
                    await backoff.wait()
                still = await self._ask(address, waiting)
                self._pending[address] = still + self._pending[address]  # + those that joined
        finally:
            self._pending.pop(address, None)

    async def _ask(self, address: str, claims: list[tuple[str, Claim]]) -> list[tuple[str, Claim]]:
        """One renewal of `claims` at `address`; returns those it has not offered yet."""
        if not claims:
            return []
        open_before = {req for req, c in claims if address in c.unanswered}
        for req, claim in claims:
            if not claim.sent:
                claim.sent = True
                self.bus.emit(ClaimSent(req=req))
        why, answer = "", Renewed({})
        with trio.move_on_after(self.answer_s) as deadline:
            try:
                answer = await self.transport.renew(
                    address, [c.req for _, c in claims], self.lease_s
                )
                if not isinstance(answer, Renewed):
                    raise TypeError(f"renew() returned {type(answer).__name__}, not Renewed")
            except Exception as exc:
                why = f"producer {address} unreachable: {type(exc).__name__}: {exc}"
                answer = Renewed({})
        if deadline.cancelled_caught:
            why = (
                f"producer {address} did not answer its claim within {self.answer_s}s "
                "(progress_timeout_s): it is gone or hung"
            )
        pending, not_offered = [], set(answer.pending)
        for req, claim in claims:
            held = address not in claim.unanswered  # this shard said held (perhaps just now)
            reason = answer.refused.get(claim.req, "")
            if reason:
                reason = f"producer {address} refused {claim.req}: {reason}"
            elif claim.req in not_offered and not held:
                pending.append((req, claim))
                continue
            elif claim.req in not_offered and req in open_before:
                continue  # asked before its offer, answered by a later ask: stale
            elif claim.req in not_offered:  # held before, forgotten since: nothing to hold
                reason = f"producer {address} no longer knows {claim.req}"
            elif why and held:  # held before, gone or hung since: a load not started fails
                log.warning("kvflow: renewing the claim of %s: %s", req, why)
            if claim.params is None and not (reason or why) and claim.req in answer.params:
                reason = self._streamed(claim, address, answer.params[claim.req])
            self._settle(req, claim, address, reason or why)
        return pending

    @staticmethod
    def _streamed(claim: Claim, address: str, raw: bytes) -> str:
        """A streamed offer's params, as `address` sent them, onto `claim`; or why not."""
        try:
            p = decode_streamed(raw, f"producer {address}'s answer to the claim of {claim.req}")
        except PdParamsError as exc:
            return str(exc)
        if p.offer != claim.req:
            return f"producer {address} sent the params of another offer for {claim.req}"
        claim.params, claim.tokens = p, p.num_tokens
        return ""

    def _timeout(self, claim: Claim) -> float:
        return self.stream_timeout_s if claim.streamed else self.timeout_s

    def _settle(self, req: str, claim: Claim, address: str, why: str) -> None:
        """`address`'s answer to `claim` (held if `why` is empty)."""
        if claim.settle(address, why):
            hit = 0 if claim.error else claim.tokens
            elapsed = time.perf_counter() - claim.since
            self.bus.emit(
                LookupAnswered(req=req, hit_tokens=hit, elapsed_s=elapsed, error=claim.error)
            )
        if claim.error:  # nothing more to hold: never renewed again
            self._claims.pop(req, None)
