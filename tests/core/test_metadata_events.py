"""kvflow.engine.metadata and kvflow.observe.events: what crosses process boundaries, and
the bus."""

from __future__ import annotations

import typing

import msgspec
import pytest

from kvflow.engine import metadata
from kvflow.engine.metadata import LoadSpec, SaveSpec, WorkerPlan, decode_plan, encode_plan
from kvflow.observe import events as ev
from kvflow.observe.events import (
    Event,
    EventBus,
    LayerComputed,
    Origin,
    TransferFailed,
    decode_event,
    encode_event,
)

PLAN = WorkerPlan(
    step=7,
    loads=[
        LoadSpec("r1", ["a" * 32, "b" * 32], [3, 4], [16, 5]),
        LoadSpec("r2", ["c" * 32], [9], [16], asynchronous=True),
    ],
    saves=[SaveSpec("r3", ["d" * 32, "e" * 32, "f" * 32], [1, 2, 8], [16, 16, 3])],
    lent=["r0"],
    preempted=["r4", "r5"],
)


# -- WorkerPlan ------------------------------------------------------------


def test_plan_round_trip() -> None:
    data = encode_plan(PLAN)
    assert isinstance(data, bytes)
    back = decode_plan(data)
    assert back == PLAN
    assert back.loads[1].asynchronous is True and back.loads[0].asynchronous is False
    assert back.saves[0].token_counts == [16, 16, 3]


def test_empty_plan_round_trip_and_is_empty() -> None:
    empty = WorkerPlan(step=1)
    assert empty.is_empty()
    assert decode_plan(encode_plan(empty)) == empty
    assert not PLAN.is_empty()
    assert not WorkerPlan(step=2, lent=["x"]).is_empty()
    assert not WorkerPlan(step=2, preempted=["x"]).is_empty()


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"not msgpack at all",
        msgspec.msgpack.encode([1, 2, 3]),  # valid msgpack, wrong shape
        msgspec.msgpack.encode({"step": "seven"}),  # wrong type
        msgspec.msgpack.encode({"loads": []}),  # missing step
        msgspec.msgpack.encode({"step": 1, "loads": [["r", ["k"], [1]]]}),  # short LoadSpec
        encode_plan(PLAN)[:-3],  # truncated
    ],
)
def test_decode_plan_rejects_garbage(garbage: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_plan(garbage)


def test_decode_plan_rejects_oversize_input_before_decoding() -> None:
    big = encode_plan(PLAN) + b"\x00" * (metadata.MAX_PLAN_BYTES)
    assert len(big) > metadata.MAX_PLAN_BYTES
    with pytest.raises(ValueError, match="exceeds"):
        decode_plan(big)


def test_decode_plan_bound_is_enforced_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode_plan(PLAN)
    monkeypatch.setattr(metadata, "MAX_PLAN_BYTES", len(data))
    assert decode_plan(data) == PLAN
    monkeypatch.setattr(metadata, "MAX_PLAN_BYTES", len(data) - 1)
    with pytest.raises(ValueError, match="exceeds"):
        decode_plan(data)


def test_plan_is_frozen() -> None:
    with pytest.raises(AttributeError):
        PLAN.step = 8  # type: ignore[misc]


# -- events ----------------------------------------------------------------

ORIGIN = Origin("engine-1", "worker", 3)
SAMPLES: list[Event] = [
    ev.LookupRequested(req="r", num_tokens=10, num_chunks=3),
    ev.LookupAnswered(req="r", hit_tokens=8, elapsed_s=0.01, error="boom"),
    ev.BlocksAllocated(req="r", num_blocks=2, external_tokens=8),
    ev.StepPlanned(step=4, loads=1, saves=2),
    ev.RequestFinished(req="r", lent=True, blocks=3, offer="0f"),
    ev.RequestArrived(req="r", tokens=90, offer="0f"),
    ev.ClaimSent(req="r"),
    ev.LoadReported(req="r", ok=False),
    ev.RequestScheduled(req="r", step=5),
    ev.FirstToken(req="r", step=5),
    ev.CachesRegistered(num_layers=2, nbytes=4096, memory="cpu", layout="cpu;layers=2"),
    ev.StepBound(step=4, loads=1, saves=0),
    ev.LoadStarted(req="r", chunks=2, tokens=8, nbytes=1024, transport="fs"),
    ev.LayerLoaded(req="r", layer=1),
    ev.LayerComputed(step=4, layer=1),
    ev.SaveStarted(req="r", chunks=2, tokens=8, nbytes=1024, transport="fs"),
    ev.TransferDone(req="r", direction="save", chunks=2, nbytes=1024, elapsed_s=0.5),
    ev.TransferFailed(req="r", direction="load", reason="x", block_ids=[1, 2], timed_out=True),
    ev.BlocksReleased(req="r"),
    ev.ClaimSeen(req="r"),
    ev.OfferStreamed(req="r", offer="0f", step=3, blocks=2),
    ev.TierRead(req="r", tier="cpu", hits=2, misses=1, promoted=1, nbytes=2048, evicted=1),
    ev.TierWrite(req="r", tier="cpu", stored=2, through=0, evicted=1, nbytes=2048),
    ev.Rejected(reason="prompt", detail="the params were made for another prompt"),
    ev.TaskFailed(task="zmq:serve", error="OSError: the side channel is gone", given_up=True),
]


def test_samples_cover_the_whole_vocabulary() -> None:
    union = set(typing.get_args(Event))
    assert {type(e) for e in SAMPLES} == union
    assert len(SAMPLES) == len(union)
    assert set(ev.__all__) >= {t.__name__ for t in union}


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event: Event) -> None:
    event.origin = ORIGIN
    back = decode_event(encode_event(event))
    assert type(back) is type(event)
    assert back == event
    assert back.origin == ORIGIN and back.ts == event.ts


