"""kvflow's loop dies with transfers in flight: vLLM's own block pool gets every block back.

docs/reliability.md's row "kvflow's loop dies", checked against vLLM's real `Scheduler`
and `BlockPool` (`tests/support/vllm_scheduler.py`, the sync loop) and kvflow's real worker-side
connector, built by vLLM (`ensure_kv_transfer_initialized`) and run by vLLM's model-runner
wrapper (`KVConnectorModelRunnerMixin`) over CPU caches: each step the scheduler plans,
the worker binds the plan, the forward visits every layer, and the `KVConnectorOutput`
the wrapper builds is what `update_from_output` gets.

With a save, a hidden-states export (`extract_hidden_states`) or a P/D offer in flight,
kvflow's worker loop dies (a `BaseException` escapes it, as in
`tests/connector/test_engine_failures.py`). vLLM steps on until it holds no request: its pool's
free blocks are back to the count it started with, also for requests that finished
after the death, and a load planned after the death fails in its own step.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Awaitable, Callable, Container, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM installed")

import torch
import trio
from vllm.config import VllmConfig, set_current_vllm_config
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
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from kvflow.observe.events import Event, LookupAnswered
from kvflow_vllm.connector import KVFlowConnector, KVFlowHandshake
from kvflow_vllm.connector.cache_spec import layer_specs

from ..support.kvflow_engines import kill_loop
from ..support.vllm_scheduler import (
    BLOCK_SIZE,
    LAYERS,
    Harness,
    LookupWaiter,
    fs_config,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
    prompt_of,
)

T = TypeVar("T")
WAIT = 30.0
"""Bound on every wait for kvflow's threads (a failure, never a pause)."""
MAX_STEPS = 40
NUM_BLOCKS = 32
HIDDEN = "model.cache_only_layers.4"
"""extract_hidden_states' cache-only layer (two aux layers of tiny-llama's 256)."""


class Signals:
    """Transfers kvflow's loop started, by name, for vLLM's thread to wait on (bounded)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seen: set[str] = set()

    def note(self, name: str) -> None:
        with self._cond:
            self._seen.add(name)
            self._cond.notify_all()

    def wait(self, *names: str) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: set(names) <= self._seen, WAIT):
                pytest.fail(f"kvflow's worker never got to {sorted(set(names) - self._seen)}")

    def hold(
        self, kind: str, real: Callable[..., Awaitable[T]], reqs: Container[str]
    ) -> Callable[..., Awaitable[T]]:
        """`real` (a transfer taking a job, export or offer with a `.req`), noted as
        `kind:req` once it starts; for `reqs`, it then never ends on its own (a store,
        or a device copy, that has not answered): only the loop's death ends it."""

        async def held(job: Any, *args: Any) -> T:
            self.note(f"{kind}:{job.req}")
            if job.req in reqs:
                await trio.sleep_forever()
            return await real(job, *args)

        return held


class Worker:
    """kvflow's worker-side connector run as vLLM's model runner runs it."""

    def __init__(
        self, cfg: VllmConfig, conn: KVFlowConnector, caches: dict[str, torch.Tensor]
    ) -> None:
        self.cfg, self.conn, self.caches = cfg, conn, caches
        self.signals = Signals()
        self.outputs: dict[int, KVConnectorOutput] = {}
        """Per harness step, what vLLM's wrapper reported."""
        self.gates_open: dict[int, bool] = {}
        """Per harness step, whether every layer's loads had settled as vLLM started them."""
        real_start = conn.start_load_kv
        self._step = 0

        def start_load_kv(*args: Any, **kwargs: Any) -> None:
            side = conn.worker_side
            assert side is not None
            self.gates_open[self._step] = all(w._gate.settled.is_set() for w in side.workers)
            real_start(*args, **kwargs)

        conn.start_load_kv = start_load_kv  # type: ignore[method-assign]

    def run(self, h: Harness) -> None:
        """`Harness.step`'s `before_update` (sync loop: the step just scheduled): the
        worker runs the step, its output goes with the step's model runner output."""
        step = h.steps[-1]
        self._step = step.index
        so = step.output
        with (
            set_forward_context(None, self.cfg),
            KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(so) as out,
        ):
            if so.total_num_scheduled_tokens:  # else vLLM's kv_connector_no_forward
                for name, cache in self.caches.items():  # as vLLM's attention layers
                    self.conn.wait_for_layer_load(name)
                    self.conn.save_kv_layer(name, cache, None)  # type: ignore[arg-type]
        assert out is not None
        self.outputs[step.index] = out
        h.report.finished_sending |= out.finished_sending or set()
        h.report.finished_recving |= out.finished_recving or set()
        h.report.failed_recving |= out.failed_recving
        h.report.invalid_block_ids |= out.invalid_block_ids

    def drain(self) -> None:
        """Wait until no transfer and no export the worker runs is in flight."""
        side = self.conn.worker_side
        assert side is not None
        side.drain(time.monotonic() + WAIT)

    def kill_loop(self) -> None:
        """kvflow's worker loop dies: a BaseException escapes it, as no task's error
        does (test_engine_failures.py's dead-loop tests kill it so)."""
        kill_loop(self.conn.context.runtime)


