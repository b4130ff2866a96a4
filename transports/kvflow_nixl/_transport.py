"""The `nixl` peer transport: a consumer READs a producer's held blocks with NIXL.

Descriptor lists are prepared once: each worker prepares one over its own whole
KV memory at registration, and a consumer one over a producer's whole KV memory
when it first meets that producer agent (from the `Regions` that come with the
agent's metadata). Both lists hold one descriptor per (layer, run, block), a run
being a block's K or V half (or the whole block, when the cache packs it); a pull
then only picks indices. A chunk that is a partial block of a token-granular
cache moves just its tokens, through a small list prepared for that pull.

Block lifetime on the producer (the rule this file implements): from the moment
it answers a Pull with its block ids, the offer is held in `HeldOffers.reading`
until one of

1. the NIXL notification `Read` arrived (the consumer sends it once each of its
   READs is DONE) -> "done";
2. the consumer's `Failed` arrived over the side channel (it sends it once each
   of its READs is DONE/ERR, or stuck past a drain wait) -> its reason;
3. the hold lapsed: `beat_ms` (the consumer's `progress_timeout_s`) past the pull or
   past the consumer's latest heartbeat (`Reading`, every quarter of it, each answered
   `Held`), and never past the read lease: the consumer's own deadline (it sends how
   long it may still read) plus `DRAIN_TIMEOUT_S` plus a margin, capped at
   `kvflow.pd.offers.MAX_READ_LEASE_S`. A consumer that died frees the blocks within
   `beat_ms`. The consumer counts the hold from when it sent each answered heartbeat,
   and a load whose READs ended after it fails (vLLM recomputes): what they read may be
   blocks vLLM reused.

So the worker's hold timeout, which cancels `offer()`, never hands back blocks a
READ may still be reading: `HeldOffers.offer` waits for the reading to end,
which is bounded by the lease. Shutdown (cancelling `serve`) ends holds at once.

NIXL 1.5.1 facts this relies on: completion is poll-only (`check_xfer_state`);
`release_xfer_handle` on a handle still in PROC "cancels" with
`ucp_request_cancel` + `ucp_request_free`, which for RMA does not stop the
operation, so the consumer never releases a PROC handle before waiting for it
to leave PROC; one still in PROC after `DRAIN_TIMEOUT_S` is never released and
the load raises `TransferStuck` (the worker stops the engine rather than give
vLLM back blocks a READ may still write). The agent's progress thread polls
without sleeping (a whole core per agent), so it is off: the consumer's polls
and the producer's notification polls (running while a pull is open) drive UCX
progress. READs carry no notification of their own: on one host UCX moves a
READ's bytes inside `transfer()` (CMA), but one that carries a notification stays
PROC until the producer's agent next polls.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import trio
import zmq

from kvflow.geometry.layout import KVLayout
from kvflow.pd.context import PeerRead
from kvflow.pd.offers import (
    new_nonce,
    read_lease,
    read_lease_ms,
)
from kvflow.pd.peer_transport import PeerOptions, PeerTransport
from kvflow.runtime import Backoff
from kvflow.transport import (
    Capabilities,
    ChunkCorrupt,
    LoadJob,
    Offer,
    PeerSource,
    TransferStuck,
    TransportContext,
    TransportError,
)
from kvflow.zmqio import BadFrame, shown

from . import _wire as wire
from ._bounce import Bounce
from ._descs import (
    MEMORY_TYPES,
    Table,
    bases,
    disjoint,
    prepare,
    release,
)
from ._reads import POLL_MAX_S, POLL_MIN_S, Reads
from ._remotes import Remote, RemoteAgents

log = logging.getLogger("kvflow.nixl")

INSTALL_HINT = "pip install 'kvflow[nixl]' (or: pip install nixl-cu12==1.5.1)"
DRAIN_TIMEOUT_S = 5.0
"""How long a cancelled consumer waits for a READ in flight to end before releasing it."""
LEASE_MARGIN_S = 1.0
POLL_FAILED_S = 1.0
"""After a failed poll of NIXL's notifications, wait this long before the next (one log
line a second at most)."""
Backend = Literal["UCX"]


class NixlOptions(PeerOptions, forbid_unknown_fields=True, kw_only=True):
    """Options of the `nixl` transport (`kv_connector_extra_config["options"]`); `host`
    and `port` are the producer's side channel."""

    backend: Backend = "UCX"
    """NIXL backend plugin that moves the bytes (UCX: tested with CPU memory here)."""


