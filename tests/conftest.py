"""Shared fixtures: real runtimes that are always shut down after the test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvflow.runtime import Runtime


@pytest.fixture
def make_runtime() -> Iterator[Callable[..., Runtime]]:
    """`make_runtime(name, cls=Runtime, **kwargs)`: a runtime shut down and joined at teardown."""
    made: list[Runtime] = []

    def make(name: str, cls: type[Runtime] = Runtime, **kwargs: Any) -> Runtime:
        rt = cls(name, **kwargs)
        made.append(rt)
        return rt

    yield make
    stuck = [rt.name for rt in made if not rt.shutdown(timeout=10.0)]
    assert not stuck, f"runtimes did not stop: {stuck}"
