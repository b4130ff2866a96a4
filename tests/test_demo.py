"""`kvflow demo`, the README's first command, run for real (two engine processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# Slow (CI runs it): three engine processes and two servers; the same paths run in the
# default set through test_e2e_fs and test_serve_pd.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

DEMO = [sys.executable, "-m", "kvflow.cli.main", "demo"]


def test_demo_reports_warm_loads_and_identical_tokens(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            *DEMO,
            "--cache-dir",
            str(tmp_path),
            "--prompts",
            "2",
            "--prompt-len",
            "300",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 2, out
    for row in rows:
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[0] == cells[1] == "300", f"every prompt token loaded: {row}"
        assert cells[-1] == "yes", f"warm tokens identical to cold: {row}"
    assert "result: OK" in out
    assert list(tmp_path.rglob("*.kv")), "the demo wrote to the cache dir it was given"


def test_pd_demo_pulls_every_prompt_and_matches_one_engine() -> None:
    proc = subprocess.run(
        [*DEMO, "--pd", "--prompts", "2", "--prompt-len", "200", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "kvflow proxy http://127.0.0.1:" in out and "decode http://127.0.0.1:" in out, out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) == 2, out
    for row in rows:
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[0] == cells[1] == "200", f"the decode server pulled every token: {row}"
        assert cells[-1] == "yes", f"text identical to one server's: {row}"
    assert "result: OK" in out
