"""Hidden states (`kvflow.hidden_states`) through the `redis` transport: stored as a
vLLM worker stores them, read back by reference from a fresh reader."""

from __future__ import annotations

import os

import msgspec
import torch
import trio

from kvflow.hidden_states import (
    HiddenStatesReader,
    HiddenStatesRef,
    hidden_context,
    hidden_layout,
    host_buffer,
    save_hidden_states,
)
from kvflow.observe.events import EventBus, Origin
from kvflow_redis import RedisOptions, RedisTransport


async def test_hidden_states_round_trip_through_redis(redis_url: str) -> None:
    tokens = list(range(7, 7 + 45))
    ref = HiddenStatesRef(
        transport="redis",
        namespace="hs-redis",
        keys=[f"{i:032x}" for i in range(3)],
        block_size=16,
        token_ids=tokens,
        num_layers=3,
        hidden_size=24,
        dtype="float32",
    )
    buf = host_buffer(ref)
    buf.copy_(torch.randn(buf.shape))
    options = {"url": redis_url, "key_prefix": f"kvflow-hs-{os.getpid()}:"}
    writer = RedisTransport(
        msgspec.convert(options, RedisOptions), hidden_context("e", "worker", ref.namespace)
    )
    await writer.open()
    await writer.register(hidden_layout(16, 3, 24, "float32"))
    try:
        assert (
            await save_hidden_states(writer, EventBus(Origin("e", "worker")), "r", ref, buf, 10)
            == ""
        )
    finally:
        await writer.aclose()
    with HiddenStatesReader("redis", options) as reader:
        got = await trio.to_thread.run_sync(reader.load, ref.to_params())
    assert torch.equal(got.hidden_states, buf.view(-1, 3, 24)[:45])