def step_until_idle(h: Harness, worker: Worker, *, drain: bool = False) -> None:
    """Engine core steps until vLLM holds no request (`drain`: the worker's transfers
    end between steps); a clear failure if it still holds some after `MAX_STEPS`."""
    for _ in range(MAX_STEPS):
        if not h.scheduler.has_requests():
            return
        h.step(before_update=lambda: worker.run(h))
        if drain:
            worker.drain()
    pytest.fail(
        f"{MAX_STEPS} steps on, vLLM still holds {sorted(h.scheduler.requests)}: "
        f"{h.free_blocks} blocks of {NUM_BLOCKS - 1} free"
    )


def cpu_caches(kv_cfg: KVCacheConfig) -> dict[str, torch.Tensor]:
    """Each layer's view, `[blocks, heads, tokens, content]` (K and V, or a hidden
    state per aux layer), as vLLM's CPU runner hands them over."""
    caches = {}
    for name, spec in layer_specs(kv_cfg).items():
        content = spec.head_size * (1 if isinstance(spec, HiddenStateCacheSpec) else 2)
        shape = (kv_cfg.num_blocks, spec.num_kv_heads, spec.block_size, content)
        caches[name] = torch.zeros(shape, dtype=spec.dtype)
    return caches


def with_hidden_layer(num_blocks: int) -> KVCacheConfig:
    """The workers' KV cache config under extract_hidden_states: the cache-only layer
    shares the attention layers' group, each layer with its own spec."""
    specs: dict[str, KVCacheSpec] = {
        name: FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
        )
        for name in LAYERS
    }
    specs[HIDDEN] = HiddenStateCacheSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=256, dtype=torch.float32
    )
    group = UniformTypeKVCacheSpecs.from_specs(specs)
    assert group is not None
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(specs), group)],
    )


def with_sliding_window(num_blocks: int, window: int) -> KVCacheConfig:
    """A hybrid model's KV cache config (vLLM's hybrid manager): `LAYERS[0]` in a
    full-attention group, `LAYERS[1]` in a sliding-window group of `window` tokens,
    blocks of one size."""
    shape: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": 1,
        "head_size": 8,
        "dtype": torch.float32,
    }
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(LAYERS[:1], FullAttentionSpec(**shape)),
            KVCacheGroupSpec(LAYERS[1:], SlidingWindowSpec(**shape, sliding_window=window)),
        ],
    )


def add_answered(h: Harness, req: Request) -> None:
    """`Harness.add`, then wait until kvflow has answered `req`'s store lookup in every
    KV cache group (vLLM schedules it once all have: `Harness.add` waits for one)."""
    groups = len(h.connector.context.groups)
    answered = threading.Condition()
    count = 0

    def note(event: Event) -> None:
        nonlocal count
        if isinstance(event, LookupAnswered) and event.req == req.request_id:
            with answered:
                count += 1
                answered.notify_all()

    stop = h.connector.context.bus.subscribe(note)
    try:
        h.add(req)
        with answered:
            if not answered.wait_for(lambda: count >= groups, WAIT):
                pytest.fail(f"kvflow answered {count} of {groups} lookups of {req.request_id}")
    finally:
        stop()


