"""Run every benchmark, write bench/results/*.json, regenerate the docs' tables.

    python bench/run.py            # everything: about 90 min on 2 cores, and `faults`
                                   # (its time is under its table in docs/reliability.md)
    python bench/run.py --quick    # smaller workloads, fewer repeats
    python bench/run.py --only fs-io,hooks --no-docs
    python bench/run.py --render   # no benchmark: the tables and plots from the files

Each benchmark runs in its own process, one after another (never two at once: they
would measure each other). Each prints ratios against a baseline measured in the same
run, alternating, with medians; see each script's docstring for its method. Each
writes its results file with what produced it (`bench/record.py`: commit, command,
machine, date, the files it ran, its earlier runs). Every table of README.md and
docs/*.md between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` is then rendered
from its file, captioned with that record and, where the code it measured has changed
since its commit, saying so; the plots in docs/img/ are redrawn (bench/plots.py, if
matplotlib is installed). tests/project/test_bench_docs.py fails when a table and its file
disagree. A benchmark that needs what this machine lacks (a GPU for `cuda-ipc`) is
skipped, saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import record  # noqa: E402

RESULTS = HERE / "results"
ROOT = HERE.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
"""The pages whose `<!-- bench:NAME -->` tables are rendered from the results files."""
TRACES = HERE / "traces"
"""Prefix traces `bench_tier.py` replays besides its own (not in git: Mooncake's, see
docs/benchmarks.md)."""


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def _trace_args() -> list[str]:
    traces = sorted(TRACES.glob("*.jsonl"))  # relative: the scripts run in the repository
    return [a for t in traces for a in ("--trace", str(t.relative_to(HERE.parent)))]


# name: (script and its arguments, whether --quick applies, what it needs)
BENCHES: dict[str, tuple[list[str], bool, Callable[[], str]]] = {
    "fs-io": (["bench_fs_io.py"], True, lambda: ""),
    "fs-store-key": (["bench_fs_io.py", "--store-key"], True, lambda: ""),
    "hooks": (["bench_hooks.py"], False, lambda: ""),
    "reshape": (["bench_reshape.py"], True, lambda: ""),
    "convert": (["bench_convert.py"], True, lambda: ""),
    "tier": (["bench_tier.py", *_trace_args()], True, lambda: ""),
    "engines": (["bench_engines.py"], True, lambda: ""),
    "zmq": (["bench_zmq.py"], True, lambda: ""),
    "zmq-channels": (["bench_zmq.py", "--channels"], True, lambda: ""),
    "nixl": (["bench_nixl.py"], True, lambda: ""),
    "nixl-layerwise": (
        ["bench_nixl.py", "--layerwise", "--out", str(RESULTS / "nixl-layerwise.json")],
        True,
        lambda: "",
    ),
    "ttft-tiers": (
        ["bench_ttft_tiers.py"],
        True,
        lambda: "" if shutil.which("redis-server") else "redis-server is not installed",
    ),
    "redis": (
        ["../plugins/kvflow_redis/bench/bench_redis.py"],
        True,
        lambda: "" if shutil.which("redis-server") else "redis-server is not installed",
    ),
    "pd-serve": (["bench_pd_serve.py"], True, lambda: ""),
    "pd-stream": (["bench_pd_stream.py"], True, lambda: ""),
    "sched-scale": (["bench_sched_scale.py"], True, lambda: ""),
    "tier-scale": (["bench_tier_scale.py"], True, lambda: ""),
    "fs-scale": (["bench_fs_scale.py"], True, lambda: ""),
    "fs-evict": (["bench_fs_evict.py"], True, lambda: ""),
    "fs-shared": (["bench_fs_shared.py"], True, lambda: ""),
    "pd-scale": (["bench_pd_scale.py"], True, lambda: ""),
    "route": (["bench_route.py"], True, lambda: ""),
    "proxy": (["bench_proxy.py", "--against", "37a1fed"], True, lambda: ""),
    "soak": (["../scripts/soak.py", "--suite"], False, lambda: ""),
    "soak-pd": (
        ["../scripts/soak_pd.py", "--out", str(RESULTS / "soak-pd.json")],
        False,
        lambda: "",
    ),
    "faults": (
        ["../scripts/faults.py"],
        False,
        lambda: (
            "the store rows mount tmpfs: run as root"
            if os.geteuid() != 0
            else ""
            if shutil.which("redis-server")
            else "redis-server is not installed"
        ),
    ),
    "tests": (["bench_tests.py"], False, lambda: ""),
    "compatibility": (["bench_compat.py"], False, lambda: ""),
    "cuda-ipc": (
        ["bench_cuda_ipc.py"],
        True,
        lambda: "" if _has_cuda() else "no CUDA device on this machine",
    ),
    "cuda-ipc-layerwise": (
        ["bench_cuda_ipc.py", "--layerwise"],
        True,
        lambda: "" if _has_cuda() else "no CUDA device on this machine",
    ),
    "staging-cuda": (
        ["bench_staging_cuda.py"],
        True,
        lambda: "" if _has_cuda() else "no CUDA device on this machine",
    ),
}


# -- tables --------------------------------------------------------------------------------


def _table(head: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """A markdown table: its first `left` columns aligned left, the others right."""
    align = ["---"] * left + ["---:"] * (len(head) - left)
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def fs_io_table(d: dict[str, Any]) -> list[str]:
    from plots import fs_io_ratio  # matplotlib's import, only when rendering

    ops = (("save", "plain save"), ("layer load", "plain load"), ("file load", "plain load"))
    ops += (("layer load, first read", "plain load, first read"),)  # since 2026-11-30
    rows = []
    for name, case in d["cases"].items():
        g = case["gbs"]
        for op, base in (o for o in ops if o[1] in g):
            cells = [f"{name}, {case['mib']:.0f} MiB, {case['files']} files", op, f"{g[base]:.2f}"]
            for side in ("kvflow", "kvflow 1 thread", "kvflow unverified"):
                v = g.get(f"{side} {op}")  # runs before 2026-11-29 had no unverified side
                cells.append("" if v is None else f"{v:.2f} ({fs_io_ratio(case, side, op):.2f}x)")
            rows.append(cells)
    head = ["KV", "operation", "plain GB/s", "kvflow GB/s (x plain)", "kvflow 1 thread"]
    head += ["kvflow, verify off"]
    note = "medians"
    if all("ratios" in case for case in d["cases"].values()):
        note += "; a load's ratio is the median of its ratios to the plain load timed next to it"
    return [*_table(head, rows), "", f"_{note}_"]


def fs_store_key_table(d: dict[str, Any]) -> list[str]:
    rows = []
    for name, case in d["cases"].items():
        g = case["gbs"]
        for op in ("save", "layer load", "file load"):
            kv = f"{name}, {case['mib']:.0f} MiB, {case['files']} files"
            unkeyed, keyed, auto = g[f"unkeyed {op}"], g[f"keyed {op}"], g[f"keyed AUTO {op}"]
            rows.append(
                [
                    kv,
                    op,
                    f"{unkeyed:.2f}",
                    f"{keyed:.2f}",
                    f"{keyed / unkeyed:.2f}x",
                    f"{auto:.2f} ({auto / unkeyed:.2f}x)",
                ]
            )
    head = [
        "KV",
        "operation",
        "unkeyed GB/s",
        "keyed GB/s",
        "keyed / unkeyed",
        "keyed, BLAKE3 `AUTO` threads GB/s (x unkeyed)",
    ]
    before, after = d["loadavg_before"], d["loadavg_after"]
    note = (
        f"medians of {d['repeats']} after a warm-up, `threads: {d['threads']}`; load average "
        f"(1, 5, 15 min) {', '.join(map(str, before))} before the run and "
        f"{', '.join(map(str, after))} after: the machine's cores were shared"
    )
    return [*_table(head, rows), "", f"_{note}_"]


def fs_store_key_hashes_table(d: dict[str, Any]) -> list[str]:
    """bench_fs_io.py --store-key: each layer hash alone, in one thread and two at once."""
    rows = []
    for name, case in d["cases"].items():
        for hash_, gbs in case["hashes"].items():
            one, two = gbs["1 thread"], gbs["2 threads"]
            rows.append([name, hash_, f"{one:.2f}", f"{two:.2f} ({two / one:.2f}x)"])
    head = ["KV", "layer hash", "1 thread GB/s", "2 threads at once GB/s (x 1 thread)"]
    layer = next(iter(d["cases"].values()))["layer_mib"]
    note = (
        f"over the request's layers, {layer:g} MiB each (most not in the CPU's cache); medians "
        f"of 5 rounds of 0.2 s, every hash in turn; {d['cores']} cores, shared (the load "
        "average above)"
    )
    return [*_table(head, rows, left=2), "", f"_{note}_"]


def reshape_table(d: dict[str, Any]) -> list[str]:
    head = ["KV layout", "load", "own size GB/s", "another size GB/s", "another / own"]
    keys = ("own", "reshaped", "ratio")
    rows = [[r["kind"], r["direction"], *(f"{r[k]:.2f}" for k in keys)] for r in d["rows"]]
    return _table(head, rows)


def convert_table(d: dict[str, Any]) -> list[str]:
    head = ["transport", "pull", "same shape GB/s", "converted GB/s", "converted / same"]
    keys = ("same", "converted", "ratio")
    rows = [[r["transport"], r["case"], *(f"{r[k]:.2f}" for k in keys)] for r in d["rows"]]
    return _table(head, rows)


def tier_policy_table(d: dict[str, Any]) -> list[str]:
    head = ["trace", "cache (share of its chunks)", "LRU hit ratio", "S3-FIFO hit ratio"]
    rows = [
        [r["trace"], f"{r['share']:.0%} ({r['slots']})", f"{r['lru']:.3f}", f"{r['s3fifo']:.3f}"]
        for r in d["policy"]
    ]
    return _table(head, rows)


def tier_load_table(d: dict[str, Any]) -> list[str]:
    r = d["load"]
    head = ["load of 128 MiB", "GB/s", "/ plain copy"]
    rows = [
        ["from the host tier", f"{r['tier']:.2f}", f"{r['ratio']:.2f}"],
        ["plain copy of the same bytes", f"{r['copy']:.2f}", "1.00"],
    ]
    return _table(head, rows)


def hooks_table(d: dict[str, Any]) -> list[str]:
    return _table(["hook", "us per call"], [[k, f"{v:.2f}"] for k, v in d["hot_path_us"].items()])


def miss_table(d: dict[str, Any]) -> list[str]:
    m = d["miss"]
    base = m["no-op connector"]
    rows = []
    for e, v in m.items():
        p, dec = v["prefill"], v["decode"]
        rows.append([e, f"{p:.0f}", f"{p / base['prefill']:.3f}", f"{dec:.1f}"])
        rows[-1].append(f"{dec / base['decode']:.3f}")
    return _table(["engine", "prefill tok/s", "/ no-op", "decode tok/s", "/ no-op"], rows)


def hit_table(d: dict[str, Any]) -> list[str]:
    t, g = d["hit"]["ttft_ms"], d["hit"]["effective_gbs"]
    order = ["no connector", "ExampleConnector", "kvflow", "kvflow layer", "kvflow cpu tier"]
    engines = [e for e in order if e in next(iter(t.values()))]
    head = ["prompt"] + [f"{'recompute' if e == 'no connector' else e} TTFT ms" for e in engines]
    head += ["kvflow GB/s", "ExampleConnector GB/s"]
    rows = []
    for label, by in t.items():
        gbs = g.get(label, {})
        cells = [label] + [f"{by[e]:.1f}" for e in engines]
        cells += [f"{gbs[e]:.2f}" if e in gbs else "-" for e in ("kvflow", "ExampleConnector")]
        rows.append(cells)
    whole = [label for label in t if label in g and "no connector" in t[label]]
    faster = {
        base: " / ".join(f"{t[w][base] / t[w]['kvflow']:.1f}x" for w in whole)
        for base in ("no connector", "ExampleConnector")
        if all(base in t[w] for w in whole)
    }
    note = f"kvflow's TTFT on the prompts stored whole ({', '.join(whole)}): "
    note += "; ".join(
        f"{'recompute' if b == 'no connector' else b} / kvflow {r}" for b, r in faster.items()
    )
    return [*_table(head, rows), "", f"_{note}_"]


def zmq_table(d: dict[str, Any]) -> list[str]:
    head = ["config", "MiB", "kvflow GB/s", "plain pyzmq GB/s", "kvflow / plain"]
    keys = ("kvflow_gbs", "plain_gbs", "ratio")
    rows = [
        [r["config"], f"{r['total_bytes'] / 2**20:.0f}", *(f"{r[k]:.2f}" for k in keys)]
        for r in d["table"]
    ]
    return _table(head, rows)


def zmq_channels_table(d: dict[str, Any]) -> list[str]:
    head = ["config", "MiB", "keyless GB/s", "authenticated GB/s", "authenticated / keyless"]
    head += ["encrypted GB/s", "encrypted / keyless"]
    rows = [
        [
            r["config"],
            f"{r['total_bytes'] / 2**20:.0f}",
            f"{r['keyless_gbs']:.2f}",
            f"{r['authenticated_gbs']:.2f}",
            f"{r['authenticated_ratio']:.3f}",
            f"{r['encrypted_gbs']:.2f}",
            f"{r['encrypted_ratio']:.3f}",
        ]
        for r in d["table"]
    ]
    return _table(head, rows)


def zmq_micro_table(d: dict[str, Any]) -> list[str]:
    return _table(["what", "us per call"], [[k, f"{v:.2f}"] for k, v in d["micro_us"].items()])


def nixl_table(d: dict[str, Any]) -> list[str]:
    head = ["config", "MB", "raw NIXL GB/s", "kvflow nixl GB/s", "nixl / raw"]
    head += ["kvflow zmq GB/s", "nixl / zmq"]
    keys = ("raw_gbs", "nixl_gbs", "nixl_over_raw", "zmq_gbs", "nixl_over_zmq")
    rows = [
        [r["config"], f"{r['total_bytes'] / 1e6:.0f}", *(f"{r[k]:.2f}" for k in keys)]
        for r in d["table"]
    ]
    return _table(head, rows)


def redis_table(d: dict[str, Any]) -> list[str]:
    med = statistics.median
    c, t, k = d["client"], d["transport"], d["cluster"]
    one_mib, request = 64 << 20, 128 << 20  # 64 x 1 MiB values; 64 chunks x 2 MiB

    def row(what: str, nbytes: int, new: list[float], old: list[float]) -> list[str]:
        return [what, f"{nbytes / med(new) / 1e9:.2f}", f"{nbytes / med(old) / 1e9:.2f}",
                f"{med(old) / med(new):.2f}x"]  # fmt: skip

    rows = [
        row("SET x 64, pipelined", one_mib, c["coredis SET"], c["old SET"]),
        row("MGET of 64", one_mib, c["coredis MGET"], c["old MGET"]),
        row("MGET (old: GET into buffers)", one_mib, c["coredis MGET"], c["old GET into buffers"]),
        row("transport save, 128 MiB", request, t["coredis save"], t["old save"]),
        row("transport load, 128 MiB, verified", request, t["coredis load"], t["old load"]),
    ]
    first = [
        "first layer signalled (ms)",
        f"{med(t['coredis first layer']) * 1e3:.0f}",
        f"{med(t['old first layer']) * 1e3:.0f}",
        "",
    ]
    agg = 4 * 16 * 2 * (2 << 20)  # 4 workers, 16 chunks of 2 MiB, saved then loaded
    cluster = [
        "4 workers at once: 3-master cluster vs one server (GB/s)",
        f"{agg / med(k['cluster']) / 1e9:.2f}",
        f"{agg / med(k['one server']) / 1e9:.2f}",
        f"{med(k['one server']) / med(k['cluster']):.2f}x",
    ]
    head = ["GB/s (10^9 B/s)", "coredis", f"old client ({d['baseline_ref']})", "coredis / old"]
    note = f"medians of {len(t['coredis save'])} samples a side, A-B-B-A"
    return [*_table(head, [*rows, first, cluster]), "", f"_{note}_"]


def ttft_tiers_table(d: dict[str, Any]) -> list[str]:
    sources = ("recompute", "host tier", "fs", "redis")
    rows = []
    for n in d["lengths"]:
        ms = {
            s: 1e3 * statistics.median(r[s][str(n)]["ttft_s"] for r in d["runs"]) for s in sources
        }
        rows.append([f"{n}", *(f"{ms[s]:.0f}" for s in sources),
                     *(f"{ms['recompute'] / ms[s]:.0f}x" for s in sources[1:])])  # fmt: skip
    head = ["prompt tokens", *(f"{s} TTFT (ms)" for s in sources)]
    head += [f"{s} vs recompute" for s in sources[1:]]
    note = f"medians of {len(d['runs'])} repeats, fresh prompts each"
    return [*_table(head, rows), "", f"_{note}_"]


def miss_tier_table(d: dict[str, Any]) -> list[str]:
    """Each engine against the no-op's, paired (median of each repeat's ratio) and on
    medians (ratio of the medians), from every sample of the run."""
    samples, base = d["miss_run"]["samples"], "no-op connector"
    rows = []
    for engine in d["miss"]:
        if engine == base:
            continue
        cells = [engine]
        for what in ("prefill", "decode"):
            mine, theirs = samples[engine][what], samples[base][what]
            paired = statistics.median(a / b for a, b in zip(mine, theirs, strict=True))
            cells.append(f"{paired:.3f}, {d['miss'][engine][what] / d['miss'][base][what]:.3f}")
        rows.append(cells)
    head = ["engine", "prefill / no-op (paired, medians)", "decode / no-op (paired, medians)"]
    n = len(samples[base]["prefill"])
    return [*_table(head, rows), "", f"_{n} repeats a side, alternating A-B-B-A_"]


def soak_table(d: dict[str, Any]) -> list[str]:
    head = ["arguments", "requests", "right", "aborted", "faults (each that hit)"]
    head += ["preemptions", "kvflow loads (chunks), failed", "wrong tokens", "request errors"]
    head += ["leaked blocks", "hangs"]
    rows = []
    for r in d["rows"]:
        if "right" not in r:
            rows.append([" ".join(r["args"]), f"exited {r['exit']} before its report"])
            continue
        faults = ", ".join(f"{k} {n}" for k, n in r["faults"].items())
        loads = r["kvflow_loads"]
        rows.append([
            f"`{' '.join(r['args'])}`" if r["args"] else "(defaults)",
            *(str(r[k]) for k in ("requests", "right", "aborted")),
            f"{sum(r['faults'].values())}: {faults or 'none'}",
            str(r["preemptions"]),
            f"{loads['done']} ({loads['chunks']}), {loads['failed']}",
            *(str(r[k]) for k in ("wrong_tokens", "request_errors", "leaked_blocks", "hangs")),
        ])  # fmt: skip
    return _table(head, rows)


def soak_pd_table(d: dict[str, Any]) -> list[str]:
    """This run and every earlier one the file keeps, each with its commit."""
    head = ["commit, date", "requests", "right", "aborted", "producer kills", "kvflow pulls"]
    head += ["wrong tokens", "request errors (+ in flight at a kill)", "leaked blocks"]
    head += ["median / worst latency"]
    rows = []
    for r in [*d.get("history", []), d]:
        lat = sorted(r["latencies_s"]) or [float("nan")]
        rows.append([
            f"{r['commit']}, {r['date']}",
            *(str(r[k]) for k in ("requests", "right", "aborted", "producer_kills")),
            str(r["kvflow_loads"]["done"]),
            str(r["wrong_tokens"]),
            f"{r['request_errors']} (+ {r['errors_at_a_kill']})",
            "yes" if r["leaked_blocks"] else "none",
            f"{lat[len(lat) // 2]:.2f} s / {lat[-1]:.2f} s",
        ])  # fmt: skip
    return _table(head, rows)


def _secs(t: float | None, leaked: str = "**LEAKED**") -> str:
    return leaked if t is None else f"{t:.2f} s"


def _said(line: str | None, cut: int = 200, head: bool = False) -> str:
    """What a server said, quoted in a table cell: the last `cut` characters of a log
    line as scripts/faults.py keeps them (`head`: the first); None: nothing said why."""
    if line is None:
        return "**logged nothing saying why**"
    quoted = line.strip().replace("`", "'").replace("|", "\\|")
    more = "..." if len(line) >= cut else ""
    return f"`{quoted}{more}`" if head else f"`{more}{quoted}`"


def faults_table(d: dict[str, Any]) -> list[str]:
    """scripts/faults.py's P/D rows and its one-server rows (port taken, serve broken)."""
    head = ["row", "fault", "answered", "wrong tokens", "errors", "worst extra wait"]
    head += ["blocks back"]
    n, rows = d["pd_requests"], []
    for name, r in d["rows"].items():
        if "prompt_tokens" in r:
            continue  # a store row: faults_store_table
        cells = [f"`{name}`", r["fault"]]
        if "answered" in r:
            back = _secs(r["blocks_back_s"])
            if "producer_blocks_back_after_sigcont_s" in r:
                back += f"; the producer's {_secs(r['producer_blocks_back_after_sigcont_s'])}"
                back += " after SIGCONT"
            wait = r["worst_extra_wait_s"]
            cells += [f"{r['answered']} of {n}", str(r["wrong_tokens"]), str(r["errors"])]
            cells += ["-" if wait is None else _secs(wait), back]
        elif "lost_with_the_consumer" in r:
            lost = r["lost_with_the_consumer"]
            cells += [f"{n - lost} ({lost} lost with it)", "-", "-", "-"]
            cells.append(f"the producer's {_secs(r['producer_blocks_back_s'])} after")
        elif "both_idle_after_resume" in r:
            after = "both servers idle after resuming"
            if not r["both_idle_after_resume"]:
                after = "**a server still held blocks after resuming**"
            cells += ["-", "-", "-", "-"]
            cells.append(
                f"the producer's {_secs(r['producer_blocks_back_s'])} after the abort; {after}"
            )
        elif "exit_code" in r:
            code = r["exit_code"]
            how = "**did not exit**" if code is None else f"exits (code {code})"
            cells += ["-", "-", "-", "-"]
            cells.append(f"{how} after {r['exited_after_s']:.1f} s: {_said(r['said'])}")
        else:
            nxt = r["next_request"]
            nxt = nxt if nxt == "answered" else _said(nxt, 126, head=True)
            cells += ["-", "-", "-", "-"]
            cells.append(
                f"restarted {r['restarts_logged']} times; `/health` {r['health_while_idle']} "
                f"while idle; the next request: {nxt}; "
                f"`/health` then {r['health_after_it']}: {_said(r['said'])}"
            )
        rows.append(cells)
    note = f"{n} requests a P/D row, {d['max_tokens']} output tokens each; blocks not back"
    note += f" within {d['idle_s']:.0f} s are leaked; the whole run took {d['wall_s'] / 60:.0f} min"
    return [*_table(head, rows, left=2), "", f"_{note}_"]


