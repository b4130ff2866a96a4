"""P/D serving on real vLLM OpenAI servers: TTFT and latency per request through `kvflow
proxy` (kvflow over `zmq`, over `nixl`, streamed or not, vLLM's own NixlConnector) and
without a proxy, against one server.

    python bench/bench_pd_serve.py [--quick] [--repeats 2] [--only "kvflow zmq"]

Configurations, each a fresh set of servers (`python -m vllm.entrypoints.openai.api_server`
started by `scripts/faults.py`'s `ApiServer`/`Pair`, `kvflow proxy` by
`scripts/soak_pd.py`'s `Proxy`), run one after another; with `--repeats` the order
alternates (A-B-C-D, D-C-B-A, ...):

- `one server`: one server, no connector, its worker on both cores
  (`VLLM_CPU_OMP_THREADS_BIND=0-1`, the pair's hardware); the requests go to it
  directly;
- `kvflow zmq`: a prefill server on core 0 and a decode server on core 1, both
  `KVFlowConnector` kv_both over `zmq` with a deployment key and policy `recompute`
  (`faults.config`: the configuration `scripts/faults.py` measures), `kvflow proxy`
  in front (prefill with `max_tokens=1` and vLLM's P/D params, then decode);
- `kvflow nixl`: the same with `transport: nixl` (NIXL 1.5.1, UCX, host memory);
- `kvflow zmq streamed`: `kvflow zmq`'s servers behind `kvflow proxy --stream` (both
  servers at once; the decode server pulls as the prefill computes: its TTFT's parts
  are the prefill, to the prefill server's finish, and what came after it);
- `kvflow nixl streamed`: `kvflow nixl`'s servers behind `kvflow proxy --stream` (the
  decode server's claim is answered once the prefill's forward is over, then it READs);
- `kvflow zmq, no proxy`: `kvflow zmq`'s servers, the client making the proxy's two
  calls itself (`kvflow.pd.proxy.prefill_request`, then the decode request with the
  params the prefill answered): what vLLM's own path takes between the prefill's offer
  and the decode server's arrival, cut where the client had the answer;
- `vLLM NixlConnector`: vLLM's own connector behind the same proxy, `kv_producer` on
  the prefill server and `kv_consumer` on the decode server, `kv_buffer_device: cpu`,
  each server its own `VLLM_NIXL_SIDE_CHANNEL_PORT`; it needs the `nixl` meta package
  (`pip install nixl==1.5.1 --no-deps` over nixl-cu12). Not `kv_both` (deprecated in
  vLLM 0.32): with it, on this machine, every request waited for the prefill's
  `kv_lease_duration` (30 s) to lapse, the prefill logged "Releasing expired KV blocks
  ... retrieved by 0 remote worker(s)", and the decode server then read the released
  blocks ("Potentially invalid KV blocks ... were retrieved by a decode worker"). A
  run whose servers log either line, whose servers do not start, or whose requests
  fail is left out, the results file saying why (`skipped`), and the script goes on;
  it is the only configuration allowed to be skipped.

Every server: model `bench-llama` (8 layers, 8 KV heads x 128, float32: 64 KiB of KV
per token, seeded random weights, the engine benchmarks' model), vLLM's prefix cache
off (`--no-enable-prefix-caching`: nothing can be served from a cache, and every
configuration gets the same prompts), block size 32, float32, eager, KV space sized
for twice the requests in flight. Workload: `--requests` (16; `--quick` 8) random-token
prompts of `--prompt-tokens` (1024; `--quick` 512), 16 output tokens (`ignore_eos`,
greedy), `--concurrency` (4) requests in flight at once, streamed. One untimed request
of the same length warms each configuration up first (first-forward costs, the
connector's handshake).

Timed client-side per request (this process, `time.perf_counter`): TTFT, from sending
the request until the first streamed chunk carrying a choice; latency, until the
stream ends. Output tok/s is a batch's generated tokens over its wall time (first
send to last answer). Samples: every request of every repeat (requests x repeats per
configuration); the table shows medians and p90, and each configuration's median TTFT
and latency over `one server`'s and over `vLLM NixlConnector`'s (where it ran). Every
answer's text is compared with `one server`'s for the same prompt (its first repeat):
a mismatch, or a failed request in a configuration that may not be skipped, makes the
script exit non-zero. Where the decode server's prompt tokens came from
(`vllm:prompt_tokens_by_source`, and kvflow's failure counters) is recorded per run:
a P/D row whose decode server computed the prompts itself is flagged `fell back`.

Where a kvflow P/D request's TTFT goes (`split`): both servers of a kvflow pair write
one kvflow event log; each request's timeline (`kvflow.observe.timeline`, what `kvflow
inspect --timeline` shows) and the client's send and first chunk, on one clock
(`time.monotonic()`), cut its TTFT into consecutive parts: the prefill (client, proxy,
the prefill server's queue and prefill, until its offer is made), offer to arrival (the
prefill's answer back through the proxy to the decode server's scheduler), the claim,
claim to pull (blocks, the step that starts it), the pull, pull to report (vLLM hears
of it at its next step), report to schedule, the first step, and the first token's
way to the client; without a proxy, offer to arrival is cut where the client had the
prefill's answer (offer to answer, answer to arrival). Per configuration: each part's
median, what P/D added over the prefill (the median sum of the parts after it), and
issue 49's goal for that (the median pull, one decode step at the median TPOT, 10 ms).
vLLM's NixlConnector writes no such events: its TTFT is the client's only.

What this machine can show: the pair shares one 2-core host, a core each (prefill 0,
decode 1: every thread of a server, its API server and engine core too, `pin`; runs
before 5b5daea bound only the workers, and the decode server's engine core, which vLLM
steps every millisecond while a request waits for remote KV, could run on the prefill's
core), and the proxy and this client float over both; the one
server computes on both cores (the same hardware as the pair). The pair can overlap
one request's prefill with another's decode, but each prefill runs on one core where
the one server's runs on two, and what P/D is for (prefill and decode on instances
of their own, sized for their batch shapes, decode steps never held up by a long
prefill) cannot show on two cores:
the figures are P/D's overhead and latency (the proxy's two hops, the prefill's one
token, the KV transfer, the decode's wait for it), not its throughput benefit.

Writes bench/results/pd-serve.json (`--out`) with `bench/record.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import record  # bench/record.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import faults  # noqa: E402  # scripts/faults.py
from soak_pd import Proxy  # noqa: E402  # scripts/soak_pd.py

from kvflow.observe.log import read_event_log  # noqa: E402
from kvflow.observe.timeline import SPANS, Timeline, timelines  # noqa: E402
from kvflow.pd.proxy import prefill_request  # noqa: E402
from kvflow_vllm.apiserver import ApiServer, free_port  # noqa: E402
from kvflow_vllm.engine_process import model_dir  # noqa: E402

MODEL = "bench-llama"
MAX_TOKENS = 16
HANG_S = 300.0
"""A request whose server sends nothing for this long has hung (a socket timeout)."""
ONE = "one server"
EVENTS = "events.jsonl"
"""A P/D pair's kvflow event log (both servers'), in its work directory."""
NIXL_CONNECTOR = "vLLM NixlConnector"
EXTRA_SOURCES = (
    "kvflow",
    "plugins/kvflow_vllm",
    "transports/kvflow_zmq",
    "transports/kvflow_nixl",
    "scripts/faults.py",
    "scripts/soak_pd.py",
)
"""What the servers and the proxy run, in other processes (for `record.save`)."""


@dataclass(frozen=True)
class Setup:
    """One configuration: a server's `--kv-transfer-config` given the deployment key and
    which server it is ("prefill", "decode"; `kv` None: one server, no connector), and
    extra environment for each server."""

    name: str
    kv: Callable[[str, str], dict[str, Any]] | None
    env: Callable[[], dict[str, str]] = dict
    optional: bool = False
    """May be skipped, saying why, where it cannot run here."""
    invalid_if: tuple[str, ...] = ()
    """Server log lines that make a run invalid (the configuration is then skipped)."""
    proxy_flags: tuple[str, ...] = ()
    """`kvflow proxy`'s options for it (`--stream`)."""
    direct: bool = False
    """No proxy: the client makes the proxy's two calls itself (vLLM's own path)."""


