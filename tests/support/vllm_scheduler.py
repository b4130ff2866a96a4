"""Drive vLLM's real `Scheduler` with `KVFlowConnector`, playing the worker by hand.

Modelled on vLLM's `tests/v1/kv_connector/unit/utils.py`: a `VllmConfig` over kvflow's
tiny Llama config (nothing is loaded), a `KVCacheConfig` of one full-attention group
with a few blocks, and a `Scheduler` whose scheduler-side connector is kvflow's. Each
`Harness.step` runs `schedule()`, records kvflow's `WorkerPlan` and vLLM's block tables
at that moment, then hands `update_from_output` what a model runner would: a sampled
token per request whose prompt the step completes, and the `KVConnectorOutput` the test
says the worker reports.

Two loops, as vLLM's engine core runs them (`vllm/v1/engine/core.py`):

- `"sync"` (`EngineCore.step`): schedule step N, then process step N's output.
- `"async"` (`--async-scheduling`: `AsyncScheduler`, `EngineCore.step_with_batch_queue`
  with its batch queue of 2): schedule step N+1 while step N executes, then process step
  N's output. The scheduler counts the tokens step N will sample as output placeholders,
  aborts land between the two, and a request's blocks may be freed while a step that
  uses them is still in flight.

Every step also checks, whichever the loop, that each save, load and offer in kvflow's
plan names exactly vLLM's blocks for that request at that step, and that no save, no
asynchronous load and no offer still running ever names a block its request no longer
holds in vLLM (freed, or handed to another request).

Lookups run on kvflow's runtime thread; `Harness.add` waits for their answer (a
`LookupAnswered` event), never for time, so each step does the same thing every run.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvflow.config import parse_options
from kvflow.engine.metadata import WorkerPlan
from kvflow.engine.scheduler import SchedulerEngine
from kvflow.engine.worker import TransferResults, WorkerEngine
from kvflow.keyfiles import host_key
from kvflow.observe.events import Event, EventBus, LookupAnswered, Origin
from kvflow.pd.context import PeerContext
from kvflow.pd.params import PdParams
from kvflow.pd.security import Channel
from kvflow.runtime import Runtime
from kvflow.transport import Offer, TransportContext, load_transport
from kvflow_vllm.connector import KVFlowConnector, KVFlowMetadata
from kvflow_vllm.connector.cache_spec import layout_from_tensors
from kvflow_vllm.engine_process import model_dir
from kvflow_vllm.plugin import CONNECTOR_NAME, register

BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SHARD = "tp0of1pp0"
"""The one worker shard of a TP=1, PP=1 engine (kvflow's `shard_name(0, 1, 0)`)."""

Loop = Literal["sync", "async"]
BATCH_QUEUE_SIZE = 2
"""`VllmConfig.max_concurrent_batches` with async scheduling at PP=1: the engine core
holds at most this many scheduled steps whose output it has not processed."""

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
    aux_layers: Sequence[int] = (),
    extra: dict[str, Any] | None = None,
    pipeline_parallel_size: int = 1,
    block_size: int = BLOCK_SIZE,
) -> VllmConfig:
    """A CPU `VllmConfig` over kvflow's tiny Llama with `KVFlowConnector` as connector;
    with `aux_layers`, vLLM's `extract_hidden_states` method exporting those layers;
    `extra`: more of kvflow's keys (`kv_connector_extra_config`)."""
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
        # vLLM 0.33 turns it on when left unset (0.32's CPU platform turns it off):
        # `make_harness` sets it to the loop it drives
        async_scheduling=False,
    )
    cache_config = CacheConfig(
        block_size=block_size,
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
            **(extra or {}),
        },
        kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
    )
    speculative = None
    if aux_layers:
        speculative = SpeculativeConfig(
            method="extract_hidden_states",
            num_speculative_tokens=1,
            draft_model_config={
                "hf_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)}
            },
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        speculative_config=speculative,
        cache_config=cache_config,
        parallel_config=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size),
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )


def fs_config(store: Path, **kwargs: Any) -> VllmConfig:
    """`make_vllm_config` with kvflow's `fs` transport storing under `store`."""
    return make_vllm_config(transport="fs", options={"path": str(store)}, **kwargs)


