"""vLLM's cache-only layer of hidden states (`extract_hidden_states`), built and written
as vLLM does, for the hidden-states tests on host memory and on a GPU."""

from __future__ import annotations

import torch
from vllm.model_executor.models.extract_hidden_states import basic_cache
from vllm.v1.kv_cache_interface import (
    HiddenStateCacheSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvflow.hidden_states import HiddenStatesRef
from kvflow.keys import chunk_keys
from kvflow_vllm.extract_hidden_states import HiddenStatesExporter

NUM_BLOCKS, LAYERS, HIDDEN = 6, 3, 40


def cache_view(
    layout: KVCacheLayout, block: int, kernel: int | None = None, device: str = "cpu"
) -> torch.Tensor:
    """The cache-only layer's view, as vLLM's GPU runner builds it (one layer)."""
    spec = HiddenStateCacheSpec(
        block_size=block, num_kv_heads=LAYERS, head_size=HIDDEN, dtype=torch.bfloat16
    )
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, 1, layout, kernel)
    size = NUM_BLOCKS * spec.page_size_bytes
    tensor = KVCacheTensor(size, ["hs"], layer_stride, block_stride)
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    (view,) = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size=kernel)
    return view


def write_rows(view: torch.Tensor, block_ids: list[int], n: int, block: int) -> torch.Tensor:
    """vLLM's own write of `n` tokens' rows into `block_ids` (its slot mapping)."""
    rows = torch.randn(n, LAYERS, HIDDEN).to(view.dtype)
    # a slot numbers a manager block's tokens as its kernel blocks' tokens too
    slots = torch.tensor([block_ids[t // block] * block + t % block for t in range(n)])
    basic_cache(rows.to(view.device), view, slots.to(view.device))
    return rows


def ref_for(tokens: list[int], block: int, namespace: str = "ns") -> HiddenStatesRef:
    return HiddenStatesRef(
        transport="fs",
        namespace=namespace,
        keys=chunk_keys(namespace, tokens, block),
        block_size=block,
        token_ids=tokens,
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        dtype="bfloat16",
    )


def wait_done(exporter: HiddenStatesExporter, reqs: set[str]) -> set[str]:
    """`take_done` until `reqs` are done, as vLLM's thread calls it each step (a step's
    worth of waiting between calls; at most 30 s)."""
    import threading
    import time

    got: set[str] = set()
    deadline = time.monotonic() + 30
    while not reqs <= got and time.monotonic() < deadline:
        got |= exporter.take_done()
        threading.Event().wait(0.01)
    return got
