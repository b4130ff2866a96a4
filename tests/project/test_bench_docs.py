"""Every table of README.md and docs/ between `<!-- bench:NAME -->` markers is its
results file rendered (bench/run.py), captioned with the commit, command, date and
machine the file records, and says so when the code it measured has changed since.
Every record a results file holds (its run, each section's run, each earlier run in
`history`) is checked against git: the commits it names exist (and the one that added
its results touched that file), its sources are git blob ids, and ids filled in after
the run say so. Git is required: these checks read the repository's history."""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from ..support.by_path import load

ROOT = Path(__file__).parents[2]


run = load("bench/run.py", "bench_run")
record = sys.modules["record"]  # bench/record.py, as run.py imports it
BLOB = re.compile(r"[0-9a-f]{40}")


def _results() -> list[Path]:
    return sorted((ROOT / "bench" / "results").glob("*.json"))


def git(*args: str) -> subprocess.CompletedProcess[str]:
    """`git ARGS` in the repository; a missing git fails the test that asked."""
    assert shutil.which("git"), "git is not installed: these checks read the repository"
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


@cache
def commit_id(rev: str) -> str | None:
    """The full id of commit `rev`, or None where the repository holds no such commit."""
    done = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    return done.stdout.strip() if done.returncode == 0 else None


@cache
def commits_touching(rel: str) -> tuple[str, ...]:
    """Full ids of the commits that changed `rel`, oldest first."""
    done = git("log", "--reverse", "--format=%H", "--", rel)
    assert done.returncode == 0, done.stderr
    return tuple(done.stdout.split())


