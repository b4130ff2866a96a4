"""Soak kvflow in one real vLLM engine: many requests with shared prefixes, a small
KV cache (preemptions), client aborts, and faults injected into the `fs` store while
it runs (chunk files truncated, corrupted, deleted; the whole store deleted).

    python scripts/soak.py --requests 1000

Prints requests, faults (only those that hit something), kvflow's loads (from its event
log: what kvflow, not vLLM's own prefix cache, served), wrong tokens, request errors,
leaked blocks and hangs, and exits non-zero if any request got wrong tokens, hung, or a
block was leaked. Under
policy `recompute` (the default) no request may fail; under `--policy fail` a load
that fails is a request error, counted apart. References are each prompt's tokens
from an engine without a connector, in a process of its own. The engine runs in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so the script can read vLLM's block pool.

    python scripts/soak.py --suite     # the four runs of docs/reliability.md's table

`--suite` runs the soak once per configuration of `SUITE`, each in a process of its
own, and writes bench/results/soak.json (bench/record.py: commit, command, machine,
date, every earlier run); `python bench/run.py --render` renders the table from it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

MAX_TOKENS = 8
ABORT_WITHIN = 40
"""An aborted request's client goes away within this many engine steps of sending it."""
HANG_S = 120.0
"""A request unanswered this long is a hang (and is aborted)."""
FAULTS = ("truncate", "corrupt", "delete-chunk", "delete-store")
ROOT = Path(__file__).resolve().parents[1]
SUITE = (
    [],
    ["--policy", "fail"],
    ["--no-prefix-caching"],
    ["--policy", "fail", "--no-prefix-caching"],
)
"""The configurations `--suite` runs (arguments added to `--requests N`)."""


def prompts(rng: random.Random, unique: int) -> list[list[int]]:
    """`unique` prompts over a few shared prefixes (a system prompt, a document)."""
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randrange(40, 300))] for _ in range(6)]
    return [
        rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 200))]
        for _ in range(unique)
    ]


def references(work: Path, ps: list[list[int]], cache: Path | None) -> list[list[int]]:
    """What an engine without kvflow generates for `ps`; kept in `cache` (a JSON file,
    keyed by the prompts) so that runs over the same prompts start that engine once."""
    from kvflow_vllm.engine_process import Scenario, spawn_engine

    key = hashlib.sha256(json.dumps(ps).encode()).hexdigest()
    known = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    if key not in known:
        result = spawn_engine(work, "reference", Scenario(batches=[ps], connector=False))
        known[key] = [r.tokens for r in result.batches[0]]
        if cache is not None:
            cache.write_text(json.dumps(known))
    return [list(tokens) for tokens in known[key]]


def inject(rng: random.Random, store: Path) -> str:
    """One fault in the store; returns what it was ("" if there was nothing to hit)."""
    files = sorted(store.rglob("*.kv")) if store.exists() else []
    kind = rng.choice(FAULTS)
    if kind == "delete-store":
        if not store.exists():  # deleted before and nothing saved since: no fault
            return ""
        # the path goes at once; saves racing us land in the old tree
        gone = store.rename(store.with_name(f"{store.name}.deleted.{rng.random()}"))
        shutil.rmtree(gone, ignore_errors=True)
        return kind
    if not files:
        return ""
    victim = rng.choice(files)
    try:
        if kind == "truncate":
            with open(victim, "r+b") as f:
                f.truncate(rng.randrange(victim.stat().st_size))
        elif kind == "corrupt":
            data = bytearray(victim.read_bytes())
            data[rng.randrange(len(data))] ^= 0xFF
            victim.write_bytes(bytes(data))
        else:
            victim.unlink()
    except FileNotFoundError:  # evicted or replaced meanwhile
        return ""
    return kind


