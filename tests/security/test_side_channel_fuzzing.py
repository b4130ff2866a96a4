"""Issue 27's side channel fuzzed with a fixed seed: thousands of mutated, junk and
mis-sealed frames to a keyed producer, and a thousand mutated answers from a hostile
producer to a consumer. The producer refuses or answers only what a consumer can read,
every load ends with a transport error, memory stays bounded, and an honest pull then
gets identical bytes (tests/support/side_channel_attacks.py).
"""

from __future__ import annotations

import os
import random
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import trio
import trio.testing
import zmq

from kvflow.pd.offers import Renew
from kvflow.pd.security import MAC_BYTES, Channel
from kvflow.testing.layouts import fill_blocks, make_layout
from kvflow.transport import Offer, Renewed, TransportError
from kvflow.zmqio import BadFrame, TrioSocket
from kvflow_zmq import _ipc as ipc
from kvflow_zmq import _wire as zwire

from ..support.side_channel_attacks import (
    BS,
    COUNTS,
    HANG_GUARD_S,
    LAYERS,
    OFFERED,
    against,
    dealer,
    hold,
    honest_pull,
    hostile_router,
    layer0,
    peers,
    renew_frame,
    renewed,
    spans,
)

# -- 6. seeded fuzzing -------------------------------------------------------------


FUZZ_SEED = 27
FUZZ_TO_PRODUCER = 3000
FUZZ_TO_CONSUMER = 1000
FUZZ_MAX_FRAME = 256 << 10
"""Fuzz frames stay below every bound, so no connection is cut mid-run."""
MEMORY_BOUND = 64 << 20
HUGE_INTS = [2**63 - 1, 2**64 - 1, -(2**63), 1 << 40, (1 << 40) - 1, 1 << 31, 10**18]
TAGS = ["Pull", "Done", "Failed", "Renew", "Renewed", "Layer", "Ipc", "Refused", "Read", "Blocks"]


