"""The worker's side of kvflow on vLLM's model-runner thread: `WorkerEngine`.

vLLM's model-runner thread calls in through the connector adapter:
`bind` (a step's plan), `wait_layer` (attention is about to read layer i),
`layer_computed` (layer i's KV is final), `end_step`, `take_results`. Those
calls hand work to the runtime's loop (`kvflow.engine.transfers`) and return; the only
waits are the ones the contract demands (layer i's load before attention reads
it, preemption before blocks are reused), each bounded by a timeout.

The transfers report through `kvflow.engine.transfers.Reports` (one lock); a failed load's
block ids are recorded before (or with) its completion, so vLLM always learns
which blocks to recompute no later than it learns the load ended.

No load's blocks go back to vLLM while something may still write into them. A
load that cannot be stopped (a read stuck in the kernel on a hung network
filesystem, a READ still in flight after its cancellation: `TransferStuck`)
ends the engine with `KVFlowFatal` instead, raised in vLLM's thread at its next
call: a late write into a block vLLM recomputes or reuses would be wrong KV.
If the loop dies, every lent block goes back and every load vLLM waits for fails.
"""

from __future__ import annotations

import functools
import logging
import time

from ..config import KVFlowConfig
from ..geometry.layout import KVLayout, LayoutError
from ..keys import ChunkKey
from ..observe.events import BlocksReleased, CachesRegistered, EventBus, TaskFailed
from ..runtime import GAVE_UP_THEN, KVFlowFatal, Runtime, given_up, supervised
from ..transport import Transport
from . import transfers
from .lending import Lending
from .metadata import WorkerPlan
from .staging import mark
from .transfers import (
    ChunkOutcomes,
    LayerGate,
    LayerReady,
    Reports,
    TransferResults,
    Transfers,
)

__all__ = ["KVFlowFatal", "TransferResults", "WorkerEngine"]

