"""Worker-side flows: every load and save is a trio task with its own deadline.

vLLM's model-runner thread calls in through the connector adapter:
`bind` (a step's plan), `wait_layer` (attention is about to read layer i),
`layer_computed` (layer i's KV is final), `end_step`, `take_results`. Those
calls hand work to the runtime and return; the only waits are the ones the
contract demands (layer i's load before attention reads it, preemption before
blocks are reused), each bounded by a timeout.

Flows report through a lock-protected `TransferResults`; a failed load's
block ids are recorded before (or with) its completion, so vLLM always learns
which blocks to recompute no later than it learns the load ended.

No load's blocks go back to vLLM while something may still write into them. A
load that cannot be stopped (a read stuck in the kernel on a hung network
filesystem, a READ still in flight after its cancellation: `TransferStuck`)
ends the engine with `KVFlowFatal` instead, raised in vLLM's thread at its next
call: a late write into a block vLLM recomputes or reuses would be wrong KV.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from .config import KVFlowConfig
from .events import (
    BlocksReleased,
    CachesRegistered,
    EventBus,
    LayerComputed,
    LayerLoaded,
    LoadStarted,
    SaveStarted,
    StepBound,
    TransferDone,
    TransferFailed,
)
from .keys import ChunkKey
from .layout import KVLayout, LayoutError
from .lending import Lending
from .metadata import LoadSpec, OfferSpec, SaveSpec, WorkerPlan
from .runtime import Runtime, poll_until
from .staging import HostStage, event_done, mark
from .transport import (
    ChunkMissing,
    LoadJob,
    Offer,
    SaveJob,
    TransferStuck,
    Transport,
    TransportError,
)

__all__ = ["KVFlowFatal", "TransferResults", "WorkerEngine"]

log = logging.getLogger("kvflow.worker")

STOP_GRACE_S = 5.0
"""How long past `load_timeout_s` vLLM's thread waits for a load to stop before it
gives up on it (and, if the loop still runs, on the engine)."""


class KVFlowFatal(RuntimeError):
    """kvflow cannot go on without risking wrong KV: the engine must stop."""


LayerReady = Callable[[], bool]
"""Polled until True before a computed layer is read (e.g. a CUDA event's query)."""


@dataclass
class TransferResults:
    """One step's snapshot of completions, in vLLM's terms."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    error_block_ids: set[int] = field(default_factory=set)


@dataclass
class ChunkOutcomes:
    """What became of chunks since the last `take_chunk_outcomes`: stored by a save, not
    stored (the save failed or was dropped), deleted by the store to make room."""

    saved: list[ChunkKey] = field(default_factory=list)
    unsaved: list[ChunkKey] = field(default_factory=list)
    evicted: list[ChunkKey] = field(default_factory=list)


def _snapshot(spans: list[memoryview]) -> list[memoryview]:
    return [memoryview(bytes(s)) for s in spans]


class _LayerGate:
    """Synchronous loads still owed per layer this step; vLLM's thread waits on it."""

    def __init__(self, num_layers: int, pending: int, after: Any = None) -> None:
        self.after = after
        """Staging: an event on vLLM's stream at bind, which device writes follow."""
        self.events = [threading.Event() for _ in range(num_layers)]
        self.remaining = [pending] * num_layers
        self.unsettled = pending
        self.settled = threading.Event()
        """Set once every load has recorded its outcome (its error blocks included)."""
        if pending == 0:
            for ev in self.events:
                ev.set()
            self.settled.set()

    def loaded(self, layer: int) -> None:
        self.remaining[layer] -= 1
        if self.remaining[layer] <= 0:
            self.events[layer].set()

    def wait(self, layer: int, timeout: float) -> bool:
        ev = self.events[layer]
        return ev.is_set() or ev.wait(timeout)

    def load_settled(self) -> None:
        self.unsettled -= 1
        if self.unsettled <= 0:
            self.settled.set()


class _Step:
    """Trio-side record of a step that saves: which layers are final."""

    def __init__(self, num_layers: int, saves: int) -> None:
        self.computed = [trio.Event() for _ in range(num_layers)]
        self.ready: list[LayerReady | None] = [None] * num_layers
        self.saves_left = saves

    async def wait_computed(self, layer: int) -> None:
        await self.computed[layer].wait()
        ready = self.ready[layer]
        if ready is not None:
            await poll_until(ready)


class WorkerEngine:
    """Runs a worker's transfers on its runtime."""

    def __init__(
        self,
        *,
        config: KVFlowConfig,
        transport: Transport,
        runtime: Runtime,
        bus: EventBus,
        report_chunks: bool = False,
    ) -> None:
        """`report_chunks`: keep what became of each saved chunk for
        `take_chunk_outcomes` (vLLM's KV events)."""
        self.config = config
        self.transport = transport
        self.runtime = runtime
        self.bus = bus
        self.layout: KVLayout | None = None
        self.staged = False
        """The cache is device memory the transport cannot move: jobs go through host
        memory (`kvflow.staging`)."""
        self._gate = _LayerGate(0, 0)
        self._step = 0
        self._step_saves = False
        self._step_load_blocks: set[int] = set()
        self._lock = threading.Lock()
        self._results = TransferResults()
        self._fatal = ""
        """Why the engine must stop (set once, by a load that could not be stopped)."""
        self._async_deadlines: dict[str, float] = {}
        """Asynchronous loads running: request -> when vLLM's thread gives up on them."""
        self._now = time.monotonic
        """vLLM's thread's clock for those deadlines (tests move it)."""
        self._lending = Lending(lambda req: self.bus.emit(BlocksReleased(req=req)))
        """Whose blocks kvflow uses, and when vLLM may have them back."""
        # vLLM-thread state: what vLLM still waits for, should the loop die
        self._open_async: dict[str, list[int]] = {}
        self._gone = False
        # loop-thread state
        self._steps: dict[int, _Step] = {}
        self._limiters: dict[str, trio.CapacityLimiter] = {}
        self._outcomes = ChunkOutcomes() if report_chunks else None

    # -- vLLM thread -------------------------------------------------------
    def register(self, layout: KVLayout) -> None:
        caps = self.transport.capabilities
        self.staged = layout.memory not in caps.memory
        if self.staged and ("cpu" not in caps.memory or caps.peer or not layout.tensors):
            raise LayoutError(
                f"kvflow: the KV cache is in {layout.memory} memory; transport "
                f"{self.transport.name!r} moves {', '.join(sorted(caps.memory))} memory only"
                + (" (peer transports are not staged through host memory)" if caps.peer else "")
            )
        if self.staged:
            log.info(
                "kvflow: %s moves host memory; staging the %s KV cache through pinned host buffers",
                self.transport.name,
                layout.memory,
            )
        self.layout = layout
        self.runtime.call(self.transport.register, layout, timeout=60.0)
        if self.transport.capabilities.peer:
            self.runtime.spawn(self.transport.serve, name=f"{self.transport.name}:serve")
        nbytes = layout.nbytes_registered
        self.runtime.submit(
            self.bus.emit,
            CachesRegistered(
                num_layers=layout.num_layers,
                nbytes=nbytes,
                memory=layout.memory,
                layout=layout.describe(),
            ),
        )

    def bind(self, plan: WorkerPlan) -> None:
        """Start this step's transfers. Returns at once."""
        self._check_fatal()
        layout = self._require_layout() if (plan.loads or plan.saves) else self.layout
        sync_loads = sum(not spec.asynchronous for spec in plan.loads)
        after = mark(layout) if self.staged and layout and plan.loads else None
        self._gate = _LayerGate(layout.num_layers if layout else 0, sync_loads, after)
        self._step = plan.step
        self._step_saves = bool(plan.saves)
        self._step_load_blocks = {
            b for spec in plan.loads if not spec.asynchronous for b in spec.block_ids
        }
        self._open_async.update((s.req, list(s.block_ids)) for s in plan.loads if s.asynchronous)
        if plan.reused:
            self._fence(plan.reused)
        self._lending.bound(plan.lent, (save.block_ids for save in plan.saves))
        if not self.runtime.running:  # the loop died: nothing will run this plan
            self._loop_gone()
        elif not plan.is_empty():
            self.runtime.submit(self._on_bind, plan, self._gate)

    def _fence(self, reused: list[int]) -> None:
        """Wait, at most `preempt_timeout_s`, until no save reads a block vLLM reuses
        now; a save still reading one then is cancelled and stores nothing."""
        busy = self._lending.busy(reused)
        if not busy or not self.runtime.running:
            return
        try:
            self.runtime.call(self._lending.idle, busy, timeout=self.config.preempt_timeout_s)
        except TimeoutError:
            log.warning(
                "kvflow: saves still read blocks %s that vLLM reuses, after "
                "preempt_timeout_s=%s; they are cancelled and store nothing",
                sorted(busy),
                self.config.preempt_timeout_s,
            )
            self.runtime.submit(self._lending.cancel_over, busy, "vLLM reused its blocks")

    def wait_layer(self, layer: int) -> None:
        """Block until this step's synchronous loads of `layer` have landed (or failed)."""
        gate = self._gate
        if layer < len(gate.events) and not gate.wait(
            layer, self.config.load_timeout_s + STOP_GRACE_S
        ):
            self._give_up_on_step_loads(f"layer {layer}'s load")
        self._check_fatal()

    def layer_computed(self, layer: int, ready: LayerReady | None = None) -> None:
        """vLLM finished writing `layer` for this step; saves of it may start."""
        if self._step_saves:
            self.runtime.submit(self._on_layer_computed, self._step, layer, ready)

    def end_step(self) -> None:
        """The forward is over: every layer is final, every synchronous load settled."""
        if self._step_saves:
            # staged saves copy on their own stream: layers vLLM did not report must
            # wait for what its stream queued up to here
            done = mark(self.layout) if self.staged and self.layout else None
            self.runtime.submit(self._on_step_end, self._step, done and done.query)
        self.settle_loads()

    def settle_loads(self) -> None:
        """Block until every synchronous load of this step has landed or failed, so its
        errors are in the results (not just every layer's gate). vLLM reads them after
        `end_step` (V1 runner) or, when Model Runner V2 defers `end_step` past the
        speculator, before it: the adapter calls this before handing out results."""
        if not self._gate.settled.wait(self.config.load_timeout_s + STOP_GRACE_S):
            self._give_up_on_step_loads("this step's loads")
        self._check_fatal()

    def take_results(self) -> TransferResults:
        """Completions since the last call (each reported exactly once)."""
        self._check_fatal()
        now = self._now()
        with self._lock:
            stuck = [req for req, t in self._async_deadlines.items() if t < now]
        if stuck and self.runtime.running:
            self._stop(f"the asynchronous load of {stuck[0]} did not stop")
        if not self.runtime.running:
            self._loop_gone()
        with self._lock:
            snap = self._results
            self._results = TransferResults(error_block_ids=snap.error_block_ids)
        snap.error_block_ids = set()  # those are taken by take_error_blocks
        snap.finished_sending |= self._lending.take_released()
        for req in snap.finished_recving:
            self._open_async.pop(req, None)
        return snap

    def take_chunk_outcomes(self) -> ChunkOutcomes | None:
        """Chunks saved, not saved and evicted since the last call (None: not reporting)."""
        if self._outcomes is None:
            return None
        with self._lock:
            out, self._outcomes = self._outcomes, ChunkOutcomes()
        return out

    def chunks_evicted(self, keys: list[ChunkKey]) -> None:
        """The store deleted these chunks to make room (any thread)."""
        with self._lock:
            if self._outcomes is not None:
                self._outcomes.evicted.extend(keys)

    def take_error_blocks(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        self._check_fatal()
        if not self.runtime.running:
            self._loop_gone()
        with self._lock:
            blocks, self._results.error_block_ids = self._results.error_block_ids, set()
        return blocks

    def preempt(self, reqs: list[str]) -> None:
        """Cancel every save of `reqs` and wait, at most `preempt_timeout_s`, until they no
        longer read the blocks vLLM is about to reuse; one still running stores nothing."""
        if reqs and self.runtime.running:
            try:
                self.runtime.call(self._cancel_saves, reqs, timeout=self.config.preempt_timeout_s)
            except TimeoutError:  # cancelled saves never store: a late read is only waste
                log.warning(
                    "kvflow: saves of preempted %s still ran after preempt_timeout_s=%s; they "
                    "are cancelled and store nothing",
                    reqs,
                    self.config.preempt_timeout_s,
                )

    def close(self, drain_s: float) -> None:
        """Let in-flight saves finish (at most `drain_s`), then stop the runtime."""
        self.drain(drain_s)
        self.runtime.shutdown()

    def drain(self, drain_s: float) -> None:
        """Let in-flight saves finish, waiting at most `drain_s`."""
        if self.runtime.running:
            try:
                self.runtime.call(self._drain, timeout=drain_s)
            except TimeoutError:
                log.warning("kvflow: saves still running after %.1fs; cancelling them", drain_s)

    # -- loop thread -------------------------------------------------------
    async def _drain(self) -> None:
        await self._lending.drained()

    def _require_layout(self) -> KVLayout:
        if self.layout is None:
            raise RuntimeError("kvflow worker got a transfer before register_kv_caches")
        return self.layout

    def _limiter(self, kind: str) -> trio.CapacityLimiter:
        lim = self._limiters.get(kind)
        if lim is None:
            lim = self._limiters[kind] = trio.CapacityLimiter(self.config.max_concurrent_transfers)
        return lim

    def _on_bind(self, plan: WorkerPlan, gate: _LayerGate) -> None:
        self.bus.emit(StepBound(step=plan.step, loads=len(plan.loads), saves=len(plan.saves)))
        over: dict[int, list[trio.CancelScope]] = {}  # a loaded block -> saves computed over it
        settled: dict[int, trio.Event] = {}  # a block loaded within the step -> its load ended
        for spec in plan.loads:
            done = trio.Event()
            if not spec.asynchronous:
                settled.update(dict.fromkeys(spec.block_ids, done))
            self.runtime.start_soon(
                self._load_flow, spec, gate, over, done, name=f"load:{spec.req}"
            )
        if plan.saves:
            step = self._steps[plan.step] = _Step(
                self._require_layout().num_layers, len(plan.saves)
            )
            for save in plan.saves:
                # registered now, not when the task first runs: a preempt may come first
                scope = trio.CancelScope()
                self._lending.start(save.req, scope)
                self._lending.reads(scope, save.block_ids)
                loads: list[trio.Event] = []
                for b in save.computed_over:
                    over.setdefault(b, []).append(scope)
                    if (load := settled.get(b)) is not None and load not in loads:
                        loads.append(load)
                self.runtime.start_soon(
                    self._save_flow, save, plan.step, step, scope, loads, name=f"save:{save.req}"
                )
        for o in plan.offers:  # held like a save: released when the offer ends
            self._lending.start(o.req)
            self.runtime.start_soon(self._offer_flow, o, name=f"offer:{o.req}")
        for req in plan.lent:
            self._lending.lend(req)

    def _started(
        self, kind: type[LoadStarted | SaveStarted], spec: LoadSpec | SaveSpec, layout: KVLayout
    ) -> int:
        """Report a load or save starting; its bytes."""
        nbytes = layout.nbytes(spec.token_counts)
        self.bus.emit(
            kind(
                req=spec.req,
                chunks=len(spec.keys),
                tokens=sum(spec.token_counts),
                nbytes=nbytes,
                transport=self.transport.name,
            )
        )
        return nbytes

    def _on_layer_computed(self, step_no: int, layer: int, ready: LayerReady | None) -> None:
        step = self._steps.get(step_no)
        if step is not None and not step.computed[layer].is_set():
            step.ready[layer] = ready
            step.computed[layer].set()
            self.bus.emit(LayerComputed(step=step_no, layer=layer))

    def _on_step_end(self, step_no: int, ready: LayerReady | None) -> None:
        step = self._steps.get(step_no)
        if step is not None:
            for layer, ev in enumerate(step.computed):
                if not ev.is_set():
                    step.ready[layer] = ready
                    ev.set()

    def _give_up_on_step_loads(self, what: str) -> None:
        """vLLM's thread waited `load_timeout_s` + `STOP_GRACE_S` for this step's loads. If
        the loop runs, a load ignored its deadline and may still write: stop the engine.
        If it is gone, nothing can write any more: report them failed, wait no more."""
        if self.runtime.running:
            self._stop(f"{what} did not stop")
        self._loop_gone()

    def _loop_gone(self) -> None:
        """The loop died (or was shut down): no transfer runs and none will start (trio
        ended every task, each waited for its threads). Hand every lent block back and
        fail every load vLLM still waits for: the requests recompute or fail, none hangs."""
        if not self._gone:
            self._gone = True
            log.error(
                "kvflow: the worker's loop is gone; its transfers are off: lent blocks go "
                "back to vLLM, pending loads fail (recomputed, or request errors)"
            )
        with self._lock:
            r = self._results
            r.finished_sending |= self._lending.release_all()
            r.error_block_ids |= self._step_load_blocks
            self._step_load_blocks = set()  # reported once: later steps may reuse them
            for req, blocks in self._open_async.items():
                if req not in r.finished_recving:
                    r.finished_recving.add(req)
                    r.failed_recving.add(req)
                    r.error_block_ids.update(blocks)
        self._open_gate()

    def _stop(self, what: str) -> None:
        """Record why the engine must stop and raise it in vLLM's thread."""
        self._set_fatal(
            f"{what} within load_timeout_s={self.config.load_timeout_s} + {STOP_GRACE_S}s "
            "(a read stuck in the kernel, e.g. on a hung network filesystem?)"
        )
        self._check_fatal()

    def _set_fatal(self, why: str) -> None:
        """The engine must stop (the first reason holds); vLLM's thread raises it next."""
        with self._lock:
            self._fatal = self._fatal or (
                f"kvflow: {why}. Stopping the engine rather than hand blocks back to vLLM "
                "while a late write could still land in them."
            )

    def _check_fatal(self) -> None:
        if self._fatal:
            raise KVFlowFatal(self._fatal)

    def _open_gate(self) -> None:
        gate = self._gate
        for ev in gate.events:
            ev.set()
        gate.settled.set()

    async def _load_flow(
        self,
        spec: LoadSpec,
        gate: _LayerGate,
        over: dict[int, list[trio.CancelScope]],
        done: trio.Event,
    ) -> None:
        """One load; if it fails, the saves of this step computed over its failed blocks
        (`over`) are dropped, before `done` lets them commit."""
        layout = self._require_layout()
        num_layers = layout.num_layers
        signalled = [False] * num_layers
        sync_gate = None if spec.asynchronous else gate

        def layer_loaded(layer: int) -> None:
            if not signalled[layer]:
                signalled[layer] = True
                if sync_gate is not None:
                    sync_gate.loaded(layer)

        stage: HostStage | None = None  # made inside the deadline: it may fail

        def transport_loaded(layer: int) -> None:
            if not signalled[layer]:
                if stage is not None:  # the device blocks are written before the gate opens
                    stage.scatter(layer, gate.after)
                self.bus.emit(LayerLoaded(req=spec.req, layer=layer))
            layer_loaded(layer)

        def spans(layer: int) -> list[list[memoryview]]:
            if stage is not None:
                return stage.spans(layer)
            return layout.chunk_spans(layer, spec.block_ids, spec.token_counts)

        nbytes = self._started(LoadStarted, spec, layout)
        job = LoadJob(
            spec.req,
            spec.keys,
            spec.token_counts,
            num_layers,
            spans,
            transport_loaded,
            spec.source,
            list(spec.block_ids),
            layerwise=not spec.asynchronous,
        )
        t0 = time.perf_counter()
        error, intact, timed_out, stuck = "", 0, False, ""
        if spec.asynchronous:  # vLLM's thread stops the engine if it outlives this
            with self._lock:
                self._async_deadlines[spec.req] = (
                    self._now() + self.config.load_timeout_s + STOP_GRACE_S
                )
        try:
            if spec.error:  # known in the scheduler already (a producer that is gone)
                raise ChunkMissing(spec.error)
            with trio.move_on_after(self.config.load_timeout_s) as deadline:
                async with self._limiter("load"):  # which also bounds pinned staging memory
                    if self.staged:
                        stage = HostStage(layout, spec.block_ids, spec.token_counts)
                        await event_done(gate.after)  # so no scatter waits on vLLM's queue
                    await self.transport.load(job)
            if deadline.cancelled_caught:
                error, timed_out = (
                    f"no answer within load_timeout_s={self.config.load_timeout_s}",
                    True,
                )
            elif not all(signalled):
                error = "transport returned before loading every layer"
        except TransferStuck as exc:
            stuck = str(exc)
        except TransportError as exc:
            error, intact = f"{type(exc).__name__}: {exc}", max(0, exc.chunk)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.exception("kvflow load of %s failed", spec.req)
        except BaseException:
            error = "cancelled (kvflow shutting down)"
            raise
        finally:
            with self._lock:
                self._async_deadlines.pop(spec.req, None)
            if stuck:  # its blocks never go back to vLLM: the engine stops
                log.error("kvflow load of %s into blocks %s: %s", spec.req, spec.block_ids, stuck)
                self._set_fatal(
                    f"the load of {spec.req} into blocks {spec.block_ids} could not be "
                    f"stopped ({stuck})"
                )
                reason = f"could not be stopped: {stuck}"
                self.bus.emit(TransferFailed(req=spec.req, direction="load", reason=reason))
            else:
                self._finish_load(spec, error, intact, timed_out, time.perf_counter() - t0, nbytes)
            if error or stuck:  # such a save waits for `done` before its last layer
                self._drop_saves_over(spec.block_ids[intact:], over, spec.req)
            done.set()
            for layer in range(num_layers):
                layer_loaded(layer)
            if sync_gate is not None:
                sync_gate.load_settled()

    def _drop_saves_over(
        self, failed: list[int], over: dict[int, list[trio.CancelScope]], req: str
    ) -> None:
        for b in failed:
            for scope in over.get(b, ()):
                self._lending.drop(scope, f"computed over blocks whose load failed ({req})")

    def _finish_load(
        self, spec: LoadSpec, error: str, intact: int, timed_out: bool, elapsed: float, nbytes: int
    ) -> None:
        failed = spec.block_ids[intact:] if error else []
        if error:
            log.warning("kvflow load of %s failed (%s); vLLM will recompute", spec.req, error)
            self.bus.emit(
                TransferFailed(
                    req=spec.req,
                    direction="load",
                    reason=error,
                    block_ids=failed,
                    timed_out=timed_out,
                )
            )
        else:
            self.bus.emit(
                TransferDone(
                    req=spec.req,
                    direction="load",
                    chunks=len(spec.keys),
                    nbytes=nbytes,
                    elapsed_s=elapsed,
                )
            )
        # only now may vLLM learn of it: whoever reads the events sees them first
        with self._lock:
            self._results.error_block_ids.update(failed)
            if spec.asynchronous:
                self._results.finished_recving.add(spec.req)
                if error:
                    self._results.failed_recving.add(spec.req)

    async def _save_flow(
        self,
        spec: SaveSpec,
        step_no: int,
        step: _Step,
        scope: trio.CancelScope,
        loads: list[trio.Event],
    ) -> None:
        """One save. Its chunks were computed over blocks the step's `loads` fill: their
        last layer waits until those loads ended, so a failed one drops the save first
        (a transport commits only once it has every layer)."""
        layout = self._require_layout()

        stage: HostStage | None = None  # made inside the deadline: it may fail

        async def layer_spans(layer: int) -> list[list[memoryview]]:
            await step.wait_computed(layer)
            if layer == layout.num_layers - 1:
                for done in loads:
                    await done.wait()
            if stage is not None:  # the host image is a snapshot by itself
                await stage.gather(layer)
                return stage.spans(layer)
            return [
                _snapshot(layout.spans(layer, b, n))
                # a block-granular partial block keeps changing as vLLM decodes into it
                if n < layout.block_size and layout.geometries[layer].block_bytes
                else layout.spans(layer, b, n)
                for b, n in zip(spec.block_ids, spec.token_counts, strict=True)
            ]

        nbytes = self._started(SaveStarted, spec, layout)
        job = SaveJob(spec.req, spec.keys, spec.token_counts, layout.num_layers, layer_spans)
        t0 = time.perf_counter()
        error, timed_out = "interrupted", False  # until the save ends one way or another
        try:
            with scope, trio.move_on_after(self.config.save_timeout_s) as deadline:
                async with self._limiter("save"):  # which also bounds pinned staging memory
                    if self.staged:
                        stage = HostStage(layout, spec.block_ids, spec.token_counts)
                    await self.transport.save(job)
            error = ""
            if deadline.cancelled_caught:
                error, timed_out = (
                    f"not saved within save_timeout_s={self.config.save_timeout_s}",
                    True,
                )
            elif scope.cancelled_caught:
                error = f"cancelled: {self._lending.why(scope)}"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.warning("kvflow save of %s failed: %s", spec.req, error)
        finally:
            step.saves_left -= 1
            if step.saves_left == 0:
                self._steps.pop(step_no, None)
            if self._outcomes is not None:  # before the release: vLLM may stop stepping then
                with self._lock:
                    (self._outcomes.unsaved if error else self._outcomes.saved).extend(spec.keys)
            self._lending.end(spec.req, scope)
        if error:
            self.bus.emit(
                TransferFailed(req=spec.req, direction="save", reason=error, timed_out=timed_out)
            )
        else:
            self.bus.emit(
                TransferDone(
                    req=spec.req,
                    direction="save",
                    chunks=len(spec.keys),
                    nbytes=nbytes,
                    elapsed_s=time.perf_counter() - t0,
                )
            )

    async def _offer_flow(self, spec: OfferSpec) -> None:
        """P/D producer: hold the blocks until the consumer is done, failed, or never came."""
        layout = self._require_layout()

        def spans(layer: int) -> list[list[memoryview]]:
            return layout.chunk_spans(layer, spec.block_ids, spec.token_counts)

        hold = trio.CancelScope(deadline=trio.current_time() + self.config.hold_timeout_s)
        leased: list[float] = []

        def renew(lease_s: float) -> None:  # a consumer claimed it: its lease, not the hold
            hold.deadline = trio.current_time() + lease_s
            leased[:] = [lease_s]

        offer = Offer(spec.req, spec.block_ids, spec.token_counts, layout.num_layers, spans, renew)
        t0 = time.perf_counter()
        outcome = ""
        try:
            with hold:
                outcome = await self.transport.offer(offer)
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
            log.warning("kvflow offer of %s failed: %s", spec.req, outcome)
        finally:
            if outcome == "done":
                self.bus.emit(
                    TransferDone(
                        req=spec.req,
                        direction="send",
                        chunks=len(spec.block_ids),
                        nbytes=layout.nbytes(spec.token_counts),
                        elapsed_s=time.perf_counter() - t0,
                    )
                )
            else:
                why = outcome or (
                    f"the consumer's claim lapsed (lease of {leased[0]}s not renewed)"
                    if leased
                    else f"no consumer within hold_timeout_s={self.config.hold_timeout_s}"
                )
                self.bus.emit(
                    TransferFailed(
                        req=spec.req, direction="send", reason=why, timed_out=not outcome
                    )
                )
            self._lending.end(spec.req)

    async def _cancel_saves(self, reqs: list[str]) -> None:
        self._lending.cancel(reqs)
        await self._lending.ended(reqs)
