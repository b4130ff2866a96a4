"""Producer-side block lifetime for peer transports (prefill/decode disaggregation).

A producer holds a finished request's blocks until one of these happens: the
consumer confirms its pull, the consumer reports failure, the consumer releases the
offer it will not pull (`Renew.release`), or the hold deadline passes (the worker
cancels `Transport.offer`). The deadline is `hold_timeout_s`
until a consumer claims the request; from then on it is a lease the consumer
renews (`Renew`, every `lease_s / 3` while the request waits in its queue), so a
loaded decode instance keeps the KV however long it queues, and a consumer that
dies frees it within `lease_s`. In every case the blocks go back to vLLM only
once no read of them is in flight. `HeldOffers` is that bookkeeping, shared by
every peer transport so each one gets it right the same way: `offer()`
implements `Transport.offer`, the transport's serving task looks offers up,
answers `Renew` with `answer_renew()`, wraps each read in `reading()` and calls
`release()`; `renew_at` is the consumer's side of a renewal.

A claim can reach the producer before its offer: the producer's API server answers
as the request finishes, but the worker learns of the offer only with a later
step's metadata (under vLLM's async scheduling, after the next forward). The
producer tells a request it has not offered yet (`Renewed.pending`: the consumer
asks again, up to its `lookup_timeout_s`) from one it offered and let go (refused,
saying why: pulled, released by its consumer, or expired).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import trio
import zmq
from msgspec import Meta

from ..transport import Offer, Renewed, TransportError
from ..zmqio import BadFrame, TrioSocket, decode_frame, shown
from .security import MAC_BYTES, Channel

__all__ = [
    "MAX_READ_LEASE_S",
    "MAX_RENEW_REQS",
    "HeldOffers",
    "Nonce",
    "NotHeld",
    "OfferId",
    "Renew",
    "Renewed",
    "answer_bind",
    "answer_renew",
    "dealer",
    "new_nonce",
    "read_lease",
    "read_lease_ms",
    "renew_at",
    "select_blocks",
]

log = logging.getLogger("kvflow.pd.offers")

MAX_READ_LEASE_S = 600.0
"""The longest a producer keeps blocks for a pull whose consumer never reports back."""

MAX_RENEW_BYTES = 4 << 20
"""A renewal's answer names offer ids and reasons; this bounds what a bad peer makes us
decode."""
MAX_RENEW_REQS = 1024
"""The most offers one renewal names (a consumer with more sends several)."""
MAX_REASON = 200
"""A peer's reason is kept and logged up to this many characters."""
FRAME_SLACK = MAC_BYTES + 256
"""Added to a frame's bound in `ZMQ_MAXMSGSIZE`: its MAC and CURVE's box."""

OfferId = Annotated[str, Meta(max_length=128)]
"""How a peer names an offer on the wire (`PdParams.offer`)."""
Nonce = Annotated[bytes, Meta(max_length=32)]
"""A consumer's random bytes in a request that the producer answers (a pull, a
heartbeat, a renewal): every answer's MAC covers them and its index (`answer_bind`)."""
ConsumerId = Annotated[str, Meta(max_length=64)]
"""A consumer's random name in its renewals: the first to renew an offer claims it."""

CLAIMED_BY_ANOTHER = "claimed by another consumer"


def new_nonce() -> bytes:
    return secrets.token_bytes(16)


def answer_bind(nonce: bytes, index: int) -> bytes:
    """What a producer's `index`-th answer to the request carrying `nonce` is bound to
    (`Channel.seal`): an answer of another pull or renewal, or out of order, fails its
    MAC."""
    return nonce + index.to_bytes(4, "big")


MAX_ENDED = 16384
"""How many ended offers a producer remembers (why each ended) to answer a late claim;
an older one looks never offered: its claim waits `lookup_timeout_s`, then fails."""

NOT_OFFERED = "not offered by this producer (never, or too long ago to remember)"


