"""The conformance suite every kvflow transport must pass.

A transport author writes one test module with one class and one fixture::

    import pytest
    from kvflow.testing.conformance import TransportConformance
    from my_transport import MyOptions, MyTransport

    class TestMyTransport(TransportConformance):
        @pytest.fixture
        def make_transport(self, tmp_path):
            def make(context):
                return MyTransport(MyOptions(path=str(tmp_path / "store")), context)
            return make

and runs it with pytest and pytest-trio installed (`pytest-trio`'s `trio_mode`
is not needed: the tests carry the `trio` mark).

The seam is the `make_transport` fixture: a callable that takes a
`kvflow.transport.TransportContext` and returns a *new, unopened* transport
(or an awaitable of one). Within one test it is called several times, once
per instance the test needs (a scheduler-side instance that answers lookups,
one or more worker-side instances that save and load, instances with another
namespace or shard), and every instance it returns must reach the same store,
as the scheduler and worker processes of one deployment do. The fixture may
depend on any other fixture (`tmp_path`, an async fixture that starts a
server). The suite then drives each instance the way kvflow does:

- `await transport.open()`, with `context.layout` still `None`;
- on workers, `await transport.register(layout)` follows `open()`, as
  `kvflow.engine.worker.WorkerEngine.register` does when vLLM registers its caches;
- lookups go to the scheduler instance, saves and loads to workers;
- `await transport.aclose()` once at the end of the test, also after
  cancelled transfers.

Memory is real: numpy buffers from `kvflow.testing.make_layout`, in two
token-granular layouts (NHD: one K and one V plane; HND: one plane per K/V head;
a partial chunk moves only its tokens) and a block-granular one (a chunk is one
opaque block); every data test runs on each (override the `layout` fixture to
narrow that). Transports whose
capabilities lack `store` or the `cpu` memory kind are skipped.

A test failure raises `ContractViolation`, an `AssertionError` whose text
names the promise of the `Transport` contract that was broken and the
chunk indexes, keys and block ids involved. Promises are listed in `Promise`
(both in `kvflow.testing.contract`). The tests speak through
`kvflow.testing.harness.Harness` (the `kv` fixture of `kvflow.testing.suite`'s
`ConformanceSuite`, which this suite and the peer suite share).
Nothing here sleeps to synchronise: every ordering is forced with
`trio.Event`s; a few waits for the transport's own progress are bounded by
`TransportConformance.progress_timeout_s` (real time) so a hung transport
fails with a message instead of hanging the run.
"""

from __future__ import annotations

import functools

import pytest
import trio
import trio.testing

from ..geometry.layout import KVLayout
from ..shapes.reshape import load_reshaped, lookup_sources, other_shapes, shard_name
from ..transport import SaveJob, Transport, TransportError
from .contract import ContractViolation, Promise, violated
from .harness import Chunks, GatedSave, Harness, _all, _spans, expect_none_stored
from .store_blocks import BlockSizeConformance
from .suite import ConformanceSuite

__all__ = [
    "Chunks",
    "ContractViolation",
    "GatedSave",
    "Harness",
    "Promise",
    "TransportConformance",
    "violated",
]


