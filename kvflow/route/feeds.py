"""One instance's KV event stream into the index (`kvflow.route.index`), as a trio task.

vLLM's publisher numbers its batches (an 8-byte sequence number per frame) and, with a
`replay_endpoint`, answers a request for every batch it still buffers from a number on.
A follower applies the batches in order. A gap (frames the SUB socket dropped, or a
router that joined late) is filled by a replay; one the replay cannot fill (no replay
endpoint, the batches gone from the publisher's buffer, no answer within
`REPLAY_TIMEOUT_S`) makes the index forget that instance's blocks, since a missed
`BlockRemoved` would leave it routing on blocks that are gone. A live batch numbered
below one applied, other than a repeat of what a replay just gave, is a restarted
publisher: its instance starts empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio
import zmq

from ..zmqio import TrioSocket
from .events import decode_batch
from .index import PrefixIndex

__all__ = ["REPLAY_TIMEOUT_S", "FeedState", "follow"]

REPLAY_TIMEOUT_S = 2.0
MAX_REPLAY_FRAMES = 1 << 17
"""The most frames one replay is read for (vLLM buffers 10,000 batches by default)."""
END_SEQ = -1


@dataclass
class FeedState:
    """What a follower has seen of one instance's stream (`/routes` shows it)."""

    name: str
    endpoint: str
    replay: str | None = None
    seq: int = -1
    """The last batch applied (-1: none yet)."""
    batches: int = 0
    bad: int = 0
    """Frames and events out of bounds, skipped."""
    lost: int = 0
    """Gaps no replay filled: each made the index forget this instance."""
    restarts: int = 0


async def follow(state: FeedState, index: PrefixIndex, ctx: zmq.Context[Any]) -> None:
    """Apply `state`'s instance's batches to `index` until cancelled."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(state.endpoint)
    sub = TrioSocket(sock)
    replayed = False  # live frames that came during a replay may repeat what it gave
    try:
        while True:
            frame = _parse(await sub.recv_multipart())
            if frame is None:
                state.bad += 1
                continue
            seq, payload = frame
            if seq <= state.seq and replayed:
                continue
            if seq <= state.seq:  # one publisher's frames only go up: it restarted
                index.forget(state.name)
                state.restarts += 1
                state.seq = -1
            replayed = seq > state.seq + 1
            if replayed:
                await _fill(state, index, ctx, seq)
            if seq > state.seq:
                _apply(state, index, seq, payload)
    finally:
        sub.close()


def _apply(state: FeedState, index: PrefixIndex, seq: int, payload: bytes) -> None:
    events, bad = decode_batch(payload)
    index.apply(state.name, events)
    state.bad += bad
    state.batches += 1
    state.seq = seq


async def _fill(state: FeedState, index: PrefixIndex, ctx: zmq.Context[Any], upto: int) -> None:
    """Batches `state.seq + 1` .. `upto - 1` from the replay endpoint; the instance
    forgotten where they cannot all be had (nothing to forget before the first batch)."""
    start = state.seq + 1
    first = await _replay(state, index, ctx, start, upto) if state.replay else None
    if first != start and state.seq >= 0:
        index.forget(state.name)
        state.lost += 1


async def _replay(
    state: FeedState, index: PrefixIndex, ctx: zmq.Context[Any], start: int, upto: int
) -> int | None:
    """Ask for every buffered batch from `start`, apply those before `upto`; the first
    batch number the answer held (None: no answer, or none)."""
    assert state.replay is not None
    sock = ctx.socket(zmq.DEALER)
    sock.connect(state.replay)
    dealer = TrioSocket(sock)
    first: int | None = None
    try:
        with trio.move_on_after(REPLAY_TIMEOUT_S):
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(MAX_REPLAY_FRAMES):
                frames = await dealer.recv_multipart()
                frame = _parse(frames[1:]) if frames[:1] == [b""] else None
                if frame is None:
                    state.bad += 1
                    break
                seq, payload = frame
                if seq == END_SEQ:
                    break
                first = seq if first is None else first
                if state.seq < seq < upto:
                    _apply(state, index, seq, payload)
    finally:
        dealer.close()
    return first


def _parse(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(sequence number, payload) of a (topic, seq, payload) frame."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big", signed=True), frames[2]
