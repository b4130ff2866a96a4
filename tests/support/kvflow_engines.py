"""The harness of the SchedulerEngine + WorkerEngine tests, driven the way the vLLM
connector drives them.

Real runtimes (one per engine side, as in vLLM's processes), the real `fs` transport
under a test's `store`, real (numpy) paged KV memory. The test thread plays vLLM:
scheduler calls (`lookup`), then the model runner's per-step hooks (`run_step`). The
`start_engine` and `store` fixtures (tests/conftest.py) build an `Engine` with
`engine_starter`; the transports here stand in for stores that hang, gate or fail.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import trio

from kvflow.config import KVFlowConfig
from kvflow.engine.metadata import WorkerPlan, decode_plan, encode_plan
from kvflow.engine.scheduler import ScheduledRequest, SchedulerEngine
from kvflow.engine.worker import WorkerEngine
from kvflow.geometry.layout import KVLayout
from kvflow.keys import ChunkKey, Fingerprint, chunk_keys
from kvflow.observe.events import Event, EventBus, LookupAnswered, Origin, TransferDone
from kvflow.runtime import Runtime
from kvflow.testing.layouts import fill_blocks, make_layout
from kvflow.transport import LoadJob, SaveJob, TransferStuck, Transport, TransportContext
from kvflow_fs import FsOptions, FsTransport

WAIT = 10.0
BS = 4
LAYERS = 2
NUM_BLOCKS = 16
SHARD = "tp0of1pp0"
PROMPT = list(range(500, 510))  # 10 tokens: chunks of 4, 4 and a partial 2
COUNTS = [4, 4, 2]

E = TypeVar("E", bound=Event)
T = TypeVar("T")
MakeRuntime = Callable[..., Runtime]
TransportFactory = Callable[[FsOptions, TransportContext], Transport]


# -- harness ---------------------------------------------------------------


class Recorder:
    """A bus subscriber the test thread can wait on (events arrive on the loop thread)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._cond = threading.Condition()

    def __call__(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def of(self, typ: type[E], req: str | None = None) -> list[E]:
        with self._cond:
            return [e for e in self.events if isinstance(e, typ) and req in (None, e.req)]

    def wait_for(self, typ: type[E], req: str | None = None, count: int = 1) -> E:
        """The first `typ` event (of `req`), once `count` of them have arrived."""
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.of(typ, req)) >= count, WAIT)
            seen = [type(e).__name__ for e in self.events]
        assert ok, f"no {count} {typ.__name__} for {req!r} within {WAIT}s; saw {seen}"
        return self.of(typ, req)[0]


class GatedFs(FsTransport):
    """`fs`, but a save first waits (in a worker thread) until the test releases it."""

    def __init__(self, options: FsOptions, context: TransportContext) -> None:
        super().__init__(options, context)
        self.entered = threading.Event()
        self.release = threading.Event()

    async def save(self, job: SaveJob) -> None:
        self.entered.set()
        await trio.to_thread.run_sync(self.release.wait, WAIT)
        await super().save(job)


class SlowEndFs(FsTransport):
    """`fs` whose load, once it has signalled every layer it will, ends (returns or
    raises) only when the test lets it."""

    def __init__(self, options: FsOptions, context: TransportContext) -> None:
        super().__init__(options, context)
        self.ending = threading.Event()
        self.may_end = threading.Event()

    async def load(self, job: LoadJob) -> None:
        try:
            await super().load(job)
        finally:
            self.ending.set()
            await trio.to_thread.run_sync(self.may_end.wait, WAIT)


