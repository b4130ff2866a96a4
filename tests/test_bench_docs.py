"""Every table of README.md and docs/ between `<!-- bench:NAME -->` markers is its
results file rendered (bench/run.py), captioned with the commit, command, date and
machine the file records, and says so when the code it measured has changed since."""

from __future__ import annotations

import difflib
import json
import re
import sys
from pathlib import Path

import pytest

from .scripts import load

ROOT = Path(__file__).parent.parent


run = load("bench/run.py", "bench_run")
record = sys.modules["record"]  # bench/record.py, as run.py imports it


def _results() -> list[Path]:
    return sorted((ROOT / "bench" / "results").glob("*.json"))


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


def test_every_table_is_shown_and_every_marker_names_one() -> None:
    shown = [n for p in run.DOCS for n in re.findall(r"<!-- bench:([\w-]+) -->", p.read_text())]
    assert sorted(shown) == sorted(run.TABLES)
    assert all((ROOT / "bench" / argv[0]).exists() for argv, _, _ in run.BENCHES.values())
    with pytest.raises(SystemExit, match=r"bench:nope -->: no such table; valid: fs-io, "):
        run.render("<!-- bench:nope -->\n<!-- /bench:nope -->")


@pytest.mark.parametrize("path", _results(), ids=lambda p: p.name)
def test_every_results_file_records_what_measured_it(path: Path) -> None:
    data = json.loads(path.read_text())
    for key in ("command", "date", "machine"):
        assert data.get(key), f"{path.name}: no {key}"
    assert data.get("commit") or data.get("committed_in"), f"{path.name}: no commit"
    assert isinstance(data.get("history"), list), f"{path.name}: no history of earlier runs"


def test_a_second_run_keeps_the_first_in_its_history(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    first, second = record.start(["bench/x.py"]), record.start(["bench/x.py", "--quick"])
    first["started"], second["started"] = "t1", "t2"
    record.save(out, {"rows": [1]}, first)
    record.save(out, {"rows": [1, 2]}, first)  # the same run, saved again: replaced
    record.save(out, {"rows": [3]}, second, extra=["kvflow/config.py"])
    data = json.loads(out.read_text())
    assert data["rows"] == [3] and data["command"] == "python bench/x.py --quick"
    assert [(h["rows"], h["started"]) for h in data["history"]] == [([1, 2], "t1")]
    assert "bench/record.py" not in data["sources"]  # measures nothing
    assert "kvflow/config.py" in data["sources"]  # what it ran in other processes
    blob = record.git("hash-object", "kvflow/config.py")
    assert data["sources"]["kvflow/config.py"] == (blob or data["sources"]["kvflow/config.py"])


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
