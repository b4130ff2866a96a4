"""The exporter's device path (a GPU's cache-only layer, copied on kvflow's own stream
into pinned memory, then stored): runs on a machine with CUDA (scripts/gpu-check.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from vllm.v1.kv_cache_layout import KVCacheLayout

from kvflow.hidden_states import HiddenStatesReader, hidden_context, hidden_layout
from kvflow.observe.events import EventBus, Origin
from kvflow.runtime import Runtime
from kvflow.transport import load_transport
from kvflow_vllm import extract_hidden_states as hs

from ..support.hidden_states_cache import (
    HIDDEN,
    LAYERS,
    NUM_BLOCKS,
    cache_view,
    ref_for,
    wait_done,
    write_rows,
)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_rows_of_a_device_cache_are_stored_and_read_back(
    tmp_path: Path, layout: KVCacheLayout
) -> None:
    block, n = 16, 45
    view = cache_view(layout, block, device="cuda")
    rows = write_rows(view, [5, 0, 2], n, block)
    ref = ref_for(list(range(n)), block)
    runtime = Runtime("exporter-cuda")
    try:
        cls = load_transport("fs")
        transport = cls(cls.Options(path=str(tmp_path)), hidden_context("e", "worker", "ns"))
        runtime.call(transport.open, timeout=10)
        runtime.call(
            transport.register, hidden_layout(block, LAYERS, HIDDEN, "bfloat16"), timeout=10
        )
        exporter = hs.HiddenStatesExporter(runtime, EventBus(Origin("e", "worker")), 10.0)
        exporter.register(transport, view, NUM_BLOCKS)
        exporter.export([hs.HiddenExport("r", [5, 0, 2], ref)])
        assert wait_done(exporter, {"r"}) == {"r"}
        exporter.drain(10.0)
    finally:
        runtime.shutdown()
    with HiddenStatesReader("fs", {"path": str(tmp_path)}, timeout_s=5) as reader:
        assert torch.equal(reader.load(ref.to_params()).hidden_states, rows)
