"""The `nixl` peer transport on real NIXL agents (UCX, CPU memory) and real sockets: a
producer holds blocks, a consumer READs them into its own KV memory."""

from __future__ import annotations

import contextvars
import dataclasses
import importlib.util
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio
import trio.testing

from kvflow.geometry.layout import KVLayout
from kvflow.pd.context import PeerContext
from kvflow.testing.layouts import fill_blocks, make_layout
from kvflow.transport import (
    ChunkCorrupt,
    ChunkMissing,
    LoadJob,
    Offer,
    PeerSource,
    TransferStuck,
    TransportContext,
    TransportError,
)
from kvflow_nixl import NixlOptions, NixlTransport
from kvflow_nixl._reads import READ_AHEAD
from kvflow_nixl._transport import vram_hint

if not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12")):
    pytest.skip("NIXL is not installed (pip install nixl-cu12==1.5.1)", allow_module_level=True)

BS = 4
COUNTS = [4, 4, 2]


def _ctx(layout: KVLayout | None = None) -> TransportContext:
    return TransportContext("e", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout)


@pytest.fixture(params=["nhd", "hnd", "block-granular"])
def layouts(request: pytest.FixtureRequest) -> tuple[KVLayout, KVLayout]:
    """The consumer has more blocks than the producer (its V planes start elsewhere)."""
    kind = {"hnd": {"hnd": True}, "block-granular": {"block_granular": True}}
    args: dict[str, Any] = {"num_layers": 3, "block_size": BS, **kind.get(request.param, {})}
    prod = make_layout(num_blocks=16, **args)
    cons = make_layout(num_blocks=23, **args)
    fill_blocks(prod, [1, 2, 3], seed=5)
    return prod, cons


async def _open(layout: KVLayout) -> NixlTransport:
    t = NixlTransport(NixlOptions(), _ctx(layout))
    await t.open()
    await t.register(layout)
    return t


@pytest.fixture
async def pair(layouts: tuple[KVLayout, KVLayout]) -> AsyncIterator[tuple[NixlTransport, ...]]:
    prod, cons = layouts
    producer, consumer = await _open(prod), await _open(cons)
    yield producer, consumer
    await consumer.aclose()
    await producer.aclose()


def _spans(layout: KVLayout, blocks: list[int], counts: list[int]):
    return lambda layer: [layout.spans(layer, b, n) for b, n in zip(blocks, counts, strict=True)]


def _bytes(layout: KVLayout, blocks: list[int], counts: list[int]) -> list[bytes]:
    f = _spans(layout, blocks, counts)
    return [b"".join(bytes(s) for c in f(i) for s in c) for i in range(layout.num_layers)]


def _job(
    cons: KVLayout,
    address: str,
    req: str = "p-req",
    loaded: Callable[[int], None] = lambda _: None,
) -> LoadJob:
    return LoadJob(
        "c-req",
        ["k"] * 3,
        COUNTS,
        cons.num_layers,
        _spans(cons, [7, 8, 9], COUNTS),
        loaded,
        PeerSource("e", [address], req, [1, 2, 3]),
        [7, 8, 9],
    )


def _offer(prod: KVLayout, req: str = "p-req") -> Offer:
    return Offer(req, [1, 2, 3], COUNTS, prod.num_layers, _spans(prod, [1, 2, 3], COUNTS))


