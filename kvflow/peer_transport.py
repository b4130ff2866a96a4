"""`PeerTransport`: what every peer transport's producer does the same way.

A producer worker binds a ZMQ ROUTER endpoint (its `address`, advertised to
consumers), holds each finished request's blocks in `HeldOffers` until a consumer
is done with them, and answers its consumers in one loop (`serve`): renewals of a
claim, pulls, and a consumer's end of a pull. A pull is refused, naming why, when
its wire version differs, the request is not held, the blocks it asks for are not
all offered, or another consumer claimed it. What differs between transports (the
wire's frames, how the bytes move, how a pull ends) is the subclass's:
`decode`, `Pull`, `refusal`, `check_pull`, `answer` and `ended`.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec
import trio
import zmq

from .keys import ChunkKey
from .peer import HeldOffers, Renew, Renewed, answer_renew, renew_at, select_blocks
from .transport import Capabilities, Offer, SaveJob, Transport, TransportContext, TransportError
from .zmqio import BadFrame, TrioSocket, bind_loopback

__all__ = ["PeerOptions", "PeerTransport"]

log = logging.getLogger("kvflow.peer")

CLOSE_TIMEOUT_S = 5.0
"""How long `aclose` waits for libzmq to close the transport's sockets and context."""


class PeerOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where a producer listens; a peer transport's options extend these."""

    host: str = "127.0.0.1"
    """Address the producer binds and advertises; loopback unless told otherwise."""
    port: int = 0
    """0: a free port, chosen at start and advertised; a taken fixed port is an error."""


class PeerTransport(Transport):
    """Base of peer transports (see the module text). Subclasses set `Pull` and
    `wire_version` and implement `decode`, `refusal`, `answer` and `ended`."""

    Options: ClassVar[type[msgspec.Struct]] = PeerOptions
    capabilities = Capabilities(store=False, peer=True)
    Pull: ClassVar[type[Any]]
    """The wire's pull frame: it has `req`, `block_ids` and `version`."""
    wire_version: ClassVar[int]

    def __init__(self, options: Any, context: TransportContext) -> None:
        super().__init__(options, context)
        self._zmq = zmq.Context()
        self._router: TrioSocket | None = None
        self.held = HeldOffers()

    async def open(self) -> None:
        """Workers: bind the producer's endpoint (the scheduler's instance moves nothing)."""
        if self.context.role != "worker":
            return
        sock = self._zmq.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply is an error, not a drop
        try:
            self.address = bind_loopback(sock, self.options.host, self.options.port)
        except OSError as exc:
            sock.close(0)
            raise TransportError(f"kv_connector_extra_config['options']: {exc}") from None
        self._router = TrioSocket(sock)

    async def aclose(self) -> None:
        """Close every socket and the ZMQ context, dropping what is queued. Bounded: once
        (a consumer that stopped reading mid-pull, zero-copy frames still queued to it)
        libzmq's context termination waited for ever, and a transport's close must not
        hang vLLM's shutdown; past `CLOSE_TIMEOUT_S` the context is left to its thread."""
        zctx = self._zmq
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
        return await self.held.offer(offer)

    async def serve(self) -> None:
        router = self._router
        if router is None:
            raise TransportError(f"{self.name} serve() needs a worker-side transport")
        async with trio.open_nursery() as nursery:
            await self.serving(nursery)
            while True:
                ident, data = await router.recv_multipart()
                try:
                    msg = self.decode(data)
                except BadFrame as exc:
                    log.warning("kvflow %s: dropped a bad frame from a peer: %s", self.name, exc)
                    continue
                if isinstance(msg, Renew):
                    await answer_renew(self.held, router, ident, msg)
                elif not isinstance(msg, self.Pull):
                    self.ended(msg, ident)  # only the consumer that claimed it counts
                elif isinstance(found := self._claim(msg, ident), str):
                    await self.reply(ident, msg.req, self.refusal(msg.req, found))
                else:
                    await self.answer(nursery, ident, msg, found)

    def _claim(self, msg: Any, ident: bytes) -> Offer | str:
        """The offered blocks `msg` asks for, claimed for `ident`; or why not."""
        why = "wire version" if msg.version != self.wire_version else self.check_pull(msg)
        offer = None if why else self.held.get(msg.req)
        if offer is not None:
            offer = select_blocks(offer, msg.block_ids)
            why = "" if offer else f"blocks {msg.block_ids} are not all offered"
        why = why or self.held.claim(msg.req, ident)  # not held: why_not(req), never ""
        return offer if offer is not None and not why else why

    async def reply(self, ident: bytes, req: str, frame: bytes) -> bool:
        """Send a control frame to a consumer; False if it is gone (ROUTER_MANDATORY)."""
        assert self._router is not None
        try:
            await self._router.send_multipart([ident, frame])
            return True
        except zmq.ZMQError as exc:
            log.info("kvflow %s: consumer of %s unreachable: %s", self.name, req, exc)
            return False

    # -- what a transport says -------------------------------------------------
    async def serving(self, nursery: trio.Nursery) -> None:
        """`serve` started: start tasks that live as long as it (in `nursery`)."""

    @abstractmethod
    def decode(self, data: bytes) -> Any:
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
    async def renew(self, address: str, reqs: Sequence[str], lease_s: float) -> Renewed:
        return await renew_at(self._zmq, address, reqs, lease_s)
