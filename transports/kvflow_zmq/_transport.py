"""The `zmq` peer transport: a producer worker serves held blocks, a consumer pulls them.

Host (CPU) KV moves as ZMQ frames, layer by layer: copies of the blocks, so the blocks
go back to vLLM once queued, whatever a consumer does with its socket, or whether it
lives (zero-copy frames would let a consumer that stops reading keep them, or read what
vLLM wrote there next). A consumer waits at most `progress_timeout_s` for each layer.
CUDA KV on one host moves device to device over CUDA IPC (`_ipc`); ZMQ then carries
only the control frames.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import trio
import zmq

from kvflow.geometry.cells import cell_index, cells_of, is_token_major, put_cells
from kvflow.geometry.layout import KVLayout, LayoutError, peer_cells_problem, peer_layout_problem
from kvflow.geometry.topology import HeadRead
from kvflow.pd.context import PeerRead
from kvflow.pd.offers import new_nonce
from kvflow.pd.peer_transport import PeerOptions, PeerTransport
from kvflow.transport import (
    Capabilities,
    ChunkCorrupt,
    LoadJob,
    Offer,
    PeerSource,
    TransportContext,
    TransportError,
)
from kvflow.zmqio import BadFrame, shown

from . import _ipc as ipc
from . import _wire as wire

log = logging.getLogger("kvflow.zmq")


MAX_PULLS_COPIED = 8
"""Pulls a producer copies into ZMQ at once; more wait their turn."""


class ZmqOptions(PeerOptions, forbid_unknown_fields=True, kw_only=True):
    """Options of the `zmq` transport (`kv_connector_extra_config["options"]`)."""

    ipc_lease_s: float = 30.0
    """CUDA IPC: how long a consumer may copy a request's blocks out of the producer's
    memory before the producer may hand them back to vLLM regardless."""


class ZmqTransport(PeerTransport):
    name = "zmq"
    Options = ZmqOptions
    capabilities = Capabilities(
        store=False,
        peer=True,
        memory=frozenset({"cpu", "cuda"}),
        hetero_tp=True,
        hetero_blocks=True,
    )
    Pull = wire.Pull
    reads_when_computed = True
    wire_version = wire.WIRE_VERSION
    max_frame_bytes = wire.MAX_CONTROL_BYTES
    device_type: type[ipc.Device] = ipc.CudaDevice
    """How device memory is shared (tests on machines without a GPU swap in a stand-in)."""

    def __init__(self, options: ZmqOptions, context: TransportContext) -> None:
        super().__init__(options, context)
        self.options: ZmqOptions = options
        self._device = self.device_type()
        self._handles: list[ipc.IpcHandle] = []
        self._opened: dict[str, tuple[bytes, list[Any]]] = {}
        """Producers' layers opened by this consumer: address -> (first handle, layers)."""
        self._pulling: set[tuple[str, bytes]] = set()
        """Pulls being answered: (offer, consumer)."""
        self._copying = trio.CapacityLimiter(MAX_PULLS_COPIED)

    async def register(self, layout: KVLayout) -> None:
        await super().register(layout)
        if layout.memory != "cpu":  # exported once, sent with every pull
            self._handles = [self._device.export(t) for t in layout.tensors]
            self.reads_when_computed = False  # the consumer copies every layer at once

    async def aclose(self) -> None:
        self._opened.clear()
        await super().aclose()

    # -- producer ----------------------------------------------------------
    def decode(self, data: bytes | memoryview) -> wire.ToProducer:
        return wire.decode_to_producer(data)

    def refusal(self, req: str, why: str) -> bytes:
        return wire.encode(wire.Refused(req, why))

    def check_pull(self, msg: wire.Pull) -> str:
        """Host memory: a consumer of cells of our size, in blocks of any tokens, with our
        heads or asking for some we hold (what its runs do not match it gets as cells,
        `_as_cells`). CUDA IPC: the same cells (the copy converts layouts), in blocks of
        our tokens, or of any as a token stream, and its heads of ours."""
        ours = self._layout().geometries
        if not msg.geometries and msg.heads is None:
            return ""  # the consumer checks what it receives (each `Layer` describes it)
        sized = all(
            t.block_size == o.block_size for t, o in zip(msg.geometries, ours, strict=False)
        )
        if self._handles and msg.heads is None and sized:
            return peer_layout_problem(msg.geometries, ours, cells=True, producer=False)
        whole = msg.heads is None  # a consumer of our size: every head of ours
        if why := peer_cells_problem(
            msg.geometries, ours, producer=False, any_block_size=True, same_heads=whole
        ):
            return why
        h = msg.heads
        if h is not None and h.first + h.count > min(g.heads for g in ours):
            return f"heads {h.first}..{h.first + h.count - 1} are not held here"
        try:
            for g, cells in zip(ours, self._as_cells(msg), strict=True):
                if cells:  # what `_send` gathers: cells on a grid (never vLLM's CPU blocks)
                    cell_index(g, [0], [1], 0, 1)
        except LayoutError as exc:
            return str(exc)
        return ""

    def _as_cells(self, msg: wire.Pull) -> list[bool]:
        """Per layer, whether a pull gets the cells token-major (`Layer.cells`): its
        consumer's runs of the heads it asks for are not ours (another layout, head count
        or block size); else the runs as they lie. A `LayoutError` when a block does not split."""
        ours = self._layout().geometries
        if not msg.geometries:
            return [False] * len(ours)
        h = msg.heads
        return [
            t.block_size != o.block_size
            or (
                (t.block_shape() != o.block_shape())
                if h is None
                else (t.head_shape(h.count) != o.head_shape(h.count))
            )
            for t, o in zip(msg.geometries, ours, strict=True)
        ]

    def ended(self, msg: wire.Done | wire.Failed, ident: bytes) -> None:
        outcome = "done" if isinstance(msg, wire.Done) else msg.reason
        self.held.release(msg.req, outcome, peer=ident)

    async def answer(
        self, nursery: trio.Nursery, ident: bytes, msg: wire.Pull, offer: Offer
    ) -> None:
        if self._handles:
            lent = await nursery.start(self.held.lend, msg.req, self.options.ipc_lease_s)
            reply = self._ipc_reply(offer) if lent else wire.Refused(msg.req, "expired")
            if not await self.reply(ident, msg.req, wire.encode(reply), msg.nonce):
                self.held.release(msg.req, "the consumer went away", peer=ident)
        elif (msg.req, ident) in self._pulling:  # one consumer, one copy of an offer
            refusal = self.refusal(msg.req, "already being pulled by this consumer")
            await self.reply(ident, msg.req, refusal, msg.nonce)
        else:  # in a task: serve() goes on answering claims and renewals meanwhile
            self._pulling.add((msg.req, ident))
            nursery.start_soon(self._serve_pull, ident, offer, msg)

    async def _serve_pull(self, ident: bytes, offer: Offer, msg: wire.Pull) -> None:
        """One pull's answer, at most `MAX_PULLS_COPIED` at once; its failure fails that
        pull only, as in serve()."""
        try:
            async with self._copying:
                if not await self._send(ident, offer, msg, self._as_cells(msg)):
                    refusal = self.refusal(msg.req, "expired")
                    await self.reply(ident, msg.req, refusal, msg.nonce)
        except Exception as exc:
            why = shown(f"{type(exc).__name__}: {exc}")
            self.reject("frame", f"answering a pull failed: {why}")
            self.held.release(msg.req, f"answering its pull failed: {why}", peer=ident)
        finally:
            self._pulling.discard((msg.req, ident))

    def _ipc_reply(self, offer: Offer) -> wire.Ipc:
        layout = self._layout()
        return wire.Ipc(
            offer.req,
            ipc.host_id(),
            list(layout.geometries),
            list(offer.block_ids),
            self.options.ipc_lease_s,
            self._handles,
        )

    async def _send(self, ident: bytes, o: Offer, pull: wire.Pull, as_cells: list[bool]) -> bool:
        """Answer one host-memory pull: queue copies of `o`'s layers (of the pull's heads
        only, if it names some; token-major cells where `as_cells`), each layer's header
        answer i of the pull, for `ident` (in a task of its own, letting other tasks run
        between layers: a pull of many MiB on a busy core takes long, and a serve()
        that waited for it answered no claim meanwhile), never waiting on the
        consumer: one that does not read gets no more. Once queued, nothing
        reads the blocks for this consumer. False, sending nothing, if `o` is no longer
        held (it expired or closed before this task ran)."""
        if o.req not in self.held:
            return False
        outcome = "done"
        layout = self._layout()
        heads = pull.heads
        answer = 0  # each answer's index (`seal_answer`)
        with self.held.reading(o.req):
            for layer in range(o.num_layers):
                alive = True
                while alive and not await self._computed(o, layer):  # streamed: computing
                    computing = wire.encode(wire.Computing(o.req))
                    alive = await self.reply(ident, o.req, computing, pull.nonce, answer)
                    answer += 1
                if not alive:
                    outcome = "the consumer went away or does not read"
                    break
                if o.req not in self.held:  # withdrawn (preempted) meanwhile
                    outcome = "withdrawn by its producer (preempted)"
                    await self.reply(ident, o.req, self.refusal(o.req, outcome), pull.nonce, answer)
                    break
                g = layout.geometries[layer]
                first, count = (0, g.heads) if heads is None else (heads.first, heads.count)
                gathered = as_cells[layer] and not is_token_major(g, first, count)
                if gathered:  # a frame a chunk (each within the consumer's bound)
                    idx = cell_index(g, o.block_ids, o.token_counts, first, count)
                    cells = cells_of(layout.buffers[layer], g.cell_bytes)[idx]
                    ends = itertools.accumulate(n * count for n in o.token_counts)
                    spans: list[Any] = np.split(cells, list(ends)[:-1])
                elif heads is None:
                    spans = [s for chunk in o.spans(layer) for s in chunk]
                else:
                    chunks = layout.head_spans(layer, o.block_ids, o.token_counts, first, count)
                    spans = [s for chunk in chunks for s in chunk]
                sizes = [s.nbytes for s in spans]
                header = wire.Layer(o.req, layer, sizes, cells=as_cells[layer])
                sealed = self.seal_answer(wire.encode(header), pull.nonce, answer)
                answer += 1
                frames = [sealed, *spans]  # gathered: a fresh array
                if not self.send(ident, frames, o.req, copy=not gathered):
                    outcome = "the consumer went away or does not read"
                    break
                await trio.lowlevel.checkpoint()
        # Copies are queued (or the consumer is gone): nothing reads the blocks for it
        # again, so they go back now (once every reader's are), whatever becomes of it
        self.held.release(o.req, outcome, peer=ident)
        return True

    async def _computed(self, o: Offer, layer: int) -> bool:
        """Whether `o`'s `layer` is computed, waiting at most half the consumer's bound on
        a producer's silence (`progress_timeout_s`: the same on both sides)."""
        with trio.move_on_after(self.context.progress_timeout_s / 2):
            await o.computed(layer)
            return True
        return False

    # -- consumer ----------------------------------------------------------
    async def pull(
        self, job: LoadJob, src: PeerSource, read: PeerRead, landed: Callable[[int], None]
    ) -> None:
        """Pull `read` (one producer rank's blocks, or some of their heads) into `job`'s
        blocks, calling `landed(i)` as layer i arrives."""
        address = read.address
        layout = self._layout()
        largest = max(g.chunk_nbytes(g.block_size) for g in layout.geometries)
        if src.block_size:  # a producer's chunk of its heads of ours
            largest = max(largest, *(g.chunk_nbytes(1) * src.block_size for g in layout.geometries))
        sock = self.connect(address, max(wire.MAX_CONTROL_BYTES, largest))
        ok = refused = False
        h = read.heads
        try:
            pulled = trio.current_time()  # a lease can start no earlier than this
            nonce = new_nonce()
            pull = wire.Pull(
                src.req,
                list(src.block_ids),
                geometries=layout.geometries,
                heads=None if h is None else wire.Heads(h.first, h.count),
                readers=read.readers,
                nonce=nonce,
            )
            await sock.send_multipart([self.seal_request(wire.encode(pull))])
            answer = 0  # each answer's index
            for layer in range(job.num_layers):  # a layer (or Ipc, Refused) after Computing
                msg: Any = wire.Computing(src.req)
                while isinstance(msg, wire.Computing):
                    frames: list[Any] = await self.receive(sock, address, src.req, copy=False)
                    msg = self.answer_to(
                        frames[0].buffer, wire.decode_to_consumer, src.req, nonce, answer
                    )
                    answer += 1
                if isinstance(msg, wire.Refused):
                    refused = True  # nothing held for us: nothing to answer
                    raise self.refused(address, src.req, msg.reason)
                if isinstance(msg, wire.Ipc):
                    await self._copy_ipc(job, src, msg, address, pulled, h, landed)
                    break
                if layout.memory != "cpu":
                    raise TransportError(
                        f"producer {address} sends host memory; this consumer's KV cache is "
                        f"in {layout.memory} memory (both sides need the same kind)"
                    )
                self._land(job, layer, msg, frames[1:], h, address, src)
                landed(layer)
            ok = True
        except BadFrame as exc:
            raise ChunkCorrupt(f"producer {address}: {exc}") from None
        finally:
            reply = wire.Done(src.req) if ok else wire.Failed(src.req, "consumer gave up")
            linger = 0
            try:
                if not refused:  # a refused pull holds nothing: nothing to answer
                    sock.sock.send_multipart([self.seal_request(wire.encode(reply))], zmq.NOBLOCK)
                    linger = 200  # let Done/Failed reach the producer
            except zmq.ZMQError:
                pass
            sock.close(linger_ms=linger)

    def _land(
        self,
        job: LoadJob,
        layer: int,
        msg: wire.Layer,
        frames: list[Any],
        h: HeadRead | None,
        address: str,
        src: PeerSource,
    ) -> None:
        """Copy one layer's frames into `job`'s blocks: span by span (the producer's runs
        are ours), or, when the producer sent the cells token-major (`Layer.cells`: another
        layout, block size, or heads that lie otherwise in a block of another head count),
        each cell into place (`kvflow.geometry.cells`), from `src.skip` tokens into the stream."""
        layout = self._layout()
        g = layout.geometries[layer]
        got = [len(f.buffer) for f in frames]
        if msg.layer != layer or msg.sizes != got:
            raise ChunkCorrupt(
                f"producer {address} sent layer {msg.layer} with spans {msg.sizes[:8]} in "
                f"frames of {got[:8]}; expected layer {layer}"
            )
        into, count = (0, g.heads) if h is None else (h.into, h.count)
        if msg.cells and (src.block_size or not is_token_major(g, into, count)):
            try:
                idx = cell_index(g, job.block_ids, job.token_counts, into, count)
            except LayoutError as exc:
                raise ChunkCorrupt(f"producer {address} sent cells: {exc}") from None
            per, skip = count * g.cell_bytes, src.skip * count
            fits = (
                all(n % per == 0 for n in got) and sum(got) >= (skip + len(idx)) * g.cell_bytes
                if src.block_size  # the producer's chunks, from its first block's start
                else got == [n * per for n in job.token_counts]
            )
            if not fits:
                raise ChunkCorrupt(f"producer {address} sent layer {layer} in {got[:8]} bytes")
            ours, at = cells_of(layout.buffers[layer], g.cell_bytes), -skip
            for f in frames:
                data = np.frombuffer(f.buffer, np.uint8).reshape(-1, g.cell_bytes)
                put_cells(ours, idx, data, at)
                at += len(data)
            return
        chunks = (
            job.spans(layer)
            if h is None
            else layout.head_spans(layer, job.block_ids, job.token_counts, into, count)
        )
        dest = [s for chunk in chunks for s in chunk]
        if got != [len(d) for d in dest]:
            raise ChunkCorrupt(
                f"producer {address} sent layer {layer} in spans {got[:8]}; expected "
                f"{[len(d) for d in dest][:8]}"
            )
        for d, f in zip(dest, frames, strict=True):
            d[:] = f.buffer

    def _layout(self) -> KVLayout:
        if self.context.layout is None:
            raise TransportError("zmq load() needs a registered worker-side transport")
        return self.context.layout

    async def _copy_ipc(
        self,
        job: LoadJob,
        src: PeerSource,
        msg: wire.Ipc,
        address: str,
        leased: float,
        h: HeadRead | None,
        landed: Callable[[int], None],
    ) -> None:
        """Copy the offered blocks (or heads `h` of them) device to device out of the
        producer's memory, calling `landed(i)` as layer i lands."""
        layout = self._layout()
        _check_ipc_offer(job, src, msg, address, layout, h)
        heads = None if h is None else (h.first, h.into, h.count)
        first = msg.handles[0].handle if msg.handles else b""
        if self._opened.get(address, (None,))[0] != first:  # new, or the producer restarted
            self._opened[address] = (first, [self._device.open(h) for h in msg.handles])
        theirs = self._opened[address][1]
        index, tokens = None, None
        with self._device.stream(layout.tensors[0].device):  # ordered before the copies
            if src.block_size:  # another block size: the tokens as one stream
                tokens = ipc.stream_map(
                    theirs[0], msg.geometries[0], src.block_ids, src.skip,
                    layout.tensors[0], layout.geometries[0], job.block_ids, job.token_counts,
                )  # fmt: skip
            else:
                index = ipc.ChunkIndex(
                    src.block_ids,
                    job.block_ids,
                    job.token_counts,
                    layout.geometries[0],
                    theirs[0].device,
                    layout.tensors[0].device,
                )
        queued: list[int] = []  # layers copied, not yet waited for
        for group in _layer_groups(job, msg, layout, theirs):
            ours = [layout.tensors[i] for i in group]
            g_src, g_dst = msg.geometries[group[0]], layout.geometries[group[0]]
            with self._device.stream(ours[0].device):
                if index is None:
                    ipc.copy_stream(
                        [theirs[i] for i in group], g_src, src.block_ids, src.skip,
                        ours, g_dst, job.block_ids, job.token_counts,
                        heads or (0, 0, g_dst.heads), tokens,
                    )  # fmt: skip
                else:
                    ipc.copy_chunks([theirs[i] for i in group], g_src, ours, g_dst, index, heads)
            queued.extend(group)
            if job.layerwise or group[-1] == job.num_layers - 1:  # else: one wait for all
                await self._landed({layout.tensors[i].device for i in queued})
                if trio.current_time() - leased > msg.lease_s:
                    raise TransportError(
                        f"copying from {address} outlived the producer's lease of "
                        f"{msg.lease_s}s (ipc_lease_s): its blocks may be reused",
                        chunk=0,
                    )
                for i in queued:
                    landed(i)
                queued = []

    async def _landed(self, devices: set[Any]) -> None:
        """Wait for the copies queued on `devices`; cancelled, still wait (blocking) before
        the producer's blocks go back."""
        try:
            for device in devices:
                await self._device.done(device)
        except BaseException:
            for device in devices:
                self._device.wait_idle(device)
            raise


