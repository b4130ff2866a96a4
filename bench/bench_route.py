"""Benchmark: `kvflow proxy --route prefix` against round robin and random routing over
two vLLM servers, on multi-turn conversations (issue 52).

    python bench/bench_route.py [--users 8] [--turns 6] [--concurrency 4] [--think 2] [--quick]

Two OpenAI servers of bench-llama (8 layers, 64 KiB of KV a token, vLLM's prefix cache
on, 256 KV blocks of 32 tokens each: 8192 tokens), one core each, each with kvflow
(`kv_both`, a host tier of 1 GiB over its own `fs` store) and its KV events on, behind
one `kvflow proxy --server` per policy. The workload, per run: `users` conversations of
`turns` turns, half of them on each of two 256-token system prompts; turn t's prompt is
the system prompt, every earlier turn (a 128-token user message and a 256-token answer
appended as if the model had written it) and a new user message: up to 2304 tokens at
6 turns.
`concurrency` conversations run at once, each turn sent a pause after the one before it
ended (the user reading and typing: exponential, mean `think` seconds, drawn per run);
every request streams (`stream_options.include_usage`), 8 tokens. Without pauses
(`--think 0`: the results file's `history` runs without `think_s`) two conversations on
one core that once computed together finish together and send their next turns
together, turn after turn: under `prefix` the slowest turns of a run were those of two
users of one system prompt, slow at several turns each. Each run has its own random
system prompts and messages (no run finds another's in a cache).

Policies: `prefix`, `round-robin`, `random`, and `one server` (the first server alone:
what an instance holding every conversation serves from cache). Four rounds (`--rounds`),
the order reversed every other one: 192 requests a policy (one round's p90 is a few
requests, and round robin's moved by a third between runs of two rounds). TTFT is the
client's: request sent to the first streamed token; `server`, where the proxy sent it
(its routing decision, matched to the request by prompt length and time: `placed`).
Cached tokens are what each server reported (`usage.prompt_tokens_details`). Goal (issue
52): p90 TTFT of `prefix` at most half of round robin's; its cached prompt tokens within
10 % of `one server`'s. Writes every request to bench/results/route.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import record  # noqa: E402

from kvflow.pd.proxy import PdProxy  # noqa: E402
from kvflow_vllm.apiserver import ApiServer, free_port  # noqa: E402
from kvflow_vllm.engine_process import model_dir  # noqa: E402

POLICIES = ("prefix", "round-robin", "random", "one server")
SYSTEM, USER, ANSWER, MAX_TOKENS = 256, 128, 256, 8
EXTRA_SOURCES = ("kvflow", "plugins/kvflow_vllm", "transports/kvflow_fs")
"""What the servers run, in other processes (for `record.save`)."""


class Server:
    def __init__(self, work: Path, name: str, core: str) -> None:
        self.events, self.replay = free_port(), free_port()
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://*:{self.replay}",
        }
        kv = {
            "kv_connector": "KVFlowConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "transport": "fs",
                "options": {"path": str(work / name), "max_gb": 0},
                "cpu_cache_gib": 1,
            },
        }
        self.api = ApiServer(
            work, name, kv, "--kv-events-config", json.dumps(events),
            "--enable-prompt-tokens-details", "--num-gpu-blocks-override", "256",
            "--max-model-len", "2560", "--max-num-seqs", "8",
            model=model_dir("bench-llama"), cores=core,
        )  # fmt: skip

    @property
    def spec(self) -> str:
        return f"tcp://127.0.0.1:{self.events},tcp://127.0.0.1:{self.replay}"


def conversations(rng: random.Random, users: int, turns: int) -> list[list[list[int]]]:
    """Each user's prompts, turn by turn (token ids; bench-llama's vocabulary is 1024)."""

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    systems = [toks(SYSTEM), toks(SYSTEM)]
    out = []
    for u in range(users):
        history, prompts = list(systems[u % 2]), []
        for _ in range(turns):
            message = toks(USER)
            prompts.append(history + message)
            history = history + message + toks(ANSWER)
        out.append(prompts)
    return out


def pauses(rng: random.Random, users: int, turns: int, mean: float) -> list[list[float]]:
    """Each user's pause before each turn, seconds (exponential of `mean`; 0: none)."""
    draw = (lambda: rng.expovariate(1 / mean)) if mean else (lambda: 0.0)
    return [[draw() for _ in range(turns)] for _ in range(users)]


def ask(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed completion: the client's TTFT, prompt and cached tokens."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    answer = conn.getresponse()
    ttft, usage = None, {}
    for line in answer:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if ttft is None and chunk.get("choices"):
            ttft = time.perf_counter() - t0
        usage = chunk.get("usage") or usage
    conn.close()
    if ttft is None or not usage:
        raise RuntimeError(f"no streamed answer from the proxy (status {answer.status})")
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": details.get("cached_tokens") or 0,
    }