def records(data: dict[str, Any], where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every run a results file records: its own, each section's that keeps its own
    sources (`NAME_run`), and every earlier one in `history`, with where it is."""
    yield where or "the file", data
    within = f"{where}." if where else ""
    for key, value in data.items():
        if key.endswith("_run") and isinstance(value, dict) and "sources" in value:
            yield f"{within}{key}", value
    for i, old in enumerate(data.get("history") or []):
        yield from records(old, f"{within}history[{i}]")


def problems(data: dict[str, Any], rel: str) -> list[str]:
    """What is not true of the records of `data`, the results file `rel` (a path from the
    repository's root), by the repository's history."""
    out = []
    for where, rec in records(data):
        section = where.split(".")[-1].endswith("_run")
        for key in ("command", "date", "machine"):
            if not rec.get(key) and not section:
                out.append(f"{where}: no {key}")
        rev, added = rec.get("commit"), rec.get("committed_in")
        if not rev and not added and not section:
            out.append(f"{where}: neither commit nor committed_in")
        if added:
            full = commit_id(added)
            if full is None:
                out.append(f"{where}: committed_in {added}: no such commit")
            elif full not in commits_touching(rel):
                out.append(f"{where}: committed_in {added} did not change {rel}")
        elif rev and commit_id(rev.removesuffix("+dirty")) is None:
            out.append(f"{where}: commit {rev}: no such commit (name committed_in)")
        for mark in record.MARKS:
            if mark in rec and not (isinstance(rec[mark], str) and rec[mark]):
                out.append(f"{where}: {mark} says nothing")
        sources = rec.get("sources")
        if not isinstance(sources, dict):
            out.append(f"{where}: sources is not {{file: blob id}}: {str(sources)[:80]}")
            continue
        if bad := [f for f, b in sources.items() if not (isinstance(b, str) and BLOB.fullmatch(b))]:
            out.append(f"{where}: sources not git blob ids: {', '.join(bad[:3])}")
        if not sources and not rec.get("not_fingerprinted"):
            out.append(f"{where}: no sources, and no not_fingerprinted saying why")
        if sources and rec.get("not_fingerprinted"):
            out.append(f"{where}: not_fingerprinted, yet it has sources")
        if sources and not rec.get("started") and not rec.get("sources_reconstructed"):
            # record.start() records `started`: a run without it predates bench/record.py,
            # so its ids were filled in after it
            out.append(f"{where}: no `started`, yet sources not marked sources_reconstructed")
    return out


def refilled(data: dict[str, Any], earlier: list[dict[str, Any]]) -> list[str]:
    """Records of `data` whose sources differ from those the first of `earlier` (the
    file's committed versions, oldest first) that holds the same run had, without
    saying they were reconstructed."""
    out = []
    for where, rec in records(data):
        if rec.get("sources_reconstructed") or not rec.get("started"):
            continue  # marked, or checked by `problems`
        ident = tuple(rec.get(k) for k in ("command", "commit", "date", "started"))
        first = next(
            (
                old
                for version in earlier
                for _, old in records(version)
                if tuple(old.get(k) for k in ("command", "commit", "date", "started")) == ident
            ),
            None,
        )
        if first is not None and first.get("sources") != rec.get("sources"):
            out.append(f"{where}: sources differ from those it was first committed with")
    return out


def committed_versions(rel: str) -> list[dict[str, Any]]:
    versions = []
    for c in commits_touching(rel):
        with_file = git("show", f"{c}:{rel}")
        try:
            versions.append(json.loads(with_file.stdout))
        except ValueError:
            continue  # not JSON then (a file before the format settled)
    return versions


@pytest.mark.parametrize("page", run.DOCS, ids=lambda p: p.name)
def test_each_table_is_its_results_file_rendered(page: Path) -> None:
    text = page.read_text()
    new = run.render(text)
    diff = "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True), n=0))
    assert new == text, (
        f"{page.name}: a table differs from its results file, or a file it measured has "
        "changed since (then its caption must say so): `python bench/run.py --render` "
        f"rewrites them; `git diff` shows what changed.\n{diff[:3000]}"
    )


PLAIN_ROW_FILES = (
    "tests/engine/test_e2e_fs.py",
    "tests/engine/test_e2e_pd.py",
    "tests/serving/test_serve_pd.py",
)


def test_the_default_set_shows_a_cell_of_every_path(tmp_path: Path) -> None:
    """The README's command (`python3 -m pytest`, slow tests left out) runs one cell of
    docs/compatibility.md per kvflow path (issue 48), from the plain row's files (those
    the page names; collecting them alone takes seconds, collecting every engine test
    half a minute: a cell elsewhere is not counted, so this can fail, never pass
    wrongly)."""
    from ..conftest import LIST_CELLS_ENV
    from ..support.compat import PATHS

    out = tmp_path / "cells.jsonl"
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    env = dict(os.environ, **{LIST_CELLS_ENV: str(out)})
    proc = subprocess.run(
        [*cmd, *PLAIN_ROW_FILES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cells = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted({c["path"] for c in cells}) == sorted(PATHS), cells


def test_every_table_is_shown_and_every_marker_names_one() -> None:
    shown = [n for p in run.DOCS for n in re.findall(r"<!-- bench:([\w-]+) -->", p.read_text())]
    assert sorted(shown) == sorted(run.TABLES)
    assert all((ROOT / "bench" / argv[0]).exists() for argv, _, _ in run.BENCHES.values())
    with pytest.raises(SystemExit, match=r"bench:nope -->: no such table; valid: fs-io, "):
        run.render("<!-- bench:nope -->\n<!-- /bench:nope -->")


@pytest.mark.parametrize("path", _results(), ids=lambda p: p.name)
def test_every_results_file_records_what_measured_it(path: Path) -> None:
    data = json.loads(path.read_text())
    assert isinstance(data.get("history"), list), f"{path.name}: no history of earlier runs"
    rel = str(path.relative_to(ROOT))
    assert problems(data, rel) == []
    assert refilled(data, committed_versions(rel)) == []
    for name, (source, _, section) in run.TABLES.items():
        if section and source == path.stem:  # a section's table is captioned by its own run
            own = data[f"{section}_run"]
            assert all(own.get(k) for k in ("command", "date", "machine")), name
            assert own.get("commit") or own.get("committed_in"), name


def test_bench_results_holds_results_files_only() -> None:
    """bench/results/ holds the results files the tables are rendered from (each checked
    above) and nothing else: no logs, no folder of a GPU session's logs and raw outputs
    (those are docs/gpu-runs/'s). Files git tracks or would add; ignored scratch
    (*.tmp) is not counted."""
    done = git("ls-files", "--cached", "--others", "--exclude-standard", "--", "bench/results")
    assert done.returncode == 0, done.stderr
    files = [Path(p) for p in done.stdout.splitlines()]
    others = [str(p) for p in files if p.parent != Path("bench/results") or p.suffix != ".json"]
    assert files and others == [], f"not results files (GPU runs go to docs/gpu-runs/): {others}"


def _a_run(tmp_path: Path) -> tuple[dict[str, Any], str]:
    """A results file as record.save writes it, and a results file's path in git."""
    out = tmp_path / "x.json"
    meta = record.start(["bench/x.py"])  # HEAD's commit
    record.save(out, {"rows": [1]}, meta, extra=["kvflow/config.py"])
    return json.loads(out.read_text()), "bench/results/zmq.json"


def test_each_record_check_fails_on_a_record_that_is_not_true(tmp_path: Path) -> None:
    good, rel = _a_run(tmp_path)
    assert problems(good, rel) == []
    first, last = commits_touching(rel)[0], commits_touching("bench/record.py")[-1]

    def broken(**change: Any) -> list[str]:
        data = json.loads(json.dumps(good))
        for key, value in change.items():
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        return problems(data, rel)

    assert broken(commit="0000000") == [
        "the file: commit 0000000: no such commit (name committed_in)"
    ]
    assert broken(committed_in="0000000") == ["the file: committed_in 0000000: no such commit"]
    if commit_id(last) not in commits_touching(rel):
        assert broken(committed_in=last[:7]) == [
            f"the file: committed_in {last[:7]} did not change {rel}"
        ]
    assert broken(committed_in=first[:7]) == []
    paths = list(good["sources"])
    assert broken(sources=paths) == [
        f"the file: sources is not {{file: blob id}}: {str(paths)[:80]}"
    ]
    assert broken(sources={"kvflow/config.py": "kvflow/config.py"}) == [
        "the file: sources not git blob ids: kvflow/config.py"
    ]
    assert broken(sources={}) == ["the file: no sources, and no not_fingerprinted saying why"]
    assert broken(sources={}, not_fingerprinted="it predates record.py") == []
    assert broken(not_fingerprinted="x") == ["the file: not_fingerprinted, yet it has sources"]
    assert broken(started=None) == [
        "the file: no `started`, yet sources not marked sources_reconstructed"
    ]
    assert broken(started=None, sources_reconstructed="ids at its commit") == []
    assert broken(sources_reconstructed="") == ["the file: sources_reconstructed says nothing"]
    assert broken(machine=None, commit=None) == [
        "the file: no machine",
        "the file: neither commit nor committed_in",
    ]
    in_history = json.loads(json.dumps(good)) | {"history": [{**good, "commit": "0000000"}]}
    del in_history["history"][0]["history"]
    assert problems(in_history, rel) == [
        "history[0]: commit 0000000: no such commit (name committed_in)"
    ]


def test_sources_filled_in_after_the_run_must_say_so(tmp_path: Path) -> None:
    now, _ = _a_run(tmp_path)
    then = json.loads(json.dumps(now)) | {"sources": list(now["sources"])}  # paths only
    assert refilled(now, [then]) == [
        "the file: sources differ from those it was first committed with"
    ]
    assert refilled(now, [now]) == []
    assert refilled(now, []) == []  # a run not committed yet
    marked = now | {"sources_reconstructed": "blob ids at its commit, filled in later"}
    assert refilled(marked, [then]) == []
    moved = {"rows": [], "history": [now]}  # a later run moved it to history: still found
    assert refilled(moved, [then]) == [
        "history[0]: sources differ from those it was first committed with"
    ]


def test_every_commit_the_docs_cite_exists() -> None:
    """A seven-digit commit id in README.md or docs/ names a commit of this repository
    (figures of earlier runs are cited by the commit that holds them)."""
    cited = {
        (page.name, c)
        for page in run.DOCS
        for c in re.findall(r"(?<![\w./-])([0-9a-f]{7})(?:\+dirty)?(?!\w)", page.read_text())
        if re.search(r"[a-f]", c) and re.search(r"[0-9]", c)
    }
    assert cited, "no commit cited: the pattern finds nothing"
    assert sorted((p, c) for p, c in cited if commit_id(c) is None) == []


def test_a_second_run_keeps_the_first_in_its_history(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    first, second = record.start(["bench/x.py"]), record.start(["bench/x.py", "--quick"])
    first["started"], second["started"] = "t1", "t2"
    record.save(out, {"rows": [1]}, first)
    record.save(out, {"rows": [1, 2]}, first)  # the same run, saved again: replaced
    # a sectioned file re-read keeps the old run's marks at its top: not this run's
    old = json.loads(out.read_text()) | {"committed_in": "abc1234", "not_fingerprinted": "x"}
    record.save(out, old | {"rows": [3]}, second, extra=["kvflow/config.py"])
    data = json.loads(out.read_text())
    assert data["rows"] == [3] and data["command"] == "python bench/x.py --quick"
    assert not set(record.MARKS) & set(data)
    assert [(h["rows"], h["started"]) for h in data["history"]] == [([1, 2], "t1")]
    assert "bench/record.py" not in data["sources"]  # measures nothing
    assert "kvflow/config.py" in data["sources"]  # what it ran in other processes
    hashed = git("hash-object", "kvflow/config.py")
    assert hashed.returncode == 0, hashed.stderr
    assert data["sources"]["kvflow/config.py"] == hashed.stdout.strip()


def test_a_caption_says_when_the_code_it_measured_has_changed(tmp_path: Path) -> None:
    ran = record.fingerprint(["kvflow/config.py", "kvflow/keys.py"])

    def caption(sources: dict[str, str]) -> str:
        data = {"commit": "abc1234", "command": "python bench/x.py", "date": "d", "machine": "m"}
        return "\n".join(run.caption(data | {"sources": sources}))

    assert caption(ran) == "_`python bench/x.py`, commit abc1234, d, m._"
    edited = ran | {"kvflow/keys.py": record.blob(b"what it was then")}
    assert "Older than the code it describes" in caption(edited)
    assert "(`python bench/x.py` measures again)" in caption(edited)
    assert "Older than" in caption(ran | {"kvflow/gone.py": ran["kvflow/keys.py"]})  # removed
    assert "cannot be told" in caption({})


def test_a_section_is_captioned_by_its_own_run_and_says_what_was_reconstructed() -> None:
    ran = record.fingerprint(["kvflow/config.py"])
    hit = {"commit": "abc1234", "command": "python b.py --skip-miss", "date": "d2", "machine": "m2"}
    miss = {
        "command": "python b.py",
        "committed_in": "def5678",
        "date": "d1",
        "machine": "m1",
        "record_reconstructed": "its date and machine from the docs",
        "sources_reconstructed": "blob ids at def5678",
        "sources": ran,
    }
    data = hit | {"sources": ran, "miss_run": miss, "hit_run": hit | {"sources": ran}}
    assert run.caption(data, "miss") == [
        "_`python b.py`, commit not recorded (the results were committed in def5678), d1, m1._",
        "",
        "_Not recorded as it ran: its date and machine from the docs._",
        "",
        "_Its sources' fingerprint was reconstructed, not recorded as it ran: blob ids at "
        "def5678._",
    ]
    assert run.caption(data, "hit") == ["_`python b.py --skip-miss`, commit abc1234, d2, m2._"]
    with pytest.raises(KeyError):
        run.caption(hit, "miss")  # a section without its own record borrows none


def test_the_fault_matrix_shows_a_leak_and_a_server_that_said_nothing() -> None:
    """The fault tables (scripts/faults.py's results) name what went wrong, not a time."""
    faults = json.loads((ROOT / "bench" / "results" / "faults.json").read_text())
    rows = {name: dict(r) for name, r in faults["rows"].items()}
    assert {"producer-kill-queued", "port-taken", "store-full"} <= set(rows)
    rows["producer-kill-queued"]["blocks_back_s"] = None  # not back within idle_s
    rows["port-taken"]["said"] = None
    rows["store-full"]["blocks_back_s"] = None
    broken = faults | {"rows": rows}
    pd = {line.split(" | ")[0]: line for line in run.faults_table(broken) if "`" in line}
    assert pd["| `producer-kill-queued`"].endswith("| **LEAKED** |")
    assert "**logged nothing saying why**" in pd["| `port-taken`"]
    assert "**LEAKED**" not in pd["| `producer-kill-before-claim`"]
    store = {line.split(" | ")[0]: line for line in run.faults_store_table(broken) if "`" in line}
    assert store["| `store-full`"].endswith("| **LEAKED** |")