class Renew(msgspec.Struct, tag=True, frozen=True):
    """Consumer -> producer: keep holding these requests' blocks `lease_ms` longer; the
    consumer still means to pull them. Part of every peer transport's producer wire."""

    reqs: Annotated[list[OfferId], Meta(max_length=MAX_RENEW_REQS)]
    lease_ms: Annotated[int, Meta(gt=0, lt=1 << 40)]
    """The producer holds each `lease_ms` from now, at most its own `lease_s`."""
    release: Annotated[list[OfferId], Meta(max_length=MAX_RENEW_REQS)] = []
    """Offers the consumer will never pull (its request ended or was refused before its
    pull, or its pull failed): the producer hands their blocks back at once, unless a
    read of them is in flight or another consumer claimed them
    (`HeldOffers.release_unpulled`)."""
    nonce: Nonce = b""
    """The answer's MAC covers it (`answer_bind`)."""
    consumer: ConsumerId = ""
    """Who renews: the first consumer to renew an offer claims it; only it may renew or
    release it from then on ("": an anonymous renewal, which claims nothing)."""


_encoder = msgspec.msgpack.Encoder()
_renewed = msgspec.msgpack.Decoder(Renewed)


def select_blocks(offer: Offer, block_ids: Sequence[int]) -> Offer | None:
    """The part of `offer` a consumer pulls: the chunks in `block_ids` (all of them if
    empty). A consumer that already has a prefix of the prompt (its prefix cache) pulls
    only the rest. None if a block is not offered, or is named twice (each block named
    would be sent: a peer must not make one offer cost more than its blocks)."""
    if not block_ids:
        return offer
    where = {b: i for i, b in enumerate(offer.block_ids)}
    if len(set(block_ids)) != len(block_ids) or any(b not in where for b in block_ids):
        return None
    idx = [where[b] for b in block_ids]

    def spans(layer: int) -> list[list[memoryview]]:
        chunks = offer.spans(layer)
        return [chunks[i] for i in idx]

    counts = [offer.token_counts[i] for i in idx]
    return dataclasses.replace(offer, block_ids=list(block_ids), token_counts=counts, spans=spans)


def read_lease_ms(margin_s: float = 0.0) -> int:
    """Consumer: how long it may still read, in ms, for its pull request: the deadline
    of the caller's cancel scope (the worker's load deadline) plus `margin_s`; 0 when
    unbounded. Past it the consumer has stopped reading and disconnected."""
    left = trio.current_effective_deadline() - trio.current_time()
    return 0 if math.isinf(left) else max(1, int((left + margin_s) * 1000))


def read_lease(lease_ms: int) -> float:
    """Producer: how long to keep a pull's blocks for a consumer that sent `lease_ms`
    (0: unknown), capped at `MAX_READ_LEASE_S`."""
    return min(lease_ms / 1000 if lease_ms > 0 else MAX_READ_LEASE_S, MAX_READ_LEASE_S)


class NotHeld(KeyError):
    """The request is not held (never offered, expired, or closing)."""


@dataclass
class _Held:
    offer: Offer
    released: trio.Event = field(default_factory=trio.Event)
    """Set when the consumer answered (done or failed)."""
    outcome: str = ""
    closed: bool = False
    """Set when `offer()` ends: no new pull or read may start."""
    peers: set[object] = field(default_factory=set)
    """The consumers that claimed the pull (socket identities, agent names)."""
    expected: int = 1
    """How many consumers pull it (a consumer of a larger tensor-parallel size reads one
    producer rank from several of its ranks, each its own heads)."""
    done: set[object] = field(default_factory=set)
    """The claimers that answered done."""
    renewer: str = ""
    """The consumer that claimed it by renewing (`Renew.consumer`)."""
    readers: int = 0
    idle: trio.Event = field(default_factory=trio.Event)
    computing: bool = False
    """A streamed offer whose transport reads it only once every layer is computed:
    until then a claim of it is pending (the consumer's pull would wait on the forward)."""

    def __post_init__(self) -> None:
        self.idle.set()


