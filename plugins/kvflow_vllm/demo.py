"""`kvflow demo`: real vLLM engines moving KV through kvflow.

- `kvflow demo`: one engine cold, restarted, warm from kvflow's `fs` cache.
  Each engine runs in its own process (`python -m kvflow_vllm.engine_process`), so the
  warm run shares nothing with the cold one but the cache directory.
- `kvflow demo --pd`: prefill/decode disaggregation as it is served: two
  OpenAI-compatible vLLM servers with the same kvflow configuration and
  `kvflow proxy` between them; the decode server pulls each prompt's KV from the
  prefill server over a peer transport (`zmq`, `nixl`).

Prompts are fresh random token ids every run, so nothing is warm by accident.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

from kvflow.config import default_cache_dir
from kvflow.observe.events import Event, LoadStarted, TransferDone, TransferFailed
from kvflow.observe.log import read_event_log
from kvflow.pd.proxy import PdProxy

from .apiserver import ApiServer
from .engine_process import EngineFailed, Scenario, spawn_engine

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
    """Two OpenAI servers with the same kvflow configuration and `kvflow proxy` between
    them, as a deployment runs them; each prompt is also asked of one server alone."""
    from vllm.platforms import current_platform

    prompts = _prompts(num_prompts, prompt_len)
    print(f"kvflow demo --pd: {num_prompts} prompts x {prompt_len} tokens over `{transport}`")
    config = {
        "kv_connector": "KVFlowConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"transport": transport},
    }
    cpu = current_platform.is_cpu()
    # CPU build: each server its own cores (docs/transports.md); GPU: both share one GPU
    extra = () if cpu else ("--gpu-memory-utilization", "0.35")
    rows: list[tuple[int, int, float, float, float, float, bool]] = []
    with tempfile.TemporaryDirectory(prefix="kvflow-demo-pd-") as t:
        tmp = Path(t)
        print("  starting a prefill and a decode server (vllm.entrypoints.openai.api_server) ...")
        servers = [
            ApiServer(tmp, name, config, *extra, cores=str(i) if cpu else None)
            for i, name in enumerate(("prefill", "decode"))
        ]
        prefill, decode = servers
        proxy = None
        try:
            for server in servers:
                server.wait_ready()
            proxy = PdProxy([prefill.url], [decode.url]).start()
            print(f"  kvflow proxy {proxy.url}: prefill {prefill.url}, decode {decode.url}")
            for p in prompts:
                t0 = time.perf_counter()
                single = prefill.completion(p, max_tokens)  # one server doing everything
                t1 = time.perf_counter()
                before = decode.metrics()
                t2 = time.perf_counter()
                pd = decode.completion(p, max_tokens, url=proxy.url)
                t3 = time.perf_counter()
                moved = _settled_load(decode, before)
                rows.append(
                    (
                        len(p),
                        int(moved["tokens"]),
                        (t1 - t0) * 1e3,
                        (t3 - t2) * 1e3,
                        moved["bytes"] / 2**20,
                        moved["bytes"] / moved["seconds"] / 1e9 if moved["seconds"] else 0.0,
                        _text(pd) == _text(single) and _text(pd) is not None,
                    )
                )
            if "kvflow load of" in decode.log_text():
                print("  the decode server reported a failed load: see its log")
        except (TimeoutError, RuntimeError) as exc:
            print(f"kvflow demo --pd failed: {exc}")
            return 1
        finally:
            if proxy is not None:
                proxy.close()
            for server in servers:
                server.close()
    _print_table(
        rows,
        "kvflow demo --pd: one server vs prefill server + decode server through the proxy",
        ("prompt tok", "pulled tok", "one server ms", "P/D ms", "MiB", "pull GB/s"),
    )
    ok = all(r[-1] for r in rows) and all(r[1] > 0 for r in rows)
    print(
        "result:",
        "OK - text identical to one server's, the prompt's KV pulled from the prefill server"
        if ok
        else "FAILED",
    )
    return 0 if ok else 1


def _text(answer: dict[str, Any]) -> str | None:
    choices = answer.get("choices")
    return str(choices[0]["text"]) if choices else None


LOAD = 'direction="load"'
MOVED = {"tokens": "tokens_total", "bytes": "transfer_bytes_sum", "seconds": "transfer_seconds_sum"}


def _settled_load(server: ApiServer, before: dict[str, float]) -> dict[str, float]:
    """Tokens, bytes and seconds the server loaded since `before`, once kvflow's stats
    (reported a step after the load) are in its metrics (at most 30 s)."""

    def moved(m: dict[str, float]) -> dict[str, float]:
        keys = {k: f"vllm:kvflow_{name}{{{LOAD}}}" for k, name in MOVED.items()}
        return {k: m.get(key, 0.0) - before.get(key, 0.0) for k, key in keys.items()}

    return moved(server.metrics_once(lambda m: moved(m)["tokens"] > 0))
