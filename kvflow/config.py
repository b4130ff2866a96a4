"""`kv_connector_extra_config` -> a validated `KVFlowConfig`.

Every error names the offending key and, where the value is one of a closed
set, the valid choices, so a bad config fails at engine start with a message a
user can act on.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

import msgspec

__all__ = [
    "ChannelMode",
    "ConfigError",
    "KVFlowConfig",
    "TierConfig",
    "default_cache_dir",
    "host_cpus",
    "parse_config",
    "parse_options",
    "store_key_of",
]

from ._moved import old_names
from .keyfiles import SecurityError, read_key
from .keys import StoreKey

LoadMode = Literal["layer", "async"]
Role = Literal["kv_both", "kv_producer", "kv_consumer"]


class ConfigError(ValueError):
    """A bad `kv_connector_extra_config`; the message names the key."""


class TierConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One store below `transport` (an item of `tiers`)."""

    transport: str
    options: dict[str, Any] = msgspec.field(default_factory=dict)


ChannelMode = Literal["encrypted", "kv-in-clear"]
"""What a keyed side channel protects: `encrypted`, every frame, KV bytes included
(ZMQ CURVE); `kv-in-clear`, the peers and the control frames (a one-time handshake
credential and a MAC on every control frame), KV bytes crossing as they are."""


class KVFlowConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """kvflow's own keys of `kv_connector_extra_config` (see docs/configuration.md)."""

    transport: str = "fs"
    """Name of an installed transport (entry-point group `kvflow.transports`)."""
    load_mode: LoadMode = "layer"
    """`layer`: load inside the step, layer by layer, overlapping compute.
    `async`: load between steps; the request waits until its KV has arrived."""
    load_timeout_s: float = 30.0
    save_timeout_s: float = 120.0
    preempt_timeout_s: float = 2.0
    """How long vLLM's preemption waits for the preempted requests' saves to stop (a
    cancelled save never stores its chunks, so later it only wastes a read)."""
    lookup_timeout_s: float = 5.0
    hold_timeout_s: float = 30.0
    """P/D producer: how long a finished request's blocks wait for a consumer to claim
    them (the consumer claims a request as it arrives, before it is scheduled; a claimed
    offer is then held by its consumer's renewals, up to `max_hold_s`)."""
    max_offer_fraction: float = 0.5
    """P/D producer: the most of its KV cache blocks that offers may hold at once; a
    prefill that would hold more returns no P/D params (its decode computes the prompt)
    and gives its blocks back, so clients that ask for prefills and never decode cannot
    fill the KV cache."""
    lease_s: float = 30.0
    """P/D consumer: a claim holds the producer's blocks this long past its latest
    renewal; the consumer renews every `lease_s / 3` while the request waits."""
    progress_timeout_s: float = 2.0
    """P/D consumer: the longest it waits for its producer's next sign of life (the
    answer to a claim or a renewal, the next part of a pull) before it takes the producer
    for dead or hung and fails the load at once (vLLM recomputes or fails the request,
    as `kv_load_failure_policy` says) instead of at `load_timeout_s`."""
    max_hold_s: float = 600.0
    """P/D producer: the longest it holds a request's blocks, renewals or not."""
    key_file: str = ""
    """A file holding the deployment's secret (`kvflow keygen PATH` makes one; it must be
    the user's alone); unset, `$KVFLOW_KEY` holds it, if set. With a key, the P/D side
    channel answers only peers that hold it, and consumers believe only P/D params it
    signed (docs/security.md). Without one, P/D instances of one user on one host share
    a host key made on first use in a private runtime directory (loopback only)."""
    channel: ChannelMode | None = None
    """What the side channel protects: `encrypted` (ZMQ CURVE: every frame, KV included,
    is encrypted and authenticated) or `kv-in-clear` (the peers and the control frames
    are authenticated; KV bytes cross as they are). Unset: `encrypted` with a
    deployment key (it crosses networks), `kv-in-clear` with the host key (loopback)."""
    insecure: bool = False
    """Allow P/D without any key, beyond loopback: anyone who reaches the side channel can
    read this engine's KV, and consumers believe unsigned P/D params (any API client can
    forge them)."""
    store_key_file: str = ""
    """A store transport's secret (`kvflow keygen PATH` makes one; it must be the user's
    alone): chunk keys and each layer's checksum are keyed with it, so whoever can
    write or read the store without it can neither plant KV that loads nor tell which
    prompts were sent; deployments with different keys share no chunk. Unset: chunk keys
    anyone can compute, unkeyed checksums (docs/security.md#stores)."""
    shutdown_drain_s: float = 10.0
    """At shutdown, how long in-flight saves may finish before they are cancelled."""
    max_concurrent_transfers: int = 16
    save_partial_blocks: bool = True
    """Save a prompt's trailing partial block, so a warm request recomputes one token."""
    event_log: str = ""
    """Append every event as a JSON line to this file (all runtimes may share it)."""
    inspect: bool = True
    """Publish live events for `kvflow inspect` (a local ZMQ socket; never blocks)."""
    worker_cpus: str = ""
    """Cores for kvflow's worker threads, e.g. "1" or "2-3,6": for vLLM's CPU build,
    which pins each worker, and every thread it starts, to its compute cores. "": where
    vLLM put the worker."""
    cpu_cache_gib: float = 0.0
    """A host-memory tier in front of the store transport: this many GiB per engine, split
    evenly over its workers (and KV cache groups), allocated at start (pinned where CUDA
    is present). Saves give vLLM its blocks back once their bytes are there and are
    written to the store from it; loads read it first. 0: no tier (`kvflow.tiers`)."""
    cpu_cache_policy: Literal["s3fifo", "lru"] = "s3fifo"
    """Which chunk a full host tier gives up (bench/bench_tier.py compares them)."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Options of the chosen transport, validated by the transport itself."""
    tiers: list[TierConfig] = msgspec.field(default_factory=list)
    """Store transports below `transport`, fastest first, each `{"transport": name,
    "options": {...}}`: lookups find a chunk in any, saves go to all, loads read the
    highest that holds it and copy what came from below into the tier above
    (`kvflow.tiers.stacked`)."""

    def cpus(self) -> set[int]:
        """`worker_cpus` as core ids (empty: unset)."""
        out: set[int] = set()
        for part in filter(None, self.worker_cpus.replace(" ", "").split(",")):
            first, _, last = part.partition("-")
            if not re.fullmatch(r"\d+(-\d+)?", part) or int(last or first) < int(first):
                raise ConfigError(
                    f"kv_connector_extra_config['worker_cpus']: {self.worker_cpus!r} is not a "
                    "core list like '1' or '2-3,6'"
                )
            out.update(range(int(first), int(last or first) + 1))
        return out

    def check(self) -> None:
        for key in (
            "load_timeout_s",
            "save_timeout_s",
            "preempt_timeout_s",
            "lookup_timeout_s",
            "hold_timeout_s",
            "lease_s",
            "progress_timeout_s",
            "max_hold_s",
            "shutdown_drain_s",
        ):
            if not getattr(self, key) > 0:  # NaN too
                raise ConfigError(f"kv_connector_extra_config[{key!r}] must be > 0")
        if self.max_hold_s < max(self.hold_timeout_s, self.lease_s):
            raise ConfigError(
                "kv_connector_extra_config['max_hold_s'] must be >= hold_timeout_s and lease_s"
            )
        if not 0 < self.max_offer_fraction <= 1:  # NaN too
            raise ConfigError(
                "kv_connector_extra_config['max_offer_fraction'] must be > 0 and <= 1"
            )
        if not self.cpu_cache_gib >= 0:  # NaN too
            raise ConfigError("kv_connector_extra_config['cpu_cache_gib'] must be >= 0")
        if self.max_concurrent_transfers < 1:
            raise ConfigError("kv_connector_extra_config['max_concurrent_transfers'] must be >= 1")
        if (cpus := self.cpus()) and not cpus <= (host := host_cpus()):
            raise ConfigError(
                f"kv_connector_extra_config['worker_cpus']: {self.worker_cpus!r} names cores "
                f"this host lacks (it has {','.join(map(str, sorted(host)))})"
            )


