"""SchedulerEngine + WorkerEngine in prefill/decode: a producer's held blocks when no
consumer comes, peer transports and device caches, and the P/D params a consumer takes
(a cached prefix, another block size pulled across, another parallel shape or block size
refused naming both where the transport cannot).

Driven the way the vLLM connector drives them, with the harness of tests/support/kvflow_engines.py;
the claims and leases between a consumer and a producer are in tests/pd/test_pd_lease.py.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
import trio
import trio.testing

from kvflow.config import KVFlowConfig
from kvflow.engine.metadata import WorkerPlan
from kvflow.engine.scheduler import SchedulerEngine
from kvflow.geometry.layout import LayoutError
from kvflow.observe.events import TransferFailed
from kvflow.pd.context import PeerContext
from kvflow.pd.params import PD_VERSION, UNSET_SHAPE, ModelShape, PdParams
from kvflow.pd.security import prompt_digest
from kvflow.transport import Capabilities, PeerSource, TransportError
from kvflow_fs import FsTransport

from ..support.kvflow_engines import BS, COUNTS, PROMPT, Engine, run_step


def test_a_producer_hands_blocks_back_when_no_consumer_comes(
    start_engine: Callable[..., Engine],
) -> None:
    """P/D: held blocks go back to vLLM after hold_timeout_s (trio's MockClock: instantly)."""
    from kvflow.engine.metadata import OfferSpec
    from kvflow.observe.events import BlocksReleased
    from kvflow_zmq import ZmqOptions, ZmqTransport

    e = start_engine(
        "producer",
        config=KVFlowConfig(hold_timeout_s=30.0),
        worker_transport=lambda _o, ctx: ZmqTransport(ZmqOptions(), ctx),
        worker_clock=trio.testing.MockClock(autojump_threshold=0),
    )
    run_step(e, WorkerPlan(step=1, offers=[OfferSpec("r", [1, 2], [4, 4])], lent=["r"]))
    failed = e.worker_events.wait_for(TransferFailed, "r")  # waits WAIT < 30 s at most
    assert failed.direction == "send" and failed.timed_out, failed
    assert "hold_timeout_s=30.0" in failed.reason
    e.worker_events.wait_for(BlocksReleased, "r")
    assert e.worker.take_results().finished_sending == {"r"}


class HostOnlyPeer(FsTransport):
    """A peer transport that moves host memory only."""

    capabilities = Capabilities(store=True, peer=True, memory=frozenset({"cpu"}))


def test_a_device_cache_is_refused_by_a_host_only_peer_transport(
    start_engine: Callable[..., Engine],
) -> None:
    with pytest.raises(LayoutError, match="moves cpu memory only \\(peer transports are not"):
        start_engine("a", device=True, worker_transport=HostOnlyPeer)


def _pd_consumer(e: Engine, tp_size: int = 1) -> SchedulerEngine:
    """A P/D consumer's scheduler side on `e`'s runtime and transport."""
    return SchedulerEngine(
        config=KVFlowConfig(),
        transport=e.sched.transport,
        runtime=e.sched.runtime,
        bus=e.sched.bus,
        namespace=e.namespace,
        block_size=BS,
        can_pull=True,
        tp_size=tp_size,
    )


def _pd(
    sched: SchedulerEngine,
    block_size: int = BS,
    *,
    shape: ModelShape = UNSET_SHAPE,
    pp_size: int = 1,
) -> PdParams:
    """Params of PROMPT for the consumer `sched` (its namespace in the digest) from a
    producer of `shape`, one tensor-parallel rank per pipeline stage."""
    blocks, n, digest = [10, 11, 12], len(PROMPT), prompt_digest(PROMPT, scope=sched.pd_scope)
    addresses, offer = [f"tcp://127.0.0.1:{i + 1}" for i in range(pp_size)], "0" * 32
    return PdParams(
        PD_VERSION, "producer", addresses, offer, blocks, n, block_size, digest, shape, 1, pp_size
    )


def test_a_pd_consumer_with_a_cached_prefix_pulls_only_the_rest(
    start_engine: Callable[..., Engine],
) -> None:
    """vLLM's prefix cache already computed the first block: the load (and the pull it
    asks the producer for) covers the other blocks only."""
    sched = _pd_consumer(start_engine("pd"))
    sched.add_request("r", PROMPT, pd=_pd(sched))
    assert sched.lookup("r", BS) == len(PROMPT) - BS
    sched.allocated("r", [5, 6, 7], len(PROMPT) - BS)
    (load,) = sched.plan([]).loads
    assert (load.block_ids, load.token_counts) == ([6, 7], COUNTS[1:])
    assert load.source is not None and load.source.block_ids == [11, 12]


def test_a_pd_consumer_of_smaller_blocks_past_a_cached_prefix_starts_inside_a_block(
    start_engine: Callable[..., Engine],
) -> None:
    """A producer of blocks of 8 tokens, a consumer of 4 whose prefix cache holds the
    first 4: the pull asks for both producer blocks and skips the first block's first 4
    tokens, landing tokens 4..9 in the consumer's last two blocks."""
    e = start_engine("blocks-skip")
    caps = e.sched.transport.capabilities
    e.sched.transport.capabilities = msgspec.structs.replace(caps, hetero_blocks=True)
    sched = _pd_consumer(e)
    sched.add_request("r", PROMPT, pd=_pd(sched, 2 * BS))
    assert sched.lookup("r", BS) == len(PROMPT) - BS
    sched.allocated("r", [5, 6, 7], len(PROMPT) - BS)
    (load,) = sched.plan([]).loads
    assert (load.block_ids, load.token_counts) == ([6, 7], COUNTS[1:])
    assert load.source is not None
    assert (load.source.block_ids, load.source.block_size, load.source.skip) == ([10, 11], 8, 4)


def test_a_pd_producer_with_another_parallel_shape_is_refused_naming_both(
    start_engine: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """A TP=1 producer and a TP=2 consumer whose transport pulls between equal sizes only
    (here `fs`; zmq reads each rank's heads: tests/engine/test_tp.py), and another pipeline
    parallel size (no transport pulls across it): the prompt is computed here, never pulled
    shard-crossed (each rank holds other heads, each stage other layers)."""
    sched = _pd_consumer(start_engine("tp"), tp_size=2)
    sched.add_request("r", PROMPT, pd=_pd(sched))
    assert not sched.is_remote("r")
    assert "runs tensor parallel size 1, this consumer 2; this transport pulls" in caplog.text
    sched = _pd_consumer(start_engine("pp"))
    sched.add_request("r", PROMPT, pd=_pd(sched, pp_size=2))
    assert not sched.is_remote("r")
    assert "runs pipeline parallel size 2, this consumer 1; kvflow pulls" in caplog.text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "other-model"),
        ("layers", 7),
        ("kv_heads", 8),
        ("head_size", 256),
        ("dtype", "torch.bfloat16"),
        ("cache_dtype", "fp8"),
    ],
)
def test_a_pd_producer_of_another_model_or_cache_is_refused_naming_the_field(
    start_engine: Callable[..., Engine],
    caplog: pytest.LogCaptureFixture,
    field: str,
    value: object,
) -> None:
    """Issue 30, item 4: params a producer of another model, number of layers, KV heads,
    head size, dtype or cache dtype signed are never loaded (their bytes could be of the
    right size and the wrong meaning); the log names the field and both values."""
    sched = _pd_consumer(start_engine(field))
    sched.shape = ModelShape("tiny", 4, 2, 64, "torch.float32", "auto")
    pd = _pd(sched, shape=msgspec.structs.replace(sched.shape, **{field: value}))
    sched.add_request("r", PROMPT, pd=pd)
    assert not sched.is_remote("r")
    ours = getattr(sched.shape, field)
    assert f"has {field}={value!r}, this consumer {field}={ours!r}" in caplog.text


def test_a_pd_producer_with_other_block_sizes_is_refused_naming_both(
    start_engine: Callable[..., Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """P with blocks of 16 tokens and D with 4: computed here, never copied block for
    block into blocks that hold other tokens."""
    sched = _pd_consumer(start_engine("blocks"))
    sched.add_request("r", PROMPT, pd=_pd(sched, 4 * BS))
    assert not sched.is_remote("r")
    assert f"producer producer has blocks of {4 * BS} tokens, this consumer {BS}" in caplog.text


def test_a_worker_refuses_a_pull_from_another_number_of_shards() -> None:
    ctx = PeerContext("e", "worker", "ns", "tp1of2pp0", ["tp0of2pp0", "tp1of2pp0"])
    assert ctx.peer_address(PeerSource("p", ["a", "b"], "r", [1])) == "b"
    with pytest.raises(
        TransportError, match=r"producer p runs 1 worker shard\(s\), this consumer 2"
    ):
        ctx.peer_address(PeerSource("p", ["a"], "r", [1]))
