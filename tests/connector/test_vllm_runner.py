"""vLLM's own model-runner connector wrappers drive a kvflow worker on CPU memory: the V1
runner's `KVConnectorModelRunnerMixin` and Model Runner V2's `ActiveKVConnector`, in the
order each calls the hooks, with and without deferring `wait_for_save` past a speculator
(`defer_finalize`). A load that fails after its layers were signalled (a transport that
fails late) must be reported in the output of the step whose forward used the blocks."""

from __future__ import annotations

import inspect
import socket
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import trio

pytest.importorskip("kvflow_vllm.connector", reason="needs vLLM installed")

from vllm.config import set_current_vllm_config
from vllm.distributed import (
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.distributed.kv_transfer.kv_transfer_state import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
)
from vllm.forward_context import set_forward_context
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
from vllm.v1.worker.kv_connector_model_runner_mixin import (
    KVConnectorModelRunnerMixin,
)

from kvflow.engine.metadata import LoadSpec, SaveSpec, WorkerPlan
from kvflow.keys import chunk_keys
from kvflow.observe.events import TransferDone
from kvflow.transport import ChunkCorrupt, LoadJob
from kvflow_vllm.connector import KVFlowConnector, KVFlowMetadata

from ..support.vllm_scheduler import BLOCK_SIZE, LAYERS, fs_config, make_kv_cache_config

NUM_BLOCKS = 16
PROMPT = list(range(1, 3 * BLOCK_SIZE + 1))
SAVED, COUNTS = [1, 2, 3], [BLOCK_SIZE] * 3
MRV2_DEFERS = "defer_finalize" in inspect.signature(ActiveKVConnector.post_forward).parameters


class Worker:
    """vLLM's worker-side connector as its runner sees it, plus the test's cache."""

    def __init__(
        self, conn: KVFlowConnector, caches: dict[str, torch.Tensor], mrv2: ActiveKVConnector
    ) -> None:
        self.conn, self.caches, self.mrv2 = conn, caches, mrv2
        self.saved = threading.Event()
        conn.context.bus.subscribe(
            lambda e: isinstance(e, TransferDone) and e.direction == "save" and self.saved.set()
        )
        self.keys = chunk_keys(conn.context.transport.context.namespace, PROMPT, BLOCK_SIZE)
        self.step = 0

    def output(self, plan_kw: dict[str, Any], runner: str, defer: bool) -> KVConnectorOutput:
        """One step through vLLM's `runner` wrapper, the forward visiting every layer as
        vLLM's attention layers do; returns what the wrapper hands the scheduler."""
        self.step += 1
        so = SchedulerOutput.make_empty()
        so.kv_connector_metadata = KVFlowMetadata([WorkerPlan(step=self.step, **plan_kw)])
        so.has_sync_kv_loads = any(not s.asynchronous for s in plan_kw.get("loads", ()))
        with set_forward_context(None, self.conn._vllm_config):
            if runner == "mrv2":
                wrapper = self.mrv2
                wrapper.pre_forward(so)
                self.forward()
                kw = {"defer_finalize": True} if defer else {}
                out = wrapper.post_forward(so.finished_req_ids, **kw)
                if defer:
                    wrapper.finalize_step()
            else:
                ctx: AbstractContextManager[KVConnectorOutput | None]
                ctx = KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(
                    so, defer_finalize=defer
                )
                with ctx as out:
                    self.forward()
                if defer:
                    KVConnectorModelRunnerMixin.finalize_kv_connector()
        assert out is not None
        return out

    def forward(self) -> None:
        for name in LAYERS:
            self.conn.wait_for_layer_load(name)
            self.conn.save_kv_layer(name, self.caches[name], None)  # type: ignore[arg-type]
        self.forward_done()

    def forward_done(self) -> None:
        """Hook: the forward of this step is over."""


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    cfg = fs_config(tmp_path_factory.mktemp("store"))
    kv_cfg = make_kv_cache_config(NUM_BLOCKS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(cfg):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
        ensure_kv_transfer_initialized(cfg, kv_cfg)  # vLLM builds kvflow's worker side
        conn = get_kv_transfer_group()
        assert isinstance(conn, KVFlowConnector)
        gen = torch.Generator().manual_seed(0)
        caches = {
            name: torch.randn(NUM_BLOCKS, 1, BLOCK_SIZE, 16, generator=gen) for name in LAYERS
        }
        mrv2 = ActiveKVConnector(cfg, caches)  # registers the caches, as Model Runner V2 does
        w = Worker(conn, caches, mrv2)
        w.output({"saves": [SaveSpec("w", w.keys, SAVED, COUNTS)]}, "v1", defer=False)
        assert w.saved.wait(30), "the save did not finish"
        try:
            yield w
        finally:
            ensure_kv_transfer_shutdown()
            destroy_model_parallel()
            destroy_distributed_environment()


RUNNERS = [
    ("v1", False),
    ("v1", True),
    ("mrv2", False),
    pytest.param(
        "mrv2",
        True,
        marks=pytest.mark.skipif(not MRV2_DEFERS, reason="this vLLM's MRV2 never defers"),
    ),
]


@pytest.mark.parametrize(("runner", "defer"), RUNNERS)
def test_a_load_lands_before_the_forward_reads_it(worker: Worker, runner: str, defer: bool) -> None:
    dst = [10, 11, 12]
    for name in LAYERS:
        worker.caches[name][dst] = 0.0
    load = LoadSpec("r", worker.keys, dst, COUNTS)
    out = worker.output({"loads": [load]}, runner, defer)
    assert not out.invalid_block_ids
    for name in LAYERS:
        assert torch.equal(worker.caches[name][dst], worker.caches[name][SAVED])


@pytest.mark.parametrize(("runner", "defer"), RUNNERS)
def test_a_load_that_fails_late_is_reported_in_its_own_step(
    worker: Worker, runner: str, defer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transport signals every layer, then fails (a checksum at the end, a peer that
    reports a bad read): vLLM's forward used the blocks, so this step's output must name
    them, even when the runner reads the errors before `wait_for_save`."""
    transport = worker.conn.context.transport
    real_load = transport.load
    forward_over = threading.Event()

    async def fails_late(job: LoadJob) -> None:
        await real_load(job)
        await trio.to_thread.run_sync(forward_over.wait)  # fail after the forward ends
        raise ChunkCorrupt("bad bytes found after the last layer", chunk=0)

    monkeypatch.setattr(transport, "load", fails_late)
    monkeypatch.setattr(worker, "forward_done", forward_over.set)
    dst = [13, 14, 15]
    out = worker.output({"loads": [LoadSpec("f", worker.keys, dst, COUNTS)]}, runner, defer)
    assert out.invalid_block_ids == set(dst)
    monkeypatch.undo()
    later = worker.output({}, runner, defer)
    assert not later.invalid_block_ids, "each failure is reported once"
