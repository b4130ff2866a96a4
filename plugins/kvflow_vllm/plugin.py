"""The `vllm.general_plugins` entry point: registers `KVFlowConnector` by name.

vLLM loads general plugins once in every process (API server, engine core,
workers) and `KVConnectorFactory.register_connector` raises on a duplicate
name, so registration checks first and is safe to call any number of times.
"""

from __future__ import annotations

__all__ = ["CONNECTOR_NAME", "register"]

CONNECTOR_NAME = "KVFlowConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "kvflow_vllm.connector", "KVFlowConnector"
        )