class HeldOffers:
    """Offers a producer holds, by request id; trio-only (one loop owns it)."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # why, by request, newest last

    def _end(self, req: str, why: str) -> None:
        self._ended[req] = why
        self._ended.move_to_end(req)
        if len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)

    def why_not(self, req: str) -> str:
        """Why `req` is not held: how its offer ended, or `NOT_OFFERED`."""
        return self._ended.get(req, NOT_OFFERED)

    def _open(self, req: str) -> _Held | None:
        held = self._held.get(req)
        if held is None or held.closed or held.released.is_set():
            return None
        return held

    def __contains__(self, req: str) -> bool:
        return self._open(req) is not None

    def get(self, req: str) -> Offer | None:
        held = self._open(req)
        return None if held is None else held.offer

    def renew(self, reqs: Sequence[str], lease_s: float, consumer: str = "") -> Renewed:
        """Answer the `Renew` of `consumer`: each held request's hold deadline becomes
        `lease_s` from now (`Offer.renew`), and the first consumer to renew it claims it;
        those not offered (yet) are pending; the others (and those another consumer
        claimed) are refused with the reason. A streamed offer's answer carries its
        params (pending until computed, for a transport that reads it only then)."""
        refused, pending, params = {}, [], {}
        for req in reqs:
            held = self._open(req)
            if held is not None and consumer and held.renewer not in ("", consumer):
                refused[req] = CLAIMED_BY_ANOTHER
            elif held is not None:
                held.renewer = held.renewer or consumer
                held.offer.renew(lease_s)
                if held.computing:
                    pending.append(req)
                elif held.offer.params:  # streamed: the consumer has no params of it yet
                    params[req] = held.offer.params
            elif req in self._ended:
                refused[req] = self._ended[req]
            else:
                pending.append(req)
        return Renewed(refused, pending, params)

    def release_unpulled(self, reqs: Sequence[str], consumer: str = "") -> int:
        """`consumer` will not pull `reqs` (its request ended, or its pull failed): end
        each held offer that no read is in flight from (one that is ends by its own
        consumer's answer or lease) and that no other consumer claimed by renewing it
        (that one still may pull it; an offer nobody claimed yet anyone with the key may
        end, as it could claim it first). Returns how many it ended."""
        ended = 0
        for req in reqs:
            held = self._open(req)
            if held is None or held.readers or held.renewer not in ("", consumer):
                continue
            ended += self.release(req, "released unpulled by its consumer")
        return ended

    def claim(self, req: str, peer: object, readers: int = 1) -> str:
        """Reserve `req` for the consumer `peer`, one of `readers` that pull it: "" if it
        may pull, else why not. The first claim fixes how many consumers pull a request
        (the ranks of one consumer engine); one more, or one that counts otherwise, is
        refused, and only the claimers' answers count (`release(..., peer=)`)."""
        held = self._open(req)
        if held is None:
            return self.why_not(req)
        if peer in held.peers:
            return ""
        if held.peers and readers != held.expected:
            return f"claimed by {held.expected} reader(s), not {readers}"
        if len(held.peers) >= readers:
            return "already being pulled by another consumer"
        held.peers.add(peer)
        held.expected = readers
        return ""

    async def offer(self, offer: Offer, whole: bool = False) -> str:
        """Hold `offer` until released; return the outcome ("done" or the consumer's
        reason). When cancelled, return only after every read of the blocks ended.
        `whole`: the transport reads a streamed offer only once every layer is computed
        (its claims are pending until then), not each layer once it is."""
        held = self._held[offer.req] = _Held(offer)
        held.computing = bool(offer.params) and whole
        self._ended.pop(offer.req, None)
        try:
            if held.computing:
                await offer.all_computed()
                held.computing = False
            await held.released.wait()
            return held.outcome
        finally:
            held.closed = True  # at once: nothing new may read the blocks from here on
            if not held.released.is_set():
                self._end(offer.req, "expired: its hold timeout passed or its claim lapsed")
            with trio.CancelScope(shield=True):
                while held.readers:
                    await held.idle.wait()
            if self._held.get(offer.req) is held:
                del self._held[offer.req]

    def release(self, req: str, outcome: str, peer: object = None) -> bool:
        """The consumer is done with `req` ("done") or failed (its reason). With `peer`,
        only a consumer that claimed the pull may release it, and "done" releases once
        every claimer is done. Returns whether it released."""
        held = self._held.get(req)
        if held is None or held.released.is_set():
            return False
        if peer is not None:
            if peer not in held.peers:
                return False
            if outcome == "done":
                held.done.add(peer)
                if len(held.done) < held.expected:
                    return False
        held.outcome = shown(outcome, MAX_REASON)  # a peer's words: logged, one line
        held.released.set()
        self._end(req, "already pulled" if outcome == "done" else f"released: {held.outcome}")
        return True

    async def lend(
        self,
        req: str,
        lease_s: float,
        *,
        task_status: trio.TaskStatus[bool] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """A peer reads `req`'s blocks by itself (CUDA IPC, RDMA) until it answers or
        `lease_s` passes; the blocks stay held meanwhile, also past the hold deadline. The
        peer must not trust what it read after the lease ended (the blocks may be vLLM's
        again). Start it with `nursery.start` before telling the peer where the blocks
        are, so the read is registered before the peer can begin; it starts with False
        (and returns) if `req` is not held."""
        held = self._open(req)
        if held is None:
            task_status.started(False)
            return
        with self.reading(req):
            task_status.started(True)
            with trio.move_on_after(lease_s):
                await held.released.wait()

    @contextmanager
    def reading(self, req: str) -> Iterator[Offer]:
        """Mark a read of `req`'s blocks in flight; its blocks stay held until it ends.
        Raises `NotHeld` if `req` is not held."""
        held = self._open(req)
        if held is None:
            raise NotHeld(req)
        if held.readers == 0:
            held.idle = trio.Event()
        held.readers += 1
        try:
            yield held.offer
        finally:
            held.readers -= 1
            if held.readers == 0:
                held.idle.set()


def dealer(
    zctx: zmq.Context[Any],
    address: str,
    max_frame_bytes: int,
    channel: Channel,
    kept: bool = False,
) -> TrioSocket:
    """A consumer's socket to the producer worker at `address`, secured for `channel`,
    refusing frames over `max_frame_bytes` (`kept`: one `Dealers` keeps, see there).
    `address` must be a `tcp://` IP literal, and
    loopback unless the channel is keyed or insecure (`Channel.address_problem`): else a
    `TransportError`, before any socket exists."""
    if why := channel.address_problem(address):
        raise TransportError(f"producer address {address[:100]!r}: {why}")
    sock = zctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + FRAME_SLACK)
        if kept:
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, -1)
        channel.secure(sock, server=False)
        sock.connect(address)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise TransportError(f"producer address {address[:100]!r}: {exc}") from None
    return TrioSocket(sock)


