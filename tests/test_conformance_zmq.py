"""The peer conformance suite against the `zmq` transport on real sockets, and checked
itself: each deliberately broken variant fails the test guarding the promise it breaks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import msgspec
import pytest

from kvflow.testing.conformance import ContractViolation
from kvflow.testing.peer_conformance import PeerConformance, PeerPromise
from kvflow.transport import ChunkMissing, LoadJob, TransportContext, TransportError
from kvflow_zmq import ZmqOptions, ZmqTransport


class TestZmqConformance(PeerConformance):
    @pytest.fixture
    def make_transport(self) -> Callable[[TransportContext], ZmqTransport]:
        return lambda context: ZmqTransport(ZmqOptions(), context)


# -- broken variants: each must fail the test guarding the promise it breaks ----------


class NeverReleases(ZmqTransport):
    """Ignores the consumer's Done and Failed: holds the blocks until the deadline."""

    async def open(self) -> None:
        await super().open()
        self.held.release = lambda req, outcome: False  # type: ignore[method-assign]


class FlipsAByte(ZmqTransport):
    async def load(self, job: LoadJob) -> None:
        await super().load(job)
        job.spans(job.num_layers - 1)[-1][0][0] ^= 0xFF


class RefusalIsNotMissing(ZmqTransport):
    async def load(self, job: LoadJob) -> None:
        try:
            await super().load(job)
        except ChunkMissing as exc:
            raise TransportError(str(exc)) from None


class PullsFromShard0(ZmqTransport):
    async def load(self, job: LoadJob) -> None:
        assert job.source is not None
        src = msgspec.structs.replace(job.source, addresses=job.source.addresses[:1] * 2)
        await super().load(dataclasses.replace(job, source=src))


P = PeerPromise
BROKEN = [
    (NeverReleases, "pull_moves_the_offered_blocks", P.DONE),
    (NeverReleases, "a_consumer_that_gives_up_releases_the_blocks", P.RELEASE),
    (FlipsAByte, "pull_moves_the_offered_blocks", P.PULL),
    (RefusalIsNotMissing, "pull_of_an_unknown_request_is_refused", P.REFUSED),
    (RefusalIsNotMissing, "an_expired_offer_is_refused", P.REFUSED),
    (PullsFromShard0, "each_shard_pulls_its_own_slice", P.PULL),
]


@pytest.mark.parametrize(
    ("broken", "test", "promise"), BROKEN, ids=[f"{b.__name__}-{t}" for b, t, _ in BROKEN]
)
async def test_suite_catches_broken_peer_transport(
    broken: type[ZmqTransport], test: str, promise: str
) -> None:
    suite = PeerConformance()
    suite.progress_timeout_s = 1.0
    make = lambda context: broken(ZmqOptions(), context)  # noqa: E731
    async with suite.harness(make, suite.build_layout(True)) as kv:
        with pytest.raises(ContractViolation) as caught:
            await getattr(suite, f"test_{test}")(kv)
    assert str(caught.value).startswith(f"Transport contract broken: {promise}"), caught.value
