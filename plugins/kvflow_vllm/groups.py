"""vLLM's KV cache groups, each moved by its own kvflow engine.

With vLLM's hybrid KV cache manager a model's layers fall into groups (full
attention, sliding window, ...), each with its own block table. kvflow gives each
group its own namespace (its keys), transport and engine, as if it were a cache of
its own; the adapter asks every group and answers vLLM for the request. This module
holds what joins them: which groups move, and the completions vLLM must learn once
per request, when every group that took part is done.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["Pending", "transfer_groups"]


def transfer_groups(kv_cache_config: Any) -> list[int]:
    """The groups whose KV moves between engines (vLLM leaves out replicas it rebuilds)."""
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    return list(ids) if ids is not None else list(range(len(kv_cache_config.kv_cache_groups)))


class Pending:
    """Per request, the groups still transferring it: a request is finished (its
    blocks go back to vLLM, its load is complete) when the last of them is."""

    def __init__(self) -> None:
        self._left: dict[str, set[int]] = {}
        self._failed: set[str] = set()

    def expect(self, reqs: Iterable[str], group: int) -> None:
        for req in reqs:
            self._left.setdefault(req, set()).add(group)

    def done(self, reqs: Iterable[str], group: int, failed: Iterable[str] = ()) -> set[str]:
        """`group` finished `reqs` (`failed`: those that failed): the requests that every
        group has now finished. One no group was expected for is finished at once."""
        self._failed.update(failed)
        out = set()
        for req in reqs:
            left = self._left.get(req)
            if left is not None:
                left.discard(group)
                if left:
                    continue
                del self._left[req]
            out.add(req)
        return out

    def take_failed(self, reqs: set[str]) -> set[str]:
        """Which of the finished `reqs` failed in some group (forgotten once taken)."""
        failed = reqs & self._failed
        self._failed -= reqs
        return failed
