"""NIXL descriptor lists over whole KV memories: a worker's own and a producer's.

A whole-memory list holds one descriptor per (layer, run, block), a run being a
block's K or V half (or the whole block, when the cache packs it), prepared once in
NIXL's compressed form; a pull then only picks indices (`Table.index`). What moves in
pieces of blocks (a partial block, another layout, some heads) goes through lists of
the pull's own (`kvflow_nixl._reads`).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.geometry.layout import KVLayout, LayerGeometry
from kvflow.transport import TransportError

__all__ = [
    "MAX_DESCRIPTORS",
    "MEMORY_TYPES",
    "Table",
    "bases",
    "disjoint",
    "prepare",
    "release",
    "remove_agent",
]

log = logging.getLogger("kvflow.nixl")

MAX_DESCRIPTORS = 1 << 27
"""Bounds a prepared whole-memory list (80 layers x 2 runs x 800k blocks), so that no
peer's `Regions` makes NIXL build an unbounded one (and indices stay int32)."""


def _address(span: memoryview) -> int:
    """Start address of a span (writable views via ctypes: 4x faster than numpy)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(span))
    except TypeError:
        return int(np.frombuffer(span, np.uint8).ctypes.data)


MEMORY_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}


def bases(layout: KVLayout) -> list[tuple[int, int]]:
    """(address, device id) of each layer's first byte: host buffers or CUDA tensors."""
    if layout.memory == "cpu":
        return [(_address(buf), 0) for buf in layout.buffers]
    return [(int(t.data_ptr()), int(t.device.index or 0)) for t in layout.tensors]


def disjoint(bases: Sequence[tuple[int, int]], sizes: Sequence[int]) -> list[Any]:
    """The layers' memory as NIXL registers it: overlapping or touching layers merged
    (layouts with the layer dimension inside the blocks interleave every layer)."""
    merged: list[list[int]] = []
    for (address, dev), n in sorted(
        zip(bases, sizes, strict=True), key=lambda r: (r[0][1], r[0][0])
    ):
        last = merged[-1] if merged else None
        if last is not None and last[2] == dev and address <= last[0] + last[1]:
            last[1] = max(last[1], address + n - last[0])
        else:
            merged.append([address, n, dev])
    return [(address, n, dev, "") for address, n, dev in merged]


@dataclass
class Table:
    """A prepared descriptor list over a whole KV memory: row `starts[layer] + r *
    num_blocks + block` is run `r` of `block` in `layer` (`LayerGeometry.block_runs`)."""

    dlist: Any
    starts: list[int]
    geometries: list[LayerGeometry]

    def index(self, layer: int, block_ids: np.ndarray) -> np.ndarray:
        g = self.geometries[layer]
        runs = len(g.block_runs())
        first = self.starts[layer] + np.arange(runs, dtype=np.int64)[:, None] * g.num_blocks
        return (first + block_ids[None, :]).reshape(-1).astype(np.int32)


def _strided(bases: Sequence[tuple[int, int]], geometries: Sequence[LayerGeometry]) -> Any:
    """NIXL's compressed (N x 5) form of a whole-memory table: per (layer, run) one row
    [address, length, device, stride, count] standing for its `count` blocks."""
    rows = [
        (base + off, n, dev, g.block_stride, g.num_blocks)
        for (base, dev), g in zip(bases, geometries, strict=True)
        for off, n in g.block_runs()
    ]
    return np.array(rows, dtype=np.uint64)


def prepare(
    agent: Any,
    who: str,
    bases: Sequence[tuple[int, int]],
    geometries: Sequence[LayerGeometry],
    memory: str,
    backend: str,
) -> Table:
    starts = [0]
    for g in geometries:
        starts.append(starts[-1] + len(g.block_runs()) * g.num_blocks)
    if starts[-1] > MAX_DESCRIPTORS:
        raise TransportError(
            f"{starts[-1]} block descriptors (layers x runs x blocks) exceed {MAX_DESCRIPTORS}"
        )
    dlist = agent.prep_xfer_dlist(who, _strided(bases, geometries), memory, [backend])
    return Table(dlist, starts[:-1], list(geometries))


def release(handle: Any) -> bool:
    try:
        handle.release()
        return True
    except Exception as exc:
        log.warning("kvflow nixl: releasing %r: %s", handle, exc)
        return False


def remove_agent(agent: Any, name: str) -> None:
    try:
        agent.remove_remote_agent(name)
    except Exception as exc:
        log.debug("kvflow nixl: removing agent %s: %s", name, exc)
