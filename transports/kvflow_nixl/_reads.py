"""The READs of one pull, on the consumer: the offer checked, whole blocks read through
the prepared lists and partial blocks through lists of their own, READ_AHEAD layers
posted at once, each layer signalled as it lands, and every handle drained (left
PROC) before it is released.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import trio

from kvflow.geometry.cells import cell_index, head_copy_runs
from kvflow.geometry.layout import KVLayout, LayerGeometry, LayoutError, layout_mismatch
from kvflow.geometry.topology import HeadRead
from kvflow.runtime import Backoff, cuda_event, event_done
from kvflow.transport import ChunkCorrupt, LoadJob, TransferStuck, TransportError

from . import _wire as wire
from ._bounce import (
    MANY_RUNS,
    Bounce,
    Piece,
    scatter_cells,
    scatter_on_device,
    scatter_stream,
    windows,
)
from ._descs import Table, release
from ._remotes import Remote

__all__ = ["POLL_MAX_S", "POLL_MIN_S", "READ_AHEAD", "Reads"]

READ_AHEAD = 2
"""Layers whose READs are in flight at once: a posted READ may copy inside `transfer()`
or in the next poll, which progresses every posted READ; a short window lets layer 0
land (and attention start) early, and keeps each blocking NIXL call one layer long."""
POLL_MIN_S = 1e-4
POLL_MAX_S = 2e-3
"""Backoff of the completion/notification polls: never a busy loop, a few ms at most."""


class Reads:
    """One pull's READs: `read` them, then always `drain` (also when `read` raised)."""

    def __init__(
        self,
        agent: Any,
        backend: str,
        local: Table,
        bases: list[tuple[int, int]],
        memory: str,
        layout: KVLayout,
        heads: HeadRead | None = None,
        landed: Callable[[int], None] | None = None,
        bounce: Bounce | None = None,
    ) -> None:
        self.agent = agent
        self.backend = backend
        self.local = local
        """This worker's prepared list over its whole KV memory."""
        self.bases = bases
        self.memory = memory
        self.layout = layout
        self.heads = heads
        """Which of the producer's heads land in which of ours (a producer of another
        tensor parallel size); None: all, into the same."""
        self.landed = landed
        """Called as each layer lands (default: the job's `layer_loaded`)."""
        self.bounce = bounce
        """Where cells in many small runs are READ through (`_bounce`)."""
        self.xfers: list[Any] = []
        """Every posted READ's handle, until drained."""
        self.dlists: list[Any] = []
        """This pull's own descriptor lists, until drained."""

    @staticmethod
    def _check_offer(job: LoadJob, peer: Remote, msg: wire.Blocks, layout: KVLayout) -> None:
        """Refuse an offer of other chunks (of another block size: too few tokens), or of
        blocks either side does not have."""
        src = job.source
        if src is not None and src.block_size:
            full, last = msg.token_counts[:-1], msg.token_counts[-1:]
            if (
                len(msg.token_counts) != len(msg.block_ids)
                or any(n != src.block_size for n in full)
                or any(not 0 < n <= src.block_size for n in last)
            ):
                raise ChunkCorrupt(
                    f"producer {peer.shown} offers chunks of {msg.token_counts[:8]} tokens in "
                    f"{len(msg.block_ids)} blocks of {src.block_size}"
                )
            if sum(msg.token_counts) < src.skip + sum(job.token_counts):
                raise ChunkCorrupt(
                    f"producer {peer.shown} offers {sum(msg.token_counts)} tokens; {job.req} "
                    f"expects {src.skip} it skips and {sum(job.token_counts)} it loads"
                )
        elif msg.token_counts != job.token_counts or len(msg.block_ids) != len(job.block_ids):
            raise ChunkCorrupt(
                f"producer {peer.shown} offers chunks of {msg.token_counts} tokens in blocks "
                f"{msg.block_ids}; {job.req} expects {job.token_counts} in "
                f"{len(job.block_ids)} blocks"
            )
        tokens = src.block_size if src is not None and src.block_size else layout.block_size
        try:
            for i, (theirs, ours) in enumerate(
                zip(peer.table.geometries, layout.geometries, strict=True)
            ):
                if not theirs.block_bytes and theirs.block_size != tokens:
                    raise LayoutError(
                        f"KV layouts differ (layer {i}): producer {theirs.describe()}, "
                        f"consumer {ours.describe()}; the pull expects blocks of {tokens}"
                    )
                theirs.check_blocks(msg.block_ids, f"producer {peer.shown}")
                ours.check_blocks(job.block_ids, "consumer")
        except LayoutError as exc:
            raise ChunkCorrupt(str(exc)) from None

    def _own_lists(
        self, job: LoadJob, peer: Remote, msg: wire.Blocks, chunks: list[int]
    ) -> tuple[tuple[Any, Any] | None, list[int]]:
        """Descriptor lists (ours, theirs) of this pull only, over `chunks`: their heads
        (`self.heads`) cell by cell where they lie in each side's blocks, neighbours
        merged (`kvflow.geometry.cells.head_copy_runs`), kept for `drain`; and where each layer's
        rows start in them."""
        starts = [0]
        if not chunks:
            return None, starts
        src = job.source
        if src is not None and src.block_size:  # every chunk: a token stream of their blocks
            spans = stream_spans(
                job.block_ids, job.token_counts, msg.block_ids, src.block_size, src.skip
            )
        else:
            spans = [
                Span(c, job.block_ids[c], msg.block_ids[c], job.token_counts[c]) for c in chunks
            ]
        mine, theirs = _pair_descs(
            self.bases, self.layout.geometries, peer.bases, peer.table.geometries,
            spans, self.heads, peer.shown,
        )  # fmt: skip
        for layer in mine:
            starts.append(starts[-1] + len(layer))
        try:
            for who, descs, memory in (("", mine, self.memory), (peer.name, theirs, peer.memory)):
                flat = np.concatenate(descs).astype(np.uint64)
                self.dlists.append(self.agent.prep_xfer_dlist(who, flat, memory, [self.backend]))
        except Exception as exc:
            raise TransportError(f"NIXL cannot prepare the READ from {peer.shown}: {exc}") from None
        return (self.dlists[-2], self.dlists[-1]), starts

    async def read(self, job: LoadJob, peer: Remote, msg: wire.Blocks) -> None:
        """READ `msg`'s blocks from `peer` into `job`'s, layer by layer, READ_AHEAD
        layers in flight; signal each as it lands."""
        layout, local = self.layout, self.local
        landed = self.landed or job.layer_loaded
        self._check_offer(job, peer, msg, layout)
        # Whole blocks of the same layout come from the prepared lists; a partial block of
        # a token-granular cache must move only its tokens, and blocks of another layout
        # or some of their heads move cell by cell: through lists of this pull's own.
        packed = all(g.block_bytes for g in layout.geometries)
        same = self.heads is None and not layout_mismatch(peer.table.geometries, layout.geometries)
        other_blocks = job.source is not None and bool(job.source.block_size)
        if (other_blocks or not same) and self._bounced(job, peer):
            assert self.bounce is not None
            async with self.bounce.lock:
                await self._read_bounced(job, peer, msg, landed)
            return
        full = [
            same and not other_blocks and (packed or n >= layout.block_size)
            for n in job.token_counts
        ]
        whole = [c for c, f in enumerate(full) if f]
        partial = [c for c, f in enumerate(full) if not f]
        theirs_ids = np.array([msg.block_ids[c] for c in whole], np.int64)
        ours_ids = np.array([job.block_ids[c] for c in whole], np.int64)
        tails, tail_starts = self._own_lists(job, peer, msg, partial)
        # Layer by layer (layer 0 lands, and attention can start, early), or all layers
        # in one READ when nobody waits on single layers (an asynchronous P/D pull).
        step = 1 if job.layerwise else max(1, job.num_layers)
        groups = [range(i, min(i + step, job.num_layers)) for i in range(0, job.num_layers, step)]

        def sides(group: range) -> list[tuple[Any, Any, Any, Any]]:
            """(our list, our rows, their list, their rows) of each READ of `group`."""
            out = []
            if whole:
                ours = np.concatenate([local.index(n, ours_ids) for n in group])
                theirs = np.concatenate([peer.table.index(n, theirs_ids) for n in group])
                out.append((local.dlist, ours, peer.table.dlist, theirs))
            if tails is not None:
                idx = np.arange(tail_starts[group[0]], tail_starts[group[-1] + 1], dtype=np.int32)
                out.append((tails[0], idx, tails[1], idx))
            return out

        posted = [self._post(peer, g[0], sides(g)) for g in groups[:READ_AHEAD]]
        for g, group in enumerate(groups):
            await self._wait(peer, group[0], posted[g])
            if g + READ_AHEAD < len(groups):
                ahead = groups[g + READ_AHEAD]
                posted.append(self._post(peer, ahead[0], sides(ahead)))
            for i in group:
                landed(i)
            await trio.lowlevel.checkpoint()

    def _heads(self) -> tuple[int, int, int]:
        """(their first head, our first head, how many) this pull moves."""
        h = self.heads
        if h is None:
            return 0, 0, self.layout.geometries[0].heads
        return h.first, h.into, h.count

    def _bounced(self, job: LoadJob, peer: Remote) -> bool:
        """Whether this pull's cells lie in so many small runs that it goes through the
        bounce buffer."""
        if self.bounce is None or not self.bounce.usable:
            return False
        first, into, count = self._heads()
        src = job.source
        if src is not None and src.block_size:  # the pieces of blocks a token stream spans
            cut = stream_spans(job.block_ids, job.token_counts, _ANY, src.block_size, src.skip)
            pieces = {(sp.tokens, sp.their_at, sp.our_at) for sp in cut}
        else:
            pieces = {(max(job.token_counts), 0, 0)}
        try:
            return any(
                not og.block_bytes
                and len(head_copy_runs(tg, first, og, into, count, n, True, t_at, o_at)) > MANY_RUNS
                for tg, og in set(zip(peer.table.geometries, self.layout.geometries, strict=True))
                for n, t_at, o_at in pieces
            )
        except LayoutError:
            return False  # refused, naming both, by the strided path

    async def _read_bounced(
        self, job: LoadJob, peer: Remote, msg: wire.Blocks, landed: Callable[[int], None]
    ) -> None:
        """READ the producer's whole blocks into the bounce buffer a window at a time and
        scatter the cells of this pull's heads into ours: host memory in a thread (the
        loop keeps serving meanwhile), device memory by torch there; see `_bounce`."""
        bounce = self.bounce
        assert bounce is not None
        region = bounce.region()
        first, into, count = self._heads()
        theirs, ours, counts = peer.table.geometries, self.layout.geometries, job.token_counts
        if first + count > min(g.heads for g in theirs):
            raise TransportError(f"producer {peer.shown} does not hold heads {first}..")
        ids = np.array(msg.block_ids, np.int64)
        skip = job.source.skip if job.source is not None and job.source.block_size else -1
        starts = list(itertools.accumulate(msg.token_counts, initial=0))  # of their chunks

        @functools.cache
        def dst_of(g: LayerGeometry) -> np.ndarray:  # one per geometry, not per piece
            return cell_index(g, job.block_ids, counts, into, count)

        def on_device(window: list[Piece], bases: list[int]) -> None:
            for (layer, c0, c1), base in zip(window, bases, strict=True):
                if skip < 0:  # their chunks are ours, one for one
                    dst = cell_index(ours[layer], job.block_ids[c0:c1], counts[c0:c1], into, count)
                    piece = (base, first, count, counts[c0:c1])
                    scatter_on_device(region, theirs[layer], piece, self._tensor(layer), dst, 0)
                    continue
                at = (starts[c0] - skip) * count  # the piece's first cell, in `dst_of`
                piece = (base, first, count, msg.token_counts[c0:c1])
                mine = self._tensor(layer)
                scatter_on_device(region, theirs[layer], piece, mine, dst_of(ours[layer]), at)

        def on_host(window: list[Piece], bases: list[int]) -> None:
            buf = region.data
            for (layer, c0, c1), base in zip(window, bases, strict=True):
                tg, mine = theirs[layer], self.layout.buffers[layer]
                if skip < 0:
                    into_ours = (mine, ours[layer], job.block_ids[c0:c1], into)
                    scatter_cells(buf, tg, base, first, count, counts[c0:c1], into_ours)
                    continue
                at, cell = (starts[c0] - skip) * count, ours[layer].cell_bytes
                piece = (base, first, count, msg.token_counts[c0:c1])
                scatter_stream(buf, tg, piece, mine, cell, dst_of(ours[layer]), at)

        for window in windows(theirs, len(ids)):
            bases = await self._read_window(peer, window, ids)
            if bounce.device is None:
                await trio.to_thread.run_sync(on_host, window, bases)  # never abandoned
            else:
                try:
                    on_device(window, bases)
                finally:  # what was queued reads the region and writes our blocks
                    with trio.CancelScope(shield=True):
                        await event_done(_record(region.device))
            for layer, _, c1 in window:
                if c1 == len(ids):
                    landed(layer)

    def _tensor(self, layer: int) -> Any:
        """Our layer as a flat uint8 torch tensor (host memory: over its buffer)."""
        if self.layout.tensors:
            return self.layout.tensors[layer]
        import torch

        return torch.frombuffer(self.layout.buffers[layer], dtype=torch.uint8)

    async def _read_window(self, peer: Remote, window: list[Piece], ids: np.ndarray) -> list[int]:
        """READ `window`'s producer blocks into the bounce buffer, run by run as its
        prepared list holds them; where each piece starts."""
        bounce = self.bounce
        assert bounce is not None
        theirs = peer.table.geometries
        rows, remote, bases, at = [], [], [], 0
        for layer, c0, c1 in window:
            remote.append(peer.table.index(layer, ids[c0:c1]))
            bases.append(at)
            for _, n in theirs[layer].block_runs():  # run-major, as `Table.index`
                starts = bounce.address + at + np.arange(c1 - c0, dtype=np.int64) * n
                rows.append(_rows(starts, np.array(n), bounce.device_id))
                at += n * (c1 - c0)
        try:
            local = np.concatenate(rows).astype(np.uint64)
            dl = self.agent.prep_xfer_dlist("", local, bounce.memory, [self.backend])
        except Exception as exc:
            raise TransportError(f"NIXL cannot prepare the bounce READ: {exc}") from None
        self.dlists.append(dl)
        index = np.arange(len(local), dtype=np.int32)
        sides = [(dl, index, peer.table.dlist, np.concatenate(remote))]
        layer = window[0][0]
        done = False
        try:
            await self._wait(peer, layer, self._post(peer, layer, sides))
            done = True
        finally:
            if not done:  # a READ may yet write into it
                bounce.broken()
        return bases

    async def _wait(self, peer: Remote, layer: int, handles: list[Any]) -> None:
        """Until every READ of `handles` is DONE (a `TransportError` if one failed)."""
        for h in handles:
            backoff = Backoff(POLL_MIN_S, POLL_MAX_S)
            while (state := self.agent.check_xfer_state(h)) == "PROC":
                await backoff.wait()
            if state != "DONE":
                raise TransportError(
                    f"NIXL READ of layer {layer} from {peer.shown} failed ({state})"
                )

    def _post(self, peer: Remote, layer: int, sides: list[Any]) -> list[Any]:
        """Post the READs of `sides` (from `layer` on), each handle kept for `drain`."""
        agent, xfers = self.agent, self.xfers
        handles = []
        for mine_dl, mine_idx, their_dl, their_idx in sides:
            try:
                h = agent.make_prepped_xfer(
                    "READ", mine_dl, mine_idx, their_dl, their_idx, b"", [self.backend]
                )
                xfers.append(h)
                handles.append(h)
                state = agent.transfer(h)
            except Exception as exc:
                raise TransportError(
                    f"NIXL READ of layer {layer} from {peer.shown} failed: {exc}"
                ) from None
            if state == "ERR":
                raise TransportError(
                    f"NIXL could not post the READ of layer {layer} from {peer.shown}"
                )
        return handles

    async def drain(self, timeout_s: float) -> bool:
        """Release every handle once its READ left PROC. Returns False if a READ failed;
        raises `TransferStuck` (releasing nothing) if one is still in flight after
        `timeout_s`: it may yet write into the consumer's blocks."""
        agent, xfers, dlists = self.agent, self.xfers, self.dlists
        clean = True
        with trio.move_on_after(timeout_s) as waited:
            for h in xfers:
                backoff = Backoff(POLL_MIN_S, POLL_MAX_S)
                while True:
                    try:
                        state = agent.check_xfer_state(h)
                    except Exception:
                        state = "ERR"
                    if state != "PROC":
                        break
                    await backoff.wait()
                clean = clean and state == "DONE"
        if waited.cancelled_caught:
            raise TransferStuck(
                f"a NIXL READ was still in flight {timeout_s}s after its load ended"
            )
        for h in [*xfers, *dlists]:
            clean = release(h) and clean
        xfers.clear()
        dlists.clear()
        return clean


