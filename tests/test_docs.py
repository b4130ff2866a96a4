"""The docs site builds with mkdocs in strict mode: no broken link, no page left out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

pytest.importorskip("mkdocs", reason="the docs build needs mkdocs (pip install -e '.[test]')")


def test_docs_build_without_warnings(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "WARNING" not in out, out
    assert (tmp_path / "site" / "transports" / "index.html").exists()
