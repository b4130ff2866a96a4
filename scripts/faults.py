"""Inject faults into real P/D servers and print what each became (docs/reliability.md).

    python scripts/faults.py                      # every row
    python scripts/faults.py producer-kill-queued consumer-abort-queued

Two of vLLM's OpenAI servers on this host (prefill on core 0, decode on core 1), `zmq`
with a deployment key, `kv_load_failure_policy: recompute`, kvflow's defaults
(`progress_timeout_s` 2 s, `lease_s` 30 s, `hold_timeout_s` 120 s). Each row prefills
16 prompts (150 to 300 tokens) on the producer with the P/D params of vLLM's proxy
convention, then sends them to the decode server (8 output tokens) with the params the
prefills returned, and injects its fault at its moment:

    producer-kill-before-claim   SIGKILL the producer after the prefills, before the
                                 decode requests arrive (their claims go unanswered)
    producer-stop-before-claim   the same with SIGSTOP (a hung host); SIGCONT after
    producer-kill-queued         the decode server paused (vLLM's /pause), the 16
                                 requests queued there with their claims held, then
                                 SIGKILL the producer and resume: 16 pulls at once
    producer-stop-queued         the same with SIGSTOP; SIGCONT after
    consumer-kill-queued         the 16 claims held, then SIGKILL the decode server
    consumer-abort-queued        the 16 claims held, then every client goes away
                                 (vLLM aborts the queued requests)
    port-taken                   a server whose side-channel port is taken
    serve-broken                 a server whose side channel's serving task fails
                                 every time it starts (injected by a sitecustomize)

and, on one `fs` (or `redis`) server with vLLM's prefix cache off, 12 prompts run
cold, then again after the fault: store-full (a 1.5 MiB tmpfs), store-read-only,
store-deleted (as the batch starts), chunk-corrupt, chunk-truncated, redis-killed (as
the batch starts; then started again).

Per row: requests answered, wrong tokens (against the decode server computing each
prompt alone), request errors, the worst extra wait (a request's latency less the same
prompt's latency computed alone: what finding the fault cost it), and the time from the
fault until every live server holds no KV block again (`vllm:kv_cache_usage_perc` 0;
one that does not within 150 s has leaked blocks). Exits non-zero on a wrong token, a
request error, a leak or a hang. A killed server is started again for the next row.
The figures go to bench/results/faults.json (`--out`; bench/record.py: commit,
command, machine, date, the files it ran), from which `python bench/run.py --render`
renders docs/reliability.md's fault matrix; a run of some rows writes those rows only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvflow.keyfiles import keygen
from kvflow.observe.events import LookupAnswered
from kvflow.observe.log import read_event_log
from kvflow.pd.proxy import PREFILL_PARAMS
from kvflow_vllm.apiserver import ApiServer, free_port, post

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import record  # noqa: E402  (bench/record.py: what a results file records)

N = 16
MAX_TOKENS = 8
IDLE_S = 150.0
"""A server whose blocks are not all back this long after a fault has leaked them."""
Result = tuple[dict[str, Any], float]
"""A completion's answer and its latency."""


def config(key: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVFlowConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"transport": "zmq", "key_file": key, **extra},
    }


