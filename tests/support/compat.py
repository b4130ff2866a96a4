"""The compatibility matrix's engines and checks (docs/compatibility.md, tests/compat/).

A row's engines: a baseline without a connector; a cold engine that computes and saves to
`fs`; a warm engine (fresh) that loads from that store, through a host tier, each case
twice: the first time from `fs`, the second from the host tier (vLLM's prefix caching off,
so that kvflow serves every hit); and P/D pairs over `zmq` and `nixl`, the test playing
vLLM's proxy. Every case's output is compared with the baseline's, and kvflow's own event
log says it loaded (never vLLM's prefix cache).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvflow.observe.events import BlocksAllocated, Event, TierRead
from kvflow.observe.log import read_event_log
from kvflow_vllm.engine_process import GenResult, Sampling, ScenarioResult

from .vllm_engines import ServingEngine, close_all, run_engine, run_engines, started

PATHS = ("fs", "tier", "zmq", "nixl")
PLAIN_ROW = "greedy decoding, one request or a batch at a time (the default test set)"
"""The row of the default set's cells: tests/engine/test_e2e_fs.py (fs, the host tier),
tests/serving/test_serve_pd.py (zmq) and tests/engine/test_e2e_pd.py (nixl)."""


@dataclass(frozen=True)
class Case:
    """One request the matrix sends every path: its prompt, how it samples."""

    prompt: list[int]
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int = 8
    loaded: bool = True
    """Whether kvflow serves its prompt; False where vLLM reads no cached KV for it."""


def _mine(event: Event, result: GenResult) -> bool:
    """Whether `event` is of `result`'s request or a child of it (`n > 1`): vLLM suffixes
    the request id (`ID-xxxx`) and prefixes a child's (`I_ID-xxxx`); a beam search's
    requests are a range of ids (`first:end`)."""
    req = event.req.split("-")[0].split("_")[-1]
    if ":" in result.request_id:
        first, end = map(int, result.request_id.split(":"))
        return req.isdigit() and first <= int(req) < end
    return req == result.request_id


def assert_served(case: Case, log: Path, result: GenResult, what: str) -> None:
    """kvflow's event log says it loaded the case's prompt, or (`case.loaded` False) that
    it loaded none of it."""
    n = loaded_tokens(log, result)
    assert (n > 0) == case.loaded, f"{what}: kvflow loaded {n} tokens"


def loaded_tokens(log: Path, result: GenResult) -> int:
    """Prompt tokens kvflow said it would load for `result`'s request (and its children)."""
    return sum(
        e.external_tokens
        for e in read_event_log(str(log))
        if isinstance(e, BlocksAllocated) and _mine(e, result)
    )


def tier_hits(log: Path, result: GenResult) -> int:
    """Chunks the host tier served `result`'s request (and its children)."""
    return sum(
        e.hits
        for e in read_event_log(str(log))
        if isinstance(e, TierRead) and e.tier == "cpu" and _mine(e, result)
    )


def assert_same(got: GenResult, want: GenResult, what: str, tol: float = 2e-3) -> None:
    """`got` is `want`: its tokens, every completion's (`n`, beams), its log-probabilities
    and its prompt's, within `tol`."""
    assert not got.error, f"{what}: the request failed: {got.error!r}"
    assert got.tokens == want.tokens, f"{what}: tokens {got.tokens} != baseline {want.tokens}"
    assert got.samples == want.samples, f"{what}: completions differ from the baseline's"
    for name in ("logprobs", "prompt_logprobs"):
        a, b = getattr(got, name), getattr(want, name)
        assert len(a) == len(b), f"{what}: {len(a)} {name}, the baseline has {len(b)}"
        worst = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
        assert worst <= tol, f"{what}: {name} differ from the baseline's by {worst:.2e}"


@dataclass
class Row:
    """A row's engines' results, by case name."""

    tmp: Path
    cases: dict[str, Case]
    name: str = ""
    baseline: dict[str, GenResult] = field(default_factory=dict)
    cold: dict[str, GenResult] = field(default_factory=dict)
    warm: dict[str, GenResult] = field(default_factory=dict)
    """From `fs` (the warm engine's first round)."""
    tier: dict[str, GenResult] = field(default_factory=dict)
    """From the host tier (its second round)."""

    def log(self, engine: str) -> Path:
        return self.tmp / f"{engine}.events.jsonl"


def run_store_row(tmp: Path, cases: dict[str, Case], **engine: Any) -> Row:
    """The baseline, cold and warm engines of a row, with `engine` (Scenario fields: e.g.
    `llm_args`) for each."""
    row = Row(tmp, cases)
    store = str(tmp / "store")
    names = list(cases)

    def scenario(rounds: int, **more: Any) -> dict[str, Any]:
        ordered = [cases[n] for n in names] * rounds
        return {
            **engine,
            "batches": [[c.prompt] for c in ordered],
            "batch_sampling": [c.sampling for c in ordered],
            "max_tokens": max(c.max_tokens for c in ordered),
            **more,
        }

    def extra(name: str, **kw: Any) -> dict[str, Any]:
        return {"options": {"path": store}, "event_log": str(row.log(name)), **kw}

    first = run_engines(
        tmp,
        {
            "baseline": scenario(1, connector=False),
            "cold": scenario(1, extra_config=extra("cold")),
        },
    )
    base, cold = started(first["baseline"]), started(first["cold"])
    warm = run_engine(tmp, "warm", **scenario(2, extra_config=extra("warm", cpu_cache_gib=0.05)))
    for i, name in enumerate(names):
        row.baseline[name] = _trim(base, i, cases[name])
        row.cold[name] = _trim(cold, i, cases[name])
        row.warm[name] = _trim(warm, i, cases[name])
        row.tier[name] = _trim(warm, len(names) + i, cases[name])
    return row


def _trim(result: ScenarioResult, batch: int, case: Case) -> GenResult:
    """The batch's one result, cut to the case's own `max_tokens` (a scenario has one)."""
    (got,) = result.batches[batch]
    n = case.max_tokens
    got.tokens, got.logprobs = got.tokens[:n], got.logprobs[:n]
    got.samples = [s[:n] for s in got.samples]
    return got


@contextlib.contextmanager
def pd_pair(tmp: Path, transport: str, **engine: Any) -> Iterator[tuple[ServingEngine, ...]]:
    """A producer and a consumer over `transport`, with `engine` (Scenario fields) each."""
    producer, consumer = (
        ServingEngine(
            tmp,
            f"{transport}-{role}",
            kv_role=f"kv_{role}",
            extra_config={
                "transport": transport,
                "event_log": str(tmp / f"{transport}-{role}.events.jsonl"),
            },
            **engine,
        )
        for role in ("producer", "consumer")
    )
    try:
        producer.wait_ready()
        consumer.wait_ready()
        yield producer, consumer
    finally:
        close_all((producer, consumer))


def through_pd(
    producer: ServingEngine,
    consumer: ServingEngine,
    case: Case,
    decoding: Sampling | None = None,
) -> GenResult:
    """The case as vLLM's proxy runs it: a prefill of one token on the producer (with the
    case's adapter), its params to the consumer, which decodes as the case samples (or
    as `decoding`)."""
    prefill = producer.ask(
        case.prompt, 1, {"do_remote_decode": True}, Sampling(lora=case.sampling.lora)
    )
    assert not prefill.error and prefill.kv_transfer_params, prefill
    params = prefill.kv_transfer_params
    return consumer.ask(case.prompt, case.max_tokens, params, decoding or case.sampling)
