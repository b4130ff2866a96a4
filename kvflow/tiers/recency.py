"""What a tier served counts as used in the store below it, off the load's path
(decision 92).

A store that evicts what was used least recently sees only its own reads; the chunks a
tier above it served must count too, or it evicts a prefix that is hot above it as its
coldest (and lookups, which ask the store, then miss it). `Recency` hands them to the
store's `Transport.touch` from a task of its own: a load neither waits for the store
nor fails by it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio

from ..keys import ChunkKey
from ..transport import Transport

__all__ = ["Recency"]

log = logging.getLogger("kvflow.tiers")

MAX_WAITING = 65536
"""Keys waiting to be told at most; a store that does not keep up misses the others."""
TOUCH_TIMEOUT_S = 10.0
"""How long one `touch` may take before its keys are given up."""


class Recency:
    """Tells `store` of the chunks a tier above it served (`used`), a batch at a time."""

    def __init__(self, store: Transport) -> None:
        self.store = store
        self._waiting: dict[ChunkKey, None] = {}  # in order, once each
        self._telling = False

    def used(self, keys: Sequence[ChunkKey]) -> None:
        """`keys` were served above `store` (call from the loop's thread); returns at once."""
        for key in keys[: max(0, MAX_WAITING - len(self._waiting))]:
            self._waiting[key] = None
        if self._waiting and not self._telling:
            self._telling = True
            trio.lowlevel.spawn_system_task(self._tell, name="kvflow-recency")

    async def _tell(self) -> None:
        try:
            while self._waiting:
                keys, self._waiting = list(self._waiting), {}
                with trio.move_on_after(TOUCH_TIMEOUT_S):
                    try:
                        await self.store.touch(keys)
                    except Exception as exc:  # a system task must not raise
                        name = type(self.store).name
                        log.info("kvflow tier %s: counting %d chunk(s) as used: %s",
                                 name, len(keys), exc)  # fmt: skip
        finally:
            self._telling = False
