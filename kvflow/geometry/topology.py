"""Which KV heads a consumer's tensor-parallel rank reads from which producer ranks.

vLLM splits a layer's KV heads over tensor-parallel ranks: with `tp` ranks and `heads`
KV heads in the model, rank `r` holds heads `[r * heads / tp, (r + 1) * heads / tp)` when
`tp <= heads`, and the one head `r // (tp / heads)` when `tp > heads` (each head is then
*replicated* on `tp / heads` ranks). An MLA cache has one latent every rank holds whole
(`heads == 1`). A P/D consumer of another tensor-parallel size than its producer reads,
on each of its ranks, exactly the heads that rank holds, each distinct head once, from
a producer rank that holds it (spreading replicas over consumer ranks), as vLLM's
`TransferTopology` describes (`tp_ratio`, `is_kv_replicated`, `target_remote_ranks`).

This module is arithmetic only: `plan_reads` answers for one consumer rank;
`readers` says how many consumer ranks read each producer rank (a producer hands a
request's blocks back once all of them are done; one no consumer rank reads is released
at once). A store keeps replicated heads once, under the first rank holding them
(`first_replica`), so reads from a store (`spread=False`) take that rank's.
"""

from __future__ import annotations

import msgspec

__all__ = ["HeadRead", "TopologyError", "first_replica", "held_heads", "plan_reads", "readers"]


class TopologyError(ValueError):
    """Two parallel shapes whose heads cannot be mapped onto each other."""


class HeadRead(msgspec.Struct, frozen=True):
    """Heads `[first, first + count)` of producer rank `rank` (numbered in that rank's own
    cache) land in heads `[into, into + count)` of the consumer rank's cache."""

    rank: int
    first: int
    count: int
    into: int


def held_heads(heads: int, tp_size: int, tp_rank: int) -> range:
    """The model's KV heads that rank `tp_rank` of `tp_size` holds (vLLM's split)."""
    if heads < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise TopologyError(f"no rank {tp_rank} of {tp_size} over {heads} KV heads")
    if tp_size <= heads:
        if heads % tp_size:
            raise TopologyError(
                f"{heads} KV heads do not split over tensor parallel size {tp_size}"
            )
        per = heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % heads:
        raise TopologyError(
            f"tensor parallel size {tp_size} is not a multiple of the {heads} KV heads"
        )
    head = tp_rank // (tp_size // heads)
    return range(head, head + 1)


def first_replica(heads: int, tp_size: int, tp_rank: int) -> int:
    """The first rank of `tp_size` holding the heads rank `tp_rank` holds: `tp_rank`
    itself unless heads are replicated (`tp_size > heads`; MLA: rank 0)."""
    held_heads(heads, tp_size, tp_rank)  # a shape that splits, or TopologyError
    replicas = max(1, tp_size // heads)
    return tp_rank - tp_rank % replicas


def plan_reads(
    heads: int, producer_tp: int, consumer_tp: int, consumer_rank: int, spread: bool = True
) -> list[HeadRead]:
    """The reads that fill consumer rank `consumer_rank`'s heads, fewest first: each
    distinct head once, consecutive heads of one producer rank in one read. `heads` is
    the model's number of KV heads (1 for MLA: every rank holds the latent). A head the
    producer replicates is read from a replica chosen by the consumer's rank (`spread`,
    for peers: each holds it), else from the first (a store holds only that one)."""
    want = held_heads(heads, consumer_tp, consumer_rank)
    reads: list[HeadRead] = []
    for into, head in enumerate(want):
        rank = _source(heads, producer_tp, head, consumer_rank if spread else 0)
        first = head - held_heads(heads, producer_tp, rank).start
        last = reads[-1] if reads else None
        if last and last.rank == rank and last.first + last.count == first:
            reads[-1] = HeadRead(rank, last.first, last.count + 1, last.into)
        else:
            reads.append(HeadRead(rank, first, 1, into))
    return reads


def _source(heads: int, producer_tp: int, head: int, consumer_rank: int) -> int:
    """The producer rank a consumer rank reads `head` from: the one holding it, or, when
    the producer replicates heads, one of its replicas chosen by the consumer's rank."""
    if producer_tp <= heads:
        return head // (heads // producer_tp)
    replicas = producer_tp // heads
    return head * replicas + consumer_rank % replicas


def readers(heads: int, producer_tp: int, consumer_tp: int, spread: bool = True) -> list[int]:
    """How many consumer ranks read each producer rank (0: none; its offer is released).
    `spread` as for `plan_reads`."""
    count = [0] * producer_tp
    for r in range(consumer_tp):
        plan = plan_reads(heads, producer_tp, consumer_tp, r, spread)
        for rank in {read.rank for read in plan}:
            count[rank] += 1
    return count
