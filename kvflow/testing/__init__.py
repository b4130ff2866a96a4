"""`kvflow.testing`: tools for testing kvflow and its transports.

- `make_layout`, `fill_blocks` (from `kvflow.testing.layouts`): synthetic paged KV
  memory over real buffers.
- `TransportConformance` (from `kvflow.testing.conformance`): the pytest-trio suite
  every store transport must pass. Peer transports pass `PeerConformance`, from
  `kvflow.testing.peer_conformance`.
- `ContractViolation`, `Promise`, `violated` (from `kvflow.testing.contract`): how a
  broken promise of the `Transport` contract fails a test.

Both suites build on `kvflow.testing.suite` (`ConformanceSuite`: the `make_transport`
seam, the test layouts, the `kv` fixture) and `kvflow.testing.harness` (`Harness`,
`Chunks`, `GatedSave`: one test's instances, memory, jobs and checks). Everything but
the layouts is imported lazily, so using the layouts does not need pytest installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .layouts import fill_blocks, make_layout

if TYPE_CHECKING:
    from .conformance import ContractViolation, Promise, TransportConformance, violated

__all__ = [
    "ContractViolation",
    "Promise",
    "TransportConformance",
    "fill_blocks",
    "make_layout",
    "violated",
]

_CONFORMANCE = {"ContractViolation", "Promise", "TransportConformance", "violated"}


def __getattr__(name: str) -> Any:
    if name in _CONFORMANCE:
        from . import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