log = logging.getLogger("kvflow.worker")


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
        self._gate = LayerGate(0, 0)
        self._step = 0
        self._step_tracked = False
        """This step's layers are watched: saves or streamed offers read them once computed."""
        self._step_load_blocks: set[int] = set()
        self._now = time.monotonic
        """vLLM's thread's clock for asynchronous loads' deadlines (tests move it)."""
        self._lending = Lending(lambda req: self.bus.emit(BlocksReleased(req=req)))
        """Whose blocks kvflow uses, and when vLLM may have them back."""
        self._reports = Reports(report_chunks)
        transport.context.tier_event = self.bus.emit
        self._transfers = Transfers(
            config=config,
            transport=transport,
            runtime=runtime,
            bus=bus,
            lending=self._lending,
            reports=self._reports,
        )
        # what vLLM still waits for, should the loop die
        self._open_async: dict[str, list[int]] = {}
        self._gone = False

    @property
    def layout(self) -> KVLayout | None:
        """vLLM's KV memory (None until `register`)."""
        return self._transfers.layout

    @property
    def staged(self) -> bool:
        """The cache is device memory the transport cannot move: jobs go through host
        memory (`kvflow.engine.staging`)."""
        return self._transfers.staged

    # -- vLLM thread -------------------------------------------------------
    def register(self, layout: KVLayout) -> None:
        caps = self.transport.capabilities
        staged = layout.memory not in caps.memory
        if staged and ("cpu" not in caps.memory or caps.peer or not layout.tensors):
            raise LayoutError(
                f"kvflow: the KV cache is in {layout.memory} memory; transport "
                f"{self.transport.name!r} moves {', '.join(sorted(caps.memory))} memory only"
                + (" (peer transports are not staged through host memory)" if caps.peer else "")
            )
        if staged:
            log.info(
                "kvflow: %s moves host memory; staging the %s KV cache through pinned host buffers",
                self.transport.name,
                layout.memory,
            )
        self._transfers.layout, self._transfers.staged = layout, staged
        self.runtime.call(self.transport.register, layout, timeout=60.0)
        if self.transport.capabilities.peer:
            serve = f"{self.transport.name}:serve"
            task = functools.partial(
                supervised, restarted=self._task_restarted, gave_up=self._task_gave_up
            )
            self.runtime.spawn(task, serve, self.transport.serve, name=serve)
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
        self._gate = LayerGate(layout.num_layers if layout else 0, sync_loads, after)
        self._step = plan.step
        self._step_tracked = bool(plan.saves) or any(o.params for o in plan.offers)
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
            self.runtime.submit(self._transfers.on_bind, plan, self._gate)

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
            layer, self.config.load_timeout_s + transfers.STOP_GRACE_S
        ):
            self._give_up_on_step_loads(f"layer {layer}'s load")
        self._check_fatal()

    def forward_started(self) -> None:
        """vLLM's forward begins. It writes a layer's new tokens into the cache before it
        asks whether that layer's loads landed, so a layer's loads must have landed
        before the forward reaches the layer: layer 0's now, layer i+1's once layer i is
        computed (`layer_finished`). See docs/decisions.md. (Loads between steps leave
        every gate open.)"""
        self.wait_layer(0)

    def layer_finished(self, layer: int, ready: LayerReady | None = None) -> None:
        """vLLM computed `layer` (`layer_computed`); then wait for the next layer's loads,
        which vLLM is about to write into."""
        self.layer_computed(layer, ready)
        if self.layout is not None and layer + 1 < self.layout.num_layers:
            self.wait_layer(layer + 1)

    def layer_computed(self, layer: int, ready: LayerReady | None = None) -> None:
        """vLLM finished writing `layer` for this step; saves and streamed offers of it
        may read it."""
        if self._step_tracked:
            self.runtime.submit(self._transfers.layer_computed, self._step, layer, ready)

    def end_step(self) -> None:
        """The forward is over: every layer is final, every synchronous load settled."""
        if self._step_tracked:
            # staged saves copy on their own stream: layers vLLM did not report must
            # wait for what its stream queued up to here
            done = mark(self.layout) if self.staged and self.layout else None
            self.runtime.submit(self._transfers.step_ended, self._step, done and done.query)
        self.settle_loads()

    def settle_loads(self) -> None:
        """Block until every synchronous load of this step has landed or failed, so its
        errors are in the results (not just every layer's gate). vLLM reads them after
        `end_step` (V1 runner) or, when Model Runner V2 defers `end_step` past the
        speculator, before it: the adapter calls this before handing out results."""
        if not self._gate.settled.wait(self.config.load_timeout_s + transfers.STOP_GRACE_S):
            self._give_up_on_step_loads("this step's loads")
        self._check_fatal()

    def take_results(self) -> TransferResults:
        """Completions since the last call (each reported exactly once)."""
        self._check_fatal()
        now = self._now()
        reports = self._reports
        with reports.lock:
            stuck = [req for req, t in reports.async_deadlines.items() if t < now]
        if stuck and self.runtime.running:
            self._stop(f"the asynchronous load of {stuck[0]} did not stop")
        if not self.runtime.running:
            self._loop_gone()
        with reports.lock:
            snap = reports.results
            reports.results = TransferResults(error_block_ids=snap.error_block_ids)
        snap.error_block_ids = set()  # those are taken by take_error_blocks
        snap.finished_sending |= self._lending.take_released()
        for req in snap.finished_recving:
            self._open_async.pop(req, None)
        return snap

    def take_chunk_outcomes(self) -> ChunkOutcomes | None:
        """Chunks saved, not saved and evicted since the last call (None: not reporting)."""
        reports = self._reports
        if reports.outcomes is None:
            return None
        with reports.lock:
            out, reports.outcomes = reports.outcomes, ChunkOutcomes()
        return out

    def chunks_evicted(self, keys: list[ChunkKey], medium: str) -> None:
        """The tier of `medium` deleted these chunks to make room (any thread)."""
        with self._reports.lock:
            if self._reports.outcomes is not None:
                self._reports.outcomes.evicted.append((medium, keys))

    def take_error_blocks(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        self._check_fatal()
        if not self.runtime.running:
            self._loop_gone()
        r = self._reports
        with r.lock:
            blocks, r.results.error_block_ids = r.results.error_block_ids, set()
        return blocks

    def preempt(self, reqs: list[str]) -> None:
        """Cancel every save of `reqs` and wait, at most `preempt_timeout_s`, until they no
        longer read the blocks vLLM is about to reuse; one still running stores nothing.
        A save that already gave its blocks back (a host tier holds its bytes:
        `SaveJob.release`) is not cancelled: it reads none of vLLM's blocks any more."""
        if reqs and self.runtime.running:
            try:
                self.runtime.call(
                    self._transfers.cancel_saves, reqs, timeout=self.config.preempt_timeout_s
                )
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
                self.runtime.call(self._transfers.drained, timeout=drain_s)
            except TimeoutError:
                log.warning("kvflow: saves still running after %.1fs; cancelling them", drain_s)

    # -- loop thread -------------------------------------------------------

    def _require_layout(self) -> KVLayout:
        if self.layout is None:
            raise RuntimeError("kvflow worker got a transfer before register_kv_caches")
        return self.layout

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
        with self._reports.lock:
            r = self._reports.results
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
        grace = f"load_timeout_s={self.config.load_timeout_s} + {transfers.STOP_GRACE_S}s"
        self._reports.set_fatal(
            f"{what} within {grace} (a read stuck in the kernel, e.g. on a hung network "
            "filesystem?)"
        )
        self._check_fatal()

    def _task_restarted(self, task: str, error: str) -> None:
        self.bus.emit(TaskFailed(task=task, error=error))

    def _task_gave_up(self, task: str, error: str) -> None:
        """A long-lived task cannot be restarted: stop the engine (vLLM's health check
        then fails) rather than serve with it silently off."""
        self.bus.emit(TaskFailed(task=task, error=error, given_up=True))
        self._reports.set_fatal(given_up(task, error), because=GAVE_UP_THEN)

    def _check_fatal(self) -> None:
        if self._reports.fatal:
            raise KVFlowFatal(self._reports.fatal)

    def _open_gate(self) -> None:
        gate = self._gate
        for ev in gate.events:
            ev.set()
        gate.settled.set()
