"""Engines in processes of their own sharing one `fs` store at its cap (issue 50, item
2): what each save, lookup and load costs against one process alone, and what sharing
gets right.

    python bench/bench_fs_shared.py            # 1, 2 and 4 processes, 3 rounds each (~2 min)

Each process is tests/support/fs_shared.py (its docstring has the method: a worker of
the conformance suite's small layout; every other chunk saved by every process, the
others its own; each round a save and a load of one of its chunks, checked byte for
byte), all started together once each has opened the store. The store's cap holds
`CAP_FILES` chunk files, a fraction of what they save, so evictions run all along.
Sizes run in turn, `REPEATS` times, alternating; each operation's p50 and p99 pool
every process's samples of a size (kept, to 0.01 ms, as value counts), and `x alone`
divides a p50 by one process's.
Outcomes, summed over every run of a size: loads right, loads that failed cleanly
(their chunk deleted after the lookup found it), lookups that found nothing, wrong
bytes, the store's count against its files at the end, and eviction passes of two
processes that overlapped in time.

Writes bench/results/fs-shared.json; `python bench/run.py --render` renders it into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import record  # bench/record.py

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvflow_fs._usage import USAGE_FILE  # noqa: E402

SCRIPT = ROOT / "tests" / "support" / "fs_shared.py"
FILE_BYTES = 5632
CAP_FILES = 200
ROUNDS = 400
REPEATS = 3
OUT = ROOT / "bench" / "results" / "fs-shared.json"


def once(processes: int) -> dict[str, Any]:
    """One run of `processes` at once over a fresh store."""
    with tempfile.TemporaryDirectory(prefix="kvflow-fs-shared-") as tmp:
        store = Path(tmp) / "store"
        cap_gb = CAP_FILES * FILE_BYTES / 2**30
        procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPT), str(store), str(cap_gb), str(ROUNDS), str(seed)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for seed in range(processes)
        ]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
        on_disk = sum(f.stat().st_size for f in store.rglob("*.kv"))
        counted = int((store / USAGE_FILE).read_text())
    passes = sorted((a, b) for r in reports for a, b, _ in r["passes"])
    return {
        "reports": reports,
        "count_drift_bytes": counted - on_disk,
        "overlapping_passes": sum(1 for x, y in itertools.pairwise(passes) if y[0] < x[1]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    meta = record.start()
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in args.sizes}
    for _ in range(REPEATS):
        for n in args.sizes:
            runs[n].append(once(n))
    rows = []
    for n, done in runs.items():
        reports = [r for run in done for r in run["reports"]]
        row: dict[str, Any] = {"processes": n}
        row["samples_ms"] = {}
        for op in ("save", "lookup", "load"):
            samples = [t for r in reports for t in r["times_s"][op]]
            row[op] = record.p50_p99_ms(samples)
            counts = collections.Counter(round(1e3 * t, 2) for t in samples)
            row["samples_ms"][op] = sorted(counts.items())  # (ms, how many)
        for key in ("loaded", "failed", "missed", "wrong", "evictions"):
            row[key] = sum(r[key] for r in reports)
        row["count_drift_bytes"] = [run["count_drift_bytes"] for run in done]
        row["overlapping_passes"] = sum(run["overlapping_passes"] for run in done)
        rows.append(row)
    alone = rows[0]
    for row in rows:
        row["x_alone"] = {
            op: row[op]["p50_ms"] / alone[op]["p50_ms"] for op in ("save", "lookup", "load")
        }
        print(
            f"{row['processes']} processes: save {row['save']['p50_ms']:.2f} ms "
            f"({row['x_alone']['save']:.2f}x), load {row['load']['p50_ms']:.2f} "
            f"({row['x_alone']['load']:.2f}x); loads right {row['loaded']}, failed cleanly "
            f"{row['failed']}, wrong {row['wrong']}; count drift {row['count_drift_bytes']}; "
            f"overlapping evictions {row['overlapping_passes']}",
            flush=True,
        )
    data = {
        "rounds": ROUNDS,
        "repeats": REPEATS,
        "cap_files": CAP_FILES,
        "file_bytes": FILE_BYTES,
        "rows": rows,
    }
    record.save(args.out, data, meta, extra=["tests/support/fs_shared.py"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
