"""kvflow's geometry of the KV views vLLM's GPU runners build, built here by vLLM's own
`create_kv_cache_views` on host memory: for every `KVCacheLayout`, the bytes kvflow
moves for the first n tokens of a block are exactly the bytes vLLM's view puts there."""

from __future__ import annotations

import itertools

import pytest
import torch

connector = pytest.importorskip("kvflow_vllm.connector", reason="needs vLLM installed")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvflow.geometry.cells import cell_index, cells_of, head_copy_runs  # noqa: E402
from kvflow.geometry.layout import LayoutError  # noqa: E402
from kvflow.testing.layouts import LAYOUTS  # noqa: E402
from kvflow_vllm.connector.cache_spec import check_spec, layout_from_tensors  # noqa: E402

NUM_BLOCKS, NUM_LAYERS = 5, 3
FP8 = torch.float8_e4m3fn

# (heads, block size, head size, dtype, kernel block size); heads == block size is the
# case a dimension-size guess confuses
CASES = {
    "h16-b16-fp16": (16, 16, 8, torch.float16, None),
    "h32-b32-bf16": (32, 32, 4, torch.bfloat16, None),
    "h1-b16-bf16": (1, 16, 8, torch.bfloat16, None),
    "h8-b128-fp16": (8, 128, 8, torch.float16, None),
    "h4-b16-fp8": (4, 16, 16, FP8, None),
    "h4-b64-kernel32-bf16": (4, 64, 8, torch.bfloat16, 32),
    "h16-b32-kernel16-fp8": (16, 32, 8, FP8, 16),
}


def views(spec, layout: KVCacheLayout, kernel: int | None = None) -> list[torch.Tensor]:
    """NUM_LAYERS layers of `spec` in one backing buffer, as vLLM's GPU runner makes
    them (`get_kv_cache_config` strides, `create_kv_cache_views`)."""
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, NUM_LAYERS, layout)
    size = NUM_LAYERS * NUM_BLOCKS * spec.page_size_bytes
    tensor = KVCacheTensor(size, [f"l{i}" for i in range(NUM_LAYERS)], layer_stride, block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size=kernel)


def check_every_chunk(layers: list[torch.Tensor], block_size: int) -> None:
    """Mark the first n tokens of block b through vLLM's view; kvflow's spans for them must
    hold every marked byte and nothing else."""
    kv = {f"l{i}": v for i, v in enumerate(layers)}
    layout = layout_from_tensors(kv, NUM_BLOCKS, block_size, opaque_blocks=False)
    raw = torch.empty(0, dtype=torch.uint8).set_(layers[0].untyped_storage())
    kernel_tokens = layers[0].shape[2]
    counts = sorted({1, kernel_tokens - 1, kernel_tokens, block_size // 2 + 1, block_size} - {0})
    for i, view in enumerate(layers):
        cells = view.view(torch.uint8).unflatten(0, (NUM_BLOCKS, -1))  # [B, kernel, H, N, C]
        for b in (0, 2, NUM_BLOCKS - 1):
            for n in counts:
                raw.zero_()
                for k in range(-(-n // kernel_tokens)):
                    cells[b, k, :, : min(kernel_tokens, n - k * kernel_tokens)] = 1
                ranges = sorted(layout.ranges(i, b, n))
                assert all(a + la <= c for (a, la), (c, _) in itertools.pairwise(ranges))
                spans = layout.spans(i, b, n)
                assert all(bytes(s) == b"\x01" * len(s) for s in spans), (i, b, n)
                assert sum(map(len, spans)) == int(raw.sum()), (i, b, n)
                assert layout.chunk_nbytes(i, n) == int(raw.sum())


def test_kvflow_knows_every_layout_vllm_has() -> None:
    assert {m.name: m.value for m in KVCacheLayout} == LAYOUTS


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
@pytest.mark.parametrize("case", CASES)
def test_spans_are_the_views_own_bytes(layout: KVCacheLayout, case: str) -> None:
    heads, block_size, head_size, dtype, kernel = CASES[case]
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype
    )
    if kernel is not None and layout not in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC):
        with pytest.raises(ValueError, match="kernel blocks"):  # blocks not dense pages
            views(spec, layout, kernel)
        return
    check_every_chunk(views(spec, layout, kernel), block_size)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_mla_latent_and_sliding_window_layers(layout: KVCacheLayout) -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    check_every_chunk(views(mla, layout), 16)
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=4, head_size=8, dtype=torch.float16, sliding_window=64
    )
    check_every_chunk(views(swa, layout), 16)
    for spec in (mla, swa):
        check_spec("l0", spec)


def test_specs_kvflow_cannot_move_are_refused_by_name() -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(LayoutError, match="layer m0 has a MambaSpec cache"):
        check_spec("m0", mamba)
    sparse = MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, tokens_per_state=4
    )
    with pytest.raises(LayoutError, match="MLAAttentionSpec stores a state per 4 tokens"):
        check_spec("s0", sparse)