def faults_store_table(d: dict[str, Any]) -> list[str]:
    """scripts/faults.py's store rows: a batch cold, the fault, the batch again."""
    head = ["row", "fault", "wrong tokens", "errors", "worst extra wait", "tokens loaded"]
    head += ["failed transfers", "blocks back"]
    rows, notes = [], []
    for name, r in d["rows"].items():
        if "prompt_tokens" not in r:
            continue
        rows.append([
            f"`{name}`",
            r["fault"],
            str(r["wrong_tokens"]),
            str(r["errors"]),
            _secs(r["worst_extra_wait_s"]),
            f"{r['tokens_loaded']} of {r['prompt_tokens']}",
            str(r["failed_transfers"]),
            _secs(r["blocks_back_s"]),
        ])  # fmt: skip
        if again := r.get("after_redis_restarted"):
            notes.append(
                f"`{name}`, once `redis-server` was back: a batch saved afresh and the next "
                f"ran with {again['wrong_tokens']} wrong tokens and {again['errors']} errors, "
                f"{again['tokens_loaded']} tokens loaded over the two"
            )
    return [*_table(head, rows, left=2), *(f"\n_{n}_" for n in notes)]


def cuda_ipc_table(d: dict[str, Any]) -> list[str]:
    head = ["run", "pull GB/s", "one-pass copy GB/s", "pull / copy", "pull, copy / peak"]
    alone = "kernel_gbs" in d["runs"][0]  # runs since 2026-11-29 time more
    if alone:
        head += ["copies alone GB/s (/ copy)", "one-block pull ms"]
    rows = []
    for i, r in enumerate(d["runs"]):
        row = [str(i + 1), f"{r['pull_gbs']:.0f}", f"{r['copy_gbs']:.0f}", f"{r['ratio']:.2f}",
               f"{r['pull_fraction']:.2f}, {r['copy_fraction']:.2f}"]  # fmt: skip
        if alone:
            row += [
                f"{r['kernel_gbs']:.0f} ({r['kernel_ratio']:.2f})",
                f"{r['one_block_pull_ms']:.2f}",
            ]
        rows.append(row)
    peak = f"peak {d['peak_bandwidth_gbs']:.0f} GB/s ({d['bandwidth_source']})"
    equal = "every byte equal" if d["bytes_equal"] else "**bytes differ**"
    return [*_table(head, rows), "", f"_{peak}; {equal}_"]