def body(server: ApiServer, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def complete(server: ApiServer, prompt: list[int], **extra: Any) -> Result:
    t0 = time.monotonic()
    try:
        out = post(server.url + "/v1/completions", body(server, prompt, **extra))
    except OSError as exc:  # the server died with the request
        out = {"error": f"{type(exc).__name__}: {exc}"}
    return out, time.monotonic() - t0


def usage(server: ApiServer) -> float:
    try:
        return server.metrics().get("vllm:kv_cache_usage_perc", 1.0)
    except OSError:
        return 1.0


def idle_after(servers: list[ApiServer], since: float) -> float | None:
    """Seconds from `since` until every server holds no block (None: not in IDLE_S)."""
    while time.monotonic() - since < IDLE_S:
        if all(usage(s) == 0 for s in servers):
            return time.monotonic() - since
        time.sleep(0.1)  # polls other processes' metrics
    return None


class Pair:
    """The prefill (producer) and decode (consumer) servers."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.key = str(keygen(work / "key"))
        self.prefill = self.start("prefill")
        self.decode = self.start("decode")

    def start(self, which: str, port: int = 0) -> ApiServer:
        dev = {"VLLM_SERVER_DEV_MODE": "1"}  # /pause and /resume
        core = "0" if which == "prefill" else "1"
        cfg = config(self.key, event_log=str(self.events(which)))
        server = ApiServer(self.work, which, cfg, cores=core, env=dev, port=port)
        server.wait_ready()
        return server

    def events(self, which: str) -> Path:
        """kvflow's event log of `which` (JSON lines)."""
        return self.work / f"{which}-events.jsonl"

    def claims_held(self, reqs: int, since: int) -> None:
        """Wait until the decode server holds `reqs` more claims than it had after `since`
        lines of its event log (a paused server publishes no metrics)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            events = read_event_log(str(self.events("decode")))[since:]
            held = [e for e in events if isinstance(e, LookupAnswered) and e.hit_tokens > 0]
            if len(held) >= reqs:
                return
            time.sleep(0.05)  # polls another process's log
        raise TimeoutError(f"the decode server did not hold {reqs} claims within 60 s")

    def log_lines(self, which: str) -> int:
        path = self.events(which)
        return len(path.read_bytes().splitlines()) if path.exists() else 0

    def restart(self, which: str) -> None:
        """Start `which` again on its port (after it was killed)."""
        old = getattr(self, which)
        old.close()
        setattr(self, which, self.start(which, old.port))

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


class Row:
    """One fault on a fresh batch of prompts."""

    def __init__(self, pair: Pair, prompts: list[list[int]]) -> None:
        self.pair, self.prompts = pair, prompts
        with ThreadPoolExecutor(N) as ex:  # the reference: the decode server alone
            self.alone = list(ex.map(lambda p: complete(pair.decode, p), prompts))
        self.fault_at = 0.0

    def prefill(self) -> list[dict[str, Any]]:
        extra = {"max_tokens": 1, "kv_transfer_params": dict(PREFILL_PARAMS)}
        with ThreadPoolExecutor(N) as ex:
            outs = list(ex.map(lambda p: complete(self.pair.prefill, p, **extra), self.prompts))
        return [out["kv_transfer_params"] for out, _ in outs]

    def decode(self, params: list[dict[str, Any]]) -> list[Future[Result]]:
        ex = ThreadPoolExecutor(N)
        futures = [
            ex.submit(complete, self.pair.decode, p, kv_transfer_params=kp)
            for p, kp in zip(self.prompts, params, strict=True)
        ]
        ex.shutdown(wait=False)
        return futures

    def queue(self, params: list[dict[str, Any]]) -> list[Future[Result]]:
        """Pause the decode server and queue the requests there, their claims held."""
        since = self.pair.log_lines("decode")
        post(self.pair.decode.url + "/pause?mode=keep", {})
        futures = self.decode(params)
        self.pair.claims_held(len(params), since)
        return futures

    def fault(self, what: Callable[[], None]) -> None:
        self.fault_at = time.monotonic()
        what()

    def judge(self, futures: list[Future[Result]], live: list[ApiServer]) -> dict[str, Any]:
        wrong = errors = 0
        extra = []
        for i, f in enumerate(futures):
            got, latency = f.result(timeout=600)
            if "choices" not in got:
                errors += 1
                print(f"  request {i} failed: {str(got)[:300]}")
                continue
            want = self.alone[i][0]["choices"][0]["text"]
            wrong += got["choices"][0]["text"] != want
            extra.append(latency - self.alone[i][1])
        idle = idle_after(live, self.fault_at)
        return {
            "answered": len(futures) - errors,
            "wrong_tokens": wrong,
            "errors": errors,
            "worst_extra_wait_s": secs(max(extra)) if extra else None,
            "blocks_back_s": secs(idle),  # None: leaked
        }


def secs(t: float | None) -> float | None:
    """`t` rounded to the hundredth (None stays None: a leak, or nothing to time)."""
    return None if t is None else round(t, 2)


def signal_server(server: ApiServer, sig: signal.Signals) -> None:
    """Signal the server's whole process group (its API server, engine and workers)."""
    os.killpg(server.proc.pid, sig)


def run_row(name: str, pair: Pair, prompts: list[list[int]]) -> dict[str, Any]:
    row = Row(pair, prompts)
    params = row.prefill()
    p, d = pair.prefill, pair.decode
    if name.startswith("producer-"):
        sig = signal.SIGKILL if "-kill-" in name else signal.SIGSTOP
        if name.endswith("-queued"):  # claims held, 16 pulls start as the producer goes
            futures = row.queue(params)

            def go() -> None:
                signal_server(p, sig)
                post(d.url + "/resume", {})

            row.fault(go)
        else:  # before the decode requests arrive: their claims go unanswered
            row.fault(lambda: signal_server(p, sig))
            futures = row.decode(params)
        out = row.judge(futures, [d])
        if sig == signal.SIGSTOP:
            signal_server(p, signal.SIGCONT)
            out["producer_blocks_back_after_sigcont_s"] = secs(idle_after([p], time.monotonic()))
        else:
            pair.restart("prefill")
        return out
    if name == "consumer-kill-queued":
        futures = row.queue(params)
        row.fault(lambda: signal_server(d, signal.SIGKILL))
        idle = idle_after([p], row.fault_at)
        lost = sum("choices" not in f.result(timeout=600)[0] for f in futures)
        pair.restart("decode")
        return {"lost_with_the_consumer": lost, "producer_blocks_back_s": secs(idle)}
    if name == "consumer-abort-queued":
        since = pair.log_lines("decode")
        post(d.url + "/pause?mode=keep", {})
        conns = []
        for prompt, kp in zip(prompts, params, strict=True):
            c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
            payload = json.dumps(body(d, prompt, stream=True, kv_transfer_params=kp))
            c.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
            conns.append(c)
        pair.claims_held(len(params), since)

        def clients_go() -> None:
            for c in conns:
                c.sock.shutdown(socket.SHUT_RDWR)
                c.close()

        row.fault(clients_go)
        idle = idle_after([p], row.fault_at)
        post(d.url + "/resume", {})
        both = idle_after([p, d], time.monotonic())
        return {"producer_blocks_back_s": secs(idle), "both_idle_after_resume": both is not None}
    raise ValueError(name)


def port_taken(work: Path, key: str) -> dict[str, Any]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = config(key, options={"port": port})
        t0 = time.monotonic()
        server = ApiServer(work, "port-taken", cfg, cores="0")
        code = server.proc.wait(300)
        said = [line for line in server.log_text().splitlines() if "cannot bind" in line]
    return {
        "exit_code": code,
        "exited_after_s": secs(time.monotonic() - t0),
        "said": said[-1].strip()[-200:] if said else None,
    }


BROKEN_SERVE = '''"""Injected by scripts/faults.py (serve-broken): the zmq transport's serving
loop fails every time it starts, in every process of the server."""
import kvflow_zmq._transport as _zmq


async def _broken(self, nursery):
    raise OSError("injected by scripts/faults.py: the side channel is gone")


_zmq.ZmqTransport.serving = _broken
'''


def health(server: ApiServer) -> str:
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
            return str(r.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except OSError as exc:
        return f"no answer ({type(exc).__name__})"


def serve_broken(work: Path, key: str) -> dict[str, Any]:
    """A server whose side channel's serving task fails every time it starts (injected
    with a `sitecustomize` module): restarted, counted, then the engine stops at its
    next step and `/health` fails, rather than serving with P/D off."""
    inject = work / "inject"
    inject.mkdir(exist_ok=True)
    (inject / "sitecustomize.py").write_text(BROKEN_SERVE)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(inject), os.environ.get("PYTHONPATH")]))}
    server = ApiServer(work, "serve-broken", config(key), cores="0", env=env)
    try:
        server.wait_ready()
        idle = health(server)
        got, _ = complete(server, [7] * 40)
        deadline = time.monotonic() + 60
        while (after := health(server)) == "200" and time.monotonic() < deadline:
            time.sleep(0.2)  # polls another process's health endpoint
        log = server.log_text()
    finally:
        server.close()
    said = [line for line in log.splitlines() if "KVFlowFatal" in line]
    return {
        "restarts_logged": log.count("kvflow: starting zmq:serve again"),
        "health_while_idle": idle,
        "next_request": "answered" if "choices" in got else f"error {str(got)[:120]}",
        "health_after_it": after,
        "said": said[-1].strip()[-200:] if said else None,
    }