def nixl_connector(_key: str, which: str) -> dict[str, Any]:
    """vLLM's NixlConnector as its docs deploy it on a P/D pair (kv_both stalls here)."""
    role = "kv_producer" if which == "prefill" else "kv_consumer"
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


SETUPS = (
    Setup(ONE, None),
    Setup("kvflow zmq", lambda key, _which: faults.config(key)),
    Setup("kvflow nixl", lambda key, _which: faults.config(key, transport="nixl")),
    Setup("kvflow zmq streamed", lambda key, _which: faults.config(key), proxy_flags=("--stream",)),
    Setup(
        "kvflow nixl streamed",
        lambda key, _which: faults.config(key, transport="nixl"),
        proxy_flags=("--stream",),
    ),
    Setup("kvflow zmq, no proxy", lambda key, _which: faults.config(key), direct=True),
    Setup(
        NIXL_CONNECTOR,
        nixl_connector,
        env=lambda: {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
        optional=True,
        # the producer let a request's blocks go before the consumer read them
        invalid_if=("Releasing expired KV blocks", "Potentially invalid KV blocks"),
    ),
)


@dataclass
class Sample:
    """One streamed request, timed by the client."""

    prompt: int
    repeat: int
    ttft_s: float = math.nan
    latency_s: float = math.nan
    tokens: int = 0
    text: str = ""
    error: str = ""
    sent: float = math.nan
    """When it was sent, and its first token came (`time.monotonic()`, the clock of
    kvflow's events)."""
    first: float = math.nan
    answered: float = math.nan
    """No proxy: when the prefill server's answer came."""
    id: str = ""
    """The answer's id (`cmpl-...`): the decode server's request id starts with it."""


@dataclass
class Opts:
    """The servers' command line and environment, common to every configuration."""

    model: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


class BenchPair(faults.Pair):
    """`faults.Pair` with this benchmark's model, arguments and connector: both servers
    start at once, then both are waited for (`restart` is not used here)."""

    def __init__(self, work: Path, setup: Setup, opts: Opts) -> None:
        self.setup, self.opts = setup, opts
        super().__init__(work)  # keygen, then `start` for prefill and decode
        try:
            self.prefill.wait_ready()
            self.decode.wait_ready()
            for server, core in ((self.prefill, 0), (self.decode, 1)):
                print(f"{setup.name}: {server.name}'s {pin(server, core)} threads on core {core}")
        except BaseException:
            self.close()
            raise

    def start(self, which: str, port: int = 0) -> ApiServer:
        assert self.setup.kv is not None
        core = "0" if which == "prefill" else "1"
        env = self.opts.env | self.setup.env()
        cfg = self.setup.kv(self.key, which)
        if cfg.get("kv_connector") == "KVFlowConnector":  # both servers' events: one log
            extra = cfg["kv_connector_extra_config"] | {"event_log": str(self.work / EVENTS)}
            cfg = cfg | {"kv_connector_extra_config": extra}
        return ApiServer(
            self.work, which, cfg, *self.opts.args, model=self.opts.model, cores=core, env=env
        )


def pin(server: ApiServer, core: int) -> int:
    """Every thread of `server`'s processes (the API server, its engine core, its worker)
    onto `core`; how many. `ApiServer(cores=)` binds its worker's compute threads only,
    and vLLM's engine core, which steps every millisecond while a request waits for
    remote KV, ran on the other server's core (bench_pd_stream.py's first run)."""
    procs, todo = [], [server.proc.pid]
    while todo:
        pid = todo.pop()
        procs.append(pid)
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids = task / "children"
            if kids.exists():
                todo += [int(c) for c in kids.read_text().split()]
    tids = [int(t.name) for pid in procs for t in Path(f"/proc/{pid}/task").iterdir()]
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, {core})
    return len(tids)


