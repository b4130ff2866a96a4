"""A model that mixes sliding-window and full attention, with vLLM's hybrid KV cache
manager on (kvflow is `SupportsHMA`): every KV cache group has its own keys, a sliding
window loads only the blocks inside it, and tokens match a run without kvflow.

`tiny-swa` is `tiny-llama` with `layer_types` (three sliding-window layers of 64 tokens,
one full): vLLM gives it four KV cache groups. Engines run once for the module: a
baseline without a connector and, at the same time, a prefill instance (`kv_producer`)
that saves to a fresh `fs` store, then a decode instance (`kv_consumer`, a fresh
process) that loads from it, with a KV cache small enough that vLLM hands the blocks a
sliding window gave back to other requests while their saves may still read them.
Prefill/decode runs between two more live engines over `zmq` and `nixl`, one pull per
group.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvflow.observe.events import (
    CachesRegistered,
    LoadStarted,
    Rejected,
    TransferDone,
    TransferFailed,
)
from kvflow.observe.log import read_event_log
from kvflow_vllm.engine_process import GenResult, ScenarioResult, model_dir

from ..support.vllm_engines import (
    ServingEngine,
    assert_same_generation,
    close_all,
    events_for,
    run_engine,
    run_engines,
    started,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BLOCK = 32
WINDOW = 64
_rng = random.Random(16)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (300, 260, 330, 200)]
TURNED_OFF = "Turning off hybrid kv cache manager"
# chunked prefill in small steps and few blocks: sliding-window blocks go back to vLLM
# and out to other requests while the batch runs
LLM_ARGS = {
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 128,
    "num_gpu_blocks_override": 96,
    "enable_prefix_caching": True,
}


class Run:
    baseline: ScenarioResult
    prefill: ScenarioResult
    decode: ScenarioResult

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def extra(self, name: str) -> dict[str, object]:
        return {
            "options": {"path": str(self.tmp / "store")},
            "event_log": str(self.tmp / f"{name}.events.jsonl"),
        }

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()


def _scenario(**kw: object) -> dict[str, object]:
    return {
        "batches": [PROMPTS],
        "model": model_dir("tiny-swa"),
        "block_size": BLOCK,
        "llm_args": LLM_ARGS,
        **kw,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    r = Run(tmp_path_factory.mktemp("hybrid"))
    first = run_engines(  # two at once: the decode instance needs the prefill's store
        r.tmp,
        {
            "baseline": _scenario(connector=False),
            "prefill": _scenario(kv_role="kv_producer", extra_config=r.extra("prefill")),
        },
    )
    r.baseline, r.prefill = started(first["baseline"]), started(first["prefill"])
    r.decode = run_engine(
        r.tmp, "decode", **_scenario(kv_role="kv_consumer", extra_config=r.extra("decode"))
    )
    return r


def _results(res: ScenarioResult) -> list[GenResult]:
    return res.batches[0]


def test_the_hybrid_manager_stays_on_with_a_group_per_engine(run: Run) -> None:
    for name in ("prefill", "decode"):
        assert TURNED_OFF not in run.log(name), f"{name}: vLLM turned its hybrid manager off"
        events = read_event_log(str(run.tmp / f"{name}.events.jsonl"))
        groups = [e for e in events if isinstance(e, CachesRegistered)]
        assert len(groups) == 4, f"{name}: {len(groups)} KV cache groups registered, want 4"


def test_prefill_instance_matches_the_baseline(run: Run) -> None:
    for i, (got, want) in enumerate(
        zip(_results(run.prefill), _results(run.baseline), strict=True)
    ):
        assert_same_generation(got, want, f"prefill, prompt {i}")


def test_decode_instance_loads_each_prompt_and_matches_the_baseline(run: Run) -> None:
    for i, (got, want) in enumerate(zip(_results(run.decode), _results(run.baseline), strict=True)):
        assert_same_generation(got, want, f"decode, prompt {i}")
        assert got.cached_tokens == len(PROMPTS[i]) - 1, f"prompt {i}: {got.cached_tokens}"


def test_sliding_window_groups_load_only_the_blocks_inside_the_window(run: Run) -> None:
    log = run.tmp / "decode.events.jsonl"
    for i, res in enumerate(_results(run.decode)):
        events = events_for(log, res)
        assert not [e for e in events if isinstance(e, TransferFailed)]
        *sliding, full = sorted(e.chunks for e in events if isinstance(e, LoadStarted))
        # the full-attention group loads every chunk of the hit (all but the last token)
        assert full == -(-(len(PROMPTS[i]) - 1) // BLOCK), f"prompt {i}: {full} chunks"
        # each sliding-window group, the blocks holding its window's 63 tokens: 3 at most
        window = -(-(WINDOW - 1) // BLOCK) + 1
        assert len(sliding) == 3 and all(c <= window for c in sliding), (
            f"prompt {i}: sliding-window groups loaded {sliding} chunks"
        )


@pytest.mark.parametrize("transport", ["zmq", "nixl"])
def test_prefill_decode_pulls_every_group(run: Run, transport: str) -> None:
    """vLLM's proxy convention between two live engines: each KV cache group's blocks
    are pulled from the producer's own endpoint for that group; a consumer that must
    not recompute (policy fail) decodes what the baseline does."""
    if transport == "nixl":
        pytest.importorskip("nixl_cu12", reason="NIXL is an optional extra: kvflow[nixl]")
    kw: dict[str, object] = {"model": model_dir("tiny-swa"), "block_size": BLOCK}
    log = run.tmp / f"{transport}.events.jsonl"
    kw["llm_args"] = LLM_ARGS
    producer = ServingEngine(
        run.tmp,
        f"{transport}-producer",
        kv_role="kv_producer",
        extra_config={"transport": transport},
        **kw,
    )
    consumer = ServingEngine(
        run.tmp,
        f"{transport}-consumer",
        kv_role="kv_consumer",
        failure_policy="fail",
        extra_config={"transport": transport, "event_log": str(log)},
        **kw,
    )
    try:
        producer.wait_ready()
        consumer.wait_ready()
        for i, (prompt, want) in enumerate(zip(PROMPTS, _results(run.baseline), strict=True)):
            prefill = producer.ask(prompt, 1, {"do_remote_decode": True})
            params = prefill.kv_transfer_params or {}
            assert len(params.get("kvflow", [])) == 4, f"one entry per group: {params}"
            got = consumer.ask(prompt, len(want.tokens), params)
            assert_same_generation(got, want, f"P/D consumer, prompt {i}")
            events = events_for(log, got)
            done = [e for e in events if isinstance(e, TransferDone) and e.direction == "load"]
            assert len(done) == 4, f"prompt {i}: {len(done)} of 4 groups pulled"
        if transport == "zmq":  # issue 27: a group's params pass for no other group
            _swapped_groups_are_computed_not_loaded(producer, consumer, log)
        for name in (f"{transport}-producer", f"{transport}-consumer"):
            assert TURNED_OFF not in run.log(name), f"{name}: hybrid manager turned off"
    finally:
        close_all((producer, consumer))


def _swapped_groups_are_computed_not_loaded(
    producer: ServingEngine, consumer: ServingEngine, log: Path
) -> None:
    """A client (or a proxy) that reorders a hybrid model's per-group params: each is
    signed for its own KV cache group (the group's namespace is in its prompt digest),
    so none passes for another; the consumer computes the prompt and loads nothing into
    a group from another group's blocks."""
    prompt = [_rng.randrange(3, 1000) for _ in range(280)]  # in no engine's prefix cache
    prefill = producer.ask(prompt, 1, {"do_remote_decode": True})
    params = prefill.kv_transfer_params or {}
    swapped = {**params, "kvflow": list(reversed(params["kvflow"]))}
    got = consumer.ask(prompt, 8, swapped)
    want = producer.ask(prompt, 8)  # computed there
    assert_same_generation(got, want, "P/D consumer, the groups' params reversed")
    events = events_for(log, got)
    assert not [e for e in events if isinstance(e, LoadStarted)], "a group loaded"
    refused = [e.reason for e in read_event_log(str(log)) if isinstance(e, Rejected)]
    assert refused == ["prompt"] * 4, refused
