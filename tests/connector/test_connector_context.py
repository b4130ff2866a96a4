"""The connector's sides hold what both roles share, never the connector (issue 47,
item 2): `kvflow_vllm.connector` has no import circle, counting imports under
`TYPE_CHECKING`; no side module reaches `connector.py`; the shared context is frozen,
and a side's constructor takes it, not the connector."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ..support.vllm_scheduler import MakeHarness

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM installed"
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "kvflow_vllm.connector"
DIR = ROOT / "plugins" / "kvflow_vllm" / "connector"
SIDES = ("scheduler", "worker")


def _module(path: Path) -> str:
    return PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"


def _targets(node: ast.Import | ast.ImportFrom, here: str, is_package: bool) -> list[str]:
    """The modules `node` imports, absolute: `from X import name` imports the module
    `X.name` where there is one, else `X` (checked by the caller)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative to this module's package
        parts = here.split(".") if is_package else here.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, node.module] if node.module else parts)
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(directory: Path = DIR) -> dict[str, set[str]]:
    """Each module of the package and the package's modules it imports anywhere in its
    source (at the top, in a function, under `if TYPE_CHECKING:`), relative or not."""
    paths = sorted(directory.glob("*.py"))
    modules = {_module(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        here = _module(path)
        graph[here] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[here] |= {t for t in _targets(node, here, False) if t in modules}
            elif isinstance(node, ast.ImportFrom):
                *names, base = _targets(node, here, path.stem == "__init__")
                graph[here] |= {n if n in modules else base for n in names} & modules
        graph[here].discard(here)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A circle of imports in `graph` (its modules in order, the first again at the
    end), or [] if there is none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        for nxt in sorted(graph.get(node, ())):
            if cycle := visit(nxt, [*path, node]):
                return cycle
        done.add(node)
        return []

    for start in sorted(graph):
        if cycle := visit(start, []):
            return cycle
    return []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The check itself: relative, absolute, `from . import x`, and TYPE_CHECKING-only
    imports are edges, and a circle through them is found."""
    (tmp_path / "__init__.py").write_text("from .a import A\n")
    (tmp_path / "a.py").write_text("from . import b\nA = 1\n")
    (tmp_path / "b.py").write_text("import kvflow_vllm.connector.c\n")
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
    )
    graph = import_graph(tmp_path)
    assert graph[PACKAGE] == {f"{PACKAGE}.a"}
    assert find_cycle(graph) == [f"{PACKAGE}.{m}" for m in ("a", "b", "c", "a")]


def test_the_connector_package_has_no_import_circle() -> None:
    graph = import_graph()
    assert f"{PACKAGE}.context" in graph and f"{PACKAGE}.connector" in graph
    cycle = find_cycle(graph)
    assert cycle == [], "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("side", SIDES)
def test_no_side_module_reaches_the_connector(side: str) -> None:
    """A side imports the shared context; nothing it imports, even for its types, leads
    back to `connector.py` (which builds the sides)."""
    graph = import_graph()
    reached = reachable(graph, f"{PACKAGE}.{side}")
    assert f"{PACKAGE}.connector" not in reached
    assert PACKAGE not in reached  # the package's __init__ imports connector.py
    assert f"{PACKAGE}.context" in reached


@needs_vllm
def test_the_shared_context_is_frozen() -> None:
    from kvflow_vllm.connector.context import ConnectorContext

    fields = dataclasses.fields(ConnectorContext)
    context = ConnectorContext(**{f.name: None for f in fields})  # type: ignore[arg-type]
    for field in fields:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(context, field.name, object())
    with pytest.raises((AttributeError, TypeError)):  # slots: no attribute to add either
        context.extra = 1  # type: ignore[attr-defined]


@needs_vllm
@pytest.mark.parametrize("side", SIDES)
def test_a_side_is_built_from_the_context_not_the_connector(side: str) -> None:
    from kvflow_vllm.connector.scheduler import KVFlowScheduler
    from kvflow_vllm.connector.worker import KVFlowWorker

    cls = {"scheduler": KVFlowScheduler, "worker": KVFlowWorker}[side]
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    annotations = [str(p.annotation) for p in params]
    assert annotations[0] == "ConnectorContext"
    assert not [a for a in annotations if "Connector" in a and a != "ConnectorContext"]


@needs_vllm
@pytest.mark.parametrize("loop", ["sync"])  # the fixture's loop: one is enough here
def test_a_live_scheduler_side_shares_the_context_and_holds_no_connector(
    harness: MakeHarness, tmp_path: Path
) -> None:
    """vLLM's real scheduler builds the connector: its side holds the connector's
    context itself, and nothing of the side's is the connector."""
    from ..support.vllm_scheduler import fs_config

    conn = harness(fs_config(tmp_path), 16).connector
    side = conn.scheduler_side
    assert side is not None and conn.worker_side is None
    assert side.context is conn.context
    assert not [name for name, value in vars(side).items() if value is conn]
