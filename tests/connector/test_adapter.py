"""The vLLM adapter's pieces that need no engine: metadata pickling, plugin registration,
layout discovery on tensors shaped like vLLM's CPU cache."""

from __future__ import annotations

import pickle

import msgspec
import pytest
import torch

from kvflow.engine.metadata import LoadSpec, SaveSpec, WorkerPlan, encode_plan

connector = pytest.importorskip("kvflow_vllm.connector", reason="needs vLLM installed")

from kvflow_vllm.connector.cache_spec import layout_from_tensors  # noqa: E402


def test_metadata_pickles_as_its_msgspec_bytes_only() -> None:
    plan = WorkerPlan(
        step=7,
        loads=[LoadSpec("r1", ["a" * 32], [3], [32])],
        saves=[SaveSpec("r2", ["b" * 32, "c" * 32], [4, 5], [32, 9])],
        lent=["r0"],
        preempted=["r9"],
    )
    from kvflow.hidden_states import HiddenStatesRef
    from kvflow_vllm.connector.metadata import _metadata_from_bytes
    from kvflow_vllm.extract_hidden_states import HiddenExport

    ref = HiddenStatesRef("fs", "ns", ["d" * 32], 32, [5, 6], 2, 8, "float32")
    exports = [HiddenExport("r3", [4], ref)]
    meta = connector.KVFlowMetadata([plan], exports)
    fn, args = meta.__reduce__()
    assert args == ([encode_plan(plan)], msgspec.msgpack.encode(exports)), (
        "the only state pickle carries is msgspec bytes"
    )
    assert fn is _metadata_from_bytes
    again = pickle.loads(pickle.dumps(meta))
    assert again.plan == plan
    assert again.exports == exports


def test_plugin_registration_is_idempotent() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvflow_vllm.plugin import CONNECTOR_NAME, register

    register()
    register()  # vLLM loads general plugins once per process, but never trust that
    cls = KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME)
    assert cls is connector.KVFlowConnector


def test_plugin_is_an_entry_point() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvflow"]
    assert ep.value == "kvflow_vllm.plugin:register"


def test_layout_of_vllm_cpu_cache_addresses_each_block() -> None:
    """vLLM's CPU cache: one int8 buffer, each layer a [blocks, heads, bs, 2*hd] view."""
    blocks, heads, bs, hd = 6, 2, 32, 8
    page = heads * bs * 2 * hd * 4
    backing = torch.zeros(2 * blocks * page, dtype=torch.int8)
    layers = {
        f"l{i}": backing[i * blocks * page : (i + 1) * blocks * page]
        .view(torch.float32)
        .view(blocks, heads, bs, 2 * hd)
        for i in range(2)
    }
    layout = layout_from_tensors(layers, blocks, bs)
    assert layout.describe() == f"cpu;layers=2;block_bytes={page}"
    layers["l1"][4].fill_(3.5)
    (span,) = layout.spans(1, 4, 5)  # a partial chunk still moves its whole block
    assert len(span) == page
    assert bytes(span) == layers["l1"][4].numpy().tobytes()
    (other,) = layout.spans(0, 4, bs)
    assert bytes(other) == bytes(page), "layer 0 is a different region of the backing buffer"


def test_layout_refuses_a_tensor_without_blocks_first() -> None:
    t = torch.zeros(2, 6, 32, 4)
    with pytest.raises(ValueError, match="expected 6 blocks first"):
        layout_from_tensors({"l0": t}, 6, 32)


def test_transports_command_lists_fs() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "transports"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("fs ") and "kvflow_fs:FsTransport" in out and "store" in out, out


def test_a_crafted_cache_salt_never_passes_for_a_lora_or_a_multimodal_input() -> None:
    """Issue 27, finding 8: salt parts were joined with ";", so a client's `cache_salt`
    could spell another request's LoRA and multimodal parts and share its chunk keys."""
    from types import SimpleNamespace

    from kvflow_vllm.connector.cache_spec import request_salt

    mm = SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=0))
    honest = SimpleNamespace(cache_salt="t1", mm_features=[mm], lora_request=None)
    crafted = SimpleNamespace(cache_salt="t1;mm=img@0", mm_features=[], lora_request=None)
    quoted = SimpleNamespace(cache_salt='t1","mm=img@0', mm_features=[], lora_request=None)
    salts = {request_salt(r) for r in (honest, crafted, quoted)}  # type: ignore[arg-type]
    assert len(salts) == 3
    plain = SimpleNamespace(cache_salt=None, mm_features=None, lora_request=None)
    assert request_salt(plain) == ""  # type: ignore[arg-type]  # stores keep their keys
