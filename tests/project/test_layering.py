"""The core stands alone: nothing under `kvflow/` imports vLLM, the adapter or a
transport, `kvflow proxy` serves with vLLM unimportable, and the adapter adds `kvflow
demo` through the `kvflow.commands` entry point."""

from __future__ import annotations

import ast
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOT_CORE = ("vllm", "kvflow_vllm", "kvflow_fs", "kvflow_zmq", "kvflow_nixl", "kvflow_redis")

# Run before the code under test: any import of vLLM fails, as on a machine without it.
BLOCK_VLLM = """
import sys
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm":
            raise ImportError(f"{name} is blocked by the test (no vLLM here)")
        return None
sys.meta_path.insert(0, _Blocker())
from kvflow.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize(
    "path", sorted((ROOT / "kvflow").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_core_imports_no_vllm_adapter_or_transport(path: Path) -> None:
    assert sorted(_imports(path) & set(NOT_CORE)) == []


def _kvflow(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", BLOCK_VLLM, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("mode", ["pd", "routed"])
def test_kvflow_proxy_serves_without_vllm(mode: str) -> None:
    dead = "http://127.0.0.1:9"
    servers = ["--prefill", dead, "--decode", dead]
    if mode == "routed":  # kvflow.route: its index, event followers and health checks
        events = "tcp://127.0.0.1:9"
        servers = ["--server", dead, "--route", "prefix", "--kv-events", events]
    proc = _kvflow("proxy", *servers, "--port", "0")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "kvflow proxy on http://127.0.0.1:PORT: ..."
        assert line.startswith("kvflow proxy on http://"), line + proc.stderr.read()
        url = line.split()[3].rstrip(":")
        with urllib.request.urlopen(f"{url}/health", timeout=30) as answer:
            assert answer.status == 200
    finally:
        proc.kill()
        proc.communicate()


def test_the_adapter_adds_kvflow_demo_which_says_it_needs_vllm_when_vllm_is_missing() -> None:
    listed = _kvflow("--help")
    out, _ = listed.communicate(timeout=120)
    assert "demo" in out and "proxy" in out
    demo = _kvflow("demo")
    _, err = demo.communicate(timeout=120)
    assert demo.returncode == 2
    assert "kvflow demo needs vLLM" in err and "blocked by the test" in err


# -- the house's shape (issue 29): sizes a reader can take in, and tests that stand alone

SOURCES = [p for d in ("kvflow", "transports", "plugins") for p in sorted((ROOT / d).rglob("*.py"))]
TESTS = sorted((ROOT / "tests").rglob("*.py")) + sorted(
    (ROOT / "plugins" / "kvflow_redis" / "tests").glob("*.py")
)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_no_function_is_over_80_lines() -> None:
    long = [
        f"{_rel(path)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in SOURCES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (node.end_lineno or 0) - node.lineno + 1 > 80
    ]
    assert long == []


def test_the_testing_modules_are_under_600_lines_and_test_files_under_800() -> None:
    testing = [p for p in sorted((ROOT / "kvflow" / "testing").glob("*.py"))]
    over = [_rel(p) for p in testing if len(p.read_text().splitlines()) > 600]
    over += [_rel(p) for p in TESTS if len(p.read_text().splitlines()) > 800]
    assert over == []


def test_no_test_module_imports_another() -> None:
    crossing = []
    for path in TESTS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(a.name for a in node.names)]
                if any(n.rsplit(".", 1)[-1].startswith("test_") for n in names):
                    crossing.append(f"{_rel(path)}:{node.lineno}")
    assert crossing == []


# -- kvflow's rooms (issue 47): packages named for what they hold, arrows one way


def _unit(module: str) -> str:
    """The room a module of kvflow is in: its subpackage (`geometry`, `engine`, ...) or,
    for a module at the top (`transport`, `config`, ...), itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvflow"


def _kvflow_imports() -> dict[str, set[str]]:
    """Each module of kvflow and the kvflow modules it imports anywhere in its text
    (relative and absolute, under TYPE_CHECKING too)."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "kvflow").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_init else parts)
        package = module if is_init else module.rsplit(".", 1)[0]
        found = out.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)]
                if node.level:
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                if target.startswith("kvflow"):
                    names = [f"{target}.{a.name}" for a in node.names] if not node.module else []
                    found |= {target, *names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("kvflow")}
    return out


def test_kvflows_rooms_import_each_other_one_way() -> None:
    """Between kvflow's subpackages and top-level modules, no circle of imports (the
    package's own `__init__`, the public face, is left out: it imports every room)."""
    graph: dict[str, set[str]] = {}
    for module, targets in _kvflow_imports().items():
        if module != "kvflow":
            unit = _unit(module)
            graph.setdefault(unit, set()).update(
                _unit(t) for t in targets if t != "kvflow" and _unit(t) != unit
            )
    state: dict[str, int] = {}
    path: list[str] = []

    def circle_from(unit: str) -> list[str]:
        state[unit] = 1
        path.append(unit)
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := circle_from(nxt)):
                return found
        state[unit] = 2
        path.pop()
        return []

    circles = [c for unit in sorted(graph) if unit not in state and (c := circle_from(unit))]
    assert circles == []


def test_the_transport_contract_and_geometry_know_nothing_above_them() -> None:
    """`kvflow.transport` imports nothing of P/D (a peer transport's context is
    `kvflow.pd.PeerContext`); `kvflow.geometry` imports nothing of kvflow but itself."""
    imports = _kvflow_imports()
    assert sorted(t for t in imports["kvflow.transport"] if t.startswith("kvflow.pd")) == []
    outside = {
        f"{m} imports {t}"
        for m, targets in imports.items()
        if m.startswith("kvflow.geometry")
        for t in targets
        if not t.startswith("kvflow.geometry")
    }
    assert sorted(outside) == []