def staging_cuda_table(d: dict[str, Any]) -> list[str]:
    """Every run the file holds (the history first): host staging against pinned copies."""
    head = ["commit", "save GB/s (/ pinned D2H)", "load GB/s (/ pinned H2D)"]
    head += ["forward under saves", "saves during the forwards"]
    rows = []
    for run in [*d.get("history", []), d]:
        s, f = run["summary"], run["run"]["forward"]
        rows.append([
            run["commit"], f"{s['save']:.1f} ({s['save_ratio']:.2f})",
            f"{s['load']:.1f} ({s['load_ratio']:.2f})", f"{s['forward_slowdown']:+.1%}",
            str(sum(f["saves_during"])),
        ])  # fmt: skip
    equal = all(r["run"]["bytes_equal"] for r in [*d.get("history", []), d])
    return [*_table(head, rows), "", f"_{'every byte equal' if equal else '**bytes differ**'}_"]


def h100_converted_table(d: dict[str, Any]) -> list[str]:
    head = ["consumer", "pull GB/s", "plain copy GB/s (within the consumer's layout)"]
    rows = []
    for layout, what in (("LBNHC", "NHD, as the producer"), ("LBHNC", "HND, converted")):
        runs = d["runs"][layout]
        rows.append([what, ", ".join(f"{r['ipc_pull_gbs']:.0f}" for r in runs),
                     ", ".join(f"{r['plain_d2d_gbs']:.0f}" for r in runs)])  # fmt: skip
    pairs = zip(d["runs"]["LBHNC"], d["runs"]["LBNHC"], strict=True)
    conv = [c["ipc_pull_gbs"] / n["ipc_pull_gbs"] for c, n in pairs]
    note = f"converted / unconverted pull, run by run: {', '.join(f'{r:.2f}' for r in conv)}"
    return [*_table(head, rows), "", f"_{note}_"]


