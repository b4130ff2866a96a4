"""Issue 27's attacks on a keyed producer's side channel by peers without the deployment
key: a plain peer, a consumer of another key, frames without the key's MAC on an
authenticated connection (an on-path attacker injecting into one) and a replayed
sealed pull, plain-text and wrong-key CURVE peers in encrypted mode. None gets an
answer, bytes, or ends the hold; each is counted, and a consumer with the key pulls
identical bytes (tests/support/side_channel_attacks.py). Replayed handshakes and frames sent back or
across pulls: tests/security/test_side_channel_replays.py.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import trio
import zmq

from kvflow.pd.offers import answer_bind
from kvflow.pd.security import MAC_BYTES, Channel
from kvflow_nixl import _wire as nwire
from kvflow_zmq import _wire as zwire

from ..support.side_channel_attacks import (
    HANDSHAKE_FAILED,
    HANG_GUARD_S,
    KINDS,
    dealer,
    hold,
    honest_pull,
    load_job,
    peers,
    poison,
    pull_frame,
    until_event,
    untouched,
    worker,
)

# -- 4. a keyed side channel -----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_a_keyed_producer_answers_only_key_holders(kind: str, zctx: zmq.Context[Any]) -> None:
    """With a deployment key (`kv-in-clear`, whose connections an on-path attacker can
    inject frames into), two locks. A connection without the key's handshake
    credentials (a plain peer, a consumer of another key) fails its handshake: none of
    its frames reaches kvflow, and it is counted "unauthenticated". Frames on a
    connection that passed the handshake get no answer without their MAC (none,
    another key's, one byte flipped, truncated), each counted; a sealed pull replayed
    after the honest pull is refused, never answered with KV. Nobody without the key
    gets bytes or ends the hold."""
    key, other = os.urandom(32), os.urandom(32)
    async with (
        peers(kind, Channel(key, "kv-in-clear")) as p,
        worker(kind, Channel(other, "kv-in-clear")) as (stranger, stranger_layout),
    ):
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(p.producer.serve)
                held = await hold(p, nursery)
                nonce = os.urandom(16)
                pull = pull_frame(kind, held.offer, nonce=nonce)
                sealed = p.channel.seal(pull, "producer")

                plain, _ = dealer(zctx, p.producer.address)  # no credentials at all
                await plain.send_multipart([sealed])
                await p.seen.reach("unauthenticated", 1)  # its handshake failed

                flip_payload, flip_mac = bytearray(sealed), bytearray(sealed)
                flip_payload[-1] ^= 1
                flip_mac[0] ^= 0x80
                forged = [
                    pull,
                    Channel(other).seal(pull, "producer"),
                    bytes(flip_payload),
                    bytes(flip_mac),
                    sealed[:MAC_BYTES],
                    sealed[:-1],
                    b"short",
                    b"",
                ]
                # a connection that passed the handshake (the test has the key for it)
                on_path, _ = dealer(zctx, p.producer.address, channel=p.channel)
                before = p.seen.count("unauthenticated")
                for frame in forged:
                    await on_path.send_multipart([frame])
                await p.seen.reach("unauthenticated", before + len(forged))

                poison(stranger_layout)
                loading = trio.CancelScope()
                stranger_ended = trio.Event()

                async def stranger_pulls() -> None:
                    with loading:
                        await stranger.load(
                            load_job(stranger_layout, p.producer.address, held.offer)
                        )
                    stranger_ended.set()

                before = p.seen.count("unauthenticated")
                nursery.start_soon(stranger_pulls)
                await p.seen.reach("unauthenticated", before + 1)  # its handshake failed
                loading.cancel()  # its load would wait until its deadline
                await stranger_ended.wait()
                assert loading.cancelled_caught, "the stranger's load ended by itself"
                assert untouched(stranger_layout), "a consumer with another key got bytes"
                assert held.offer in p.producer.held, "a stranger ended the hold"

                await honest_pull(p, held)
                await on_path.send_multipart([sealed])  # replayed, once pulled
                frames = await on_path.recv_multipart()  # its first answer: the replay's
                decode = zwire.decode_to_consumer if kind == "zmq" else nwire.decode_to_consumer
                answer = decode(p.channel.open(frames[0], "consumer", answer_bind(nonce, 0)))
                assert isinstance(answer, zwire.Refused | nwire.Refused), answer
                assert answer.reason == "already pulled" and len(frames) == 1
                nursery.cancel_scope.cancel()
    assert {r for r, _ in p.seen.log} == {"unauthenticated"}


@pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE")
@pytest.mark.parametrize("kind", KINDS)
async def test_an_encrypted_channel_lets_no_stranger_in(kind: str, zctx: zmq.Context[Any]) -> None:
    """In encrypted mode (ZMQ CURVE from the deployment key) a plain-text peer and a
    CURVE peer with another key fail the handshake: not one of their frames reaches
    kvflow (only their failed handshakes are counted); a consumer with the key pulls
    identical bytes."""
    key = os.urandom(32)
    async with peers(kind, Channel(key, "encrypted")) as p:
        with trio.fail_after(HANG_GUARD_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(p.producer.serve)
                held = await hold(p, nursery)
                pull = pull_frame(kind, held.offer)
                plain, plain_events = dealer(zctx, p.producer.address)
                await plain.send_multipart([pull])
                events = await until_event(plain_events, HANDSHAKE_FAILED)
                wrong_key = Channel(os.urandom(32), "encrypted")
                curve, curve_events = dealer(zctx, p.producer.address, channel=wrong_key)
                await curve.send_multipart([wrong_key.seal(pull, "producer")])
                events += await until_event(curve_events, HANDSHAKE_FAILED)
                assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events

                await honest_pull(p, held)
                assert not plain.sock.poll(0) and not curve.sock.poll(0)
                nursery.cancel_scope.cancel()
    assert p.seen.log, "the failed handshakes were not counted"
    assert all("failed its handshake" in d for _, d in p.seen.log), "a stranger's frame got in"
