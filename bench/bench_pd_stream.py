"""Streamed P/D against pull-after-prefill on real vLLM OpenAI servers (issue 49, part 3):
time to first token of one request at a time, by prompt length.

    python bench/bench_pd_stream.py [--quick] [--repeats 4] [--sizes 1024 4096 8192]

A kvflow pair per transport (`--transports`: `zmq`, `nixl`), as `bench/bench_pd_serve.py`
starts its `kvflow zmq` and `kvflow nixl` configurations (`faults.config`: kv_both, a
deployment key, policy `recompute`; prefill
server on core 0, decode server on core 1, each server's every process and thread (its
API server, engine core and worker: `bench_pd_serve.pin`) kept to its core, model `bench-llama`,
float32, eager, block
size 32, vLLM's prefix cache off), every prompt computed in one step
(`--max-num-batched-tokens` = the longest prompt and its output: a chunked prefill is
offered with its last chunk, and only that chunk's forward overlaps the pull), and
bench-llama's positions raised to hold the longest prompt (`--hf-overrides`; its
weights are seeded random, what it computes past its configured length does not
matter here). In front of the same two servers, two `kvflow proxy` processes:

- `pull after prefill`: vLLM's convention, the prefill request, then the decode request
  with the params it returned;
- `streamed`: `kvflow proxy --stream`, both requests at once; the decode server claims
  the offer as the request arrives and pulls each layer once the prefill computed it.

Per prompt length (`--sizes`), `--repeats` fresh random prompts, each sent through both
proxies one request at a time, the order alternating (A-B, B-A, ...): TTFT from the
client's send to its first streamed token (`time.perf_counter`), and, from both
servers' kvflow event log, the pull's time, its part past the prefill's end
(`kvflow.observe.timeline`'s `pull past prefill`; streamed only) and the prefill's time
(from the client's send to the prefill server's finish). One untimed request
through each proxy first (the streamed proxy's first request goes the convention's way
and learns the prefill server's workers). Every pair of answers of one prompt must be
equal, and every decode must have pulled its prompt (the decode server's
`vllm:kvflow_failures_total` unchanged), or the script exits non-zero.

What this machine can show: the pair shares one 2-core host. Each server keeps to its
core (an earlier run pinned only the workers: the decode server's engine core, which
vLLM steps every millisecond while a request waits for remote KV, for a streamed one
its whole prefill, then ran on the prefill's core too, and streamed TTFT was up to
1.47x the convention's, its `history`). What a streamed pull costs the prefill server
(a `zmq` producer copying each layer into ZMQ messages, its TCP stack sending them)
still runs on the prefill's core while it computes; on a GPU the forward does not share
it. The proxies and this client float over both cores.

Writes bench/results/pd-stream.json (`--out`) with `bench/record.py`: every sample, and
per transport and length each mode's median TTFT, the streamed over pull-after-prefill
ratio of the medians, the median pull and prefill (to the producer's finish).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import record  # bench/record.py
from bench_pd_serve import (
    EVENTS,
    EXTRA_SOURCES,
    MAX_TOKENS,
    MODEL,
    BenchPair,
    Opts,
    Sample,
    Setup,
    stream,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import faults  # noqa: E402  # scripts/faults.py
from soak_pd import Proxy  # noqa: E402  # scripts/soak_pd.py

from kvflow.observe.log import read_event_log  # noqa: E402
from kvflow.observe.timeline import timelines  # noqa: E402
from kvflow_vllm.engine_process import model_dir  # noqa: E402

MODES = ("pull after prefill", "streamed")


def setup(transport: str) -> Setup:
    """A kvflow pair over `transport`, `load_timeout_s` raised: a streamed load lasts as long
    as its prefill's forward, which for the longest prompt on one core of this host is
    long (docs/transports.md#streamed)."""
    return Setup(
        f"kvflow {transport}",
        lambda key, _which: faults.config(key, transport=transport, load_timeout_s=300.0),
    )


def server_opts(longest: int) -> Opts:
    """bench-llama's server arguments for prompts of up to `longest` tokens, computed in one
    step, with KV space for two of them."""
    model = model_dir(MODEL)
    cfg = json.loads((Path(model) / "config.json").read_text())
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    length = longest + MAX_TOKENS
    gib = max(1, -(-2 * length * per_token // 2**30))
    overrides = json.dumps({"max_position_embeddings": max(length, cfg["max_position_embeddings"])})
    args = [
        "--no-enable-prefix-caching",
        "--max-model-len", str(length),
        "--max-num-batched-tokens", str(length),
        "--hf-overrides", overrides,
    ]  # fmt: skip
    return Opts(model, args, {"VLLM_CPU_KVCACHE_SPACE": str(gib)})


def failures(pair: BenchPair) -> float:
    return pair.decode.metrics().get("vllm:kvflow_failures_total", 0.0)


def pull_figures(sample: Sample, events: Path, streamed: bool) -> dict[str, Any]:
    """From the event log: the pull's time, its part past the prefill's end (streamed),
    the prefill's (from the client's send to the producer's finish), every gap. Waits up
    to 30 s for the producer's finish to be logged (it may come after the first token)."""
    end_stage = "prefill done" if streamed else "offered"
    deadline = time.monotonic() + 30
    while True:
        lines = timelines(read_event_log(str(events)))
        found = [t for t in lines if sample.id and t.req.startswith(sample.id)]
        if (found and found[0].first(end_stage)) or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # polls the servers' event log
    if not found:
        return {}
    t = found[0]
    gaps = t.gaps()
    names = (("pull_s", "pull"), ("past_prefill_s", "pull past prefill"))
    out: dict[str, Any] = {key: gaps[gap] for key, gap in names if gap in gaps}
    if (end := t.first(end_stage)) is not None:
        out["prefill_s"] = end - sample.sent
    out["gaps"] = gaps
    return out


def run_transport(
    transport: str, work: Path, opts: Opts, sizes: list[int], repeats: int, seed: int
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every prompt length through one pair over `transport`: the samples and problems."""
    samples: list[dict[str, Any]] = []
    bad: list[str] = []
    rng = random.Random(seed)  # the same prompts for every transport
    work.mkdir(parents=True)
    pair = BenchPair(work, setup(transport), opts)
    try:
        proxies = {
            MODES[0]: Proxy(pair.prefill, pair.decode, work / "proxy.log"),
            MODES[1]: Proxy(pair.prefill, pair.decode, work / "proxy-stream.log", "--stream"),
        }
        try:
            warm = [rng.randrange(3, 1000) for _ in range(sizes[0])]
            for proxy in proxies.values():  # first forwards; the streamed proxy learns
                stream(proxy.port, opts.model, warm, Sample(-1, -1))
            for size in sizes:
                for r in range(repeats):
                    prompt = [rng.randrange(3, 1000) for _ in range(size)]  # vocab 1024
                    order = MODES if r % 2 == 0 else MODES[::-1]
                    texts = {}
                    for mode in order:
                        before = failures(pair)
                        s = stream(proxies[mode].port, opts.model, prompt, Sample(size, r))
                        failed = failures(pair) - before
                        figures = pull_figures(s, work / EVENTS, mode == MODES[1])
                        row = {"transport": transport, "mode": mode, "size": size, "repeat": r,
                               "ttft_s": s.ttft_s, "latency_s": s.latency_s, "error": s.error,
                               "failures": failed, **figures}  # fmt: skip
                        samples.append(row)
                        texts[mode] = s.text
                        if s.error or failed:
                            why = s.error or f"{failed} failures"
                            bad.append(f"{transport} {mode} {size} #{r}: {why}")
                        print(f"{transport} {size:5d} {mode:18s} TTFT {1e3 * s.ttft_s:8.1f} ms")
                    if texts[MODES[0]] != texts[MODES[1]]:
                        bad.append(f"{transport} {size} #{r}: the answers differ")
        finally:
            for proxy in proxies.values():
                proxy.close()
    finally:
        pair.close()
    return samples, bad


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per prompt length: each mode's median TTFT, their ratio, the median pulls."""
    figures: dict[str, Any] = {}
    for size in sorted({s["size"] for s in samples}):
        of = {m: [s for s in samples if s["size"] == size and s["mode"] == m] for m in MODES}
        med = {m: statistics.median(s["ttft_s"] for s in of[m]) for m in MODES}
        past = [s["past_prefill_s"] for s in of[MODES[1]] if "past_prefill_s" in s]
        pulls = {m: [s["pull_s"] for s in of[m] if "pull_s" in s] for m in MODES}
        prefills = {m: [s["prefill_s"] for s in of[m] if "prefill_s" in s] for m in MODES}
        figures[str(size)] = {
            "median_ttft_s": med,
            "ratio": med[MODES[1]] / med[MODES[0]],
            "median_pull_s": {m: statistics.median(v) for m, v in pulls.items() if v},
            "median_prefill_s": {m: statistics.median(v) for m, v in prefills.items() if v},
            "median_pull_past_prefill_s": statistics.median(past) if past else None,
        }
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", help="prompt lengths (default 1024 4096 8192)")
    ap.add_argument("--repeats", type=int, help="prompts per length (default 4, --quick 2)")
    ap.add_argument("--transports", nargs="+", default=["zmq", "nixl"], choices=["zmq", "nixl"])
    ap.add_argument("--quick", action="store_true", help="lengths 512 and 1024, 2 prompts each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pd-stream.json"))
    args = ap.parse_args()
    meta = record.start()
    sizes = args.sizes or ([512, 1024] if args.quick else [1024, 4096, 8192])
    repeats = args.repeats or (2 if args.quick else 4)
    work = Path(tempfile.mkdtemp(prefix="kvflow-pd-stream-"))
    opts = server_opts(max(sizes))
    t0 = time.monotonic()
    samples: list[dict[str, Any]] = []
    bad: list[str] = []
    for transport in args.transports:
        got, wrong = run_transport(transport, work / transport, opts, sizes, repeats, args.seed)
        samples += got
        bad += wrong
    figures = {t: summary([s for s in samples if s["transport"] == t]) for t in args.transports}
    data = {
        "model": MODEL,
        "sizes": sizes,
        "repeats": repeats,
        "max_tokens": MAX_TOKENS,
        "prefix_caching": False,
        "wall_s": time.monotonic() - t0,
        "figures": figures,
        "samples": samples,
        "problems": bad,
    }
    record.save(args.out, data, meta, extra=EXTRA_SOURCES)
    shutil.rmtree(work, ignore_errors=True)
    for transport, by_size in figures.items():
        for size, f in by_size.items():
            m = f["median_ttft_s"]
            print(f"{transport} {size} tokens: TTFT pull after prefill {1e3 * m[MODES[0]]:.0f} "
                  f"ms, streamed {1e3 * m[MODES[1]]:.0f} ms ({f['ratio']:.2f}x)")  # fmt: skip
    print(f"wrote {args.out}")
    for line in bad:
        print(f"PROBLEM: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
