"""The compatibility matrix of docs/compatibility.md: vLLM features (rows) by kvflow's paths
(columns), each cell shown by the tests marked `cell(row, path, claim=...)`.

    python bench/bench_compat.py [PYTEST ARGS]

Runs `python3 -m pytest -m cell` (slow tests included: the matrix's engines are in CI's
slow set) with `KVFLOW_COMPAT_RESULTS` set, so each marked test appends its outcome
(tests/conftest.py), and writes bench/results/compatibility.json: the record (commit,
machine, installed vLLM), each cell's tests and outcomes. `python bench/run.py --render`
draws the table from it; a failing test shows as failing there, never as a yes. Takes
what the matrix's engines take (about 20 min on 2 cores): run it on an idle machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import record

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "compatibility.json"
RAN = [
    "kvflow",
    "transports",
    "plugins",
    "tests/compat",
    "tests/support",
    "tests/conftest.py",
    "tests/engine/test_e2e_fs.py",
    "tests/engine/test_e2e_pd.py",
    "tests/serving/test_serve_pd.py",
]
"""What the cells' tests run (their engines import kvflow in other processes)."""


def main(argv: list[str]) -> int:
    meta = record.start()
    with tempfile.TemporaryDirectory() as tmp:
        lines = Path(tmp, "cells.jsonl")
        env = os.environ | {"KVFLOW_COMPAT_RESULTS": str(lines)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cell"]
        rc = subprocess.run([*cmd, *argv], cwd=ROOT, env=env, check=False).returncode
        cells = [json.loads(x) for x in lines.read_text().splitlines()] if lines.exists() else []
    if not cells:
        print("no test marked `cell` ran", file=sys.stderr)
        return 1
    record.save(OUT, {"pytest_exit": rc, "cells": cells}, meta, extra=RAN)
    failed = [c["test"] for c in cells if c["outcome"] != "passed"]
    print(f"wrote {OUT}: {len(cells)} cells, {len(failed)} not passed", *failed, sep="\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