class Soak:
    def __init__(self, args: argparse.Namespace, store: Path) -> None:
        from kvflow_vllm.engine_process import make_llm

        self.args = args
        self.rng = random.Random(args.seed)
        self.store = store
        self.llm = make_llm(
            extra_config={
                "transport": "fs",
                "options": {"path": str(store)},
                "event_log": str(args.event_log),
                "load_mode": args.load_mode,
            },
            failure_policy=args.policy,
            prefix_caching=not args.no_prefix_caching,
            num_gpu_blocks_override=args.blocks,
            max_model_len=512,  # prompts are shorter; a small cache still holds one
            max_num_seqs=16,
        )
        self.engine = self.llm.llm_engine
        self.count: Counter[str] = Counter()
        self.in_flight: dict[str, tuple[int, float]] = {}

    def run(self, ps: list[list[int]], want: list[list[int]]) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        sent = 0
        abort_at: dict[str, int] = {}  # request -> the step its client goes away at
        step = 0
        while sent < self.args.requests or self.in_flight:
            while sent < self.args.requests and len(self.in_flight) < 16:
                i = self.rng.randrange(len(ps))
                rid = f"soak-{sent}"
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=ps[i]), params)
                self.in_flight[rid] = (i, time.monotonic())
                if self.rng.random() < self.args.abort_rate:
                    abort_at[rid] = step + self.rng.randrange(1, ABORT_WITHIN)
                sent += 1
            step += 1
            for rid in [r for r, at in abort_at.items() if at <= step]:
                del abort_at[rid]
                if self.in_flight.pop(rid, None) is not None:  # not finished meanwhile
                    self.engine.abort_request([rid])
                    self.count["aborted"] += 1
            if self.rng.random() < self.args.fault_rate and (kind := inject(self.rng, self.store)):
                self.count[f"fault:{kind}"] += 1
            for out in self.engine.step():
                if out.finished and out.request_id in self.in_flight:
                    self.finish(out, want)
            for rid, (_, since) in list(self.in_flight.items()):
                if time.monotonic() - since > HANG_S:
                    self.engine.abort_request([rid])
                    del self.in_flight[rid]
                    self.count["hangs"] += 1

    def finish(self, out: Any, want: list[list[int]]) -> None:
        i, _ = self.in_flight.pop(out.request_id)
        c = out.outputs[0]
        if c.finish_reason not in ("length", "stop"):
            self.count["request errors"] += 1
        elif list(c.token_ids) != want[i]:
            self.count["wrong tokens"] += 1
            print(f"wrong tokens: {out.request_id} (prompt {i}): {list(c.token_ids)} != {want[i]}")
        else:
            self.count["right"] += 1

    def leaked_blocks(self) -> int:
        """Blocks not free once every request ended and kvflow released what it held."""
        core = self.engine.engine_core.engine_core
        deadline = time.monotonic() + 60
        while core.scheduler.has_requests() and time.monotonic() < deadline:
            core.step()  # vLLM steps while finished requests wait for kvflow's saves
        pool = core.scheduler.kv_cache_manager.block_pool
        return int(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())  # 1: the null block

    def preemptions(self) -> int:
        m = {x.name: x for x in self.llm.get_metrics()}
        total = m.get("vllm:num_preemptions")
        return int(getattr(total, "value", 0)) if total is not None else -1


def kvflow_loads(event_log: Path) -> dict[str, int]:
    """kvflow's loads in its event log: done (chunks and bytes) and failed."""
    from kvflow.observe.events import LookupAnswered, TransferDone, TransferFailed
    from kvflow.observe.log import read_event_log

    out = Counter({"done": 0, "chunks": 0, "bytes": 0, "failed": 0})
    out.update(lookups=0, lookup_errors=0)
    for e in read_event_log(str(event_log)):
        if isinstance(e, LookupAnswered):
            out.update(lookups=1, lookup_errors=int(bool(e.error)))
        elif isinstance(e, TransferDone) and e.direction == "load" and e.what == "kv":
            out.update(done=1, chunks=e.chunks, bytes=e.nbytes)
        elif isinstance(e, TransferFailed) and e.direction == "load" and e.what == "kv":
            out.update(failed=1)
    return dict(out)


