"""The shape of vLLM's connector contract (`KVConnectorBase_V1`), read from its source."""

from __future__ import annotations

import ast
from pathlib import Path


def connector_api(base_py: Path) -> dict[str, str]:
    """Each method of `KVConnectorBase_V1` with its decorators and parameters, as text."""
    tree = ast.parse(base_py.read_text())
    (cls,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVConnectorBase_V1"
    ]
    api = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            decorators = "".join(f"@{ast.unparse(d)} " for d in node.decorator_list)
            args = ast.unparse(node.args)
            returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
            api[node.name] = f"{decorators}({args}){returns}"
    return api
