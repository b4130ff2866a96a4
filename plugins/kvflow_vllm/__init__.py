"""kvflow's vLLM adapter: the only package that imports vLLM.

`KVFlowConnector` (in `kvflow_vllm.connector`) subclasses vLLM's
`KVConnectorBase_V1` and translates each call into kvflow's scheduler or
worker engine; `kvflow_vllm.plugin.register` makes it available by name.
"""

from .plugin import CONNECTOR_NAME, register

__all__ = ["CONNECTOR_NAME", "register"]