_ANY = range(1 << 62)
"""Block ids standing for any (`stream_spans` for where the pieces lie, not which blocks)."""


class Span(NamedTuple):
    """Tokens `[their_at, their_at + tokens)` of their block `theirs` into tokens from
    `our_at` on of our block `ours`, for our chunk `chunk`."""

    chunk: int
    ours: int
    theirs: int
    tokens: int
    our_at: int = 0
    their_at: int = 0


def stream_spans(
    our_blocks: Sequence[int],
    counts: Sequence[int],
    their_blocks: Sequence[int],
    size: int,
    skip: int,
) -> list[Span]:
    """The `Span`s moving a token stream out of their blocks of `size` tokens, from token
    `skip` of the first, into our blocks holding `counts` tokens each."""
    out, at = [], skip
    for c, (ours, n) in enumerate(zip(our_blocks, counts, strict=True)):
        done = 0
        while done < n:
            j, t = divmod(at, size)
            m = min(n - done, size - t)
            out.append(Span(c, ours, their_blocks[j], m, done, t))
            done, at = done + m, at + m
    return out


def _pair_descs(
    our_bases: Sequence[tuple[int, int]],
    ours: Sequence[LayerGeometry],
    their_bases: Sequence[tuple[int, int]],
    theirs: Sequence[LayerGeometry],
    spans: Sequence[Span],
    heads: HeadRead | None,
    who: str,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer, the [address, length, device] rows (ours, theirs, pairwise equal in
    length) moving heads `heads` (None: all) of each of `spans` from their block into
    ours. A `TransportError` naming both layouts when the cells differ."""
    by_tokens: dict[tuple[int, int, int], list[Span]] = {}
    for sp in spans:
        by_tokens.setdefault((sp.tokens, sp.our_at, sp.their_at), []).append(sp)
    mine: list[np.ndarray] = []
    their: list[np.ndarray] = []
    for og, tg, (ob, od), (tb, td) in zip(ours, theirs, our_bases, their_bases, strict=True):
        o_rows, t_rows = [], []
        for (n, o_tok, t_tok), group in by_tokens.items():
            first, into, count = (
                (0, 0, og.heads) if heads is None else (heads.first, heads.into, heads.count)
            )
            try:
                runs = head_copy_runs(tg, first, og, into, count, n, True, t_tok, o_tok)
            except LayoutError as exc:
                raise TransportError(
                    f"producer {who}: KV layouts differ: producer {tg.describe()}, consumer "
                    f"{og.describe()} ({exc})",
                    chunk=0,  # refused before any READ
                ) from None
            r = np.array(runs, dtype=np.int64).reshape(-1, 3)
            o_at = np.array([sp.ours for sp in group], np.int64)[:, None] * og.block_stride
            t_at = np.array([sp.theirs for sp in group], np.int64)[:, None] * tg.block_stride
            o_rows.append(_rows(ob + o_at + r[None, :, 1], r[:, 2], od))
            t_rows.append(_rows(tb + t_at + r[None, :, 0], r[:, 2], td))
        mine.append(np.concatenate(o_rows))
        their.append(np.concatenate(t_rows))
    return mine, their


def _rows(addresses: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    """[address, length, device] rows of a `[chunks, runs]` grid of addresses."""
    lengths = np.broadcast_to(lengths, addresses.shape).ravel()
    return np.stack([addresses.ravel(), lengths, np.full_like(lengths, device)], axis=1)


def _record(device: Any) -> Any:
    """A CUDA event after what is queued on `device`'s current stream; None elsewhere."""
    if device.type != "cuda":
        return None
    import torch

    event = cuda_event()
    event.record(torch.cuda.current_stream(device))
    return event
