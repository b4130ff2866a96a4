"""What both roles of kvflow's connector share: `ConnectorContext`, built once per
connector instance by `build_context` (kvflow's configuration fitted to vLLM's, a
`Runtime`, an `EventBus`, stats, one open transport per KV cache group) and handed,
frozen, to the role's side. The sides hold it, never the connector (vLLM's nixl
package passes its sides plain configuration, likewise).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvflow.config import (
    ConfigError,
    KVFlowConfig,
    parse_config,
    parse_options,
    store_key_of,
)
from kvflow.observe.events import EventBus, Origin, Rejected
from kvflow.observe.log import JsonlEventLog
from kvflow.observe.stats import StatsCollector
from kvflow.observe.stream import start_publisher
from kvflow.pd.context import PeerContext
from kvflow.pd.security import channel_of
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

from ..groups import transfer_groups
from .cache_spec import fingerprint, fit_config, kv_events_on, model_shape

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvflow.keys import StoreKey
    from kvflow.pd.security import Channel

__all__ = [
    "ConnectorContext",
    "Placement",
    "Role",
    "build_context",
    "lower_tiers",
    "store_transports",
]

Role = Literal["scheduler", "worker"]

Placement = tuple[int, int, set[int] | None, str]
"""A side's tensor and pipeline parallel ranks, the cores for kvflow's threads (None:
any) and its runtime's name (`KVFlowScheduler.placement`, `KVFlowWorker.placement`)."""


@dataclass(frozen=True, slots=True)
class ConnectorContext:
    """What a connector's role side shares with the connector: set once, never
    reassigned (the runtime, bus and transports inside are live objects)."""

    config: KVFlowConfig
    """kvflow's configuration, fitted to vLLM's (`cache_spec.fit_config`)."""
    transport_cls: type[Transport]
    options: Any
    """`transport_cls`'s parsed options."""
    store_key: StoreKey | None
    engine_id: str
    groups: tuple[int, ...]
    """The KV cache groups kvflow moves (vLLM's indices), in the order of the next three."""
    namespaces: tuple[str, ...]
    scopes: tuple[str, ...]
    """Each group's P/D scope (`Fingerprint.pd_scope`)."""
    transports: tuple[Transport, ...]
    """Each group's transport, open (the stack below a host tier, a replica's view)."""
    block_size: int
    hash_block: int
    """Tokens of each of vLLM's `request.block_hashes` (a divisor of the block size)."""
    events: bool
    """Whether kvflow reports its blocks in vLLM's KV events."""
    tp_rank: int
    rank: int
    """This instance's index in vLLM's shards (stage by stage, rank by rank)."""
    runtime: Runtime
    bus: EventBus
    stats: StatsCollector
    event_log: JsonlEventLog | None
    rejected: Callable[[str, str], None]
    """An input from outside refused (any thread): counted, and in the event log."""

    @property
    def transport(self) -> Transport:
        """The first (for most models the only) KV cache group's transport."""
        return self.transports[0]


@dataclass(frozen=True, slots=True)
class _Fitted:
    """kvflow's configuration, fitted to vLLM's: what `build_context` starts from."""

    config: KVFlowConfig
    transport_cls: type[Transport]
    options: Any
    tiers: list[tuple[type[Transport], Any]]
    channel: Channel
    store_key: StoreKey | None
    engine_id: str
    groups: tuple[int, ...]
    block_size: int
    hash_block: int
    events: bool


def build_context(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    role: Role,
    placement: Callable[[KVFlowConfig], Placement],
) -> ConnectorContext:
    """What `role`'s side shares, placed by `placement`: the runtime, bus and stats,
    and one open transport per KV cache group; a `ConfigError` where vLLM's setup and
    kvflow's configuration do not fit, or a transport does not open."""
    fit = _fit(vllm_config, kv_cache_config)
    tp_rank, pp_rank, cpus, name = placement(fit.config)
    runtime = Runtime(f"{fit.engine_id[:8]}-{name}", cpus=cpus)
    bus = EventBus(Origin(fit.engine_id, role, tp_rank))
    stats = StatsCollector()
    bus.subscribe(stats)
    event_log = JsonlEventLog(fit.config.event_log) if fit.config.event_log else None
    if event_log is not None:
        bus.subscribe(event_log)
    if fit.config.inspect:
        start_publisher(runtime, bus)
    rejected = functools.partial(_rejected, runtime, bus)
    rank, namespaces, scopes, transports = _open_transports(
        fit, vllm_config, kv_cache_config, role, (tp_rank, pp_rank), runtime, rejected
    )
    return ConnectorContext(
        config=fit.config,
        transport_cls=fit.transport_cls,
        options=fit.options,
        store_key=fit.store_key,
        engine_id=fit.engine_id,
        groups=fit.groups,
        namespaces=namespaces,
        scopes=scopes,
        transports=transports,
        block_size=fit.block_size,
        hash_block=fit.hash_block,
        events=fit.events,
        tp_rank=tp_rank,
        rank=rank,
        runtime=runtime,
        bus=bus,
        stats=stats,
        event_log=event_log,
        rejected=rejected,
    )


