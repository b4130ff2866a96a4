"""kvflow's vLLM KV connector, laid out as vLLM's NixlConnector package is.

- `connector.py`: `KVFlowConnector`, registered by this package's path in
  `kvflow_vllm.plugin`: builds what both roles share and forwards each vLLM call to
  its role's side;
- `context.py`: `ConnectorContext`, what both roles share (built once, frozen): each
  side gets it, never the connector, so no side module imports `connector.py`;
- `scheduler.py`: `KVFlowScheduler`, the scheduler's side;
- `worker.py`: `KVFlowWorker`, a worker's side;
- `metadata.py`: what the scheduler and the workers send each other;
- `cache_spec.py`: what vLLM's cache spec and settings mean for the KV kvflow moves.
"""

from .connector import KVFlowConnector
from .metadata import KVFlowHandshake, KVFlowMetadata

__all__ = ["KVFlowConnector", "KVFlowHandshake", "KVFlowMetadata"]