def test_a_view_of_another_block_size_is_refused() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    kv = {f"l{i}": v for i, v in enumerate(views(spec, KVCacheLayout.LBNHC))}
    with pytest.raises(LayoutError, match="layer l0: 16 tokens a block, not 32"):
        layout_from_tensors(kv, NUM_BLOCKS, 32, opaque_blocks=False)


def test_kvflow_requires_no_layout() -> None:
    """vLLM keeps the layout its attention backend prefers (decision 28)."""
    assert connector.KVFlowConnector.get_required_kvcache_layout(None) is None  # type: ignore[arg-type]


def _tokens(layer: torch.Tensor) -> torch.Tensor:
    """A layer's view as `[blocks, tokens, heads, cell bytes]`, read through vLLM's own
    logical view (tokens of a block in order across its kernel blocks)."""
    cells = layer.view(torch.uint8).unflatten(0, (NUM_BLOCKS, -1))  # [B, kernel, H, N, C]
    b, k, h, n, c = cells.shape
    return cells.permute(0, 1, 3, 2, 4).reshape(b, k * n, h, c)


PAIRS = [(s, d) for s in KVCacheLayout for d in KVCacheLayout]


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=lambda m: m.name)
@pytest.mark.parametrize("heads", [(4, 4, 0, 0), (4, 2, 2, 0), (2, 4, 0, 2)])
def test_cells_move_between_any_two_layouts_and_head_counts(
    src: KVCacheLayout, dst: KVCacheLayout, heads: tuple[int, int, int, int]
) -> None:
    """What P/D converts on receive (`kvflow.geometry.cells`): heads `first..` of a producer's
    blocks into heads `into..` of a consumer's, between every pair of vLLM's layouts and
    tensor-parallel head counts, by byte runs between blocks (a NIXL READ's pieces) and by
    gathering and scattering cells (zmq's frames); each cell lands where vLLM's view of
    the consumer's cache puts that token and head."""
    src_heads, dst_heads, first, into = heads
    count = min(src_heads, dst_heads)
    kv = {}
    for name, layout, h in (("src", src, src_heads), ("dst", dst, dst_heads)):
        spec = FullAttentionSpec(block_size=16, num_kv_heads=h, head_size=8, dtype=torch.float16)
        kv[name] = views(spec, layout)[1]
        kv[name].view(torch.uint8).copy_(
            torch.randint(0, 256, (*kv[name].shape, 2), dtype=torch.uint8).flatten(-2)
        )
    src_kv = layout_from_tensors({"l": kv["src"]}, NUM_BLOCKS, 16, opaque_blocks=False)
    dst_kv = layout_from_tensors({"l": kv["dst"]}, NUM_BLOCKS, 16, opaque_blocks=False)
    sg, dg = src_kv.geometries[0], dst_kv.geometries[0]
    sbuf, dbuf = src_kv.buffers[0], dst_kv.buffers[0]
    blocks, counts = [(1, 3), (4, 0)], [16, 9]
    for s, d, length in head_copy_runs(sg, first, dg, into, count, 16, in_blocks=True):
        at, to = blocks[0][0] * sg.block_stride + s, blocks[0][1] * dg.block_stride + d
        dbuf[to : to + length] = sbuf[at : at + length]
    src_idx = cell_index(sg, [blocks[1][0]], [9], first, count)
    dst_idx = cell_index(dg, [blocks[1][1]], [9], into, count)
    cells_of(dbuf, dg.cell_bytes)[dst_idx] = cells_of(sbuf, sg.cell_bytes)[src_idx]
    theirs, ours = _tokens(kv["src"]), _tokens(kv["dst"])
    for (b_src, b_dst), n in zip(blocks, counts, strict=True):
        want = theirs[b_src, :n, first : first + count]
        assert torch.equal(ours[b_dst, :n, into : into + count], want), (b_src, b_dst)