KEPT_DEALERS = 64
"""Idle renewal connections kept, in all (one per producer worker a consumer renews at)."""


class Dealers:
    """A consumer's idle connections to producer workers, one per address, each reused
    for that producer's next renewal: a keyed connection's handshake costs each renewal
    some milliseconds (the producer's ZAP handler checks it), and the first ask of a
    claim is on the path of its request's first token. A connection is kept only after a
    renewal answered on it. Its handshake's credential is one-time (a producer refuses it
    again as a replay, and counts that as a stranger's), so it never reconnects
    (`zmq.RECONNECT_IVL` -1) and takes a message only while connected (`zmq.IMMEDIATE`):
    one that refuses the next renewal at once lost its connection, and a new one
    replaces it."""

    def __init__(self, zctx: zmq.Context[Any]) -> None:
        self.zctx = zctx
        self._idle: OrderedDict[str, TrioSocket] = OrderedDict()

    def kept(self, address: str) -> TrioSocket | None:
        """The kept connection to `address`, if any (no longer kept: `keep` it again once
        it answered)."""
        return self._idle.pop(address, None)

    def new(self, address: str, channel: Channel) -> TrioSocket:
        """A new connection to `address` (see `dealer`)."""
        return dealer(self.zctx, address, MAX_RENEW_BYTES, channel, kept=True)

    def keep(self, address: str, sock: TrioSocket) -> None:
        """`sock` answered a renewal and nothing is left to read on it: kept for the next."""
        if (old := self._idle.pop(address, None)) is not None:
            old.close()
        self._idle[address] = sock
        while len(self._idle) > KEPT_DEALERS:
            self._idle.popitem(last=False)[1].close()

    def close(self) -> None:
        while self._idle:
            self._idle.popitem()[1].close()


