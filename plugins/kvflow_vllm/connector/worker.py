"""A worker's side of kvflow's connector: a `WorkerEngine` per KV cache group kvflow
moves, over the KV caches vLLM registers, fed each step's plan and the model runner's
per-layer calls; and, under extract_hidden_states, the exporter that stores hidden
states."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvflow.config import ConfigError, KVFlowConfig
from kvflow.engine.cpu_pinning import pinned_neighbours
from kvflow.engine.worker import WorkerEngine
from kvflow.hidden_states import hidden_context, hidden_layout
from kvflow.tiers import HostTier, tiers_of
from kvflow.transport import Transport, TransportError

from ..extract_hidden_states import (
    HiddenStatesExporter,
    HiddenStatesPlanner,
    extracts_hidden_states,
    hidden_layer,
)
from ..groups import Pending
from ..kv_events import ChunkReport, KVFlowWorkerMeta, media
from .cache_spec import check_spec, layer_specs, layout_from_tensors
from .context import ConnectorContext, Placement, Role
from .metadata import KVFlowHandshake, KVFlowMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["KVFlowWorker"]

log = logging.getLogger("kvflow.vllm")

_HIDDEN = -1
"""`Pending`'s group for a request's hidden-state export (next to its KV groups')."""


class KVFlowWorker:
    """A worker's connector calls, on kvflow's worker engines."""

    role: ClassVar[Role] = "worker"

    @staticmethod
    def placement(config: KVFlowConfig) -> Placement:
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
        self, context: ConnectorContext, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        self.context = context
        """What this side shares with its connector (built once, frozen)."""
        self.config = context.config
        self.runtime = context.runtime
        self.engine_id = context.engine_id
        self.block_size = context.block_size
        self.transports = context.transports
        self._kv_cache_config = kv_cache_config
        self._num_blocks = kv_cache_config.num_blocks
        kv_cache_groups = kv_cache_config.kv_cache_groups
        self._group_layers = [set(kv_cache_groups[g].layer_names) for g in context.groups]
        self.workers = [
            WorkerEngine(
                config=self.config,
                transport=transport,
                runtime=self.runtime,
                bus=context.bus,
                report_chunks=context.events,
            )
            for transport in context.transports
        ]
        """The worker engines, one per KV cache group kvflow moves."""
        self._layer_index: dict[str, tuple[WorkerEngine, int]] = {}
        """A layer's engine and index in its group's layout (set at registration)."""
        self._rank = context.rank
        """This worker's index in vLLM's shards (its KV events' reports say it)."""
        self._media: list[dict[int, str]] = [{} for _ in self.workers]
        """Per KV cache group, the medium of each tier (by `id`) for KV events."""
        if context.events:
            self._report_evictions(context.namespaces)
        self._sending = Pending()
        self._receiving = Pending()
        self._exporter: HiddenStatesExporter | None = None
        """Under extract_hidden_states: copies them out and stores them."""
        if extracts_hidden_states(vllm_config):
            planner = HiddenStatesPlanner(
                vllm_config, kv_cache_config, self.config.transport, context.store_key
            )
            self._exporter = HiddenStatesExporter(
                self.runtime, context.bus, self.config.save_timeout_s
            )
            self._hidden_writer = context.tp_rank == 0
            transport_cls, options = context.transport_cls, context.options
            self._hidden_transport: Callable[[], Transport] = lambda: transport_cls(
                options,
                hidden_context(self.engine_id, "worker", planner.namespace, context.store_key),
            )

    def _report_evictions(self, namespaces: Sequence[str]) -> None:
        """Hand what each tier evicted to the engine of its namespace, named by the tier's
        medium (for vLLM's KV events), and learn each tier's medium for its saves."""
        by_namespace = dict(zip(namespaces, self.workers, strict=True))
        names = media(self.config)
        tiers = [  # (tier, medium) of each group's transport; none on a replica rank
            list(zip(ts, names, strict=True)) if (ts := tiers_of(t)) else []
            for t in self.transports
        ]
        self._media = [{id(t): m for t, m in group} for group in tiers]

        def evicted(medium: str) -> Callable[[str, list[str]], None]:
            def report(namespace: str, keys: list[str]) -> None:
                if (worker := by_namespace.get(namespace)) is not None:
                    worker.chunks_evicted(keys, medium)

            return report

        for group, namespace in zip(tiers, namespaces, strict=True):
            for tier, medium in group:
                if isinstance(tier, HostTier):  # its own, for its namespace only
                    tier.evicted = functools.partial(evicted(medium), namespace)
                else:
                    tier.context.evicted = evicted(medium)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        reports = [
            ChunkReport.of(w.take_chunk_outcomes(), self._rank, tiers)
            for w, tiers in zip(self.workers, self._media, strict=True)
        ]
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
        if len(self._kv_cache_config.kv_cache_groups) > 1:
            # A block id names a block of one group only: vLLM takes no block ids from a
            # model of several groups (it stops the engine). Their loads are asynchronous
            # (cache_spec.check_groups), and each failed one is in `failed_recving`.
            return set()
        return blocks

    def drain(self, end: float) -> None:
        """Give saves and hidden-state exports in flight until `end` (`time.monotonic()`)."""
        for worker in self.workers:
            worker.drain(max(0.0, end - time.monotonic()))
        if self._exporter is not None:
            self._exporter.drain(max(0.0, end - time.monotonic()))
