"""What `kvflow proxy` adds to a P/D request: its own time, apart from the servers'.

    python bench/bench_proxy.py [--quick] [--against REV]

The servers are a stand-in in a process of its own (the standard library's threaded HTTP
server): a prefill request (`do_remote_decode`) is answered at once with
`kv_transfer_params`, a decode request with a ~1 KiB JSON completion or, streamed, 16
server-sent events; so what is timed is HTTP and the proxy, not a model. `kvflow proxy
--prefill S --decode S` runs in a process of its own, as users run it. The client (this
process, a thread per request in flight, each keeping its connection alive) times each
request from send to the answer's last byte:

- `direct`: the client makes the proxy's two calls itself, the prefill's and then the
  decode's (the same bodies), over its own kept-alive connection: the baseline;
- `proxy`: the request through `kvflow proxy` of this tree;
- `proxy at REV` (`--against REV`): through `kvflow proxy` of commit REV's `kvflow/`
  (e.g. the last one with `http.server` and `urllib`, 37a1fed).

Workloads: `json` (not streamed) and `stream`, each at 1 and 32 requests in flight.
Every configuration runs each workload in turn, the order alternating by round
(A-B-C, C-B-A, ...); every sample is kept. The table shows per configuration and
workload the p50 and p90 latency, requests per second, and the p50 over `direct`'s:
what the proxy adds is the difference. On 2 cores the client, the stand-in and the proxy
share the CPU: the figures are the proxy's cost relative to its baseline here, not a
capacity.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import record  # noqa: E402

from kvflow_vllm.apiserver import free_port  # noqa: E402

OUT = HERE / "results" / "proxy.json"
PATH = "/v1/completions"
CONCURRENCY = (1, 32)
BODY = {"model": "m", "prompt": list(range(1024)), "max_tokens": 16}
"""A request as a client sends it: a prompt of 1024 token ids (~5 KiB of JSON)."""
ANSWER = json.dumps(
    {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x " * 400}]}
).encode()
EVENTS = 16
EXTRA_SOURCES = [
    "kvflow/cli/main.py",
    "kvflow/pd/proxy.py",
    *(
        str(p.relative_to(ROOT))
        for room in ("route", "web")
        for p in sorted((ROOT / "kvflow" / room).glob("*.py"))
    ),
]
"""What `kvflow proxy` runs, in a process of its own (for `record.save`)."""


# -- the stand-in servers (`--serve PORT_FILE`, a process of its own) ---------------------


class _Standin(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # its head and body are two writes: no 40 ms delayed ACK

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            params = {"do_remote_prefill": True, "remote_block_ids": list(range(32))}
            self._whole(json.dumps({"choices": [], "kv_transfer_params": params}).encode())
        elif body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            event = b'data: {"choices": [{"text": "x"}]}\n\n'
            for _ in range(EVENTS):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._whole(ANSWER)

    def _whole(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _StandinServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: a burst of new connections is not reset


def serve_standin(port_file: str) -> None:
    server = _StandinServer(("127.0.0.1", 0), _Standin)
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


# -- processes --------------------------------------------------------------------------


@contextlib.contextmanager
def process(args: list[str], env: dict[str, str] | None = None) -> Iterator[None]:
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def proxy(standin: str, tree: Path | None) -> Iterator[int]:
    """`kvflow proxy` in a process of its own (of the `kvflow/` under `tree` if given);
    its port once it answers."""
    port = free_port()
    code = "import sys; sys.path.insert(0, sys.argv.pop(1)) if sys.argv[1] else sys.argv.pop(1)\n"
    code += "from kvflow.cli.main import main; sys.exit(main(sys.argv[1:]))"
    args = [sys.executable, "-c", code, str(tree or ""), "proxy"]
    args += ["--prefill", standin, "--decode", standin, "--port", str(port)]
    with process(args):
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    conn.close()
                    break
            if time.monotonic() > deadline:
                raise SystemExit("kvflow proxy did not start")
            time.sleep(0.05)  # polls another process's start
        yield port


# -- the client -------------------------------------------------------------------------


def _read(conn: http.client.HTTPConnection, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()  # bytes: head and body in one send
    conn.request("POST", PATH, data, {"Content-Type": "application/json"})
    answer = conn.getresponse()
    data = answer.read()
    if answer.status != 200:
        raise SystemExit(f"answered {answer.status}: {data[:200]!r}")
    return data


def one_request(port: int, direct: bool, stream: bool, local: threading.local) -> float:
    conn = getattr(local, "conns", {}).get(port)
    if conn is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        local.conns = {**getattr(local, "conns", {}), port: conn}
    body = dict(BODY, stream=stream)
    t0 = time.perf_counter()
    if direct:  # what the proxy does: the prefill, then the decode with its params
        pre = dict(body, max_tokens=1, stream=False)
        pre["kv_transfer_params"] = {"do_remote_decode": True}
        params = json.loads(_read(conn, pre))["kv_transfer_params"]
        data = _read(conn, dict(body, kv_transfer_params=params))
    else:
        data = _read(conn, body)
    elapsed = time.perf_counter() - t0
    if data.count(b"data: ") != (EVENTS if stream else 0) or len(data) < 64:
        raise SystemExit(f"an answer of {len(data)} bytes: {data[:120]!r}")
    return elapsed


def batch(port: int, direct: bool, stream: bool, concurrency: int, n: int) -> dict[str, Any]:
    local = threading.local()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(lambda _: one_request(port, direct, stream, local), range(concurrency)))
        t0 = time.perf_counter()
        samples = list(ex.map(lambda _: one_request(port, direct, stream, local), range(n)))
        wall = time.perf_counter() - t0
    return {"samples_ms": [s * 1e3 for s in samples], "requests_per_s": n / wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--against", metavar="REV", help="also time kvflow proxy of commit REV")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve_standin(args.serve)
        return 0
    meta = record.start()
    rounds = args.rounds or (2 if args.quick else 4)
    per = {1: 100 if args.quick else 300, 32: 320 if args.quick else 960}
    work = Path(tempfile.mkdtemp(prefix="kvflow-bench-proxy-"))
    old: Path | None = None
    if args.against:
        old = work / "old"
        old.mkdir()
        archive = subprocess.run(
            ["git", "archive", args.against, "kvflow"], cwd=ROOT, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    port_file = work / "standin.port"
    standin = [sys.executable, str(Path(__file__).resolve()), "--serve", str(port_file)]
    env = dict(os.environ, PYTHONPATH="")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(standin, env))
        proc_port = _wait_port_file(port_file)
        url = f"http://127.0.0.1:{proc_port}"
        ports = {"direct": proc_port, "proxy": stack.enter_context(proxy(url, None))}
        if old is not None:
            ports[f"proxy at {args.against}"] = stack.enter_context(proxy(url, old))
        names = list(ports)
        workloads = [(s, c) for s in (False, True) for c in CONCURRENCY]
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                for stream, c in workloads:
                    key = f"{'stream' if stream else 'json'} x{c}"
                    got = batch(ports[name], name == "direct", stream, c, per[c])
                    into = results.setdefault(name, {}).setdefault(
                        key, {"samples_ms": [], "requests_per_s": []}
                    )
                    into["samples_ms"] += got["samples_ms"]
                    into["requests_per_s"].append(got["requests_per_s"])
                    print(f"round {r} {name:>20} {key:>10}: p50 "
                          f"{statistics.median(got['samples_ms']):.2f} ms, "
                          f"{got['requests_per_s']:.0f} req/s", flush=True)  # fmt: skip
    table: dict[str, dict[str, dict[str, float]]] = {}
    for name, by in results.items():
        for key, got in by.items():
            s = sorted(got["samples_ms"])
            base = statistics.median(results["direct"][key]["samples_ms"])
            table.setdefault(name, {})[key] = {
                "p50_ms": statistics.median(s),
                "p90_ms": s[int(0.9 * (len(s) - 1))],
                "requests_per_s": statistics.median(got["requests_per_s"]),
                "p50_over_direct": statistics.median(s) / base,
                "added_p50_ms": statistics.median(s) - base,
            }
    for name, by in table.items():
        for key, row in by.items():
            print(f"{name:>22} {key:>10}: p50 {row['p50_ms']:.2f} ms (+{row['added_p50_ms']:.2f}, "
                  f"{row['p50_over_direct']:.2f}x direct), p90 {row['p90_ms']:.2f} ms, "
                  f"{row['requests_per_s']:.0f} req/s")  # fmt: skip
    data = {
        "rounds": rounds,
        "requests": per,
        "against": args.against,
        "table": table,
        "samples_ms": {n: {k: v["samples_ms"] for k, v in by.items()} for n, by in results.items()},
    }
    record.save(args.out, data, meta, extra=EXTRA_SOURCES)
    return 0


def _wait_port_file(port_file: Path) -> int:
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text()):
        if time.monotonic() > deadline:
            raise SystemExit("the stand-in servers did not start")
        time.sleep(0.05)  # polls another process's start
    return int(port_file.read_text())


if __name__ == "__main__":
    sys.exit(main())
