"""Stand-ins for a NIXL consumer of device memory, for the tests on hosts without a GPU."""

from __future__ import annotations

import torch

from kvflow.geometry.layout import KVLayout
from kvflow_nixl import NixlTransport
from kvflow_nixl._bounce import Bounce


class StridedNixl(NixlTransport):
    """READs every run of cells where it lies, never through the bounce buffer, on host
    memory."""

    async def register(self, layout: KVLayout) -> None:
        await super().register(layout)
        self._bounce = None


class TorchBounceNixl(NixlTransport):
    """READs cells in many small runs through a bounce region gathered and scattered by
    torch (as a consumer of device memory does), on host memory."""

    async def register(self, layout: KVLayout) -> None:
        await super().register(layout)
        assert self._bounce is not None
        self._bounce = Bounce(self._bounce.agent, self._bounce.backend, torch.device("cpu"))
