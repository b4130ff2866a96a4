"""Drive vLLM's real `Scheduler` with `KVFlowConnector`, playing the worker by hand.

Modelled on vLLM's `tests/v1/kv_connector/unit/utils.py`: a `VllmConfig` over kvflow's
tiny Llama config (nothing is loaded), a `KVCacheConfig` of one full-attention group
with a few blocks, and a `Scheduler` whose scheduler-side connector is kvflow's. Each
`Harness.step` runs `schedule()`, records kvflow's `WorkerPlan` and vLLM's block tables
at that moment, then hands `update_from_output` what a model runner would: a sampled
token per request whose prompt is complete, and the `KVConnectorOutput` the test says
the worker reports.

Lookups run on kvflow's runtime thread; `Harness.add` waits for their answer (a
`LookupAnswered` event), never for time, so each step does the same thing every run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvflow.config import parse_options
from kvflow.events import Event, EventBus, LookupAnswered, Origin
from kvflow.metadata import WorkerPlan
from kvflow.runtime import Runtime
from kvflow.transport import TransportContext, load_transport
from kvflow.worker import TransferResults, WorkerEngine
from kvflow_vllm.connector import KVFlowConnector, KVFlowMetadata, layout_from_tensors
from kvflow_vllm.engine import model_dir
from kvflow_vllm.plugin import CONNECTOR_NAME, register

BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SHARD = "tp0of1pp0"
"""The one worker shard of a TP=1, PP=1 engine (kvflow's `_shard(0, 1, 0)`)."""

_hash_ready = False


def make_vllm_config(
    *,
    transport: str = "fs",
    options: dict[str, Any] | None = None,
    kv_role: str = "kv_both",
    load_mode: str = "layer",
    max_num_batched_tokens: int = 256,
    enable_prefix_caching: bool = True,
    kv_load_failure_policy: str = "recompute",
) -> VllmConfig:
    """A CPU `VllmConfig` over kvflow's tiny Llama with `KVFlowConnector` as connector."""
    register()
    model_config = ModelConfig(
        model=model_dir("tiny-llama"),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    kv_transfer_config = KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_role=kv_role,  # type: ignore[arg-type]
        kv_connector_extra_config={
            "transport": transport,
            "load_mode": load_mode,
            "inspect": False,  # no live-event socket in unit tests
            "options": options or {},
        },
        kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
    )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )


def fs_config(store: Path, **kwargs: Any) -> VllmConfig:
    """`make_vllm_config` with kvflow's `fs` transport storing under `store`."""
    return make_vllm_config(transport="fs", options={"path": str(store)}, **kwargs)


def make_kv_cache_config(num_blocks: int) -> KVCacheConfig:
    """One full-attention group over `LAYERS`; block 0 is vLLM's null block."""
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