def _text(rng: random.Random, n: int | None = None) -> str:
    """A string of `n` (random) characters, NUL, non-ASCII and 4-byte ones among them."""
    n = rng.choice([0, 1, 8, 32, 129, 300, 4097, 20_000]) if n is None else n
    unit = "".join(rng.choice("aZ0/_-.\x00\u00e9\u4e2d\U0001f600") for _ in range(min(n, 64)))
    return (unit * (n // max(1, len(unit)) + 1))[:n]


def _junk(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack value of random structure."""
    r = rng.randrange(10 if depth < 3 else 7)
    if r == 0:
        return rng.choice(HUGE_INTS)
    if r == 1:
        return -rng.randrange(1, 2**63)
    if r == 2:
        return rng.randrange(-3, 5)
    if r == 3:
        return rng.choice([rng.random() * 10 ** rng.randrange(20), float("nan"), float("-inf")])
    if r == 4:
        return _text(rng)
    if r == 5:
        return rng.randbytes(rng.randrange(64))
    if r == 6:
        return rng.choice([None, True, False])
    if r == 7:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(6))]
    if r == 8:
        return {_text(rng, 6): _junk(rng, depth + 1) for _ in range(rng.randrange(6))}
    return {"type": rng.choice(TAGS), **{_text(rng, 4): _junk(rng, depth + 1) for _ in range(3)}}


def _mutate(rng: random.Random, msg: dict[str, Any]) -> dict[str, Any]:
    """`msg` (a frame as builtins) with one to three fields made hostile."""
    m = dict(msg)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        key = rng.choice(list(m)) if m else "type"
        op = rng.randrange(9)
        if op == 0:
            m[key] = rng.choice(HUGE_INTS)
        elif op == 1:
            m[key] = -rng.randrange(1, 2**63)
        elif op == 2:
            m[key] = _text(rng)
        elif op == 3:
            m[key] = _junk(rng)
        elif op == 4:
            m[_text(rng, 8)] = _junk(rng)  # a field no frame has
        elif op == 5:
            m.pop(key, None)
        elif op == 6:
            m["type"] = rng.choice(TAGS)
        elif op == 7 and isinstance(m.get(key), list) and m[key]:  # one element
            items = list(m[key])
            i = rng.randrange(len(items))
            items[i] = _mutate(rng, items[i]) if isinstance(items[i], dict) else _junk(rng)
            m[key] = items
        elif op == 8 and isinstance(m.get(key), list):  # a long list
            m[key] = (list(m[key]) or [0]) * rng.choice([2, 100, 5000])
    return m


def _frames(rng: random.Random, payload: bytes) -> list[bytes]:
    """`payload` maybe truncated, flipped or padded, and maybe split into frames."""
    r = rng.random()
    if r < 0.08:
        payload = payload[: rng.randrange(len(payload) + 1)]
    elif r < 0.16 and payload:
        b = bytearray(payload)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        payload = bytes(b)
    elif r < 0.2:
        payload += rng.randbytes(rng.randrange(1, 32))
    payload = payload[:FUZZ_MAX_FRAME]
    if rng.random() < 0.05 and len(payload) > 1:
        cuts = sorted(
            rng.sample(range(1, len(payload)), min(len(payload) - 1, rng.randrange(1, 3)))
        )
        return [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)]
    return [payload]


def _fuzz_payload(rng: random.Random, templates: list[dict[str, Any]]) -> bytes:
    r = rng.random()
    if r < 0.15:
        return rng.randbytes(rng.randrange(1, 512))
    if r < 0.35:
        return msgspec.msgpack.encode(_junk(rng))
    if r < 0.37:
        return msgspec.msgpack.encode(rng.choice(templates))  # a frame as it is
    return msgspec.msgpack.encode(_mutate(rng, rng.choice(templates)))


@contextmanager
def _traced() -> Iterator[Callable[[], int]]:
    """Trace allocations; yields a function returning the peak since entry."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield lambda: tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()


def _drain(sock: TrioSocket, into: list[list[bytes]]) -> None:
    while True:
        try:
            into.append(sock.sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return


async def test_fuzzing_a_keyed_producer(zctx: zmq.Context[Any]) -> None:
    """~3000 random and mutated frames (random bytes, msgpack of random structure, real
    Pull/Renew/Done/Failed frames with fields made huge, negative, long, of the wrong
    type, extra or missing, truncated, flipped, split), most sealed with the key: the
    producer answers only sealed frames that decode, with sealed frames that decode;
    renewals reach the offer with leases in bounds only; memory stays bounded; an honest
    pull then gets identical bytes."""
    rng = random.Random(FUZZ_SEED)
    key = os.urandom(32)
    other = Channel(os.urandom(32))
    async with peers("zmq", Channel(key, "kv-in-clear")) as p:
        decoy = f"{rng.getrandbits(128):032x}"  # the offer the fuzzer knows (and may pull)
        ours = list(p.prod.geometries)
        templates = [
            msgspec.to_builtins(m)
            for m in [
                zwire.Pull(decoy, OFFERED, geometries=ours),
                zwire.Pull(decoy),
                zwire.Pull("unknown-offer", [1, 2]),
                Renew([decoy, "unknown-offer"], 5000),
                zwire.Done(decoy),
                zwire.Failed(decoy, "gave up"),
            ]
        ]
        leases: list[float] = []
        answers: list[list[bytes]] = []
        sentinel = "fuzz-sentinel"
        with _traced() as peak, trio.fail_after(HANG_GUARD_S * 2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(p.producer.serve)
                decoy_offer = Offer(
                    decoy, OFFERED, COUNTS, LAYERS, spans(p.prod, OFFERED), leases.append
                )
                nursery.start_soon(p.producer.offer, decoy_offer)
                await trio.testing.wait_all_tasks_blocked()
                # frames injected into a connection that passed the handshake (an on-path
                # attacker's, in kv-in-clear; the test makes one with the key)
                attacker, _ = dealer(zctx, p.producer.address, channel=p.channel)
                for i in range(FUZZ_TO_PRODUCER):
                    frames = _frames(rng, _fuzz_payload(rng, templates))
                    seal = rng.random()
                    if seal < 0.9:
                        frames[0] = p.channel.seal(frames[0], "producer")
                    elif seal < 0.95:
                        frames[0] = other.seal(frames[0], "producer")
                    await attacker.send_multipart(frames)
                    if i % 100 == 99:  # read what it answered, as a consumer does
                        _drain(attacker, answers)
                nonce = rng.randbytes(16)
                sentinel_frame = renew_frame([sentinel], 1000, nonce=nonce)
                await attacker.send_multipart([p.channel.seal(sentinel_frame, "producer")])
                while True:  # every frame before it was handled once its answer is here
                    answers.append(await attacker.recv_multipart())
                    try:
                        last = renewed(p.channel, answers[-1][0], nonce)
                    except (BadFrame, msgspec.DecodeError):
                        continue
                    if last.pending == [sentinel]:
                        break
                await honest_pull(p, await hold(p, nursery))
                nursery.cancel_scope.cancel()
            used = peak()
    assert used < MEMORY_BOUND, f"the fuzz run allocated {used >> 20} MiB at its peak"
    reasons = {r for r, _ in p.seen.log}
    assert reasons <= {"frame", "unauthenticated"}
    assert p.seen.count("frame") > FUZZ_TO_PRODUCER // 3
    assert p.seen.count("unauthenticated") > FUZZ_TO_PRODUCER // 50
    assert all(0 < lease < (1 << 40) / 1000 for lease in leases), leases
    answer_type = zwire.Layer | zwire.Refused | zwire.Ipc | Renewed
    decoder = msgspec.msgpack.Decoder(answer_type)
    for frames in answers:  # the producer says only what a consumer can read (each
        decoder.decode(frames[0][MAC_BYTES:])  # sealed for the request it answers)


async def test_fuzzing_a_consumer(zctx: zmq.Context[Any]) -> None:
    """~1000 pulls, each answered by a hostile producer with a mutated Layer (its data
    frames as sent, sometimes one too few or too many), Refused or Ipc, or junk, then
    a refusal: every load raises a transport error, never another exception, never
    hangs; memory stays bounded; the consumer then pulls identical bytes from an
    honest producer."""
    rng = random.Random(FUZZ_SEED + 1)
    prod = make_layout(num_layers=LAYERS, block_size=BS)
    fill_blocks(prod, OFFERED, seed=27)
    sizes, data = layer0(prod)
    router, address = hostile_router(zctx)
    failures: list[str] = []
    kinds: dict[str, int] = {}
    async with peers("zmq") as p:
        ours = list(p.cons.geometries)
        handle = ipc.IpcHandle(0, b"h", 1 << 20, 0, b"", 0, b"", False, 0, 1 << 20)

        def answer(o: str) -> list[list[bytes]]:
            template = rng.choice(
                [
                    zwire.Layer(o, 0, sizes),
                    zwire.Refused(o, "gone"),
                    zwire.Ipc(o, ipc.host_id(), ours, OFFERED, 30.0, [handle] * LAYERS),
                ]
            )
            r = rng.random()
            if r < 0.1:
                payload = rng.randbytes(rng.randrange(1, 512))
            elif r < 0.2:
                payload = msgspec.msgpack.encode(_junk(rng))
            else:
                builtins = msgspec.to_builtins(template, builtin_types=(bytes,))
                payload = msgspec.msgpack.encode(_mutate(rng, builtins))
            frames = _frames(rng, payload)
            if isinstance(template, zwire.Layer):
                body = list(data)
                if rng.random() < 0.1:
                    body = body[: rng.randrange(len(body))] if rng.random() < 0.5 else body * 2
                frames += body
            return [frames, [zwire.encode(zwire.Refused(o, "the end"))]]

        with _traced() as peak:
            for _ in range(FUZZ_TO_CONSUMER):
                got = await against(p.consumer, p.cons, router, address, answer)
                kinds[type(got).__name__] = kinds.get(type(got).__name__, 0) + 1
                if not isinstance(got, TransportError):
                    failures.append(repr(got))
            with trio.fail_after(HANG_GUARD_S):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(p.producer.serve)
                    await honest_pull(p, await hold(p, nursery))
                    nursery.cancel_scope.cancel()
            used = peak()
    assert not failures, f"loads that ended otherwise than with a transport error: {failures[:5]}"
    assert set(kinds) >= {"ChunkCorrupt", "ChunkMissing"}, kinds
    assert used < MEMORY_BOUND, f"the fuzz run allocated {used >> 20} MiB at its peak"
