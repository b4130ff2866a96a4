"""Prefill/decode disaggregation parameters: kvflow's part of vLLM's `kv_transfer_params`.

vLLM's proxy convention (as used with its NIXL connector, so existing proxies and
routers work unchanged): the proxy sends the prefill request to the producer with
`kv_transfer_params={"do_remote_decode": true}`; the producer's output carries
`{"do_remote_prefill": true, "do_remote_decode": false, "kvflow": {...}}`; the proxy
passes those params as they came to the consumer. The `kvflow` entry is a versioned
`PdParams`, or a list of them, one per KV cache group, for a model vLLM's hybrid KV
cache manager gives several groups (each group has its own blocks and its own
transport endpoints); anything malformed there is a `PdParamsError` naming the field.

The params come from a client (through a proxy), so nothing in them is believed: every
field is bounded; the producer names its offer by a random id (`offer`), not by the
request id a client chooses; and `check_pd_params` refuses, before any socket opens,
params made for another prompt (`prompt`, a `kvflow.pd.security.prompt_digest`), params a
keyed deployment did not sign (`mac`) and addresses that are not `tcp://` IP literals.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ..geometry.topology import TopologyError, readers
from ..zmqio import shown
from .security import Channel, prompt_digest

__all__ = [
    "PD_VERSION",
    "UNSET_SHAPE",
    "ModelShape",
    "PdParams",
    "PdParamsError",
    "StreamRef",
    "check_pd_params",
    "consumer_params",
    "decode_streamed",
    "encode_streamed",
    "join_groups",
    "parse_pd_params",
    "parse_stream",
    "pull_refusal",
    "stream_offer",
]

PD_VERSION = 4
KEY = "kvflow"
STREAM_KEY = "kvflow_stream"
"""A streamed request's `kv_transfer_params` entry on its decode instance (`StreamRef`)."""
OFFER_KEY = "kvflow_offer"
"""A streamed request's `kv_transfer_params` entry on its prefill instance: the offer id
the proxy chose, which the producer offers its blocks under as it computes them."""
MAX_BLOCKS = 1 << 20
MAX_SHARDS = 1024

Text = Annotated[str, Meta(max_length=256)]
OfferId = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}\Z")]
Hex = Annotated[str, Meta(pattern=r"^[0-9a-f]*\Z", max_length=128)]


class PdParamsError(ValueError):
    """`kv_transfer_params` that claim a remote prefill but do not describe one."""


Size = Annotated[int, Meta(ge=0, le=1 << 20)]


class ModelShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a producer's and a consumer's KV caches must agree on, whatever their parallel
    shapes, block sizes and layouts: a consumer refuses a pull naming the first field
    that differs (it would otherwise load KV of the right size and the wrong meaning)."""

    model: Text
    layers: Size
    """KV cache layers of the group (all pipeline stages)."""
    kv_heads: Size
    """The model's KV heads, over all tensor-parallel ranks (1 for MLA's latent)."""
    head_size: Size
    dtype: Text
    cache_dtype: Text

    def mismatch(self, theirs: ModelShape, producer: str) -> str:
        """Why KV of `theirs` (producer `producer`'s) cannot be loaded here; "" if it can."""
        for name in self.__struct_fields__:
            ours, other = getattr(self, name), getattr(theirs, name)
            if ours != other:
                return (
                    f"producer {producer} has {name}={other!r}, this consumer {name}={ours!r}; "
                    "producer and consumer must serve the same model with the same KV cache"
                )
        return ""


UNSET_SHAPE = ModelShape(model="", layers=0, kv_heads=1, head_size=0, dtype="", cache_dtype="")
"""The shape of an engine that states none (engines driven without vLLM: tests)."""


class PdParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a consumer pulls a request's prompt KV from."""

    version: int
    engine_id: Text
    addresses: Annotated[list[Text], Meta(min_length=1, max_length=MAX_SHARDS)]
    """The producer's worker endpoints, one per shard (TP rank)."""
    offer: OfferId
    """The producer's random id of this offer: what the consumer pulls and renews."""
    block_ids: Annotated[
        list[Annotated[int, Meta(ge=0, lt=1 << 31)]], Meta(min_length=1, max_length=MAX_BLOCKS)
    ]
    num_tokens: Annotated[int, Meta(ge=1, lt=1 << 31)]
    block_size: Annotated[int, Meta(ge=1, le=1 << 20)]
    """Tokens in one of the producer's blocks (a consumer pulls only into blocks of as
    many; their layouts are the workers' business)."""
    prompt: Hex
    """`prompt_digest` of the prompt's first `num_tokens` tokens, its salt and the KV
    cache group's `Fingerprint.pd_scope`."""
    shape: ModelShape
    """The producer's model and KV cache (checked before anything is pulled)."""
    tp_size: Annotated[int, Meta(ge=1, le=MAX_SHARDS)]
    pp_size: Annotated[int, Meta(ge=1, le=MAX_SHARDS)]
    """The producer's tensor and pipeline parallel sizes (`addresses` holds one endpoint
    per rank, pipeline stage by stage)."""
    mac: Hex = ""
    """The deployment's MAC over every other field ("" for a keyless deployment)."""

    def message(self) -> bytes:
        """What `mac` covers: every other field."""
        return _encoder.encode(msgspec.structs.astuple(msgspec.structs.replace(self, mac="")))

    def signed(self, channel: Channel) -> PdParams:
        """These params with the deployment's MAC."""
        return msgspec.structs.replace(self, mac=channel.sign(self.message()))


_encoder = msgspec.msgpack.Encoder()


def consumer_params(p: PdParams) -> dict[str, Any]:
    """The `kv_transfer_params` a producer returns for the proxy to hand to a consumer."""
    return {"do_remote_prefill": True, "do_remote_decode": False, KEY: msgspec.to_builtins(p)}


def join_groups(params: list[dict[str, Any]]) -> dict[str, Any]:
    """The `kv_transfer_params` of a request whose KV cache groups each returned
    `consumer_params`: one group's as they are, several groups' entries as a list."""
    if len(params) == 1:
        return params[0]
    return {**params[0], KEY: [p[KEY] for p in params]}


class StreamRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A streamed request on its decode instance (`kv_transfer_params["kvflow_stream"]`):
    the proxy sent it here and to a prefill instance at once, so no producer's params
    exist yet. The consumer claims `offer` at `addresses` (a producer's worker endpoints,
    as its earlier params named them); the producer's answer, once it schedules the
    prefill, carries its signed `PdParams`, checked as if they had come with the request
    (decision 93)."""

    offer: OfferId
    """The id the proxy chose and gave the prefill instance too (`OFFER_KEY`)."""
    addresses: Annotated[list[Text], Meta(min_length=1, max_length=MAX_SHARDS)]


def parse_stream(raw: Any) -> StreamRef | None:
    """The `StreamRef` in a request's `kv_transfer_params`, or None if it has none;
    a `PdParamsError` naming the field if it is malformed."""
    ref: StreamRef | None = _entry(raw, "do_remote_prefill", STREAM_KEY, StreamRef)
    return ref


def stream_offer(raw: Any) -> str | None:
    """The offer id a prefill request's `kv_transfer_params` asks its blocks to be
    offered under as they are computed (`OFFER_KEY`), or None; a `PdParamsError` if it
    is not 32 hex digits."""
    offer: str | None = _entry(raw, "do_remote_decode", OFFER_KEY, OfferId)
    return offer


def _entry(raw: Any, flag: str, key: str, kind: Any) -> Any:
    """`raw[key]` as `kind` if `raw` is a dict with `flag` set and a `key`, else None."""
    if not isinstance(raw, dict) or not raw.get(flag) or key not in raw:
        return None
    try:
        return msgspec.convert(raw[key], kind)
    except msgspec.ValidationError as exc:
        raise PdParamsError(f"kv_transfer_params[{key!r}]: {exc}"[:500]) from None


def parse_pd_params(raw: Any) -> list[PdParams] | None:
    """kvflow's P/D params in a request's `kv_transfer_params`, one per KV cache group,
    or None if it has none."""
    if not isinstance(raw, dict) or not raw.get("do_remote_prefill"):
        return None
    if KEY not in raw and STREAM_KEY in raw:
        return None  # a streamed request: `parse_stream`
    if KEY not in raw:
        raise PdParamsError(
            "kv_transfer_params has do_remote_prefill but no 'kvflow' entry: "
            "they were not produced by a kvflow producer"
        )
    entries = raw[KEY] if isinstance(raw[KEY], list) else [raw[KEY]]
    if not entries:
        raise PdParamsError("kv_transfer_params['kvflow'] is an empty list")
    return [_parse_one(e) for e in entries]


def _parse_one(entry: Any) -> PdParams:
    if not isinstance(entry, dict) or entry.get("version") != PD_VERSION:
        version = entry.get("version") if isinstance(entry, dict) else None
        raise PdParamsError(
            f"kv_transfer_params['kvflow']['version'] is {version!r}; this kvflow reads "
            f"{PD_VERSION} (run the same kvflow on producer and consumer)"
        )
    try:
        p = msgspec.convert(entry, PdParams)
    except msgspec.ValidationError as exc:
        raise PdParamsError(f"kv_transfer_params['kvflow']: {exc}"[:500]) from None
    return _whole(p, "kv_transfer_params['kvflow']")


def _whole(p: PdParams, where: str) -> PdParams:
    if len(p.addresses) != p.tp_size * p.pp_size:
        raise PdParamsError(
            f"{where}: {len(p.addresses)} addresses for tp_size {p.tp_size} x pp_size {p.pp_size}"
        )
    return p


_decoder = msgspec.msgpack.Decoder(PdParams)


def encode_streamed(p: PdParams) -> bytes:
    """A streamed offer's params as its producer hands them to a claim (`Offer.params`)."""
    return _encoder.encode(p)


def decode_streamed(raw: bytes, where: str) -> PdParams:
    """A streamed offer's params as a claim's answer carried them (from `where`), bounded
    and whole; a `PdParamsError` naming what is wrong. Believed only once
    `check_pd_params` passes, as the params of any request."""
    try:
        p = _decoder.decode(raw)
    except msgspec.DecodeError as exc:  # a ValidationError too
        raise PdParamsError(f"{where}: params that do not decode: {exc}"[:500]) from None
    if p.version != PD_VERSION:
        raise PdParamsError(
            f"{where}: params of version {p.version}; this kvflow reads {PD_VERSION}"
        )
    return _whole(p, where)


def check_pd_params(
    p: PdParams, channel: Channel, token_ids: Sequence[int] | None, salt: str, scope: str = ""
) -> tuple[str, str]:
    """(reason, why) a consumer must not pull `p` for a request of `token_ids` and
    `salt` into the KV cache group `scope` (`Fingerprint.pd_scope`); ("", "") if it may. Reasons:
    `address`, `signature`, `prompt`. `token_ids` None: whether they are this
    deployment's params at all (address, signature), for no prompt."""
    for address in p.addresses:
        if why := channel.address_problem(address):
            return "address", f"producer address {address[:100]!r}: {why}"
    if not channel.signed(p.message(), p.mac):
        missing = "not signed" if not p.mac else "signed with another key, or altered"
        return "signature", (
            f"the params are {missing}"
            if channel.keyed
            else "the params are signed but this engine has no key (key_file)"
        )
    if token_ids is None:
        return "", ""
    if len(token_ids) < p.num_tokens or p.prompt != prompt_digest(
        token_ids[: p.num_tokens], salt, scope
    ):
        return "prompt", (
            "the params were made for another prompt (tokens, cache_salt or LoRA) or for "
            "another model or KV cache group"
        )
    return "", ""


def pull_refusal(
    p: PdParams,
    shape: ModelShape,
    tp_size: int,
    pp_size: int,
    block_size: int,
    hetero_tp: bool,
    hetero_blocks: bool = False,
) -> str:
    """Why a consumer of `shape`, `tp_size` x `pp_size` ranks and blocks of `block_size`
    tokens cannot pull `p` ("" if it can), naming what differs. `hetero_tp`: its transport
    pulls between tensor-parallel sizes (`kvflow.geometry.topology`); `hetero_blocks`: between
    block sizes."""
    producer = shown(p.engine_id, 100)  # a client wrote it: one line in the log
    if why := shape.mismatch(p.shape, producer):
        return why
    if len(p.addresses) != p.tp_size * p.pp_size:
        return f"producer {producer} sent {len(p.addresses)} addresses for its ranks"
    if p.pp_size != pp_size:
        return (
            f"producer {producer} runs pipeline parallel size {p.pp_size}, this consumer "
            f"{pp_size}; kvflow pulls between equal pipeline parallel sizes only"
        )
    if p.tp_size != tp_size:
        if not hetero_tp:
            return (
                f"producer {producer} runs tensor parallel size {p.tp_size}, this consumer "
                f"{tp_size}; this transport pulls between equal tensor parallel sizes only"
            )
        try:
            readers(shape.kv_heads, p.tp_size, tp_size)  # every rank's reads can be planned
        except TopologyError as exc:
            return f"producer {producer} (tensor parallel size {p.tp_size}): {exc}"
    if p.block_size != block_size and not hetero_blocks:
        return (
            f"producer {producer} has blocks of {p.block_size} tokens, this consumer "
            f"{block_size}; this transport pulls between equal block sizes only (give "
            "both instances the same --block-size)"
        )
    return ""