def import_nixl() -> Any:
    """NIXL's Python API module: the `nixl` meta package or the `nixl_cu12` wheel."""
    errors = []
    for name in ("nixl._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise TransportError(
        f"the nixl transport needs NIXL's Python API ({'; '.join(errors)}); {INSTALL_HINT}"
    )


@dataclass
class _Pull:
    """One consumer's READ of a held offer, as the producer tracks it."""

    req: str
    agent: str
    ident: bytes
    """The consumer's side-channel identity: only its `Failed` counts."""
    lease_s: float
    beat_s: float = 0.0
    """Held this long past the pull and past each of the consumer's `Reading` (never past
    `lease_s`); 0: for all of `lease_s`."""
    outcome: str = ""
    ended: trio.Event = field(default_factory=trio.Event)
    hold: trio.CancelScope = field(default_factory=trio.CancelScope)
    cap: float = math.inf

    def end(self, outcome: str) -> None:
        if not self.ended.is_set():
            self.outcome = outcome
            self.ended.set()

    def start(self) -> None:
        now = trio.current_time()
        self.cap = now + self.lease_s
        self.hold.deadline = min(self.cap, now + self.beat_s) if self.beat_s else self.cap

    def beat(self) -> int:
        """The consumer still reads: hold `beat_s` from now, at most to the cap. Returns
        the ms granted; 0 if the hold already ended (or the pull has no beats)."""
        if not self.beat_s or self.ended.is_set() or self.hold.cancel_called:
            return 0
        now = trio.current_time()
        self.hold.deadline = min(self.cap, now + self.beat_s)
        return max(0, int((self.hold.deadline - now) * 1000))


@dataclass
class _ReadLease:
    """The consumer's view of how long the producer holds the blocks it READs: until
    `until` (its clock). A READ that ended later may have read blocks vLLM reused."""

    address: str
    req: str
    until: float
    error: str = ""

    def check(self) -> None:
        if self.error:
            raise TransportError(self.error)
        if trio.current_time() > self.until:
            raise TransportError(
                f"the READs of {self.req} ended after producer {self.address}'s hold of its "
                "blocks (no answer to a heartbeat in time): they may hold reused blocks"
            )