def convert_cuda_table(d: dict[str, Any]) -> list[str]:
    head = ["transport", "HND producer GB/s", "NHD producer, converted GB/s", "converted / same"]
    rows = [
        [r["transport"], f"{r['same_gbs']:.1f}", f"{r['converted_gbs']:.1f}", f"{r['ratio']:.2f}"]
        for r in d["results"]
    ]
    equal = all(r["bytes_equal"] for r in d["results"])
    return [*_table(head, rows), "", f"_{'every byte equal' if equal else '**bytes differ**'}_"]


def pd_serve_table(d: dict[str, Any]) -> list[str]:
    head = ["configuration", "TTFT p50 / p90 ms", "latency p50 / p90 ms", "output tok/s"]
    head += ["TTFT / one server", "latency / one server", "wrong answers", "failed requests"]
    rows = []
    for name, c in d["configs"].items():
        if "skipped" in c:
            rows.append([name, f"skipped: {c['skipped']}", *[""] * (len(head) - 2)])
            continue
        t, lat, r = c["ttft_s"], c["latency_s"], d["ratios"].get(name)
        if r is None or not t.get("n"):
            rows.append([name, "no request answered", *[""] * (len(head) - 2)])
            continue
        rows.append([
            name + (" (fell back: the decode server computed)" if c["fell_back"] else ""),
            f"{t['median'] * 1e3:.0f} / {t['p90'] * 1e3:.0f}",
            f"{lat['median'] * 1e3:.0f} / {lat['p90'] * 1e3:.0f}",
            f"{c['output_tok_s']:.1f}",
            f"{r['ttft_vs_one_server']:.2f}",
            f"{r['latency_vs_one_server']:.2f}",
            str(len(c["mismatches"])),
            str(len(c["errors"])),
        ])  # fmt: skip
    n = next(iter(d["configs"].values()))["ttft_s"]["n"]
    note = f"{d['requests']} prompts of {d['prompt_tokens']} tokens, {d['max_tokens']} output"
    note += f" tokens, {d['concurrency']} in flight, {d['repeats']} repeat(s): {n} samples each"
    return [*_table(head, rows), "", f"_{note}_", *_pd_split_table(d)]