@contextlib.contextmanager
def deployment(setup: Setup, work: Path, opts: Opts) -> Iterator[tuple[int, list[ApiServer]]]:
    """`setup`'s servers (and proxy), fresh: the port that takes the requests (`direct`:
    the decode server's) and the servers, the one that computes the output tokens last
    (its metrics say where the prompt's KV came from). Everything started is shut down
    on the way out."""
    work.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        if setup.kv is None:
            env = opts.env | setup.env()
            one = ApiServer(work, "one", None, *opts.args, model=opts.model, cores="0-1", env=env)
            stack.callback(one.close)
            one.wait_ready()
            yield one.port, [one]
            return
        pair = BenchPair(work, setup, opts)
        stack.callback(pair.close)
        if setup.direct:
            yield pair.decode.port, [pair.prefill, pair.decode]
            return
        proxy = Proxy(pair.prefill, pair.decode, work / "proxy.log", *setup.proxy_flags)
        stack.callback(proxy.close)
        yield proxy.port, [pair.prefill, pair.decode]


def stream(
    port: int, model: str, prompt: list[int], sample: Sample, prefill_port: int = 0
) -> Sample:
    """Send one streamed completion of `prompt` to `port`, timing it into `sample`;
    `prefill_port`: first to that prefill server as `kvflow proxy` would, then to `port`
    with the params it answered."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_S)
    text: list[str] = []
    t0 = time.perf_counter()
    sample.sent = time.monotonic()
    try:
        headers = {"Content-Type": "application/json"}
        if prefill_port:
            pre = http.client.HTTPConnection("127.0.0.1", prefill_port, timeout=HANG_S)
            try:
                pre.request("POST", "/v1/completions", json.dumps(prefill_request(body)), headers)
                got = pre.getresponse()
                answer = got.read()
            finally:
                pre.close()
            sample.answered = time.monotonic()
            if got.status != 200:
                sample.error = f"prefill: HTTP {got.status}: {answer[:300]!r}"
                return sample
            doc = json.loads(answer)
            params = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
            body["kv_transfer_params"] = params  # None: the decode server computes it
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            sample.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return sample
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                sample.error = str(event["error"])[:300]
            if usage := event.get("usage"):
                sample.tokens = int(usage.get("completion_tokens", 0))
            for choice in event.get("choices") or []:
                if math.isnan(sample.ttft_s):
                    sample.ttft_s = time.perf_counter() - t0
                    sample.first, sample.id = time.monotonic(), str(event.get("id", ""))
                text.append(choice.get("text") or "")
        sample.latency_s = time.perf_counter() - t0
    except (OSError, ValueError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    sample.text = "".join(text)
    if not sample.error and math.isnan(sample.ttft_s):
        sample.error = "the stream carried no token"
    return sample


PARTS = (
    ("prefill", "sent", "offered"),
    *(s for s in SPANS if s[0] not in ("offer to first token", "pull past prefill")),
    ("to the client", "first token", "first"),
)
"""A P/D request's TTFT in consecutive parts, from the client's send to its first token,
on one clock: the client's marks (`sent`, `first`) and the request's kvflow timeline."""
DIRECT_PARTS = (
    PARTS[0],
    ("offer to answer", "offered", "answered"),
    ("answer to arrival", "answered", "arrived"),
    *PARTS[2:],
)
"""No proxy: offer to arrival cut where the client had the prefill server's answer (the
answer's way out of vLLM, then the decode request's way in)."""


def split(sample: Sample, lines: list[Timeline]) -> dict[str, float]:
    """`sample`'s TTFT in `PARTS` (`DIRECT_PARTS` without a proxy; a streamed request's
    two: the prefill and after it), seconds, or {} where its timeline lacks a stage."""
    found = [t for t in lines if sample.id and t.req.startswith(sample.id + "-")]
    if not found or sample.error:
        return {}
    t = found[0]
    if (done := t.first("prefill done")) is not None:  # streamed: the pull ran meanwhile
        return {"prefill": done - sample.sent, "after the prefill": sample.first - done}
    at = {"sent": sample.sent, "first": sample.first}
    parts = PARTS if math.isnan(sample.answered) else DIRECT_PARTS
    at["answered"] = sample.answered
    for stage in {a for _, a, _ in parts} | {b for _, _, b in parts}:
        if stage not in at and (ts := t.last(stage) if stage == "pull done" else t.first(stage)):
            at[stage] = ts
    if not all(a in at and b in at for _, a, b in parts):
        return {}
    return {name: at[b] - at[a] for name, a, b in parts}


def sources(server: ApiServer) -> dict[str, float]:
    """The server's prompt tokens by where their KV came from (`local_compute`,
    `external_kv_transfer`, ...), all prompt tokens, and kvflow's failed transfers."""
    out = {}
    for key, value in server.metrics().items():
        if key.startswith("vllm:prompt_tokens_by_source_total"):
            out[key.partition('source="')[2].rstrip('"}')] = value
        elif key in ("vllm:prompt_tokens_total", "vllm:kvflow_failures_total"):
            out[key] = value
    return out


