"""kvflow: a structured-concurrency KV-cache connector framework for vLLM.

The core (this package) imports no vLLM module: the vLLM adapter lives in
`kvflow_vllm`, built-in transports in `kvflow_fs` and friends.

What this module exports is the public API (pinned by `tests/project/test_public_api.py`):
what a transport author implements and is handed (`Transport`, its jobs, context,
layout and errors, the `PeerTransport` base and its helpers), kvflow's configuration,
`with_host_tier` (a store behind the host-memory tier, to test it there) and `stacked`
(stores one below another, as the `tiers` option stacks them). The
conformance suites are in `kvflow.testing` (extra `kvflow[testing]`). Everything
else is kvflow's own and may change.
"""

from importlib import metadata as _metadata

from .chunks import BadHeader, ChunkFailure, ChunkHeader, first_failure, layer_hash
from .config import ConfigError, KVFlowConfig
from .geometry.layout import KVLayout, LayerGeometry, LayoutError
from .keys import ChunkKey
from .pd.offers import HeldOffers, NotHeld, Renew, answer_renew, renew_at, select_blocks
from .pd.peer_transport import PeerOptions, PeerTransport
from .tiers import stacked, with_host_tier
from .transport import (
    Capabilities,
    ChunkCorrupt,
    ChunkMissing,
    LoadJob,
    NoOptions,
    Offer,
    PeerSource,
    Renewed,
    SaveJob,
    TransferStuck,
    Transport,
    TransportContext,
    TransportError,
    one_error,
)
from .zmqio import BadFrame

try:  # one place to bump: pyproject.toml's version, read back from the installed metadata
    __version__ = _metadata.version("kvflow")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "BadFrame",
    "BadHeader",
    "Capabilities",
    "ChunkCorrupt",
    "ChunkFailure",
    "ChunkHeader",
    "ChunkKey",
    "ChunkMissing",
    "ConfigError",
    "HeldOffers",
    "KVFlowConfig",
    "KVLayout",
    "LayerGeometry",
    "LayoutError",
    "LoadJob",
    "NoOptions",
    "NotHeld",
    "Offer",
    "PeerOptions",
    "PeerSource",
    "PeerTransport",
    "Renew",
    "Renewed",
    "SaveJob",
    "TransferStuck",
    "Transport",
    "TransportContext",
    "TransportError",
    "answer_renew",
    "first_failure",
    "layer_hash",
    "one_error",
    "renew_at",
    "select_blocks",
    "stacked",
    "with_host_tier",
]
