"""What kvflow's conformance suites share: `ConformanceSuite`, the base class of the
store suite (`kvflow.testing.conformance.TransportConformance`) and of the peer suite
(`kvflow.testing.peer_conformance.PeerConformance`).

It holds the `make_transport` seam (the fixture every subclass defines), the suites'
test geometry (`num_layers`, `block_size`, `num_blocks`, `build_layout`,
`large_layout`), the `layout` fixture over `LAYOUT_KINDS`, and the `kv` fixture: a
`kvflow.testing.harness.Harness` over the transport under test, skipped where
`skip_reason` says the suite does not apply.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import pytest
import trio

from ..geometry.layout import KVLayout
from ..transport import Transport, TransportContext
from .harness import Harness, _single_errors
from .layouts import make_layout

__all__ = ["LAYOUT_KINDS", "ConformanceSuite"]

LAYOUT_KINDS = ["token", "hnd", "block"]
"""NHD planes (one K and one V run per token), HND planes (one per K/V head) and
vLLM's CPU cache (blocks packed, block-granular)."""


class ConformanceSuite:
    """What the store and peer suites share: the `make_transport` seam, layouts, harness."""

    pytestmark: ClassVar = pytest.mark.trio

    num_layers: ClassVar[int] = 3
    block_size: ClassVar[int] = 4
    num_blocks: ClassVar[int] = 64
    large_block_layers: ClassVar[int] = 2
    """The large-block test uses blocks of 2 MiB per layer (4 MiB per block over 2 layers)."""
    progress_timeout_s: ClassVar[float] = 10.0

    # -- fixtures --------------------------------------------------------------
    @pytest.fixture
    def make_transport(self) -> Callable[[TransportContext], Any]:
        raise NotImplementedError(
            f"subclass {type(self).__name__} and define a `make_transport` fixture returning "
            "a callable context -> unopened Transport (see kvflow.testing.conformance)"
        )

    @pytest.fixture(params=LAYOUT_KINDS)
    def layout(self, request: pytest.FixtureRequest) -> KVLayout:
        return self.build_layout(request.param == "block", hnd=request.param == "hnd")

    def build_layout(self, block_granular: bool, **kw: Any) -> KVLayout:
        """A test layout of this suite's geometry; `kw` overrides `make_layout` arguments."""
        args: dict[str, Any] = {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "block_granular": block_granular,
        }
        args.update(kw)
        return make_layout(**args)

    def large_layout(self, like: KVLayout) -> KVLayout:
        """Blocks of 256 tokens x 8 heads x 128 dims: 2 MiB per layer and block (float32,
        K and V), granular as `like`."""
        return self.build_layout(
            like.is_block_granular(),
            num_layers=self.large_block_layers,
            num_blocks=4,
            block_size=256,
            heads=8,
            head_dim=128,
        )

    @pytest.fixture
    async def kv(
        self, make_transport: Callable[[TransportContext], Any], layout: KVLayout
    ) -> AsyncIterator[Harness]:
        async with self.harness(make_transport, layout) as harness:
            yield harness

    @contextlib.asynccontextmanager
    async def harness(
        self, make_transport: Callable[[TransportContext], Any], layout: KVLayout
    ) -> AsyncIterator[Harness]:
        """What the `kv` fixture yields; skips transports the suite does not apply to."""
        skip = ""
        with _single_errors():
            async with trio.open_nursery() as nursery, contextlib.AsyncExitStack() as stack:
                harness = Harness(
                    make_transport,
                    layout,
                    stack,
                    nursery,
                    progress_timeout_s=self.progress_timeout_s,
                )
                probe = await harness.scheduler()
                skip = self.skip_reason(type(probe))
                if not skip:
                    yield harness
        if skip:
            pytest.skip(skip)

    def skip_reason(self, cls: type[Transport]) -> str:
        """Why this suite does not apply to transports of class `cls` ("" if it does)."""
        if "cpu" not in cls.capabilities.memory:
            return f"{cls.__name__} does not move cpu memory"
        return ""