async def test_consumer_reads_held_blocks_layer_by_layer(
    pair: tuple[NixlTransport, NixlTransport], layouts: tuple[KVLayout, KVLayout]
) -> None:
    producer, consumer = pair
    prod, cons = layouts
    assert producer.address.startswith("tcp://127.0.0.1:") and not producer.address.endswith(":0")
    outcomes: list[str] = []

    async def hold(req: str, done: trio.Event) -> None:
        outcomes.append(await producer.offer(_offer(prod, req)))
        done.set()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            for req in ("p-req", "p-again"):  # a second pull reuses the cached remote agent
                signalled: list[int] = []
                released = trio.Event()
                nursery.start_soon(hold, req, released)
                await trio.testing.wait_all_tasks_blocked()
                for s in _spans(cons, [7, 8, 9], COUNTS)(0):
                    for span in s:
                        span[:] = bytes(len(span))
                await consumer.load(_job(cons, producer.address, req, signalled.append))
                await released.wait()  # the producer learns "done" from NIXL notifications
                assert signalled == [0, 1, 2]
                assert _bytes(cons, [7, 8, 9], COUNTS) == _bytes(prod, [1, 2, 3], COUNTS)
                if not cons.is_block_granular():  # a partial block moves only its tokens
                    whole = _bytes(cons, [9], [BS])
                    assert all(layer.count(0) >= len(layer) // 2 for layer in whole), whole
            nursery.cancel_scope.cancel()
    assert outcomes == ["done", "done"], "the producer hands blocks back once every READ ended"
    assert [r.name for r in consumer.remotes.by_address.values()] == [producer._agent.name]


def test_a_failed_vram_registration_says_when_cuda_12s_runtime_is_missing() -> None:
    """Seen on an H100 with a torch built for CUDA 13: UCX took VRAM for host memory."""
    hint = vram_hint("VRAM", "libkvflow-missing.so.12")
    assert "libkvflow-missing.so.12 does not load here" in hint
    assert "nvidia-cuda-runtime-cu12" in hint
    assert vram_hint("DRAM", "libkvflow-missing.so.12") == ""


async def test_pull_of_an_unknown_request_is_refused(
    pair: tuple[NixlTransport, NixlTransport], layouts: tuple[KVLayout, KVLayout]
) -> None:
    producer, consumer = pair
    _, cons = layouts
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            with pytest.raises(ChunkMissing, match="not offered by this producer"):
                await consumer.load(_job(cons, producer.address, "never-offered"))
            nursery.cancel_scope.cancel()


async def test_a_held_offer_ends_at_its_deadline_without_a_consumer(
    pair: tuple[NixlTransport, NixlTransport], layouts: tuple[KVLayout, KVLayout]
) -> None:
    producer, _ = pair
    prod, _ = layouts
    with trio.move_on_after(0.2) as hold_deadline:
        await producer.offer(_offer(prod, "p"))
    assert hold_deadline.cancelled_caught
    assert "p" not in producer.held, "an expired offer is forgotten"


async def test_a_dead_producer_ends_the_load_at_its_deadline_and_the_consumer_recovers(
    pair: tuple[NixlTransport, NixlTransport], layouts: tuple[KVLayout, KVLayout]
) -> None:
    producer, consumer = pair
    prod, cons = layouts
    address = producer.address
    await producer.aclose()  # the producer process is gone
    with trio.fail_after(5):  # the caller's deadline ends it, not a hang
        with trio.move_on_after(0.3) as load_deadline:
            await consumer.load(_job(cons, address))
    assert load_deadline.cancelled_caught

    fresh = await _open(prod)
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fresh.serve)
                nursery.start_soon(fresh.offer, _offer(prod))
                await trio.testing.wait_all_tasks_blocked()
                await consumer.load(_job(cons, fresh.address))
                nursery.cancel_scope.cancel()
        assert _bytes(cons, [7, 8, 9], COUNTS) == _bytes(prod, [1, 2, 3], COUNTS)
    finally:
        await fresh.aclose()


