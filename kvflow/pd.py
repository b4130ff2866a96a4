"""Prefill/decode disaggregation parameters: kvflow's part of vLLM's `kv_transfer_params`.

vLLM's proxy convention (as used with its NIXL connector, so existing proxies and
routers work unchanged): the proxy sends the prefill request to the producer with
`kv_transfer_params={"do_remote_decode": true}`; the producer's output carries
`{"do_remote_prefill": true, "do_remote_decode": false, "kvflow": {...}}`; the proxy
passes those params as they came to the consumer. The `kvflow` entry is a versioned
`PdParams`, or a list of them, one per KV cache group, for a model vLLM's hybrid KV
cache manager gives several groups (each group has its own blocks and its own
transport endpoints); anything malformed there is a `PdParamsError` naming the field.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "PD_VERSION",
    "PdParams",
    "PdParamsError",
    "consumer_params",
    "join_groups",
    "parse_pd_params",
]

PD_VERSION = 2
KEY = "kvflow"


class PdParamsError(ValueError):
    """`kv_transfer_params` that claim a remote prefill but do not describe one."""


class PdParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a consumer pulls a request's prompt KV from."""

    version: int
    engine_id: str
    addresses: list[str]
    """The producer's worker endpoints, one per shard (TP rank)."""
    req: str
    """The request id on the producer."""
    block_ids: list[int]
    num_tokens: int
    block_size: int
    """Tokens in one of the producer's blocks (a consumer pulls only into blocks of as
    many; their layouts are the workers' business)."""


def consumer_params(p: PdParams) -> dict[str, Any]:
    """The `kv_transfer_params` a producer returns for the proxy to hand to a consumer."""
    return {"do_remote_prefill": True, "do_remote_decode": False, KEY: msgspec.to_builtins(p)}


def join_groups(params: list[dict[str, Any]]) -> dict[str, Any]:
    """The `kv_transfer_params` of a request whose KV cache groups each returned
    `consumer_params`: one group's as they are, several groups' entries as a list."""
    if len(params) == 1:
        return params[0]
    return {**params[0], KEY: [p[KEY] for p in params]}


def parse_pd_params(raw: Any) -> list[PdParams] | None:
    """kvflow's P/D params in a request's `kv_transfer_params`, one per KV cache group,
    or None if it has none."""
    if not isinstance(raw, dict) or not raw.get("do_remote_prefill"):
        return None
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
    try:
        p = msgspec.convert(entry, PdParams)
    except msgspec.ValidationError as exc:
        raise PdParamsError(f"kv_transfer_params['kvflow']: {exc}") from None
    if p.version != PD_VERSION:
        raise PdParamsError(
            f"kv_transfer_params['kvflow']['version'] is {p.version}; "
            f"this kvflow reads {PD_VERSION}"
        )
    if not p.addresses or not p.block_ids or p.num_tokens < 1:
        raise PdParamsError("kv_transfer_params['kvflow'] names no producer or no tokens")
    return p
