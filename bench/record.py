"""What every results file under bench/results/ records besides its figures: which code
was measured (the commit, and the source files the benchmark ran), by which command, on
which machine, on which day, and every earlier run of the same file.

    meta = record.start()                      # once, as the benchmark starts
    ...
    record.save(out, {"rows": rows, ...}, meta)

`save` writes the figures with `meta` beside them (`commit`, `command`, `date`,
`machine`, `started`, `sources`) and keeps what the file held before under `history`
(a later save of the same run, same `started`, replaces it instead). `bench/run.py`
renders the docs' tables from these files and says, beside each, whether the code it
measured has changed since (`changed_since`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
META = ("commit", "command", "date", "machine", "started", "sources")
"""The keys `save` adds to a results file, beside `history`."""


def git(*args: str) -> str:
    """`git ARGS` in the repository: its output, or "" where git or the repository is not."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


CODE = ("--", "kvflow", "transports", "plugins", "bench", "scripts", ":!bench/results")
"""Where a change makes a measurement `+dirty` (docs and results files do not)."""


def commit() -> str:
    """HEAD's short hash, `+dirty` when tracked code differs from it ("unknown" outside
    git)."""
    head = git("rev-parse", "--short=7", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", *CODE) else "")


def gpu() -> str:
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return "no GPU"


def machine() -> str:
    """CPU model, cores, memory, GPU, and the vLLM and torch this process imports."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    parts = [f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB, {gpu()}"]
    for mod in ("vllm", "torch"):
        with contextlib.suppress(Exception):
            parts.append(f"{mod} {__import__(mod).__version__}")
    return ", ".join(parts)


def command(argv: list[str] | None = None) -> str:
    """`python SCRIPT ARGS` as typed from the repository's root."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else None
    if script is not None and script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return "python " + shlex.join(argv)


def start(argv: list[str] | None = None) -> dict[str, Any]:
    """This run's record, taken as it starts (the commit is the code that runs)."""
    now = datetime.datetime.now(datetime.UTC)
    return {
        "commit": commit(),
        "command": command(argv),
        "date": now.date().isoformat(),
        "machine": machine(),
        "started": now.isoformat(timespec="seconds"),
    }


def sources(extra: Iterable[str] = ()) -> list[str]:
    """The repository's Python files this process has imported, and `extra` (paths from
    the repository's root: what the benchmark runs in other processes)."""
    seen = set(extra)
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None)
        if not path or not Path(path).is_absolute():  # torch.ops' and torch.classes' are not
            continue
        p = Path(path).resolve()
        if p.is_relative_to(ROOT) and p.suffix == ".py":
            seen.add(str(p.relative_to(ROOT)))
    return sorted(seen)


def save(
    path: Path | str, data: dict[str, Any], meta: dict[str, Any], extra: Iterable[str] = ()
) -> None:
    """Write `data` to `path` with `meta` and the files measured (`sources`, and `extra`);
    what the file held before (another run) goes to its `history`, oldest first."""
    path = Path(path)
    history: list[dict[str, Any]] = []
    if path.exists():
        with contextlib.suppress(ValueError):
            old = json.loads(path.read_text())
            history = old.pop("history", [])
            if old.get("started") != meta.get("started"):
                history.append(old)
    out = dict(data) | meta | {"sources": sources(extra), "history": history}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


def changed_since(data: dict[str, Any], fallback: Iterable[str]) -> list[str] | None:
    """Which of the files a results file measured differ now (the working tree) from its
    commit: [] when none, None when that cannot be told (no commit recorded, or git does
    not know it)."""
    rev = str(data.get("commit", "")).removesuffix("+dirty")
    if (
        not rev
        or rev == "unknown"
        or not git("rev-parse", "--verify", "--quiet", rev + "^{commit}")
    ):
        return None
    paths = [p for p in data.get("sources") or list(fallback)]
    changed = git("diff", "--name-only", rev, "--", *paths)
    return changed.splitlines() if changed else []