def make_kv_cache_config(num_blocks: int, block_size: int = BLOCK_SIZE) -> KVCacheConfig:
    """One full-attention group over `LAYERS`; block 0 is vLLM's null block."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32
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
    stop_token_ids: Sequence[int] = (),
    block_size: int = BLOCK_SIZE,
) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, stop_token_ids=list(stop_token_ids)
    )
    req = Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
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

    index: int
    """Its position in `Harness.steps`."""
    output: SchedulerOutput
    plan: WorkerPlan
    block_ids: dict[str, list[int]]
    """vLLM's block table, read right after `schedule()`, of every request the step
    schedules and of every request its plan loads into or offers."""
    kvflow_tables: dict[str, list[int]]
    """kvflow's block table of the same requests, at the same moment."""
    samples: set[str]
    """The scheduled requests the runner samples a token for: those this step takes to
    the end of their known tokens (the runner discards a partial prefill's sample; vLLM
    marks the others `is_prefill_chunk` False). Async, their tokens are placeholders
    until the step's output is processed."""
    processed: bool = False
    """Whether `update_from_output` has had this step's output (async: a step later)."""
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    """What this step's `update_from_output` returned, request by request."""

    @property
    def finished(self) -> list[EngineCoreOutput]:
        """Outputs of requests that finished in this step's `update_from_output`."""
        return [o for o in self.outputs if o.finish_reason is not None]


