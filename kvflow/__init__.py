"""kvflow: a structured-concurrency KV-cache connector framework for vLLM.

The core (this package) imports no vLLM module: the vLLM adapter lives in
`kvflow_vllm`, built-in transports in `kvflow_fs` and friends.

What this module exports is the public API (pinned by `tests/project/test_public_api.py`):
what a transport author implements and is handed (`Transport`, its jobs, context,
layout and errors, the `PeerTransport` base and its context), kvflow's configuration,
`with_host_tier` (a store behind the host-memory tier, to test it there) and `stacked`
(stores one below another, as the `tiers` option stacks them). The
conformance suites are in `kvflow.testing` (extra `kvflow[testing]`), the helpers a
peer transport's producer holds offers with in `kvflow.pd` (`HeldOffers`,
`select_blocks`, `answer_renew`, `renew_at`, `Renew`, `NotHeld`). Everything else is
kvflow's own and may change.
"""

from importlib import metadata as _metadata

from . import _moved
from .chunks import BadHeader, ChunkFailure, ChunkHeader, first_failure, layer_hash
from .config import ConfigError, KVFlowConfig
from .geometry.layout import KVLayout, LayerGeometry, LayoutError
from .keys import ChunkKey
from .pd.context import PeerContext, PeerRead
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

_moved.install()  # the modules 0.4 moved, by their old names until 0.5

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
    "KVFlowConfig",
    "KVLayout",
    "LayerGeometry",
    "LayoutError",
    "LoadJob",
    "NoOptions",
    "Offer",
    "PeerContext",
    "PeerOptions",
    "PeerRead",
    "PeerSource",
    "PeerTransport",
    "Renewed",
    "SaveJob",
    "TransferStuck",
    "Transport",
    "TransportContext",
    "TransportError",
    "first_failure",
    "layer_hash",
    "one_error",
    "stacked",
    "with_host_tier",
]

_MOVED_TO_PD = ("HeldOffers", "NotHeld", "Renew", "answer_renew", "renew_at", "select_blocks")


def __getattr__(name: str) -> object:
    """P/D's offer helpers, exported here before 0.4 (`kvflow.pd` holds them now): until
    0.5, with a `DeprecationWarning`."""
    if name in _MOVED_TO_PD:
        import warnings

        from . import pd

        warnings.warn(
            f"kvflow.{name} moved to kvflow.pd.{name}; the old name goes in kvflow 0.5",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(pd, name)
    return _moved.old_submodule(__name__, name)  # `import kvflow; kvflow.layout`
