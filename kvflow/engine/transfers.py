"""The worker's transfers on the runtime's loop: a task per load, save and offer.

`Transfers.on_bind` starts a step's transfers; each has its own deadline and reports to
vLLM's thread through `Reports` (one lock): completions in vLLM's terms, the
blocks of failed loads, what became of saved chunks, and why the engine must
stop. Which blocks kvflow uses, and when vLLM may have them back, is
`kvflow.engine.lending`'s. `LayerGate` is what vLLM's thread waits on for a step's
synchronous loads; `WorkerEngine` (`kvflow.engine.worker`) is the vLLM-thread side.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from ..config import KVFlowConfig
from ..geometry.layout import KVLayout
from ..keys import ChunkKey
from ..observe.events import (
    ClaimSeen,
    Direction,
    EventBus,
    LayerComputed,
    LayerLoaded,
    LoadStarted,
    SaveStarted,
    StepBound,
    TransferDone,
    TransferFailed,
)
from ..runtime import Runtime, event_done, poll_until
from ..shapes.reblock import load_reblocked
from ..shapes.replicas import ReplicaStore
from ..shapes.reshape import load_reshaped
from ..transport import (
    ChunkMissing,
    LoadJob,
    Offer,
    SaveJob,
    TransferStuck,
    Transport,
    TransportError,
)
from .lending import Lending
from .metadata import LoadSpec, OfferSpec, SaveSpec, WorkerPlan
from .staging import HostStage

__all__ = [
    "STOP_GRACE_S",
    "ChunkOutcomes",
    "LayerGate",
    "LayerReady",
    "Reports",
    "TransferResults",
    "Transfers",
]

log = logging.getLogger("kvflow.worker")

STOP_GRACE_S = 5.0
"""How long past `load_timeout_s` vLLM's thread waits for a load to stop before it
gives up on it (and, if the loop still runs, on the engine)."""

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
    stored (the save failed or was dropped), deleted by a tier to make room."""

    saved: list[tuple[list[ChunkKey], list[Transport]]] = field(default_factory=list)
    """Each save's chunks and the tiers (transports) holding them: `SaveJob.stored_in`,
    else the store saved to."""
    unsaved: list[ChunkKey] = field(default_factory=list)
    evicted: list[tuple[str, list[ChunkKey]]] = field(default_factory=list)
    """The medium of the tier that evicted chunks (named by whoever reports them), and
    their keys."""


class Reports:
    """What the transfers tell vLLM's thread, under one lock."""

    def __init__(self, chunk_outcomes: bool = False) -> None:
        self.lock = threading.Lock()
        self.results = TransferResults()
        self.outcomes = ChunkOutcomes() if chunk_outcomes else None
        """What became of saved chunks (kept for vLLM's KV events only)."""
        self.async_deadlines: dict[str, float] = {}
        """Asynchronous loads running: request -> when vLLM's thread gives up on them
        (`time.monotonic`)."""
        self.fatal = ""
        """Why the engine must stop (set once, by a load that could not be stopped)."""

    def set_fatal(
        self,
        why: str,
        because: str = "Stopping the engine rather than hand blocks back to vLLM while a "
        "late write could still land in them.",
    ) -> None:
        """The engine must stop (the first reason holds); vLLM's thread raises it next."""
        with self.lock:
            self.fatal = self.fatal or f"kvflow: {why}. {because}"


def _snapshot(spans: list[memoryview]) -> list[memoryview]:
    return [memoryview(bytes(s)) for s in spans]


class LayerGate:
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


