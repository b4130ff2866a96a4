"""The wheels hold the whole tree: every package directory, every module and the package
data, for `kvflow` and `kvflow-redis`; the version is pyproject.toml's, everywhere.

An editable install reads the source tree, so only a built wheel shows what a user gets
(the wheel of 0.1.0 left out `kvflow.tiers` and did not import). scripts/check-wheel.sh
(CI) installs the wheels in a fresh virtualenv and runs them; this builds them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

import kvflow

ROOT = Path(__file__).resolve().parents[2]
REDIS = ROOT / "plugins" / "kvflow_redis"

# Where each distribution's importable packages live in the tree.
PACKAGE_ROOTS = {
    "kvflow": [
        ROOT / "kvflow",
        ROOT / "transports" / "kvflow_fs",
        ROOT / "transports" / "kvflow_zmq",
        ROOT / "transports" / "kvflow_nixl",
        ROOT / "plugins" / "kvflow_vllm",
    ],
    "kvflow_redis": [REDIS / "kvflow_redis"],
}


def _version(project: Path) -> str:
    with (project / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def _listed(where: Path) -> list[str]:
    """The files under `where` that git tracks or would track, relative to it."""
    cmd = ["git", "ls-files", "-co", "--exclude-standard"]
    return subprocess.run(cmd, cwd=where, capture_output=True, text=True, check=True).stdout.split()


def tree_files(dist: str) -> set[str]:
    """What the wheel of `dist` must hold: each package's modules and its data (what
    git tracks or would track, as in the checkout a wheel is built from)."""
    want = set()
    for root in PACKAGE_ROOTS[dist]:
        for rel in _listed(root):
            path = Path(root.name, rel)
            if path.suffix in (".py", ".json") or path.name == "py.typed":
                want.add(path.as_posix())
    return want


def _build_wheel(project: Path, out: Path) -> Path:
    """The wheel of `project`, built from a copy of what git tracks or would track there
    (so no build output of the tree, and nothing written into it)."""
    src = out / "src"
    for rel in _listed(project):
        if (project / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((project / rel).read_bytes())
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), "."]
    done = subprocess.run(cmd, cwd=src, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "kvflow": _build_wheel(ROOT, tmp_path_factory.mktemp("kvflow")),
        "kvflow_redis": _build_wheel(REDIS, tmp_path_factory.mktemp("redis")),
    }


def missing_from(wheel: Path, dist: str) -> list[str]:
    """The files of `dist`'s packages in the tree that `wheel` lacks, and the package
    directories among them named first."""
    have = set(zipfile.ZipFile(wheel).namelist())
    lost = sorted(tree_files(dist) - have)
    packages = sorted({str(Path(f).parent) for f in lost if f.endswith("__init__.py")})
    return [f"package {p.replace('/', '.')}" for p in packages] + lost


@pytest.mark.parametrize("dist", ["kvflow", "kvflow_redis"])
def test_the_wheel_holds_every_package_module_and_data_file(
    wheels: dict[str, Path], dist: str
) -> None:
    assert tree_files(dist), "the tree lists the packages' files"
    assert missing_from(wheels[dist], dist) == []


def test_the_check_names_a_package_left_out(tmp_path: Path, wheels: dict[str, Path]) -> None:
    """A wheel without `kvflow/tiers/` (the 0.1.0 wheel's defect) is caught by name."""
    stripped = tmp_path / wheels["kvflow"].name
    with zipfile.ZipFile(wheels["kvflow"]) as src, zipfile.ZipFile(stripped, "w") as dst:
        for item in src.infolist():
            if not item.filename.startswith("kvflow/tiers/"):
                dst.writestr(item, src.read(item))
    lost = missing_from(stripped, "kvflow")
    assert lost[0] == "package kvflow.tiers" and "kvflow/tiers/host.py" in lost


def test_the_wheels_carry_pyprojects_version_and_entry_points(wheels: dict[str, Path]) -> None:
    version = _version(ROOT)
    assert _version(REDIS) == version, "kvflow-redis is released with kvflow"
    with zipfile.ZipFile(wheels["kvflow"]) as whl:
        meta = whl.read(f"kvflow-{version}.dist-info/METADATA").decode()
        eps = whl.read(f"kvflow-{version}.dist-info/entry_points.txt").decode()
    assert f"\nVersion: {version}\n" in meta
    for line in ("fs = kvflow_fs:FsTransport", "kvflow = kvflow_vllm.plugin:register"):
        assert line in eps


def test_the_version_is_read_from_the_installed_metadata() -> None:
    version = _version(ROOT)
    assert metadata.version("kvflow") == version, "reinstall: `bash scripts/install.sh`"
    assert kvflow.__version__ == version
    out = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == f"kvflow {version}"


def test_the_installed_check_fails_on_a_partial_load_or_other_tokens() -> None:
    """scripts/check_installed.py's reading of `kvflow demo`'s table can fail."""
    from ..support.by_path import load

    problems = load("scripts/check_installed.py", "check_installed").demo_problems
    good = "│ 300 │ 300 │ 1.0 │ 0.5 │ 1.2 │ 0.1 │ yes │"
    assert problems(f"{good}\n{good}\nresult: OK", 300, 2) == []
    partial = "│ 300 │ 256 │ 1.0 │ 0.5 │ 1.2 │ 0.1 │ yes │"
    other = "│ 300 │ 300 │ 1.0 │ 0.5 │ 1.2 │ 0.1 │ NO │"
    assert problems(f"{good}\n{partial}\nresult: OK", 300, 2) == [
        f"not every prompt token loaded: {partial}"
    ]
    assert problems(f"{good}\n{other}\nresult: FAILED", 300, 2) == [
        f"tokens differ: {other}",
        "no 'result: OK'",
    ]
    assert problems(f"{good}\nresult: OK", 300, 2) == ["1 rows, not 2"]


def test_the_version_rules_in_the_docs_are_the_codes() -> None:
    """docs/install.md's table of what two kvflows must agree on holds the code's numbers,
    and the changelog has an entry for this version."""
    from kvflow.pd.params import PD_VERSION
    from kvflow_fs import _format as fs_format
    from kvflow_nixl import _wire as nixl_wire
    from kvflow_zmq import _wire as zmq_wire

    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in (ROOT / "docs" / "install.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| what")
    }
    got = {name.split()[0].strip("`"): now.split()[0] for name, now in rows.items()}
    assert got == {
        "P/D": str(PD_VERSION),
        "zmq": str(zmq_wire.WIRE_VERSION),
        "nixl": str(nixl_wire.WIRE_VERSION),
        "fs": fs_format.MAGIC.decode()[-1],
        "redis": "2",
    }
    redis_format = (REDIS / "kvflow_redis" / "_format.py").read_text()
    assert "this version reads format 2" in redis_format
    assert f"## {_version(ROOT)}" in (ROOT / "CHANGELOG.md").read_text()