def test_events_are_tagged_by_type_name() -> None:
    raw = msgspec.msgpack.decode(encode_event(ev.BlocksReleased(req="r")))
    assert raw["type"] == "BlocksReleased"
    with pytest.raises(msgspec.ValidationError):
        decode_event(msgspec.msgpack.encode({"type": "NoSuchEvent", "req": "r"}))
    with pytest.raises(msgspec.DecodeError):
        decode_event(b"\xc1garbage")


def test_events_get_a_monotonic_timestamp() -> None:
    a = ev.LayerLoaded(layer=0)
    b = ev.LayerLoaded(layer=1)
    assert 0 < a.ts <= b.ts


def test_bus_stamps_origin_and_delivers_in_order() -> None:
    bus = EventBus(ORIGIN)
    seen: list[tuple[str, Event]] = []
    bus.subscribe(lambda e: seen.append(("first", e)))
    bus.subscribe(lambda e: seen.append(("second", e)))
    event = LayerComputed(step=1, layer=0)
    assert event.origin != ORIGIN
    bus.emit(event)
    assert [tag for tag, _ in seen] == ["first", "second"]
    assert all(e is event and e.origin == ORIGIN for _, e in seen)


def test_raising_subscriber_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus(ORIGIN)
    seen: list[str] = []

    def broken(e: Event) -> None:
        raise RuntimeError("stats exporter bug")

    bus.subscribe(lambda e: seen.append("before"))
    bus.subscribe(broken)
    bus.subscribe(lambda e: seen.append("after"))
    bus.emit(TransferFailed(req="r", direction="load", reason="x"))
    bus.emit(TransferFailed(req="r", direction="load", reason="y"))
    assert seen == ["before", "after", "before", "after"]
    errors = [r for r in caplog.records if r.name == "kvflow.events"]
    assert len(errors) == 2 and "TransferFailed" in errors[0].getMessage()


def test_unsubscribe() -> None:
    bus = EventBus(ORIGIN)
    seen: list[Event] = []
    unsubscribe = bus.subscribe(seen.append)
    bus.emit(LayerComputed(step=1, layer=0))
    unsubscribe()
    bus.emit(LayerComputed(step=1, layer=1))
    assert len(seen) == 1
