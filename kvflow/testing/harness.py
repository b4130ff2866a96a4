"""The conformance suites' harness: one test's view of the transport under test.

- `Harness` (what the suites' `kv` fixture yields): opens instances the way kvflow does
  (`scheduler()`, `worker()`: a worker is registered, and a peer transport's worker
  served), hands out real memory (`blocks`, `chunks`, `fill`, `copy`, `poison`,
  `snapshot`, `destination`), builds and runs jobs (`save_job`, `load_job`, `save`,
  `load`, `load_error`, `lookup`, `progress`) and checks every byte (`expect_loaded`,
  `round_trip`). A check that fails raises `ContractViolation` (`kvflow.testing.contract`).
- `Chunks`: one request's chunk keys, token counts and the blocks holding them.
- `GatedSave`: a save job whose layers the test hands over one at a time.
- `expect_none_stored`, `open_nursery`: a check that nothing of a save is visible, and a
  nursery whose lone `ContractViolation` is raised as itself.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import trio

from ..geometry.layout import KVLayout
from ..keys import ChunkKey, chunk_keys
from ..pd.context import PeerContext
from ..runtime import all_or_first_error
from ..transport import LoadJob, PeerSource, SaveJob, Transport, TransportContext, TransportError
from .contract import ContractViolation, Promise, violated

__all__ = ["Chunks", "GatedSave", "Harness", "expect_none_stored", "open_nursery"]


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
    await all_or_first_error(calls, ContractViolation)


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
class Harness:
    """One test's view of the transport under test: instances, memory, jobs, checks."""

    make: Callable[[TransportContext], Any]
    layout: KVLayout
    stack: contextlib.AsyncExitStack
    nursery: trio.Nursery
    """Runs each worker instance's `serve()`, as `kvflow.engine.worker.WorkerEngine` does."""
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
        tp: tuple[int, int] = (0, 1),
        kv_heads: int = 0,
    ) -> Transport:
        """A new opened instance (of TP rank `tp[0]` of `tp[1]`, over a model of `kv_heads`
        KV heads); on workers `register(layout)` follows `open()`."""
        ctx = PeerContext(  # a TransportContext, with what a peer transport needs too
            engine_id=f"conformance-engine-{next(self._engines)}",
            role=role,
            namespace=namespace or self.namespace,
            shard=shard,
            shards=list(shards or [shard]),
            tp_rank=tp[0],
            tp_size=tp[1],
            kv_heads=kv_heads,
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

    def heads(self, chunks: Chunks, first: int, count: int, layout: KVLayout) -> list[bytes]:
        """Each layer's bytes of heads `[first, first + count)` of `chunks`' blocks."""
        return [
            b"".join(
                bytes(s)
                for c in layout.head_spans(layer, chunks.blocks, chunks.token_counts, first, count)
                for s in c
            )
            for layer in range(layout.num_layers)
        ]

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
