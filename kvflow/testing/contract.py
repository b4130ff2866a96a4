"""The contract vocabulary of kvflow's conformance suites: how a failed check reads.

- `Promise`: the promises of the `Transport` contract the store suite checks, each as
  the text a failure shows (the peer suite adds `PeerPromise`).
- `violated(promise, detail, chunks=, keys=, block_ids=)`: raise `ContractViolation`
  naming the broken promise, what happened, and the chunk indexes, keys and block ids
  involved.
- `ContractViolation`: an `AssertionError`, so pytest reports it as a failed test.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NoReturn

from ..keys import ChunkKey

__all__ = ["ContractViolation", "Promise", "violated"]


class ContractViolation(AssertionError):
    """A transport broke a promise of the `Transport` contract."""


class Promise:
    """The promises of the `Transport` contract the suite checks, as failure text."""

    LOOKUP = "lookup(keys) returns how many *leading* keys are fully stored (all shards)"
    SAVE = "save(job) stores every chunk or raises"
    SAVE_ATOMIC = (
        "a chunk is never visible half-written: nothing shows before save(job) has all layers"
    )
    SAVE_READS = (
        "save reads layer i only after job.layer(i) returned, and has copied it when save returns"
    )
    LOAD = (
        "load(job) fills every span of every chunk with the bytes saved under its key, nothing else"
    )
    LOAD_ORDER = (
        "load(job) calls job.layer_loaded(i) once per layer, in layer order, after layer i landed"
    )
    LOAD_HANDS_OFF = (
        "once job.layer_loaded(i) is called the transport neither reads nor writes layer i's "
        "spans again: vLLM computes into them right away"
    )
    LOAD_ERROR = (
        "a load that cannot move a chunk raises ChunkMissing / ChunkCorrupt / TransportError "
        "with .chunk = the first chunk that did not arrive intact, the chunks before it intact"
    )
    CANCEL = "all methods are cancellable; a cancelled save leaves nothing visible"
    NAMESPACE = "a transport serves only its context's namespace; other namespaces see nothing"
    SHARDS = "each shard stores its own slice of a chunk; a lookup hit needs every shard"
    REBLOCK = (
        "with capabilities.reshape, a device cache finds and loads, token for token, the "
        "chunks an engine of another block size saved (plain chunks of the same namespace: "
        "kvflow.shapes.reblock)"
    )
    RESHAPE = (
        "with capabilities.reshape, an engine of another tensor-parallel size finds and "
        "loads a chunk under the shards that saved it (lookup(keys, shards); the load "
        "job's shard and layout), each head where it holds it"
    )


def violated(
    promise: str,
    detail: str = "",
    *,
    chunks: Iterable[int] = (),
    keys: Iterable[ChunkKey] = (),
    block_ids: Iterable[int] = (),
) -> NoReturn:
    """Raise `ContractViolation` naming `promise` and the chunks, keys and blocks involved."""
    lines = [f"Transport contract broken: {promise}"]
    if detail:
        lines.append(f"  what happened: {detail}")
    if chunks := list(chunks):
        lines.append(f"  chunk index(es): {chunks}")
    if keys := list(keys):
        lines.append(f"  key(s): {', '.join(keys)}")
    if block_ids := list(block_ids):
        lines.append(f"  block id(s): {block_ids}")
    raise ContractViolation("\n".join(lines))
