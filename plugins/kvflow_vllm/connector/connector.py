"""`KVFlowConnector`: vLLM's `KVConnectorBase_V1`, translated into kvflow's engines.

Each instance (the scheduler's, and one per worker) builds what both roles share once
(`context.ConnectorContext`: the configuration, a `Runtime`, an `EventBus`, stats, a
transport per KV cache group), hands it to its role's side (`KVFlowScheduler`,
`KVFlowWorker`), which never sees the connector, and forwards every vLLM call to it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

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

from ..compat import untested_version
from ..metrics import KVFlowPromMetrics, KVFlowStats
from .context import ConnectorContext, build_context
from .scheduler import KVFlowScheduler
from .worker import KVFlowWorker

if TYPE_CHECKING:
    import torch
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

__all__ = ["KVFlowConnector"]

log = logging.getLogger("kvflow.vllm")


class KVFlowConnector(KVConnectorBase_V1, SupportsHMA):
    """kvflow as a vLLM KV connector (both roles): what they share (`context`, built
    once, frozen, handed to the side), and the role's side, which vLLM's calls go to."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        if warning := untested_version(vllm.__version__):
            log.warning(warning)
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        side = KVFlowScheduler if role == KVConnectorRole.SCHEDULER else KVFlowWorker
        self.context: ConnectorContext = build_context(
            vllm_config, kv_cache_config, side.role, side.placement
        )
        """What both roles share, built once; the side gets it, never the connector."""
        built = side(self.context, vllm_config, kv_cache_config)
        self.scheduler_side = built if isinstance(built, KVFlowScheduler) else None
        self.worker_side = built if isinstance(built, KVFlowWorker) else None
        log.info(
            "kvflow %s ready: transport=%s namespace=%s load_mode=%s",
            side.role,
            self.context.config.transport,
            ",".join(self.context.namespaces),
            self.context.config.load_mode,
        )

    def shutdown(self) -> None:
        ctx = self.context
        end = time.monotonic() + ctx.config.shutdown_drain_s
        if self.worker_side is not None:
            self.worker_side.drain(end)
        ctx.runtime.shutdown()
        if ctx.event_log is not None:
            ctx.event_log.close()  # with what its rate limit held back

    # ---------------------------------------------------------------- stats
    def get_kv_connector_stats(self) -> metrics.KVConnectorStats | None:
        return None if (data := self.context.stats.take()) is None else KVFlowStats(data=data)

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
        self._to_scheduler.set_handshakes([m for _, m in sorted(metadata.items())])

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """What vLLM's engine core calls: every worker's handshake by (pp_rank, tp_rank)
        (the base refuses pp_rank > 0: a pipeline-parallel engine would not start). Sorted,
        they are kvflow's shards in order, stage by stage."""
        self._to_scheduler.set_handshakes([m for _, m in sorted(metadata.items())])

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