@dataclass
class WorkerReport:
    """What the worker reports with the next model runner output it returns."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


@dataclass
class Transfer:
    """A save, an asynchronous load or an offer the worker may still be running."""

    kind: Literal["save", "load", "offer"]
    req: str
    block_ids: list[int]
    step: int


@dataclass
class Harness:
    scheduler: Scheduler
    lookups: LookupWaiter
    loop: Loop = "sync"
    steps: list[Step] = field(default_factory=list)
    in_flight: deque[Step] = field(default_factory=deque)
    """Scheduled steps whose output is still to be processed, newest first (the engine
    core's batch queue; always empty between sync steps)."""
    report: WorkerReport = field(default_factory=WorkerReport)
    """The worker's results not yet handed to vLLM."""
    running: list[Transfer] = field(default_factory=list)
    """Transfers planned and not yet known to be over (see `_settle`)."""
    tokens: dict[str, list[int]] = field(default_factory=dict)
    """The tokens the model samples for a request, in order (then `step`'s `token`)."""
    num_sampled: Counter[str] = field(default_factory=Counter)
    """Tokens the runner has sampled per request (stale ones included)."""

    @property
    def connector(self) -> KVFlowConnector:
        conn = self.scheduler.connector
        assert isinstance(conn, KVFlowConnector)
        return conn

    @property
    def kvflow_sched(self) -> SchedulerEngine:
        """kvflow's scheduler engine (the first, here the only, KV cache group's)."""
        side = self.connector.scheduler_side
        assert side is not None
        return side.sched

    @property
    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    @property
    def idle(self) -> bool:
        """The engine core's busy loop would wait: nothing to schedule, nothing in flight."""
        return not self.scheduler.has_requests() and not self.in_flight

    def block_table(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def kvflow_block_table(self, req_id: str) -> list[int]:
        """The block table kvflow's scheduler engine plans with (its private state)."""
        return list(self.kvflow_sched._reqs[req_id].block_ids)

    @property
    def kvflow_requests(self) -> set[str]:
        """Requests kvflow's scheduler engine still keeps state for (its private state)."""
        return set(self.kvflow_sched._reqs)

    def add(self, *reqs: Request) -> None:
        """Add requests, then wait until kvflow has answered each one's store lookup."""
        for req in reqs:
            self.scheduler.add_request(req)
        sched = self.kvflow_sched
        claims = sched._claims is not None  # a P/D request's claim is its lookup
        waits = [
            r.request_id
            for r in reqs
            if (claims and sched.is_remote(r.request_id))
            or (
                sched.can_load
                and len(r.prompt_token_ids or ()) >= 2
                and not sched.is_remote(r.request_id)
            )
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
        """One engine core step that schedules: returns the step it scheduled.

        sync: schedule a step, then process its output. async (as
        `EngineCore.step_with_batch_queue`): schedule a step, then process the output of
        the oldest step in flight once the batch queue is full (the previous step; none
        on the first call), or this step's own when vLLM is left with nothing to
        schedule after it.

        The worker results given here go with the next model runner output processed
        (this call's, or a later call's when this one processes none). `send_lent`: the
        worker also reports every request the processed step's plan lends as
        `finished_sending` (kvflow's worker does so once the request's saves are done).
        `before_update` runs between `schedule()` and `update_from_output`, where the
        engine core handles aborts that arrived while the model ran (right after
        `schedule()` when this call processes no output). The runner samples `token`
        for each request it samples, unless `tokens` scripts the request.
        """
        assert self.scheduler.has_requests(), "the engine core schedules no step now"
        self._report(finished_sending, finished_recving, failed_recving, invalid_block_ids)
        step = self._schedule()
        self.in_flight.appendleft(step)
        if self.loop == "async" and len(self.in_flight) < BATCH_QUEUE_SIZE:
            executed = step.output.total_num_scheduled_tokens > 0
            if executed or self.scheduler.has_requests():
                if before_update is not None:
                    before_update()  # the engine core's input queue, before the next step
                return step
        self._process(self.in_flight.pop(), send_lent, before_update, token)
        return step

    def drain(self, *, send_lent: bool = False, token: int = 7) -> None:
        """Engine core steps with nothing to schedule: process the steps still in flight
        (async only; a sync engine has none)."""
        while self.in_flight:
            assert not self.scheduler.has_requests(), "the engine core would schedule"
            self._process(self.in_flight.pop(), send_lent, None, token)

    def collect(self, step: Step, *, send_lent: bool = False) -> Step:
        """Step on until `step`'s output has been processed (async: one step later)."""
        while not step.processed:
            if self.scheduler.has_requests():
                self.step(send_lent=send_lent)
            else:
                self.drain(send_lent=send_lent)
        return step

    def plans(self) -> list[WorkerPlan]:
        return [s.plan for s in self.steps]

    def close(self) -> None:
        self.scheduler.shutdown()

    # -- internals ------------------------------------------------------------------
    def _report(
        self,
        finished_sending: Iterable[str],
        finished_recving: Iterable[str],
        failed_recving: Iterable[str],
        invalid_block_ids: Iterable[int],
    ) -> None:
        self.report.finished_sending.update(finished_sending)
        self.report.finished_recving.update(finished_recving)
        self.report.failed_recving.update(failed_recving)
        self.report.invalid_block_ids.update(invalid_block_ids)

    def _schedule(self) -> Step:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, KVFlowMetadata)
        plan = meta.plan
        named = [s.req for s in plan.loads] + [o.req for o in plan.offers]
        tables = {r: self.block_table(r) for r in [*out.num_scheduled_tokens, *named]}
        known = self.kvflow_requests
        step = Step(
            index=len(self.steps),
            output=out,
            plan=plan,
            block_ids=tables,
            kvflow_tables={r: self.kvflow_block_table(r) for r in tables if r in known},
            samples={
                r
                for r in out.num_scheduled_tokens
                if not self.scheduler.requests[r].is_prefill_chunk
            },
        )
        self.steps.append(step)
        self._check_plan(step)
        self._check_running(f"after step {step.index}'s schedule()")
        return step

    def _process(
        self,
        step: Step,
        send_lent: bool,
        before_update: Callable[[], object] | None,
        token: int,
    ) -> None:
        """Hand vLLM step `step`'s model runner output, as a runner builds it."""
        if before_update is not None:
            before_update()
        report, self.report = self.report, WorkerReport()
        if send_lent:
            report.finished_sending.update(step.plan.lent)
        kv_out = KVConnectorOutput(
            finished_sending=report.finished_sending or None,
            finished_recving=report.finished_recving or None,
            failed_recving=report.failed_recving,
            invalid_block_ids=report.invalid_block_ids,
        )
        ids = list(step.output.num_scheduled_tokens)
        if ids:
            runner_out = ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[
                    [self._sample(r, token)] if r in step.samples else [] for r in ids
                ],
                kv_connector_output=None if kv_out.is_empty() else kv_out,
            )
        else:  # the runner's kv_connector_no_forward
            runner_out = ModelRunnerOutput.with_kv_conn_output_only(kv_out)
        engine_outputs = self.scheduler.update_from_output(step.output, runner_out)
        step.outputs = [o for outs in engine_outputs.values() for o in outs.outputs]
        step.processed = True
        self._settle(report)
        self._check_running(f"after step {step.index}'s update_from_output")

    def _sample(self, req: str, token: int) -> int:
        n = self.num_sampled[req]
        self.num_sampled[req] += 1
        script = self.tokens.get(req, [])
        return script[n] if n < len(script) else token

    def _check_plan(self, step: Step) -> None:
        """Each transfer the plan names lies in vLLM's blocks of its request, in order."""
        plan = step.plan
        specs: list[tuple[Literal["save", "load", "offer"], str, list[int], bool]] = [
            *(("save", s.req, list(s.block_ids), True) for s in plan.saves),
            *(("load", s.req, list(s.block_ids), s.asynchronous) for s in plan.loads),
            *(("offer", s.req, list(s.block_ids), True) for s in plan.offers),
        ]
        for kind, req, blocks, outlives_step in specs:
            table = step.block_ids[req]
            start = table.index(blocks[0]) if blocks and blocks[0] in table else -1
            assert start >= 0 and table[start : start + len(blocks)] == blocks, (
                f"step {step.index}: kvflow's {kind} of {req} names blocks {blocks}; "
                f"vLLM's block table of {req} is {table}"
            )
            if outlives_step:  # a synchronous load ends with its step's forward
                self.running.append(Transfer(kind, req, blocks, step.index))
        for req in plan.preempted:
            # the worker stops and awaits a preempted request's saves before it runs
            # the step that may reuse its blocks
            self.running = [t for t in self.running if not (t.req == req and t.kind == "save")]

    def _settle(self, report: WorkerReport) -> None:
        """Transfers the worker reported over: a lent request's saves and offers when
        it reports `finished_sending`, an asynchronous load at `finished_recving`."""

        def over(t: Transfer) -> bool:
            if t.kind == "load":
                return t.req in report.finished_recving
            return t.req in report.finished_sending

        self.running = [t for t in self.running if not over(t)]

    def _check_running(self, when: str) -> None:
        """No running transfer names a block its request no longer holds in vLLM."""
        for t in self.running:
            held = self.block_table(t.req) if t.req in self.scheduler.requests else []
            lost = [b for b in t.block_ids if b not in held]
            assert not lost, (
                f"{when}: the {t.kind} of {t.req} planned in step {t.step} still runs "
                f"over blocks {t.block_ids}, but vLLM no longer holds {lost} for {t.req} "
                f"(its blocks now: {held})"
            )


MakeHarness = Callable[..., Harness]
"""The `harness` fixture (tests/conftest.py): `harness(vllm_config, num_blocks)`."""


def make_harness(vllm_config: VllmConfig, num_blocks: int, loop: Loop = "sync") -> Harness:
    """A real scheduler with `KVFlowConnector` over `num_blocks` blocks (one is null):
    vLLM's `Scheduler`, or its `AsyncScheduler` for the async loop (the class the
    engine core picks, `SchedulerConfig.get_scheduler_cls`)."""
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    # set after VllmConfig's checks: vLLM's CPU platform turns async scheduling off (a
    # CPU engine never runs it); the GPU engine's default is on
    vllm_config.scheduler_config.async_scheduling = loop == "async"
    if vllm_config.parallel_config.pipeline_parallel_size == 1:  # stages keep more batches
        # in flight than either loop drives (a test of them checks the handshake only)
        assert vllm_config.max_concurrent_batches == (BATCH_QUEUE_SIZE if loop == "async" else 1)
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    assert issubclass(scheduler_cls, Scheduler)
    assert issubclass(scheduler_cls, AsyncScheduler) == (loop == "async")
    block_size = vllm_config.cache_config.block_size
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=make_kv_cache_config(num_blocks, block_size),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
    )
    harness = Harness(scheduler=scheduler, lookups=LookupWaiter(), loop=loop)
    harness.connector.context.bus.subscribe(harness.lookups)
    return harness


