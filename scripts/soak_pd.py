"""Soak P/D: many requests through `kvflow proxy` and two real vLLM servers, with
client aborts and the producer killed and started again as it serves.

    python scripts/soak_pd.py --requests 1000

The servers and their configuration are `scripts/faults.py`'s (prefill on core 0,
decode on core 1, `zmq` with a deployment key, policy `recompute`); `kvflow proxy` runs
between them as a user starts it. Prompts are drawn from 60 over 6 shared prefixes (a
system prompt, a document), 16 in flight at once; a fifth of the requests are streamed
and their clients go away after the first chunk (vLLM aborts them, here and on the
decode server). Every `--kill-every` requests the prefill server is killed (SIGKILL,
its engine and workers with it) with requests in flight, and started again on its
port; no request is sent while it starts.

Prints requests, aborts, kills, wrong tokens (against the decode server computing each
prompt alone), request errors (those in flight when the producer was killed, apart),
blocks held once both servers are idle, the decode server's kvflow loads (pulls, from
its event log) and the worst and median latency, and writes them with every request's
latency to bench/results/soak-pd.json (bench/record.py: commit, command, machine, date,
every earlier run; docs/reliability.md's table is rendered from it by `python
bench/run.py --render`). Exits non-zero on a wrong token, a leaked block, a hang, or a
request error that no kill explains.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from faults import Pair, body, idle_after, signal_server  # scripts/faults.py
from soak import kvflow_loads  # scripts/soak.py

from kvflow_vllm.apiserver import ApiServer, free_port, post

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import record  # noqa: E402  (bench/record.py: what a results file records)

HANG_S = 300.0
"""A request unanswered this long is a hang."""


def prompts(rng: random.Random, unique: int) -> list[list[int]]:
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randrange(40, 250))] for _ in range(6)]
    return [
        rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 120))]
        for _ in range(unique)
    ]


class Proxy:
    """`kvflow proxy` in a process of its own."""

    def __init__(self, prefill: ApiServer, decode: ApiServer, log: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "kvflow.cli.main", "proxy", "--prefill", prefill.url,
            "--decode", decode.url, "--port", str(self.port), *flags,
        ]  # fmt: skip
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"kvflow proxy did not start: {log.read_text()}") from None
                time.sleep(0.1)  # polls another process's port

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Soak:
    def __init__(self, args: argparse.Namespace, pair: Pair, proxy: Proxy) -> None:
        self.args, self.pair, self.proxy = args, pair, proxy
        self.count: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.lock = threading.Lock()
        self.kill_epoch = 0
        """Bumped at each kill: a request that fails across one is the kill's."""

    def one(self, i: int, prompt: list[int], want: str, abort: bool, epoch: int) -> None:
        """Request `i`, sent when `epoch` kills had been made."""
        t0 = time.monotonic()
        if abort:
            self.abort(prompt)
            with self.lock:
                self.count["aborted"] += 1
            return
        out = post(self.proxy.url + "/v1/completions", body(self.pair.decode, prompt), HANG_S)
        latency = time.monotonic() - t0
        with self.lock:
            if "choices" not in out:
                kind = "errors at a kill" if self.kill_epoch != epoch else "errors"
                self.count[kind] += 1
                if kind == "errors":
                    print(f"request {i} failed: {str(out)[:300]}", flush=True)
            elif out["choices"][0]["text"] != want:
                self.count["wrong tokens"] += 1
                print(f"request {i}: wrong tokens", flush=True)
            else:
                self.count["right"] += 1
                self.latencies.append(latency)

    def abort(self, prompt: list[int]) -> None:
        """A streamed request whose client goes away after its first chunk."""
        c = http.client.HTTPConnection("127.0.0.1", self.proxy.port, timeout=HANG_S)
        try:
            payload = json.dumps(body(self.pair.decode, prompt, stream=True))
            c.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
            resp = c.getresponse()
            resp.read1(1)
        except OSError:
            pass
        finally:
            c.close()

    def run(self, ps: list[list[int]], want: list[str]) -> None:
        rng = random.Random(self.args.seed + 1)
        pool = ThreadPoolExecutor(self.args.concurrency)
        in_flight: list[Future[None]] = []
        for i in range(self.args.requests):
            if i and i % self.args.kill_every == 0:
                self.kill_producer()
            while len(in_flight) >= self.args.concurrency:
                in_flight = [f for f in in_flight if not f.done()]
                if len(in_flight) >= self.args.concurrency:
                    time.sleep(0.01)  # a free client slot
            k = rng.randrange(len(ps))
            abort = rng.random() < self.args.abort_rate
            epoch = self.kill_epoch  # now: the thread may start it after the next kill
            in_flight.append(pool.submit(self.one, i, ps[k], want[k], abort, epoch))
        for f in in_flight:
            f.result(timeout=HANG_S)
        pool.shutdown()

    def kill_producer(self) -> None:
        with self.lock:  # first: a request that fails from here on may be the kill's
            self.kill_epoch += 1
            self.count["producer kills"] += 1
        signal_server(self.pair.prefill, signal.SIGKILL)
        self.pair.restart("prefill")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--unique", type=int, default=60, help="distinct prompts")
    ap.add_argument("--abort-rate", type=float, default=0.2)
    ap.add_argument("--kill-every", type=int, default=300, help="requests between kills")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak-pd.json")
    args = ap.parse_args()
    meta = record.start()
    work = Path(tempfile.mkdtemp(prefix="kvflow-soak-pd-"))
    ps = prompts(random.Random(args.seed), args.unique)
    pair = Pair(work)
    proxy = None
    try:
        d = pair.decode
        with ThreadPoolExecutor(args.concurrency) as ex:  # each prompt computed alone
            outs = list(ex.map(lambda p: post(d.url + "/v1/completions", body(d, p)), ps))
        want = [o["choices"][0]["text"] for o in outs]
        proxy = Proxy(pair.prefill, pair.decode, work / "proxy.log")
        soak = Soak(args, pair, proxy)
        t0 = time.monotonic()
        soak.run(ps, want)
        wall = time.monotonic() - t0
        idle = idle_after([pair.prefill, pair.decode], time.monotonic())
        c = soak.count
        report = {
            "requests": args.requests,
            "right": c["right"],
            "aborted": c["aborted"],
            "producer_kills": c["producer kills"],
            "wrong_tokens": c["wrong tokens"],
            "request_errors": c["errors"],
            "errors_at_a_kill": c["errors at a kill"],
            "leaked_blocks": idle is None,
            "kvflow_loads": kvflow_loads(pair.events("decode")),
            "latencies_s": soak.latencies,
            "wall_s": round(wall, 1),
        }
        print_report(report)
        extra = ("kvflow", "plugins/kvflow_vllm", "transports/kvflow_zmq", "scripts/faults.py")
        record.save(args.out, report, meta, extra)
        bad = c["wrong tokens"] or c["errors"] or idle is None
    finally:
        if proxy is not None:
            proxy.close()
        pair.close()
    shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


def print_report(r: dict[str, Any]) -> None:
    lat, loads = sorted(r["latencies_s"]), r["kvflow_loads"]
    print(f"requests          {r['requests']} ({r['right']} right, {r['aborted']} aborted)")
    print(f"producer kills    {r['producer_kills']}")
    print(f"kvflow loads      {loads['done']} ({loads['chunks']} chunks), {loads['failed']} failed")
    print(f"wrong tokens      {r['wrong_tokens']}")
    errors = f"{r['request_errors']} (+ {r['errors_at_a_kill']} in flight at a kill)"
    print(f"request errors    {errors}")
    print(f"leaked blocks     {'YES (kv_cache_usage_perc > 0)' if r['leaked_blocks'] else 'none'}")
    if lat:
        print(f"latency           median {lat[len(lat) // 2]:.2f} s, worst {lat[-1]:.2f} s")
    print(f"wall              {r['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
