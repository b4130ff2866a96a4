"""scripts/skips.py, which makes `scripts/check-vllm.sh` fail when a module it should
run skipped (say, a vLLM whose module layout moved under `pytest.importorskip`)."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "skips.py"


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


def test_an_import_skipped_inside_a_module_that_ran_fails_the_check(tmp_path: Path) -> None:
    """A module that ran still fails when one of its tests could not import: only the
    skip reason says so, in the words the check's modules use."""
    source = (
        "import pytest\ndef test_a(): pass\n"
        "def test_b(): pytest.importorskip('no_such_vllm_module', reason='needs vLLM installed')\n"
    )
    done = _run(tmp_path, {"test_some.py": source})
    assert done.returncode == 1, done.stdout
    assert "tests/test_some.py::test_b: skipped: needs vLLM installed" in done.stderr
    assert "ran no test that passed" not in done.stderr


def _pattern() -> re.Pattern[str]:
    spec = importlib.util.spec_from_file_location("skips", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pattern: re.Pattern[str] = module.IMPORT_FAILED
    return pattern


def _checked_modules() -> list[str]:
    """The modules scripts/check-vllm.sh runs, from its `modules=(...)`."""
    text = (ROOT / "scripts" / "check-vllm.sh").read_text()
    found = re.search(r"^modules=\((.*?)\)", text, re.S | re.M)
    assert found, "check-vllm.sh has no modules=(...)"
    return found.group(1).split()


def _skip_reasons() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(module, reason) of each importorskip and of each other skip in the check's
    modules, read from their source."""
    imports: list[tuple[str, str]] = []
    others: list[tuple[str, str]] = []
    for module in _checked_modules():
        for node in ast.walk(ast.parse((ROOT / module).read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            kind = node.func.attr
            if kind not in ("importorskip", "skip", "skipif"):
                continue
            reasons = [k.value for k in node.keywords if k.arg in ("reason", "msg")]
            if kind == "skip" and node.args:
                reasons.append(node.args[0])
            for reason in reasons:
                text = reason.value if isinstance(reason, ast.Constant) else None
                assert isinstance(text, str), f"{module}: a skip reason that is not a literal"
                (imports if kind == "importorskip" else others).append((module, text))
            if kind == "importorskip" and not reasons:
                imports.append((module, _pytests_own_reason()))
    return imports, others


def _pytests_own_reason() -> str:
    """What pytest.importorskip says when given no reason."""
    with pytest.raises(pytest.skip.Exception) as skipped:
        pytest.importorskip("no_such_vllm_module")
    return str(skipped.value.msg)


def test_every_import_skip_reason_of_the_checked_modules_counts_as_a_failed_import() -> None:
    imports, _ = _skip_reasons()
    assert imports, "found no importorskip in the check's modules"
    pattern = _pattern()
    for module, reason in [*imports, ("pytest", _pytests_own_reason())]:
        assert pattern.search(reason), f"{module}: {reason!r} does not count as an import"
    assert "No module named 'no_such_vllm_module'" in _pytests_own_reason()


def test_the_checked_modules_skips_by_design_do_not_count_as_failed_imports() -> None:
    _, others = _skip_reasons()
    assert others, "the check's modules skip nothing by design any more: drop this test"
    pattern = _pattern()
    for module, reason in others:
        assert not pattern.search(reason), f"{module}: {reason!r} counts as a failed import"