PD_PARTS = (
    "prefill",
    "offer to arrival",
    "offer to answer",
    "answer to arrival",
    "claim",
    "claim to pull",
    "pull",
    "pull to report",
    "report to schedule",
    "first step",
    "to the client",
    "after the prefill",
)
"""The order of bench_pd_serve.py's parts of TTFT in the table (its `PARTS`, its no-proxy
rows' cut of offer to arrival, a streamed request's part after the prefill)."""


def _pd_split_table(d: dict[str, Any]) -> list[str]:
    """Where a P/D request's TTFT goes (bench_pd_serve.py's `split`): each part's median
    over the requests whose kvflow timeline is whole, what P/D added over the prefill,
    and issue 49's goal for it (the pull, one decode step, 10 ms)."""
    splits = {name: c["split"] for name, c in d["configs"].items() if c.get("split")}
    if not splits:
        return []
    parts = list(dict.fromkeys(p for s in splits.values() for p in s["median_s"]))
    parts.sort(key=lambda p: PD_PARTS.index(p) if p in PD_PARTS else len(PD_PARTS))
    head = ["configuration", "requests", *parts, "added over the prefill", "goal"]
    rows = [
        [name, str(s["n"]),
         *(f"{v * 1e3:.1f}" if (v := s["median_s"].get(p)) is not None else "" for p in parts),
         f"{s['added_s'] * 1e3:.1f}", f"{s['goal_s'] * 1e3:.1f}"]
        for name, s in splits.items()
    ]  # fmt: skip
    note = (
        "TTFT's parts, median ms over the requests, on one clock (the client's send and "
        "first chunk, kvflow's events of both servers: `kvflow inspect --timeline`); "
        "added: the parts after the prefill, median of their sum; goal: the median pull, "
        "one decode step (median TPOT) and 10 ms; streamed: the prefill is until the prefill "
        "server's finish, and none of the pull is after it"
    )
    return ["", *_table(head, rows), "", f"_{note}_"]


def pd_stream_table(d: dict[str, Any]) -> list[str]:
    """bench_pd_stream.py: TTFT by prompt length, streamed against pull after prefill."""
    modes = ("pull after prefill", "streamed")
    head = ["transport", "prompt tokens", *(f"TTFT p50 ms, {m}" for m in modes)]
    head += ["streamed / pull after", *(f"prefill p50 ms, {m}" for m in modes)]
    head += [*(f"pull p50 ms, {m}" for m in modes), "pull past the prefill's end p50 ms"]
    rows = []
    for transport, by_size in d["figures"].items():
        for size, f in by_size.items():
            past = f["median_pull_past_prefill_s"]
            rows.append([
                transport,
                size,
                *(f"{f['median_ttft_s'][m] * 1e3:.0f}" for m in modes),
                f"{f['ratio']:.2f}",
                *(f"{v * 1e3:.0f}" if (v := f["median_prefill_s"].get(m)) else "" for m in modes),
                *(f"{v * 1e3:.0f}" if (v := f["median_pull_s"].get(m)) else "" for m in modes),
                "" if past is None else f"{past * 1e3:.0f}",
            ])  # fmt: skip
    note = f"one request at a time, {d['repeats']} prompts per length, each through both "
    note += f"proxies, the order alternating; {d['max_tokens']} output tokens; problems: "
    note += "; ".join(d["problems"]) or "none (every pair of answers equal, every prompt pulled)"
    return [*_table(head, rows), "", f"_{note}_"]