async def renew_at(
    zctx: zmq.Context[Any],
    address: str,
    reqs: Sequence[str],
    lease_s: float,
    channel: Channel | None = None,
    release: Sequence[str] = (),
    consumer: str = "",
    dealers: Dealers | None = None,
) -> Renewed:
    """The consumer's side of a renewal: ask the producer worker at `address` (its peer
    transport's endpoint, which must answer `Renew` with `Renewed`) to hold `reqs`
    `lease_s` longer for `consumer` (its claim) and to let go of `release` (offers this
    consumer will not pull), over `channel` (the deployment's key; keyless if None;
    `dealer` checks `address`), in rounds of at most `MAX_RENEW_REQS`, each answer bound
    to its round (`answer_bind`); on the connection `dealers` keeps, if given. Returns
    its answer (refused and pending requests); raises `TransportError` on an answer that
    does not decode. Waits for the answer until
    cancelled (a producer that is gone never answers: the caller bounds the wait)."""
    channel = channel or Channel()
    reused = False
    if dealers is None:
        sock = dealer(zctx, address, MAX_RENEW_BYTES, channel)
    elif (kept := dealers.kept(address)) is not None:
        sock, reused = kept, True
    else:
        sock = dealers.new(address, channel)
    refused: dict[str, str] = {}
    pending: list[str] = []
    params: dict[str, bytes] = {}
    answered = False
    try:
        lease_ms = max(1, int(lease_s * 1000))
        for i in range(0, max(len(reqs), len(release)), MAX_RENEW_REQS):
            part = slice(i, i + MAX_RENEW_REQS)
            nonce = new_nonce()
            renew = Renew(list(reqs[part]), lease_ms, list(release[part]), nonce, consumer)
            frame = channel.seal(_encoder.encode(renew), "producer")
            if not (reused and _sent_now(sock, frame)):
                if reused and dealers is not None:  # it lost its connection (`Dealers`)
                    sock.close()
                    sock = dealers.new(address, channel)
                await sock.send_multipart([frame])
            reused = False
            frames = await sock.recv_multipart()
            try:
                if len(frames) != 1:
                    raise BadFrame(f"a message of {len(frames)} frames")
                payload = channel.open(frames[0], "consumer", answer_bind(nonce, 0))
                answer = decode_frame(_renewed, payload, MAX_RENEW_BYTES)
            except BadFrame as exc:
                raise TransportError(f"producer {address} answered a renewal with {exc}") from None
            refused.update((r, shown(why, MAX_REASON)) for r, why in answer.refused.items())
            pending += answer.pending
            params.update(answer.params)
        answered = True
        return Renewed(refused, pending, params)
    finally:
        if answered and dealers is not None:
            dealers.keep(address, sock)
        else:
            sock.close()


def _sent_now(sock: TrioSocket, frame: bytes) -> bool:
    """Whether `sock` took `frame` at once (a kept connection that did not has no peer)."""
    try:
        sock.send_now([frame])
    except zmq.Again:
        return False
    return True


async def answer_renew(
    held: HeldOffers, router: TrioSocket, ident: bytes, msg: Renew, channel: Channel | None = None
) -> None:
    """A producer's answer to the consumer `ident`'s `Renew` on its ROUTER side channel
    (every peer transport's serving loop calls it), sealed for `channel` and bound to the
    renewal, never waiting: a consumer gone meanwhile, or one that does not read its
    answers, is logged and its answer dropped."""
    held.release_unpulled(msg.release, msg.consumer)
    answer = held.renew(msg.reqs, msg.lease_ms / 1000, msg.consumer)
    bind = answer_bind(msg.nonce, 0)
    frame = (channel or Channel()).seal(_encoder.encode(answer), "consumer", bind)
    await trio.lowlevel.checkpoint()
    try:
        router.send_now([ident, frame])
    except zmq.ZMQError as exc:
        log.info("kvflow: a consumer renewing %d request(s) is unreachable: %s", len(msg.reqs), exc)