class TransportConformance(BlockSizeConformance, ConformanceSuite):
    """The store suite. Subclass and provide a `make_transport` fixture; see the module
    docstring."""

    def skip_reason(self, cls: type[Transport]) -> str:
        if not cls.capabilities.store:
            return f"{cls.__name__} is not a store (capabilities.store=False)"
        return super().skip_reason(cls)

    # -- lookup ----------------------------------------------------------------
    async def test_lookup_on_empty_store_is_zero(self, kv: Harness) -> None:
        sched = await kv.scheduler()
        chunks = kv.chunks(3, fill=False)
        await kv.lookup(sched, chunks.keys, 0)
        await kv.lookup(sched, [], 0)

    async def test_save_then_lookup_counts_all(self, kv: Harness) -> None:
        sched = await kv.scheduler()
        worker = await kv.worker()
        chunks = kv.chunks(3, partial=1)
        await kv.save(worker, chunks)
        await kv.lookup(sched, chunks.keys, 3)
        # a scheduler that starts after the save sees it too
        await kv.lookup(await kv.scheduler(), chunks.keys, 3)

    async def test_lookup_counts_only_leading_present_keys(self, kv: Harness) -> None:
        sched = await kv.scheduler()
        worker = await kv.worker()
        chunks = kv.chunks(5)
        await kv.save(worker, chunks.take([0, 1]))
        await kv.save(worker, chunks.take([3]))
        await kv.lookup(sched, chunks.keys, 2)
        await kv.lookup(sched, chunks.keys[2:], 0)
        await kv.lookup(sched, chunks.keys[3:], 1)
        await kv.lookup(sched, [chunks.keys[3], chunks.keys[0]], 2)

    # -- round trips -----------------------------------------------------------
    async def test_round_trip_full_chunks(self, kv: Harness) -> None:
        worker = await kv.worker()
        await kv.round_trip(worker, worker, kv.chunks(3))

    @pytest.mark.parametrize("tokens", [1, 3])
    async def test_round_trip_partial_chunk(self, kv: Harness, tokens: int) -> None:
        assert tokens < kv.layout.block_size
        worker = await kv.worker()
        await kv.round_trip(worker, worker, kv.chunks(2, partial=tokens))
        await kv.round_trip(worker, worker, kv.chunks(1, partial=tokens))

    async def test_round_trip_across_instances(self, kv: Harness) -> None:
        """Bytes saved by one worker load in another (another process, a restart)."""
        saver = await kv.worker()
        loader = await kv.worker()
        await kv.round_trip(saver, loader, kv.chunks(2, partial=2))

    async def test_load_signals_each_layer_in_order_once_landed(self, kv: Harness) -> None:
        worker = await kv.worker()
        src = kv.chunks(3, partial=2)
        dst = src.at(kv.blocks(3))
        kv.poison(dst.blocks)
        await kv.save(worker, src)
        source = before = kv.snapshot()

        def on_layer(layer: int) -> None:
            kv.expect_loaded(source, before, src, dst, layers=[layer], promise=Promise.LOAD_ORDER)

        job, signalled = kv.load_job(dst, on_layer=on_layer)
        await worker.load(job)
        if signalled != list(range(kv.layout.num_layers)):
            violated(
                Promise.LOAD_ORDER,
                f"layer_loaded was called with {signalled}",
                keys=dst.keys,
                block_ids=dst.blocks,
            )
        kv.expect_loaded(source, before, src, dst)

    async def test_load_leaves_a_layer_alone_once_it_is_signalled(self, kv: Harness) -> None:
        """vLLM writes the last prompt token's KV into the last loaded block as soon as the
        layer is signalled; a transport that still checks or fills that memory afterwards
        reports a false corruption or clobbers vLLM's write."""
        worker = await kv.worker()
        src = kv.chunks(3, partial=2)
        dst, _, _ = kv.destination(src)
        await kv.save(worker, src)
        scribble: dict[int, bytes] = {}

        def on_layer(layer: int) -> None:  # what vLLM's forward does to the last block
            last = _spans(kv.layout, layer, dst)[-1][-1]
            pattern = bytes([0xA5 ^ layer]) * len(last)
            last[:] = pattern
            scribble[layer] = pattern

        job, _ = kv.load_job(dst, on_layer=on_layer)
        try:
            await worker.load(job)
        except Exception as exc:
            violated(
                Promise.LOAD_HANDS_OFF,
                f"load raised {type(exc).__name__}: {exc} after vLLM wrote into a signalled layer",
                keys=dst.keys,
                block_ids=dst.blocks,
            )
        for layer, pattern in scribble.items():
            last = _spans(kv.layout, layer, dst)[-1][-1]
            if bytes(last) != pattern:
                violated(
                    Promise.LOAD_HANDS_OFF,
                    f"layer {layer} of the last block changed after layer_loaded({layer})",
                    chunks=[len(dst) - 1],
                    keys=dst.keys[-1:],
                    block_ids=dst.blocks[-1:],
                )

    # -- save ordering ---------------------------------------------------------
    async def test_save_reads_each_layer_only_after_it_is_given(self, kv: Harness) -> None:
        sched = await kv.scheduler()
        worker = await kv.worker()
        src = kv.chunks(3, partial=1)  # source blocks hold stale bytes until `give`
        gated = GatedSave(kv, src)
        done = trio.Event()
        num_layers = kv.layout.num_layers

        async def save() -> None:
            await kv.save(worker, src, job=gated.job)
            done.set()

        async def drive() -> None:
            for layer in range(num_layers):
                await gated.wait_asked(layer)
                await trio.testing.wait_all_tasks_blocked()
                if done.is_set():
                    violated(
                        Promise.SAVE,
                        f"save returned before job.layer({layer}) returned",
                        keys=src.keys,
                        block_ids=src.blocks,
                    )
                await expect_none_stored(
                    sched, src, Promise.SAVE_ATOMIC, f"while layers {layer}.. were not given yet"
                )
                gated.give(layer)

        await _all([save, drive])
        if sorted(set(gated.returned)) != list(range(num_layers)):
            violated(
                Promise.SAVE,
                f"save returned having asked only for layers {sorted(set(gated.returned))}",
                keys=src.keys,
                block_ids=src.blocks,
            )
        await kv.lookup(sched, src.keys, len(src))
        source = kv.snapshot()
        kv.poison(src.blocks)  # vLLM may reuse the blocks once save returned
        dst = src.at(kv.blocks(len(src)))
        kv.poison(dst.blocks)
        before = kv.snapshot()
        await kv.load(worker, dst)
        kv.expect_loaded(source, before, src, dst, promise=Promise.SAVE_READS)

    async def test_save_whose_layer_fails_raises_and_stores_nothing(self, kv: Harness) -> None:
        sched = await kv.scheduler()
        worker = await kv.worker()
        src = kv.chunks(2)

        class LayerFailed(Exception):
            pass

        async def layer_spans(layer: int) -> list[list[memoryview]]:
            await trio.lowlevel.checkpoint()
            if layer == kv.layout.num_layers - 1:
                raise LayerFailed(f"layer {layer} could not be computed")
            return _spans(kv.layout, layer, src)

        job = SaveJob(
            "conformance-fail", src.keys, src.token_counts, kv.layout.num_layers, layer_spans
        )
        try:
            await worker.save(job)
        except Exception:
            pass
        else:
            violated(
                Promise.SAVE,
                "job.layer() raised, yet save returned as if every chunk was stored",
                keys=src.keys,
                block_ids=src.blocks,
            )
        got = await sched.lookup(src.keys)
        if got:
            violated(
                Promise.SAVE_ATOMIC,
                f"after a save that failed in its last layer, lookup found {got} chunk(s)",
                keys=src.keys,
                block_ids=src.blocks,
            )

    # -- load errors -----------------------------------------------------------
    @pytest.mark.parametrize("missing", [0, 2])
    async def test_load_of_missing_key_names_first_missing_chunk(
        self, kv: Harness, missing: int
    ) -> None:
        worker = await kv.worker()
        src = kv.chunks(4, partial=2)
        stored = [i for i in range(len(src)) if i != missing]
        await kv.save(worker, src.take(stored))
        dst, source, before = kv.destination(src)
        exc = await kv.load_error(worker, dst)
        if exc.chunk != missing:
            violated(
                Promise.LOAD_ERROR,
                f"{type(exc).__name__}.chunk is {exc.chunk}, but chunk {missing} is the first "
                f"missing one ({exc})",
                chunks=[missing],
                keys=[dst.keys[missing]],
                block_ids=[dst.blocks[missing]],
            )
        if exc.key and exc.key != dst.keys[missing]:
            violated(
                Promise.LOAD_ERROR,
                f"{type(exc).__name__}.key is {exc.key}, not the key of chunk {missing}",
                chunks=[missing],
                keys=[dst.keys[missing]],
            )
        intact = list(range(missing))
        kv.expect_loaded(
            source,
            before,
            src.take(intact),
            dst.take(intact),
            unspecified=dst.blocks[missing:],
            promise=Promise.LOAD_ERROR,
        )

    # -- concurrency -----------------------------------------------------------
    async def test_concurrent_saves_and_loads_of_distinct_keys(self, kv: Harness) -> None:
        sched = await kv.scheduler()
        workers = [await kv.worker(), await kv.worker()]
        requests = [kv.chunks(2, partial=0 if i % 2 else 3) for i in range(8)]
        await _all(
            functools.partial(kv.save, workers[i % 2], src) for i, src in enumerate(requests)
        )
        source = kv.snapshot()
        for src in requests:
            await kv.lookup(sched, src.keys, len(src))
        dsts = [src.at(kv.blocks(len(src))) for src in requests]
        for src in requests:
            kv.poison(src.blocks)
        for dst in dsts:
            kv.poison(dst.blocks)
        before = kv.snapshot()
        await _all(
            functools.partial(kv.load, workers[(i + 1) % 2], dst) for i, dst in enumerate(dsts)
        )
        kv.expect_loaded(source, before, sum(requests[1:], requests[0]), sum(dsts[1:], dsts[0]))

    @pytest.mark.parametrize("instances", ["one", "two"])
    async def test_concurrent_saves_of_the_same_key(self, kv: Harness, instances: str) -> None:
        sched = await kv.scheduler()
        first = await kv.worker()
        second = first if instances == "one" else await kv.worker()
        a = kv.chunks(3, partial=2, fill=False)
        b = a.at(kv.blocks(len(a)))  # same keys, other source blocks,
        kv.copy(a, b)  # same bytes: a key always names the same bytes
        saves = [GatedSave(kv, a, fill=False), GatedSave(kv, b, fill=False)]

        async def lockstep() -> None:  # open each layer to both saves at once
            for layer in range(kv.layout.num_layers):
                await trio.testing.wait_all_tasks_blocked()
                for s in saves:
                    s.give(layer)

        await _all(
            [
                functools.partial(kv.save, first, a, job=saves[0].job),
                functools.partial(kv.save, second, b, job=saves[1].job),
                lockstep,
            ]
        )
        await kv.lookup(sched, a.keys, len(a))
        dst, source, before = kv.destination(a)
        await kv.load(first, dst)
        kv.expect_loaded(source, before, a, dst)

    # -- cancellation ----------------------------------------------------------
    @pytest.mark.parametrize("at", ["first", "last"])
    async def test_cancelled_save_leaves_nothing_visible(self, kv: Harness, at: str) -> None:
        """Cancelled while waiting for the first or the last layer."""
        sched = await kv.scheduler()
        worker = await kv.worker()
        src = kv.chunks(3, partial=1)
        gated = GatedSave(kv, src)
        num_layers = kv.layout.num_layers
        stop_at = 0 if at == "first" else num_layers - 1
        scope = trio.CancelScope()
        outcome: list[BaseException | None] = []

        async def save() -> None:
            with scope:
                try:
                    await worker.save(gated.job)
                except trio.Cancelled:
                    raise
                except BaseException as exc:
                    outcome.append(exc)
                    return
                outcome.append(None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(save)
            for layer in range(stop_at):
                await gated.wait_asked(layer)
                gated.give(layer)
            await gated.wait_asked(stop_at)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
        if outcome:
            what = "returned normally" if outcome[0] is None else f"raised {outcome[0]!r}"
            violated(
                Promise.CANCEL,
                f"save cancelled while waiting for layer {stop_at} {what} instead of "
                "letting trio.Cancelled propagate",
                keys=src.keys,
                block_ids=src.blocks,
            )
        await expect_none_stored(
            sched, src, Promise.CANCEL, f"after a save cancelled at layer {stop_at}"
        )
        dst = src.at(kv.blocks(len(src)))
        exc = await kv.load_error(worker, dst)
        if exc.chunk != 0:
            violated(
                Promise.LOAD_ERROR,
                f"nothing of a cancelled save is stored, yet the load failed at chunk {exc.chunk}",
                chunks=[0],
                keys=dst.keys[:1],
            )
        # the store is not wedged: the same keys save and load afterwards
        kv.fill(src)
        await kv.round_trip(worker, worker, src)

    async def test_cancelled_load_leaves_store_usable(self, kv: Harness) -> None:
        worker = await kv.worker()
        src = kv.chunks(2, partial=3)
        await kv.save(worker, src)
        scope = trio.CancelScope()
        job, _ = kv.load_job(src.at(kv.blocks(len(src))), on_layer=lambda layer: scope.cancel())
        with scope:
            await worker.load(job)
        if not scope.cancelled_caught:
            violated(
                Promise.CANCEL,
                "a load cancelled from its first layer_loaded returned normally",
                keys=src.keys,
            )
        await kv.round_trip(worker, worker, kv.chunks(1))
        dst, source, before = kv.destination(src)
        await kv.load(worker, dst)
        kv.expect_loaded(source, before, src, dst)

    # -- scale -----------------------------------------------------------------
    async def test_large_blocks(self, kv: Harness) -> None:
        big = self.large_layout(kv.layout)
        worker = await kv.worker(layout=big)
        await kv.round_trip(worker, worker, kv.chunks(2, partial=100, layout=big), layout=big)

    # -- isolation -------------------------------------------------------------
    async def test_other_namespace_sees_nothing(self, kv: Harness) -> None:
        mine = await kv.worker()
        other_ns = "conformance-ns-b"
        other_sched = await kv.scheduler(namespace=other_ns)
        other = await kv.worker(namespace=other_ns)
        src = kv.chunks(2, partial=1)
        await kv.save(mine, src)
        got = await other_sched.lookup(src.keys)
        if got:
            violated(
                Promise.NAMESPACE,
                f"a scheduler of namespace {other_ns!r} found {got} chunk(s) saved under "
                f"{kv.namespace!r}",
                keys=src.keys,
            )
        dst = src.at(kv.blocks(len(src)))
        exc = await kv.load_error(other, dst)
        if exc.chunk != 0:
            violated(
                Promise.NAMESPACE,
                f"a load in namespace {other_ns!r} failed at chunk {exc.chunk}, not 0",
                keys=src.keys,
            )
        # the other namespace may hold other bytes under the same key strings
        theirs = src.at(kv.blocks(len(src)))
        kv.fill(theirs)
        await kv.save(other, theirs)
        dst, source, before = kv.destination(src)
        await kv.load(mine, dst)
        kv.expect_loaded(source, before, src, dst, promise=Promise.NAMESPACE)

    async def test_lookup_needs_every_shard(self, kv: Harness) -> None:
        shards = ["tp0of2pp0", "tp1of2pp0"]
        sched = await kv.scheduler(shard=shards[0], shards=shards)
        layouts = [self.build_layout(kv.layout.is_block_granular()) for _ in shards]
        workers = [
            await kv.worker(shard=s, shards=shards, layout=lay)
            for s, lay in zip(shards, layouts, strict=True)
        ]
        # each rank holds its own slice: other bytes in other memory
        parts = [kv.chunks(2, partial=2, layout=layouts[0])]
        parts.append(parts[0].at(kv.blocks(2, layouts[1])))
        kv.fill(parts[1], layout=layouts[1])
        await kv.save(workers[0], parts[0], layouts[0])
        got = await sched.lookup(parts[0].keys)
        if got:
            violated(
                Promise.SHARDS,
                f"lookup found {got} chunk(s) when only shard {shards[0]} was saved",
                keys=parts[0].keys,
            )
        await kv.save(workers[1], parts[1], layouts[1])
        await kv.lookup(sched, parts[0].keys, 2)
        for w, part, lay in zip(workers, parts, layouts, strict=True):
            dst, source, before = kv.destination(part, lay)
            await kv.load(w, dst, lay)
            kv.expect_loaded(source, before, part, dst, layout=lay, promise=Promise.SHARDS)

    # -- another tensor-parallel size ---------------------------------------------
    async def test_engines_of_another_tp_size_load_each_others_chunks(self, kv: Harness) -> None:
        """What two TP=2 ranks saved, a TP=1 rank loads (each head from the rank holding
        it); what the TP=1 rank saved, each TP=2 rank loads its heads of."""
        sched = await kv.scheduler(kv_heads=4)
        if not type(sched).capabilities.reshape:
            pytest.skip("capabilities.reshape is not set")
        hnd = "HND" in kv.layout.describe()
        halves = [
            self.build_layout(kv.layout.is_block_granular(), hnd=hnd, heads=2) for _ in range(2)
        ]
        whole = self.build_layout(kv.layout.is_block_granular(), hnd=hnd, heads=4)
        shards = [shard_name(r, 2, 0) for r in range(2)]
        ranks = [
            await kv.worker(shard=s, shards=shards, layout=lay, tp=(r, 2), kv_heads=4)
            for r, (s, lay) in enumerate(zip(shards, halves, strict=True))
        ]
        one = await kv.worker(layout=whole, kv_heads=4)
        parts = [kv.chunks(2, partial=3, layout=halves[0])]
        parts.append(parts[0].at(kv.blocks(2, halves[1])))
        kv.fill(parts[1], layout=halves[1])
        for w, part, lay in zip(ranks, parts, halves, strict=True):
            await kv.save(w, part, lay)
        await self._load_other_size(kv, sched, one, whole, parts, halves, 2)
        src = kv.chunks(2, partial=3, layout=whole)
        await kv.save(one, src, whole)
        for r, (w, lay) in enumerate(zip(ranks, halves, strict=True)):
            rank_sched = await kv.scheduler(shard=shards[r], shards=shards, tp=(r, 2), kv_heads=4)
            await self._load_other_size(kv, rank_sched, w, lay, [src], [whole], 1, r * 2)

    async def _load_other_size(
        self,
        kv: Harness,
        sched: Transport,
        worker: Transport,
        layout: KVLayout,
        saved: list[Chunks],
        saved_layouts: list[KVLayout],
        size: int,
        first: int = 0,
    ) -> None:
        """Look up and load `saved` (each part one rank's of TP size `size`) into new blocks
        of `worker`; its heads must equal theirs from head `first` on."""
        ctx = worker.context
        keys = saved[0].keys
        shapes = other_shapes(4, ctx.tp_size, 1)
        found = await lookup_sources(sched, keys, shapes)
        if found != [size] * len(keys):
            violated(Promise.RESHAPE, f"lookup found {found} for chunks of TP={size}", keys=keys)
        dst = saved[0].at(kv.blocks(len(keys), layout))
        job, signalled = kv.load_job(dst, layout)
        try:
            await load_reshaped(worker, job, [size] * len(keys))
        except TransportError as exc:
            violated(Promise.RESHAPE, f"load raised {exc}", chunks=[exc.chunk], keys=keys)
        if signalled != list(range(layout.num_layers)):
            violated(Promise.RESHAPE, f"layers signalled {signalled}", keys=keys)
        per = layout.geometries[0].heads
        for h in range(per):
            rank, local = divmod(first + h, 4 // size)
            want = kv.heads(saved[rank], local, 1, saved_layouts[rank])
            if kv.heads(dst, h, 1, layout) != want:
                violated(Promise.RESHAPE, f"head {h} differs from what TP={size} saved", keys=keys)