def batch(
    port: int,
    model: str,
    prompts: list[list[int]],
    repeat: int,
    concurrency: int,
    prefill_port: int = 0,
) -> tuple[list[Sample], float]:
    """Every prompt once, `concurrency` in flight at once: the samples and the wall time."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        futures = [
            ex.submit(stream, port, model, p, Sample(i, repeat), prefill_port)
            for i, p in enumerate(prompts)
        ]
        samples = [f.result() for f in futures]
    return samples, time.perf_counter() - t0


def run_setup(
    setup: Setup, work: Path, opts: Opts, prompts: list[list[int]], repeat: int, concurrency: int
) -> dict[str, Any]:
    """One run of `setup` on fresh servers: its samples, wall time, output tok/s and
    where the decode server's prompt tokens came from."""
    warm = prompts[-1][::-1]  # a prompt of the same length, not timed
    with deployment(setup, work, opts) as (port, servers):
        decode = servers[-1]
        prefill = servers[0].port if setup.direct else 0
        first = stream(port, opts.model, warm, Sample(-1, repeat), prefill)
        if first.error:
            raise RuntimeError(f"the warm-up request failed: {first.error}")
        before = sources(decode)
        samples, wall = batch(port, opts.model, prompts, repeat, concurrency, prefill)
        want = before.get("vllm:prompt_tokens_total", 0.0) + sum(map(len, prompts))
        # vLLM publishes a step's stats after the step
        decode.metrics_once(lambda m: m.get("vllm:prompt_tokens_total", 0.0) >= want, 10)
        after = sources(decode)
        said = [
            line.strip()[-300:]
            for server in servers
            for line in server.log_text().splitlines()
            if any(mark in line for mark in setup.invalid_if)
        ]
    if said:
        raise RuntimeError(f"its servers logged {len(said)} line(s) like: {said[0]}")
    log = work / EVENTS
    lines = timelines(read_event_log(str(log))) if log.exists() else []
    return {
        "split": [split(s, lines) for s in samples] if lines else [],
        "repeat": repeat,
        "samples": samples,
        "wall_s": wall,
        "output_tok_s": sum(s.tokens for s in samples) / wall,
        "decode_prompt_tokens": {k: v - before.get(k, 0.0) for k, v in after.items()},
    }


