"""A follower (`kvflow.route.feeds`) on vLLM's own publisher (`ZmqEventPublisher`, its
PUB and replay sockets): a late join filled by a replay, a gap the replay cannot fill
forgetting the instance, a restarted publisher starting empty."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator

import pytest
import trio
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from kvflow.route.feeds import FeedState, follow
from kvflow.route.index import Match, PrefixIndex
from kvflow_vllm.apiserver import free_port


class Stream:
    """One vLLM publisher (remade on the same ports by `restart`) publishing a chain of
        one-block batches: block b (tokens 4b..4b+3, plus 1000 for each restart) is the child of
    block b-1."""

    def __init__(self, steps: int) -> None:
        self.pub_port, self.replay_port = free_port(), free_port()
        self.steps = steps
        self.pub = self._publisher()
        self.blocks = 0
        self.base = 0

    def _publisher(self) -> ZmqEventPublisher:
        return ZmqEventPublisher(
            0, f"tcp://*:{self.pub_port}", f"tcp://*:{self.replay_port}", buffer_steps=self.steps
        )

    def restart(self) -> None:
        """A new publisher on the same ports (as a restarted server's), once zmq's I/O
        thread has let go of the old one's (a close returns before it has)."""
        self.pub.shutdown()
        for _ in range(200):
            try:
                self.pub = self._publisher()
                break
            except zmq.ZMQError:
                threading.Event().wait(0.05)
        else:
            raise AssertionError("the publisher's ports were never free again")
        self.blocks = 0
        self.base += 1000

    def publish(self, n: int = 1) -> None:
        for _ in range(n):
            b = self.blocks = self.blocks + 1
            event = BlockStored(
                block_hashes=[self.base + b],
                parent_block_hash=self.base + b - 1 if b > 1 else None,
                token_ids=[self.base + t for t in range(4 * b, 4 * b + 4)],
                block_size=4, lora_id=None,
                medium="GPU", lora_name=None,
            )  # fmt: skip
            self.pub.publish(KVEventBatch(ts=0.0, events=[event]))

    def sent(self) -> None:
        """Return once the publisher's thread has sent every batch published (`publish`
        only queues them): asks its replay endpoint for the last until it is there."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 20_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.replay_port}")
        last = (self.blocks - 1).to_bytes(8, "big")
        try:
            for _ in range(1000):
                sock.send_multipart([b"", last])
                seqs = []
                while (seq := sock.recv_multipart()[2]) != ZmqEventPublisher.END_SEQ:
                    seqs.append(seq)
                if last in seqs:
                    return
            raise AssertionError("the publisher never sent its last batch")
        finally:
            sock.close()

    def feed(self) -> FeedState:
        """A follower's state for this stream (instance `a`)."""
        return FeedState(
            "a", f"tcp://127.0.0.1:{self.pub_port}", f"tcp://127.0.0.1:{self.replay_port}"
        )

    def tokens(self) -> list[int]:
        return [self.base + t for t in range(4, 4 * self.blocks + 4)]


@pytest.fixture
def stream() -> Iterator[Stream]:
    s = Stream(steps=4)
    yield s
    s.pub.shutdown()


@pytest.fixture
def roomy() -> Iterator[Stream]:
    s = Stream(steps=1000)
    yield s
    s.pub.shutdown()


@pytest.fixture
async def following_roomy(roomy: Stream) -> AsyncIterator[tuple[FeedState, PrefixIndex]]:
    async for pair in _following(roomy):
        yield pair


@pytest.fixture
async def following(stream: Stream) -> AsyncIterator[tuple[FeedState, PrefixIndex]]:
    async for pair in _following(stream):
        yield pair


async def _following(stream: Stream) -> AsyncIterator[tuple[FeedState, PrefixIndex]]:
    state, index = stream.feed(), PrefixIndex()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow, state, index, ctx)
        yield state, index
        nursery.cancel_scope.cancel()
    ctx.term()


async def seen(stream: Stream, state: FeedState, index: PrefixIndex) -> int:
    """Publish a block at a time until the follower has applied one published after this
    call began (a SUB socket joins a while after it connects: ZMQ's slow joiner); then
    wait until it applied the last. The tokens the index says the instance holds."""
    with trio.fail_after(20):
        before = state.batches
        while state.batches == before:
            stream.publish()
            await trio.sleep(0.05)  # the publisher's thread sends it
        while state.seq != stream.blocks - 1:
            await trio.sleep(0.01)
    return index.match(stream.tokens(), None).get("a", Match()).tokens


async def test_a_late_follower_is_filled_by_a_replay(
    stream: Stream, following: tuple[FeedState, PrefixIndex]
) -> None:
    state, index = following
    assert await seen(stream, state, index) == len(stream.tokens())
    assert (state.lost, state.restarts, state.bad) == (0, 0, 0)


async def test_a_gap_the_replay_cannot_fill_forgets_the_instance(stream: Stream) -> None:
    state, index = stream.feed(), PrefixIndex()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow, state, index, ctx)
        assert await seen(stream, state, index) == len(stream.tokens())
        nursery.cancel_scope.cancel()
    stream.publish(10)  # unseen, and more than the publisher's buffer (4) holds
    stream.sent()  # before the follower is back (else it may see them all live)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(follow, state, index, ctx)
        held = await seen(stream, state, index)
        nursery.cancel_scope.cancel()
    ctx.term()
    assert state.lost == 1
    assert held == 0  # forgotten; what came after has no known parent: not indexed


async def test_a_restarted_publisher_starts_its_instance_empty(
    roomy: Stream, following_roomy: tuple[FeedState, PrefixIndex]
) -> None:
    """(A buffer that holds what the new publisher sends before the follower's socket
    has joined it again, so its whole chain is had by a replay.)"""
    stream, (state, index) = roomy, following_roomy
    assert await seen(stream, state, index) == len(stream.tokens())
    stream.publish(20)  # numbered past what the new publisher will have sent when seen
    assert await seen(stream, state, index) == len(stream.tokens())
    old = stream.tokens()
    stream.restart()
    assert await seen(stream, state, index) == len(stream.tokens())  # the new chain
    assert state.restarts == 1
    assert index.match(old, None) == {}
