"""`kvflow demo`: real vLLM engines moving KV through kvflow.

- `kvflow demo`: one engine cold, restarted, warm from kvflow's `fs` cache.
  Each engine runs in its own process (`python -m kvflow_vllm.engine`), so the
  warm run shares nothing with the cold one but the cache directory.
- `kvflow demo --pd`: prefill/decode disaggregation. A producer engine
  prefills, a consumer engine pulls the KV over a peer transport (`zmq`) and
  decodes; the demo plays vLLM's disaggregation proxy between them.

Prompts are fresh random token ids every run, so nothing is warm by accident.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from kvflow.config import default_cache_dir
from kvflow.eventlog import read_event_log
from kvflow.events import Event, LoadStarted, TransferDone, TransferFailed

from .engine import EngineFailed, Scenario, spawn_engine
from .serving import ServingEngine

__all__ = ["run_demo", "run_pd_demo"]


def _by_request(events: list[Event]) -> dict[str, list[Event]]:
    out: dict[str, list[Event]] = {}
    for e in events:
        out.setdefault(e.req.split("-")[0], []).append(e)
    return out


def _prompts(num_prompts: int, prompt_len: int) -> list[list[int]]:
    rng = random.Random()
    return [[rng.randrange(3, 1000) for _ in range(prompt_len)] for _ in range(num_prompts)]


def run_demo(*, cache_dir: str, num_prompts: int, prompt_len: int, max_tokens: int) -> int:
    cache = Path(cache_dir) if cache_dir else default_cache_dir() / "fs"
    prompts = _prompts(num_prompts, prompt_len)
    print(f"kvflow demo: {num_prompts} prompts x {prompt_len} tokens, fs cache at {cache}")
    with tempfile.TemporaryDirectory(prefix="kvflow-demo-") as t:
        tmp = Path(t)
        runs = {}
        for name in ("cold", "warm"):
            print(f"  starting the {name} engine (a fresh vLLM process) ...", flush=True)
            sc = Scenario(
                batches=[prompts],
                one_by_one=True,
                max_tokens=max_tokens,
                extra_config={
                    "options": {"path": str(cache)},
                    "event_log": str(tmp / f"{name}.events.jsonl"),
                },
            )
            try:
                runs[name] = spawn_engine(tmp, name, sc)
            except EngineFailed as exc:
                print("\n".join(exc.log.splitlines()[-30:]))
                print(f"{exc}")
                return 1
        warm_events = _by_request(read_event_log(str(tmp / "warm.events.jsonl")))
    cold = runs["cold"].batches[0]
    warm = runs["warm"].batches[0]
    rows: list[tuple[int, int, float, float, float, float, bool]] = []
    for c, w in zip(cold, warm, strict=True):
        ev = warm_events.get(w.request_id, [])
        for e in ev:
            if isinstance(e, TransferFailed):
                print(f"  request {w.request_id}: {e.direction} failed: {e.reason}")
        loaded = sum(e.tokens for e in ev if isinstance(e, LoadStarted))
        done = [e for e in ev if isinstance(e, TransferDone) and e.direction == "load"]
        nbytes = sum(e.nbytes for e in done)
        secs = sum(e.elapsed_s for e in done)
        rows.append(
            (
                len(prompts[len(rows)]),
                loaded,
                c.ttft_s * 1e3,
                w.ttft_s * 1e3,
                nbytes / 2**20,
                nbytes / secs / 1e9 if secs else 0.0,
                c.tokens == w.tokens and not w.error,
            )
        )
    _print_table(
        rows,
        "kvflow demo: cold vs warm (engine restarted in between)",
        ("prompt tok", "loaded tok", "TTFT cold ms", "TTFT warm ms", "MiB", "load GB/s"),
    )
    ok = all(r[-1] for r in rows) and all(r[1] > 0 for r in rows)
    print("result:", "OK - warm tokens identical, prefill served from kvflow" if ok else "FAILED")
    return 0 if ok else 1


def _print_table(
    rows: list[tuple[int, int, float, float, float, float, bool]],
    title: str,
    columns: tuple[str, ...],
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    table.add_column("tokens match", justify="center")
    for p, loaded, tc, tw, mib, gbs, match in rows:
        table.add_row(
            str(p),
            str(loaded),
            f"{tc:.1f}",
            f"{tw:.1f}",
            f"{mib:.1f}",
            f"{gbs:.2f}",
            "yes" if match else "NO",
        )
    Console().print(table)


def run_pd_demo(*, transport: str, num_prompts: int, prompt_len: int, max_tokens: int) -> int:
    prompts = _prompts(num_prompts, prompt_len)
    print(f"kvflow demo --pd: {num_prompts} prompts x {prompt_len} tokens over `{transport}`")
    rows: list[tuple[int, int, float, float, float, float, bool]] = []
    with tempfile.TemporaryDirectory(prefix="kvflow-demo-pd-") as t:
        tmp = Path(t)

        def engine(name: str, role: str) -> ServingEngine:
            extra = {"transport": transport, "event_log": str(tmp / f"{name}.events.jsonl")}
            return ServingEngine(tmp, name, kv_role=role, extra_config=extra)

        print("  starting a producer and a consumer engine (two vLLM processes) ...", flush=True)
        producer, consumer = engine("producer", "kv_producer"), engine("consumer", "kv_consumer")
        try:
            producer.wait_ready()
            consumer.wait_ready()
            for p in prompts:
                single = producer.ask(p, max_tokens)  # one engine doing everything
                prefill = producer.ask(p, 1, {"do_remote_decode": True})
                params = prefill.kv_transfer_params or {}
                if not rows:
                    where = params.get("kvflow", {}).get("addresses")
                    print(f"  proxy: producer answered do_remote_prefill from {where}")
                decoded = consumer.ask(p, max_tokens, params)
                ev = _by_request(read_event_log(str(tmp / "consumer.events.jsonl")))
                ev_req = ev.get(decoded.request_id, [])
                for e in ev_req:
                    if isinstance(e, TransferFailed):
                        print(f"  request {decoded.request_id}: pull failed: {e.reason}")
                pulled = sum(e.tokens for e in ev_req if isinstance(e, LoadStarted))
                done = [e for e in ev_req if isinstance(e, TransferDone)]
                nbytes = sum(e.nbytes for e in done)
                secs = sum(e.elapsed_s for e in done)
                rows.append(
                    (
                        len(p),
                        pulled,
                        single.ttft_s * 1e3,
                        decoded.ttft_s * 1e3,
                        nbytes / 2**20,
                        nbytes / secs / 1e9 if secs else 0.0,
                        decoded.tokens == single.tokens and not decoded.error,
                    )
                )
        except (TimeoutError, RuntimeError) as exc:
            print(f"kvflow demo --pd failed: {exc}")
            return 1
        finally:
            producer.close()
            consumer.close()
    _print_table(
        rows,
        "kvflow demo --pd: one engine vs producer prefill + consumer decode",
        ("prompt tok", "pulled tok", "TTFT single ms", "TTFT consumer ms", "MiB", "pull GB/s"),
    )
    ok = all(r[-1] for r in rows) and all(r[1] > 0 for r in rows)
    print(
        "result:",
        "OK - consumer tokens identical, its prompt KV pulled from the producer"
        if ok
        else "FAILED",
    )
    return 0 if ok else 1
