"""The `zmq` peer transport: a producer worker serves held blocks, a consumer pulls them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import trio
import zmq

from kvflow.keys import ChunkKey
from kvflow.peer import HeldOffers
from kvflow.transport import (
    Capabilities,
    ChunkCorrupt,
    ChunkMissing,
    LoadJob,
    Offer,
    SaveJob,
    Transport,
    TransportContext,
    TransportError,
)
from kvflow.zmqio import TrioSocket, bind_loopback

from . import _wire as wire

log = logging.getLogger("kvflow.zmq")


class ZmqOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options of the `zmq` transport (`kv_connector_extra_config["options"]`)."""

    host: str = "127.0.0.1"
    """Address the producer binds and advertises; loopback unless told otherwise."""
    port: int = 0
    """0: a free port, chosen at start and advertised; a taken fixed port is an error."""


class ZmqTransport(Transport):
    name = "zmq"
    Options = ZmqOptions
    capabilities = Capabilities(store=False, peer=True, memory=frozenset({"cpu"}))

    def __init__(self, options: ZmqOptions, context: TransportContext) -> None:
        super().__init__(options, context)
        self.options: ZmqOptions = options
        self._zmq = zmq.Context()
        self._router: TrioSocket | None = None
        self.held = HeldOffers()

    async def open(self) -> None:
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
        self._zmq.destroy(linger=0)

    # -- store methods: not a store ----------------------------------------
    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        return 0

    async def save(self, job: SaveJob) -> None:
        raise TransportError("the zmq transport is a peer transport; it stores nothing")

    # -- producer ----------------------------------------------------------
    async def offer(self, offer: Offer) -> str:
        return await self.held.offer(offer)

    async def serve(self) -> None:
        router = self._router
        if router is None:
            raise TransportError("zmq serve() needs a worker-side transport")
        while True:
            ident, data = await router.recv_multipart()
            try:
                msg = wire.decode_to_producer(data)
            except wire.BadFrame as exc:
                log.warning("kvflow zmq: dropped a bad frame from a peer: %s", exc)
                continue
            if not isinstance(msg, wire.Pull):
                self.held.release(msg.req, "done" if isinstance(msg, wire.Done) else msg.reason)
            elif msg.req not in self.held or msg.version != wire.WIRE_VERSION:
                why = "wire version" if msg.req in self.held else "unknown or expired request"
                await router.send_multipart([ident, wire.encode(wire.Refused(msg.req, why))])
            else:
                with self.held.reading(msg.req) as offer:
                    await self._send_layers(router, ident, offer)

    async def _send_layers(self, router: TrioSocket, ident: bytes, o: Offer) -> None:
        trackers: list[zmq.MessageTracker] = []
        try:
            for layer in range(o.num_layers):
                spans = [s for chunk in o.spans(layer) for s in chunk]
                header = wire.encode(wire.Layer(o.req, layer, [len(s) for s in spans]))
                t = await router.send_multipart([ident, header, *spans], copy=False, track=True)
                if t is not None:
                    trackers.append(t)
        except zmq.ZMQError as exc:
            log.warning("kvflow zmq: sending %s failed: %s", o.req, exc)
        finally:
            with trio.CancelScope(shield=True):  # zmq reads the blocks until the trackers fire
                delay = 1e-4
                while not all(t.done for t in trackers):
                    await trio.sleep(delay)
                    delay = min(delay * 2, 5e-3)

    # -- consumer ----------------------------------------------------------
    async def load(self, job: LoadJob) -> None:
        src = job.source
        if src is None:
            raise TransportError("a zmq load needs a PeerSource (kv_transfer_params)")
        sock = TrioSocket(self._zmq.socket(zmq.DEALER))
        ok = False
        address = src.addresses[self.context.shards.index(self.context.shard)]
        try:
            sock.sock.connect(address)
            await sock.send_multipart([wire.encode(wire.Pull(src.req))])
            for layer in range(job.num_layers):
                frames: list[Any] = await sock.recv_multipart(copy=False)
                msg = wire.decode_to_consumer(frames[0].buffer)
                if isinstance(msg, wire.Refused):
                    raise ChunkMissing(f"producer {address} refused {src.req}: {msg.reason}")
                dest = [s for chunk in job.spans(layer) for s in chunk]
                sizes = [len(d) for d in dest]
                if msg.layer != layer or msg.sizes != sizes or len(frames) != len(dest) + 1:
                    raise ChunkCorrupt(
                        f"producer {address} sent layer {msg.layer} with spans {msg.sizes}; "
                        f"expected layer {layer} with {sizes}"
                    )
                for d, f in zip(dest, frames[1:], strict=True):
                    d[:] = f.buffer
                job.layer_loaded(layer)
            ok = True
        except wire.BadFrame as exc:
            raise ChunkCorrupt(f"producer {address}: {exc}") from None
        finally:
            reply = wire.Done(src.req) if ok else wire.Failed(src.req, "consumer gave up")
            try:
                sock.sock.send_multipart([wire.encode(reply)], zmq.NOBLOCK)
                sock.close(linger_ms=200)  # let Done/Failed reach the producer
            except zmq.ZMQError:
                sock.close()
