"""kvflow: a structured-concurrency KV-cache connector framework for vLLM.

The core (this package) imports no vLLM module: the vLLM adapter lives in
`kvflow_vllm`, built-in transports in `kvflow_fs` and friends.
"""

from .config import ConfigError, KVFlowConfig
from .keys import ChunkKey, Fingerprint, chunk_keys
from .runtime import Runtime, RuntimeClosed
from .transport import (
    Capabilities,
    ChunkCorrupt,
    ChunkMissing,
    LoadJob,
    SaveJob,
    Transport,
    TransportContext,
    TransportError,
)

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "ChunkCorrupt",
    "ChunkKey",
    "ChunkMissing",
    "ConfigError",
    "Fingerprint",
    "KVFlowConfig",
    "LoadJob",
    "Runtime",
    "RuntimeClosed",
    "SaveJob",
    "Transport",
    "TransportContext",
    "TransportError",
    "chunk_keys",
]