class NixlTransport(PeerTransport):
    name = "nixl"
    Options = NixlOptions
    capabilities = Capabilities(
        store=False,
        peer=True,
        memory=frozenset({"cpu", "cuda"}),
        hetero_tp=True,
        hetero_blocks=True,
    )
    Pull = wire.Pull
    wire_version = wire.WIRE_VERSION
    max_frame_bytes = wire.MAX_TO_PRODUCER_BYTES

    def __init__(self, options: NixlOptions, context: TransportContext) -> None:
        super().__init__(options, context)
        self.options: NixlOptions = options
        self._api: Any = None
        self._agent: Any = None
        self._reg: Any = None
        self._memory = "DRAM"
        self._bases: list[tuple[int, int]] = []
        self._local: Table | None = None
        self.remotes = RemoteAgents(options.backend)
        """The producers this consumer pulls from (their agents, added once)."""
        self._pulls: dict[tuple[str, bytes], _Pull] = {}
        """Open pulls by request and consumer (the ranks of a consumer of another tensor
        parallel size each pull the same request)."""
        self._reads_started = trio.Event()
        self._bounce: Bounce | None = None
        """Where a pull of cells in many small runs READs whole blocks (`_bounce`)."""

    # -- lifecycle -----------------------------------------------------------
    async def open(self) -> None:
        if self.context.role == "worker":
            self._api = import_nixl()
        await super().open()

    async def register(self, layout: KVLayout) -> None:
        """Create this worker's NIXL agent and register each layer as DRAM (CPU caches)
        or VRAM (CUDA caches)."""
        await super().register(layout)
        if layout.memory not in MEMORY_TYPES:
            raise TransportError(f"the nixl transport cannot register {layout.memory!r} memory")
        self._memory = MEMORY_TYPES[layout.memory]
        self._bases = bases(layout)
        if self._api is None:
            self._api = import_nixl()
        backend = self.options.backend
        ctx = self.context
        name = f"kvflow-{ctx.engine_id}-{ctx.shard}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            config = self._api.nixl_agent_config(enable_prog_thread=False, backends=[backend])
            agent = self._api.nixl_agent(name, config)
        except Exception as exc:
            raise TransportError(f"cannot create NIXL agent {name}: {exc}") from None
        if backend not in agent.backends:
            raise TransportError(
                f"kv_connector_extra_config['options']['backend']: NIXL has no usable "
                f"{backend!r} plugin; plugins found: {', '.join(agent.get_plugin_list())}"
            )
        self._agent = agent  # from here on aclose() undoes what registration did
        device = layout.tensors[0].device if self._memory == "VRAM" else None
        self._bounce = Bounce(agent, backend, device)
        sizes = [len(b) for b in layout.buffers] or [int(t.numel()) for t in layout.tensors]
        regions = disjoint(self._bases, sizes)
        try:
            self._reg = agent.register_memory(regions, self._memory, [backend])
            self._local = prepare(agent, "", self._bases, layout.geometries, self._memory, backend)
        except TransportError:
            raise
        except Exception as exc:
            why = f"{exc}{vram_hint(self._memory)}"
            raise TransportError(f"NIXL cannot register the KV memory: {why}") from None

    async def aclose(self) -> None:
        """Forget remote agents, deregister memory, drop the agent; each step survives a
        peer that is already gone."""
        agent, self._agent = self._agent, None
        if agent is not None:
            self.remotes.close(agent)
            if self._bounce is not None:
                self._bounce.close()
                self._bounce = None
            if self._local is not None:
                release(self._local.dlist)
                self._local = None
            if self._reg is not None:
                try:
                    agent.deregister_memory(self._reg, [self.options.backend])
                except Exception as exc:
                    log.warning("kvflow nixl: deregistering KV memory: %s", exc)
                self._reg = None
            del agent
        await super().aclose()

    def _layout(self) -> KVLayout:
        if self.context.layout is None:
            raise TransportError("the nixl transport has no registered KV memory")
        return self.context.layout

    def _require_agent(self) -> Any:
        if self._agent is None:
            raise TransportError("the nixl transport has no registered KV memory (or is closed)")
        return self._agent

    # -- producer ----------------------------------------------------------
    async def serving(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._poll_notifs, self._require_agent())

    def decode(self, data: bytes | memoryview) -> wire.ToProducer:
        return wire.decode_to_producer(data)

    def refusal(self, req: str, why: str) -> bytes:
        return wire.encode(wire.Refused(req, why))

    def ended(self, msg: wire.Failed | wire.Read | wire.Reading, ident: bytes) -> None:
        pull = self._pulls.get((msg.req, ident))  # only the consumer that pulls counts
        if isinstance(msg, wire.Reading):  # a heartbeat: answered, held or not
            held_ms = pull.beat() if pull is not None else 0
            answer = (
                wire.Held(msg.req, held_ms)
                if held_ms
                else wire.Refused(msg.req, "not held: its hold lapsed or the pull ended")
            )
            self.send(ident, [self.seal_answer(wire.encode(answer), msg.nonce)], msg.req)
        elif pull is not None:
            pull.end("done" if isinstance(msg, wire.Read) else msg.reason)

    async def answer(
        self, nursery: trio.Nursery, ident: bytes, msg: wire.Pull, offer: Offer
    ) -> None:
        pull = await nursery.start(self._hold, msg, ident)
        if pull is None:
            await self.reply(ident, msg.req, self.refusal(msg.req, "expired"), msg.nonce)
        else:
            await self._reply(ident, self._require_agent(), msg, offer, pull)

    async def _hold(
        self, msg: wire.Pull, ident: bytes, *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep `msg.req`'s blocks held while its consumer may READ them (see module doc).
        Starts with None if the offer ended meanwhile."""
        offer = self.held.get(msg.req)
        if offer is None:
            task_status.started(None)
            return
        lease_s = read_lease(msg.lease_ms) + LEASE_MARGIN_S
        pull = _Pull(msg.req, msg.agent, ident, lease_s, msg.beat_ms / 1000)
        self._pulls[msg.req, ident] = pull
        try:
            with self.held.reading(msg.req):
                pull.start()
                task_status.started(pull)
                self._reads_started.set()
                with pull.hold:
                    await pull.ended.wait()
                if not pull.ended.is_set():
                    agent = shown(msg.agent)  # a peer's words (its engine id in it)
                    log.warning(
                        "kvflow nixl: %s: consumer %s neither finished nor failed within its "
                        "read lease (%.1fs)",
                        shown(msg.req),
                        agent,
                        pull.lease_s,
                    )
                    pull.end(f"consumer {agent} silent past its read lease")
                self.held.release(msg.req, pull.outcome, peer=ident)
        finally:
            if self._pulls.get((msg.req, ident)) is pull:
                del self._pulls[msg.req, ident]

    async def _reply(
        self, ident: bytes, agent: Any, msg: wire.Pull, offer: Offer, pull: _Pull
    ) -> None:
        try:
            layout = self.context.layout
            assert layout is not None
            reply = wire.Blocks(
                msg.req,
                agent.name,
                b"",
                list(offer.block_ids),
                list(offer.token_counts),
                self._memory,
            )
            if msg.known != agent.name:
                regions = wire.Regions(self._bases, list(layout.geometries))
                metadata = agent.get_agent_metadata()
                reply = msgspec.structs.replace(reply, metadata=metadata, regions=regions)
            if not self.send(ident, [self.seal_answer(wire.encode(reply), msg.nonce)], msg.req):
                pull.end("the consumer is gone or does not read")  # it can READ nothing
        except TransportError as exc:
            log.warning("kvflow nixl: answering the pull of %s failed: %s", shown(msg.req), exc)
            pull.end(f"answering the pull failed: {exc}")  # no descriptors left: no READ

    async def _poll_notifs(self, agent: Any) -> None:
        """Collect READ notifications (this also drives the producer's UCX progress);
        sleeps on an event while no pull is open, backs off while nothing arrives. A
        failed poll is logged and retried, never the end of `serve`: that would end every
        pull's hold while the consumers may still READ."""
        backoff = Backoff(POLL_MIN_S, POLL_MAX_S)
        while True:
            if not self._pulls:
                self._reads_started = trio.Event()
                await self._reads_started.wait()
                backoff.reset()
            try:
                notifs: dict[str, list[bytes]] = agent.get_new_notifs()
            except Exception as exc:  # the side channel's Read still ends each pull
                log.warning("kvflow nixl: polling NIXL notifications failed: %s", exc)
                await trio.sleep(POLL_FAILED_S)
                continue
            if not notifs:
                await backoff.wait()
                continue
            for sender, messages in notifs.items():
                for data in messages:
                    self._on_notif(sender, data)
            backoff.reset()
            await trio.sleep(0)

    def _on_notif(self, sender: str, data: bytes) -> None:
        try:
            note = wire.decode_notif(self.unseal(data))
        except Exception as exc:  # BadFrame, or anything else a stranger's bytes raise:
            # one notification never ends the poll, and with it every pull's end
            self.reject("frame", f"a bad notification from {sender[:100]!r}: {shown(str(exc))}")
            return
        for pull in self._pulls.values():  # else late, foreign or stray
            if pull.req == note.req and pull.agent == sender:
                pull.end("done")

    # -- consumer ----------------------------------------------------------
    async def pull(
        self, job: LoadJob, src: PeerSource, read: PeerRead, landed: Callable[[int], None]
    ) -> None:
        agent = self._require_agent()
        address = read.address
        sock = self.connect(address, wire.MAX_TO_CONSUMER_BYTES)
        reads = Reads(
            agent, self.options.backend, self._local_table(), self._bases, self._memory,
            self._layout(), read.heads, landed, self._bounce,
        )  # fmt: skip
        ok = refused = False
        peer: Remote | None = None
        try:
            lease_ms = read_lease_ms(DRAIN_TIMEOUT_S)
            beat_ms = max(1, int(self.context.progress_timeout_s * 1000))
            known = self.remotes.known(address)
            nonce = new_nonce()
            pull = wire.Pull(
                src.req,
                agent.name,
                known,
                lease_ms,
                list(src.block_ids),
                beat_ms=beat_ms,
                readers=read.readers,
                nonce=nonce,
            )
            sent = trio.current_time()  # the producer holds beat_ms past its arrival
            await sock.send_multipart([self.seal_request(wire.encode(pull))])
            msg = await self._answer(sock, address, src.req, nonce)
            if isinstance(msg, wire.Refused):
                refused = True  # nothing is held for us: nothing to answer
                raise self.refused(address, src.req, msg.reason)
            if not isinstance(msg, wire.Blocks):
                raise BadFrame(f"a {type(msg).__name__} before the blocks")
            peer = self.remotes.acquire(agent, address, msg, self._layout())
            held = min(beat_ms, lease_ms or beat_ms) / 1000
            lease = _ReadLease(address, src.req, sent + held)
            try:
                await self._read_held(sock, lease, agent, job, peer, msg, reads)
            except BaseExceptionGroup as group:  # the READs' own error, as they raised it
                raise group.exceptions[0] from None
            lease.check()
            try:  # every READ is DONE: the producer may hand the blocks back
                agent.send_notif(peer.name, self.seal_request(wire.encode(wire.Read(src.req))))
            except Exception as exc:  # the side channel's Read below still tells it
                log.info("kvflow nixl: notifying %s of %s: %s", peer.shown, src.req, exc)
            ok = True
        except BadFrame as exc:
            raise ChunkCorrupt(f"producer {address}: {exc}") from None
        finally:
            stuck: TransferStuck | None = None
            with trio.CancelScope(shield=True):
                try:
                    drained = await self._drain(reads)
                except TransferStuck as exc:
                    drained, stuck = False, exc
            if peer is not None:
                self.remotes.release(agent, address, peer, drained)
            answer: wire.ToProducer | None = None
            if ok:
                answer = wire.Read(src.req)
            elif not refused:  # only now: none of our READs is in flight any more
                answer = wire.Failed(src.req, "consumer gave up")
            try:
                if answer is not None:
                    sock.sock.send_multipart([self.seal_request(wire.encode(answer))], zmq.NOBLOCK)
                sock.close(linger_ms=1000 if answer is not None else 0)  # let it arrive
            except zmq.ZMQError:
                sock.close()
            if stuck is not None:
                raise stuck

    def _local_table(self) -> Table:
        if self._local is None:
            raise TransportError("the nixl transport has no registered KV memory")
        return self._local

    async def _answer(self, sock: Any, address: str, req: str, nonce: bytes) -> Any:
        """The producer's answer to the request about `req` carrying `nonce` (within
        `progress_timeout_s`)."""
        frames = await self.receive(sock, address, req)
        if len(frames) != 1:
            raise BadFrame(f"an answer of {len(frames)} frames")
        return self.answer_to(frames[0], wire.decode_to_consumer, req, nonce)

    async def _read_held(
        self,
        sock: Any,
        lease: _ReadLease,
        agent: Any,
        job: LoadJob,
        peer: Remote,
        msg: wire.Blocks,
        reads: Reads,
    ) -> None:
        """`_read`, while a heartbeat keeps the producer holding the blocks (`_beat`)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._beat, sock, lease, nursery.cancel_scope)
            try:
                await self._read(agent, job, peer, msg, reads)
            finally:
                nursery.cancel_scope.cancel()

    async def _beat(self, sock: Any, lease: _ReadLease, reads: trio.CancelScope) -> None:
        """Every quarter of `progress_timeout_s`, ask the producer to hold the blocks that
        long again; each answer moves `lease.until` (from when it was asked). A producer
        that does not answer in time, or no longer holds them, stops the READs."""
        beat_s = self.context.progress_timeout_s
        try:
            while True:
                await trio.sleep(beat_s / 4)
                asked = trio.current_time()
                nonce = new_nonce()  # an earlier beat's Held, replayed, fails
                beat = wire.encode(wire.Reading(lease.req, nonce))
                await sock.send_multipart([self.seal_request(beat)])
                msg = await self._answer(sock, lease.address, lease.req, nonce)
                if not isinstance(msg, wire.Held):
                    why = shown(getattr(msg, "reason", type(msg).__name__))
                    raise TransportError(f"producer {lease.address} stopped holding: {why}")
                lease.until = max(lease.until, asked + msg.held_ms / 1000)
        except (TransportError, BadFrame) as exc:
            lease.error = f"reading {lease.req}: {exc}"
            reads.cancel()

    async def _read(
        self, agent: Any, job: LoadJob, peer: Remote, msg: wire.Blocks, reads: Reads
    ) -> None:
        await reads.read(job, peer, msg)

    async def _drain(self, reads: Reads) -> bool:
        return await reads.drain(DRAIN_TIMEOUT_S)


def vram_hint(memory: str, runtime: str = "libcudart.so.12") -> str:
    """What to add to a failed registration of GPU memory when CUDA 12's runtime does not
    load: nixl-cu12's UCX needs it for VRAM, and without it takes VRAM for host memory
    (NIXL_ERR_BACKEND). A torch built for CUDA 13 brings none (seen on an H100)."""
    if memory != "VRAM":
        return ""
    try:
        ctypes.CDLL(runtime)
    except OSError:
        return (
            f" ({runtime} does not load here, and nixl-cu12's UCX needs it to register GPU "
            "memory: with a torch built for CUDA 13, `pip install nvidia-cuda-runtime-cu12` "
            "and put its nvidia/cuda_runtime/lib directory on LD_LIBRARY_PATH)"
        )
    return ""
