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
  `kvflow.worker.WorkerEngine.register` does when vLLM registers its caches;
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
chunk indexes, keys and block ids involved. Promises are listed in `Promise`.
Nothing here sleeps to synchronise: every ordering is forced with
`trio.Event`s; a few waits for the transport's own progress are bounded by
`TransportConformance.progress_timeout_s` (real time) so a hung transport
fails with a message instead of hanging the run.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn

import numpy as np
import pytest
import trio
import trio.testing

from ..keys import ChunkKey, chunk_keys
from ..layout import KVLayout
from ..transport import LoadJob, PeerSource, SaveJob, Transport, TransportContext, TransportError
from .contract import ContractViolation, Promise, violated
from .layouts import make_layout

__all__ = [
    "Chunks",
    "ContractViolation",
    "GatedSave",
    "Harness",
    "Promise",
    "TransportConformance",
    "violated",
]


async def expect_none_stored(sched: Transport, src: Chunks, promise: str, when: str) -> None:
    """`promise` holds only if `lookup` finds none of `src`'s chunks (`when`: the moment)."""
    got = await sched.lookup(src.keys)
    if got:
        violated(
            promise,
            f"lookup found {got} chunk(s) {when}",
            keys=src.keys[:got],
            block_ids=src.blocks[:got],
        )


# -- chunks and memory ---------------------------------------------------------


@dataclass
class Chunks:
    """Chunks of one request: keys, token counts, and the blocks holding them."""

    keys: list[ChunkKey]
    token_counts: list[int]
    blocks: list[int]

    def __len__(self) -> int:
        return len(self.keys)

    def at(self, blocks: Sequence[int]) -> Chunks:
        """The same chunks, held in other blocks (a load's destination)."""
        return Chunks(self.keys, self.token_counts, list(blocks))

    def __add__(self, other: Chunks) -> Chunks:
        return Chunks(
            self.keys + other.keys,
            self.token_counts + other.token_counts,
            self.blocks + other.blocks,
        )

    def take(self, index: Sequence[int]) -> Chunks:
        return Chunks(
            [self.keys[i] for i in index],
            [self.token_counts[i] for i in index],
            [self.blocks[i] for i in index],
        )


def _spans(layout: KVLayout, layer: int, chunks: Chunks) -> list[list[memoryview]]:
    return layout.chunk_spans(layer, chunks.blocks, chunks.token_counts)


def _span_ranges(layout: KVLayout, layer: int, num_tokens: int) -> list[tuple[int, int]]:
    """Byte ranges, relative to a block's start, of the spans of `num_tokens` tokens."""
    return [(off, off + n) for off, n in layout.geometries[layer].runs(num_tokens)]


def _locate(layout: KVLayout, layer: int, index: int) -> tuple[int | None, int]:
    """The block holding byte `index` of a layer's buffer, and the byte's offset from the
    block's start (as `_span_ranges` counts it); `None` if no block holds it."""
    g = layout.geometries[layer]
    for b in range(g.num_blocks):
        rel = index - b * g.block_stride
        if any(lo <= rel < hi for lo, hi in _span_ranges(layout, layer, layout.block_size)):
            return b, rel
    return None, index


def _shadow(layout: KVLayout, buffers: Sequence[bytes]) -> KVLayout:
    """A writable copy of `layout` over copies of `buffers`."""
    return KVLayout(
        names=list(layout.names),
        geometries=list(layout.geometries),
        buffers=[memoryview(bytearray(b)) for b in buffers],
        memory=layout.memory,
        block_size=layout.block_size,
    )


def _fill_layer(
    layout: KVLayout, layer: int, blocks: Iterable[int], rng: np.random.Generator
) -> None:
    for b in blocks:
        for span in layout.spans(layer, b, layout.block_size):
            span[:] = rng.integers(0, 256, len(span), dtype=np.uint8).tobytes()