@pytest.fixture(scope="module")
def distributed() -> Iterator[None]:
    """vLLM's world of one worker (its worker-side connector asks for its ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(make_vllm_config()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        ensure_model_parallel_initialized(1, 1)
    try:
        yield
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


Engine = Callable[[VllmConfig, KVCacheConfig], tuple[Harness, Worker]]


@pytest.fixture
def engine(distributed: None) -> Iterator[Engine]:
    """`engine(vllm_config, workers_kv_cache_config)`: vLLM's scheduler (over the config
    vLLM derives from the workers', `generate_scheduler_kv_cache_config`) and its one
    worker, both shut down at teardown."""
    made: list[Harness] = []

    def make(cfg: VllmConfig, worker_kv: KVCacheConfig) -> tuple[Harness, Worker]:
        cfg.cache_config.num_gpu_blocks = worker_kv.num_blocks
        with set_current_vllm_config(cfg):
            ensure_kv_transfer_initialized(cfg, worker_kv)  # vLLM builds kvflow's worker
        conn = get_kv_transfer_group()
        assert isinstance(conn, KVFlowConnector)
        caches = cpu_caches(worker_kv)
        conn.register_kv_caches(caches)
        scheduler = Scheduler(
            vllm_config=cfg,
            kv_cache_config=generate_scheduler_kv_cache_config([worker_kv]),
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=BLOCK_SIZE,
        )
        h = Harness(scheduler=scheduler, lookups=LookupWaiter())
        h.connector.context.bus.subscribe(h.lookups)
        made.append(h)
        return h, Worker(cfg, conn, caches)

    try:
        yield make
    finally:
        ensure_kv_transfer_shutdown()
        for h in made:
            h.close()


def test_saves_and_exports_in_flight_when_the_loop_dies(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store engine under extract_hidden_states. When the loop dies, `b` has finished
    and vLLM lends kvflow its blocks for its save and its hidden-states export, both in
    flight; `a` still runs, its prompt's save in flight, and finishes after the death.
    A request that loads a stored prompt after the death has its load fail in its own
    step (no layer waits for the dead loop), and vLLM recomputes it."""
    cfg = fs_config(tmp_path, aux_layers=[1, 2], enable_prefix_caching=False)
    h, worker = engine(cfg, with_hidden_layer(NUM_BLOCKS))
    start = h.free_blocks
    assert start == NUM_BLOCKS - 1  # block 0 is vLLM's null block
    stored = prompt_of(1, 40)
    h.add(make_request("warm", stored, max_tokens=1))  # saved and exported for good
    step_until_idle(h, worker, drain=True)
    assert h.free_blocks == start

    side, signals = worker.conn.worker_side, worker.signals
    assert side is not None and side._exporter is not None
    transport = worker.conn.context.transport
    monkeypatch.setattr(transport, "save", signals.hold("save", transport.save, {"a", "b"}))
    exporter = side._exporter
    monkeypatch.setattr(exporter, "_copy_out", signals.hold("export", exporter._copy_out, {"b"}))
    h.add(
        make_request("a", prompt_of(2, 40), max_tokens=8),
        make_request("b", prompt_of(3, 40), max_tokens=1),
    )
    prefill = h.step(before_update=lambda: worker.run(h))
    assert {o.request_id for o in prefill.finished} == {"b"}
    lends = h.step(before_update=lambda: worker.run(h))
    assert lends.plan.lent == ["b"]
    assert [e.req for e in lends.output.kv_connector_metadata.exports] == ["b"]  # type: ignore[union-attr]
    signals.wait("save:a", "save:b", "export:b")
    assert "b" in h.scheduler.requests, "vLLM waits for kvflow's save and export of b"
    held = start - h.free_blocks
    assert held == 3 + 3  # a's blocks (running) and b's (lent)

    worker.kill_loop()
    h.add(make_request("again", stored, max_tokens=2))  # the scheduler's loop still looks up
    step_until_idle(h, worker)

    assert h.free_blocks == start, f"{start - h.free_blocks} blocks never came back"
    assert not h.scheduler.requests and not h.kvflow_requests
    (load_step,) = [s for s in h.steps if any(ld.req == "again" for ld in s.plan.loads)]
    (load,) = load_step.plan.loads
    assert load.block_ids and not load.asynchronous
    assert worker.gates_open[load_step.index], "the forward waited for a dead loop's load"
    assert worker.outputs[load_step.index].invalid_block_ids == set(load.block_ids)
    finish = {o.request_id: o.finish_reason for s in h.steps for o in s.finished}
    assert finish["again"] == finish["a"] == FinishReason.LENGTH, "recomputed, not failed"


