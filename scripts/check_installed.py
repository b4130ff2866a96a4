"""Check kvflow as a user installed it: run by scripts/check-wheel.sh with a fresh
virtualenv's python, from a directory outside the repository, after a non-editable
install of the built wheels.

    python check_installed.py --version 0.3.0 [--skip-demo]

It fails (exit 1, naming each problem) unless:
- every module of the `kvflow` and `kvflow-redis` distributions imports, from the
  virtualenv's site-packages (never from a source tree);
- `kvflow --version` and `kvflow.__version__` say the version built;
- `kvflow transports` lists fs, zmq, nixl and redis, none broken;
- `kvflow doctor` finds nothing that would stop an engine;
- `kvflow demo` (a cold and a restarted, warm vLLM engine over `fs`) loads every prompt
  token in the warm engine and generates the cold engine's tokens.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

DISTS = ("kvflow", "kvflow-redis")
TRANSPORTS = ("fs", "zmq", "nixl", "redis")


def modules(dist: str) -> list[str]:
    """The dotted names of every Python module the installed distribution `dist` holds."""
    names = []
    for f in metadata.files(dist) or []:
        if f.suffix != ".py" or ".." in f.parts:  # console scripts live outside site-packages
            continue
        parts = list(f.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return sorted(names)


def check_imports() -> list[str]:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    problems = []
    for dist in DISTS:
        names = modules(dist)
        if not names:
            problems.append(f"{dist}: no module installed")
        for name in names:
            try:
                mod = importlib.import_module(name)
            except Exception as exc:
                problems.append(f"import {name}: {type(exc).__name__}: {exc}")
                continue
            where = Path(mod.__file__ or "").resolve()
            if not where.is_relative_to(site):
                problems.append(f"{name} imported from {where}, not from {site}")
        print(f"check_installed: {len(names)} modules of {dist} import from {site}")
    return problems


def run_kvflow(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The `kvflow` console script of this environment, as a user runs it."""
    exe = Path(sys.executable).parent / "kvflow"
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def check_version(expected: str) -> list[str]:
    import kvflow

    problems = []
    out = run_kvflow("--version")
    if out.returncode != 0 or out.stdout.strip() != f"kvflow {expected}":
        problems.append(f"`kvflow --version` said {out.stdout.strip()!r}, not 'kvflow {expected}'")
    if kvflow.__version__ != expected:
        problems.append(f"kvflow.__version__ is {kvflow.__version__!r}, not {expected!r}")
    return problems


def check_transports() -> list[str]:
    out = run_kvflow("transports")
    print(out.stdout, end="")
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.strip()}
    problems = [f"`kvflow transports` does not list {t}" for t in TRANSPORTS if t not in listed]
    lines = out.stdout.splitlines()
    problems += [f"broken transport: {line}" for line in lines if "BROKEN" in line]
    if out.returncode != 0:
        problems.append(f"`kvflow transports` exited {out.returncode}: {out.stderr[-2000:]}")
    return problems


def check_doctor() -> list[str]:
    """`kvflow doctor` on the default configuration: this host would start an engine."""
    out = run_kvflow("doctor")
    print(out.stdout, end="")
    return [] if out.returncode == 0 else [f"`kvflow doctor` exited {out.returncode}"]


def demo_problems(out: str, prompt_len: int, prompts: int) -> list[str]:
    """What is wrong with `kvflow demo`'s (or `--pd`'s) table in its output `out`: a row per
    prompt whose first two cells (the prompt's tokens, those loaded) are `prompt_len` and
    whose last says the tokens matched."""
    rows = [line for line in out.splitlines() if line.startswith("│")]
    problems = [] if len(rows) == prompts else [f"{len(rows)} rows, not {prompts}"]
    for row in rows:
        cells = [c.strip() for c in row.strip("│").split("│")]
        if not cells[0] == cells[1] == str(prompt_len):
            problems.append(f"not every prompt token loaded: {row}")
        if cells[-1] != "yes":
            problems.append(f"tokens differ: {row}")
    if "result: OK" not in out:
        problems.append("no 'result: OK'")
    return problems


def check_demo() -> list[str]:
    with tempfile.TemporaryDirectory() as cache:
        args = ["--cache-dir", cache, "--prompts", "2", "--prompt-len", "300", "--max-tokens", "8"]
        out = run_kvflow("demo", *args, timeout=900)
        print(out.stdout, end="")
        problems = demo_problems(out.stdout, 300, 2)
        if out.returncode != 0:
            problems.append(f"`kvflow demo` exited {out.returncode}: {out.stderr[-3000:]}")
        if not list(Path(cache).rglob("*.kv")):
            problems.append("`kvflow demo` wrote no chunk file into its --cache-dir")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", required=True, help="the version that was built")
    p.add_argument("--skip-demo", action="store_true", help="no engine run")
    args = p.parse_args()
    problems = check_imports() + check_version(args.version) + check_transports()
    problems += check_doctor()
    if not args.skip_demo:
        problems += check_demo()
    for problem in problems:
        print(f"check_installed: FAILED: {problem}", file=sys.stderr)
    print("check_installed:", "FAILED" if problems else "OK, kvflow as installed works")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