def _as_array(buf: memoryview | bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


async def _all(calls: Iterable[Callable[[], Awaitable[Any]]]) -> None:
    """Run the calls concurrently; the first `ContractViolation` cancels the others and is
    re-raised as itself (not wrapped in an exception group)."""
    violations: list[ContractViolation] = []

    async def run(call: Callable[[], Awaitable[Any]]) -> None:
        try:
            await call()
        except ContractViolation as exc:
            violations.append(exc)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for call in calls:
            nursery.start_soon(run, call)
    if violations:
        raise violations[0]


@contextlib.contextmanager
def _single_errors() -> Iterator[None]:
    """Re-raise a lone exception out of a nursery's group as itself, so a failing check
    reads as its `ContractViolation`, not as an exception group."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


@contextlib.asynccontextmanager
async def open_nursery() -> AsyncIterator[trio.Nursery]:
    """A trio nursery whose lone failure (a `ContractViolation`) is raised as itself."""
    with _single_errors():
        async with trio.open_nursery() as nursery:
            yield nursery


# -- the harness -----------------------------------------------------------------


def _explain(
    layout: KVLayout, layer: int, diff: Any, src: Chunks, dst: Chunks, promise: str
) -> NoReturn:
    """Name the block, chunk and key where a loaded layer differs from what was saved."""
    block, offset = _locate(layout, layer, int(diff[0]))
    changed = f"{len(diff)} bytes of the layer differ"
    if block not in dst.blocks:
        violated(
            promise,
            f"layer {layer}: block {block} changed at byte {offset} of the block, "
            f"though no chunk of the load targets it ({changed})",
            block_ids=[block] if block is not None else [],
        )
    c = dst.blocks.index(block)
    ranges = _span_ranges(layout, layer, dst.token_counts[c])
    what = (
        "holds other bytes than were saved"
        if any(lo <= offset < hi for lo, hi in ranges)
        else f"was written outside the spans of its {dst.token_counts[c]} tokens"
    )
    violated(
        promise,
        f"layer {layer}: destination block {block} {what} (first difference at byte "
        f"{offset} of the block; {changed}); saved from block {src.blocks[c]}",
        chunks=[c],
        keys=[dst.keys[c]],
        block_ids=[block],
    )


@dataclass
class Harness:  # ~360 lines: every test's vocabulary (workers, chunks, jobs, checks) in
    # one place, so that each promise's test reads as the promise
    """One test's view of the transport under test: instances, memory, jobs, checks."""

    make: Callable[[TransportContext], Any]
    layout: KVLayout
    stack: contextlib.AsyncExitStack
    nursery: trio.Nursery
    """Runs each worker instance's `serve()`, as `kvflow.worker.WorkerEngine` does."""
    namespace: str = "conformance-ns-a"
    progress_timeout_s: float = 10.0
    _next_block: dict[int, int] = field(default_factory=dict)
    _seeds: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _engines: itertools.count[int] = field(default_factory=itertools.count)
    _closed: set[int] = field(default_factory=set)
    _serving: dict[int, Callable[[], Awaitable[None]]] = field(default_factory=dict)

    # -- instances -------------------------------------------------------------
    async def open(
        self,
        role: str = "worker",
        *,
        namespace: str | None = None,
        shard: str = "tp0of1pp0",
        shards: Sequence[str] | None = None,
        layout: KVLayout | None = None,
    ) -> Transport:
        """A new opened instance; on workers `register(layout)` follows `open()`."""
        ctx = TransportContext(
            engine_id=f"conformance-engine-{next(self._engines)}",
            role=role,
            namespace=namespace or self.namespace,
            shard=shard,
            shards=list(shards or [shard]),
        )
        made = self.make(ctx)
        transport = await made if inspect.isawaitable(made) else made
        if not isinstance(transport, Transport):
            raise TypeError(
                "make_transport(context) must return a kvflow.transport.Transport, "
                f"got {type(transport).__name__}"
            )
        await transport.open()
        self.stack.push_async_callback(self.close, transport)
        if role == "worker":
            await transport.register(layout or self.layout)
            if type(transport).capabilities.peer:
                self._serving[id(transport)] = await self.nursery.start(self._serve, transport)
        return transport

    async def _serve(
        self, transport: Transport, *, task_status: trio.TaskStatus[Callable[[], Awaitable[None]]]
    ) -> None:
        stopped = trio.Event()

        async def stop() -> None:
            scope.cancel()
            await stopped.wait()

        with trio.CancelScope() as scope:
            task_status.started(stop)
            try:
                await transport.serve()
            finally:
                stopped.set()

    async def close(self, transport: Transport) -> None:
        """`aclose()` an instance now (a process going away); the end of the test skips it."""
        if id(transport) not in self._closed:
            self._closed.add(id(transport))
            if stop := self._serving.pop(id(transport), None):
                await stop()
            await transport.aclose()

    async def scheduler(self, **kw: Any) -> Transport:
        return await self.open("scheduler", **kw)

    async def worker(self, **kw: Any) -> Transport:
        return await self.open("worker", **kw)

    # -- memory ----------------------------------------------------------------
    def blocks(self, n: int, layout: KVLayout | None = None) -> list[int]:
        """`n` block ids of `layout` no earlier call returned."""
        layout = layout or self.layout
        first = self._next_block.get(id(layout), 0)
        total = layout.geometries[0].num_blocks
        if first + n > total:
            raise RuntimeError(f"test layout has only {total} blocks; raise num_blocks")
        self._next_block[id(layout)] = first + n
        return list(range(first, first + n))

    def chunks(
        self,
        n: int,
        *,
        partial: int = 0,
        layout: KVLayout | None = None,
        fill: bool = True,
    ) -> Chunks:
        """`n` chunks of fresh random tokens (the last holding `partial` tokens, if set),
        keyed with `kvflow.keys.chunk_keys`, in new blocks filled with random bytes."""
        layout = layout or self.layout
        bs = layout.block_size
        seed = next(self._seeds)
        rng = np.random.default_rng(seed)
        num_tokens = n * bs - (bs - partial if partial else 0)
        tokens = rng.integers(0, 32000, num_tokens).tolist()
        keys = chunk_keys(f"conformance-{seed}", tokens, bs)
        counts = [bs] * n
        if partial:
            counts[-1] = partial
        chunks = Chunks(keys, counts, self.blocks(n, layout))
        if fill:
            self.fill(chunks, layout=layout)
        return chunks

    def fill(
        self, chunks: Chunks, *, layout: KVLayout | None = None, layer: int | None = None
    ) -> None:
        """Random bytes into every block of `chunks` (one layer, or all)."""
        layout = layout or self.layout
        rng = np.random.default_rng(next(self._seeds))
        layers = range(layout.num_layers) if layer is None else [layer]
        for i in layers:
            _fill_layer(layout, i, chunks.blocks, rng)

    def copy(self, src: Chunks, dst: Chunks, *, layout: KVLayout | None = None) -> None:
        """Copy the whole blocks of `src` into those of `dst`."""
        layout = layout or self.layout
        for layer in range(layout.num_layers):
            for s, d in zip(src.blocks, dst.blocks, strict=True):
                for out, inp in zip(
                    layout.spans(layer, d, layout.block_size),
                    layout.spans(layer, s, layout.block_size),
                    strict=True,
                ):
                    out[:] = inp

    def poison(self, blocks: Sequence[int], *, layout: KVLayout | None = None) -> None:
        """Overwrite whole blocks with a sentinel pattern (0xA5)."""
        layout = layout or self.layout
        for layer in range(layout.num_layers):
            for b in blocks:
                for span in layout.spans(layer, b, layout.block_size):
                    span[:] = b"\xa5" * len(span)

    def snapshot(self, layout: KVLayout | None = None) -> list[bytes]:
        return [bytes(b) for b in (layout or self.layout).buffers]

    def destination(
        self, src: Chunks, layout: KVLayout | None = None
    ) -> tuple[Chunks, list[bytes], list[bytes]]:
        """New poisoned blocks to load `src` into, with snapshots of the memory before the
        poison (`source`) and after it (`before`), as `expect_loaded` takes them."""
        source = self.snapshot(layout)
        dst = src.at(self.blocks(len(src), layout))
        self.poison(dst.blocks, layout=layout)
        return dst, source, self.snapshot(layout)

    # -- jobs ------------------------------------------------------------------
    def save_job(self, chunks: Chunks, layout: KVLayout | None = None) -> SaveJob:
        layout = layout or self.layout

        async def layer_spans(layer: int) -> list[list[memoryview]]:
            await trio.lowlevel.checkpoint()
            return _spans(layout, layer, chunks)

        return SaveJob(
            "conformance-save", chunks.keys, chunks.token_counts, layout.num_layers, layer_spans
        )

    def load_job(
        self,
        chunks: Chunks,
        layout: KVLayout | None = None,
        on_layer: Callable[[int], None] | None = None,
        source: PeerSource | None = None,
    ) -> tuple[LoadJob, list[int]]:
        """A load of `chunks` into their blocks (pulled from `source`, for peer
        transports), and the list of layer_loaded calls."""
        layout = layout or self.layout
        signalled: list[int] = []

        def layer_loaded(layer: int) -> None:
            signalled.append(layer)
            if on_layer is not None:
                on_layer(layer)

        job = LoadJob(
            "conformance-load",
            chunks.keys,
            chunks.token_counts,
            layout.num_layers,
            lambda layer: _spans(layout, layer, chunks),
            layer_loaded,
            source,
            list(chunks.blocks),
        )
        return job, signalled

    async def save(
        self,
        transport: Transport,
        chunks: Chunks,
        layout: KVLayout | None = None,
        *,
        job: SaveJob | None = None,
    ) -> None:
        """Save `chunks` (with `job`, or a plain job over their blocks), expecting success."""
        try:
            await transport.save(job or self.save_job(chunks, layout))
        except Exception as exc:
            violated(
                Promise.SAVE,
                f"save raised {type(exc).__name__}: {exc}",
                keys=chunks.keys,
                block_ids=chunks.blocks,
            )

    async def load(
        self, transport: Transport, chunks: Chunks, layout: KVLayout | None = None
    ) -> list[int]:
        """Load `chunks` expecting success; returns the layer_loaded calls."""
        job, signalled = self.load_job(chunks, layout)
        try:
            await transport.load(job)
        except Exception as exc:
            violated(
                Promise.LOAD,
                f"load of chunks that were saved raised {type(exc).__name__}: {exc}",
                chunks=[exc.chunk] if isinstance(exc, TransportError) else [],
                keys=chunks.keys,
                block_ids=chunks.blocks,
            )
        return signalled

    async def load_error(
        self, transport: Transport, chunks: Chunks, layout: KVLayout | None = None
    ) -> TransportError:
        """Load `chunks` expecting a `TransportError`; returns it."""
        job, _ = self.load_job(chunks, layout)
        try:
            await transport.load(job)
        except TransportError as exc:
            return exc
        except Exception as exc:
            violated(
                Promise.LOAD_ERROR,
                f"raised {type(exc).__name__} ({exc}), not a TransportError",
                keys=chunks.keys,
                block_ids=chunks.blocks,
            )
        violated(
            Promise.LOAD_ERROR,
            "load returned normally although not every chunk was stored",
            keys=chunks.keys,
            block_ids=chunks.blocks,
        )

    async def lookup(self, transport: Transport, keys: Sequence[ChunkKey], expect: int) -> None:
        got = await transport.lookup(list(keys))
        if got != expect:
            violated(
                Promise.LOOKUP,
                f"lookup of {len(keys)} keys returned {got}, expected {expect}",
                keys=keys,
            )

    async def progress(self, event: trio.Event, what: str, promise: str, chunks: Chunks) -> None:
        """Wait for the transport to make progress, failing after `progress_timeout_s`."""
        with trio.move_on_after(self.progress_timeout_s):
            await event.wait()
            return
        violated(
            promise,
            f"{what} did not happen within {self.progress_timeout_s} s",
            keys=chunks.keys,
            block_ids=chunks.blocks,
        )

    # -- checks ----------------------------------------------------------------
    def expect_loaded(
        self,
        source: Sequence[bytes],
        before: Sequence[bytes],
        src: Chunks,
        dst: Chunks,
        *,
        layers: Iterable[int] | None = None,
        layout: KVLayout | None = None,
        unspecified: Iterable[int] = (),
        promise: str = Promise.LOAD,
    ) -> None:
        """Check that the buffers of `layout` equal `before` with every span of each `dst`
        chunk replaced by the same span of its `src` chunk as it was in `source`.

        Blocks in `unspecified` (those of chunks a failed load did not deliver) may hold
        anything."""
        layout = layout or self.layout
        src_view = _shadow(layout, source)
        expected = _shadow(layout, before)
        layers = range(layout.num_layers) if layers is None else list(layers)
        unspecified = list(unspecified)
        for layer in layers:
            for s, d, n in zip(src.blocks, dst.blocks, dst.token_counts, strict=True):
                for out, inp in zip(
                    expected.spans(layer, d, n), src_view.spans(layer, s, n), strict=True
                ):
                    out[:] = inp
            for b in unspecified:
                for out, inp in zip(
                    expected.spans(layer, b, layout.block_size),
                    layout.spans(layer, b, layout.block_size),
                    strict=True,
                ):
                    out[:] = inp
            got = _as_array(layout.buffers[layer])
            diff = np.flatnonzero(got != _as_array(expected.buffers[layer]))
            if not len(diff):
                continue
            _explain(layout, layer, diff, src, dst, promise)

    async def round_trip(
        self,
        saver: Transport,
        loader: Transport,
        src: Chunks,
        *,
        layout: KVLayout | None = None,
    ) -> None:
        """Save `src`, poison it, load into new blocks, and check every byte."""
        layout = layout or self.layout
        dst = src.at(self.blocks(len(src), layout))
        self.poison(dst.blocks, layout=layout)
        await self.save(saver, src, layout)
        source = self.snapshot(layout)
        # a transport must have copied the bytes when save returns: vLLM reuses the blocks
        self.poison(src.blocks, layout=layout)
        before = self.snapshot(layout)
        await self.load(loader, dst, layout)
        self.expect_loaded(source, before, src, dst, layout=layout)


class GatedSave:
    """A SaveJob whose `layer(i)` waits until the test calls `give(i)`.

    `give(i)` writes the final bytes of layer i into the source blocks (they hold
    other, "stale" bytes until then; `fill=False` keeps the bytes as they are),
    then lets `layer(i)` return.
    """

    def __init__(
        self, kv: Harness, chunks: Chunks, layout: KVLayout | None = None, *, fill: bool = True
    ) -> None:
        self.kv = kv
        self.chunks = chunks
        self.fill = fill
        self.layout = layout or kv.layout
        n = self.layout.num_layers
        self.gates = [trio.Event() for _ in range(n)]
        self.asked = [trio.Event() for _ in range(n)]
        """`asked[i]` is set once the transport asked for layer i or a later one."""
        self.returned: list[int] = []
        self.job = SaveJob(
            "conformance-gated", chunks.keys, chunks.token_counts, n, self._layer_spans
        )

    async def _layer_spans(self, layer: int) -> list[list[memoryview]]:
        for event in self.asked[: layer + 1]:
            event.set()
        await self.gates[layer].wait()
        self.returned.append(layer)
        return _spans(self.layout, layer, self.chunks)

    async def wait_asked(self, layer: int) -> None:
        await self.kv.progress(
            self.asked[layer],
            f"save asking for layer {layer} (job.layer({layer}))",
            Promise.SAVE,
            self.chunks,
        )

    def give(self, layer: int) -> None:
        if self.fill:
            self.kv.fill(self.chunks, layout=self.layout, layer=layer)
        self.gates[layer].set()


# -- the suite -------------------------------------------------------------------

LAYOUT_KINDS = ["token", "hnd", "block"]
"""NHD planes (one K and one V run per token), HND planes (one per K/V head) and
vLLM's CPU cache (blocks packed, block-granular)."""


class ConformanceSuite:
    """What the store and peer suites share: the `make_transport` seam, layouts, harness."""

    pytestmark: ClassVar = pytest.mark.trio

    num_layers: ClassVar[int] = 3
    block_size: ClassVar[int] = 4
    num_blocks: ClassVar[int] = 64
    large_block_layers: ClassVar[int] = 2
    """The large-block test uses blocks of 2 MiB per layer (4 MiB per block over 2 layers)."""
    progress_timeout_s: ClassVar[float] = 10.0

    # -- fixtures --------------------------------------------------------------
    @pytest.fixture
    def make_transport(self) -> Callable[[TransportContext], Any]:
        raise NotImplementedError(
            f"subclass {type(self).__name__} and define a `make_transport` fixture returning "
            "a callable context -> unopened Transport (see kvflow.testing.conformance)"
        )

    @pytest.fixture(params=LAYOUT_KINDS)
    def layout(self, request: pytest.FixtureRequest) -> KVLayout:
        return self.build_layout(request.param == "block", hnd=request.param == "hnd")

    def build_layout(self, block_granular: bool, **kw: Any) -> KVLayout:
        """A test layout of this suite's geometry; `kw` overrides `make_layout` arguments."""
        args: dict[str, Any] = {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "block_granular": block_granular,
        }
        args.update(kw)
        return make_layout(**args)

    def large_layout(self, like: KVLayout) -> KVLayout:
        """Blocks of 256 tokens x 8 heads x 128 dims: 2 MiB per layer and block (float32,
        K and V), granular as `like`."""
        return self.build_layout(
            like.is_block_granular(),
            num_layers=self.large_block_layers,
            num_blocks=4,
            block_size=256,
            heads=8,
            head_dim=128,
        )

    @pytest.fixture
    async def kv(
        self, make_transport: Callable[[TransportContext], Any], layout: KVLayout
    ) -> AsyncIterator[Harness]:
        async with self.harness(make_transport, layout) as harness:
            yield harness

    @contextlib.asynccontextmanager
    async def harness(
        self, make_transport: Callable[[TransportContext], Any], layout: KVLayout
    ) -> AsyncIterator[Harness]:
        """What the `kv` fixture yields; skips transports the suite does not apply to."""
        skip = ""
        with _single_errors():
            async with trio.open_nursery() as nursery, contextlib.AsyncExitStack() as stack:
                harness = Harness(
                    make_transport,
                    layout,
                    stack,
                    nursery,
                    progress_timeout_s=self.progress_timeout_s,
                )
                probe = await harness.scheduler()
                skip = self.skip_reason(type(probe))
                if not skip:
                    yield harness
        if skip:
            pytest.skip(skip)

    def skip_reason(self, cls: type[Transport]) -> str:
        """Why this suite does not apply to transports of class `cls` ("" if it does)."""
        if "cpu" not in cls.capabilities.memory:
            return f"{cls.__name__} does not move cpu memory"
        return ""


class TransportConformance(ConformanceSuite):  # ~420 lines: one test per promise of the
    # contract; pytest collects them from this class
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
