"""What the scheduler tells workers each step, as msgspec Structs.

vLLM ships connector metadata to workers inside its (pickled) scheduler
output. kvflow's metadata pickles as its msgspec bytes only, so nothing
kvflow-defined ever rides in pickle, and decoding is strict and typed.
"""

from __future__ import annotations

import msgspec

from ..keys import ChunkKey
from ..shapes.reblock import StoredRun
from ..transport import PeerSource

__all__ = ["LoadSpec", "OfferSpec", "SaveSpec", "WorkerPlan", "decode_plan", "encode_plan"]


class LoadSpec(msgspec.Struct, frozen=True, array_like=True):
    """Load `keys[i]` (holding `token_counts[i]` tokens) into block `block_ids[i]`."""

    req: str
    keys: list[ChunkKey]
    block_ids: list[int]
    token_counts: list[int]
    asynchronous: bool = False
    source: PeerSource | None = None
    """Set for prefill/decode loads: the producer to pull from."""
    error: str = ""
    """Set when the scheduler knows the load cannot succeed (its producer refused the
    claim or is gone): the worker fails it at once, and vLLM recomputes or fails the
    request as its `kv_load_failure_policy` says."""
    tp_sizes: list[int] = []
    """Per chunk, the tensor-parallel size whose shards a store holds it under (0: this
    engine's own; empty: every chunk its own): `kvflow.shapes.reshape`."""
    stored: StoredRun | None = None
    """Set when a store holds these tokens in chunks of another block size: load those
    (`keys` are this engine's, for reports): `kvflow.shapes.reblock`."""


class OfferSpec(msgspec.Struct, frozen=True, array_like=True):
    """Producer side of P/D: hold `block_ids` for a consumer to pull (request finished,
    or, streamed, scheduled to compute its prompt's last tokens)."""

    req: str
    block_ids: list[int]
    token_counts: list[int]
    offer: str = ""
    """The random id consumers pull the blocks by (`PdParams.offer`; the scheduler always
    sets one; without one, `req`)."""
    params: bytes = b""
    """Streamed (made in the step that computes the prompt, not at its end): the signed
    params a claim's answer carries (`Offer.params`); its layers are read once computed."""


class SaveSpec(msgspec.Struct, frozen=True, array_like=True):
    """Save block `block_ids[i]`'s first `token_counts[i]` tokens as `keys[i]`."""

    req: str
    keys: list[ChunkKey]
    block_ids: list[int]
    token_counts: list[int]
    computed_over: list[int] = []
    """Blocks a load of the same step fills that these chunks were computed over (the
    request's own loaded prefix, or one it shares with the request loading it): if
    that load fails, the forward attended to bad KV and this save stores nothing."""


class WorkerPlan(msgspec.Struct, frozen=True):
    """One scheduler step's instructions to every worker."""

    step: int
    loads: list[LoadSpec] = []
    saves: list[SaveSpec] = []
    lent: list[str] = []
    """Requests whose blocks vLLM lent to kvflow at finish; report them once saved."""
    preempted: list[str] = []
    """Requests whose blocks are about to be reused: stop reading them."""
    offers: list[OfferSpec] = []
    reused: list[int] = []
    """Blocks vLLM hands out anew this step that a save of an earlier step may still read
    (a sliding window's blocks go back to vLLM while their request runs): such saves end
    before this step's forward writes them."""

    def is_empty(self) -> bool:
        return not (
            self.loads or self.saves or self.lent or self.preempted or self.offers or self.reused
        )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WorkerPlan)
MAX_PLAN_BYTES = 64 << 20


def encode_plan(plan: WorkerPlan) -> bytes:
    return _encoder.encode(plan)


def decode_plan(data: bytes) -> WorkerPlan:
    if len(data) > MAX_PLAN_BYTES:
        raise ValueError(f"kvflow plan of {len(data)} bytes exceeds {MAX_PLAN_BYTES}")
    return _decoder.decode(data)