def why(exc: BaseException) -> str:
    """What stopped a configuration: the exception's first line, and the server log's
    last line naming an error."""
    text = str(exc)
    head = text.splitlines()[0] if text else type(exc).__name__
    named = [ln.strip() for ln in text.splitlines()[1:] if "error" in ln.lower()]
    return f"{head}: {named[-1][-400:]}" if named else head


def stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    p90 = statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]
    return {"median": statistics.median(xs), "p90": p90, "n": len(xs)}


def summarise(
    name: str, runs: list[dict[str, Any]], want: dict[int, str], prompt_tokens: int
) -> dict[str, Any]:
    """A configuration's figures over its runs; every answer checked against `want`."""
    samples: list[Sample] = [s for run in runs for s in run["samples"]]
    good = [s for s in samples if not s.error]
    mismatches = [
        {"prompt": s.prompt, "repeat": s.repeat, "got": s.text, "want": want[s.prompt]}
        for s in good
        if s.text != want[s.prompt]
    ]
    computed = sum(run["decode_prompt_tokens"].get("local_compute", 0.0) for run in runs)
    keep = ("prompt", "repeat", "ttft_s", "latency_s", "tokens", "error")

    def row(s: Sample) -> dict[str, Any]:
        return {k: v for k, v in asdict(s).items() if k in keep}

    return {
        "split": split_figures(runs, good),
        "ttft_s": stats([s.ttft_s for s in good]),
        "latency_s": stats([s.latency_s for s in good]),
        "output_tok_s": statistics.median(run["output_tok_s"] for run in runs),
        "mismatches": mismatches,
        "errors": [
            {"prompt": s.prompt, "repeat": s.repeat, "error": s.error} for s in samples if s.error
        ],
        # a P/D decode server computes a few tokens of each prompt, not half of them
        "fell_back": name != ONE and computed > 0.5 * len(samples) * prompt_tokens,
        "runs": [
            {k: v for k, v in run.items() if k != "samples"}
            | {"samples": [row(s) for s in run["samples"]]}
            for run in runs
        ],
    }


