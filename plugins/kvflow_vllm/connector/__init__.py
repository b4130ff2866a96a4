"""kvflow's vLLM KV connector.

`KVFlowConnector` (`connector.py`) is registered by this package's path in
`kvflow_vllm.plugin`; `metadata.py` holds what its instances send each other, and
`cache_spec.py` what vLLM's cache spec and requests say about the bytes it moves.
"""

from .connector import KVFlowConnector
from .metadata import KVFlowHandshake, KVFlowMetadata

__all__ = ["KVFlowConnector", "KVFlowHandshake", "KVFlowMetadata"]
