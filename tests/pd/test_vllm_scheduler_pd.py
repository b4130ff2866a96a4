"""kvflow's prefill/decode inside vLLM's real `Scheduler` (no engine, no model forward):
a producer offers a request's blocks and a consumer pulls them; the P/D params a consumer
believes (its prompt's, its deployment's, from loopback without a key) and the offer id
a reused request id gets.

Driven by hand as in tests/connector/test_vllm_scheduler.py (see
`tests/support/vllm_scheduler.py`), in both of the engine core's loops (the `loop` fixture).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM installed")

from kvflow.engine.metadata import OfferSpec
from kvflow.keyfiles import keygen, read_key
from kvflow.observe.events import Event, Rejected
from kvflow.pd.params import PdParams, decode_streamed, parse_pd_params
from kvflow.pd.security import Channel
from kvflow.transport import Offer, PeerSource
from kvflow_vllm.connector import KVFlowHandshake

from ..support.vllm_scheduler import (
    BLOCK_SIZE,
    Harness,
    MakeHarness,
    aimed,
    held_offer,
    make_request,
    make_vllm_config,
    prompt_of,
    run_to_completion,
)


def test_a_pipeline_parallel_producer_offers_each_stages_endpoint(harness: MakeHarness) -> None:
    """vLLM's engine core hands a scheduler the workers' handshakes keyed by (pp_rank,
    tp_rank) (`set_xfer_handshake_metadata_pp_aware`; its default refuses pp_rank > 0, so
    an engine of two stages would not start): the producer's params list both stages'
    endpoints, stage by stage, and its pipeline parallel size."""
    config = make_vllm_config(transport="zmq", kv_role="kv_producer", pipeline_parallel_size=2)
    producer = harness(config, 16)
    stages = ["tcp://127.0.0.1:45556", "tcp://127.0.0.1:45557"]  # never dialled
    producer.connector.set_xfer_handshake_metadata_pp_aware(
        {(1, 0): KVFlowHandshake([stages[1]]), (0, 0): KVFlowHandshake([stages[0]])}
    )
    producer.add(
        make_request(
            "pd", prompt_of(3, 40), max_tokens=1, kv_transfer_params={"do_remote_decode": True}
        )
    )
    (out,) = producer.collect(producer.step()).finished
    (pd,) = parse_pd_params(out.kv_transfer_params) or []
    assert pd.addresses == stages and pd.pp_size == 2 and pd.tp_size == 1


def test_pd_producer_offers_blocks_and_consumer_pulls_them(harness: MakeHarness) -> None:
    producer = harness(make_vllm_config(transport="zmq", kv_role="kv_producer"), 16)
    address = "tcp://127.0.0.1:45555"  # never dialled: no worker runs
    producer.connector.set_xfer_handshake_metadata({0: KVFlowHandshake([address])})
    start = producer.free_blocks
    prompt = prompt_of(3, 40)
    producer.add(
        make_request("pd", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        make_request("plain", prompt_of(4, 20), max_tokens=1),
    )
    prefill = producer.collect(producer.step())
    outputs = {o.request_id: o for o in prefill.finished}
    assert set(outputs) == {"pd", "plain"}
    assert outputs["plain"].kv_transfer_params is None
    params = outputs["pd"].kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    (pd,) = parse_pd_params(params) or []
    table = prefill.block_ids["pd"]
    assert pd.block_ids == table and pd.num_tokens == 40 and pd.block_size == BLOCK_SIZE
    assert pd.addresses == [address] and pd.engine_id == producer.connector.context.engine_id
    assert set(producer.scheduler.requests) == {"pd"}, "plain's blocks are free already"
    assert producer.free_blocks == start - 3

    offer = producer.step()
    assert offer.plan.offers == [OfferSpec("pd", table, [16, 16, 8], pd.offer)]
    assert offer.plan.lent == ["pd"]
    producer.step()  # the consumer has not pulled yet
    assert producer.free_blocks == start - 3, "held for the consumer"
    producer.step(finished_sending={"pd"})
    assert producer.free_blocks == start
    assert not producer.scheduler.requests and not producer.kvflow_requests

    consumer = harness(make_vllm_config(transport="zmq", kv_role="kv_consumer"), 16)
    c_start = consumer.free_blocks
    with held_offer(Offer(pd.offer, table, [16, 16, 8], 0, lambda _layer: [])) as live:
        address = live  # a producer that answers the consumer's claim
        params = aimed(params, address)
        consumer.add(make_request("d", prompt, max_tokens=3, kv_transfer_params=params))
    pull = consumer.step()
    assert not pull.output.num_scheduled_tokens
    (load,) = pull.plan.loads
    assert load.asynchronous and load.token_counts == [16, 16, 8]
    assert load.block_ids == consumer.block_table("d")
    want = PeerSource(pd.engine_id, [address], pd.offer, table, 1, pd.shape.kv_heads)
    assert load.source == want
    assert pd.shape.kv_heads == 2 and pd.shape.layers == 2, pd.shape  # vLLM's model config
    consumer.step(finished_recving={"d"})
    decode = consumer.step()
    assert decode.output.num_scheduled_tokens == {"d": 1}, "only the last token recomputed"
    assert decode.block_ids["d"] == load.block_ids
    run_to_completion(consumer)
    assert all(not s.plan.saves and not s.plan.lent for s in consumer.steps)
    assert consumer.free_blocks == c_start
    assert not consumer.kvflow_requests


def test_a_streamed_prefill_is_offered_as_it_is_scheduled_and_its_decode_pulls_it(
    harness: MakeHarness,
) -> None:
    """`kvflow proxy --stream` sends a request to both instances at once, naming an offer
    id it drew: the producer offers the blocks under it in the step that schedules the
    prompt (its workers send each layer once that step's forward wrote it), not a step
    after the request finished; the consumer's claim brings the producer's params, and
    it pulls as from params that came with the request."""
    offer_id = "5e" * 16
    held = Offer(offer_id, [], [], 0, lambda _layer: [])  # filled from the producer's plan
    with held_offer(held) as live:
        producer = harness(make_vllm_config(transport="zmq", kv_role="kv_producer"), 16)
        producer.connector.set_xfer_handshake_metadata({0: KVFlowHandshake([live])})
        start = producer.free_blocks
        prompt = prompt_of(3, 40)
        streamed = {"do_remote_decode": True, "kvflow_offer": offer_id}
        producer.add(make_request("pd", prompt, max_tokens=1, kv_transfer_params=streamed))
        prefill = producer.step()
        (spec,) = prefill.plan.offers  # in the step that computes the prompt
        assert not prefill.plan.lent, "offered before the request finished"
        table = prefill.block_ids["pd"]
        assert (spec.req, spec.offer, spec.block_ids) == ("pd", offer_id, table)
        (out,) = producer.collect(prefill).finished
        (pd,) = parse_pd_params(out.kv_transfer_params) or []
        assert pd.offer == offer_id and decode_streamed(spec.params, "the plan") == pd
        producer.step(finished_sending={"pd"})
        assert [o for s in producer.steps for o in s.plan.offers] == [spec], "offered once"
        assert [r for s in producer.steps for r in s.plan.lent] == ["pd"]
        assert producer.free_blocks == start and not producer.kvflow_requests
        held.block_ids, held.token_counts, held.params = table, spec.token_counts, spec.params

        consumer = harness(make_vllm_config(transport="zmq", kv_role="kv_consumer"), 16)
        c_start = consumer.free_blocks
        ref = {"do_remote_prefill": True, "kvflow_stream": {"offer": offer_id, "addresses": [live]}}
        consumer.add(make_request("d", prompt, max_tokens=3, kv_transfer_params=ref))
        pull = consumer.step()
        (load,) = pull.plan.loads
        assert load.asynchronous and load.token_counts == [16, 16, 8]
        assert load.source == PeerSource(pd.engine_id, [live], offer_id, table, 1, 2)
        consumer.step(finished_recving={"d"})
        decode = consumer.step()
        assert decode.output.num_scheduled_tokens == {"d": 1}, "only the last token recomputed"
        run_to_completion(consumer)
    assert consumer.free_blocks == c_start and not consumer.kvflow_requests


def test_a_streamed_claim_whose_params_are_not_for_its_prompt_is_computed_here(
    harness: MakeHarness,
) -> None:
    """A client that names someone's streamed offer for its own prompt gets nothing from
    it: the params the claim brings are checked as any params (the prompt's digest)."""
    offer_id = "7a" * 16
    held = Offer(offer_id, [], [], 0, lambda _layer: [])
    with held_offer(held) as live:
        producer = harness(make_vllm_config(transport="zmq", kv_role="kv_producer"), 16)
        producer.connector.set_xfer_handshake_metadata({0: KVFlowHandshake([live])})
        streamed = {"do_remote_decode": True, "kvflow_offer": offer_id}
        producer.add(
            make_request("pd", prompt_of(3, 40), max_tokens=1, kv_transfer_params=streamed)
        )
        (spec,) = producer.step().plan.offers
        held.block_ids, held.token_counts, held.params = (
            spec.block_ids, spec.token_counts, spec.params,
        )  # fmt: skip
        consumer = harness(make_vllm_config(transport="zmq", kv_role="kv_consumer"), 16)
        rejected = _rejections(consumer)
        ref = {"do_remote_prefill": True, "kvflow_stream": {"offer": offer_id, "addresses": [live]}}
        consumer.add(make_request("d", prompt_of(4, 40), max_tokens=3, kv_transfer_params=ref))
        first = consumer.step()
        run_to_completion(consumer)
    assert not first.plan.loads and first.output.num_scheduled_tokens == {"d": 40}
    assert rejected() == {"prompt": 1}
    assert not consumer.kvflow_requests


def _offered(harness: MakeHarness, prompt: list[int], **extra: object) -> dict[str, Any]:
    """The `kv_transfer_params` vLLM's real Scheduler returns for a P/D prefill of
    `prompt` (a producer with kvflow's keys `extra`), its offer still held."""
    producer = harness(make_vllm_config(transport="zmq", kv_role="kv_producer", extra=extra), 16)
    producer.connector.set_xfer_handshake_metadata({0: KVFlowHandshake(["tcp://127.0.0.1:45555"])})
    producer.add(
        make_request("pd", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    )
    (out,) = producer.collect(producer.step()).finished
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def _rejections(h: Harness) -> Callable[[], dict[str, int]]:
    """Record the rejections `h`'s kvflow counts (what `vllm:kvflow_rejected_total`
    gets); the returned call says how many, by reason, so far."""
    seen: dict[str, int] = {}

    def count(event: Event) -> None:
        if isinstance(event, Rejected):
            seen[event.reason] = seen.get(event.reason, 0) + 1

    h.connector.context.bus.subscribe(count)

    def counted() -> dict[str, int]:
        runtime = h.connector.context.runtime
        runtime.call(trio.lowlevel.checkpoint, timeout=10.0)  # after its submits
        return dict(seen)

    return counted


def test_pd_params_are_believed_only_for_their_prompt_and_deployment(
    harness: MakeHarness, tmp_path: Path
) -> None:
    """Issue 27, finding 4, with vLLM's real Scheduler on both sides: a consumer pulls
    only with params its deployment's key signed for this very prompt; anything else it
    computes itself (never connecting), counted by reason."""
    key = str(keygen(tmp_path / "key"))
    prompt, other = prompt_of(3, 40), prompt_of(4, 40)
    params = _offered(harness, prompt, key_file=key)
    (pd,) = parse_pd_params(params) or []
    assert len(pd.offer) == 32 and pd.mac, "a random offer id, signed"

    def tampered(**fields: object) -> dict[str, Any]:
        return {**params, "kvflow": {**params["kvflow"], **fields}}

    cfg = make_vllm_config(  # no prefix cache: every request here computes all it asks
        transport="zmq", kv_role="kv_consumer", extra={"key_file": key}, enable_prefix_caching=False
    )
    consumer = harness(cfg, 32)
    rejected = _rejections(consumer)
    other_key = tmp_path / "other"
    keygen(other_key)
    forged = PdParams(**{**params["kvflow"], "mac": ""}).signed(  # type: ignore[arg-type]
        Channel(read_key(str(other_key)))
    )
    cases = {
        "another prompt": (other, params),
        "other blocks": (prompt, tampered(block_ids=[7, 8, 9])),
        "another producer": (prompt, tampered(addresses=["tcp://127.0.0.1:1"])),
        "unsigned": (prompt, tampered(mac="")),
        "another key": (prompt, {**params, "kvflow": msgspec.to_builtins(forged)}),
        "not an offer id": (prompt, tampered(offer="../../x")),
    }
    for i, (tokens, p) in enumerate(cases.values()):
        consumer.add(make_request(f"d{i}", tokens, max_tokens=1, kv_transfer_params=p))
    step = consumer.step()
    assert not step.plan.loads, "nothing pulled"
    assert step.output.num_scheduled_tokens == {f"d{i}": 40 for i in range(len(cases))}
    assert rejected() == {"prompt": 1, "signature": 4, "malformed": 1}

    with held_offer(
        Offer(pd.offer, pd.block_ids, [16, 16, 8], 0, lambda _: []), Channel(read_key(key))
    ) as address:  # the genuine params, pulled from a producer of this deployment
        consumer.add(make_request("real", prompt, max_tokens=1, kv_transfer_params=params))
    (load,) = consumer.step().plan.loads
    assert load.source is not None and load.source.req == pd.offer
    del address


def test_a_consumer_without_a_key_file_pulls_from_loopback_only_and_never_from_a_deployment(
    harness: MakeHarness, tmp_path: Path
) -> None:
    """Without a deployment key (the host key), P/D params may name loopback producers
    only (a client must not make the consumer dial any host, or probe ports), and a
    deployment-keyed producer's params are refused (this consumer could not speak to it)."""
    prompt = prompt_of(3, 40)
    keyless = _offered(harness, prompt)
    keyed = _offered(harness, prompt, key_file=str(keygen(tmp_path / "key")))
    consumer = harness(make_vllm_config(transport="zmq", kv_role="kv_consumer"), 16)
    rejected = _rejections(consumer)
    far = {**keyless, "kvflow": {**keyless["kvflow"], "addresses": ["tcp://10.9.8.7:5555"]}}
    named = {**keyless, "kvflow": {**keyless["kvflow"], "addresses": ["tcp://localhost:5"]}}
    tail = {**keyless, "kvflow": {**keyless["kvflow"], "addresses": ["tcp://127.0.0.1:5#;x:1"]}}
    for i, p in enumerate((far, named, tail, keyed)):
        consumer.add(make_request(f"d{i}", prompt, max_tokens=1, kv_transfer_params=p))
    assert not consumer.step().plan.loads
    assert rejected() == {"address": 3, "signature": 1}


def test_a_client_that_hoards_prefills_holds_at_most_max_offer_fraction_of_the_cache(
    harness: MakeHarness,
) -> None:
    """Issue 46, M2: any client may send prefills with `do_remote_decode` and never
    decode them; each offer held its blocks for `hold_timeout_s`, with no cap, so a few
    long prompts filled the KV cache. Now offers hold at most `max_offer_fraction` of it:
    past that a prefill gets no P/D params (its decode computes the prompt), its blocks
    go back at once, counted `offers`; as offers end (pulled, released, expired),
    prefills are offered again."""
    producer = harness(make_vllm_config(transport="zmq", kv_role="kv_producer"), 65)
    producer.connector.set_xfer_handshake_metadata({0: KVFlowHandshake(["tcp://127.0.0.1:45555"])})
    rejected = _rejections(producer)
    free = producer.free_blocks  # 64: block 0 is vLLM's null block
    cap = int(0.5 * 65)  # max_offer_fraction's default of the 65 blocks
    offered: list[str] = []
    for i in range(10):  # 7 blocks each (100 tokens, blocks of 16): 70 in all
        remote = {"do_remote_decode": True}
        req = make_request(f"h{i}", prompt_of(i, 100), max_tokens=1, kv_transfer_params=remote)
        producer.add(req)
        (out,) = producer.collect(producer.step()).finished
        if out.kv_transfer_params:
            offered.append(f"h{i}")
    assert len(offered) == cap // 7 == 4, offered
    assert producer.free_blocks == free - 7 * len(offered), "refused prefills' blocks are back"
    assert rejected().get("offers") == 10 - len(offered)
    producer.add(make_request("tick", prompt_of(12, 20), max_tokens=1))
    producer.collect(producer.step(finished_sending=offered))  # their offers ended
    assert producer.free_blocks == free, "every block is back"
    remote = {"do_remote_decode": True}
    producer.add(make_request("late", prompt_of(11, 100), max_tokens=1, kv_transfer_params=remote))
    (out,) = producer.collect(producer.step()).finished
    assert out.kv_transfer_params, "offered again once the hoard's offers ended"


def test_a_clients_words_reach_the_log_on_one_line(
    harness: MakeHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 46, Low: under `insecure`, an unsigned params' engine id, and any request id,
    are a client's words; the consumer's log lines that name them stay one line each."""
    prompt = prompt_of(3, 40)
    params = _offered(harness, prompt, insecure=True)
    forged = "x\nkvflow: FORGED line\u2028"
    two = ["tcp://127.0.0.1:5", "tcp://127.0.0.1:6"]
    bad = {**params, "kvflow": {**params["kvflow"], "engine_id": forged, "pp_size": 2,
                                "addresses": two}}  # fmt: skip
    consumer = harness(make_vllm_config(transport="zmq", kv_role="kv_consumer",
                                        extra={"insecure": True}), 16)  # fmt: skip
    caplog.clear()
    consumer.add(make_request("d\nkvflow: FORGED", prompt, max_tokens=1, kv_transfer_params=bad))
    other = {**params, "kvflow": {**params["kvflow"], "prompt": "0" * 32}}
    consumer.add(make_request("e\r\n", prompt, max_tokens=1, kv_transfer_params=other))
    assert not consumer.step().plan.loads
    lines = [r.getMessage() for r in caplog.records if "kvflow" in r.getMessage()]
    assert any("pipeline parallel size 2" in line for line in lines), lines
    assert any("refused (prompt)" in line for line in lines), lines
    assert all("\n" not in line and "\r" not in line and "\u2028" not in line for line in lines)


def test_a_repeated_request_id_gets_an_offer_of_its_own(harness: MakeHarness) -> None:
    """Issue 27, finding 5: clients choose request ids. A request that reuses the id of
    an earlier one is offered under a new random offer id: params of the earlier request
    (still in some consumer's hands) never name the later request's blocks."""
    producer = harness(make_vllm_config(transport="zmq", kv_role="kv_producer"), 16)
    producer.connector.set_xfer_handshake_metadata({0: KVFlowHandshake(["tcp://127.0.0.1:45555"])})
    offers = []
    for seed in (3, 4):
        remote = {"do_remote_decode": True}
        req = make_request("same", prompt_of(seed, 40), max_tokens=1, kv_transfer_params=remote)
        producer.add(req)
        (out,) = producer.collect(producer.step()).finished
        (pd,) = parse_pd_params(out.kv_transfer_params) or []
        (spec,) = producer.step().plan.offers
        assert spec.offer == pd.offer and spec.req == "same"
        producer.step(finished_sending={"same"})  # pulled: vLLM frees the id
        offers.append(pd)
    assert offers[0].offer != offers[1].offer
    assert offers[0].prompt != offers[1].prompt


@pytest.mark.parametrize(("p_bs", "c_bs"), [(16, 32), (32, 16)])
def test_a_consumer_of_another_block_size_pulls_the_blocks_holding_its_tokens(
    harness: MakeHarness, p_bs: int, c_bs: int
) -> None:
    """Issue 30, item 2: a producer of blocks of 16 tokens and a consumer of 32 (and the
    reverse), vLLM's real schedulers: the consumer plans the load of every prompt token
    into its own blocks from the producer's blocks that hold them (`PeerSource.block_size`;
    zmq converts on receive: tests/transports/test_peer_layouts.py)."""
    config = make_vllm_config(transport="zmq", kv_role="kv_producer", block_size=p_bs)
    producer = harness(config, 16)
    producer.connector.set_xfer_handshake_metadata({0: KVFlowHandshake(["tcp://127.0.0.1:9"])})
    prompt = prompt_of(6, 72)
    req = make_request(
        "pd", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, block_size=p_bs
    )
    producer.add(req)
    (out,) = producer.collect(producer.step()).finished
    params = out.kv_transfer_params
    assert params is not None
    (pd,) = parse_pd_params(params) or []
    assert pd.block_size == p_bs and len(pd.block_ids) == -(-72 // p_bs)
    config = make_vllm_config(transport="zmq", kv_role="kv_consumer", block_size=c_bs)
    consumer = harness(config, 16)
    counts = [p_bs] * (72 // p_bs) + [72 % p_bs]
    with held_offer(Offer(pd.offer, pd.block_ids, counts, 0, lambda _layer: [])) as live:
        consumer.add(
            make_request(
                "d", prompt, max_tokens=2, kv_transfer_params=aimed(params, live), block_size=c_bs
            )
        )
        (load,) = consumer.step().plan.loads
    assert load.token_counts == [c_bs] * (72 // c_bs) + [72 % c_bs]
    assert load.block_ids == consumer.block_table("d")
    assert load.source is not None
    assert (load.source.block_ids, load.source.block_size, load.source.skip) == (
        pd.block_ids,
        p_bs,
        0,
    )


def test_a_request_preempted_after_its_pull_is_computed_when_it_resumes(
    harness: MakeHarness,
) -> None:
    """Found under load (tests/compat/test_serving_load.py): a decode server short of
    blocks preempts a request whose prompt it pulled; resumed, it claimed its producer's
    blocks again, which the producer had let go once pulled ("already pulled"), and under
    policy `fail` the request failed. A producer's KV serves one pull: the resumed request
    is computed here, as vLLM's NixlConnector does (one transfer per request)."""
    prompts = {"a": prompt_of(5, 40), "b": prompt_of(6, 40)}
    offered = {r: _offered(harness, p) for r, p in prompts.items()}
    # 7 usable blocks: two 40-token prompts take 3 each; decoding past 48 tokens needs a
    # 4th, which preempts the other; no prefix caching: the preempted one's blocks are
    # not found again in vLLM's cache (on a loaded server, others have taken them)
    config = make_vllm_config(
        transport="zmq",
        kv_role="kv_consumer",
        enable_prefix_caching=False,
        kv_load_failure_policy="fail",
    )
    consumer = harness(config, 8)
    start = consumer.free_blocks
    offers = []
    for params in offered.values():
        (pd,) = parse_pd_params(params) or []
        offers.append(Offer(pd.offer, pd.block_ids, [16, 16, 8], 0, lambda _layer: []))
    with held_offer(offers[0]) as first, held_offer(offers[1]) as second:
        for (r, prompt), address in zip(prompts.items(), (first, second), strict=True):
            params = aimed(offered[r], address)
            consumer.add(make_request(r, prompt, max_tokens=20, kv_transfer_params=params))
        consumer.step()
        consumer.step(finished_recving=set(prompts))
        run_to_completion(consumer)
    assert any(s.plan.preempted for s in consumer.steps), "nothing was preempted"
    pulls = [ld.req for s in consumer.steps for ld in s.plan.loads if ld.source is not None]
    assert sorted(pulls) == ["a", "b"], f"each prompt pulled once, not {pulls}"
    assert consumer.free_blocks == start and not consumer.kvflow_requests