def sched_scale_table(d: dict[str, Any]) -> list[str]:
    """bench_sched_scale.py: each scheduler-side call's cost by the requests held at once."""
    names = list(d["rows"][0]["calls"])
    head = ["requests", *(f"`{n}` p50 / p99 µs" for n in names)]
    head += ["`build_connector_meta`, all running, p50 µs a request"]
    head += ["all scheduled after, ms (without kvflow's lookups)", "kvflow bytes a request"]
    rows = []
    for r in d["rows"]:
        calls = r["calls"]
        cells = [f"{calls[n]['median_us']:.1f} / {calls[n]['p99_us']:.1f}" for n in names]
        each = calls["build_connector_meta, all running"]["median_us"] / r["requests"]
        admitted = f"{r['admitted_s'] * 1e3:.0f} ({r['admitted_no_lookups_s'] * 1e3:.0f})"
        rows.append([str(r["requests"]), *cells, f"{each:.2f}", admitted,
                     str(r["memory_per_request"])])  # fmt: skip
    note = f"vLLM's Scheduler, every request a {d['prompt_tokens']}-token prompt and "
    note += f"{d['output_tokens']} output tokens, all at once; {d['repeats']} batches a size "
    note += "each way (kvflow's lookups, and none: every lookup a miss at once), alternating, "
    note += "medians; the calls timed in batches whose lookups were answered before the steps"
    return [*_table(head, rows), "", f"_{note}_"]


def tier_scale_table(d: dict[str, Any]) -> list[str]:
    """bench_tier_scale.py: the host tier's operations by its slots, per policy."""
    ops = list(d["rows"][0]["median_ns"])
    head = ["policy", "slots", *(f"{op} ns (x fewest)" for op in ops), "kvflow bytes a slot"]
    rows = []
    for r in d["rows"]:
        cells = [f"{r['median_ns'][op]:.0f} ({r['ratio'][op]:.2f}x)" for op in ops]
        rows.append([r["policy"], f"{r['slots']:,}", *cells, f"{r['bytes_per_slot']:.0f}"])
    note = f"medians of batches of {d['batch']:,} operations; slots of {d['slot_bytes']} bytes, "
    note += f"{d['layers']} layer sizes a chunk; x fewest: against the same policy's smallest cache"
    return [*_table(head, rows), "", f"_{note}_"]


def fs_scale_table(d: dict[str, Any]) -> list[str]:
    """bench_fs_scale.py: `fs`'s costs by the chunk files its store holds."""
    head = ["files", "open ms", "scan s", "lookup hit p50 / p99 ms", "lookup miss p50 / p99 ms"]
    head += ["save p50 / p99 ms", "load p50 / p99 ms", "load while evicting p50 / p99 ms"]
    head += ["eviction step s", "files looked at / deleted", "peak MiB scan / eviction"]

    def pp(f: dict[str, float] | None) -> str:
        return "-" if f is None else f"{f['p50_ms']:.2f} / {f['p99_ms']:.2f}"

    rows = []
    for r in d["rows"]:
        looked = f"{r['evict_looked_at']:,} / {r['evict_deleted']:,}"
        peaks = f"{r['scan_peak_bytes'] / 2**20:.1f} / {r['evict_peak_bytes'] / 2**20:.1f}"
        rows.append([
            f"{r['files']:,}", f"{r['open_ms']:.1f}", f"{r['scan_s']:.1f}",
            pp(r["lookup_hit"]), pp(r["lookup_miss"]), pp(r["save"]), pp(r["load"]),
            pp(r["load_while_evicting"]), f"{r['evict_s']:.2f}", looked, peaks,
        ])  # fmt: skip
    note = f"filler files of {d['filler_bytes']} bytes; {d['samples']} samples of each "
    note += "operation a size; eviction step: a save past a store at its cap (`max_gb` "
    note += "just under its size), to the end of the eviction its chore ran"
    return [*_table(head, rows), "", f"_{note}_"]


def fs_evict_table(d: dict[str, Any]) -> list[str]:
    """bench_fs_evict.py: hit rate and work of each way to evict, per trace."""
    head = ["trace", "eviction", "chunk reads hit", "x exact in steps", "passes"]
    head += ["looked at a file deleted", "pass median ms"]
    rows = []
    for r in d["rows"]:
        exact = next(
            x["hit_rate"] for x in d["rows"]
            if x["trace"] == r["trace"] and x["kind"] == "exact" and x["evict_to"] == d["step"]
        )  # fmt: skip
        how = f"{r['kind']} to {r['evict_to']:.1%}"
        if r["share"] is not None:
            how += f", share {r['share']}"
        rows.append([
            r["trace"], how, f"{r['hit_rate']:.4f}", f"{r['hit_rate'] / exact:.3f}",
            str(r["passes"]), f"{r['looked_per_deleted']:.1f}", f"{r['pass_ms']:.1f}",
        ])  # fmt: skip
    caps = ", ".join(f"{t} {c:,} files" for t, c in d["cap_files"].items())
    distinct = ", ".join(f"{t} {c:,}" for t, c in d["distinct_chunks"].items())
    note = f"{d['requests']:,} requests a trace; cap {caps} of {d['file_bytes']} bytes; "
    note += f"distinct chunks {distinct}; sample {d['sample_files']} files"
    return [*_table(head, rows), "", f"_{note}_"]


def fs_shared_table(d: dict[str, Any]) -> list[str]:
    """bench_fs_shared.py: processes sharing one store at its cap, against one alone."""
    ops = ("save", "lookup", "load")
    head = ["processes", *(f"{op} p50 / p99 ms (x alone)" for op in ops)]
    head += ["loads right / failed cleanly / wrong", "lookups missed", "evictions"]
    head += ["evictions at once", "count drift bytes"]
    rows = []
    for r in d["rows"]:
        cells = [
            f"{r[op]['p50_ms']:.2f} / {r[op]['p99_ms']:.2f} ({r['x_alone'][op]:.2f}x)" for op in ops
        ]
        rows.append([
            str(r["processes"]), *cells, f"{r['loaded']:,} / {r['failed']} / {r['wrong']}",
            f"{r['missed']:,}", f"{r['evictions']:,}", str(r["overlapping_passes"]),
            ", ".join(str(x) for x in r["count_drift_bytes"]),
        ])  # fmt: skip
    note = f"{d['rounds']} rounds a process (a save, a lookup, a load), {d['repeats']} runs "
    note += f"a size, alternating; the cap {d['cap_files']} chunk files of {d['file_bytes']} "
    note += "bytes; count drift: the store's count minus its files' bytes after each run"
    return [*_table(head, rows), "", f"_{note}_"]


