"""The soak script of docs/reliability.md runs as written (here on fewer requests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_short_soak_ends_with_nothing_wrong(policy: str) -> None:
    cmd = [sys.executable, "scripts/soak.py", "--requests", "80", "--unique", "16"]
    cmd += ["--policy", policy, "--fault-rate", "0.2", "--abort-rate", "0.05"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, tail
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines() if "  " in line)
    assert lines["wrong"].split()[-1] == "0", tail  # "wrong tokens    0"
    assert lines["leaked"].split()[-1] == "0" and lines["hangs"].strip() == "0", tail
    assert not lines["faults"].startswith("0"), "no fault was injected"
