"""The peer conformance suite against the `nixl` transport: real NIXL agents (UCX, DRAM)
and real side-channel sockets."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvflow.testing.peer_conformance import PeerConformance
from kvflow.transport import TransportContext
from kvflow_nixl import NixlOptions, NixlTransport

pytest.importorskip("nixl_cu12", reason="NIXL is an optional extra: pip install 'kvflow[nixl]'")


class TestNixlConformance(PeerConformance):
    @pytest.fixture
    def make_transport(self) -> Callable[[TransportContext], NixlTransport]:
        return lambda context: NixlTransport(NixlOptions(), context)
