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


def test_the_gpu_suite_runs_files_that_exist_and_says_when_there_is_no_gpu() -> None:
    import re

    import torch

    script = (ROOT / "scripts" / "gpu-check.sh").read_text()
    named = re.findall(r"(?:tests|bench)/\w+\.py", script)
    assert len(named) >= 5 and all((ROOT / p).exists() for p in named), named
    if torch.cuda.is_available():
        return  # there it runs the suite: scripts/gpu-check.sh itself
    proc = subprocess.run(
        ["bash", "scripts/gpu-check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr, proc.stderr
