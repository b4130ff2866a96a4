"""Hidden states out of vLLM's cache-only layer, through a store, back by reference.

The rows are written by vLLM's own `basic_cache` (what its `CacheOnlyAttentionImpl`
runs) into views vLLM's `create_kv_cache_views` builds on host memory for every GPU
`KVCacheLayout`; kvflow gathers them, stores them through the `fs` transport and
`HiddenStatesReader` loads them by the reference the engine returns."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
import torch
import trio

hs = pytest.importorskip("kvflow_vllm.extract_hidden_states", reason="needs vLLM installed")

from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvflow.hidden_states import (  # noqa: E402
    PARAM,
    HiddenStatesError,
    HiddenStatesReader,
    hidden_context,
    hidden_layout,
    host_buffer,
    save_hidden_states,
)
from kvflow.observe.events import EventBus, Origin, SaveStarted, TransferDone  # noqa: E402
from kvflow.transport import load_transport  # noqa: E402

from ..support.hidden_states_cache import (  # noqa: E402
    HIDDEN,
    LAYERS,
    NUM_BLOCKS,
    cache_view,
    ref_for,
    wait_done,
    write_rows,
)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
@pytest.mark.parametrize(("block", "kernel"), [(16, None), (32, 16)])
def test_rows_gathered_from_every_gpu_layout_are_the_rows_vllm_wrote(
    layout: KVCacheLayout, block: int, kernel: int | None
) -> None:
    try:
        view = cache_view(layout, block, kernel)
    except ValueError as exc:  # vLLM splits blocks only where they are dense pages
        assert kernel is not None and "kernel blocks" in str(exc)
        return
    blocks, n = [4, 1, 3], 2 * block + 5
    rows = write_rows(view, blocks, n, block)
    out = host_buffer(ref_for(list(range(n)), block))
    hs.gather_rows(view, NUM_BLOCKS, blocks, n, out)
    assert torch.equal(out.view(-1, LAYERS, HIDDEN)[:n], rows)


async def test_stored_hidden_states_load_by_reference(tmp_path: Path) -> None:
    block, n = 16, 37
    view = cache_view(KVCacheLayout.LBNHC, block)
    rows = write_rows(view, [2, 5, 0], n, block)
    ref = ref_for(list(range(100, 100 + n)), block)
    buf = host_buffer(ref)
    hs.gather_rows(view, NUM_BLOCKS, [2, 5, 0], n, buf)
    cls = load_transport("fs")
    writer = cls(cls.Options(path=str(tmp_path)), hidden_context("e", "worker", ref.namespace))
    await writer.open()
    await writer.register(hidden_layout(block, LAYERS, HIDDEN, "bfloat16"))
    seen: list[object] = []
    bus = EventBus(Origin("e", "worker"))
    bus.subscribe(seen.append)
    assert await save_hidden_states(writer, bus, "r1", ref, buf, 10.0) == ""
    await writer.aclose()
    assert [type(e) for e in seen] == [SaveStarted, TransferDone]
    assert all(e.what == "hidden_states" for e in seen)  # type: ignore[attr-defined]

    params = msgspec.json.decode(msgspec.json.encode(ref.to_params()))  # as a client gets it
    with HiddenStatesReader("fs", {"path": str(tmp_path)}) as reader:
        got = await trio.to_thread.run_sync(reader.load, params)
    assert torch.equal(got.hidden_states, rows)
    assert got.token_ids.tolist() == ref.token_ids


async def test_a_reader_says_what_it_cannot_read(tmp_path: Path) -> None:
    ref = ref_for([random.randrange(1000) for _ in range(40)], 16)
    with HiddenStatesReader("fs", {"path": str(tmp_path)}, timeout_s=0.2) as reader:
        with pytest.raises(HiddenStatesError, match=r"0 of 3 chunks .* after 0.2s"):
            await trio.to_thread.run_sync(reader.load, ref.to_params())
        other = msgspec.structs.replace(ref, transport="redis")
        with pytest.raises(HiddenStatesError, match="through transport 'redis'"):
            reader.load({PARAM: msgspec.to_builtins(other)})
        with pytest.raises(HiddenStatesError, match="not a kvflow hidden-states reference"):
            reader.load({PARAM: {"keys": []}})
    with pytest.raises(HiddenStatesError, match="pathh"):
        HiddenStatesReader("fs", {"pathh": "/tmp"})
    with pytest.raises(HiddenStatesError, match="not a kvflow hidden-states reference: None"):
        HiddenStatesReader("fs", {"path": str(tmp_path)}).load(None)  # type: ignore[arg-type]
    (tmp_path / "file").write_bytes(b"")
    bad = pytest.raises(HiddenStatesError, match=r"\(fs\): .* not a writable directory")
    with HiddenStatesReader("fs", {"path": str(tmp_path / "file")}) as reader, bad:
        await trio.to_thread.run_sync(reader.load, ref.to_params())
    with pytest.raises(HiddenStatesError, match="this reader is closed"):
        reader.load(ref.to_params())


def test_the_exporter_hands_blocks_back_whatever_becomes_of_the_copy(tmp_path: Path) -> None:
    from kvflow.runtime import Runtime

    block, n = 16, 20
    view = cache_view(KVCacheLayout.LBNHC, block)
    rows = write_rows(view, [3, 1], n, block)
    good = ref_for(list(range(n)), block)
    bad = msgspec.structs.replace(good, num_layers=LAYERS + 1)  # not what the layer holds
    runtime = Runtime("exporter")
    bus = EventBus(Origin("e", "worker"))
    try:
        idle = hs.HiddenStatesExporter(runtime, bus, 10.0)  # a rank that does not write
        idle.export([hs.HiddenExport("a", [3, 1], good)])
        assert idle.take_done() == {"a"}

        cls = load_transport("fs")
        transport = cls(cls.Options(path=str(tmp_path)), hidden_context("e", "worker", "ns"))
        runtime.call(transport.open, timeout=10)
        runtime.call(
            transport.register, hidden_layout(block, LAYERS, HIDDEN, "bfloat16"), timeout=10
        )
        writer = hs.HiddenStatesExporter(runtime, bus, 10.0)
        writer.register(transport, view, NUM_BLOCKS)
        writer.export([hs.HiddenExport("b", [3, 1], good), hs.HiddenExport("c", [3, 1], bad)])
        assert wait_done(writer, {"b", "c"}) == {"b", "c"}
        writer.drain(10.0)
        with HiddenStatesReader("fs", {"path": str(tmp_path)}, timeout_s=5) as reader:
            assert torch.equal(reader.load(good.to_params()).hidden_states, rows)

        runtime.shutdown()  # the loop is gone: the blocks go back all the same
        writer.export([hs.HiddenExport("d", [3, 1], good)])
        assert writer.take_done() == {"d"}
    finally:
        runtime.shutdown()
