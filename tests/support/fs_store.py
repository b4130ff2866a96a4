"""An fs store's transports for the fs test modules: `Factory` makes them over one
directory, `fs_worker` takes a conformance harness's worker as the `FsTransport` it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvflow.testing.conformance import Harness
from kvflow.transport import TransportContext
from kvflow_fs import FsOptions, FsTransport


class Factory:
    """Makes fs transports over one store; `options` apply to instances made after."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.options: dict[str, Any] = {}

    def __call__(self, context: TransportContext) -> FsTransport:
        return FsTransport(FsOptions(path=str(self.store), **self.options), context)


async def fs_worker(kv: Harness, **kw: Any) -> FsTransport:
    worker = await kv.worker(**kw)
    assert isinstance(worker, FsTransport)
    return worker
