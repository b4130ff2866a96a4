"""The docs site builds with mkdocs in strict mode: no broken link, no page left out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

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
    assert (
        f"python -m {cmd[2]} --model <model>" in readme
    )  # tests/serving/test_serve_pd.py starts it
    (line,) = [ln for ln in readme.splitlines() if ln.startswith("kvflow proxy ")]
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert args.prefill == ["http://127.0.0.1:8100"] and args.decode == ["http://127.0.0.1:8200"]


def test_the_routing_pages_commands_parse_and_name_each_servers_events() -> None:
    """docs/routing.md's server and proxy commands: the proxy's parses, one --kv-events
    per --server, each naming the endpoints its server's --kv-events-config binds."""
    import json
    import re
    import shlex

    from kvflow.cli.main import build_parser

    page = (ROOT / "docs" / "routing.md").read_text()
    block = page.split("```")[1].replace("\\\n", " ")
    lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
    servers = [ln for ln in lines if ln.startswith("python -m vllm.entrypoints.openai.api_server")]
    (proxy,) = [ln for ln in lines if ln.startswith("kvflow proxy ")]
    args = build_parser().parse_args(shlex.split(proxy)[1:])
    assert args.route == "prefix" and len(args.server) == len(args.kv_events) == len(servers)
    for server, url, events in zip(servers, args.server, args.kv_events, strict=True):
        words = shlex.split(server)
        assert url.endswith(":" + words[words.index("--port") + 1])
        config = json.loads(words[words.index("--kv-events-config") + 1])
        ports = [re.sub(r".*:", "", e) for e in events.split(",")]
        assert ports == [
            config["endpoint"].split(":")[-1],
            config["replay_endpoint"].split(":")[-1],
        ]


def test_the_gpu_suite_runs_files_that_exist_and_says_when_there_is_no_gpu() -> None:
    import re

    import torch

    script = (ROOT / "scripts" / "gpu-check.sh").read_text()
    named = re.findall(r"(?:tests|bench)/[\w/]+\.py", script)
    assert len(named) >= 5 and all((ROOT / p).exists() for p in named), named
    if torch.cuda.is_available():
        return  # there it runs the suite: scripts/gpu-check.sh itself
    proc = subprocess.run(
        ["bash", "scripts/gpu-check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr, proc.stderr


def test_the_gpu_suite_logs_to_docs_gpu_runs_not_bench_results(tmp_path: Path) -> None:
    """scripts/gpu-check.sh, run in a copy with a stand-in interpreter that says it has
    CUDA on an "NVIDIA H200", logs to docs/gpu-runs/DATE-h200/ and nothing to bench/."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "gpu-check.sh").write_text(
        (ROOT / "scripts" / "gpu-check.sh").read_text()
    )
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H200'\n")
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake)}
    proc = subprocess.run(
        ["bash", "scripts/gpu-check.sh"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.log"))
    assert logs and all(p.startswith("docs/gpu-runs/") for p in logs), logs
    (day,) = {p.split("/")[2] for p in logs}
    steps = ["bench_cuda_ipc", "bench_cuda_ipc_hnd", "bench_cuda_ipc_layerwise"]
    steps += ["bench_staging", "engines", "tests"]
    assert day.endswith("-h200") and logs == [
        f"docs/gpu-runs/{day}/gpu-check-{step}.log" for step in steps
    ], logs
    assert not (tmp_path / "bench").exists()


def test_the_readme_is_a_front_door() -> None:
    """What kvflow is in at most five lines, both set-up commands in the first 30 lines,
    a quick start of at most 15 lines and a feature list of at most 25 that links to the
    docs; no test times, commit ids or run details (those are docs/benchmarks.md's)."""
    import re

    lines = (ROOT / "README.md").read_text().splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("## ")]

    def section(title: str) -> list[str]:
        (start,) = [i for i in heads if lines[i] == f"## {title}"]
        end = next((i for i in heads if i > start), len(lines))
        return [ln for ln in lines[start + 1 : end] if ln.strip()]

    intro = [ln for ln in lines[1 : heads[0]] if ln.strip()]
    assert 0 < len(intro) <= 5, intro
    first = "\n".join(lines[:30])
    assert "bash scripts/install.sh && kvflow demo" in first
    assert "bash scripts/install.sh && python3 -m pytest" in first
    assert len(section("Quick start")) <= 15
    features = section("Features")
    assert len(features) <= 25 and sum("](docs/" in ln for ln in features) >= 8
    text = "\n".join(lines)
    assert not re.search(r"\b[0-9a-f]{7}\b", text), "a commit id: docs/benchmarks.md's"
    assert not re.search(r"\d+ min\b|\d+ tests\b", text), "a run's time: docs/benchmarks.md's"
