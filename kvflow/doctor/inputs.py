"""What `kvflow doctor` is given: a `kv_connector_extra_config` or a whole
`--kv-transfer-config`, as JSON text or `@file.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..findings import Findings

__all__ = ["CONNECTOR", "read_config"]

CONNECTOR = "KVFlowConnector"
TRANSFER_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "engine_id")
"""Keys of vLLM's KVTransferConfig that kvflow's own config lacks: a JSON object with one
of them is a whole `--kv-transfer-config`."""


def read_config(text: str | None, findings: Findings) -> tuple[bool, dict[str, Any] | None]:
    """(whether it reads, kvflow's `kv_connector_extra_config`) from `text`: JSON, or
    `@PATH` of a JSON file; None: nothing given (kvflow's defaults)."""
    if text is None:
        return True, None
    where = "the config"
    if text.startswith("@"):
        where = text[1:]
        try:
            text = Path(where).read_text()
        except OSError as exc:
            findings.fail("config", f"{where}: {exc.strerror}", "name a readable JSON file")
            return False, None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        findings.fail("config", f"{where} is not JSON: {exc}", "give it as JSON (quote it)")
        return False, None
    if not isinstance(raw, dict):
        findings.fail("config", f"{where} is not a JSON object", "give {...}")
        return False, None
    if not any(k in raw for k in TRANSFER_KEYS):
        return True, raw
    connector = raw.get("kv_connector")
    if connector is not None and connector != CONNECTOR:
        findings.warn(
            "kv_connector",
            f"kv_connector is {connector!r}: vLLM does not run kvflow with this config",
            f'"kv_connector": "{CONNECTOR}"',
        )
    return True, raw.get("kv_connector_extra_config") or {}