def make_request(
    req_id: str,
    prompt: Sequence[int],
    *,
    max_tokens: int = 4,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    req.kv_transfer_params = kv_transfer_params
    return req


def prompt_of(seed: int, length: int) -> list[int]:
    """Distinct token ids per seed (the tiny model's vocabulary is far larger)."""
    return [(seed * 1009 + i * 7) % 30000 + 1 for i in range(length)]


class LookupWaiter:
    """Collects the request ids whose store lookup kvflow has answered."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._answered: set[str] = set()

    def __call__(self, event: Event) -> None:
        if isinstance(event, LookupAnswered):
            with self._cond:
                self._answered.add(event.req)
                self._cond.notify_all()

    def wait(self, reqs: Iterable[str], timeout: float = 10.0) -> None:
        want = set(reqs)
        with self._cond:
            if not self._cond.wait_for(lambda: want <= self._answered, timeout):
                raise TimeoutError(f"kvflow answered no lookup for {want - self._answered}")


@dataclass
class Step:
    """One scheduler step as the worker saw it."""

    output: SchedulerOutput
    plan: WorkerPlan
    block_ids: dict[str, list[int]]
    """vLLM's block table of every scheduled request, read right after `schedule()`."""
    kvflow_tables: dict[str, list[int]]
    """kvflow's block table of the same requests, at the same moment."""
    finished: list[EngineCoreOutput]
    """Outputs of requests that finished in this step's `update_from_output`."""


@dataclass
class Harness:
    scheduler: Scheduler
    lookups: LookupWaiter
    steps: list[Step] = field(default_factory=list)

    @property
    def connector(self) -> KVFlowConnector:
        conn = self.scheduler.connector
        assert isinstance(conn, KVFlowConnector)
        return conn

    @property
    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def block_table(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def kvflow_block_table(self, req_id: str) -> list[int]:
        """The block table kvflow's scheduler engine plans with (its private state)."""
        return list(self.connector.sched._reqs[req_id].block_ids)

    @property
    def kvflow_requests(self) -> set[str]:
        """Requests kvflow's scheduler engine still keeps state for (its private state)."""
        return set(self.connector.sched._reqs)

    def add(self, *reqs: Request) -> None:
        """Add requests, then wait until kvflow has answered each one's store lookup."""
        for req in reqs:
            self.scheduler.add_request(req)
        sched = self.connector.sched
        waits = [
            r.request_id
            for r in reqs
            if sched.can_load
            and len(r.prompt_token_ids or ()) >= 2
            and not sched.is_remote(r.request_id)
        ]
        self.lookups.wait(waits)

    def step(
        self,
        *,
        finished_sending: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
        invalid_block_ids: Iterable[int] = (),
        send_lent: bool = False,
        before_update: Callable[[], object] | None = None,
        token: int = 7,
    ) -> Step:
        """Schedule one step, then report it done with the given worker results.

        `send_lent`: the worker also reports every request this step's plan lends as
        `finished_sending` (kvflow's worker does so once the request's saves are done).
        `before_update` runs while the step is "executing" (between `schedule()` and
        `update_from_output`), where an engine may abort requests.
        """
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVFlowMetadata)
        tables = {r: self.block_table(r) for r in out.num_scheduled_tokens}
        known = self.kvflow_requests
        kvflow_tables = {r: self.kvflow_block_table(r) for r in tables if r in known}
        if before_update is not None:
            before_update()
        sending = set(finished_sending) | (set(meta.plan.lent) if send_lent else set())
        sampled: list[list[int]] = []
        for req_id in out.num_scheduled_tokens:
            req = self.scheduler.requests.get(req_id)  # gone if aborted meanwhile
            done = req is not None and req.num_computed_tokens >= req.num_tokens
            sampled.append([token] if done else [])
        kv_out = KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=set(finished_recving) or None,
            failed_recving=set(failed_recving),
            invalid_block_ids=set(invalid_block_ids),
        )
        ids = list(out.num_scheduled_tokens)
        runner_out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=None if kv_out.is_empty() else kv_out,
        )
        engine_outputs = self.scheduler.update_from_output(out, runner_out)
        finished = [
            o
            for outs in engine_outputs.values()
            for o in outs.outputs
            if o.finish_reason is not None
        ]
        step = Step(
            output=out,
            plan=meta.plan,
            block_ids=tables,
            kvflow_tables=kvflow_tables,
            finished=finished,
        )
        self.steps.append(step)
        return step

    def plans(self) -> list[WorkerPlan]:
        return [s.plan for s in self.steps]

    def close(self) -> None:
        self.scheduler.shutdown()


def make_harness(vllm_config: VllmConfig, num_blocks: int) -> Harness:
    """A real `Scheduler` with `KVFlowConnector` over `num_blocks` blocks (one is null)."""
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=make_kv_cache_config(num_blocks),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
    )
    harness = Harness(scheduler=scheduler, lookups=LookupWaiter())
    harness.connector.bus.subscribe(harness.lookups)
    return harness


def run_real_worker(harness: Harness, plans: Sequence[WorkerPlan]) -> TransferResults:
    """Run `plans` through kvflow's real `WorkerEngine` and transport over a CPU cache
    laid out as vLLM's CPU attention lays it out (block `b` of layer `l` filled with
    `l * 1000 + b`), wait until every save has finished, and return what the worker
    reports (`finished_sending`: the lent requests it released)."""
    conn = harness.connector
    num_blocks = harness.scheduler.kv_cache_config.num_blocks
    caches = {
        name: torch.full((num_blocks, 1, BLOCK_SIZE, 16), float(layer * 1000))
        + torch.arange(num_blocks, dtype=torch.float32).view(-1, 1, 1, 1)
        for layer, name in enumerate(LAYERS)
    }
    transport_cls = load_transport(conn.config.transport)
    options = parse_options(conn.config.options, transport_cls.Options, conn.config.transport)
    ctx = TransportContext(
        engine_id=conn.engine_id,
        role="worker",
        namespace=conn.sched.namespace,
        shard=SHARD,
        shards=[SHARD],
    )
    runtime = Runtime("test-worker")
    transport = transport_cls(options, ctx)
    runtime.call(transport.open, timeout=30.0)
    runtime.add_closer(transport.aclose)
    worker = WorkerEngine(
        config=conn.config,
        transport=transport,
        runtime=runtime,
        bus=EventBus(Origin(conn.engine_id, "worker", 0)),
    )
    try:
        worker.register(layout_from_tensors(caches, num_blocks, BLOCK_SIZE))
        for plan in plans:
            worker.bind(plan)
            worker.end_step()  # every layer computed
    finally:
        worker.close(drain_s=30.0)  # returns once every save has ended
    return worker.take_results()
