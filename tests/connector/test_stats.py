"""kvflow's stats for vLLM: collected from events, merged across workers like vLLM
merges them, reduced, and exported to Prometheus through vLLM's own classes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvflow.observe import stats
from kvflow.observe.events import (
    Event,
    LoadStarted,
    LookupAnswered,
    LookupRequested,
    RequestFinished,
    SaveStarted,
    TierRead,
    TierWrite,
    TransferDone,
    TransferFailed,
)

MB = 1_000_000


def done(direction: Any, nbytes: int, start: float, end: float, req: str = "r") -> TransferDone:
    return TransferDone(
        ts=end, req=req, direction=direction, chunks=1, nbytes=nbytes, elapsed_s=end - start
    )


def test_collector_counts_lookups_tokens_failures_and_lent_requests() -> None:
    c = stats.StatsCollector()
    events: list[Event] = [
        LookupRequested(req="a", num_tokens=100, num_chunks=4),
        LookupAnswered(req="a", hit_tokens=64, elapsed_s=0.001),
        LoadStarted(req="a", chunks=2, tokens=64, nbytes=2 * MB, transport="fs"),
        done("load", 2 * MB, 10.0, 10.5, "a"),
        SaveStarted(req="b", chunks=1, tokens=32, nbytes=MB, transport="fs"),
        TransferFailed(req="b", direction="save", reason="disk full"),
        TransferFailed(req="c", direction="load", reason="slow", timed_out=True),
        RequestFinished(req="d", lent=True),
        RequestFinished(req="e", lent=False),
        # hidden states (extract_hidden_states) are not KV traffic
        SaveStarted(req="f", chunks=1, tokens=9, nbytes=9, transport="fs", what="hidden_states"),
        TransferDone(
            req="f", direction="save", chunks=1, nbytes=9, elapsed_s=1, what="hidden_states"
        ),
        TransferFailed(req="g", direction="save", reason="x", what="hidden_states"),
    ]
    for e in events:
        c(e)
    data = c.take()
    assert data is not None
    assert (data["lookups"], data["hit_tokens"], data["miss_tokens"]) == (1, 64, 36)
    assert (data["load_tokens"], data["save_tokens"]) == (64, 0), "a failed save moved nothing"
    assert (data["failures"], data["timeouts"], data["requests_lent"]) == (2, 1, 1)
    assert data["transfers"] == [["load", 2 * MB, 10.0, 10.5]]
    assert c.take() is None, "take() resets the interval"


def test_busy_seconds_is_the_union_of_intervals() -> None:
    assert stats.busy_seconds([]) == 0.0
    assert stats.busy_seconds([(0, 1), (0.5, 1.5), (3, 4), (3.2, 3.8)]) == pytest.approx(2.5)


def test_throughput_of_overlapping_workers_is_bytes_over_wall_time() -> None:
    """Two workers each load 1 GB in the same second: 2 GB/s, not 1 (mean) or 4 (sum of
    per-transfer durations halved... or any other double count)."""
    w0, w1 = stats.empty(), stats.empty()
    w0["transfers"] = [["load", 1000 * MB, 5.0, 6.0]]
    w1["transfers"] = [["load", 1000 * MB, 5.0, 6.0], ["save", 100 * MB, 7.0, 7.1]]
    reduced = stats.reduce(stats.merge(w0, w1))
    assert reduced["load_GBps"] == pytest.approx(2.0)
    assert reduced["load_transfers"] == 2 and reduced["load_MB"] == 2000
    assert reduced["save_GBps"] == pytest.approx(1.0)
    assert reduced["send_GBps"] == 0.0


def test_vllm_stats_aggregate_like_vllm_does() -> None:
    from kvflow_vllm.connector import KVFlowConnector
    from kvflow_vllm.metrics import KVFlowStats

    a = KVFlowConnector.build_kv_connector_stats(
        {**stats.empty(), "hit_tokens": 5, "transfers": [["load", MB, 0.0, 1.0]]}
    )
    b = KVFlowStats(data={**stats.empty(), "hit_tokens": 7, "failures": 1})
    assert KVFlowStats().is_empty() and not b.is_empty()
    merged = a.aggregate(b)
    assert merged.reduce()["hit_tokens"] == 12 and merged.reduce()["failures"] == 1
    assert merged.reduce()["load_GBps"] == pytest.approx(0.001)


def test_prometheus_metrics_observe_histograms_and_counters() -> None:
    from kvflow_vllm.connector import KVFlowConnector

    registry = CollectorRegistry()

    def bound(cls: type[Any]) -> type[Any]:  # the metric class, in a registry of our own
        class Bound(cls):
            def __init__(self, *a: Any, **k: Any) -> None:
                super().__init__(*a, registry=registry, **k)

        return Bound

    types: dict[type[Any], type[Any]] = {
        Gauge: bound(Gauge),
        Counter: bound(Counter),
        Histogram: bound(Histogram),
    }
    config: Any = SimpleNamespace(kv_transfer_config=None)
    prom = KVFlowConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"]})
    data = {**stats.empty(), "hit_tokens": 96, "timeouts": 1, "failures": 1, "load_tokens": 150}
    data["transfers"] = [["load", 4 * MB, 1.0, 1.02], ["send", MB, 2.0, 2.5]]
    prom.observe(data, 0)
    get = registry.get_sample_value
    load = {"engine": "0", "direction": "load"}
    assert get("vllm:kvflow_transfer_seconds_count", load) == 1
    assert get("vllm:kvflow_transfer_seconds_sum", load) == pytest.approx(0.02)
    assert get("vllm:kvflow_transfer_bytes_sum", {"engine": "0", "direction": "send"}) == MB
    assert get("vllm:kvflow_hit_tokens_total", {"engine": "0"}) == 96
    assert get("vllm:kvflow_tokens_total", load) == 150  # a P/D pull is no lookup hit
    assert get("vllm:kvflow_tokens_total", {"engine": "0", "direction": "send"}) == 0
    assert get("vllm:kvflow_timeouts_total", {"engine": "0"}) == 1


def test_host_tier_reads_and_writes_reach_prometheus_by_tier_and_outcome() -> None:
    """`TierRead` and `TierWrite` events (kvflow.tiers) from two workers, merged as vLLM
    merges them, become `vllm:kvflow_tier_chunks_total{tier,outcome}` and
    `vllm:kvflow_tier_bytes_total{tier,direction}`."""
    from kvflow_vllm.connector import KVFlowConnector

    registry = CollectorRegistry()

    def bound(cls: type[Any]) -> type[Any]:
        class Bound(cls):
            def __init__(self, *a: Any, **k: Any) -> None:
                super().__init__(*a, registry=registry, **k)

        return Bound

    workers = []
    for hits, misses in ((5, 2), (3, 0)):
        c = stats.StatsCollector()
        c(TierRead(req="r", tier="cpu", hits=hits, misses=misses, promoted=misses, nbytes=hits))
        c(TierRead(req="x", tier="disk", hits=1, misses=0, promoted=0, nbytes=1))  # not ours
        c(TierWrite(req="s", tier="cpu", stored=4, through=1, evicted=misses, nbytes=40))
        workers.append(c.take())
    merged = stats.merge(stats.empty(), workers[0])
    merged = stats.merge(merged, workers[1])
    assert stats.reduce(merged)["tier_cpu_hits"] == 8
    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    config: Any = SimpleNamespace(kv_transfer_config=None)
    prom = KVFlowConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"]})
    prom.observe(merged, 0)
    get = registry.get_sample_value
    cpu = {"engine": "0", "tier": "cpu"}
    assert get("vllm:kvflow_tier_chunks_total", {**cpu, "outcome": "hit"}) == 8
    assert get("vllm:kvflow_tier_chunks_total", {**cpu, "outcome": "miss"}) == 2
    assert get("vllm:kvflow_tier_chunks_total", {**cpu, "outcome": "promoted"}) == 2
    assert get("vllm:kvflow_tier_chunks_total", {**cpu, "outcome": "stored"}) == 8
    assert get("vllm:kvflow_tier_chunks_total", {**cpu, "outcome": "through"}) == 2
    assert get("vllm:kvflow_tier_chunks_total", {**cpu, "outcome": "evicted"}) == 2
    assert get("vllm:kvflow_tier_bytes_total", {**cpu, "direction": "load"}) == 8
    assert get("vllm:kvflow_tier_bytes_total", {**cpu, "direction": "save"}) == 80
    disk = {"engine": "0", "tier": "disk", "direction": "load"}
    assert get("vllm:kvflow_tier_bytes_total", disk) is None


def test_a_stacks_tiers_reach_prometheus_under_their_transports_names() -> None:
    """A stack's loads are `TierRead`s of its top store (`fs` over `redis`): labelled with
    the names the engine's configuration gives its stores, under `MultiConnector` too."""
    from kvflow_vllm.connector import KVFlowConnector

    kvflow = {"transport": "fs", "tiers": [{"transport": "redis", "options": {}}]}
    child = {"kv_connector": "KVFlowConnector", "kv_connector_extra_config": kvflow}
    for extra in (kvflow, {"connectors": [child]}):
        registry = CollectorRegistry()

        def bound(cls: type[Any], registry: CollectorRegistry = registry) -> type[Any]:
            class Bound(cls):
                def __init__(self, *a: Any, **k: Any) -> None:
                    super().__init__(*a, registry=registry, **k)

            return Bound

        c = stats.StatsCollector()
        c(TierRead(req="r", tier="fs", hits=3, misses=1, promoted=1, nbytes=3))
        c(TierRead(req="r", tier="disk", hits=1, misses=0, promoted=0, nbytes=1))
        types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
        config: Any = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra)
        )
        prom = KVFlowConnector.build_prom_metrics(config, types, ["engine"], {0: ["0"]})
        prom.observe(stats.merge(stats.empty(), c.take()), 0)
        get = registry.get_sample_value
        fs = {"engine": "0", "tier": "fs"}
        assert get("vllm:kvflow_tier_chunks_total", {**fs, "outcome": "hit"}) == 3
        assert get("vllm:kvflow_tier_chunks_total", {**fs, "outcome": "promoted"}) == 1
        disk = {"engine": "0", "tier": "disk", "outcome": "hit"}
        assert get("vllm:kvflow_tier_chunks_total", disk) is None