STORE_ROWS = (
    "store-full",
    "store-read-only",
    "store-deleted",
    "chunk-corrupt",
    "chunk-truncated",
    "redis-killed",
)


def fs_config(path: Path) -> dict[str, Any]:
    return {
        "kv_connector": "KVFlowConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"transport": "fs", "options": {"path": str(path)}},
    }


def redis_config(url: str) -> dict[str, Any]:
    cfg = fs_config(Path())
    cfg["kv_connector_extra_config"] = {"transport": "redis", "options": {"url": url}}
    return cfg


def mount_tmpfs(path: Path, nbytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(path)]
    subprocess.run(cmd, check=True, capture_output=True)


def chunk_files(store: Path) -> list[Path]:
    return sorted(store.rglob("*.kv"))


def batch(server: ApiServer, prompts: list[list[int]]) -> list[Result]:
    with ThreadPoolExecutor(4) as ex:
        return list(ex.map(lambda p: complete(server, p), prompts))


def compare(got: list[Result], want: list[Result]) -> dict[str, Any]:
    wrong = sum(
        "choices" in g and g["choices"][0]["text"] != w["choices"][0]["text"]
        for (g, _), (w, _) in zip(got, want, strict=True)
    )
    errors = sum("choices" not in g for g, _ in got)
    extra = max(t - w for (_, t), (_, w) in zip(got, want, strict=True))
    return {"wrong_tokens": wrong, "errors": errors, "worst_extra_wait_s": secs(extra)}


