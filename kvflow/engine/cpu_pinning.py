"""Other kvflow workers on this host pinned to the same CPU cores as this process.

Two engines whose workers are pinned to the same cores starve each other: vLLM's CPU
workers busy-wait for their next step (and vLLM keeps stepping while a P/D transfer is
pending), so on a shared core the other engine's worker, and kvflow's loop in it, may
not run for tens of seconds when the two run in different sessions (each its own
scheduler group). A producer then registers its offer and answers a pull only after the
consumer gave up. Found through the `kvflow inspect` discovery records.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import host_cpus
from ..observe.stream import Registration, discover

__all__ = ["pinned_neighbours"]


def pinned_neighbours(
    engine: str, own: set[int] | None = None, directory: Path | None = None
) -> list[tuple[Registration, set[int]]]:
    """Workers of other engines pinned to some of this process's cores, with the shared
    cores. Empty when this process is not pinned (it may run on every core)."""
    cpus = os.sched_getaffinity(0) if own is None else own
    everywhere = host_cpus()
    if cpus >= everywhere:
        return []
    found = []
    for reg in discover(directory, clean=False):
        if reg.role != "worker" or reg.engine == engine or reg.pid == os.getpid():
            continue
        try:
            theirs = os.sched_getaffinity(reg.pid)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if theirs < everywhere and (shared := cpus & theirs):
            found.append((reg, shared))
    return found