GOAL_SLACK_S = 0.010
"""Issue 49's goal: what P/D adds over the prefill is at most the pull, one decode step
and this."""


def split_figures(runs: list[dict[str, Any]], good: list[Sample]) -> dict[str, Any]:
    """The medians of each part of TTFT over the requests with a whole timeline; what P/D
    added over the prefill (all parts after it) against the goal: the pull, one decode
    step (TPOT, this configuration's median) and `GOAL_SLACK_S`."""
    splits = [d for run in runs for d in run.get("split", []) if d]
    if not splits:
        return {}
    names = list(splits[0])  # PARTS, DIRECT_PARTS, or a streamed request's two
    med = {name: statistics.median(d[name] for d in splits if name in d) for name in names}
    added = statistics.median(sum(v for k, v in d.items() if k != "prefill") for d in splits)
    tpot = statistics.median(
        (s.latency_s - s.ttft_s) / (s.tokens - 1) for s in good if s.tokens > 1
    )
    goal = med.get("pull", 0.0) + tpot + GOAL_SLACK_S  # streamed: none of the pull is after
    return {"n": len(splits), "median_s": med, "added_s": added, "tpot_s": tpot, "goal_s": goal}


def ratios(figures: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each configuration's median TTFT and latency over `one server`'s and over vLLM
    NixlConnector's (where it ran)."""
    out: dict[str, dict[str, float]] = {}
    for name, f in figures.items():
        if "skipped" in f or not f["ttft_s"]:
            continue
        out[name] = {}
        for base, tag in ((ONE, "one_server"), (NIXL_CONNECTOR, "nixl_connector")):
            b = figures.get(base, {})
            if "skipped" in b or not b.get("ttft_s"):
                continue
            for what in ("ttft_s", "latency_s"):
                out[name][f"{what[:-2]}_vs_{tag}"] = f[what]["median"] / b[what]["median"]
    return out


def table(figures: dict[str, Any], rel: dict[str, dict[str, float]]) -> str:
    cols = ["configuration", "TTFT p50", "TTFT p90", "latency p50", "latency p90", "out tok/s"]
    cols += ["TTFT/one", "lat/one", "TTFT/NixlC", "lat/NixlC", "wrong", "errors"]
    rows = [cols]
    for name, f in figures.items():
        if "skipped" in f:
            rows.append([name, f"skipped: {f['skipped'][:120]}"])
            continue
        r = rel.get(name, {})
        t, lat = f["ttft_s"], f["latency_s"]
        row = [name + (" (fell back)" if f["fell_back"] else "")]
        row += [f"{1e3 * x:.0f} ms" for x in (t["median"], t["p90"], lat["median"], lat["p90"])]
        row.append(f"{f['output_tok_s']:.1f}")
        for key in ("ttft_vs_one_server", "latency_vs_one_server"):
            row.append(f"{r[key]:.2f}x" if key in r else "-")
        for key in ("ttft_vs_nixl_connector", "latency_vs_nixl_connector"):
            row.append(f"{r[key]:.2f}x" if key in r else "-")
        row += [str(len(f["mismatches"])), str(len(f["errors"]))]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows if len(row) > 2) for i in range(len(cols))]
    lines = []
    for line in rows:
        if len(line) == 2:
            lines.append(f"{line[0]:<{widths[0]}}  {line[1]}")
        else:
            cells = [line[0].ljust(widths[0])]
            cells += [c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)]
            lines.append("  ".join(cells))
    return "\n".join(lines)


def server_opts(prompt_tokens: int, concurrency: int) -> Opts:
    """bench-llama's server arguments: room for a prompt and its output, KV space for
    twice the tokens in flight, vLLM's prefix cache off."""
    model = model_dir(MODEL)
    cfg = json.loads((Path(model) / "config.json").read_text())
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    if prompt_tokens + MAX_TOKENS > cfg["max_position_embeddings"]:
        raise SystemExit(f"{MODEL} holds at most {cfg['max_position_embeddings']} tokens")
    gib = max(1, math.ceil(2 * concurrency * (prompt_tokens + MAX_TOKENS) * per_token / 2**30))
    args = ["--no-enable-prefix-caching", "--max-model-len", str(prompt_tokens + MAX_TOKENS)]
    return Opts(model, args, {"VLLM_CPU_KVCACHE_SPACE": str(gib)})