def suite(requests: int, out: Path) -> int:
    """Each configuration of SUITE in a process of its own; their reports into `out`."""
    sys.path.insert(0, str(ROOT / "bench"))
    import record

    meta = record.start()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvflow-soak-suite-") as tmp:
        refs = Path(tmp) / "references.json"
        for i, extra in enumerate(SUITE):
            report = Path(tmp) / f"{i}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--requests", str(requests)]
            cmd += [*extra, "--references", str(refs), "--report", str(report)]
            print(f"== soak {' '.join(extra) or '(defaults)'}", flush=True)
            rc = subprocess.run(cmd, cwd=ROOT).returncode
            got = json.loads(report.read_text()) if report.exists() else {}  # died before it
            rows.append({"args": extra, "exit": rc, **got})
    extra_sources = ("kvflow", "plugins/kvflow_vllm", "transports/kvflow_fs", "scripts/soak.py")
    record.save(out, {"requests": requests, "rows": rows}, meta, extra_sources)
    print(f"wrote {out}")
    return 1 if any(r["exit"] for r in rows) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--unique", type=int, default=60, help="distinct prompts")
    ap.add_argument("--policy", choices=["recompute", "fail"], default="recompute")
    ap.add_argument("--blocks", type=int, default=64, help="vLLM's KV cache, in blocks of 32")
    ap.add_argument("--abort-rate", type=float, default=0.03, help="share of requests")
    ap.add_argument("--fault-rate", type=float, default=0.03, help="per engine step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-mode", choices=["layer", "async"], default="layer")
    ap.add_argument("--no-prefix-caching", action="store_true", help="vLLM's own prefix cache off")
    ap.add_argument("--store", type=Path, default=None, help="default: a temporary directory")
    ap.add_argument("--event-log", type=Path, default=None, help="kvflow's event log (JSONL)")
    ap.add_argument("--report", type=Path, default=None, help="this run's counts, as JSON")
    ap.add_argument("--suite", action="store_true", help="every configuration of SUITE")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    ap.add_argument(
        "--references", type=Path, default=None,
        help="a JSON file keeping the connector-less engine's tokens across runs",
    )  # fmt: skip
    args = ap.parse_args()
    if args.suite:
        return suite(args.requests, args.out)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    work = Path(tempfile.mkdtemp(prefix="kvflow-soak-"))
    store = args.store or work / "kv"
    args.event_log = args.event_log or work / "events.jsonl"
    ps = prompts(random.Random(args.seed), args.unique)
    want = references(work, ps, args.references)
    t0 = time.monotonic()
    soak = Soak(args, store)
    soak.run(ps, want)
    leaked = soak.leaked_blocks()
    preemptions = soak.preemptions()
    soak.engine.engine_core.shutdown()  # kvflow's event log is whole once it is closed
    c = soak.count
    faults = {k[6:]: n for k, n in sorted(c.items()) if k.startswith("fault:")}
    report = {
        "requests": args.requests,
        "right": c["right"],
        "aborted": c["aborted"],
        "faults": faults,
        "preemptions": preemptions,
        "kvflow_loads": kvflow_loads(args.event_log),
        "wrong_tokens": c["wrong tokens"],
        "request_errors": c["request errors"],
        "policy": args.policy,
        "leaked_blocks": leaked,
        "hangs": c["hangs"],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print_report(report)
    if args.report:
        args.report.write_text(json.dumps(report))
    shutil.rmtree(work, ignore_errors=True)
    bad = c["wrong tokens"] or c["hangs"] or leaked
    bad = bad or (args.policy == "recompute" and c["request errors"])
    return 1 if bad else 0


def print_report(r: dict[str, Any]) -> None:
    kinds = ", ".join(f"{k} {n}" for k, n in r["faults"].items())
    loads = r["kvflow_loads"]
    print(f"requests        {r['requests']} ({r['right']} right, {r['aborted']} aborted)")
    print(f"faults          {sum(r['faults'].values())} ({kinds or 'none'})")
    print(f"preemptions     {r['preemptions']}")
    print(f"kvflow loads    {loads['done']} ({loads['chunks']} chunks), {loads['failed']} failed")
    looked = loads.get("lookups", 0)  # older reports have no lookups
    print(f"lookups         {looked} answered, {loads.get('lookup_errors', 0)} failed or late")
    print(f"wrong tokens    {r['wrong_tokens']}")
    print(f"request errors  {r['request_errors']} (policy {r['policy']})")
    print(f"leaked blocks   {r['leaked_blocks']}")
    print(f"hangs           {r['hangs']}")
    print(f"wall            {r['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