class _Spy:
    """Wraps a nixl_agent: records what the transport does, can stall UCX progress."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.stalled = False
        self.posted: list[Any] = []
        self.states: list[str] = []
        self.released: list[Any] = []
        self.all_posted = trio.Event()
        self.polled_while_proc = trio.Event()
        self.cancelled = False
        self.first_posts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {} if self.stalled else self._agent.get_new_notifs()

    def make_prepped_xfer(self, *args: Any) -> Any:
        handle = self._agent.make_prepped_xfer(*args)
        release = handle.release
        spy = self

        class Handle:
            _handle = handle._handle

            def release(self) -> None:
                spy.released.append(self)
                release()

        wrapped = Handle()
        self.posted.append(wrapped)
        self._handles = getattr(self, "_handles", {})
        self._handles[id(wrapped)] = handle
        return wrapped

    def transfer(self, h: Any) -> str:
        state = self._agent.transfer(self._handles[id(h)])
        if len(self.posted) == self.first_posts:
            self.all_posted.set()
        return state

    def check_xfer_state(self, h: Any) -> str:
        state = self._agent.check_xfer_state(self._handles[id(h)])
        self.states.append(state)
        if self.cancelled and state == "PROC":
            self.polled_while_proc.set()
        return state


async def test_a_cancelled_consumer_drains_its_reads_before_blocks_go_back() -> None:
    # big layers so that a READ is still in flight when the consumer is cancelled
    prod = make_layout(num_layers=3, num_blocks=4, block_size=BS, heads=64, head_dim=2048)
    cons = make_layout(num_layers=3, num_blocks=10, block_size=BS, heads=64, head_dim=2048)
    fill_blocks(prod, [1, 2, 3], seed=7)

    producer, consumer = await _open(prod), await _open(cons)
    producer._agent = pspy = _Spy(producer._agent)
    consumer._agent = cspy = _Spy(consumer._agent)
    cspy.first_posts = min(READ_AHEAD, cons.num_layers)  # the READs posted up front
    pspy.stalled = True  # the producer makes no UCX progress: the READs cannot finish
    order: list[str] = []
    signalled: list[int] = []
    offer_done, load_done = trio.Event(), trio.Event()

    async def hold() -> None:
        order.append(f"offer returned: {await producer.offer(_offer(prod))}")
        offer_done.set()

    async def load(scope: trio.CancelScope) -> None:
        with scope:
            await consumer.load(_job(cons, producer.address, loaded=signalled.append))
        order.append("load returned")
        load_done.set()

    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer.serve)
                nursery.start_soon(hold)
                await trio.testing.wait_all_tasks_blocked()
                load_scope = trio.CancelScope()
                nursery.start_soon(load, load_scope)
                await cspy.all_posted.wait()
                assert signalled == [], "no READ finished yet"
                cspy.cancelled = True
                load_scope.cancel()  # the load timeout fires mid-transfer
                await cspy.polled_while_proc.wait()  # the consumer waits for its READs ...
                await trio.testing.wait_all_tasks_blocked()
                assert order == [], "... and meanwhile the producer keeps the blocks"
                assert cspy.released == []
                pspy.stalled = False  # the READs can end now
                await load_done.wait()
                await offer_done.wait()
                nursery.cancel_scope.cancel()
    finally:
        await consumer.aclose()
        await producer.aclose()
    assert order[0] == "load returned", "blocks go back only after the consumer's reads ended"
    assert order[1].startswith("offer returned: ")
    assert sorted(map(id, cspy.released)) == sorted(map(id, cspy.posted)), "every handle released"
    assert "PROC" in cspy.states


async def test_a_read_that_stays_in_flight_is_never_released_and_stops_the_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The producer makes no progress at all: past the drain wait the consumer releases
    nothing (a released RMA READ can still land) and raises `TransferStuck`, on which the
    worker stops the engine instead of giving the blocks back."""
    import kvflow_nixl._transport as impl

    monkeypatch.setattr(impl, "DRAIN_TIMEOUT_S", 0.2)
    prod = make_layout(num_layers=3, num_blocks=4, block_size=BS, heads=64, head_dim=2048)
    cons = make_layout(num_layers=3, num_blocks=10, block_size=BS, heads=64, head_dim=2048)
    producer, consumer = await _open(prod), await _open(cons)
    producer._agent = pspy = _Spy(producer._agent)
    consumer._agent = cspy = _Spy(consumer._agent)
    cspy.first_posts = min(READ_AHEAD, cons.num_layers)
    pspy.stalled = True  # and it never recovers
    raised: list[BaseException] = []

    async def load(scope: trio.CancelScope) -> None:
        with scope:
            try:
                await consumer.load(_job(cons, producer.address))
            except TransferStuck as exc:
                raised.append(exc)

    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer.serve)
                nursery.start_soon(producer.offer, _offer(prod))
                await trio.testing.wait_all_tasks_blocked()
                scope = trio.CancelScope()
                nursery.start_soon(load, scope)
                await cspy.all_posted.wait()
                scope.cancel()  # the load timeout fires mid-transfer
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
    finally:
        pspy.stalled = False
        await consumer.aclose()
        await producer.aclose()
    assert [type(e) for e in raised] == [TransferStuck]
    assert "still in flight 0.2s after its load ended" in str(raised[0])
    assert cspy.released == [], "no READ handle released while in flight"


async def test_without_nixl_open_fails_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvflow_nixl._transport as impl

    def missing(name: str) -> Any:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(impl.importlib, "import_module", missing)
    t = NixlTransport(NixlOptions(), _ctx())
    with pytest.raises(TransportError, match=r"pip install 'kvflow\[nixl\]'"):
        await t.open()
    await t.aclose()


