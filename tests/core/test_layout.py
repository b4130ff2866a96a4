"""Layer geometry: the runs a whole block occupies and when two caches' blocks match."""

from __future__ import annotations

import pytest

from kvflow.geometry.layout import LayoutError, view_geometry
from kvflow.testing.layouts import LAYOUTS, make_layout

KINDS = {name: {"layout": name} for name in LAYOUTS} | {
    "packed": {"block_granular": True},
    "LBHNC-kernel2": {"layout": "LBHNC", "kernel_block_size": 2},
}


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


def test_a_dense_hnd_block_is_one_run_and_its_partial_chunk_one_run_a_head() -> None:
    g = make_layout(num_blocks=5, block_size=4, heads=3, head_dim=8, hnd=True).geometries[0]
    cell = 2 * 8 * 4
    assert g.block_runs() == [(0, 3 * 4 * cell)]
    assert g.runs(2) == ((0, 2 * cell), (4 * cell, 2 * cell), (8 * cell, 2 * cell))
    assert g.describe() == f"HND block=4 heads=3 cell={cell}B"


def test_a_partial_chunk_of_split_blocks_takes_whole_kernel_blocks_then_its_tokens() -> None:
    g = make_layout(
        num_blocks=5, block_size=8, heads=3, head_dim=8, layout="LBHNC", kernel_block_size=4
    ).geometries[0]
    cell, kernel = 64, 3 * 4 * 64
    assert g.runs(6) == (
        (0, kernel + 2 * cell),
        (kernel + 4 * cell, 2 * cell),
        (kernel + 8 * cell, 2 * cell),
    )
    assert g.describe() == "HND block=8 in 2 kernel blocks heads=3 cell=64B"


@pytest.mark.parametrize("kind", KINDS)
def test_caches_with_other_block_counts_have_the_same_block_shape(kind: str) -> None:
    small = make_layout(num_blocks=4, **KINDS[kind]).geometries[0]
    large = make_layout(num_blocks=9, **KINDS[kind]).geometries[0]
    assert small.block_shape() == large.block_shape()
    other = make_layout(num_blocks=4, head_dim=16, **KINDS[kind]).geometries[0]
    assert other.block_shape() != small.block_shape()


def test_hnd_and_nhd_blocks_do_not_match() -> None:
    hnd = make_layout(layout="LBHNC").geometries[0]
    nhd = make_layout(layout="LBNHC").geometries[0]
    assert hnd.block_runs() == nhd.block_runs(), "the same bytes of a block..."
    assert hnd.block_shape() != nhd.block_shape(), "...in another order"


def test_overlapping_dimensions_are_refused() -> None:
    with pytest.raises(LayoutError, match="dimensions overlap"):
        view_geometry((4, 2, 16, 8), (128, 8, 8, 1), 2, 4)  # heads and tokens alias
    with pytest.raises(LayoutError, match="content is not contiguous"):
        view_geometry((4, 2, 16, 8), (256, 128, 16, 2), 2, 4)
