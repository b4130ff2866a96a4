"""Modules kvflow 0.4 moved into packages, importable by their old names until 0.5.

`import kvflow.layout` (or `from kvflow.events import Event`) still works, with a
`DeprecationWarning` naming the new place: the old name is the new module itself, not
a copy. Names 0.4 moved between modules or renamed answer through `old_names`, a
module `__getattr__`, the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "install", "old_names", "old_submodule"]

MOVED = {
    "kvflow.layout": "kvflow.geometry.layout",
    "kvflow.cells": "kvflow.geometry.cells",
    "kvflow.pd.topology": "kvflow.geometry.topology",
    "kvflow.reshape": "kvflow.shapes.reshape",
    "kvflow.reblock": "kvflow.shapes.reblock",
    "kvflow.replicas": "kvflow.shapes.replicas",
    "kvflow.events": "kvflow.observe.events",
    "kvflow.event_stream": "kvflow.observe.stream",
    "kvflow.eventlog": "kvflow.observe.log",
    "kvflow.stats": "kvflow.observe.stats",
    "kvflow.scheduler": "kvflow.engine.scheduler",
    "kvflow.worker": "kvflow.engine.worker",
    "kvflow.transfers": "kvflow.engine.transfers",
    "kvflow.lending": "kvflow.engine.lending",
    "kvflow.metadata": "kvflow.engine.metadata",
    "kvflow.staging": "kvflow.engine.staging",
    "kvflow.cpu_pinning": "kvflow.engine.cpu_pinning",
}
"""Old module name -> where it lives now."""


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old name goes in kvflow 0.5",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__  # importlib sets the old name's on it
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran when it was imported: give it back its own spec."""
        alias = module.__spec__
        if alias is not None and alias.name in self._specs:
            module.__spec__ = self._specs.pop(alias.name)


def old_names(module: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A `__getattr__` for `module` answering the names 0.4 moved out of it or renamed
    (`{"old": "new.module:name"}`), with a `DeprecationWarning`, until 0.5."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, new = names[name].split(":")
        warnings.warn(
            f"{module}.{name} is {where}.{new} now; the old name goes in kvflow 0.5",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(where), new)

    return __getattr__


def old_submodule(package: str, name: str) -> ModuleType:
    """`package.name` as an attribute, where `name` is a submodule 0.4 moved (imported,
    so it warns); an `AttributeError` for any other name. For a package's `__getattr__`."""
    if f"{package}.{name}" not in MOVED:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(f"{package}.{name}")


def install() -> None:
    """Answer the old names (once per process)."""
    if not any(isinstance(f, _OldNames) for f in sys.meta_path):
        sys.meta_path.append(_OldNames())
