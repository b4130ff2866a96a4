"""`KVFlowConnector`: vLLM's `KVConnectorBase_V1`, translated into kvflow's engines.

Each instance (the scheduler's, and one per worker) builds what both roles share (the
configuration, a `Runtime`, an `EventBus`, stats, a transport per KV cache group), then
its role's side (`KVFlowScheduler`, `KVFlowWorker`), and forwards every vLLM call to it.
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

from kvflow.config import (
    ConfigError,
    KVFlowConfig,
    channel_of,
    parse_config,
    parse_options,
    store_key_of,
)
from kvflow.observe.events import EventBus, Origin, Rejected
from kvflow.observe.log import JsonlEventLog
from kvflow.observe.stats import StatsCollector
from kvflow.observe.stream import start_publisher
from kvflow.runtime import Runtime
from kvflow.shapes.replicas import as_replica, store_shards
from kvflow.shapes.reshape import shard_name
from kvflow.tiers import stack_of, with_host_tier
from kvflow.transport import (
    Transport,
    TransportContext,
    TransportError,
    TransportNotFound,
    available_transports,
    load_transport,
)

from ..compat import untested_version
from ..groups import transfer_groups
from ..metrics import KVFlowPromMetrics, KVFlowStats
from .cache_spec import fingerprint, fit_config, kv_events_on, model_shape
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

    from kvflow.engine.scheduler import SchedulerEngine
    from kvflow.pd.security import Channel

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
            self.tiers = lower_tiers(self.config, self.transport_cls)
            channel = channel_of(self.config, peer=self.transport_cls.capabilities.peer)
            caps = self.transport_cls.capabilities
            self.store_key = store_key_of(self.config, store=caps.store and not caps.peer)
        except (ConfigError, TransportNotFound) as exc:
            raise ConfigError(f"KVFlowConnector: {exc}") from None
        self.engine_id = str(ktc.engine_id)
        self.groups = transfer_groups(kv_cache_config)  # each its keys, transport, engine
        caps = self.transport_cls.capabilities
        if self.config.cpu_cache_gib and (not caps.store or caps.peer):
            raise ConfigError(
                f"KVFlowConnector: kv_connector_extra_config['cpu_cache_gib']: transport "
                f"{name!r} is a peer transport; a host tier goes in front of a store "
                f"transport (valid choices: {', '.join(store_transports())})"
            )
        self.config = fit_config(self.config, vllm_config, kv_cache_config, self.groups, caps.store)
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
        self.event_log = JsonlEventLog(self.config.event_log) if self.config.event_log else None
        if self.event_log is not None:
            self.bus.subscribe(self.event_log)
        if self.config.inspect:
            start_publisher(self.runtime, self.bus)
        pc = self._vllm_config.parallel_config
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.shards = [shard_name(r, tp, p) for p in range(pp) for r in range(tp)]
        shard = shard_name(self.tp_rank, tp, pp_rank)
        self.rank = self.shards.index(shard)
        fps = [fingerprint(self._vllm_config, self._kv_cache_config, g) for g in self.groups]
        self.namespaces = [fp.namespace(self.store_key) for fp in fps]
        self.scopes = [fp.pd_scope() for fp in fps]
        heads = [
            model_shape(self._vllm_config, self._kv_cache_config, g).kv_heads for g in self.groups
        ]
        caps = self.transport_cls.capabilities
        store = caps.store and not caps.peer
        cp = getattr(pc, "decode_context_parallel_size", 1) * getattr(
            pc, "prefill_context_parallel_size", 1
        )
        self.transports: list[Transport] = []  # per KV cache group, as namespaces, scopes
        for namespace, kv_heads in zip(self.namespaces, heads, strict=True):
            own, shards = shard, self.shards
            if store:  # replicated heads are stored once (`kvflow.shapes.replicas`)
                own, shards = store_shards(kv_heads, tp, pp, self.tp_rank, pp_rank, cp)
            ctx = TransportContext(
                engine_id=self.engine_id,
                role=side.role,
                namespace=namespace,
                shard=own,
                shards=shards,
                channel=channel,
                rejected=self._rejected,
                progress_timeout_s=self.config.progress_timeout_s,
                tp_rank=self.tp_rank,
                tp_size=tp,
                pp_rank=pp_rank,
                kv_heads=kv_heads,
                store_key=self.store_key,
            )
            transport = stack_of([(self.transport_cls, self.options), *self.tiers], ctx)
            if side.role == "worker" and own != shard:  # another rank saves these heads
                transport = as_replica(transport)  # (behind its host tier)
            elif side.role == "worker" and self.config.cpu_cache_gib:
                share = self.config.cpu_cache_gib * 2**30 / len(shards) / len(heads)
                transport = with_host_tier(transport, int(share), self.config.cpu_cache_policy)
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
        if self.event_log is not None:
            self.event_log.close()  # with what its rate limit held back

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


def lower_tiers(config: KVFlowConfig, upper: type[Transport]) -> list[tuple[type[Transport], Any]]:
    """Each of `config.tiers` as its transport class and parsed options; a ConfigError
    naming the key where one is not a store (or `transport` is not, with tiers below), or
    cannot do what `transport` does (kvflow plans with `transport`'s capabilities)."""
    out: list[tuple[type[Transport], Any]] = []
    for i, tier in enumerate(config.tiers):
        where = f"kv_connector_extra_config['tiers'][{i}]"
        cls = load_transport(tier.transport)
        for key, c in (("kv_connector_extra_config", upper), (where, cls)):
            if not c.capabilities.store or c.capabilities.peer:
                raise ConfigError(
                    f"{key}['transport']: {c.name!r} is not a store transport; stores stack (valid "
                    f"choices: {', '.join(store_transports())})"
                )
        mine, theirs = upper.capabilities, cls.capabilities
        if not mine.memory <= theirs.memory or (mine.reshape and not theirs.reshape):
            raise ConfigError(
                f"{where}['transport']: {cls.name!r} moves less than {upper.name!r} "
                "(memory kinds, or loads across TP sizes and block sizes): it cannot be "
                "below it"
            )
        out.append((cls, parse_options(tier.options, cls.Options, cls.name, f"{where}['options']")))
    return out


def store_transports() -> list[str]:
    """The installed transports a host tier can front (stores, not peers)."""
    out = []
    for name in sorted(available_transports()):
        try:
            caps = load_transport(name).capabilities
        except Exception:  # a broken plugin is named where it is chosen
            continue
        if caps.store and not caps.peer:
            out.append(name)
    return out
