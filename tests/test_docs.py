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


def test_the_readmes_server_and_proxy_commands_are_the_ones_the_tests_run() -> None:
    import shlex

    from kvflow.cli.main import build_parser
    from kvflow_vllm.apiserver import server_command

    readme = (ROOT / "README.md").read_text()
    cmd = server_command("m", 8100, {})
    assert f"python -m {cmd[2]} --model <model>" in readme  # tests/test_serve_pd.py starts it
    (line,) = [ln for ln in readme.splitlines() if ln.startswith("kvflow proxy ")]
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert args.prefill == ["http://127.0.0.1:8100"] and args.decode == ["http://127.0.0.1:8200"]
