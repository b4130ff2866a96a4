"""The routing index and router on vLLM's own event objects (`vllm.distributed.kv_events`),
encoded as vLLM's publisher encodes them; no server."""

from __future__ import annotations

import msgspec
import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvflow.route import events as ev
from kvflow.route.index import Match, PrefixIndex
from kvflow.route.router import Router

BLOCK = 4
_pack = msgspec.msgpack.Encoder()


def frame(*events: object) -> bytes:
    """A batch as vLLM's `ZmqEventPublisher` sends it (its payload frame)."""
    return _pack.encode(KVEventBatch(ts=1.0, events=list(events)))  # type: ignore[arg-type]


def stored(
    hashes: list[int],
    tokens: list[int],
    parent: int | None = None,
    medium: str | None = "GPU",
    **kw: object,
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
        lora_id=None, medium=medium, lora_name=kw.pop("lora_name", None), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def apply(index: PrefixIndex, instance: str, *events: object) -> int:
    got, bad = ev.decode_batch(frame(*events))
    index.apply(instance, got)
    return bad


PROMPT = list(range(100, 116))  # 4 blocks of 4


def test_an_instance_holding_a_prompts_blocks_matches_its_leading_run() -> None:
    index = PrefixIndex()
    # blocks 0-1 in one event, block 2 in another (parent: block 1's vLLM hash)
    assert apply(index, "a", stored([11, 12], PROMPT[:8])) == 0
    apply(index, "a", stored([13], PROMPT[8:12], parent=12))
    apply(index, "b", stored([21], PROMPT[:4]))
    found = index.match(PROMPT, None)
    assert (found["a"].tokens, found["b"].tokens) == (12, 4)
    assert index.match([1, 2, 3, 4, *PROMPT], None) == {}  # another first block: nothing
    assert index.match(PROMPT, "an-adapter") == {}  # another adapter's blocks: nothing


def test_removed_blocks_end_the_run_and_media_weigh_less_below_the_gpu() -> None:
    index = PrefixIndex()
    apply(index, "a", stored([11, 12, 13], PROMPT[:12]))
    apply(index, "a", stored([11, 12, 13], PROMPT[:12], medium="kvflow:fs"))
    apply(index, "a", BlockRemoved(block_hashes=[12], medium="GPU"))
    m = index.match(PROMPT, None)["a"]
    assert m.tokens == 12  # block 1 is still in kvflow:fs
    assert m.weighted == 4 * 1.0 + 4 * 0.5 + 4 * 1.0
    apply(index, "a", BlockRemoved(block_hashes=[12], medium="kvflow:fs"))
    assert index.match(PROMPT, None)["a"].tokens == 4
    apply(index, "a", AllBlocksCleared())  # vLLM's GPU cache emptied: kvflow:fs's block 0 left
    assert index.match(PROMPT, None)["a"] == Match(tokens=4, weighted=4 * 0.5)


def test_blocks_keyed_on_more_than_tokens_or_an_unknown_parent_are_not_indexed() -> None:
    index = PrefixIndex()
    apply(index, "a", stored([11], PROMPT[:4], extra_keys=[("some-mm-hash", 0)]))
    apply(index, "a", stored([13], PROMPT[4:8], parent=999))
    apply(index, "a", stored([14], PROMPT[:4], group_idx=1))
    assert index.match(PROMPT, None) == {}
    assert index.stats.skipped == 3
    apply(index, "a", stored([15], PROMPT[:4], lora_name="ad", extra_keys=[("ad",)]))
    assert index.match(PROMPT, "ad")["a"].tokens == 4


def test_out_of_bounds_events_and_frames_are_counted_never_applied() -> None:
    index = PrefixIndex()
    short = stored([11, 12], PROMPT[:7])  # 7 token ids for 2 blocks of 4
    assert apply(index, "a", short, stored([21], PROMPT[:4])) == 1
    assert set(index.match(PROMPT, None)) == {"a"}
    assert ev.decode_batch(b"\xc1not msgpack") == ([], 1)
    assert ev.decode_batch(b"\x00" * (ev.MAX_FRAME_BYTES + 1)) == ([], 1)
    future = _pack.encode([1.0, [{"type": "SomeLaterEvent", "x": 1}], 0])
    assert ev.decode_batch(future) == ([], 1)


def test_the_index_keeps_at_most_max_blocks_forgetting_the_oldest() -> None:
    index = PrefixIndex(max_blocks=3)
    apply(index, "a", stored([11, 12, 13, 14], PROMPT))
    assert len(index) == 3 and index.stats.evicted == 1
    assert index.match(PROMPT, None) == {}  # the first block went first: no leading run
    apply(index, "b", stored([21, 22], list(range(8))))
    assert len(index) == 3


def test_forgetting_an_instance_drops_only_its_blocks() -> None:
    index = PrefixIndex()
    apply(index, "a", stored([11], PROMPT[:4]))
    apply(index, "b", stored([21], PROMPT[:4]))
    index.forget("a")
    assert set(index.match(PROMPT, None)) == {"b"}


def test_a_hot_prefix_never_puts_more_than_max_skew_above_the_least_loaded() -> None:
    """The bound on imbalance: 40 requests in flight at once, all for a prefix only `a`
    holds: `a` takes requests until it has `max_skew` more in flight than the others,
    then they share; at no choice did the chosen one exceed least + max_skew + 1."""
    router = Router(["a", "b", "c"], max_skew=3)
    apply(router.index, "a", stored([11, 12, 13, 14], PROMPT))
    chosen = []
    for _ in range(40):
        d = router.choose(PROMPT)
        after = dict(d.in_flight, **{d.server: d.in_flight[d.server] + 1})
        assert after[d.server] <= min(d.in_flight.values()) + router.max_skew + 1
        chosen.append(d.server)
    assert chosen[:4] == ["a"] * 4  # a's prefix first, up to the bound
    loads = {s: st.in_flight for s, st in router.servers.items()}
    assert max(loads.values()) - min(loads.values()) <= router.max_skew + 1
    assert loads["a"] == max(loads.values())
    for server in chosen:
        router.done(server)
    assert router.choose(PROMPT).server == "a"  # idle again: the prefix decides


def test_a_prefix_draws_a_request_to_a_busier_server_only_if_it_saves_more() -> None:
    """Within the bound, a server holding a prefix is chosen over a less loaded one only
    where the prompt tokens it saves outweigh the work queued there (its requests in
    flight, each weighing the prompt tokens recent requests computed): a short shared
    prefix (a system prompt) does not pile requests on one server, a long history does.
    (Choosing the longest prefix within `max_skew` sent the short one to `a` too.)"""
    router = Router(["a", "b"], max_skew=8)
    for i in range(4):  # four requests that computed 16 tokens each, done
        router.done(router.choose([1000 + 16 * i + k for k in range(16)]).server)
    apply(router.index, "a", stored([11, 12, 13, 14], PROMPT))  # a holds all 16 tokens
    assert [router.choose(PROMPT).server for _ in range(2)] == ["a", "a"]  # 0 to compute
    short = PROMPT[:4] + list(range(500, 512))  # a holds its first 4 tokens
    assert router.choose(short).server == "b"  # a saves 4 with 2 requests queued: b
    router.done("a")
    long = [*PROMPT, 7, 8, 9, 10]  # a holds 16 of its 20 tokens, with 1 request queued
    assert router.choose(long).server == "a"
    assert router.servers["a"].in_flight == 2 and router.servers["b"].in_flight == 1


def test_an_unhealthy_server_is_left_out_and_its_blocks_forgotten() -> None:
    router = Router(["a", "b"])
    apply(router.index, "a", stored([11], PROMPT[:4]))
    router.set_healthy("a", False)
    assert {router.choose(PROMPT).server for _ in range(4)} == {"b"}
    router.set_healthy("a", True)
    assert router.index.match(PROMPT, None) == {}


@pytest.mark.parametrize("policy", ["round-robin", "random"])
def test_the_other_policies_ignore_the_index(policy: str) -> None:
    router = Router(["a", "b"], policy=policy, seed=1)
    apply(router.index, "a", stored([11], PROMPT[:4]))
    got = [router.choose(PROMPT).server for _ in range(20)]
    assert set(got) == {"a", "b"}
    if policy == "round-robin":
        assert got[:4] == ["a", "b", "a", "b"]
