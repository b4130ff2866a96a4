"""`PeerTransport`: what every peer transport's producer does the same way.

A producer worker binds a ZMQ ROUTER endpoint (its `address`, advertised to
consumers), holds each finished request's blocks in `HeldOffers` until a consumer
is done with them, and answers its consumers in one loop (`serve`): renewals of a
claim, pulls, and a consumer's end of a pull. A pull is refused, naming why, when
its wire version differs, the request is not held, the blocks it asks for are not
all offered, or another consumer claimed it. What differs between transports (the
wire's frames, how the bytes move, how a pull ends) is the subclass's:
`decode`, `Pull`, `refusal`, `check_pull`, `answer` and `ended`.

Nothing a peer sends is believed. With the deployment's key (`PeerContext.channel`)
every connection's handshake proves the key before libzmq takes in a message (a ZAP
task of `serve` checks it, a one-time credential in `kv-in-clear`; failures are
counted), and every control frame, both ways, is sealed toward its side: a frame
without its MAC is dropped unanswered, and each answer is bound to the request it
answers and its place among that request's answers (`kvflow.pd.offers.answer_bind`).
Every socket refuses frames over its bound (`ZMQ_MAXMSGSIZE`) and a handshake not done
within `HANDSHAKE_IVL_MS`; the serving loop handles each message on its own and never
waits on a consumer: a frame of any shape, count or content is refused and counted
(`PeerContext.rejected`), never the end of `serve`. A peer's words are logged
escaped and cut (`kvflow.zmqio.shown`).
"""

from __future__ import annotations

import functools
import logging
import secrets
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import msgspec
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from ..keys import ChunkKey
from ..runtime import all_or_first_error
from ..transport import (
    Capabilities,
    ChunkMissing,
    LoadJob,
    Offer,
    PeerSource,
    SaveJob,
    Transport,
    TransportContext,
    TransportError,
)
from ..zmqio import BadFrame, TrioSocket, bind_loopback, shown
from .context import PeerContext, PeerRead
from .offers import (
    FRAME_SLACK,
    MAX_REASON,
    Dealers,
    HeldOffers,
    NotHeld,
    Renew,
    Renewed,
    answer_bind,
    answer_renew,
    dealer,
    renew_at,
    select_blocks,
)
from .security import Rejections, ZapSocket

__all__ = ["PeerOptions", "PeerTransport"]

log = logging.getLogger("kvflow.pd.offers")

CLOSE_TIMEOUT_S = 5.0
"""How long `aclose` waits for libzmq to close the transport's sockets and context."""
HANDSHAKE_IVL_MS = 5000
"""A connection to a producer that has not finished its handshake this long after it was
made is dropped (libzmq's `ZMQ_HANDSHAKE_IVL`; its default, 30 s, let idle strangers
hold connections six times as long). An honest handshake takes milliseconds."""


class PeerOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where a producer listens; a peer transport's options extend these."""

    host: str = "127.0.0.1"
    """Address the producer binds and advertises; loopback unless told otherwise."""
    port: int = 0
    """0: a free port, chosen at start and advertised; a taken fixed port is an error."""


