"""How long the README's test command takes as a new contributor runs it: a fresh clone
of this repository's HEAD, a fresh virtualenv, `bash scripts/install.sh`, then
`python3 -m pytest` (and, with --slow, `python3 -m pytest -q -m slow` after it).

    python bench/bench_tests.py [--slow]

Writes bench/results/tests.json: each command's wall time and pytest's counts. The run
takes what the suite takes (about 10 min, the install about 4 more); run it on a machine
doing nothing else, since the suite's engines share its cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import record

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "tests.json"
CODE = ["kvflow", "transports", "plugins", "tests", "scripts"]
"""What the suite runs (fingerprinted as the clone holds it): a change to any of it makes
the result older than the code."""


FAILURE_LINES = 80
"""At most this many lines of pytest's failure reports are kept (`why`)."""
_RAISED = re.compile(r"^[\s|+>]*[\w.]*(Error|Exception|ExceptionGroup|Failed|Timeout)\w*: ")
"""An exception's line outside pytest's `E` lines: an exception group's members (pytest
prints a group's traceback as Python does, `| AssertionError: ...`), a teardown's."""


def timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> dict[str, Any]:
    """`cmd`'s wall time, the last line it printed, the tests pytest says failed, why
    (each failure's heading, its `E` lines and the exceptions' lines of its groups, the
    first `FAILURE_LINES`), and its exit status."""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    failed = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    why = [ln for ln in lines if ln.startswith(("____", "E ")) or _RAISED.match(ln)]
    why = why[:FAILURE_LINES]
    last = lines[-1] if lines else proc.stderr[-500:]
    run = {"command": " ".join(cmd), "wall_s": wall, "rc": proc.returncode, "last_line": last}
    return run | ({"failed": failed, "why": why} if failed else {})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slow", action="store_true", help="then `-m slow` too")
    args = p.parse_args()
    meta = record.start()
    head = record.git("rev-parse", "--short", "HEAD")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        clone, venv = Path(tmp, "kvflow"), Path(tmp, "venv")
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = os.environ | {"VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin:{os.environ['PATH']}"}
        steps = [["bash", "scripts/install.sh"], ["python3", "-m", "pytest", "-q"]]
        if args.slow:
            steps.append(["python3", "-m", "pytest", "-q", "-m", "slow"])
        ran = {  # what the clone ran: the working tree may have moved on since
            f: record.blob((clone / f).read_bytes())
            for code in CODE
            for f in map(str, sorted(p.relative_to(clone) for p in (clone / code).rglob("*.py")))
        }
        for cmd in steps:
            run = timed(cmd, clone, env)
            print(f"{run['command']}: {run['wall_s']:.0f} s, exit {run['rc']}: {run['last_line']}")
            print("\n".join(run.get("failed", [])))
            runs.append(run)
            if run["rc"] != 0:
                break
    data = {"clone_of": head, "runs": runs}
    record.save(OUT, data, meta, ran=ran)
    print(f"wrote {OUT}")
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
