"""A redis store serves engines of another block size (`kvflow.reblock`) on a real
redis-server: what a device cache of blocks of 16 saved (staged token-major), one of
blocks of 32 finds and loads token for token, and back. The stand-in device caches are
host tensors labelled `cuda` (`kvflow.testing.layouts.device_layout`), staged as on a
GPU."""

from __future__ import annotations

import uuid

import pytest
import torch

from kvflow.keys import chunk_keys, chunk_token_counts
from kvflow.layout import KVLayout
from kvflow.reblock import load_reblocked, load_window, lookup_blocks
from kvflow.staging import HostStage
from kvflow.testing.layouts import device_layout
from kvflow.transport import LoadJob, SaveJob, TransportContext
from kvflow_redis import RedisOptions, RedisTransport

PROMPT = list(range(1000, 1083))  # 83 tokens: 5 blocks of 16 and 3; 2 of 32 and 19
NS = "reblock"


async def _engine(url: str, prefix: str, block_size: int) -> tuple[RedisTransport, list]:
    layout, views = device_layout("cpu", num_layers=2, num_blocks=8, block_size=block_size,
                                  heads=2, head_dim=8, seed=block_size)  # fmt: skip
    ctx = TransportContext("e", "worker", NS, "tp0of1pp0", ["tp0of1pp0"], layout)
    t = RedisTransport(RedisOptions(url=url, key_prefix=prefix), ctx)
    await t.open()
    await t.register(layout)
    return t, views


def _tokens(views: list[torch.Tensor], blocks: list[int], counts: list[int]) -> list[torch.Tensor]:
    """Per layer, `[tokens, heads, content]` of `blocks`' first `counts` tokens."""
    return [
        torch.cat([v[b, :, :n].transpose(0, 1) for b, n in zip(blocks, counts, strict=True)])
        for v in views
    ]


@pytest.mark.parametrize("sizes", [(16, 32), (32, 16)], ids=["16-into-32", "32-into-16"])
async def test_a_cache_loads_what_a_cache_of_another_block_size_saved(
    redis_url: str, sizes: tuple[int, int]
) -> None:
    prefix = f"kvflow-test-{uuid.uuid4().hex[:8]}:"
    (saver, theirs_views), (reader, views) = [await _engine(redis_url, prefix, b) for b in sizes]
    theirs = chunk_token_counts(len(PROMPT), sizes[0])
    src = list(range(1, 1 + len(theirs)))
    assert saver.context.layout is not None
    stage = HostStage(saver.context.layout, src, theirs)

    async def gathered(layer: int) -> list[list[memoryview]]:
        await stage.gather(layer)
        return stage.spans(layer)

    keys = chunk_keys(NS, PROMPT, sizes[0])
    await saver.save(SaveJob("save", keys, theirs, 2, gathered))

    ours = chunk_token_counts(len(PROMPT), sizes[1])
    assert await reader.lookup(chunk_keys(NS, PROMPT, sizes[1])) == 0
    hits, run = await lookup_blocks(reader, NS, PROMPT, "", True, ours, [sizes[0]])
    assert hits == len(ours) and run is not None and run.keys == keys
    chunks = list(range(1, len(ours)))  # the first block is in vLLM's own prefix cache
    window, why = load_window(run, ours, chunks)
    assert window is not None and why == ""
    dst = [7 - i for i in range(len(chunks))]
    counts = [ours[i] for i in chunks]
    layout = reader.context.layout
    assert isinstance(layout, KVLayout)
    before = [v.clone() for v in views]
    into = HostStage(layout, dst, counts)
    signalled: list[int] = []
    await load_reblocked(reader, LoadJob("load", [""] * len(dst), counts, 2, into.spans,
                                         signalled.append, None, dst), window)  # fmt: skip
    for layer in range(2):
        into.scatter(layer)
    assert signalled == [0, 1]
    first = sizes[1]  # tokens before the load's first block
    for got, want in zip(
        _tokens(views, dst, counts), _tokens(theirs_views, src, theirs), strict=True
    ):
        assert torch.equal(got, want[first:]), "every loaded token equals the saved one"
    tail = counts[-1]  # nothing past the last chunk's tokens written
    for v, b in zip(views, before, strict=True):
        assert torch.equal(v[dst[-1], :, tail:], b[dst[-1], :, tail:])
    await saver.aclose()
    await reader.aclose()