class HangingTransport(Transport):
    """Claims every chunk, then never finishes moving any."""

    name = "hanging"

    def __init__(self, options: Any, context: TransportContext) -> None:
        super().__init__(options, context)
        self.cancelled = threading.Event()

    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        return len(keys)

    async def _forever(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.cancelled.set()

    async def save(self, job: SaveJob) -> None:
        await self._forever()

    async def load(self, job: LoadJob) -> None:
        await self._forever()


class StuckReadFs(FsTransport):
    """`fs` whose reads hang in the kernel (a hung network filesystem) until the test lets
    them go on: trio cannot cancel the thread, so the read lands whenever it returns."""

    def __init__(self, options: FsOptions, context: TransportContext) -> None:
        super().__init__(options, context)
        self.reading = threading.Event()
        self.unstick = threading.Event()

    def _read(self, *args: Any) -> Any:
        self.reading.set()
        self.unstick.wait(60.0)
        return super()._read(*args)


class StuckPeer(HangingTransport):
    """A load whose transfer could not be stopped (a NIXL READ still in flight)."""

    async def load(self, job: LoadJob) -> None:
        raise TransferStuck("a READ was still in flight after its end")


class CallSpyRuntime(Runtime):
    """A Runtime that flags when someone blocks on `call` (to order a test around it)."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.called = threading.Event()

    def call(self, async_fn: Callable[..., Awaitable[T]], *args: Any, timeout: float) -> T:
        self.called.set()
        return super().call(async_fn, *args, timeout=timeout)


@dataclass
class Engine:
    """One vLLM instance: a scheduler-side and a worker-side engine, each on its own runtime."""

    sched: SchedulerEngine
    worker: WorkerEngine
    layout: KVLayout
    namespace: str
    sched_events: Recorder
    worker_events: Recorder
    worker_transport: Transport
    block_size: int = BS

    def keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        return chunk_keys(self.namespace, tokens, self.block_size)


def transport_context(role: str, namespace: str, layout: KVLayout | None) -> TransportContext:
    return TransportContext(
        engine_id="test", role=role, namespace=namespace, shard=SHARD, shards=[SHARD], layout=layout
    )


def open_transport(rt: Runtime, transport: Transport) -> None:
    rt.call(transport.open, timeout=WAIT)
    rt.add_closer(transport.aclose)


def engine_starter(make_runtime: MakeRuntime, store: Path) -> Callable[..., Engine]:
    """`start(name, **options)`: one vLLM instance's scheduler- and worker-side engines,
    each on a runtime of `make_runtime`, storing into `store` (the `start_engine` fixture
    of tests/conftest.py)."""

    def start(
        name: str,
        *,
        config: KVFlowConfig | None = None,
        block_granular: bool = False,
        device: bool = False,
        worker_transport: TransportFactory = FsTransport,
        worker_clock: trio.abc.Clock | None = None,
        worker_runtime_cls: type[Runtime] = Runtime,
        block_size: int = BS,
        store_block_sizes: Sequence[int] = (),
        transport: Callable[[TransportContext], Transport] | None = None,
    ) -> Engine:
        """`transport(context)`: each side's transport instead of `fs`."""
        cfg = config or KVFlowConfig()
        layout = make_layout(
            num_layers=LAYERS,
            num_blocks=NUM_BLOCKS,
            block_size=block_size,
            block_granular=block_granular,
        )
        if device:  # a stand-in for a CUDA cache: tensors only kvflow.engine.staging copies from
            layout.memory = "cuda"
            layout.tensors = [torch.frombuffer(b, dtype=torch.uint8) for b in layout.buffers]
        ns = Fingerprint(
            model="kvflow-test",
            dtype="float32",
            block_size=0 if device else block_size,  # a device cache's chunks: token-major
            num_layers=LAYERS,
            layout=layout.describe(),
            bytes_per_token=0,
        ).namespace()
        options = FsOptions(path=str(store))

        srt = make_runtime(f"{name}-sched")
        sbus, srec = EventBus(Origin(name, "scheduler")), Recorder()
        sbus.subscribe(srec)
        sctx = transport_context("scheduler", ns, None)
        stransport = transport(sctx) if transport else FsTransport(options, sctx)
        open_transport(srt, stransport)
        sched = SchedulerEngine(
            config=cfg,
            transport=stransport,
            runtime=srt,
            bus=sbus,
            namespace=ns,
            block_size=block_size,
            store_block_sizes=store_block_sizes,
        )

        wrt = make_runtime(f"{name}-worker", cls=worker_runtime_cls, clock=worker_clock)
        wbus, wrec = EventBus(Origin(name, "worker")), Recorder()
        wbus.subscribe(wrec)
        wctx = transport_context("worker", ns, layout)
        wtransport = transport(wctx) if transport else worker_transport(options, wctx)
        open_transport(wrt, wtransport)
        worker = WorkerEngine(config=cfg, transport=wtransport, runtime=wrt, bus=wbus)
        worker.register(layout)
        return Engine(sched, worker, layout, ns, srec, wrec, wtransport, block_size)

    return start


def kill_loop(rt: Runtime, then: Callable[[], None] = lambda: None) -> None:
    """kvflow's loop dies: a BaseException escapes it, as no task's error does. `then`
    runs once it is on its way (e.g. letting a blocked thread go, which trio waits
    for); returns once the loop's thread ended."""
    loop = rt._loop
    assert loop is not None and loop.thread is not None

    def die() -> None:
        raise KeyboardInterrupt

    rt.submit(die)
    then()
    loop.thread.join(WAIT)
    assert not loop.thread.is_alive() and not rt.running, "kvflow's loop did not die"


@contextmanager
def loop_held(rt: Runtime) -> Iterator[None]:
    """Park the loop thread in a callback, so work handed in meanwhile cannot start yet."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(WAIT)

    rt.submit(hold)
    assert entered.wait(WAIT)
    try:
        yield
    finally:
        release.set()


def lookup(e: Engine, req: str, tokens: Sequence[int], num_computed: int = 0) -> int:
    """vLLM's get_num_new_matched_tokens: 'ask again' while the lookup runs, then a count."""
    with loop_held(e.sched.runtime):
        e.sched.add_request(req, tokens)
        assert e.sched.lookup(req, num_computed) is None
        assert e.sched.lookup(req, num_computed) is None  # asking again is side-effect free
    e.sched_events.wait_for(LookupAnswered, req)
    n = e.sched.lookup(req, num_computed)
    assert n is not None
    return n


def run_step(e: Engine, plan: WorkerPlan, check_layer: Callable[[int], None] | None = None) -> None:
    """The model runner's forward: bind, then per layer wait for loads, compute, save hook."""
    w = e.worker
    w.bind(decode_plan(encode_plan(plan)))  # the plan crosses a process boundary in vLLM
    for layer in range(LAYERS):
        w.wait_layer(layer)
        if check_layer is not None:
            check_layer(layer)
        w.layer_computed(layer)
    w.end_step()


def prefill_cold(e: Engine, req: str, tokens: Sequence[int], blocks: list[int]) -> WorkerPlan:
    """A cold request's prefill step: nothing to load, the whole prompt to save."""
    assert lookup(e, req, tokens) == 0
    e.sched.allocated(req, blocks, 0)
    plan = e.sched.plan(
        [ScheduledRequest(req, 0, len(tokens), blocks, replace_blocks=True, token_ids=tokens)]
    )
    assert plan.loads == []
    fill_blocks(e.layout, blocks, seed=len(req) * 7 + blocks[0])  # "the forward computes KV"
    return plan


def save_prompt(e: Engine, req: str, tokens: Sequence[int], blocks: list[int]) -> None:
    run_step(e, prefill_cold(e, req, tokens, blocks))
    done = e.worker_events.wait_for(TransferDone, req)
    assert done.direction == "save"


def block_bytes(layout: KVLayout, layer: int, block: int, tokens: int = BS) -> bytes:
    return b"".join(bytes(s) for s in layout.spans(layer, block, tokens))


def stored_files(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*") if p.is_file())
