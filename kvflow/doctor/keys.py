"""`kvflow doctor`'s key checks: the key a P/D engine will hold (`key_file` or
`$KVFLOW_KEY`: readable, a key, the user's alone; else this host's key) and where its
producer may bind, both asking `kvflow.pd.security.channel_of`; and a store's key
(`store_key_file`), asking `kvflow.config.store_key_of`: each as the engine does."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError, KVFlowConfig, store_key_of
from ..findings import Findings
from ..keyfiles import HOST_KEY, KEY_ENV, runtime_dir
from ..pd.security import Channel, channel_of, is_loopback

__all__ = ["check_key", "check_peer_host", "check_store_key"]

KEYGEN = "make a key with `kvflow keygen PATH` and set 'key_file': PATH on every instance"
STORE_KEYGEN = (
    "make a key with `kvflow keygen PATH` and set 'store_key_file': PATH on every engine "
    "that shares the store's chunks"
)


def check_key(findings: Findings, cfg: KVFlowConfig, *, peer: bool) -> Channel | None:
    """The side channel a `peer` transport's engine will have (None if it cannot start;
    a store transport's needs no key and is not reported)."""
    try:
        channel = channel_of(cfg, peer=peer)
    except ConfigError as exc:
        what = str(exc).removeprefix("kv_connector_extra_config")
        findings.fail("key", what, KEYGEN)
        return None
    if not peer:
        return channel
    if channel.host:
        findings.ok(
            "key",
            f"this host's key ({runtime_dir() / HOST_KEY}): P/D between this user's instances "
            f"on this host, over loopback; channel {channel.mode}",
        )
    elif channel.keyed:
        findings.ok("key", f"{cfg.key_file or '$' + KEY_ENV}; channel {channel.mode}")
    else:
        findings.warn(
            "key",
            "none ('insecure'): the side channel is open to anyone who reaches it, and "
            "decode instances believe unsigned P/D params (any API client can forge them)",
            f"{KEYGEN}, then drop 'insecure'",
        )
    return channel


def check_peer_host(findings: Findings, options: Any, channel: Channel) -> None:
    """A peer transport's producer `host`: where the worker will refuse to bind."""
    host = getattr(options, "host", None)
    if not isinstance(host, str):
        return
    where = f"kv_connector_extra_config['options']['host'] {host!r}"
    if why := channel.bind_problem(host):
        findings.fail("p/d host", f"{where}: the worker refuses to start ({why})", KEYGEN)
    elif is_loopback(host):
        findings.ok("p/d host", f"{where} (loopback)")
    elif channel.keyed:
        findings.ok("p/d host", f"{where}, with a deployment key; channel {channel.mode}")
    else:
        findings.warn(
            "p/d host",
            f"{where} is routable, without a key, and 'insecure': anyone who reaches it can "
            "read this engine's KV",
            f"{KEYGEN}, then drop 'insecure'",
        )


def check_store_key(findings: Findings, cfg: KVFlowConfig, store: bool) -> None:
    """`store_key_file`, where set: a key the engine will read (the user's alone), and a
    `store` transport to key (a peer transport's engine refuses one)."""
    if not cfg.store_key_file:
        return
    try:
        store_key_of(cfg, store=store)
    except ConfigError as exc:
        what = str(exc).removeprefix("kv_connector_extra_config")
        findings.fail("store key", what, STORE_KEYGEN)
        return
    findings.ok(
        "store key",
        f"{cfg.store_key_file}: the store's chunk keys and layer checksums are keyed with it",
    )
