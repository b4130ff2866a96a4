"""kvflow's vLLM KV connector, `KVFlowConnector` (registered by this module path in
`kvflow_vllm.plugin`); `connector.py` holds it."""

from .connector import (
    KVFlowConnector,
    check_spec,
    fingerprint,
    layer_specs,
    layout_from_tensors,
    request_salt,
)
from .metadata import KVFlowHandshake, KVFlowMetadata

__all__ = [
    "KVFlowConnector",
    "KVFlowHandshake",
    "KVFlowMetadata",
    "check_spec",
    "fingerprint",
    "layer_specs",
    "layout_from_tensors",
    "request_salt",
]