def test_an_offer_in_flight_when_the_loop_dies(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A P/D producer (`zmq`): `pd`'s blocks are held for a consumer that never comes when
    the loop dies; `late` finishes after the death, its offer bound to the dead loop."""
    cfg = make_vllm_config(transport="zmq", kv_role="kv_producer")
    h, worker = engine(cfg, make_kv_cache_config(NUM_BLOCKS))
    handshake = worker.conn.get_handshake_metadata()
    assert isinstance(handshake, KVFlowHandshake)
    h.connector.set_xfer_handshake_metadata({0: handshake})  # as vLLM's engine core does
    transport = worker.conn.context.transport
    monkeypatch.setattr(transport, "offer", worker.signals.hold("offer", transport.offer, ()))
    start = h.free_blocks
    remote = {"do_remote_decode": True}
    h.add(make_request("pd", prompt_of(3, 40), max_tokens=1, kv_transfer_params=remote))
    prefill = h.step(before_update=lambda: worker.run(h))
    assert {o.request_id for o in prefill.finished} == {"pd"}
    offers = h.step(before_update=lambda: worker.run(h))
    (spec,) = offers.plan.offers
    assert offers.plan.lent == ["pd"]
    worker.signals.wait(f"offer:{spec.offer}")  # served, waiting for its consumer
    assert "pd" in h.scheduler.requests and start - h.free_blocks == 3, "held for the consumer"

    worker.kill_loop()
    h.add(make_request("late", prompt_of(4, 40), max_tokens=1, kv_transfer_params=remote))
    step_until_idle(h, worker)

    assert any(s.plan.offers and s.plan.lent == ["late"] for s in h.steps), "late was offered"
    assert h.free_blocks == start, f"{start - h.free_blocks} blocks never came back"
    assert not h.scheduler.requests and not h.kvflow_requests


def test_a_failed_load_of_a_model_of_several_kv_cache_groups_is_recomputed_not_an_engine_stop(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hybrid model (a full-attention and a sliding-window KV cache group) loads a
    stored prompt, asynchronously as kvflow loads for several groups; the loop dies with
    the load in flight. kvflow reports the request in `failed_recving` and no block ids
    (on block ids of a model of several groups vLLM's Scheduler raises, stopping the
    engine): vLLM recomputes it and gets every block back."""
    cfg = fs_config(tmp_path, enable_prefix_caching=False)  # loads from the store only
    h, worker = engine(cfg, with_sliding_window(NUM_BLOCKS, window=4 * BLOCK_SIZE))
    assert len(h.scheduler.kv_cache_config.kv_cache_groups) == 2
    assert len(worker.conn.context.transports) == 2  # kvflow moves both groups
    start = h.free_blocks
    stored = prompt_of(1, 40)
    add_answered(h, make_request("warm", stored, max_tokens=1))  # computed and saved
    step_until_idle(h, worker, drain=True)
    assert h.free_blocks == start

    for transport in worker.conn.context.transports:
        held = worker.signals.hold("load", transport.load, {"again"})
        monkeypatch.setattr(transport, "load", held)
    add_answered(h, make_request("again", stored, max_tokens=2))
    loads = h.step(before_update=lambda: worker.run(h))
    (load,) = loads.plan.loads
    assert load.req == "again" and load.block_ids and load.asynchronous
    worker.signals.wait("load:again")
    assert h.scheduler.requests["again"].status == RequestStatus.WAITING_FOR_REMOTE_KVS

    worker.kill_loop()  # fails every asynchronous load still open
    step_until_idle(h, worker)  # the old worker's block ids: vLLM raised here

    reports = [out for out in worker.outputs.values() if out.failed_recving]
    assert [out.failed_recving for out in reports] == [{"again"}]
    assert not any(out.invalid_block_ids for out in worker.outputs.values())
    finish = {o.request_id: o.finish_reason for s in h.steps for o in s.finished}
    assert finish["again"] == FinishReason.LENGTH, "recomputed, not failed"
    runs = [s.output.num_scheduled_tokens.get("again") for s in h.steps[loads.index :]]
    assert [n for n in runs if n] == [len(stored), 1], "its prompt computed from token 0"
    assert h.free_blocks == start, f"{start - h.free_blocks} blocks never came back"
    assert not h.scheduler.requests and not h.kvflow_requests
