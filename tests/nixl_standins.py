"""A stand-in for a NIXL consumer of device memory, for the tests on hosts without a GPU."""

from __future__ import annotations

from kvflow.layout import KVLayout
from kvflow_nixl import NixlTransport


class StridedNixl(NixlTransport):
    """READs every run of cells where it lies, never through the bounce buffer (as a
    consumer of device memory does), on host memory."""

    async def register(self, layout: KVLayout) -> None:
        await super().register(layout)
        self._bounce = None
