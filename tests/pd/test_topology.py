"""Which heads a consumer rank reads from which producer ranks (`kvflow.geometry.topology`),
checked against vLLM's own `TransferTopology` for every shape its NixlConnector takes."""

from __future__ import annotations

import itertools

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import EngineTransferInfo, TransferTopology

from kvflow.geometry.topology import HeadRead, TopologyError, held_heads, plan_reads, readers
from kvflow.pd.context import PeerContext
from kvflow.shapes.reshape import shard_name
from kvflow.transport import PeerSource

SIZES = (1, 2, 4, 8)
SHAPES = [
    (h, p, c)
    for h, p, c in itertools.product((1, 2, 4, 8), SIZES, SIZES)
    if all((t <= h and h % t == 0) or (t > h and t % h == 0) for t in (p, c))
]


def _vllm(heads: int, producer_tp: int, consumer_tp: int, rank: int) -> TransferTopology:
    topo = TransferTopology(
        tp_rank=rank,
        tp_size=consumer_tp,
        block_size=16,
        engine_id="consumer",
        is_mla=False,
        is_mamba=False,
        total_num_kv_heads=heads,
        attn_backends=[],
    )
    topo.register_remote_engine(
        "producer",
        EngineTransferInfo(
            remote_tp_size=producer_tp,
            remote_block_len=0,
            remote_block_size=16,
            remote_physical_blocks_per_logical=1,
        ),
    )
    return topo


@pytest.mark.parametrize(("heads", "producer_tp", "consumer_tp"), SHAPES)
def test_each_rank_reads_its_heads_once_from_ranks_vllm_names(
    heads: int, producer_tp: int, consumer_tp: int
) -> None:
    for rank in range(consumer_tp):
        reads = plan_reads(heads, producer_tp, consumer_tp, rank)
        want = held_heads(heads, consumer_tp, rank)
        got: list[int] = []
        for r in sorted(reads, key=lambda r: r.into):
            held = held_heads(heads, producer_tp, r.rank)
            assert r.first + r.count <= len(held), (r, held)
            assert r.into == len(got), reads  # consecutive, in the consumer's order
            got += [held[r.first + i] for i in range(r.count)]
        assert got == list(want), (rank, reads)
        topo = _vllm(heads, producer_tp, consumer_tp, rank)
        targets = set(topo.target_remote_ranks("producer"))
        ranks = {r.rank for r in reads}
        assert topo.local_physical_heads == len(want)
        if topo.is_kv_replicated("producer"):  # one read per distinct head
            assert len(ranks) == len(want), reads
            assert ranks <= set(range(producer_tp)), reads
        else:
            assert ranks == targets, (reads, targets)


@pytest.mark.parametrize(("heads", "producer_tp", "consumer_tp"), SHAPES)
def test_readers_of_each_producer_rank(heads: int, producer_tp: int, consumer_tp: int) -> None:
    count = readers(heads, producer_tp, consumer_tp)
    if consumer_tp >= producer_tp:  # vLLM: tp_ratio consumer ranks share each producer rank
        topo = _vllm(heads, producer_tp, consumer_tp, 0)
        assert count == [topo.dcp_consumer_count(producer_tp, 1)] * producer_tp
    elif producer_tp > heads:  # replicas nobody needs are not read
        assert count.count(0) == producer_tp - max(heads, consumer_tp), count
    else:
        assert count == [1] * producer_tp


def test_examples() -> None:
    # P TP1 -> D TP2, 4 heads: each consumer rank reads its half of the one producer rank
    assert plan_reads(4, 1, 2, 1) == [HeadRead(rank=0, first=2, count=2, into=0)]
    # P TP2 -> D TP1: the consumer reads both ranks, one into each half
    assert plan_reads(4, 2, 1, 0) == [HeadRead(0, 0, 2, 0), HeadRead(1, 0, 2, 2)]
    # P TP4 over 2 heads (replicated) -> D TP1: one read per distinct head
    assert plan_reads(2, 4, 1, 0) == [HeadRead(0, 0, 1, 0), HeadRead(2, 0, 1, 1)]
    assert readers(2, 4, 1) == [1, 0, 1, 0]
    # MLA (one latent on every rank): each consumer rank reads it once
    assert plan_reads(1, 2, 4, 3) == [HeadRead(1, 0, 1, 0)]


def test_shapes_that_do_not_split_are_refused() -> None:
    with pytest.raises(TopologyError, match="3 KV heads do not split over tensor parallel"):
        plan_reads(3, 2, 1, 0)
    with pytest.raises(TopologyError, match="not a multiple of the 2 KV heads"):
        plan_reads(2, 3, 1, 0)


def test_each_consumer_stage_reads_the_producer_stage_holding_its_layers() -> None:
    """Endpoints are listed stage by stage (`set_xfer_handshake_metadata_pp_aware`): a
    worker of stage p reads stage p's ranks, whole blocks or heads."""
    addrs = ["s0r0", "s0r1", "s1r0", "s1r1"]
    src = PeerSource("p", addrs, "req", [1], tp_size=2, kv_heads=2)
    shards = [shard_name(r, 2, p) for p in range(2) for r in range(2)]
    for p in range(2):
        for r in range(2):
            ctx = PeerContext(
                "e", "worker", "ns", shard_name(r, 2, p), shards, tp_rank=r, tp_size=2, pp_rank=p
            )
            assert [read.address for read in ctx.peer_reads(src)] == [f"s{p}r{r}"]
    one = [shard_name(0, 1, p) for p in range(2)]
    ctx = PeerContext("e", "worker", "ns", one[1], one, tp_rank=0, tp_size=1, pp_rank=1)
    assert [read.address for read in ctx.peer_reads(src)] == ["s1r0", "s1r1"]