def one_run(
    policy: str,
    servers: list[Server],
    convs: list[list[list[int]]],
    concurrency: int,
    think: list[list[float]],
) -> dict[str, Any]:
    urls = [s.api.url for s in servers]
    specs = [s.spec for s in servers]
    if policy == "one server":
        urls, specs = urls[:1], specs[:1]
    route = "round-robin" if policy == "one server" else policy
    proxy = PdProxy([], [], servers=urls, route=route, kv_events=specs).start()
    model = servers[0].api.model
    samples: list[dict[str, Any]] = []
    todo = list(range(len(convs)))
    lock = threading.Lock()
    failed: list[BaseException] = []
    start = time.perf_counter()

    def user_loop() -> None:
        while True:
            with lock:
                if not todo or failed:
                    return
                u = todo.pop(0)
            for t, prompt in enumerate(convs[u]):
                if t:  # the user reads the answer and writes the next message
                    time.sleep(think[u][t])
                sent, wall = time.perf_counter() - start, time.time()
                try:
                    got = ask(proxy.url, model, prompt)
                except BaseException as exc:
                    failed.append(exc)
                    return
                with lock:
                    samples.append({"user": u, "turn": t, "sent_s": sent, "wall": wall, **got})

    try:
        threads = [threading.Thread(target=user_loop) for _ in range(concurrency)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert proxy.routing is not None
        router = proxy.routing.router
        requests = {s.url: s.requests for s in router.servers.values()}
        decisions = list(router.decisions)
    finally:
        proxy.close()
    if failed:
        raise failed[0]
    return {
        "policy": policy,
        "samples": placed(samples, decisions, urls),
        "requests_by_server": requests,
    }


def placed(samples: list[dict[str, Any]], decisions: list[Any], urls: list[str]) -> list[Any]:
    """Each sample with the server it went to (`server`: its index in `urls`): in the
    order they were sent, the proxy's first decision not yet taken, made after the send,
    for a prompt of its length (or of no known length: routed without reading the
    prompt). Approximate: two requests of one length sent in the same millisecond may be
    swapped (a run's first turns are sent together)."""
    left = sorted(decisions, key=lambda d: d.at)
    for s in sorted(samples, key=lambda s: s["sent_s"]):
        wall = s.pop("wall")
        fits = [d for d in left if d.prompt_tokens in (s["prompt_tokens"], 0)]
        after = [d for d in fits if d.at >= wall]
        if fits:
            d = (after or fits)[0]
            left.remove(d)
            s["server"] = urls.index(d.server)
    return samples


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy in POLICIES:
        mine = [r for r in runs if r["policy"] == policy]
        samples = [s for r in mine for s in r["samples"]]
        ttft = sorted(s["ttft_s"] for s in samples)
        later = sorted(s["ttft_s"] for s in samples if s["turn"] > 0)
        counts = [list(r["requests_by_server"].values()) for r in mine]
        out[policy] = {
            "requests": len(samples),
            "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p90_ms": 1e3 * ttft[int(0.9 * (len(ttft) - 1))],
            "later_turns_ttft_p90_ms": 1e3 * later[int(0.9 * (len(later) - 1))],
            "cached_share": sum(s["cached_tokens"] for s in samples)
            / sum(s["prompt_tokens"] for s in samples),
            "requests_by_server": counts,
        }
    p, rr, one = out["prefix"], out["round-robin"], out["one server"]
    out["goals"] = {
        "p90_vs_round_robin": p["ttft_p90_ms"] / rr["ttft_p90_ms"],
        "cached_vs_one_server": p["cached_share"] / one["cached_share"],
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--think", type=float, default=2.0,
        help="mean seconds between a conversation's turns (exponential; 0: none)",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="4 users, 3 turns, 1 round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "route.json"))
    args = ap.parse_args()
    if args.quick:
        args.users, args.turns, args.rounds = 4, 3, 1
    meta = record.start()
    work = Path(tempfile.mkdtemp(prefix="kvflow-route-"))
    rng = random.Random(args.seed)
    servers = [Server(work, "a", "0"), Server(work, "b", "1")]
    runs: list[dict[str, Any]] = []
    orders = []
    try:
        for s in servers:
            s.api.wait_ready()
        for r in range(args.rounds):
            order = POLICIES if r % 2 == 0 else POLICIES[::-1]
            orders.append(list(order))
            for policy in order:
                print(f"round {r + 1}: {policy} ...", flush=True)
                convs = conversations(rng, args.users, args.turns)
                think = pauses(rng, args.users, args.turns, args.think)
                runs.append(one_run(policy, servers, convs, args.concurrency, think) | {"round": r})
    finally:
        for s in servers:
            s.api.close()
        shutil.rmtree(work, ignore_errors=True)
    figures = summarise(runs)
    data = {
        "model": "bench-llama",
        "users": args.users,
        "turns": args.turns,
        "concurrency": args.concurrency,
        "think_s": args.think,
        "rounds": args.rounds,
        "orders": orders,
        "policies": {p: figures[p] for p in POLICIES},
        "goals": figures["goals"],
        "runs": runs,
    }
    record.save(Path(args.out), data, meta, extra=EXTRA_SOURCES)
    for p in POLICIES:
        f = figures[p]
        print(
            f"{p:<12} TTFT p50 {f['ttft_p50_ms']:7.1f} ms  p90 {f['ttft_p90_ms']:7.1f} ms  "
            f"later turns p90 {f['later_turns_ttft_p90_ms']:7.1f} ms  "
            f"cached {f['cached_share']:.2f}  by server {f['requests_by_server']}"
        )
    g = figures["goals"]
    print(
        f"prefix p90 / round robin p90 = {g['p90_vs_round_robin']:.2f} (goal <= 0.5); "
        f"prefix cached / one server's = {g['cached_vs_one_server']:.2f} (goal >= 0.9)"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
