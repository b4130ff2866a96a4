"""Layer geometry: the runs a whole block occupies and when two caches' blocks match."""

from __future__ import annotations

import pytest

from kvflow.testing.layouts import make_layout

KINDS = {"nhd": {}, "hnd": {"hnd": True}, "packed": {"block_granular": True}}


@pytest.mark.parametrize("kind", KINDS)
def test_block_runs_cover_exactly_the_bytes_of_a_whole_block(kind: str) -> None:
    layout = make_layout(num_blocks=5, block_size=4, heads=3, **KINDS[kind])
    g = layout.geometries[0]
    for block in range(5):
        runs = {(block * g.block_stride + off, n) for off, n in g.block_runs()}
        covered = {i for off, n in runs for i in range(off, off + n)}
        spans = g.ranges(block, layout.block_size)
        assert covered == {i for off, n in spans for i in range(off, off + n)}
        assert len(runs) <= len(spans)


def test_hnd_heads_of_one_half_merge_into_one_run() -> None:
    g = make_layout(num_blocks=5, block_size=4, heads=3, head_dim=8, hnd=True).geometries[0]
    assert len(g.plane_offsets) == 6, "one plane per K/V head"
    assert [n for _, n in g.block_runs()] == [3 * 4 * 8 * 4] * 2, "K and V halves"


@pytest.mark.parametrize("kind", KINDS)
def test_caches_with_other_block_counts_have_the_same_block_shape(kind: str) -> None:
    small = make_layout(num_blocks=4, **KINDS[kind]).geometries[0]
    large = make_layout(num_blocks=9, **KINDS[kind]).geometries[0]
    if kind != "packed":
        assert small.plane_offsets != large.plane_offsets, "V starts after all K blocks"
    assert small.block_shape() == large.block_shape()
    other = make_layout(num_blocks=4, head_dim=16, **KINDS[kind]).geometries[0]
    assert other.block_shape() != small.block_shape()
