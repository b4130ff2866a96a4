"""Benchmark: real vLLM engines, kvflow `fs` against no connector, a connector that does
nothing and vLLM's ExampleConnector: the miss path (nothing to load) and the hit path
(warm TTFT, partial prefixes, a miss batched with hits).

    python bench/bench_engines.py [--repeats 3] [--quick]

All engines live in this one process side by side (each vLLM engine core in its own
process, started once), so every measurement alternates between them within a
repeat; medians over `--repeats`. Model `bench-llama` (8 layers, hidden 1024, 8 KV
heads x 128, float32: 64 KiB of KV per token, seeded random weights), block size 128,
greedy decoding.

Engines (vLLM's defaults otherwise, prefix caching on):

- `no connector`;
- `no-op connector`: `bench/noop_connector.py`, answers "nothing to load", saves
  nothing: what vLLM itself costs once a connector is configured;
- `ExampleConnector`: vLLM's own, kv_both, safetensors files under a temp dir;
- `kvflow`: `KVFlowConnector` with `fs` under a temp dir, kv_both (prefix caching on,
  so kvflow loads between steps: `load_mode` async);
- `kvflow worker_cpus=1`: `kvflow` with its worker threads on core 1 (`worker_cpus`),
  off the compute core vLLM pins its worker, and kvflow's threads with it, to; miss
  path only;
- `kvflow layer`: `kvflow` with vLLM's prefix caching off, so kvflow loads inside the
  step, layer by layer (`load_mode` layer); hit path only;
- `kvflow cpu tier`: `kvflow` with a 2 GiB host-memory tier in front of `fs`
  (`cpu_cache_gib`): its warm loads come from host memory, in this same process.

Every engine takes a whole prompt in one step (`max_num_batched_tokens` = the longest
prompt): ExampleConnector saves each prefill chunk over the last one, and a prompt
longer than one chunk then kills its engine when it loads (a value tensor of 4096
tokens for 8064 slots, vLLM 0.32).

Every engine computes on core 0 (`VLLM_CPU_OMP_THREADS_BIND=0`); vLLM's CPU build
would otherwise compute on one core without a connector and on two with one (see
docs/benchmarks.md). Core 1 is left to vLLM's own processes (and to kvflow's threads
where `worker_cpus` puts them).
(kvflow warns at start that the engines share core 0: meant for P/D pairs, which run
at once; here one engine runs at a time, and each run is followed by `SETTLE_S`.)

Miss path, fresh random prompts each repeat (nothing stored, every connector saves
what it computes): prefill = 16 prompts of 512 tokens, 1 output token each, prompt
tokens per second of `generate()`; decode = 16 prompts of 64 tokens, 128 output tokens
each, output tokens per second.

Hit path: a prompt is first run once (computed, saved by the connector), vLLM's prefix
cache is reset, then it runs again: TTFT is vLLM's own first-token latency of that
second run (for `no connector`: of the first run, the recompute). Effective GB/s = KV
of the tokens vLLM did not compute (`num_cached_tokens`) / TTFT. Lengths 1k, 4k, 8k;
prefixes: a 2k prompt of which the first 25 / 50 / 100 % were run (stored) before;
mixed: one fresh 1k prompt batched after two stored 2k prompts, against another fresh
1k prompt alone (does a miss wait behind hits?). Effective GB/s only where the whole
prompt was stored (elsewhere TTFT is mostly computing the rest). Warm tokens are compared with the
no-connector engine's (a mismatch is reported and fails the run).

Writes bench/results/engines.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import record

BLOCK = 128
KV_PER_TOKEN = 8 * 8 * 128 * 2 * 4  # layers x heads x head dim x (K, V) x float32
MAX_LEN = 8192 + 256
SETTLE_S = 1.5
"""After each run: vLLM's workers busy-loop (`sched_yield`) for 1 s after their last
step (`shm_broadcast.SpinCondition.busy_loop_s`); an engine measured meanwhile on the
same core would share it with that loop."""

SIZES = {
    "full": {
        "miss_prefill": (16, 512),
        "miss_decode": (16, 64, 128),
        "lengths": (1024, 4096, 8192),
        "prefix_len": 2048,
        "mixed": (1024, 2, 2048),
    },
    "quick": {
        "miss_prefill": (8, 256),
        "miss_decode": (8, 32, 32),
        "lengths": (1024,),
        "prefix_len": 1024,
        "mixed": (512, 2, 1024),
    },
}


def engine_configs(tmp: Path) -> dict[str, dict[str, Any]]:
    from vllm.config import KVTransferConfig

    def kv(name: str, extra: dict[str, Any], **kw: Any) -> KVTransferConfig:
        return KVTransferConfig(
            kv_connector=name, kv_role="kv_both", kv_connector_extra_config=extra, **kw
        )

    kvflow = {"options": {"path": str(tmp / "kvflow"), "max_gb": 0}}
    layer = {"options": {"path": str(tmp / "kvflow-layer"), "max_gb": 0}}
    cpus = {"options": {"path": str(tmp / "kvflow-cpus"), "max_gb": 0}, "worker_cpus": "1"}
    tier = {"options": {"path": str(tmp / "kvflow-tier"), "max_gb": 0}, "cpu_cache_gib": 2}
    tier_cpus = {**tier, "options": {"path": str(tmp / "kvflow-tier-cpus"), "max_gb": 0}}
    tier_cpus["worker_cpus"] = "1"
    return {
        "no connector": {"kv_transfer_config": None},
        "no-op connector": {
            "kv_transfer_config": kv("NoopConnector", {}, kv_connector_module_path="noop_connector")
        },
        "ExampleConnector": {
            "kv_transfer_config": kv(
                "ExampleConnector", {"shared_storage_path": str(tmp / "example")}
            )
        },
        "kvflow": {"kv_transfer_config": kv("KVFlowConnector", kvflow)},
        "kvflow worker_cpus=1": {"kv_transfer_config": kv("KVFlowConnector", cpus)},
        "kvflow cpu tier": {"kv_transfer_config": kv("KVFlowConnector", tier)},
        "kvflow cpu tier worker_cpus=1": {"kv_transfer_config": kv("KVFlowConnector", tier_cpus)},
        "kvflow layer": {
            "kv_transfer_config": kv("KVFlowConnector", layer),
            "enable_prefix_caching": False,
        },
    }


MISS_ENGINES = (
    "no connector",
    "no-op connector",
    "ExampleConnector",
    "kvflow",
    "kvflow worker_cpus=1",
    "kvflow cpu tier",
    "kvflow cpu tier worker_cpus=1",
)
HIT_ENGINES = ("no connector", "ExampleConnector", "kvflow", "kvflow layer", "kvflow cpu tier")


def start_engines(tmp: Path, model: str, names: tuple[str, ...] = ()) -> dict[str, Any]:
    """The engines of `engine_configs` (only those of `names`, if given), started."""
    from kvflow_vllm.engine_process import generate, make_llm

    llms = {}
    for name, cfg in engine_configs(tmp).items():
        if names and name not in names:
            continue
        print(f"  starting {name} ...", flush=True)
        cfg = {"enable_prefix_caching": True} | cfg
        llms[name] = make_llm(
            model=model,
            connector=None,
            block_size=BLOCK,
            prefix_caching=cfg.pop("enable_prefix_caching"),
            max_model_len=MAX_LEN,
            max_num_batched_tokens=MAX_LEN,  # no chunked prefill: see the docstring
            hf_overrides={"max_position_embeddings": MAX_LEN},
            **cfg,
        )
        generate(llms[name], [[1, 2, 3]], 1)  # the first forward pays one-off costs
    return llms


def wait_saved(tmp: Path, engine: str, prompts: list[list[int]]) -> None:
    """Until kvflow's store holds every full block of `prompts` and no save is in flight
    (no temp file): a warm run must not race its own cold run's saves."""
    from kvflow.keys import chunk_keys

    if not engine.startswith("kvflow"):
        return  # ExampleConnector saves inside the step; no connector saves nothing
    stores = {"kvflow": "kvflow", "kvflow layer": "kvflow-layer", "kvflow cpu tier": "kvflow-tier"}
    stores["kvflow cpu tier worker_cpus=1"] = "kvflow-tier-cpus"
    store = tmp / stores.get(engine, "kvflow-cpus")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        namespaces = [d for d in store.iterdir() if d.is_dir()] if store.is_dir() else []
        if len(namespaces) == 1:
            ns = namespaces[0]
            keys = [k for p in prompts for k in chunk_keys(ns.name, p, BLOCK)]
            present = all(any(ns.glob(f"{k[:2]}/{k}.*.kv")) for k in keys)
            if present and not any(ns.glob("*/*.tmp.*")):
                return
        time.sleep(0.05)
    raise TimeoutError(f"{engine}: the cold run's saves did not land in 120 s")


