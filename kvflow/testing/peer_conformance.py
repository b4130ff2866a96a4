"""The conformance suite of peer transports (prefill/decode disaggregation).

A peer transport moves one request's KV straight from the producer's blocks
into the consumer's: the producer worker `offer()`s the blocks and answers
pulls in `serve()`; the consumer worker `load()`s a job whose `source` names
the producer. An author writes, as for the store suite::

    class TestMyPeerTransport(PeerConformance):
        @pytest.fixture
        def make_transport(self):
            return lambda context: MyTransport(MyOptions(), context)

Every instance is a worker (scheduler instances are only used to probe the
capabilities); the harness runs each worker's `serve()` as a task, the way
`kvflow.engine.worker.WorkerEngine` does, and stops it before `aclose()`. Producer
and consumer share one test layout and use distinct blocks of it, so every
byte of the consumer's memory is checked against the producer's. Transports
whose capabilities lack `peer` or the `cpu` memory kind are skipped.

Failures raise `ContractViolation` naming the broken promise (`PeerPromise`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import ClassVar

import pytest
import trio
import trio.testing

from ..geometry.layout import KVLayout
from ..transport import ChunkMissing, Offer, PeerSource, Renewed, Transport, TransportError
from .contract import Promise, violated
from .harness import Chunks, Harness, _all, _spans, open_nursery
from .suite import ConformanceSuite

__all__ = ["PeerConformance", "PeerPromise"]


class PeerPromise:
    """The promises of peer transports the suite checks, as failure text."""

    ADDRESS = "a producer worker advertises where consumers reach it in `address` after open()"
    PULL = (
        "a load whose job.source names a producer fills every span of every chunk with the "
        "bytes of the producer's offered blocks"
    )
    DONE = 'offer(o) returns "done" once the consumer has pulled every block'
    RELEASE = (
        "offer(o) returns once the consumer is finished with the blocks (pulled, or gave up), "
        "not only at the hold deadline"
    )
    HOLD = (
        "offered blocks are never let go while a pull reads them: offer(o) returns only "
        "after every read ended, also when cancelled at the hold deadline"
    )
    REFUSED = (
        "a pull of a request the producer does not hold (never offered, or expired) raises "
        "ChunkMissing promptly"
    )
    RENEW = (
        "renew(address, reqs, lease_s) reaches the producer worker at `address`: each held "
        "request's Offer.renew(lease_s) is called, one offered and let go comes back refused "
        "with a reason, and one not offered (yet) comes back pending"
    )
    RELEASE = (
        "renew(address, [], lease_s, release=[req]) makes the producer end its offer of "
        "`req` at once when no pull claimed it (offer(o) returns a reason, not 'done')"
    )
    EARLY_CLAIM = (
        "a claim (renew) that reaches the producer before its offer is pending, and held "
        "once the offer is made"
    )
    ONE_CONSUMER = (
        "a request is pulled by one consumer: a second is refused (ChunkMissing) and nothing "
        "it sends releases the blocks the first is reading"
    )
    STREAMED = (
        "a streamed offer (Offer.params set: made as its prefill is scheduled) gives its "
        "params with each answer to a claim that holds it (Renewed.params), and each of its "
        "layers is read only after Offer.computed(layer) returned"
    )
    DEAD_PEER = (
        "a pull from a producer that is gone ends by the caller's deadline (cancellable, no "
        "hang) and the consumer stays usable"
    )


class PeerConformance(ConformanceSuite):
    """The peer suite. Subclass and provide a `make_transport` fixture."""

    dead_peer_deadline_s: ClassVar[float] = 0.5
    """How long the consumer waits for a producer that is gone before giving up."""

    def skip_reason(self, cls: type[Transport]) -> str:
        if not cls.capabilities.peer:
            return f"{cls.__name__} is not a peer transport (capabilities.peer=False)"
        return super().skip_reason(cls)

    # -- helpers -----------------------------------------------------------------
    @staticmethod
    def offer_of(kv: Harness, req: str, chunks: Chunks, layout: KVLayout | None = None) -> Offer:
        layout = layout or kv.layout
        return Offer(
            req,
            list(chunks.blocks),
            list(chunks.token_counts),
            layout.num_layers,
            lambda layer: _spans(layout, layer, chunks),
        )

    @staticmethod
    def source(producers: Sequence[Transport], req: str, chunks: Chunks) -> PeerSource:
        return PeerSource("producer", [p.address for p in producers], req, list(chunks.blocks))

    async def pull(
        self,
        kv: Harness,
        producer: Transport,
        consumer: Transport,
        src: Chunks,
        *,
        req: str = "pd-req",
        layout: KVLayout | None = None,
        layerwise: bool = True,
        only: Sequence[int] | None = None,
    ) -> None:
        """Offer `src` on `producer`, pull it (or its chunks `only`) into new blocks with
        `consumer`, and check the bytes, the layer signals and the offer's outcome."""
        layout = layout or kv.layout
        offered, src = src, src if only is None else src.take(only)
        dst, source, before = kv.destination(src, layout)
        outcome: list[str] = []
        returned = trio.Event()

        async def hold() -> None:
            outcome.append(await producer.offer(self.offer_of(kv, req, offered, layout)))
            returned.set()

        def on_layer(layer: int) -> None:
            kv.expect_loaded(
                source, before, src, dst, layers=[layer], layout=layout, promise=Promise.LOAD_ORDER
            )

        async with open_nursery() as nursery:
            nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            job, signalled = kv.load_job(dst, layout, on_layer, self.source([producer], req, src))
            job = dataclasses.replace(job, layerwise=layerwise)
            try:
                await consumer.load(job)
            except Exception as exc:
                violated(
                    PeerPromise.PULL,
                    f"the pull raised {type(exc).__name__}: {exc}",
                    keys=src.keys,
                    block_ids=src.blocks,
                )
            await kv.progress(returned, "offer() returning after the pull", PeerPromise.DONE, src)
        if signalled != list(range(layout.num_layers)):
            violated(Promise.LOAD_ORDER, f"layer_loaded was called with {signalled}")
        kv.expect_loaded(source, before, src, dst, layout=layout, promise=PeerPromise.PULL)
        if outcome != ["done"]:
            violated(PeerPromise.DONE, f"offer() returned {outcome[0]!r}", block_ids=src.blocks)

    async def pull_all(
        self,
        kv: Harness,
        producers: Sequence[Transport],
        consumers: Sequence[Transport],
        srcs: Sequence[Chunks],
        reqs: Sequence[str],
    ) -> None:
        """Concurrent pulls: consumer i pulls `srcs[i]`, offered as `reqs[i]` by producer i
        (or by the only producer); all sources name every producer, in shard order."""
        offering = producers if len(producers) == len(srcs) else [producers[0]] * len(srcs)
        dsts = [s.at(kv.blocks(len(s))) for s in srcs]
        for d in dsts:
            kv.poison(d.blocks)
        before = kv.snapshot()
        outcomes: list[str] = []
        loaded = False

        async def hold(i: int) -> None:
            outcomes.append(await offering[i].offer(self.offer_of(kv, reqs[i], srcs[i])))

        async def load(i: int) -> None:
            job, _ = kv.load_job(dsts[i], source=self.source(producers, reqs[i], srcs[i]))
            try:
                await consumers[i].load(job)
            except Exception as exc:
                violated(
                    PeerPromise.PULL,
                    f"pull {i} of {len(srcs)} concurrent ones raised {type(exc).__name__}: {exc}",
                    keys=srcs[i].keys,
                    block_ids=srcs[i].blocks,
                )

        with trio.move_on_after(kv.progress_timeout_s) as deadline:
            async with open_nursery() as nursery:
                for i in range(len(srcs)):
                    nursery.start_soon(hold, i)
                await trio.testing.wait_all_tasks_blocked()
                await _all(functools.partial(load, i) for i in range(len(srcs)))
                loaded = True
        if loaded:
            src_all, dst_all = sum(srcs[1:], srcs[0]), sum(dsts[1:], dsts[0])
            kv.expect_loaded(before, before, src_all, dst_all, promise=PeerPromise.PULL)
        if deadline.cancelled_caught or outcomes != ["done"] * len(srcs):
            violated(PeerPromise.DONE, f"{len(srcs)} pulls done; the offers returned {outcomes}")

    async def refused(self, kv: Harness, consumer: Transport, source: PeerSource) -> None:
        dst = kv.chunks(len(source.block_ids), fill=False)
        job, _ = kv.load_job(dst, source=source)
        with trio.move_on_after(kv.progress_timeout_s):
            try:
                await consumer.load(job)
            except ChunkMissing:
                return
            except Exception as exc:
                violated(PeerPromise.REFUSED, f"raised {type(exc).__name__}: {exc}")
            violated(PeerPromise.REFUSED, "the pull returned normally")
        violated(PeerPromise.REFUSED, f"no answer within {kv.progress_timeout_s} s")

    # -- tests -------------------------------------------------------------------
    async def test_producer_advertises_an_address(self, kv: Harness) -> None:
        a, b = await kv.worker(), await kv.worker()
        if not a.address or a.address == b.address:
            violated(PeerPromise.ADDRESS, f"two producers advertise {a.address!r}, {b.address!r}")

    async def test_pull_moves_the_offered_blocks(self, kv: Harness) -> None:
        producer, consumer = await kv.worker(), await kv.worker()
        await self.pull(kv, producer, consumer, kv.chunks(3), req="full")
        await self.pull(kv, producer, consumer, kv.chunks(2, partial=1), req="partial")

    async def test_an_asynchronous_pull_moves_the_offered_blocks(self, kv: Harness) -> None:
        """`LoadJob.layerwise=False` (a P/D pull): all layers may move at once, but every
        layer is still signalled, in order."""
        producer, consumer = await kv.worker(), await kv.worker()
        await self.pull(kv, producer, consumer, kv.chunks(3), req="full", layerwise=False)
        src = kv.chunks(2, partial=1)
        await self.pull(kv, producer, consumer, src, req="partial", layerwise=False)

    async def test_a_consumer_with_a_prefix_pulls_only_the_rest(self, kv: Harness) -> None:
        """A decode instance whose prefix cache holds the first chunks asks for the other
        blocks of the offer only (`PeerSource.block_ids` is that part)."""
        producer, consumer = await kv.worker(), await kv.worker()
        src = kv.chunks(4, partial=2)
        await self.pull(kv, producer, consumer, src, req="rest", only=[2, 3])
        src = kv.chunks(3)
        await self.pull(kv, producer, consumer, src, req="rest-async", only=[1, 2], layerwise=False)

    async def test_pull_leaves_a_layer_alone_once_it_is_signalled(self, kv: Harness) -> None:
        """vLLM computes into a layer as soon as it is signalled (see the store suite)."""
        producer, consumer = await kv.worker(), await kv.worker()
        src = kv.chunks(2, partial=3)
        dst, _, _ = kv.destination(src)
        scribble: dict[int, bytes] = {}

        def on_layer(layer: int) -> None:
            last = _spans(kv.layout, layer, dst)[-1][-1]
            scribble[layer] = last[:] = bytes([0x5A ^ layer]) * len(last)

        async with open_nursery() as nursery:
            nursery.start_soon(producer.offer, self.offer_of(kv, "r", src))
            await trio.testing.wait_all_tasks_blocked()
            job, _ = kv.load_job(dst, on_layer=on_layer, source=self.source([producer], "r", src))
            await consumer.load(job)
            nursery.cancel_scope.cancel()
        for layer, pattern in scribble.items():
            if bytes(_spans(kv.layout, layer, dst)[-1][-1]) != pattern:
                violated(
                    Promise.LOAD_HANDS_OFF,
                    f"layer {layer} of the last block changed after layer_loaded({layer})",
                    block_ids=dst.blocks[-1:],
                )

    async def test_pull_of_an_unknown_request_is_refused(self, kv: Harness) -> None:
        producer, consumer = await kv.worker(), await kv.worker()
        await self.refused(kv, consumer, PeerSource("p", [producer.address], "never", [0, 1]))

    async def test_an_expired_offer_is_refused(self, kv: Harness) -> None:
        producer, consumer = await kv.worker(), await kv.worker()
        src = kv.chunks(2)
        with trio.CancelScope() as deadline:
            deadline.cancel()  # the hold deadline passed before any consumer came
            await producer.offer(self.offer_of(kv, "late", src))
        await self.refused(kv, consumer, self.source([producer], "late", src))

    async def claiming(
        self, kv: Harness, req: str
    ) -> tuple[Transport, Transport, Offer, list[float]]:
        """A producer worker, a consumer scheduler, and an offer of `req` whose renewals
        are recorded (in the list); skips transports without claims."""
        producer, consumer = await kv.worker(), await kv.scheduler()
        if type(consumer).renew is Transport.renew:
            pytest.skip(f"{type(consumer).__name__} holds offers for the hold timeout only")
        leases: list[float] = []
        offer = dataclasses.replace(self.offer_of(kv, req, kv.chunks(2)), renew=leases.append)
        return producer, consumer, offer, leases

    async def test_a_claim_renews_held_offers_and_names_the_others(self, kv: Harness) -> None:
        producer, consumer, offer, leases = await self.claiming(kv, "held")
        with trio.CancelScope() as deadline:
            deadline.cancel()  # the hold deadline passed before any consumer came
            await producer.offer(self.offer_of(kv, "gone", kv.chunks(1)))
        answer: Renewed | None = None
        async with open_nursery() as nursery:
            nursery.start_soon(producer.offer, offer)
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(kv.progress_timeout_s):
                answer = await consumer.renew(producer.address, ["held", "gone", "never"], 12.5)
            nursery.cancel_scope.cancel()  # the hold deadline
        if answer is None:
            violated(PeerPromise.RENEW, f"no answer within {kv.progress_timeout_s} s")
        elif (
            leases != [12.5]
            or list(answer.refused) != ["gone"]
            or not answer.refused["gone"]
            or answer.pending != ["never"]
        ):
            violated(PeerPromise.RENEW, f"renewed {leases}, answered {answer}")

    async def test_a_release_ends_an_unpulled_offer_at_once(self, kv: Harness) -> None:
        producer, consumer, offer, _ = await self.claiming(kv, "r")
        outcome: list[str] = []
        ended = trio.Event()

        async def hold() -> None:
            outcome.append(await producer.offer(offer))
            ended.set()

        async with open_nursery() as nursery:
            nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(kv.progress_timeout_s):
                await consumer.renew(producer.address, [], 9.0, release=["r"])
                await ended.wait()
            nursery.cancel_scope.cancel()  # the hold deadline
        if not outcome or outcome[0] in ("", "done"):
            violated(PeerPromise.RELEASE, f"offer() returned {outcome or 'nothing'}")

    async def test_a_claim_before_its_offer_is_pending_then_held(self, kv: Harness) -> None:
        producer, consumer, offer, leases = await self.claiming(kv, "r")
        answers: list[Renewed] = []
        async with open_nursery() as nursery:
            with trio.move_on_after(kv.progress_timeout_s):
                answers.append(await consumer.renew(producer.address, ["r"], 9.0))
                nursery.start_soon(producer.offer, offer)  # the producer's next step
                await trio.testing.wait_all_tasks_blocked()
                answers.append(await consumer.renew(producer.address, ["r"], 9.0))
            nursery.cancel_scope.cancel()
        want = [Renewed({}, ["r"]), Renewed({}, [])]
        if answers != want or leases != [9.0]:
            violated(PeerPromise.EARLY_CLAIM, f"answered {answers}, renewed {leases}")

    async def test_a_claim_of_a_streamed_offer_gets_its_params(self, kv: Harness) -> None:
        producer, consumer, offer, _ = await self.claiming(kv, "streamed")
        plain = self.offer_of(kv, "plain", kv.chunks(1))
        answer: Renewed | None = None
        async with open_nursery() as nursery:
            nursery.start_soon(producer.offer, dataclasses.replace(offer, params=b"signed"))
            nursery.start_soon(producer.offer, plain)
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(kv.progress_timeout_s):
                answer = await consumer.renew(producer.address, ["streamed", "plain"], 9.0)
            nursery.cancel_scope.cancel()
        if answer is None or answer.params != {"streamed": b"signed"} or answer.refused:
            violated(PeerPromise.STREAMED, f"answered {answer}")

    async def test_a_streamed_offer_is_read_only_as_its_layers_are_computed(
        self, kv: Harness
    ) -> None:
        """The pull comes before the prefill's forward wrote the blocks: until layer i is
        computed they hold other bytes, which a pull that read it early would land."""
        producer, consumer = await kv.worker(), await kv.worker()
        layout, src = kv.layout, kv.chunks(2, partial=3)
        dst, source, before = kv.destination(src)

        def spans(layer: int) -> list[memoryview]:
            return [s for b in src.blocks for s in layout.spans(layer, b, layout.block_size)]

        computed_bytes = [[bytes(s) for s in spans(i)] for i in range(layout.num_layers)]
        kv.fill(src)  # what the blocks held before this step's forward
        asked, computed = trio.Event(), [trio.Event() for _ in range(layout.num_layers)]
        waited: list[int] = []

        async def wait(layer: int) -> None:
            waited.append(layer)
            asked.set()
            await computed[layer].wait()

        offer = dataclasses.replace(self.offer_of(kv, "s", src), params=b"p", computed=wait)
        outcome: list[str] = []
        failed: list[str] = []

        async def load() -> None:
            job, _ = kv.load_job(dst, source=self.source([producer], "s", src))
            try:
                await consumer.load(job)
            except Exception as exc:
                failed.append(f"the pull raised {type(exc).__name__}: {exc}")
            asked.set()  # a pull that ended without waiting: the forward goes on anyway

        async def hold() -> None:
            outcome.append(await producer.offer(offer))

        with trio.move_on_after(kv.progress_timeout_s * (layout.num_layers + 2)):
            async with open_nursery() as nursery:
                nursery.start_soon(hold)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(load)
                await asked.wait()  # the producer waits for layer 0
                for layer in range(layout.num_layers):  # the forward, layer by layer
                    await trio.testing.wait_all_tasks_blocked()  # a pull reading ahead: now
                    for span, data in zip(spans(layer), computed_bytes[layer], strict=True):
                        span[:] = data
                    computed[layer].set()
        if not waited:
            violated(PeerPromise.STREAMED, "the offer was read without Offer.computed called")
        if failed or outcome != ["done"]:
            violated(PeerPromise.STREAMED, f"{failed or ''} offer() returned {outcome}")
        kv.expect_loaded(source, before, src, dst, promise=PeerPromise.STREAMED)

    async def test_blocks_stay_held_while_a_pull_reads_them(self, kv: Harness) -> None:
        """The hold deadline passes mid-pull: once offer() returns, vLLM reuses the blocks
        (here: overwrites them); the consumer must end with the offered bytes or an error,
        never with the new contents."""
        producer, consumer = await kv.worker(), await kv.worker()
        src = kv.chunks(3, partial=2)
        dst, source, before = kv.destination(src)
        deadline = trio.CancelScope()

        async def hold() -> None:
            with deadline:
                await producer.offer(self.offer_of(kv, "r", src))
            kv.poison(src.blocks)  # the blocks went back to vLLM

        async with open_nursery() as nursery:
            nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            job, _ = kv.load_job(
                dst, on_layer=lambda _: deadline.cancel(), source=self.source([producer], "r", src)
            )
            try:
                await consumer.load(job)
            except TransportError:
                return  # a failed pull is recomputed by vLLM: allowed
        kv.expect_loaded(source, before, src, dst, unspecified=src.blocks, promise=PeerPromise.HOLD)

    async def test_a_consumer_that_gives_up_releases_the_blocks(self, kv: Harness) -> None:
        producer, consumer = await kv.worker(), await kv.worker()
        src = kv.chunks(3)
        dst = src.at(kv.blocks(3))
        returned = trio.Event()

        async def hold() -> None:
            await producer.offer(self.offer_of(kv, "r", src))
            returned.set()

        async with open_nursery() as nursery:
            nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()
            with trio.CancelScope() as load_deadline:
                job, _ = kv.load_job(
                    dst,
                    on_layer=lambda _: load_deadline.cancel(),
                    source=self.source([producer], "r", src),
                )
                await consumer.load(job)
            await kv.progress(returned, "offer() returning", PeerPromise.RELEASE, src)

    async def test_a_second_consumer_of_a_request_is_refused(self, kv: Harness) -> None:
        producer, first, second = await kv.worker(), await kv.worker(), await kv.worker()
        src = kv.chunks(3)
        dst, source, before = kv.destination(src)
        other = src.at(kv.blocks(3))
        outcome: list[str] = []
        second_said: list[BaseException | None] = []
        returned, answered = trio.Event(), trio.Event()

        async def hold() -> None:
            outcome.append(await producer.offer(self.offer_of(kv, "r", src)))
            returned.set()

        async def intrude() -> None:  # pulls the same request while the first one does
            job, _ = kv.load_job(other, source=self.source([producer], "r", src))
            try:
                await second.load(job)
                second_said.append(None)
            except Exception as exc:
                second_said.append(exc)
            answered.set()

        async with open_nursery() as nursery:
            nursery.start_soon(hold)
            await trio.testing.wait_all_tasks_blocked()

            def on_layer(layer: int) -> None:
                if layer == 0:
                    nursery.start_soon(intrude)

            job, _ = kv.load_job(dst, on_layer=on_layer, source=self.source([producer], "r", src))
            await first.load(job)
            await kv.progress(answered, "the second pull ending", PeerPromise.ONE_CONSUMER, src)
            await kv.progress(returned, "offer() returning", PeerPromise.DONE, src)
        if not second_said or not isinstance(second_said[0], ChunkMissing):
            got = repr(second_said[0]) if second_said else "no answer"
            violated(PeerPromise.ONE_CONSUMER, f"the second pull ended with {got}")
        kv.expect_loaded(source, before, src, dst, promise=PeerPromise.PULL)
        if outcome != ["done"]:
            violated(PeerPromise.ONE_CONSUMER, f"offer() returned {outcome}, not the first's done")

    async def test_a_dead_producer_ends_the_pull_by_its_deadline(self, kv: Harness) -> None:
        producer, consumer = await kv.worker(), await kv.worker()
        src = kv.chunks(2)
        gone = self.source([producer], "r", src)
        await kv.close(producer)  # the producer's process died before the pull
        job, _ = kv.load_job(src.at(kv.blocks(2)), source=gone)
        with trio.move_on_after(self.dead_peer_deadline_s):
            try:
                await consumer.load(job)
            except TransportError:
                pass
            else:
                violated(PeerPromise.DEAD_PEER, "a pull from a closed producer returned normally")
        await self.pull(kv, await kv.worker(), consumer, kv.chunks(1), req="after")

    async def test_concurrent_pulls(self, kv: Harness) -> None:
        producer = await kv.worker()
        consumers = [await kv.worker() for _ in range(3)]
        srcs = [kv.chunks(2, partial=i + 1) for i in range(3)]
        await self.pull_all(kv, [producer], consumers, srcs, reqs=["r0", "r1", "r2"])

    async def test_each_shard_pulls_its_own_slice(self, kv: Harness) -> None:
        """Tensor parallelism: producer rank i serves consumer rank i the same request."""
        shards = ["tp0of2pp0", "tp1of2pp0"]
        producers = [await kv.worker(shard=s, shards=shards) for s in shards]
        consumers = [await kv.worker(shard=s, shards=shards) for s in shards]
        srcs = [kv.chunks(2, partial=2) for _ in shards]
        await self.pull_all(kv, producers, consumers, srcs, reqs=["tp", "tp"])

    async def test_large_blocks(self, kv: Harness) -> None:
        big = self.large_layout(kv.layout)
        producer = await kv.worker(layout=big)
        consumer = await kv.worker(layout=big)
        await self.pull(kv, producer, consumer, kv.chunks(2, partial=100, layout=big), layout=big)