class _Load:
    """One load's state: the layers signalled so far (each once: the gate counts them),
    its host staging (a device cache), and how it ended."""

    def __init__(self, spec: LoadSpec, layout: KVLayout, gate: LayerGate, bus: EventBus) -> None:
        self.spec = spec
        self.layout = layout
        self.bus = bus
        self.gate = None if spec.asynchronous else gate
        self.after = gate.after
        self.signalled = [False] * layout.num_layers
        self.stage: HostStage | None = None
        """Made inside the deadline: it may fail."""
        self.error = "cancelled (kvflow shutting down)"
        self.intact = 0
        """Leading chunks that arrived whole (when `error`)."""
        self.timed_out = False
        self.stuck = ""
        """Why the load could not be stopped (`TransferStuck`): the engine must stop."""

    async def run(
        self, transport: Transport, timeout_s: float, limiter: trio.CapacityLimiter, staged: bool
    ) -> None:
        """Move the chunks within `timeout_s`; record how it ended (a cancellation leaves
        the error it starts with)."""
        spec = self.spec
        try:
            if spec.error:  # known in the scheduler already (a producer that is gone)
                raise ChunkMissing(spec.error)
            with trio.move_on_after(timeout_s) as deadline:
                async with limiter:  # which also bounds pinned staging memory
                    if staged:
                        self.stage = HostStage(self.layout, spec.block_ids, spec.token_counts)
                        await event_done(self.after)  # so no scatter waits on vLLM's queue
                    if spec.tp_sizes:  # chunks saved at another tensor-parallel size
                        await load_reshaped(transport, self.job(), spec.tp_sizes)
                    elif spec.stored is not None:  # saved at another block size
                        await load_reblocked(transport, self.job(), spec.stored)
                    else:
                        await transport.load(self.job())
            self.error = ""
            if deadline.cancelled_caught:
                self.error = f"no answer within load_timeout_s={timeout_s}"
                self.timed_out = True
            elif not all(self.signalled):
                self.error = "transport returned before loading every layer"
        except TransferStuck as exc:
            self.error, self.stuck = "", str(exc)
        except TransportError as exc:
            self.error, self.intact = f"{type(exc).__name__}: {exc}", max(0, exc.chunk)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("kvflow load of %s failed", spec.req)

    def job(self) -> LoadJob:
        spec = self.spec
        return LoadJob(
            spec.req,
            spec.keys,
            spec.token_counts,
            self.layout.num_layers,
            self.spans,
            self.transport_loaded,
            spec.source,
            list(spec.block_ids),
            layerwise=not spec.asynchronous,
        )

    def spans(self, layer: int) -> list[list[memoryview]]:
        if self.stage is not None:
            return self.stage.spans(layer)
        return self.layout.chunk_spans(layer, self.spec.block_ids, self.spec.token_counts)

    def transport_loaded(self, layer: int) -> None:
        if not self.signalled[layer]:
            if self.stage is not None:  # the device blocks are written before the gate opens
                self.stage.scatter(layer, self.after)
            self.bus.emit(LayerLoaded(req=self.spec.req, layer=layer))
        self.layer_loaded(layer)

    def layer_loaded(self, layer: int) -> None:
        if not self.signalled[layer]:
            self.signalled[layer] = True
            if self.gate is not None:
                self.gate.loaded(layer)

    def settle(self) -> None:
        """The load ended, one way or another: every layer's gate opens."""
        for layer in range(self.layout.num_layers):
            self.layer_loaded(layer)
        if self.gate is not None:
            self.gate.load_settled()


class _SaveSpans:
    """`SaveJob.layer` of one save: layer i's spans once vLLM computed it (and, for the
    last layer, once the step's loads it was computed over ended)."""

    def __init__(
        self, spec: SaveSpec, layout: KVLayout, step: _Step, loads: list[trio.Event]
    ) -> None:
        self.spec = spec
        self.layout = layout
        self.step = step
        self.loads = loads
        self.stage: HostStage | None = None
        """A device cache's host image (made inside the save's deadline: it may fail)."""

    async def layer(self, layer: int) -> list[list[memoryview]]:
        layout, spec = self.layout, self.spec
        await self.step.wait_computed(layer)
        if layer == layout.num_layers - 1:
            for done in self.loads:
                await done.wait()
        if self.stage is not None:  # the host image is a snapshot by itself
            await self.stage.gather(layer)
            return self.stage.spans(layer)
        return [
            _snapshot(layout.spans(layer, b, n))
            # a block-granular partial block keeps changing as vLLM decodes into it
            if n < layout.block_size and layout.geometries[layer].block_bytes
            else layout.spans(layer, b, n)
            for b, n in zip(spec.block_ids, spec.token_counts, strict=True)
        ]


