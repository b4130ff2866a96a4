"""Run every benchmark, write bench/results/*.json, regenerate the tables in
docs/benchmarks.md.

    python bench/run.py            # everything: ~60 min on 2 cores
    python bench/run.py --quick    # smaller workloads, fewer repeats: ~10 min
    python bench/run.py --only fs-io,hooks --no-docs

Each benchmark runs in its own process, one after another (never two at once: they
would measure each other). Each prints ratios against a baseline measured in the same
run, alternating, with medians; see each script's docstring for its method. The
tables in docs/benchmarks.md between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`
are rewritten from the JSON, each with the command, the date and the machine, and the
plots in docs/img/ redrawn (bench/plots.py, if matplotlib is installed). A
benchmark that needs what this machine lacks (a GPU for `cuda-ipc`) is skipped, saying
so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
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
RESULTS = HERE / "results"
DOCS = HERE.parent / "docs" / "benchmarks.md"
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
    "cuda-ipc": (
        ["bench_cuda_ipc.py"],
        True,
        lambda: "" if _has_cuda() else "no CUDA device on this machine",
    ),
}


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    parts = [f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB"]
    for mod in ("vllm", "torch"):
        with contextlib.suppress(ImportError):
            parts.append(f"{mod} {__import__(mod).__version__}")
    return ", ".join(parts)


# -- tables --------------------------------------------------------------------------------


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(head) - 1)
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def fs_io_table(d: dict[str, Any]) -> list[str]:
    ops = (("save", "plain save"), ("layer load", "plain load"), ("file load", "plain load"))
    rows = []
    for name, case in d["cases"].items():
        g = case["gbs"]
        for op, base in ops:
            cells = [f"{name}, {case['mib']:.0f} MiB, {case['files']} files", op, f"{g[base]:.2f}"]
            for side in ("kvflow", "kvflow 1 thread"):
                v = g[f"{side} {op}"]
                cells.append(f"{v:.2f} ({v / g[base]:.2f}x)")
            rows.append(cells)
    head = ["KV", "operation", "plain GB/s", "kvflow GB/s (x plain)", "kvflow 1 thread"]
    return _table(head, rows)


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
    return _table(head, rows)


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
    note = f"commit {d['commit']}; medians of {len(t['coredis save'])} samples a side, A-B-B-A"
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
    note = f"commit {d['commit']}; medians of {len(d['runs'])} repeats, fresh prompts each"
    return [*_table(head, rows), "", f"_{note}_"]


# table name in docs: (results file, renderer, section of the file it shows)
TABLES: dict[str, tuple[str, Callable[[dict[str, Any]], list[str]], str]] = {
    "fs-io": ("fs-io", fs_io_table, ""),
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
}


def _script(bench: str) -> str:
    argv = BENCHES[bench][0]
    return " ".join(a for i, a in enumerate(argv) if a != "--out" and argv[i - 1] != "--out")


def regenerate_docs(ran: dict[str, dict[str, Any]], text: str) -> str:
    """`text` with each table whose benchmark ran in `ran` rewritten between its markers."""
    for name, (bench, render, section) in TABLES.items():
        if bench not in ran:
            continue
        meta = ran[bench]
        with open(RESULTS / f"{bench}.json") as f:
            data = json.load(f)
        if section and section not in data:
            continue  # this run did not measure it; the table keeps its last run
        how = f"`{meta['command']}` ({_script(bench)})"
        if section and (cmd := data.get(f"{section}_run", {}).get("command")):
            how = f"`{cmd}`"  # measured by a run of its own
        body = [f"_{how}, {meta['date']}, {meta['machine']}:_", "", *render(data)]
        pattern = re.compile(
            rf"(<!-- bench:{re.escape(name)} -->\n).*?(<!-- /bench:{re.escape(name)} -->)",
            re.S,
        )
        if not pattern.search(text):
            print(f"  docs: no markers for table {name!r}; not written")
            continue
        table = "\n".join(body) + "\n"
        text = pattern.sub(lambda m, t=table: m.group(1) + t + m.group(2), text)
    return text


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
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        ap.error(f"unknown benchmark {unknown}; choose from {list(BENCHES)}")
    command = "python bench/run.py" + (" --quick" if args.quick else "")
    date, where = datetime.date.today().isoformat(), machine()
    print(f"{command}: {date}, {where}")
    ran: dict[str, dict[str, Any]] = {}
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
        rc = subprocess.run(cmd, cwd=HERE.parent).returncode
        wall = time.perf_counter() - t0
        print(f"== {name}: exit {rc} after {wall:.0f} s", flush=True)
        if rc:
            failed.append(name)
            continue
        ran[name] = {"command": command, "date": date, "machine": where, "wall_s": wall}
    log = RESULTS / "run.json"  # the last run of each benchmark
    log.write_text(json.dumps(json.loads(log.read_text()) | ran if log.exists() else ran, indent=2))
    if not args.no_docs and ran:
        DOCS.write_text(regenerate_docs(ran, DOCS.read_text()))
        print(f"rewrote the tables of {', '.join(ran)} in {DOCS}")
        draw_plots()
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