def run_to_completion(h: Harness, *, max_steps: int = 200, send_lent: bool = True) -> None:
    """Step until the engine core would go idle (vLLM holds no request, no step is in
    flight); the worker releases lent requests at once."""
    for _ in range(max_steps):
        if not h.scheduler.has_requests():
            h.drain(send_lent=send_lent)
            assert h.idle and not h.scheduler.requests
            return
        h.step(send_lent=send_lent)
    raise AssertionError(f"requests still held after {max_steps} steps: {h.scheduler.requests}")


def run_real_worker(harness: Harness, plans: Sequence[WorkerPlan]) -> TransferResults:
    """Run `plans` through kvflow's real `WorkerEngine` and transport over a CPU cache
    laid out as vLLM's CPU attention lays it out (block `b` of layer `l` filled with
    `l * 1000 + b`), wait until every save has finished, and return what the worker
    reports (`finished_sending`: the lent requests it released)."""
    shared = harness.connector.context
    num_blocks = harness.scheduler.kv_cache_config.num_blocks
    caches = {
        name: torch.full((num_blocks, 1, BLOCK_SIZE, 16), float(layer * 1000))
        + torch.arange(num_blocks, dtype=torch.float32).view(-1, 1, 1, 1)
        for layer, name in enumerate(LAYERS)
    }
    transport_cls = load_transport(shared.config.transport)
    options = parse_options(shared.config.options, transport_cls.Options, shared.config.transport)
    ctx = TransportContext(
        engine_id=shared.engine_id,
        role="worker",
        namespace=shared.namespaces[0],
        shard=SHARD,
        shards=[SHARD],
    )
    runtime = Runtime("test-worker")
    transport = transport_cls(options, ctx)
    runtime.call(transport.open, timeout=30.0)
    runtime.add_closer(transport.aclose)
    worker = WorkerEngine(
        config=shared.config,
        transport=transport,
        runtime=runtime,
        bus=EventBus(Origin(shared.engine_id, "worker", 0)),
    )
    try:
        worker.register(layout_from_tensors(caches, num_blocks, BLOCK_SIZE))
        for plan in plans:
            worker.bind(plan)
            worker.end_step()  # every layer computed
    finally:
        worker.close(drain_s=30.0)  # returns once every save has ended
    return worker.take_results()