class Transfers:
    """A worker's transfers, on its runtime's loop thread."""

    def __init__(
        self,
        *,
        config: KVFlowConfig,
        transport: Transport,
        runtime: Runtime,
        bus: EventBus,
        lending: Lending,
        reports: Reports,
    ) -> None:
        self.config = config
        self.transport = transport
        self.runtime = runtime
        self.bus = bus
        self.lending = lending
        self.reports = reports
        self.layout: KVLayout | None = None
        self.staged = False
        """The cache is device memory the transport cannot move: jobs go through host
        memory (`kvflow.engine.staging`)."""
        self._steps: dict[int, _Step] = {}
        self._limiters: dict[str, trio.CapacityLimiter] = {}
        self._saves = 0
        """Saves running, also those that gave their blocks back early (`SaveJob.release`)."""
        self._saves_ended = trio.Event()

    def _require_layout(self) -> KVLayout:
        if self.layout is None:
            raise RuntimeError("kvflow worker got a transfer before register_kv_caches")
        return self.layout

    def _limiter(self, kind: str) -> trio.CapacityLimiter:
        lim = self._limiters.get(kind)
        if lim is None:
            lim = self._limiters[kind] = trio.CapacityLimiter(self.config.max_concurrent_transfers)
        return lim

    def on_bind(self, plan: WorkerPlan, gate: LayerGate) -> None:
        """Start a step's transfers: its loads (signalling `gate`), saves and offers."""
        self.bus.emit(StepBound(step=plan.step, loads=len(plan.loads), saves=len(plan.saves)))
        over: dict[int, list[trio.CancelScope]] = {}  # a loaded block -> saves computed over it
        settled: dict[int, trio.Event] = {}  # a block loaded within the step -> its load ended
        for spec in plan.loads:
            done = trio.Event()
            if not spec.asynchronous:
                settled.update(dict.fromkeys(spec.block_ids, done))
            self.runtime.start_soon(self._load, spec, gate, over, done, name=f"load:{spec.req}")
        step: _Step | None = None
        if plan.saves or any(o.params for o in plan.offers):
            step = self._steps[plan.step] = _Step(
                self._require_layout().num_layers, len(plan.saves)
            )
            for save in plan.saves:
                # registered now, not when the task first runs: a preempt may come first
                scope = trio.CancelScope()
                self.lending.start(save.req, scope, save.block_ids)
                loads: list[trio.Event] = []
                for b in save.computed_over:
                    over.setdefault(b, []).append(scope)
                    if (load := settled.get(b)) is not None and load not in loads:
                        loads.append(load)
                self.runtime.start_soon(
                    self._save, save, plan.step, step, scope, loads, name=f"save:{save.req}"
                )
        for o in plan.offers:  # held like a save: released when the offer ends
            # streamed: its request runs on; a preemption cancels it, as it does a save
            hold = trio.CancelScope(deadline=trio.current_time() + self.config.hold_timeout_s)
            self.lending.start(o.req, hold if o.params else None)
            computing = step if o.params else None
            self.runtime.start_soon(self._offer, o, hold, computing, name=f"offer:{o.req}")
        for req in plan.lent:
            self.lending.lend(req)

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

    def layer_computed(self, step_no: int, layer: int, ready: LayerReady | None) -> None:
        """vLLM computed `layer` of step `step_no`: its saves may read it (once `ready`)."""
        step = self._steps.get(step_no)
        if step is not None and not step.computed[layer].is_set():
            step.ready[layer] = ready
            step.computed[layer].set()
            self.bus.emit(LayerComputed(step=step_no, layer=layer))

    def step_ended(self, step_no: int, ready: LayerReady | None) -> None:
        """Step `step_no`'s forward is over: every layer vLLM did not report is final."""
        step = self._steps.get(step_no)
        if step is not None:
            for layer, ev in enumerate(step.computed):
                if not ev.is_set():
                    step.ready[layer] = ready
                    ev.set()
            if step.saves_left == 0:  # a step of streamed offers only (they keep it)
                self._steps.pop(step_no, None)

    async def _load(
        self,
        spec: LoadSpec,
        gate: LayerGate,
        over: dict[int, list[trio.CancelScope]],
        done: trio.Event,
    ) -> None:
        """One load; if it fails, the saves of this step computed over its failed blocks
        (`over`) are dropped, before `done` lets them commit."""
        load = _Load(spec, self._require_layout(), gate, self.bus)
        nbytes = self._started(LoadStarted, spec, load.layout)
        t0 = time.perf_counter()
        if spec.asynchronous:  # vLLM's thread stops the engine if it outlives this
            with self.reports.lock:
                self.reports.async_deadlines[spec.req] = (
                    time.monotonic() + self.config.load_timeout_s + STOP_GRACE_S
                )
        try:
            await load.run(
                self.transport, self.config.load_timeout_s, self._limiter("load"), self.staged
            )
        finally:
            with self.reports.lock:
                self.reports.async_deadlines.pop(spec.req, None)
            if load.stuck:  # its blocks never go back to vLLM: the engine stops
                log.error(
                    "kvflow load of %s into blocks %s: %s", spec.req, spec.block_ids, load.stuck
                )
                self.reports.set_fatal(
                    f"the load of {spec.req} into blocks {spec.block_ids} could not be "
                    f"stopped ({load.stuck})"
                )
                reason = f"could not be stopped: {load.stuck}"
                self.bus.emit(TransferFailed(req=spec.req, direction="load", reason=reason))
            else:
                self._finish_load(spec, load, t0, nbytes)
            if load.error or load.stuck:  # such a save waits for `done` before its last layer
                self._drop_saves_over(spec.block_ids[load.intact :], over, spec.req)
            done.set()
            load.settle()

    def _drop_saves_over(
        self, failed: list[int], over: dict[int, list[trio.CancelScope]], req: str
    ) -> None:
        for b in failed:
            for scope in over.get(b, ()):
                self.lending.drop(scope, f"computed over blocks whose load failed ({req})")

    def _finish_load(self, spec: LoadSpec, load: _Load, t0: float, nbytes: int) -> None:
        error = load.error
        failed = spec.block_ids[load.intact :] if error else []
        if error:
            log.warning("kvflow load of %s failed (%s); vLLM will recompute", spec.req, error)
        chunks = len(spec.keys)
        self._ended(spec.req, "load", error, chunks, nbytes, t0, load.timed_out, failed)
        # only now may vLLM learn of it: whoever reads the events sees them first
        with self.reports.lock:
            self.reports.results.error_block_ids.update(failed)
            if spec.asynchronous:
                self.reports.results.finished_recving.add(spec.req)
                if error:
                    self.reports.results.failed_recving.add(spec.req)

    async def _save(
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
        spans = _SaveSpans(spec, layout, step, loads)
        nbytes = self._started(SaveStarted, spec, layout)
        released = False

        def release() -> None:  # the transport has the bytes elsewhere (a host tier)
            nonlocal released
            if not released:
                released = True
                self.lending.end(spec.req, scope)

        job = SaveJob(
            spec.req, spec.keys, spec.token_counts, layout.num_layers, spans.layer, release
        )
        t0 = time.perf_counter()
        error, timed_out = "interrupted", False  # until the save ends one way or another
        self._saves += 1
        try:
            with scope, trio.move_on_after(self.config.save_timeout_s) as deadline:
                async with self._limiter("save"):  # which also bounds pinned staging memory
                    if self.staged and not isinstance(self.transport, ReplicaStore):
                        spans.stage = HostStage(layout, spec.block_ids, spec.token_counts)
                    await self.transport.save(job)
            error = ""
            if deadline.cancelled_caught:
                error, timed_out = (
                    f"not saved within save_timeout_s={self.config.save_timeout_s}",
                    True,
                )
            elif scope.cancelled_caught:
                error = f"cancelled: {self.lending.why(scope)}"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.warning("kvflow save of %s failed: %s", spec.req, error)
        finally:
            step.saves_left -= 1
            if step.saves_left == 0:
                self._steps.pop(step_no, None)
            try:
                if (outcomes := self.reports.outcomes) is not None:  # before the release:
                    with self.reports.lock:  # vLLM may stop stepping then (a save that
                        # gave its blocks back early reports at its end all the same)
                        if error:
                            outcomes.unsaved.extend(spec.keys)
                        else:
                            tiers = job.stored_in or [self.transport]
                            outcomes.saved.append((list(spec.keys), tiers))
                release()
            finally:
                self._saves -= 1
                self._saves_ended.set()
                self._saves_ended = trio.Event()
        self._ended(spec.req, "save", error, len(spec.keys), nbytes, t0, timed_out)

    def _ended(
        self,
        req: str,
        direction: Direction,
        error: str,
        chunks: int,
        nbytes: int,
        t0: float,
        timed_out: bool = False,
        block_ids: list[int] | None = None,
    ) -> None:
        """Report a transfer's end: failed with `error`, or done since `t0`."""
        if error:
            self.bus.emit(
                TransferFailed(
                    req=req,
                    direction=direction,
                    reason=error,
                    block_ids=block_ids or [],
                    timed_out=timed_out,
                )
            )
        else:
            elapsed = time.perf_counter() - t0
            self.bus.emit(
                TransferDone(
                    req=req, direction=direction, chunks=chunks, nbytes=nbytes, elapsed_s=elapsed
                )
            )

    async def _offer(
        self, spec: OfferSpec, hold: trio.CancelScope, computing: _Step | None
    ) -> None:
        """P/D producer: hold the blocks until the consumer is done, failed, or never came
        (streamed: or vLLM preempted the request, cancelling `hold`); `computing`: the
        step whose forward computes them (streamed)."""
        layout = self._require_layout()

        def spans(layer: int) -> list[list[memoryview]]:
            return layout.chunk_spans(layer, spec.block_ids, spec.token_counts)

        async def computed(layer: int) -> None:
            if computing is not None:
                await computing.wait_computed(layer)

        cap = trio.current_time() + self.config.max_hold_s  # a stranger cannot pin blocks
        leased: list[float] = []

        def renew(lease_s: float) -> None:  # a consumer claimed it: its lease, not the hold
            if not leased:
                self.bus.emit(ClaimSeen(req=spec.req))
            lease_s = min(lease_s, self.config.lease_s)  # the consumer's word, bounded
            hold.deadline = min(trio.current_time() + lease_s, cap)
            leased[:] = [lease_s]

        offer = Offer(
            spec.offer or spec.req,
            spec.block_ids,
            spec.token_counts,
            layout.num_layers,
            spans,
            renew,
            spec.params,
            computed,
        )
        t0 = time.perf_counter()
        outcome = ""
        try:
            with hold:
                outcome = await self.transport.offer(offer)
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
            log.warning("kvflow offer of %s failed: %s", spec.req, outcome)
        finally:
            why = "" if outcome == "done" else outcome
            if not outcome:
                why = (
                    f"cancelled: {self.lending.why(hold)}"
                    if hold.cancel_called and trio.current_time() < hold.deadline
                    else f"held max_hold_s={self.config.max_hold_s} without a pull"
                    if trio.current_time() >= cap
                    else f"the consumer's claim lapsed (lease of {leased[0]}s not renewed)"
                    if leased
                    else f"no consumer within hold_timeout_s={self.config.hold_timeout_s}"
                )
            nbytes = layout.nbytes(spec.token_counts)
            self._ended(spec.req, "send", why, len(spec.block_ids), nbytes, t0, not outcome)
            self.lending.end(spec.req, hold if spec.params else None)

    async def cancel_saves(self, reqs: list[str]) -> None:
        self.lending.cancel(reqs)
        await self.lending.ended(reqs)

    async def drained(self) -> None:
        """Until no transfer uses vLLM's blocks and no save is still writing."""
        await self.lending.drained()
        while self._saves:
            await self._saves_ended.wait()
