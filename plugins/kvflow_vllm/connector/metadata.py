"""What kvflow's connector sends between its instances: the scheduler's plan for each
step (`KVFlowMetadata`) and a worker's peer endpoints at start (`KVFlowHandshake`), each
pickled as plain data."""

from __future__ import annotations

from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from kvflow.engine.metadata import WorkerPlan, decode_plan, encode_plan

from ..extract_hidden_states import HiddenExport

__all__ = ["KVFlowHandshake", "KVFlowMetadata"]


class KVFlowMetadata(KVConnectorMetadata):
    """Carries a `WorkerPlan` per KV cache group, and the hidden-state exports; pickles as
    their msgspec bytes, nothing else."""

    def __init__(self, plans: list[WorkerPlan], exports: list[HiddenExport] | None = None) -> None:
        self.plans = plans
        self.exports = exports or []

    @property
    def plan(self) -> WorkerPlan:
        """The first (for most models the only) group's plan."""
        return self.plans[0]

    def __reduce__(self) -> tuple[Any, tuple[list[bytes], bytes]]:
        plans = [encode_plan(p) for p in self.plans]
        return (_metadata_from_bytes, (plans, msgspec.msgpack.encode(self.exports)))


def _metadata_from_bytes(data: list[bytes], exports: bytes) -> KVFlowMetadata:
    return KVFlowMetadata(
        [decode_plan(d) for d in data], msgspec.msgpack.decode(exports, type=list[HiddenExport])
    )


class KVFlowHandshake(KVConnectorHandshakeMetadata):
    """A worker's peer endpoints, one per KV cache group, sent to its scheduler once at
    start (as plain strings)."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    def __reduce__(self) -> tuple[Any, tuple[list[str]]]:
        return (KVFlowHandshake, (list(self.addresses),))