class PeerTransport(Transport):
    """Base of peer transports (see the module text). Subclasses set `Pull` and
    `wire_version` and implement `decode`, `refusal`, `answer`, `ended` and `pull`."""

    Options: ClassVar[type[msgspec.Struct]] = PeerOptions
    capabilities = Capabilities(store=False, peer=True)
    Pull: ClassVar[type[Any]]
    """The wire's pull frame: it has `req`, `block_ids` and `version` (and `nonce`: the
    consumer's random bytes its answers are bound to, `reply`; without one, b"")."""
    reads_when_computed: bool = False
    """`answer` waits for each layer's `Offer.computed` before reading it, so a streamed
    offer's pull starts at once; otherwise a claim of such an offer is pending, and
    `serve` answers its pull, once its prefill computed every layer."""
    wire_version: ClassVar[int]
    max_frame_bytes: ClassVar[int]
    """The largest control frame a consumer sends this producer (its ROUTER's bound)."""

    context: PeerContext

    def __init__(self, options: Any, context: TransportContext) -> None:
        if not isinstance(context, PeerContext):  # a test's or a benchmark's
            context = PeerContext.of(context)
        super().__init__(options, context)
        self._zmq = zmq.Context()
        self._dealers = Dealers(self._zmq)
        """A consumer's connections to producers, kept for its next renewal at each."""
        self._router: TrioSocket | None = None
        self._zap: ZapSocket | None = None
        """Where libzmq asks for each connection's handshake to be checked (keyed
        workers; `serve` answers)."""
        self.held = HeldOffers()
        self.channel = context.channel
        self.reject = Rejections(f"{self.name} side channel", context.rejected)
        """Count and log a refused frame (a reason of `kvflow.pd.security.REJECT_REASONS`)."""
        self.consumer_id = secrets.token_hex(16)
        """This consumer's name in its renewals (`Renew.consumer`): what it claims by
        renewing, no other consumer may renew or release."""

    async def open(self) -> None:
        """Workers: bind the producer's endpoint (the scheduler's instance moves nothing).
        A keyless channel binds loopback only, unless it is `insecure`."""
        if self.context.role != "worker":
            return
        if why := self.channel.bind_problem(self.options.host):
            raise TransportError(f"kv_connector_extra_config['options']['host']: {why}")
        self._zap = self.channel.zap_socket(self._zmq)
        sock = self._zmq.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply is an error, not a drop
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes + FRAME_SLACK)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        try:
            self.channel.secure(sock, server=True)
            self.address = bind_loopback(sock, self.options.host, self.options.port)
        except (OSError, ValueError) as exc:
            sock.close(0)
            if self._zap is not None:  # an open socket would hold the process at exit
                self._zap.close()  # (its context's termination waits for it)
                self._zap = None
            raise TransportError(f"kv_connector_extra_config['options']: {exc}") from None
        self._router = TrioSocket(sock)

    def connect(self, address: str, max_frame_bytes: int) -> TrioSocket:
        """A consumer's socket to the producer at `address`, which must be a `tcp://` IP
        literal (loopback, keyless), refusing frames over `max_frame_bytes`."""
        return dealer(self._zmq, address, max_frame_bytes, self.channel)

    def seal_request(self, frame: bytes) -> bytes:
        """A consumer's control frame as sent to a producer (`Channel.seal`)."""
        return self.channel.seal(frame, "producer")

    def seal_answer(self, frame: bytes, nonce: bytes = b"", index: int = 0) -> bytes:
        """A producer's `index`-th answer to the request carrying `nonce`, as sent."""
        return self.channel.seal(frame, "consumer", answer_bind(nonce, index))

    def unseal(self, frame: Any) -> bytes | memoryview:
        """A control frame a producer received: its payload; `BadFrame` if it lacks this
        deployment's MAC toward a producer."""
        return self.channel.open(frame, "producer")

    async def aclose(self) -> None:
        """Close every socket and the ZMQ context, dropping what is queued. Bounded: once
        (a consumer that stopped reading mid-pull, zero-copy frames still queued to it)
        libzmq's context termination waited for ever, and a transport's close must not
        hang vLLM's shutdown; past `CLOSE_TIMEOUT_S` the context is left to its thread."""
        zctx = self._zmq
        self._dealers.close()
        with trio.move_on_after(CLOSE_TIMEOUT_S) as scope:
            await trio.to_thread.run_sync(zctx.destroy, 0, abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning(
                "kvflow %s: ZMQ did not close within %ss; left behind", self.name, CLOSE_TIMEOUT_S
            )

    # -- not a store ---------------------------------------------------------
    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        return 0

    async def save(self, job: SaveJob) -> None:
        raise TransportError(f"the {self.name} transport is a peer transport; it stores nothing")

    # -- producer --------------------------------------------------------------
    async def offer(self, offer: Offer) -> str:
        return await self.held.offer(offer, whole=not self.reads_when_computed)

    async def serve(self) -> None:
        router = self._router
        if router is None:
            raise TransportError(f"{self.name} serve() needs a worker-side transport")
        async with trio.open_nursery() as nursery:
            await self.serving(nursery)
            if self._zap is not None:
                nursery.start_soon(self.channel.answer_zap, self._zap)
                nursery.start_soon(self._count_failed_handshakes, router)
            while True:
                frames = await router.recv_multipart()
                try:
                    await self._handle(nursery, router, frames)
                except Exception as exc:  # one message's failure never ends serve()
                    why = shown(f"{type(exc).__name__}: {exc}")
                    self.reject("frame", f"handling a frame failed: {why}")
                await trio.lowlevel.checkpoint()  # a flood of frames never holds the loop

    async def _count_failed_handshakes(self, router: TrioSocket) -> None:
        """Count each connection whose handshake failed (a peer without the key)."""
        failed = (
            zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        # an endpoint of its own: pyzmq's default (one per socket) may still be bound by
        # the monitor of a `serve` cancelled just before ("Address already in use")
        where = f"inproc://kvflow-monitor-{secrets.token_hex(8)}"
        monitor = TrioSocket(router.sock.get_monitor_socket(failed, addr=where))
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                raw: Any = event.get("endpoint", b"")
                where = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
                self.reject("unauthenticated", f"a connection to {where} failed its handshake")
        finally:
            router.sock.disable_monitor()
            monitor.close()

    async def _handle(self, nursery: trio.Nursery, router: TrioSocket, frames: list[Any]) -> None:
        """One message from a consumer: checked, then answered (or dropped, counted)."""
        if len(frames) != 2:
            self.reject("frame", f"a message of {len(frames) - 1} frames (one expected)")
            return
        ident, data = frames
        try:
            payload = self.unseal(data)
        except BadFrame as exc:
            self.reject("unauthenticated", str(exc))
            return
        try:
            msg = self.decode(payload)
        except BadFrame as exc:
            self.reject("frame", str(exc))
            return
        if isinstance(msg, Renew):
            await answer_renew(self.held, router, ident, msg, self.channel)
        elif not isinstance(msg, self.Pull):
            self.ended(msg, ident)  # only the consumer that claimed it counts
        elif isinstance(found := self._claim(msg, ident), str):
            refusal = self.refusal(msg.req, found[:MAX_REASON])
            await self.reply(ident, msg.req, refusal, getattr(msg, "nonce", b""))
        elif found.params and not self.reads_when_computed:  # streamed: once computed
            nursery.start_soon(self._answer_computed, nursery, ident, msg, found)
        else:
            await self.answer(nursery, ident, msg, found)

    async def _answer_computed(
        self, nursery: trio.Nursery, ident: bytes, msg: Any, offer: Offer
    ) -> None:
        """Answer a pull of a streamed offer once its prefill computed every layer, held
        meanwhile (a transport that does not wait for each layer itself)."""
        try:
            with self.held.reading(offer.req):
                await offer.all_computed()
            await self.answer(nursery, ident, msg, offer)
        except NotHeld:  # withdrawn meanwhile (preempted)
            await self.reply(ident, msg.req, self.refusal(msg.req, "withdrawn"), msg.nonce)
        except Exception as exc:  # as in serve(): one pull's failure fails that pull only
            why = shown(f"{type(exc).__name__}: {exc}")
            self.reject("frame", f"answering a pull failed: {why}")
            self.held.release(msg.req, f"answering its pull failed: {why}", peer=ident)

    def _claim(self, msg: Any, ident: bytes) -> Offer | str:
        """The offered blocks `msg` asks for, claimed for `ident`; or why not. The layout
        is checked only for an offer held (a peer learns nothing of it otherwise)."""
        why = (
            f"wire version {msg.version}; this producer speaks {self.wire_version} (run "
            "the same kvflow version on both, docs/install.md#versions)"
            if msg.version != self.wire_version
            else ""
        )
        offer = None if why else self.held.get(msg.req)
        if offer is not None and not (why := self.check_pull(msg)):
            offer = select_blocks(offer, msg.block_ids)
            why = "" if offer else "the blocks asked for are not all offered, or repeat"
        readers = getattr(msg, "readers", 1)  # the ranks of a consumer of another TP size
        why = why or self.held.claim(msg.req, ident, readers)  # not held: why_not(req)
        return offer if offer is not None and not why else why

    async def reply(
        self, ident: bytes, req: str, frame: bytes, nonce: bytes = b"", index: int = 0
    ) -> bool:
        """Send a consumer the `index`-th answer to its request carrying `nonce` (a wire
        without nonces: b""), sealed; False if it is gone or does not read (`send`)."""
        return self.send(ident, [self.seal_answer(frame, nonce, index)], req)

    def send(self, ident: bytes, frames: list[Any], req: str, copy: bool = True) -> bool:
        """Queue `frames` (copied; `copy=False`: handed to libzmq, for buffers nothing else
        writes) for the consumer `ident`, never waiting: False, and dropped, if it is gone
        (ROUTER_MANDATORY) or its pipe is full because it does not read what it asked for
        (a peer that never reads must not stall `serve`, and with it every other
        consumer)."""
        assert self._router is not None
        try:
            self._router.send_now([ident, *frames], copy=copy)  # serve() may wait to receive
            return True
        except zmq.Again:
            self.reject(
                "frame", f"a consumer of {shown(req)} does not read its answers; dropped one"
            )
        except zmq.ZMQError as exc:
            log.info("kvflow %s: consumer of %s unreachable: %s", self.name, shown(req), exc)
        return False

    # -- what a transport says -------------------------------------------------
    async def serving(self, nursery: trio.Nursery) -> None:
        """`serve` started: start tasks that live as long as it (in `nursery`)."""

    @abstractmethod
    def decode(self, data: bytes | memoryview) -> Any:
        """A frame from a consumer (raise `BadFrame` when it is not one)."""

    def check_pull(self, msg: Any) -> str:
        """Why this producer cannot answer `msg` whatever it holds ("" if it can)."""
        return ""

    @abstractmethod
    def refusal(self, req: str, why: str) -> bytes:
        """The encoded frame that refuses a pull of `req` (the consumer raises
        `ChunkMissing` with `why`)."""

    @abstractmethod
    async def answer(self, nursery: trio.Nursery, ident: bytes, msg: Any, offer: Offer) -> None:
        """Answer a claimed pull of `offer` (the blocks `msg` asked for). Return soon:
        `serve` waits; a transfer that takes long runs in `nursery` (and keeps the blocks
        held with `held.reading` or `held.lend` while anything may read them)."""

    @abstractmethod
    def ended(self, msg: Any, ident: bytes) -> None:
        """A consumer's frame other than a pull or a renewal: its end of a pull."""

    # -- consumer --------------------------------------------------------------
    async def load(self, job: LoadJob) -> None:
        """Pull `job`'s blocks from the producer ranks that hold this worker's part of
        them (`PeerContext.peer_reads`): one rank's whole blocks when both sides have
        one tensor-parallel size, else each rank's heads; a layer is loaded once every
        pull delivered it, and the load fails as one."""
        src = job.source
        if src is None:
            raise TransportError(f"a {self.name} load needs a PeerSource (kv_transfer_params)")
        reads = self.context.peer_reads(src)
        if len(reads) == 1:
            await self.pull(job, src, reads[0], job.layer_loaded)
            return
        delivered = [0] * job.num_layers
        signalled = 0

        def landed(layer: int) -> None:
            nonlocal signalled
            delivered[layer] += 1
            while signalled < job.num_layers and delivered[signalled] == len(reads):
                job.layer_loaded(signalled)
                signalled += 1

        pulls = [functools.partial(self.pull, job, src, read, landed) for read in reads]
        await all_or_first_error(pulls, TransportError)

    @abstractmethod
    async def pull(
        self, job: LoadJob, src: PeerSource, read: PeerRead, landed: Callable[[int], None]
    ) -> None:
        """Pull `read` (one producer rank's blocks, or some of their heads) into `job`'s
        blocks, calling `landed(i)` as layer i lands."""

    def answer_to(
        self,
        frame: Any,
        decode: Callable[[bytes | memoryview], Any],
        req: str,
        nonce: bytes = b"",
        index: int = 0,
    ) -> Any:
        """A producer's `index`-th answer to this consumer's request about `req` carrying
        `nonce`, unsealed and decoded; `BadFrame` if it lacks this deployment's MAC for
        that answer (another key, a frame sent toward a producer, another request's or
        another place's answer), does not decode, or is about another offer."""
        payload = self.channel.open(frame, "consumer", answer_bind(nonce, index))
        msg = decode(payload)
        if msg.req != req:
            raise BadFrame(f"an answer about {msg.req[:40]!r}, not {req!r}")
        return msg

    async def receive(self, sock: TrioSocket, address: str, req: str, copy: bool = True) -> Any:
        """The producer's next message on a pull of `req`, waited for at most
        `progress_timeout_s` (the consumer's bound on a producer's silence: one that sends
        nothing for that long is dead or hung, and the load fails at once)."""
        wait = self.context.progress_timeout_s
        with trio.move_on_after(wait):
            return await sock.recv_multipart(copy=copy)
        raise TransportError(
            f"producer {address} sent nothing for {wait}s while {req} was pulled "
            "(progress_timeout_s): it is gone or hung"
        )

    @staticmethod
    def refused(address: str, req: str, reason: str) -> ChunkMissing:
        """The error of a pull the producer refused, its reason cut to `MAX_REASON`."""
        return ChunkMissing(f"producer {address} refused {req}: {shown(reason, MAX_REASON)}")

    async def renew(
        self, address: str, reqs: Sequence[str], lease_s: float, release: Sequence[str] = ()
    ) -> Renewed:
        return await renew_at(
            self._zmq, address, reqs, lease_s, self.channel, release, self.consumer_id,
            self._dealers,
        )  # fmt: skip
