"""`kvflow doctor`'s side-channel checks: the deployment key (`key_file`: present,
readable, a key, owner-only) and a P/D producer bound beyond loopback without one."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ..config import KVFlowConfig
from ..findings import Findings
from ..pd.security import KEY_ENV, SecurityError, is_loopback, read_key

__all__ = ["check_key", "check_peer_host"]


def check_key(findings: Findings, cfg: KVFlowConfig) -> bool:
    """The key `cfg` names; True where the engine will have one."""
    keygen = "make a key with `kvflow keygen PATH` and set 'key_file': PATH on every instance"
    if not cfg.key_file:
        if not os.environ.get(KEY_ENV):
            if cfg.channel == "encrypted":
                findings.fail("key", "channel 'encrypted' and no key_file nor $KVFLOW_KEY", keygen)
            else:
                findings.ok("key", "none: the P/D side channel binds and pulls on loopback only")
            return False
        if why := _not_a_key(""):
            findings.fail("key", why, keygen)
            return False
        findings.ok("key", f"${KEY_ENV}; channel {cfg.channel}")
        return True
    try:
        st = Path(cfg.key_file).stat()
    except OSError as exc:
        findings.fail("key file", f"{cfg.key_file}: {exc.strerror}", keygen)
        return False
    if why := "not a file" if not stat.S_ISREG(st.st_mode) else _not_a_key(cfg.key_file):
        findings.fail("key file", f"{cfg.key_file}: {why}", keygen)
        return False
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        who = " and ".join(w for w, bits in (("group", 0o070), ("others", 0o007)) if mode & bits)
        findings.warn(
            "key file",
            f"{cfg.key_file} ({mode:04o}) is open to its {who}: whoever reads it can read and "
            "forge this deployment's P/D traffic",
            f"chmod 600 {cfg.key_file} (kvflow keygen writes it owner-only)",
        )
    else:
        findings.ok("key file", f"{cfg.key_file} ({mode:04o}); channel {cfg.channel}")
    return True


def _not_a_key(key_file: str) -> str:
    """Why `key_file` (or $KVFLOW_KEY, "") holds no key the engine can read ("" if it does)."""
    try:
        read_key(key_file)
    except SecurityError as exc:
        return str(exc)
    return ""


def check_peer_host(findings: Findings, cfg: KVFlowConfig, options: Any, keyed: bool) -> None:
    """A peer transport's producer `host`: beyond loopback it needs a key (or
    `insecure`); the worker refuses to start otherwise."""
    host = getattr(options, "host", None)
    if not isinstance(host, str):
        return
    where = f"kv_connector_extra_config['options']['host'] {host!r}"
    keygen = "`kvflow keygen PATH` and 'key_file': PATH on every instance"
    if keyed:
        findings.ok("p/d host", f"{where}, with a key")
    elif is_loopback(host):
        findings.ok("p/d host", f"{where} (loopback)")
    elif cfg.insecure:
        findings.warn(
            "p/d host",
            f"{where} is routable, without a key, and 'insecure': anyone who reaches it can "
            "read this engine's KV",
            f"{keygen}, then drop 'insecure'",
        )
    else:
        findings.fail(
            "p/d host",
            f"{where} is routable and no key is configured: the worker refuses to start "
            "(anyone who reaches it could read this engine's KV)",
            f"{keygen}, or 'insecure': true",
        )
