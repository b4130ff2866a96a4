"""bench/plots.py draws every plot docs/benchmarks.md shows, from the committed results."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from ..support.by_path import load

ROOT = Path(__file__).parents[2]

pytest.importorskip("matplotlib", reason="the plots need matplotlib (pip install -e '.[bench]')")


def _plots() -> ModuleType:
    return load("bench/plots.py", "bench_plots")


def test_every_plot_is_a_small_png_drawn_from_the_committed_results(tmp_path: Path) -> None:
    plots = _plots()
    drawn = plots.draw_all(plots.RESULTS, tmp_path)
    assert sorted(p.name for p in drawn) == sorted(f"bench-{n}.png" for n in plots.PLOTS)
    for path in drawn:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), path
        assert len(data) < 60_000, (path, len(data))


def test_the_page_shows_every_plot_and_each_is_in_docs_img() -> None:
    plots = _plots()
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    shown = set(re.findall(r"\]\(img/(bench-[\w-]+\.png)\)", page))
    assert shown == {f"bench-{n}.png" for n in plots.PLOTS}
    assert all((ROOT / "docs" / "img" / name).exists() for name in shown)


def test_a_missing_results_file_skips_its_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plots = _plots()
    results = tmp_path / "results"
    results.mkdir()
    (results / "ttft-tiers.json").write_bytes((plots.RESULTS / "ttft-tiers.json").read_bytes())
    drawn = plots.draw_all(results, tmp_path / "img")
    assert [p.name for p in drawn] == ["bench-ttft-tiers.png"]
    assert capsys.readouterr().out.count("not drawn") == len(plots.PLOTS) - 1