def clear_stores(tmp: Path) -> None:
    """Untimed, between repeats: what the connectors stored (a full run stores tens of
    GB otherwise). Each store's root stays; kvflow and ExampleConnector recreate the
    rest."""
    for store in tmp.iterdir():
        for d in store.iterdir() if store.is_dir() else []:
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Bench:
    def __init__(self, llms: dict[str, Any], tmp: Path, sizes: dict[str, Any], repeats: int):
        self.llms, self.tmp, self.sizes, self.repeats = llms, tmp, sizes, repeats
        self.samples: dict[str, dict[str, list[float]]] = {}
        """Every miss-path sample (tokens per second), by engine and phase."""
        self.rng = random.Random(0)
        self.mismatches: list[str] = []

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 1000) for _ in range(n)]

    def run(self, engine: str, prompts: list[list[int]], max_tokens: int) -> list[Any]:
        from kvflow_vllm.engine_process import generate

        out = generate(self.llms[engine], prompts, max_tokens)
        time.sleep(SETTLE_S)  # untimed: this engine's worker stops spinning before the next
        bad = [r.error for r in out if r.error]
        if bad:
            raise RuntimeError(f"{engine}: request errors {bad}")
        return out

    def order(self, engines: tuple[str, ...], r: int) -> tuple[str, ...]:
        return engines if r % 2 == 0 else engines[::-1]

    # -- miss path --------------------------------------------------------------------
    def miss(self) -> dict[str, dict[str, float]]:
        n, plen = self.sizes["miss_prefill"]
        dn, dlen, dout = self.sizes["miss_decode"]
        engines = tuple(e for e in MISS_ENGINES if e in self.llms)
        rates: dict[str, dict[str, list[float]]] = {e: {} for e in engines}
        self.samples = rates
        for r in range(self.repeats):
            prefill = [self.prompt(plen) for _ in range(n)]
            decode = [self.prompt(dlen) for _ in range(dn)]
            for e in self.order(engines, r):
                out = self.run(e, prefill, 1)
                rates[e].setdefault("prefill", []).append(n * plen / out[0].seconds)
                wait_saved(self.tmp, e, [])
                out = self.run(e, decode, dout)
                rates[e].setdefault("decode", []).append(dn * dout / out[0].seconds)
                wait_saved(self.tmp, e, [])
            clear_stores(self.tmp)
            print(f"    miss repeat {r + 1}/{self.repeats} done", flush=True)
        return {e: {k: median(v) for k, v in d.items()} for e, d in rates.items()}

    # -- hit path ---------------------------------------------------------------------
    def warm(self, engine: str, stored: list[list[int]], prompts: list[list[int]]) -> list[Any]:
        """Run `stored` (cold: computed and saved), reset vLLM's prefix cache, then run
        `prompts` in one batch; for `no connector` only the reset and `prompts`."""
        llm = self.llms[engine]
        if engine != "no connector":
            for p in stored:
                self.run(engine, [p], 1)
            wait_saved(self.tmp, engine, stored)
        llm.reset_prefix_cache()
        return self.run(engine, prompts, 1)

    def check_tokens(self, label: str, outs: dict[str, list[Any]]) -> None:
        ref = [o.tokens for o in outs["no connector"]]
        for e, o in outs.items():
            if [x.tokens for x in o] != ref:
                self.mismatches.append(f"{label}: {e}")

    def hits(self) -> dict[str, Any]:
        ttft: dict[str, dict[str, list[float]]] = {}
        gbs: dict[str, dict[str, list[float]]] = {}

        def record(label: str, e: str, res: Any, whole: bool = False) -> None:
            """`whole`: the prompt was stored whole, so its TTFT is the load's."""
            ttft.setdefault(label, {}).setdefault(e, []).append(res.ttft_s * 1e3)
            if whole and e != "no connector":
                gbs.setdefault(label, {}).setdefault(e, []).append(
                    res.cached_tokens * KV_PER_TOKEN / res.ttft_s / 1e9
                )

        for r in range(self.repeats):
            for n in self.sizes["lengths"]:
                p = self.prompt(n)
                outs = {e: self.warm(e, [p], [p]) for e in self.order(HIT_ENGINES, r)}
                for e, o in outs.items():
                    record(f"{n} tokens", e, o[0], whole=True)
                self.check_tokens(f"{n} tokens", outs)
            n = self.sizes["prefix_len"]
            for pct in (25, 50, 100):
                p = self.prompt(n)
                head = p[: n * pct // 100]
                outs = {e: self.warm(e, [head], [p]) for e in self.order(HIT_ENGINES, r)}
                for e, o in outs.items():
                    record(f"{pct} % of {n}", e, o[0], whole=pct == 100)
                self.check_tokens(f"{pct} % of {n}", outs)
            mlen, k, hlen = self.sizes["mixed"]
            hit_prompts = [self.prompt(hlen) for _ in range(k)]
            alone, batched = self.prompt(mlen), self.prompt(mlen)
            solos: dict[str, list[Any]] = {}
            mixed: dict[str, list[Any]] = {}
            for e in self.order(HIT_ENGINES, r):
                (solo,) = solos[e] = self.warm(e, [], [alone])
                out = mixed[e] = self.warm(e, hit_prompts, [*hit_prompts, batched])
                record("miss alone", e, solo)
                ttft.setdefault("miss batched with hits", {}).setdefault(e, []).append(
                    out[-1].ttft_s * 1e3
                )
                ttft.setdefault("hits batched with a miss", {}).setdefault(e, []).append(
                    median([o.ttft_s * 1e3 for o in out[:-1]])
                )
            self.check_tokens("miss alone", solos)
            self.check_tokens("hits batched with a miss", mixed)  # every prompt of the batch
            clear_stores(self.tmp)
            print(f"    hit repeat {r + 1}/{self.repeats} done", flush=True)
        return {
            "ttft_ms": {k: {e: median(v) for e, v in d.items()} for k, d in ttft.items()},
            "effective_gbs": {k: {e: median(v) for e, v in d.items()} for k, d in gbs.items()},
            "samples": {"ttft_ms": ttft, "effective_gbs": gbs},
        }


ENGINE_SOURCES = (
    "kvflow",
    "plugins/kvflow_vllm",
    "transports/kvflow_fs",
    "bench/noop_connector.py",
)
"""What the engines run besides this process's own imports (their cores are processes)."""


def main() -> int:
    meta = record.start()
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small workloads, 2 repeats")
    ap.add_argument("--skip-hits", action="store_true")
    ap.add_argument("--skip-miss", action="store_true")
    ap.add_argument(
        "--engines", default="", help="comma-separated: start and time only these engines"
    )
    ap.add_argument("--out", default="", help="results file (default results/engines.json)")
    args = ap.parse_args()
    names = tuple(n.strip() for n in args.engines.split(",") if n.strip())
    if names and not args.skip_hits:
        ap.error("--engines times the miss path only: add --skip-hits")
    if unknown := [n for n in names if n not in MISS_ENGINES + HIT_ENGINES]:
        ap.error(f"--engines: unknown {unknown}; valid: {sorted(set(MISS_ENGINES + HIT_ENGINES))}")
    repeats = 2 if args.quick else args.repeats
    sizes = SIZES["quick" if args.quick else "full"]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB each: 16k tokens
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from kvflow_vllm.engine_process import model_dir

    tmp = Path(tempfile.mkdtemp(prefix="kvflow-bench-engines-"))
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / "engines.json"
    # sections not run this time keep their last results, each with how it was measured
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    t0 = time.perf_counter()
    try:
        llms: dict[str, Any] = {}  # each path's engines, started as it begins
        bench = Bench(llms, tmp, sizes, repeats)
        steps: list[tuple[str, Callable[[], Any]]] = []
        if not args.skip_miss:
            steps.append(("miss", bench.miss))
        if not args.skip_hits:
            steps.append(("hit", bench.hits))
        for name, fn in steps:
            # only this path's engines run: all seven at once outgrow 24 GiB, now that
            # the host tier's engines touch their 2 GiB at start (decision 66)
            need = [
                e
                for e in (MISS_ENGINES if name == "miss" else HIT_ENGINES)
                if e in names or not names
            ]
            for e in [e for e in llms if e not in need]:
                llms.pop(e).llm_engine.engine_core.shutdown()
            if new := tuple(e for e in need if e not in llms):
                llms.update(start_engines(tmp, model_dir("bench-llama"), new))
            print(f"  {name} path ...", flush=True)
            results[name] = fn()
            results[f"{name}_run"] = {
                **meta,
                "sources": record.sources(ENGINE_SOURCES),  # a section's own: another may be older
                "repeats": repeats,
                "sizes": sizes,
                "token_mismatches": bench.mismatches,
                "wall_s": time.perf_counter() - t0,
                "samples": bench.samples if name == "miss" else {},
            }
            record.save(out, results, meta, ENGINE_SOURCES)  # what is measured is kept
        for llm in llms.values():
            llm.llm_engine.engine_core.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({k: v for k, v in results.items() if k in ("miss", "hit")}, indent=1))
    print(f"wrote {out}")
    if bench.mismatches:
        print(f"TOKENS DIFFER from no connector: {bench.mismatches}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