def store_row(name: str, work: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """One fs (or redis) server, policy recompute, vLLM's prefix cache off (every
    request asks kvflow): a cold batch (the reference), then the fault, then the batch
    again."""
    store = work / name
    redis = None
    if name == "store-full":
        mount_tmpfs(store, 3 << 19)  # 1.5 MiB: a few chunks of the tiny model
    elif name == "store-read-only":
        mount_tmpfs(store, 256 << 20)
    if name == "redis-killed":
        redis = Redis(work)
        cfg = redis_config(redis.url)
    else:
        cfg = fs_config(store)
    server = ApiServer(work, name, cfg, "--no-enable-prefix-caching", cores="0")
    try:
        server.wait_ready()
        cold = batch(server, prompts)
        idle_after([server], time.monotonic())
        before = server.metrics()
        pool = ThreadPoolExecutor(1)
        if name in ("store-deleted", "redis-killed"):  # mid-run: the batch is in flight
            running = pool.submit(batch, server, prompts)
        t0 = time.monotonic()
        if name == "store-read-only":
            subprocess.run(["mount", "-o", "remount,ro", str(store)], check=True)
        elif name == "store-deleted":  # the path goes at once; saves racing land in the old
            shutil.rmtree(store.rename(store.with_name("deleted")), ignore_errors=True)
        elif name in ("chunk-corrupt", "chunk-truncated"):
            for f in chunk_files(store):
                data = bytearray(f.read_bytes())
                if name == "chunk-truncated":
                    data = data[: len(data) // 2]
                else:
                    data[len(data) // 2] ^= 0xFF
                f.write_bytes(bytes(data))
        elif redis is not None:
            redis.kill()
        if name not in ("store-deleted", "redis-killed"):
            running = pool.submit(batch, server, prompts)
        after = running.result()
        pool.shutdown()
        out = compare(after, cold)
        idle = idle_after([server], t0)
        m = server.metrics()
        loads = 'vllm:kvflow_tokens_total{direction="load"}'
        out["prompt_tokens"] = sum(map(len, prompts))
        out["tokens_loaded"] = round(m.get(loads, 0) - before.get(loads, 0))
        fails = "vllm:kvflow_failures_total"
        out["failed_transfers"] = round(m.get(fails, 0) - before.get(fails, 0))
        if redis is not None:
            redis.start()
            batch(server, prompts)  # saved afresh
            again = batch(server, prompts)  # then loaded
            out["after_redis_restarted"] = compare(again, cold) | {
                "tokens_loaded": round(server.metrics().get(loads, 0) - m.get(loads, 0))
            }
        out["blocks_back_s"] = secs(idle)  # None: leaked
        return out
    finally:
        server.close()
        if redis is not None:
            redis.kill()
        if name in ("store-full", "store-read-only"):
            subprocess.run(["umount", str(store)], capture_output=True)


class Redis:
    """A `redis-server` on a free loopback port, no persistence."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install -y redis-server)")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, cwd=self.work)
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"*1\r\n$4\r\nPING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)  # polls another process's port

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


FAULTS = {
    "producer-kill-before-claim": "SIGKILL the producer after its prefills, before the "
    "decode requests arrive",
    "producer-stop-before-claim": "the same with SIGSTOP (a hung host)",
    "producer-kill-queued": f"{N} requests queued on the paused decode server with their "
    f"claims held; SIGKILL the producer, resume: {N} pulls at once from a dead producer",
    "producer-stop-queued": "the same with SIGSTOP",
    "consumer-kill-queued": f"{N} claims held; SIGKILL the decode server",
    "consumer-abort-queued": f"{N} claims held; every client goes away (vLLM aborts the "
    "queued requests)",
    "port-taken": "a server whose side-channel port is taken",
    "serve-broken": "a server whose side channel's serving task fails every time it starts "
    "(injected by a `sitecustomize`)",
    "store-full": "the store a 1.5 MiB tmpfs, full",
    "store-read-only": "the store remounted read-only",
    "store-deleted": "the store deleted as the batch starts",
    "chunk-corrupt": "a byte flipped in every chunk file",
    "chunk-truncated": "every chunk file cut in half",
    "redis-killed": "`redis-server` killed as the batch starts, then started again (empty)",
}
"""Each row and its fault, as the results file and the docs' table give it."""
ROWS = tuple(FAULTS)
assert set(STORE_ROWS) <= set(ROWS)


def main() -> int:
    meta = record.start()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="*", help=f"of {', '.join(ROWS)} (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults.json")
    args = ap.parse_args()
    if unknown := [r for r in args.rows if r not in ROWS]:
        ap.error(f"unknown row(s) {', '.join(unknown)}; valid: {', '.join(ROWS)}")
    args.rows = args.rows or list(ROWS)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kvflow-faults-"))
    t0 = time.monotonic()
    results: dict[str, Any] = {
        "seed": args.seed,
        "pd_requests": N,
        "max_tokens": MAX_TOKENS,
        "idle_s": IDLE_S,
        "rows": {},
    }

    def keep(name: str, out: dict[str, Any]) -> bool:
        """Print and save a row (each as it ends: a run cut short keeps what it measured);
        True if it shows a wrong token, an error, a leak or a fault not handled."""
        results["rows"][name] = {"fault": FAULTS[name], **out}
        results["wall_s"] = round(time.monotonic() - t0, 1)
        extra = [
            *("kvflow", "plugins/kvflow_vllm", "plugins/kvflow_redis", "scripts/faults.py"),
            *("transports/kvflow_zmq", "transports/kvflow_fs"),
        ]
        record.save(args.out, results, meta, extra)
        return report(out)

    bad = False
    alone = ("port-taken", "serve-broken")
    pd_rows = [r for r in args.rows if r not in STORE_ROWS and r not in alone]
    pair = Pair(work) if pd_rows else None
    try:
        for name in [r for r in args.rows if r not in STORE_ROWS]:
            print(f"{name}:", flush=True)
            if name == "port-taken":
                out = port_taken(work, str(keygen(work / "port-key")))
            elif name == "serve-broken":
                out = serve_broken(work, str(keygen(work / "broken-key")))
            else:
                assert pair is not None
                ps = [
                    [rng.randrange(3, 1000) for _ in range(rng.randrange(150, 300))]
                    for _ in range(N)
                ]
                out = run_row(name, pair, ps)
            bad |= keep(name, out)
    finally:
        if pair is not None:
            pair.close()
    prompts = [[rng.randrange(3, 1000) for _ in range(60 + 17 * i)] for i in range(12)]
    for name in [r for r in args.rows if r in STORE_ROWS]:
        print(f"{name}:", flush=True)
        bad |= keep(name, store_row(name, work, prompts))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


def failed(out: dict[str, Any]) -> bool:
    """Whether a row's figures show a wrong token, a request error, a leak (blocks not
    back within IDLE_S), or a fault that was not handled as it must be."""
    bad = False
    for k, v in out.items():
        if isinstance(v, dict):
            bad |= failed(v)
        elif k in ("wrong_tokens", "errors"):
            bad |= v != 0
        elif k.endswith("blocks_back_s") or k.endswith("blocks_back_after_sigcont_s"):
            bad |= v is None
        elif k == "both_idle_after_resume":
            bad |= not v
        elif k == "said":
            bad |= v is None
        elif k == "exit_code":
            bad |= v == 0
        elif k == "health_after_it":
            bad |= v == "200"
    return bad


def report(out: dict[str, Any], indent: str = "  ") -> bool:
    """Print a row's figures; True if they show what `failed` looks for."""
    for k, v in out.items():
        if isinstance(v, dict):
            print(f"{indent}{k}:")
            report(v, indent + "  ")
            continue
        shown = "LEAKED" if v is None and "blocks_back" in k else v
        print(f"{indent}{k:<40} {shown}", flush=True)
    return failed(out)


if __name__ == "__main__":
    sys.exit(main())