def pd_scale_table(d: dict[str, Any]) -> list[str]:
    """bench_pd_scale.py: a producer's offers and a consumer's renewals by offers held."""
    head = ["offers held", "offer µs each", "renew all ms", "renew all bytes"]
    head += ["renewal traffic bytes/s", "renew one p50 / p99 ms", "kvflow bytes an offer"]
    every = d["lease_s"] / 3
    rows = [
        [
            f"{r['offers']:,}", f"{r['offer_us']:.0f}", f"{r['renew_all_ms']:.1f}",
            f"{r['renew_all_bytes']:,}", f"{r['renew_all_bytes'] / every:,.0f}",
            f"{r['renew_one_ms']['p50']:.2f} / {r['renew_one_ms']['p99']:.2f}",
            f"{r['bytes_per_offer']:.0f}",
        ]
        for r in d["rows"]
    ]  # fmt: skip
    note = f"zmq, keyed; renewal traffic: one round every lease_s / 3 = {every:g} s; "
    note += f"renew one: {d['renew_one_samples']} renewals of one claim among all held"
    return [*_table(head, rows), "", f"_{note}_"]


def _route_sharing(d: dict[str, Any], policy: str) -> list[str]:
    """bench_route.py's samples of `policy`: how many requests computed while another was
    computing on their server (the send to the first token of each overlapping), of all;
    the median TTFT of those that did not; of the requests at or above the p90 TTFT, how
    many shared. Blank cells for runs that did not record each request's server."""
    samples = [(r["round"], s) for r in d["runs"] if r["policy"] == policy for s in r["samples"]]
    if not samples or any("server" not in s for _, s in samples):
        return ["", "", ""]

    def shared(run: int, s: dict[str, Any]) -> bool:
        end = s["sent_s"] + s["ttft_s"]
        return any(
            o is not s and r == run and o["server"] == s["server"]
            and o["sent_s"] < end and o["sent_s"] + o["ttft_s"] > s["sent_s"]
            for r, o in samples
        )  # fmt: skip

    flags = [(s["ttft_s"], shared(r, s)) for r, s in samples]
    ttft = sorted(t for t, _ in flags)
    p90 = ttft[int(0.9 * (len(ttft) - 1))]  # as bench_route.summarise
    slow = [f for t, f in flags if t >= p90]
    alone = [t for t, f in flags if not f]
    return [
        f"{sum(f for _, f in flags)} of {len(flags)}",
        f"{1e3 * statistics.median(alone):.0f}" if alone else "",
        f"{sum(slow)} of {len(slow)}",
    ]


def route_table(d: dict[str, Any]) -> list[str]:
    rows = [
        [
            name,
            f"{p['ttft_p50_ms']:.0f}",
            f"{p['ttft_p90_ms']:.0f}",
            f"{p['later_turns_ttft_p90_ms']:.0f}",
            f"{p['cached_share']:.2f}",
            *_route_sharing(d, name),
            " / ".join("-".join(str(n) for n in run) for run in p["requests_by_server"]),
        ]
        for name, p in d["policies"].items()
    ]
    g = d["goals"]
    rows.append(
        [
            "**prefix / round robin, prefix / one server**",
            "",
            f"{g['p90_vs_round_robin']:.2f}x",
            "",
            f"{g['cached_vs_one_server']:.2f}x",
            "",
            "",
            "",
            "",
        ]
    )
    head = [
        "routing",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "turns 2+ p90 ms",
        "cached share",
        "requests sharing their server",
        "TTFT p50 ms, not sharing",
        "p90 and slower, sharing",
        "requests by server (each run)",
    ]
    note = f"{d['users']} conversations of {d['turns']} turns, {d['concurrency']} at once, "
    note += f"pauses between turns of {d.get('think_s', 0):g} s mean, {d['rounds']} rounds; "
    note += "sharing: computing while another request was computing on the same server "
    note += "(its send to its first token)"
    return [*_table(head, rows), "", f"_{note}_"]


def proxy_table(d: dict[str, Any]) -> list[str]:
    rows = [
        [
            name,
            workload,
            f"{r['p50_ms']:.2f}",
            f"{r['p90_ms']:.2f}",
            f"{r['requests_per_s']:.0f}",
            f"{r['added_p50_ms']:+.2f}",
            f"{r['p50_over_direct']:.2f}x",
        ]
        for name, by in d["table"].items()
        for workload, r in by.items()
    ]
    head = ["client to", "workload", "p50 ms", "p90 ms", "req/s", "p50 - direct ms", "p50 / direct"]
    return _table(head, rows, left=2)


def tests_table(d: dict[str, Any]) -> list[str]:
    """bench_tests.py: each command of a fresh clone's set-up and test run, its wall time
    and pytest's counts."""
    rows = []
    for r in d["runs"]:
        said = re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", r["last_line"])
        n = {kind: count for count, kind in said}
        none = "0" if "pytest" in r["command"] else "-"
        kinds = ("passed", "skipped", "deselected", "failed")
        mins, secs = divmod(round(r["wall_s"]), 60)
        wall = f"{mins} min {secs:02d} s"
        rows.append([f"`{r['command']}`", wall, *(n.get(k, none) for k in kinds), str(r["rc"])])
    head = ["command", "wall time", "passed", "skipped", "deselected", "failed", "exit"]
    note = f"in a fresh clone of {d['clone_of']} and a fresh virtualenv, one after another"
    return [*_table(head, rows), "", f"_{note}_"]


COMPAT_PATHS = {
    "fs": "`fs`: saved, then loaded by a fresh engine",
    "tier": "host tier (`cpu_cache_gib`): hit in the same engine",
    "zmq": "P/D over `zmq`",
    "nixl": "P/D over `nixl`",
}
"""The compatibility matrix's columns: kvflow's paths, by the names its cells use."""


def compat_table(d: dict[str, Any]) -> list[str]:
    """bench_compat.py: vLLM features by kvflow's paths; each cell what its tests claim
    (named), or that one of them failed or was skipped."""
    cells: dict[str, dict[str, list[str]]] = {}
    for c in d["cells"]:
        file, _, name = c["test"].partition("::")
        link = f"`{file}::{name.split('[')[0]}`"  # mkdocs links no file outside docs/
        said = c["claim"] if c["outcome"] == "passed" else f"**{c['outcome'].upper()}**"
        cells.setdefault(c["row"], {}).setdefault(c["path"], []).append(f"{said} ({link})")
    rows = [
        [row, *("; ".join(by.get(p, ["-"])) for p in COMPAT_PATHS)] for row, by in cells.items()
    ]
    return _table(["vLLM feature", *COMPAT_PATHS.values()], rows)