def _rejected(runtime: Runtime, bus: EventBus, reason: str, detail: str) -> None:
    """An input from outside refused (any thread): counted, and in the event log."""
    runtime.submit(bus.emit, Rejected(reason=reason, detail=detail))


def _fit(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> _Fitted:
    """kvflow's configuration (`kv_connector_extra_config`), fitted to vLLM's."""
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None  # vLLM's connector base refuses to start without one
    try:
        config = parse_config(
            ktc.kv_connector_extra_config, transports=list(available_transports())
        )
        name = config.transport
        transport_cls = load_transport(name)
        options = parse_options(config.options, transport_cls.Options, name)
        tiers = lower_tiers(config, transport_cls)
        channel = channel_of(config, peer=transport_cls.capabilities.peer)
        caps = transport_cls.capabilities
        store_key = store_key_of(config, store=caps.store and not caps.peer)
    except (ConfigError, TransportNotFound) as exc:
        raise ConfigError(f"KVFlowConnector: {exc}") from None
    groups = tuple(transfer_groups(kv_cache_config))  # each its keys, transport, engine
    if config.cpu_cache_gib and (not caps.store or caps.peer):
        raise ConfigError(
            f"KVFlowConnector: kv_connector_extra_config['cpu_cache_gib']: transport "
            f"{name!r} is a peer transport; a host tier goes in front of a store "
            f"transport (valid choices: {', '.join(store_transports())})"
        )
    config = fit_config(config, vllm_config, kv_cache_config, groups, caps.store)
    block_size = kv_cache_config.kv_cache_groups[groups[0]].kv_cache_spec.block_size
    hash_block = getattr(kv_cache_config, "hash_block_size", None) or block_size
    return _Fitted(
        config=config,
        transport_cls=transport_cls,
        options=options,
        tiers=tiers,
        channel=channel,
        store_key=store_key,
        engine_id=str(ktc.engine_id),
        groups=groups,
        block_size=block_size,
        hash_block=hash_block,
        events=kv_events_on(vllm_config, block_size, hash_block),
    )


def _open_transports(
    fit: _Fitted,
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    role: Role,
    ranks: tuple[int, int],
    runtime: Runtime,
    rejected: Callable[[str, str], None],
) -> tuple[int, tuple[str, ...], tuple[str, ...], tuple[Transport, ...]]:
    """This instance's index in vLLM's shards, and each KV cache group's namespace, P/D
    scope and transport, opened on `runtime` (shut down if one does not open)."""
    tp_rank, pp_rank = ranks
    pc = vllm_config.parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    all_shards = [shard_name(r, tp, p) for p in range(pp) for r in range(tp)]
    shard = shard_name(tp_rank, tp, pp_rank)
    fps = [fingerprint(vllm_config, kv_cache_config, g) for g in fit.groups]
    namespaces = tuple(fp.namespace(fit.store_key) for fp in fps)
    scopes = tuple(fp.pd_scope() for fp in fps)
    heads = [model_shape(vllm_config, kv_cache_config, g).kv_heads for g in fit.groups]
    caps = fit.transport_cls.capabilities
    store = caps.store and not caps.peer
    cp = getattr(pc, "decode_context_parallel_size", 1) * getattr(
        pc, "prefill_context_parallel_size", 1
    )
    config = fit.config
    transports: list[Transport] = []  # per KV cache group, as namespaces, scopes
    for namespace, kv_heads in zip(namespaces, heads, strict=True):
        own, shards = shard, all_shards
        if store:  # replicated heads are stored once (`kvflow.shapes.replicas`)
            own, shards = store_shards(kv_heads, tp, pp, tp_rank, pp_rank, cp)
        ctx = TransportContext(
            engine_id=fit.engine_id,
            role=role,
            namespace=namespace,
            shard=own,
            shards=shards,
            tp_rank=tp_rank,
            tp_size=tp,
            pp_rank=pp_rank,
            kv_heads=kv_heads,
            store_key=fit.store_key,
        )
        if caps.peer:  # and what P/D needs
            ctx = PeerContext.of(
                ctx,
                channel=fit.channel,
                rejected=rejected,
                progress_timeout_s=config.progress_timeout_s,
            )
        transport = stack_of([(fit.transport_cls, fit.options), *fit.tiers], ctx)
        if role == "worker" and own != shard:  # another rank saves these heads
            transport = as_replica(transport)  # (behind its host tier)
        elif role == "worker" and config.cpu_cache_gib:
            share = config.cpu_cache_gib * 2**30 / len(shards) / len(heads)
            transport = with_host_tier(transport, int(share), config.cpu_cache_policy)
        runtime.add_closer(transport.aclose)  # also after a failed open: what it
        try:  # opened (a socket, a context) would hold the process at exit
            runtime.call(transport.open, timeout=60.0)
        except TransportError as exc:
            runtime.shutdown()
            raise ConfigError(f"KVFlowConnector: transport {config.transport!r}: {exc}") from None
        transports.append(transport)
    return all_shards.index(shard), namespaces, scopes, tuple(transports)


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