def run_all(
    args: argparse.Namespace, setups: list[Setup], prompts: list[list[int]], work: Path
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str], list[list[str]]]:
    """Every configuration `args.repeats` times, the order reversed every other repeat:
    the runs by configuration, the skipped ones with why, the orders run."""
    opts = server_opts(len(prompts[0]), args.concurrency)
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in setups}
    skipped: dict[str, str] = {}
    orders = []
    for r in range(args.repeats):
        order = setups if r % 2 == 0 else setups[::-1]
        orders.append([s.name for s in order if s.name not in skipped])
        for setup in order:
            if setup.name in skipped:
                continue
            print(f"repeat {r + 1}/{args.repeats}: {setup.name} ...", flush=True)
            where = work / f"{setup.name.replace(' ', '-')}-r{r}"
            try:
                run = run_setup(setup, where, opts, prompts, r, args.concurrency)
            except (RuntimeError, TimeoutError) as exc:
                if not setup.optional:
                    raise
                skipped[setup.name] = why(exc)
                print(f"  skipped: {skipped[setup.name]}", flush=True)
                continue
            failed = [s.error for s in run["samples"] if s.error]
            if setup.optional and failed:
                failed_n = f"{len(failed)} of {len(prompts)} requests failed"
                skipped[setup.name] = f"{failed_n}: {failed[0]}"
                print(f"  skipped: {skipped[setup.name]}", flush=True)
                continue
            t = [s.ttft_s for s in run["samples"] if not s.error]
            print(f"  median TTFT {1e3 * statistics.median(t):.0f} ms, "
                  f"{run['output_tok_s']:.1f} output tok/s", flush=True)  # fmt: skip
            runs[setup.name].append(run)
    return runs, skipped, orders


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, help="prompts per run (default 16, --quick 8)")
    ap.add_argument("--prompt-tokens", type=int, help="(default 1024, --quick 512)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each configuration")
    ap.add_argument("--quick", action="store_true", help="8 requests of 512 tokens")
    ap.add_argument("--only", default="", help="comma-separated configurations (+ one server)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pd-serve.json"))
    args = ap.parse_args()
    meta = record.start()
    n = args.requests or (8 if args.quick else 16)
    length = args.prompt_tokens or (512 if args.quick else 1024)
    only = {o.strip() for o in args.only.split(",") if o.strip()}
    if unknown := only - {s.name for s in SETUPS}:
        ap.error(f"unknown configuration(s) {unknown}; valid: {[s.name for s in SETUPS]}")
    setups = [s for s in SETUPS if not only or s.name in only or s.name == ONE]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(n)]  # vocab 1024
    work = Path(tempfile.mkdtemp(prefix="kvflow-pd-serve-"))
    t0 = time.monotonic()
    runs, skipped, orders = run_all(args, setups, prompts, work)
    want = {s.prompt: s.text for s in runs[ONE][0]["samples"]}
    figures: dict[str, Any] = {}
    for s in setups:
        figures[s.name] = (
            {"skipped": skipped[s.name]}
            if s.name in skipped
            else summarise(s.name, runs[s.name], want, length)
        )
    rel = ratios(figures)
    data = {
        "model": MODEL,
        "requests": n,
        "prompt_tokens": length,
        "max_tokens": MAX_TOKENS,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "prefix_caching": False,
        "orders": orders,
        "wall_s": time.monotonic() - t0,
        "configs": figures,
        "ratios": rel,
    }
    record.save(args.out, data, meta, extra=EXTRA_SOURCES)
    shutil.rmtree(work, ignore_errors=True)
    print(table(figures, rel))
    for name, f in figures.items():
        if sp := f.get("split"):
            parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sp["median_s"].items())
            print(f"{name}: TTFT's parts (median ms, {sp['n']} requests): {parts}; added "
                  f"over the prefill {1e3 * sp['added_s']:.1f} ms, goal "
                  f"{1e3 * sp['goal_s']:.1f} ms")  # fmt: skip
    print(f"wrote {args.out}")
    bad = any(f.get("mismatches") or f.get("errors") for f in figures.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
