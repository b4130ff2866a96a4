"""`KVFlowConnector`: vLLM's `KVConnectorBase_V1`, translated into kvflow's engines.

Each instance (the scheduler's, and one per worker) builds what both roles share (the
configuration, a `Runtime`, an `EventBus`, stats, a transport per KV cache group), then
its role's side (`KVFlowScheduler` in `scheduler.py`, `KVFlowWorker` below), and
forwards every vLLM call to it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvflow.config import ConfigError, KVFlowConfig, channel_of, parse_config, parse_options
from kvflow.eventlog import JsonlEventLog
from kvflow.events import EventBus, Origin, Rejected
from kvflow.hidden_states import hidden_context, hidden_layout
from kvflow.neighbours import pinned_neighbours
from kvflow.publish import start_publisher
from kvflow.runtime import Runtime
from kvflow.stats import StatsCollector
from kvflow.transport import (
    Transport,
    TransportContext,
    TransportError,
    TransportNotFound,
    available_transports,
    load_transport,
)
from kvflow.worker import WorkerEngine

from ..compat import untested_version
from ..groups import Pending, transfer_groups
from ..hidden_states import (
    HiddenStatesExporter,
    HiddenStatesPlanner,
    extracts_hidden_states,
    hidden_layer,
)
from ..kv_events import ChunkReport, KVFlowWorkerMeta
from ..stats import KVFlowPromMetrics, KVFlowStats
from .cache_spec import (
    _shard,
    check_spec,
    fingerprint,
    fit_config,
    kv_events_on,
    layer_specs,
    layout_from_tensors,
)
from .metadata import KVFlowHandshake, KVFlowMetadata
from .scheduler import KVFlowScheduler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1 import metrics
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvflow.scheduler import SchedulerEngine
    from kvflow.security import Channel

__all__ = ["KVFlowConnector"]

log = logging.getLogger("kvflow.vllm")


class KVFlowConnector(KVConnectorBase_V1, SupportsHMA):
    """kvflow as a vLLM KV connector (both roles): what they share (set by `_configure`
    and `_start`, read by the sides), and the role's side, which vLLM's calls go to."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        if warning := untested_version(vllm.__version__):
            log.warning(warning)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        side = KVFlowScheduler if role == KVConnectorRole.SCHEDULER else KVFlowWorker
        self._start(side, self._configure(vllm_config, kv_cache_config))
        built = side(self, vllm_config, kv_cache_config)
        self.scheduler_side = built if isinstance(built, KVFlowScheduler) else None
        self.worker_side = built if isinstance(built, KVFlowWorker) else None
        log.info(
            "kvflow %s ready: transport=%s namespace=%s load_mode=%s",
            side.role,
            self.config.transport,
            ",".join(self.namespaces),
            self.config.load_mode,
        )

    def _configure(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Channel:
        """kvflow's configuration, fitted to vLLM's; returns the side channel's."""
        ktc = self._kv_transfer_config
        try:
            self.config: KVFlowConfig = parse_config(
                ktc.kv_connector_extra_config, transports=list(available_transports())
            )
            name = self.config.transport
            self.transport_cls = load_transport(name)
            self.options = parse_options(self.config.options, self.transport_cls.Options, name)
            channel = channel_of(self.config)
        except (ConfigError, TransportNotFound) as exc:
            raise ConfigError(f"KVFlowConnector: {exc}") from None
        self.engine_id = str(ktc.engine_id)
        self.groups = transfer_groups(kv_cache_config)  # each its keys, transport, engine
        store = self.transport_cls.capabilities.store
        self.config = fit_config(self.config, vllm_config, kv_cache_config, self.groups, store)
        self.block_size = kv_cache_config.kv_cache_groups[self.groups[0]].kv_cache_spec.block_size
        self.hash_block = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
        self.events = kv_events_on(vllm_config, self.block_size, self.hash_block)
        return channel

    def _start(self, side: type[KVFlowScheduler | KVFlowWorker], channel: Channel) -> None:
        """The runtime, bus and stats, and one open transport per KV cache group."""
        self.tp_rank, pp_rank, cpus, name = side.placement(self.config)
        self.runtime = Runtime(f"{self.engine_id[:8]}-{name}", cpus=cpus)
        self.bus = EventBus(Origin(self.engine_id, side.role, self.tp_rank))
        self.stats = StatsCollector()
        self.bus.subscribe(self.stats)
        if self.config.event_log:
            self.bus.subscribe(JsonlEventLog(self.config.event_log))
        if self.config.inspect:
            start_publisher(self.runtime, self.bus)
        pc = self._vllm_config.parallel_config
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.shards = [_shard(r, tp, p) for p in range(pp) for r in range(tp)]
        shard = _shard(self.tp_rank, tp, pp_rank)
        self.rank = self.shards.index(shard)
        fps = [fingerprint(self._vllm_config, self._kv_cache_config, g) for g in self.groups]
        self.namespaces = [fp.namespace() for fp in fps]
        self.scopes = [fp.pd_scope() for fp in fps]
        self.transports: list[Transport] = []  # per KV cache group, as namespaces, scopes
        for namespace in self.namespaces:
            ctx = TransportContext(
                engine_id=self.engine_id,
                role=side.role,
                namespace=namespace,
                shard=shard,
                shards=self.shards,
                channel=channel,
                rejected=self._rejected,
                progress_timeout_s=self.config.progress_timeout_s,
            )
            transport = self.transport_cls(self.options, ctx)
            self.runtime.add_closer(transport.aclose)  # also after a failed open: what it
            try:  # opened (a socket, a context) would hold the process at exit
                self.runtime.call(transport.open, timeout=60.0)
            except TransportError as exc:
                self.runtime.shutdown()
                raise ConfigError(
                    f"KVFlowConnector: transport {self.config.transport!r}: {exc}"
                ) from None
            self.transports.append(transport)
        self.transport = self.transports[0]

    def shutdown(self) -> None:
        end = time.monotonic() + self.config.shutdown_drain_s
        if self.worker_side is not None:
            self.worker_side.drain(end)
        self.runtime.shutdown()

    # ---------------------------------------------------------------- stats
    def _rejected(self, reason: str, detail: str) -> None:
        """An input from outside refused (any thread): counted, and in the event log."""
        self.runtime.submit(self.bus.emit, Rejected(reason=reason, detail=detail))

    def get_kv_connector_stats(self) -> metrics.KVConnectorStats | None:
        return None if (data := self.stats.take()) is None else KVFlowStats(data=data)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> metrics.KVConnectorStats:
        return KVFlowStats(data=data) if data else KVFlowStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[metrics.PromMetric], type[metrics.PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> metrics.KVConnectorPromMetrics:
        return KVFlowPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """No (vLLM 0.33+ asks): registered memory and CUDA IPC handles would point at
        memory that sleep released and wake remapped. vLLM refuses the combination."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # wait_for_layer_load / save_kv_layer run between layers

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a store is a cache: a dropped save is a later miss, never an error

    # ------------------------------------------------------------ scheduler
    @property
    def _to_scheduler(self) -> KVFlowScheduler:
        assert self.scheduler_side is not None, "scheduler-side call on a worker connector"
        return self.scheduler_side

    @property
    def sched(self) -> SchedulerEngine:
        """The first (for most models the only) KV cache group's scheduler engine."""
        return self._to_scheduler.sched

    def on_new_request(self, request: Request) -> None:
        self._to_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._to_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._to_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._to_scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._to_scheduler.request_finished_all_groups(request, block_ids)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._to_scheduler.set_xfer_handshake_metadata(metadata)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._to_scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        side = self.scheduler_side  # a worker's: none
        return [] if side is None else side.take_events()

    # --------------------------------------------------------------- worker
    @property
    def _to_worker(self) -> KVFlowWorker:
        assert self.worker_side is not None, "worker-side call on a scheduler connector"
        return self.worker_side

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._to_worker.build_connector_worker_meta()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        side = self.worker_side  # the scheduler's transports have no address
        return None if side is None else side.get_handshake_metadata()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._to_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._to_worker.bind_connector_metadata(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._to_worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._to_worker.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if (side := self.worker_side) is not None:  # the scheduler's: no layers
            side.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        if (side := self.worker_side) is not None:  # the scheduler's: no layers
            side.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._to_worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._to_worker.get_transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._to_worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._to_worker.get_block_ids_with_load_errors()


_HIDDEN = -1
"""`Pending`'s group for a request's hidden-state export (next to its KV groups')."""


class KVFlowWorker:
    """A worker's connector calls, on kvflow's worker engines."""

    role: ClassVar[Literal["scheduler", "worker"]] = "worker"

    @staticmethod
    def placement(config: KVFlowConfig) -> tuple[int, int, set[int] | None, str]:
        """Tensor and pipeline parallel ranks, the cores for kvflow's threads (None: any)
        and the runtime's name."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
        # vLLM's CPU workers are pinned to their compute cores, and every thread they
        # start with them: `worker_cpus` moves kvflow's elsewhere (decision 36)
        cpus = config.cpus() or None
        if cpus:
            log.info("kvflow: worker threads on cores %s", sorted(cpus))
        return tp_rank, pp_rank, cpus, f"worker{tp_rank}"

    def __init__(
        self, conn: KVFlowConnector, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        self.config = conn.config
        self.runtime = conn.runtime
        self.engine_id = conn.engine_id
        self.block_size = conn.block_size
        self.transports = conn.transports
        self._kv_cache_config = kv_cache_config
        self._num_blocks = kv_cache_config.num_blocks
        kv_cache_groups = kv_cache_config.kv_cache_groups
        self._group_layers = [set(kv_cache_groups[g].layer_names) for g in conn.groups]
        self.workers = [
            WorkerEngine(
                config=self.config,
                transport=transport,
                runtime=self.runtime,
                bus=conn.bus,
                report_chunks=conn.events,
            )
            for transport in conn.transports
        ]
        """The worker engines, one per KV cache group kvflow moves."""
        self._layer_index: dict[str, tuple[WorkerEngine, int]] = {}
        """A layer's engine and index in its group's layout (set at registration)."""
        self._rank = conn.rank
        """This worker's index in vLLM's shards (its KV events' reports say it)."""
        if conn.events:
            self._report_evictions(conn.namespaces)
        self._sending = Pending()
        self._receiving = Pending()
        self._exporter: HiddenStatesExporter | None = None
        """Under extract_hidden_states: copies them out and stores them."""
        if extracts_hidden_states(vllm_config):
            planner = HiddenStatesPlanner(vllm_config, kv_cache_config, self.config.transport)
            self._exporter = HiddenStatesExporter(
                self.runtime, conn.bus, self.config.save_timeout_s
            )
            self._hidden_writer = conn.tp_rank == 0
            transport_cls, options = conn.transport_cls, conn.options
            self._hidden_transport: Callable[[], Transport] = lambda: transport_cls(
                options, hidden_context(self.engine_id, "worker", planner.namespace)
            )

    def _report_evictions(self, namespaces: list[str]) -> None:
        """Hand what a transport's store evicted to the engine of its namespace (for
        vLLM's KV events)."""
        by_namespace = dict(zip(namespaces, self.workers, strict=True))

        def evicted(namespace: str, keys: list[str]) -> None:
            if (worker := by_namespace.get(namespace)) is not None:
                worker.chunks_evicted(keys)

        for transport in self.transports:
            transport.context.evicted = evicted

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        reports = [ChunkReport.of(w.take_chunk_outcomes(), self._rank) for w in self.workers]
        if all(r.is_empty() for r in reports):
            return None
        return KVFlowWorkerMeta(reports)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        addresses = [t.address for t in self.transports]
        return KVFlowHandshake(addresses) if any(addresses) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, spec in layer_specs(self._kv_cache_config).items():
            if name in kv_caches:
                check_spec(name, spec)
        for layers, worker in zip(self._group_layers, self.workers, strict=True):
            caches = {n: t for n, t in kv_caches.items() if n in layers}
            layout = layout_from_tensors(caches, self._num_blocks, self.block_size)
            worker.register(layout)
            self._layer_index.update((n, (worker, i)) for n, i in layout.index.items())
        if self._exporter is not None:
            self._register_hidden(kv_caches)
        for reg, shared in pinned_neighbours(self.engine_id):
            log.warning(
                "kvflow: this worker (pid %d) and engine %s's worker (pid %d) on this host "
                "are both pinned to CPU cores %s. vLLM's CPU workers busy-wait for their next "
                "step, so the two starve each other: steps stall, and P/D pulls between them "
                "wait tens of seconds. Give each instance its own cores with "
                "VLLM_CPU_OMP_THREADS_BIND (e.g. '0' for one, '1' for the other).",
                os.getpid(),
                reg.engine,
                reg.pid,
                sorted(shared),
            )

    def _register_hidden(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Under extract_hidden_states: the worker holding the cache-only layer on tensor
        parallel rank 0 stores the hidden states, through a transport of their own."""
        assert self._exporter is not None
        name = hidden_layer(self._kv_cache_config)
        if name is None or name not in kv_caches or not self._hidden_writer:
            return
        view = kv_caches[name]
        dtype = str(view.dtype).removeprefix("torch.")
        transport = self._hidden_transport()
        try:
            self.runtime.call(transport.open, timeout=60.0)
        except TransportError as exc:
            raise ConfigError(f"KVFlowConnector: hidden states: {exc}") from None
        self.runtime.add_closer(transport.aclose)
        layout = hidden_layout(self.block_size, view.shape[1], view.shape[3], dtype)
        self.runtime.call(transport.register, layout, timeout=60.0)
        self._exporter.register(transport, view, self._num_blocks)
        log.info("kvflow: storing hidden states of %s (%s)", name, layout.describe())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(connector_metadata, KVFlowMetadata)
        for g, (worker, plan) in enumerate(
            zip(self.workers, connector_metadata.plans, strict=True)
        ):
            self._sending.expect(plan.lent, g)
            self._receiving.expect((s.req for s in plan.loads if s.asynchronous), g)
            worker.bind(plan)
        if self._exporter is not None and connector_metadata.exports:
            self._sending.expect((e.req for e in connector_metadata.exports), _HIDDEN)
            self._exporter.export(connector_metadata.exports)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVFlowMetadata)
        for worker, plan in zip(self.workers, kv_connector_metadata.plans, strict=True):
            worker.preempt(plan.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # loads started in bind_connector_metadata; the layer gates' protocol is the
        # worker's (WorkerEngine.forward_started). Several KV cache groups load between
        # steps only: their gates are open.
        self.workers[0].forward_started()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if (at := self._layer_index.get(layer_name)) is not None:
            at[0].wait_layer(at[1])

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        if (at := self._layer_index.get(layer_name)) is None:
            return
        worker, i = at
        ready = None
        if kv_layer.is_cuda:
            event = torch.cuda.Event()
            event.record()
            ready = event.query
        worker.layer_finished(i, ready)

    def wait_for_save(self) -> None:
        for worker in self.workers:
            worker.end_step()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending: set[str] = set()
        recving: set[str] = set()
        for g, worker in enumerate(self.workers):
            worker.settle_loads()  # Model Runner V2 may ask before wait_for_save
            r = worker.take_results()
            sending |= self._sending.done(r.finished_sending, g)
            recving |= self._receiving.done(r.finished_recving, g, r.failed_recving)
        if self._exporter is not None:
            sending |= self._sending.done(self._exporter.take_done(), _HIDDEN)
        return KVConnectorTransferResults(
            finished_sending=sending,
            finished_recving=recving,
            failed_recving=self._receiving.take_failed(recving),
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks: set[int] = set()
        for worker in self.workers:
            worker.settle_loads()  # errors of this step's forward, whatever the order
            blocks |= worker.take_error_blocks()
        return blocks

    def drain(self, end: float) -> None:
        """Give saves and hidden-state exports in flight until `end` (`time.monotonic()`)."""
        for worker in self.workers:
            worker.drain(max(0.0, end - time.monotonic()))
        if self._exporter is not None:
            self._exporter.drain(max(0.0, end - time.monotonic()))
