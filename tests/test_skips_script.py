"""scripts/skips.py, which makes `scripts/check-vllm.sh` fail when a module it should
run skipped (say, a vLLM whose module layout moved under `pytest.importorskip`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "skips.py"


def _run(tmp: Path, modules: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """pytest on `modules` (name -> source) in `tmp`, then skips.py on its report."""
    (tmp / "tests").mkdir()
    (tmp / "tests" / "__init__.py").touch()
    for name, source in modules.items():
        (tmp / "tests" / name).write_text(source)
    paths = [f"tests/{name}" for name in modules]
    junit = ["--junitxml=report.xml", "-p", "no:cacheprovider", "-q", *paths]
    subprocess.run([sys.executable, "-m", "pytest", *junit], cwd=tmp, capture_output=True)
    cmd = [sys.executable, str(SCRIPT), "report.xml", *paths]
    return subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)


def test_a_module_that_could_not_import_fails_the_check(tmp_path: Path) -> None:
    gone = "import pytest\npytest.importorskip('no_such_vllm_module')\ndef test_a(): pass\n"
    done = _run(tmp_path, {"test_gone.py": gone, "test_ok.py": "def test_b(): pass\n"})
    assert done.returncode == 1
    assert "tests/test_gone.py ran no test that passed" in done.stderr
    assert "could not import 'no_such_vllm_module'" in done.stderr
    assert "test_ok.py" not in done.stderr


def test_a_case_skipped_by_design_in_a_module_that_ran_passes(tmp_path: Path) -> None:
    source = (
        "import pytest\ndef test_a(): pass\ndef test_b(): pytest.skip('not in the async loop')\n"
    )
    done = _run(tmp_path, {"test_some.py": source})
    assert done.returncode == 0, done.stderr
    assert "allowed: tests/test_some.py::test_b: skipped: not in the async loop" in done.stdout
