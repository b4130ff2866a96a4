"""Modules kvflow 0.4 moved into packages, importable by their old names until 0.5.

`import kvflow.layout` (or `from kvflow.events import Event`) still works, with a
`DeprecationWarning` naming the new place: the old name is the new module itself, not
a copy. Names inside a module that were renamed are not aliased.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

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
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran when it was imported."""


def install() -> None:
    """Answer the old names (once per process)."""
    if not any(isinstance(f, _OldNames) for f in sys.meta_path):
        sys.meta_path.append(_OldNames())
