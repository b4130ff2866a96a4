"""Issue 27's floods of a producer's side channel: a peer that sends far more than it
reads (renewals and pulls whose answers it never reads) stalls no honest pull, and a
stranger's one huge multipart message does not grow a keyed producer's memory
(tests/side_channel.py).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import trio
import trio.testing
import zmq

from kvflow.pd.offers import MAX_RENEW_REQS
from kvflow.pd.security import Channel
from kvflow_zmq import _wire as zwire

from .side_channel import (
    HANDSHAKE_FAILED,
    HANG_GUARD_S,
    dealer,
    hold,
    honest_pull,
    peers,
    renew_frame,
    until_event,
)

# -- what the fix still leaves open ----------------------------------------------------


async def test_a_peer_that_never_reads_stalls_no_one_else(zctx: zmq.Context[Any]) -> None:
    """A peer floods the producer with renewals and pulls whose answers it never reads
    (~26 MiB of renewals' answers, then 3000 refusals: more than ZMQ's queues and TCP's
    buffers hold), its last frame a renewal of a held offer. Honest pulls go on meanwhile:
    each must be answered, until one that starts after the producer reached the flood's
    last frame, which proves it got through all of it."""
    async with peers("zmq") as p, trio.open_nursery() as nursery:
        nursery.start_soon(p.producer.serve)
        through = trio.Event()
        marker = (await hold(p, nursery, renew=lambda lease_s: through.set())).offer
        flooder, _ = dealer(zctx, p.producer.address, RCVHWM=1, RCVBUF=4096)
        renew = renew_frame([f"{i:0128d}" for i in range(MAX_RENEW_REQS)], 1000)
        for _ in range(200):  # each answered by a Renewed of ~130 KiB
            await flooder.send_multipart([renew], copy=False)
        for i in range(3000):
            await flooder.send_multipart([zwire.encode(zwire.Pull(f"{i:0128d}"))])
        await flooder.send_multipart([renew_frame([marker], 1000)])
        pulls = 0
        while True:
            after_the_flood = through.is_set()
            with trio.move_on_after(5) as hang_guard:  # a hang guard: a pull takes ms
                await honest_pull(p, await hold(p, nursery))
            pulls += 1
            if hang_guard.cancelled_caught or after_the_flood:
                break
        nursery.cancel_scope.cancel()
    assert not hang_guard.cancelled_caught, (
        f"pull {pulls} was never answered: the producer is stuck on a peer that does not read"
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
async def test_a_stranger_cannot_make_a_keyed_producer_take_in_a_huge_message(
    zctx: zmq.Context[Any],
) -> None:
    """Issue 27, finding 7 ("frame counts are not checked"), against a keyed producer in
    authenticated mode: a peer without the key sends one message of 96 parts of 1 MiB
    each. libzmq takes in a whole multipart message before kvflow sees it (its size
    bound is per part), so only the handshake can keep it out: the producer's memory
    must not grow by what a stranger sends (measured as the process's resident size
    when the message is refused, or when the stranger's connection fails)."""
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    grown: list[int] = []
    async with peers("zmq", Channel(os.urandom(32))) as p:
        part = bytes(p.producer.max_frame_bytes)
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(p.producer.serve)
                await trio.testing.wait_all_tasks_blocked()
                before = rss()
                p.seen.on_call = lambda reason, detail: grown.append(rss() - before)
                stranger, events = dealer(zctx, p.producer.address)
                refused = trio.Event()

                async def refusal() -> None:
                    await p.seen.reach("frame", 1)
                    refused.set()

                async def handshake_failed() -> None:
                    await until_event(events, HANDSHAKE_FAILED)
                    grown.append(rss() - before)
                    refused.set()

                nursery.start_soon(refusal)
                nursery.start_soon(handshake_failed)
                await stranger.send_multipart([part] * 96, copy=False)
                await refused.wait()
                nursery.cancel_scope.cancel()
    assert grown and grown[0] < (32 << 20), f"the producer grew by {grown[0] >> 20} MiB"