def store_key_of(cfg: KVFlowConfig, *, store: bool = True) -> StoreKey | None:
    """The store key `store_key_file` names (None if unset); a `ConfigError` naming it if
    the file is not one, or not the user's alone, or the transport (`store`) is no store."""
    if not cfg.store_key_file:
        return None
    where = "kv_connector_extra_config['store_key_file']"
    if not store:
        raise ConfigError(
            f"{where}: transport {cfg.transport!r} is a peer transport; a store key keys a "
            "store's chunks (drop store_key_file, or use a store transport)"
        )
    try:
        secret = read_key(cfg.store_key_file)
    except SecurityError as exc:  # its message says key_file: this is store_key_file
        said = str(exc).replace(f"key_file {cfg.store_key_file!r}", repr(cfg.store_key_file))
        raise ConfigError(f"{where}: {said}") from None
    assert secret is not None  # a file was named: read_key raised or read it
    return StoreKey(secret)


def host_cpus() -> set[int]:
    """The cores processes here may use: init's (a container's cpuset)."""
    try:
        return os.sched_getaffinity(1)
    except OSError:
        return set(range(os.cpu_count() or 1))


S = TypeVar("S", bound=msgspec.Struct)


def _convert(raw: dict[str, Any], typ: type[S], where: str) -> S:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(raw).__name__}")
    fields = msgspec.structs.fields(typ)
    names = [f.name for f in fields]
    for key in raw:
        if key not in names:
            raise ConfigError(
                f"{where}: unknown key {key!r}; valid keys: {', '.join(sorted(names))}"
            )
    try:
        return msgspec.convert(raw, typ, str_keys=True)
    except ConfigError:
        raise
    except msgspec.ValidationError as exc:
        key = str(exc).rpartition("`$.")[2].rstrip("`").split(".")[0].split("[")[0]
        hint = ""
        for f in fields:
            if f.name == key and (choices := _choices(f.type)):
                hint = f"; valid choices: {', '.join(choices)}"
        raise ConfigError(f"{where}[{key!r}]: {exc}{hint}") from None


def _choices(typ: Any) -> list[str]:
    """The values a `Literal` field (or an optional one) takes; [] for other types."""
    if getattr(typ, "__origin__", None) is Literal:
        return [str(a) for a in get_args(typ)]
    return [c for arg in get_args(typ) for c in _choices(arg)]


def parse_config(raw: dict[str, Any] | None, *, transports: list[str]) -> KVFlowConfig:
    """Validate kvflow's keys; `transports` are the installed transport names."""
    cfg = _convert({} if raw is None else raw, KVFlowConfig, "kv_connector_extra_config")
    cfg.check()
    if cfg.transport not in transports:
        raise ConfigError(
            f"kv_connector_extra_config['transport']: {cfg.transport!r} is not an installed "
            f"transport; valid choices: {', '.join(sorted(transports))}"
        )
    for i, tier in enumerate(cfg.tiers):
        if tier.transport not in transports:
            raise ConfigError(
                f"kv_connector_extra_config['tiers'][{i}]['transport']: {tier.transport!r} is "
                f"not an installed transport; valid choices: {', '.join(sorted(transports))}"
            )
    return cfg


def parse_options(raw: dict[str, Any], typ: type[S], transport: str, where: str = "") -> S:
    """Validate a transport's `options` against its Options Struct (`where`: the key
    holding them, if not `options`)."""
    key = where or "kv_connector_extra_config['options']"
    return _convert(raw, typ, f"{key} (transport {transport!r})")


def default_cache_dir() -> Path:
    """The per-user cache directory kvflow writes to unless told otherwise."""
    base = os.environ.get("KVFLOW_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "kvflow"


# What 0.4 moved to kvflow.pd.security, by name (imported on use, until 0.5).
__getattr__ = old_names(__name__, {"channel_of": "kvflow.pd.security:channel_of"})
