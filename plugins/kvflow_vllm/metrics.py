"""kvflow's transfer statistics in vLLM's metrics: the periodic log line and Prometheus.

`KVFlowStats` wraps `kvflow.observe.stats` data (collected from events in each
worker and the scheduler) in vLLM's `KVConnectorStats`; vLLM merges the
workers' stats with `aggregate` and logs `reduce()`. `KVFlowPromMetrics`
turns each merged interval into Prometheus histograms (transfer time and
size, per direction) and counters (lookup hit/miss tokens, failures,
timeouts, lent requests, refused inputs, task restarts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvflow.observe import stats
from kvflow.pd.security import REJECT_REASONS

__all__ = ["KVFlowPromMetrics", "KVFlowStats"]


@dataclass
class KVFlowStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.reduce(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


SECONDS = [0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
BYTES = [2.0 ** (14 + 2 * i) for i in range(10)]  # 16 KiB .. 4 GiB
COUNTED = {
    "hit_tokens": "Prompt tokens found in kvflow's store by lookups",
    "miss_tokens": "Prompt tokens lookups did not find",
    "failures": "kvflow transfers that failed (the blocks were recomputed or the request failed)",
    "timeouts": "kvflow transfers that timed out (also counted as failures)",
    "requests_lent": "Finished requests whose blocks a P/D producer held for a consumer",
}


def tier_labels(vllm_config: Any) -> set[str]:
    """The `tier` label values this engine's reports may add: `cpu` (the host tier) and the
    transport of each store it stacks (`transport`, `tiers`; under `MultiConnector`,
    kvflow's child's); nothing else a report names becomes a label."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    for child in extra.get("connectors") or []:
        if isinstance(child, dict) and child.get("kv_connector") == "KVFlowConnector":
            extra = dict(child.get("kv_connector_extra_config") or {})
    tiers = extra.get("tiers")
    below = [t.get("transport") for t in tiers if isinstance(t, dict)] if tiers else []
    names = [extra.get("transport", "fs"), *below]
    return {"cpu", *(n for n in names if isinstance(n, str))}


TIER_OUTCOMES = (
    ("hit", "hits"),
    ("miss", "misses"),
    ("promoted", "promoted"),
    ("stored", "stored"),
    ("through", "through"),
    ("evicted", "evicted"),
)
"""`vllm:kvflow_tier_chunks_total`'s outcome label, and the stats key it counts."""
TIER_CHUNKS = (
    "Chunks of a kvflow host-memory tier, by tier and outcome: loads found them in it (hit), "
    "read them from the store below (miss) and kept those (promoted); saves copied them "
    "into it (stored) or, without room, wrote them to the store directly (through); "
    "dropped from it to make room (evicted)"
)
TIER_BYTES = (
    "Bytes loads copied out of a kvflow host-memory tier (direction=load) and saves copied "
    "into it (direction=save), by tier"
)


class KVFlowPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.tiers = tier_labels(vllm_config)
        labels = [*labelnames, "direction"]
        histogram: Any = self._histogram_cls  # prometheus_client classes (or vLLM's wrappers)
        counter: Any = self._counter_cls

        def per_direction(metric: Any) -> dict[int, dict[str, Any]]:
            return {
                idx: {d: metric.labels(*values, d) for d in stats.DIRECTIONS}
                for idx, values in self.per_engine_labelvalues.items()
            }

        self.seconds = per_direction(
            histogram(
                name="vllm:kvflow_transfer_seconds",
                documentation="Duration of kvflow KV transfers (load, save, send)",
                buckets=SECONDS,
                labelnames=labels,
            )
        )
        self.nbytes = per_direction(
            histogram(
                name="vllm:kvflow_transfer_bytes",
                documentation="Size of kvflow KV transfers (load, save, send)",
                buckets=BYTES,
                labelnames=labels,
            )
        )
        self.tokens = per_direction(
            counter(
                name="vllm:kvflow_tokens",
                documentation="Prompt tokens kvflow moved: loaded (from a store or a P/D "
                "producer), saved, sent to a P/D consumer",
                labelnames=labels,
            )
        )
        self.counters: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(
                counter(name=f"vllm:kvflow_{key}", documentation=doc, labelnames=labelnames),
                self.per_engine_labelvalues,
            )
            for key, doc in COUNTED.items()
        }
        rejected = counter(
            name="vllm:kvflow_rejected",
            documentation="Inputs from outside kvflow refused, by reason: P/D params "
            "(address, signature, prompt, malformed) and side-channel frames "
            "(unauthenticated, frame, bounds)",
            labelnames=[*labelnames, "reason"],
        )
        self.rejected = {
            idx: {r: rejected.labels(*values, r) for r in REJECT_REASONS}
            for idx, values in self.per_engine_labelvalues.items()
        }
        self.restarts = counter(
            name="vllm:kvflow_task_restarts",
            documentation="Restarts of kvflow's long-lived tasks after they failed, by "
            "task (a peer transport's serve, the P/D claims); one that cannot be restarted "
            "stops the engine",
            labelnames=[*labelnames, "task"],
        )

        self.tier_chunks = counter(
            name="vllm:kvflow_tier_chunks",
            documentation=TIER_CHUNKS,
            labelnames=[*labelnames, "tier", "outcome"],
        )
        self.tier_bytes = counter(
            name="vllm:kvflow_tier_bytes",
            documentation=TIER_BYTES,
            labelnames=[*labelnames, "tier", "direction"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for direction, nbytes, start, end in transfer_stats_data.get("transfers", []):
            self.seconds[engine_idx][direction].observe(end - start)
            self.nbytes[engine_idx][direction].observe(nbytes)
        for direction in stats.DIRECTIONS:
            if value := transfer_stats_data.get(f"{direction}_tokens", 0):
                self.tokens[engine_idx][direction].inc(value)
        for key, per_engine in self.counters.items():
            if value := transfer_stats_data.get(key, 0):
                per_engine[engine_idx].inc(value)
        for reason, value in transfer_stats_data.get("rejected", {}).items():
            if reason in self.rejected[engine_idx]:
                self.rejected[engine_idx][reason].inc(value)
        values = self.per_engine_labelvalues[engine_idx]
        for task, value in transfer_stats_data.get("task_restarts", {}).items():
            if isinstance(task, str) and len(task) <= 64:  # kvflow's own task names
                self.restarts.labels(*values, task).inc(value)
        for tier, counts in transfer_stats_data.get("tiers", {}).items():
            if tier not in self.tiers:
                continue
            for outcome, key in TIER_OUTCOMES:
                if value := counts.get(key, 0):
                    self.tier_chunks.labels(*values, tier, outcome).inc(value)
            for direction, key in (("load", "bytes"), ("save", "bytes_in")):
                if value := counts.get(key, 0):
                    self.tier_bytes.labels(*values, tier, direction).inc(value)