def test_a_bad_backend_names_the_key_and_the_choices() -> None:
    from kvflow.config import ConfigError, parse_options

    with pytest.raises(ConfigError, match=r"\['backend'\].*valid choices: UCX"):
        parse_options({"backend": "TCP"}, NixlOptions, "nixl")


_failing_drain: contextvars.ContextVar[bool] = contextvars.ContextVar("fail", default=False)


class GatedConsumer(NixlTransport):
    """A consumer whose pull of `slow` waits for `gate` after the producer answered (its
    agent in use), and whose pull of `fails` ends with a READ it could not drain."""

    at_gate: trio.Event
    gate: trio.Event

    async def _read(self, agent: Any, job: LoadJob, *args: Any) -> None:
        if job.req == "c-slow":
            self.at_gate.set()
            await self.gate.wait()
        await super()._read(agent, job, *args)

    async def _drain(self, reads: Any) -> bool:
        return await super()._drain(reads) and not _failing_drain.get()

    async def load(self, job: LoadJob) -> None:
        token = _failing_drain.set(job.req == "c-fails")  # this task's pull only
        try:
            await super().load(job)
        finally:
            _failing_drain.reset(token)


async def test_a_producer_forgotten_mid_pull_stays_added_until_that_pull_ends(
    layouts: tuple[KVLayout, KVLayout],
) -> None:
    """A failed READ makes the consumer forget the producer's agent; a concurrent pull
    still READing with that agent and its prepared list must finish first."""
    prod, cons = layouts
    producer = await _open(prod)
    consumer = GatedConsumer(NixlOptions(), _ctx(cons))
    consumer.gate, consumer.at_gate = trio.Event(), trio.Event()
    await consumer.open()
    await consumer.register(cons)

    def job(req: str) -> LoadJob:
        return dataclasses.replace(_job(cons, producer.address, req), req=f"c-{req}")

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            for req in ("first", "slow", "fails"):
                nursery.start_soon(producer.offer, _offer(prod, req))
            await trio.testing.wait_all_tasks_blocked()
            await consumer.load(job("first"))  # the producer is added and prepared
            (remote,) = consumer.remotes.by_address.values()
            async with trio.open_nursery() as pulls:
                pulls.start_soon(consumer.load, job("slow"))
                await consumer.at_gate.wait()
                assert remote.users == 1, "the slow pull holds the agent"
                await consumer.load(job("fails"))  # forgets the producer at its end
                assert consumer.remotes.by_address == {} and consumer.remotes.stale == {
                    remote.name: remote
                }
                consumer.gate.set()
            assert consumer.remotes.stale == {}, "the last pull removed the forgotten agent"
            assert _bytes(cons, [7, 8, 9], COUNTS) == _bytes(prod, [1, 2, 3], COUNTS)
            nursery.cancel_scope.cancel()
    await consumer.aclose()
    await producer.aclose()


async def test_a_pull_with_other_token_counts_than_offered_is_corrupt(
    pair: tuple[NixlTransport, NixlTransport], layouts: tuple[KVLayout, KVLayout]
) -> None:
    """The producer holds 1 token in the last block; a consumer expecting 2 would read
    a stale one."""
    producer, consumer = pair
    prod, cons = layouts
    short = [4, 4, 1]
    offer = Offer("p-req", [1, 2, 3], short, prod.num_layers, _spans(prod, [1, 2, 3], short))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(producer.serve)
            nursery.start_soon(producer.offer, offer)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(ChunkCorrupt, match=r"chunks of \[4, 4, 1\] tokens"):
                await consumer.load(_job(cons, producer.address))
            nursery.cancel_scope.cancel()


class _Beating(NixlTransport):
    """A producer that counts the heartbeats it answers, or (`hung`) answers none."""

    hung = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.beats = 0
        self.beaten = trio.Event()

    def ended(self, msg: Any, ident: bytes) -> None:
        if type(msg).__name__ == "Reading":
            if self.hung:
                return
            self.beats += 1
            if self.beats == 3:
                self.beaten.set()
        super().ended(msg, ident)


async def _open_as(cls: type[NixlTransport], layout: KVLayout, progress_s: float = 2.0) -> Any:
    t = cls(NixlOptions(), PeerContext.of(_ctx(layout), progress_timeout_s=progress_s))
    await t.open()
    await t.register(layout)
    return t


