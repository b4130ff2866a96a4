"""The READs of one pull, on the consumer: the offer checked, whole blocks read through
the prepared lists and partial blocks through lists of their own, READ_AHEAD layers
posted at once, each layer signalled as it lands, and every handle drained (left
PROC) before it is released.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from kvflow.layout import KVLayout, LayoutError
from kvflow.runtime import Backoff
from kvflow.transport import ChunkCorrupt, LoadJob, TransferStuck, TransportError

from . import _wire as wire
from ._descs import Table, partial_descs, release
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
    ) -> None:
        self.agent = agent
        self.backend = backend
        self.local = local
        """This worker's prepared list over its whole KV memory."""
        self.bases = bases
        self.memory = memory
        self.layout = layout
        self.xfers: list[Any] = []
        """Every posted READ's handle, until drained."""
        self.dlists: list[Any] = []
        """This pull's own descriptor lists (partial blocks), until drained."""

    @staticmethod
    def _check_offer(job: LoadJob, peer: Remote, msg: wire.Blocks, layout: KVLayout) -> None:
        """Refuse an offer of other chunks, or of blocks either side does not have."""
        if msg.token_counts != job.token_counts or len(msg.block_ids) != len(job.block_ids):
            raise ChunkCorrupt(
                f"producer {peer.name} offers chunks of {msg.token_counts} tokens in blocks "
                f"{msg.block_ids}; {job.req} expects {job.token_counts} in "
                f"{len(job.block_ids)} blocks"
            )
        try:
            for theirs, ours in zip(peer.table.geometries, layout.geometries, strict=True):
                theirs.check_blocks(msg.block_ids, f"producer {peer.name}")
                ours.check_blocks(job.block_ids, "consumer")
        except LayoutError as exc:
            raise ChunkCorrupt(str(exc)) from None

    def _tail_lists(
        self, job: LoadJob, peer: Remote, msg: wire.Blocks, partial: list[int]
    ) -> tuple[tuple[Any, Any] | None, list[int]]:
        """Descriptor lists (ours, theirs) over just the tokens of the `partial` chunks,
        kept for `drain`, and where each layer's rows start in them."""
        agent, dlists = self.agent, self.dlists
        starts = [0]
        if not partial:
            return None, starts
        layout = self.layout
        counts = [job.token_counts[c] for c in partial]
        try:
            mine = partial_descs(
                self.bases,
                layout.geometries,
                [(job.block_ids[c], n) for c, n in zip(partial, counts, strict=True)],
            )
            their = partial_descs(
                peer.bases,
                peer.table.geometries,
                [(msg.block_ids[c], n) for c, n in zip(partial, counts, strict=True)],
            )
        except LayoutError as exc:
            raise ChunkCorrupt(str(exc)) from None
        for layer in mine:
            starts.append(starts[-1] + len(layer))
        try:
            for who, descs, memory in (("", mine, self.memory), (peer.name, their, peer.memory)):
                flat = np.array([d for layer in descs for d in layer], np.uint64)
                dlists.append(agent.prep_xfer_dlist(who, flat, memory, [self.backend]))
        except Exception as exc:
            raise TransportError(f"NIXL cannot prepare the READ from {peer.name}: {exc}") from None
        return (dlists[-2], dlists[-1]), starts

    async def read(self, job: LoadJob, peer: Remote, msg: wire.Blocks) -> None:
        """READ `msg`'s blocks from `peer` into `job`'s, layer by layer, READ_AHEAD
        layers in flight; signal each as it lands."""
        agent, layout, local = self.agent, self.layout, self.local
        self._check_offer(job, peer, msg, layout)
        # Whole blocks come from the prepared lists; a partial block of a token-granular
        # cache must move only its tokens, through a small list of its own.
        packed = all(g.block_bytes for g in layout.geometries)
        full = [packed or n >= layout.block_size for n in job.token_counts]
        whole = [c for c, f in enumerate(full) if f]
        partial = [c for c, f in enumerate(full) if not f]
        theirs_ids = np.array([msg.block_ids[c] for c in whole], np.int64)
        ours_ids = np.array([job.block_ids[c] for c in whole], np.int64)
        tails, tail_starts = self._tail_lists(job, peer, msg, partial)
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
            for h in posted[g]:
                backoff = Backoff(POLL_MIN_S, POLL_MAX_S)
                while (state := agent.check_xfer_state(h)) == "PROC":
                    await backoff.wait()
                if state != "DONE":
                    raise TransportError(
                        f"NIXL READ of layer {group[0]} from {peer.name} failed ({state})"
                    )
            if g + READ_AHEAD < len(groups):
                ahead = groups[g + READ_AHEAD]
                posted.append(self._post(peer, ahead[0], sides(ahead)))
            for i in group:
                job.layer_loaded(i)
            await trio.lowlevel.checkpoint()

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
                    f"NIXL READ of layer {layer} from {peer.name} failed: {exc}"
                ) from None
            if state == "ERR":
                raise TransportError(
                    f"NIXL could not post the READ of layer {layer} from {peer.name}"
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
