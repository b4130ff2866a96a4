"""`kvflow demo --pd`, run for real (two servers and the proxy).

`kvflow demo` itself, the README's first command, runs in CI from the installed wheel in a
fresh virtualenv (scripts/check-wheel.sh, checked by scripts/check_installed.py with the
same `demo_problems`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..support.by_path import load

demo_problems = load("scripts/check_installed.py", "check_installed").demo_problems

# Slow (CI runs it): three engine processes and two servers; the same paths run in the
# default set through test_serve_pd.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

DEMO = [sys.executable, "-m", "kvflow.cli.main", "demo"]


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
    assert demo_problems(out, 200, 2) == [], out