async def test_a_read_longer_than_the_heartbeat_stays_held_by_it(
    layouts: tuple[KVLayout, KVLayout],
) -> None:
    """Issue 28, item 2: the producer holds a pull's blocks only `progress_timeout_s` past
    the consumer's latest heartbeat. A READ that outlasts several of them is held by
    them, and lands the offered bytes."""
    prod, cons = layouts
    producer: _Beating = await _open_as(_Beating, prod)
    consumer: GatedConsumer = await _open_as(GatedConsumer, cons, progress_s=0.2)
    consumer.gate, consumer.at_gate = trio.Event(), trio.Event()
    outcome: list[str] = []
    ended = trio.Event()

    async def hold() -> None:
        outcome.append(await producer.offer(_offer(prod, "slow")))
        ended.set()

    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer.serve)
                nursery.start_soon(hold)
                await trio.testing.wait_all_tasks_blocked()
                job = dataclasses.replace(_job(cons, producer.address, "slow"), req="c-slow")
                nursery.start_soon(consumer.load, job)
                await producer.beaten.wait()  # three heartbeats, 0.05 s apart, answered
                consumer.gate.set()  # the READs start past the first hold of 0.2 s
                await ended.wait()
                nursery.cancel_scope.cancel()
        assert _bytes(cons, [7, 8, 9], COUNTS) == _bytes(prod, [1, 2, 3], COUNTS)
        assert outcome == ["done"]
    finally:
        await consumer.aclose()
        await producer.aclose()


async def test_a_consumer_that_dies_mid_pull_frees_the_blocks_within_its_heartbeat(
    layouts: tuple[KVLayout, KVLayout],
) -> None:
    """Issue 28, item 2: a consumer that dies after the producer answered its pull sends
    no heartbeat; the producer hands the blocks back `beat_ms` after the pull, not at
    the end of the read lease (here: none given, so the 600 s cap)."""
    from kvflow_nixl import _wire as wire

    prod, _ = layouts
    producer = await _open(prod)
    outcome: list[str] = []
    ended = trio.Event()

    async def hold() -> None:
        outcome.append(await producer.offer(_offer(prod)))
        ended.set()

    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer.serve)
                nursery.start_soon(hold)
                await trio.testing.wait_all_tasks_blocked()
                sock = producer.connect(producer.address, wire.MAX_TO_CONSUMER_BYTES)
                pull = wire.Pull("p-req", "a-consumer", "", 0, [1, 2, 3], beat_ms=300)
                await sock.send_multipart([producer.seal_request(wire.encode(pull))])
                (frame,) = await sock.recv_multipart()
                blocks = producer.answer_to(frame, wire.decode_to_consumer, "p-req")
                assert isinstance(blocks, wire.Blocks), blocks
                sock.close()  # and it dies: nothing more comes
                await ended.wait()  # at the producer's hold of 0.3 s (else: 600 s)
                nursery.cancel_scope.cancel()
    finally:
        await producer.aclose()
    assert outcome == ["consumer a-consumer silent past its read lease"], outcome
    assert "p-req" not in producer.held


async def test_a_producer_that_stops_answering_heartbeats_fails_the_read(
    layouts: tuple[KVLayout, KVLayout],
) -> None:
    """Issue 28, item 2: a consumer whose heartbeats go unanswered (the producer hung, or
    is partitioned away) cannot know the blocks are still held: its load fails (vLLM
    recomputes) rather than keep what the READs bring."""
    prod, cons = layouts
    producer: _Beating = await _open_as(_Beating, prod)
    producer.hung = True
    consumer: GatedConsumer = await _open_as(GatedConsumer, cons, progress_s=0.2)
    consumer.gate, consumer.at_gate = trio.Event(), trio.Event()
    raised: list[BaseException] = []

    async def load() -> None:
        job = dataclasses.replace(_job(cons, producer.address, "slow"), req="c-slow")
        try:
            await consumer.load(job)
        except TransportError as exc:
            raised.append(exc)

    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(producer.serve)
                nursery.start_soon(producer.offer, _offer(prod, "slow"))
                await trio.testing.wait_all_tasks_blocked()
                await load()  # the gate stays shut: the heartbeat's failure ends the READs
                nursery.cancel_scope.cancel()
    finally:
        await consumer.aclose()
        await producer.aclose()
    assert len(raised) == 1, raised
    assert "sent nothing for 0.2s while slow was pulled" in str(raised[0]), raised[0]