# table name in docs: (its results, renderer, section of the file it shows)
TABLES: dict[str, tuple[str, Callable[[dict[str, Any]], list[str]], str]] = {
    "fs-io": ("fs-io", fs_io_table, ""),
    "fs-store-key": ("fs-store-key", fs_store_key_table, ""),
    "fs-store-key-hashes": ("fs-store-key", fs_store_key_hashes_table, ""),
    "hooks": ("hooks", hooks_table, ""),
    "reshape": ("reshape", reshape_table, ""),
    "convert": ("convert", convert_table, ""),
    "tier-policy": ("tier", tier_policy_table, ""),
    "tier-load": ("tier", tier_load_table, ""),
    "engines-miss": ("engines", miss_table, "miss"),
    "engines-hit": ("engines", hit_table, "hit"),
    "zmq": ("zmq", zmq_table, ""),
    "zmq-channels": ("zmq-channels", zmq_channels_table, ""),
    "zmq-channels-us": ("zmq-channels", zmq_micro_table, ""),
    "nixl": ("nixl", nixl_table, ""),
    "nixl-layerwise": ("nixl-layerwise", nixl_table, ""),
    "redis": ("redis", redis_table, ""),
    "ttft-tiers": ("ttft-tiers", ttft_tiers_table, ""),
    "engines-miss-tier": ("engines-miss-tier", miss_tier_table, ""),
    "engines-miss-tier-gil": ("engines-miss-tier-gil", miss_tier_table, ""),
    "cuda-ipc": ("cuda_ipc", cuda_ipc_table, ""),
    "cuda-ipc-layerwise": ("cuda_ipc_layerwise", cuda_ipc_table, ""),
    "cuda-ipc-converted-h100": ("cuda_ipc_converted_h100", h100_converted_table, ""),
    "staging-cuda": ("staging_cuda", staging_cuda_table, ""),
    "convert-cuda-h100": ("convert_cuda_h100", convert_cuda_table, ""),
    "soak": ("soak", soak_table, ""),
    "soak-pd": ("soak-pd", soak_pd_table, ""),
    "pd-serve": ("pd-serve", pd_serve_table, ""),
    "pd-stream": ("pd-stream", pd_stream_table, ""),
    "sched-scale": ("sched-scale", sched_scale_table, ""),
    "tier-scale": ("tier-scale", tier_scale_table, ""),
    "fs-scale": ("fs-scale", fs_scale_table, ""),
    "fs-evict": ("fs-evict", fs_evict_table, ""),
    "fs-shared": ("fs-shared", fs_shared_table, ""),
    "pd-scale": ("pd-scale", pd_scale_table, ""),
    "route": ("route", route_table, ""),
    "proxy": ("proxy", proxy_table, ""),
    "faults": ("faults", faults_table, ""),
    "faults-store": ("faults", faults_store_table, ""),
    "tests": ("tests", tests_table, ""),
    "compatibility": ("compatibility", compat_table, ""),
}


def caption(data: dict[str, Any], section: str = "") -> list[str]:
    """What measured a table, from its results file: command, commit, date, machine (a
    section's own record, `{section}_run`, where the table shows one section of the
    file); what of that record, or of its fingerprint, was filled in after the run
    rather than recorded as it ran (`record_reconstructed`, `sources_reconstructed`,
    `not_fingerprinted`); and whether any file it ran differs now from what it ran
    (`record.changed_since`)."""
    meta = data[f"{section}_run"] if section else data
    rev, added = meta.get("commit"), meta.get("committed_in")
    if rev and added:
        at = f"commit {rev} (the results were committed in {added})"
    elif rev:
        at = f"commit {rev}"
    elif added:
        at = f"commit not recorded (the results were committed in {added})"
    else:
        at = "commit not recorded"
    lines = [f"_`{meta.get('command')}`, {at}, {meta.get('date')}, {meta.get('machine')}._"]
    if how := meta.get("record_reconstructed"):
        lines += ["", f"_Not recorded as it ran: {how}._"]
    if how := meta.get("sources_reconstructed"):
        lines += [
            "",
            f"_Its sources' fingerprint was reconstructed, not recorded as it ran: {how}._",
        ]
    if why := meta.get("not_fingerprinted"):
        lines += ["", f"_Not fingerprinted: {why}._"]
    changed = record.changed_since(meta)  # a section's own sources
    if changed is None:
        return [*lines, "", "_Whether the code it measured has changed since cannot be told._"]
    if changed:
        again = f"`{meta.get('command')}` measures again"
        return [*lines, "", f"_**Older than the code it describes**: changed since ({again})._"]
    return lines


def render(text: str, results: Path = RESULTS) -> str:
    """`text` with every `<!-- bench:NAME -->` table rendered from its results file."""

    def table(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise SystemExit(f"<!-- bench:{name} -->: no such table; valid: {', '.join(TABLES)}")
        source, draw, section = TABLES[name]
        if not (results / f"{source}.json").exists():
            runs = [
                b for b, (argv, _, _) in BENCHES.items() if source in " ".join(argv) or b == source
            ]
            how = f"`python bench/run.py --only {runs[0]}`" if runs else "its benchmark"
            raise SystemExit(
                f"<!-- bench:{name} -->: no bench/results/{source}.json; {how} writes it"
            )
        data = json.loads((results / f"{source}.json").read_text())
        body = [*caption(data, section), "", *draw(data)]
        return f"<!-- bench:{name} -->\n" + "\n".join(body) + f"\n<!-- /bench:{name} -->"

    return re.sub(r"<!-- bench:([\w-]+) -->\n.*?<!-- /bench:\1 -->", table, text, flags=re.S)


def render_docs(results: Path = RESULTS) -> list[Path]:
    """Rewrite the tables of every page in DOCS; the pages that changed."""
    changed = []
    for page in DOCS:
        text = page.read_text()
        if (new := render(text, results)) != text:
            page.write_text(new)
            changed.append(page)
    return changed


def draw_plots() -> None:
    """docs/img/bench-*.png from the results files (bench/plots.py), if matplotlib is here."""
    sys.path.insert(0, str(HERE))
    try:
        import plots
    except ModuleNotFoundError as e:
        if e.name not in ("matplotlib", "PIL"):
            raise
        print("plots: matplotlib is not installed (pip install -e '.[bench]'); not drawn")
        return
    plots.draw_all()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help=f"comma-separated, of: {', '.join(BENCHES)}")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite the docs' tables")
    ap.add_argument("--render", action="store_true", help="run nothing: tables and plots only")
    args = ap.parse_args()
    names = [] if args.render else [n for n in args.only.split(",") if n] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"unknown benchmark {unknown}; choose from {list(BENCHES)}")
    print(f"{record.commit()}: {record.machine()}")
    failed = []
    for name in names:
        argv, quick, needs = BENCHES[name]
        if missing := needs():
            print(f"== {name}: skipped ({missing})")
            continue
        cmd = [sys.executable, str(HERE / argv[0]), *argv[1:]]
        cmd += ["--quick"] if args.quick and quick else []
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        print(f"== {name}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if not args.no_docs:
        changed = render_docs()
        print(f"rendered the tables; changed: {', '.join(map(str, changed)) or 'none'}")
        draw_plots()
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