def _layer_groups(
    job: LoadJob, msg: wire.Ipc, layout: KVLayout, theirs: list[Any]
) -> list[list[int]]:
    """The layers a pull copies together: each alone when a forward waits on them layer
    by layer (`job.layerwise`), else runs of layers of the same geometries on the same
    devices (one launch each on a GPU)."""
    groups: list[list[int]] = []
    key = lambda i: (  # noqa: E731
        msg.geometries[i],
        layout.geometries[i],
        layout.tensors[i].device,
        theirs[i].device,
    )
    for i in range(job.num_layers):
        if groups and not job.layerwise and key(i) == key(groups[-1][-1]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _check_ipc_offer(
    job: LoadJob,
    src: PeerSource,
    msg: wire.Ipc,
    address: str,
    layout: KVLayout,
    h: HeadRead | None,
) -> None:
    """Refuse an offer this consumer cannot copy: another memory kind or host, other
    cells (or heads `h` it does not hold), other blocks."""
    here = ipc.host_id()
    if layout.memory == "cpu":
        raise TransportError(
            f"producer {address} offers CUDA memory; this consumer's KV cache is in host "
            "memory (both sides need the same kind)"
        )
    if msg.host != here:
        raise TransportError(
            f"CUDA IPC needs producer and consumer on one host: {address} is on "
            f"{shown(msg.host)}, this consumer on {here}"
        )
    if h is None and not src.block_size:
        why = peer_layout_problem(msg.geometries, layout.geometries, cells=True)
    else:  # heads of theirs, or tokens of blocks of another size: cell by cell
        other = bool(src.block_size)
        first, count = (0, layout.geometries[0].heads) if h is None else (h.first, h.count)
        why = peer_cells_problem(
            msg.geometries, layout.geometries, any_block_size=other, same_heads=h is None
        ) or next(
            (
                f"its blocks do not hold heads {first}..{first + count - 1} as cells"
                for g in msg.geometries
                if g.block_bytes or first + count > g.heads
            ),
            "",
        )
    if why:
        raise ChunkCorrupt(f"producer {address}: {why}")
    if len(msg.handles) != len(msg.geometries) or any(
        h.nbytes < g.extent() for h, g in zip(msg.handles, msg.geometries, strict=False)
    ):
        raise ChunkCorrupt(f"producer {address}: its memory handles do not cover its layers")
    tokens = sum(job.token_counts) + src.skip
    if src.block_size and (
        any(g.block_size != src.block_size for g in msg.geometries)
        or len(src.block_ids) * src.block_size < tokens
    ):
        raise ChunkCorrupt(
            f"producer {address}: its blocks of {src.block_size} tokens {src.block_ids[:8]} "
            f"do not hold the {tokens} tokens asked for"
        )
    if msg.block_ids != src.block_ids or (
        not src.block_size and len(job.block_ids) != len(src.block_ids)
    ):
        raise ChunkCorrupt(
            f"producer {address} offers blocks {msg.block_ids}; the consumer asked for "
            f"{src.block_ids} into {len(job.block_ids)} blocks"
        )
    try:
        for g_src, g_dst in set(zip(msg.geometries, layout.geometries, strict=True)):
            g_src.check_blocks(src.block_ids, f"producer {address}")
            g_dst.check_blocks(job.block_ids, "destination")
    except LayoutError as exc:
        raise ChunkCorrupt(str(exc)) from None