def host_channel() -> Channel:
    """The channel an engine without a key_file gets: this user's host key."""
    return Channel(host_key(), "kv-in-clear", host=True)


def aimed(params: dict[str, Any], address: str, channel: Channel | None = None) -> dict[str, Any]:
    """`params` (one group's) naming the producer at `address` instead, signed again by
    `channel` (the host key if None), as a producer there would have signed them."""
    fields = {**params["kvflow"], "addresses": [address], "mac": ""}
    pd = PdParams(**fields).signed(channel or host_channel())
    return {**params, "kvflow": msgspec.to_builtins(pd)}


@contextmanager
def held_offer(offer: Offer, channel: Channel | None = None) -> Iterator[str]:
    """A producer worker's real `zmq` transport serving `offer` (held until the context
    ends) over `channel` (the host key's if None, as an engine without a key_file):
    yields its address, for a consumer to claim."""
    cls = load_transport("zmq")
    ctx = PeerContext(
        engine_id="producer",
        role="worker",
        namespace="",
        shard=SHARD,
        shards=[SHARD],
        channel=channel or host_channel(),
    )
    runtime = Runtime("test-producer")
    peer = cls(cls.Options(), ctx)
    try:
        runtime.call(peer.open, timeout=30.0)
        runtime.add_closer(peer.aclose)
        runtime.spawn(peer.serve)
        runtime.spawn(peer.offer, offer)
        yield peer.address
    finally:
        runtime.shutdown(timeout=30.0)
