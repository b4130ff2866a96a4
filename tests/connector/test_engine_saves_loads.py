"""SchedulerEngine + WorkerEngine saving and loading prompts (lent blocks, hybrid KV cache
groups among them), driven the way the vLLM connector drives them.

Real runtimes (one per engine side, as in vLLM's processes), the real `fs`
transport under tmp_path, real (numpy) paged KV memory. The test thread plays
vLLM: scheduler calls, then the model runner's per-step hooks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest
import trio
import trio.testing

from kvflow.config import KVFlowConfig
from kvflow.engine.metadata import LoadSpec, SaveSpec, WorkerPlan
from kvflow.engine.scheduler import ScheduledRequest, SchedulerEngine
from kvflow.keys import ChunkKey
from kvflow.observe.events import (
    BlocksReleased,
    EventBus,
    LookupAnswered,
    Origin,
    RequestFinished,
    StepBound,
    TransferDone,
    TransferFailed,
)
from kvflow.testing.layouts import fill_blocks
from kvflow_fs import FsTransport

from ..support.kvflow_engines import (
    BS,
    COUNTS,
    LAYERS,
    NUM_BLOCKS,
    PROMPT,
    WAIT,
    CallSpyRuntime,
    Engine,
    GatedFs,
    HangingTransport,
    MakeRuntime,
    Recorder,
    block_bytes,
    lookup,
    prefill_cold,
    run_step,
    save_prompt,
    transport_context,
)

# -- the main flow ---------------------------------------------------------


@pytest.mark.parametrize(
    ("block_granular", "device"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["nhd", "block-granular", "nhd-staged", "block-granular-staged"],
)
def test_saved_prompt_is_loaded_by_a_fresh_engine(
    start_engine: Callable[..., Engine], block_granular: bool, device: bool
) -> None:
    """`-staged`: the cache is device memory (a CPU stand-in for CUDA) that `fs` cannot
    move; the worker stages it through host memory."""
    a = start_engine("a", block_granular=block_granular, device=device)
    assert a.worker.staged is device
    keys = a.keys(PROMPT)
    plan = prefill_cold(a, "r1", PROMPT, [1, 2, 3])
    assert plan.saves == [SaveSpec("r1", keys, [1, 2, 3], COUNTS)]  # incl. the partial tail
    run_step(a, plan)
    done = a.worker_events.wait_for(TransferDone, "r1")
    assert done.direction == "save" and done.chunks == 3
    decode = a.sched.plan([ScheduledRequest("r1", len(PROMPT), 1, [])])
    assert decode.saves == []  # the prompt is stored; decoding saves nothing more

    b = start_engine("b", block_granular=block_granular, device=device)  # fresh runtimes
    assert b.keys(PROMPT) == keys
    assert lookup(b, "r2", PROMPT) == len(PROMPT) - 1  # vLLM computes the last token itself
    b.sched.allocated("r2", [5, 6, 7], len(PROMPT) - 1)
    plan = b.sched.plan(
        [ScheduledRequest("r2", 9, 1, [5, 6, 7], replace_blocks=True, token_ids=PROMPT)]
    )
    assert plan.saves == []
    assert plan.loads == [LoadSpec("r2", keys, [5, 6, 7], COUNTS, asynchronous=False)]

    checked: list[int] = []

    def check(layer: int) -> None:  # layer i has landed when wait_layer(i) returns
        for src, dst, n in zip([1, 2, 3], [5, 6, 7], COUNTS, strict=True):
            expect = block_bytes(a.layout, layer, src, n)
            assert any(expect)
            assert block_bytes(b.layout, layer, dst, n) == expect
        checked.append(layer)

    run_step(b, plan, check)
    assert checked == list(range(LAYERS))
    assert b.worker.take_error_blocks() == set()
    assert b.worker_events.wait_for(TransferDone, "r2").direction == "load"
    untouched = [blk for blk in range(NUM_BLOCKS) if blk not in (5, 6, 7)]
    assert not any(any(block_bytes(b.layout, i, blk)) for i in range(LAYERS) for blk in untouched)
    results = b.worker.take_results()
    assert not (results.finished_recving or results.failed_recving or results.finished_sending)
    assert b.sched.finished("r2")[0] is False  # nothing saved: no blocks to lend


def test_lookup_caps_at_prompt_len_minus_one_and_skips_computed_tokens(
    start_engine: Callable[..., Engine],
) -> None:
    a = start_engine("a")
    prompt = PROMPT[:8]  # exactly two full blocks
    save_prompt(a, "r1", prompt, [1, 2])
    b = start_engine("b")
    keys = b.keys(prompt)
    assert lookup(b, "full", prompt) == 7
    # vLLM's own prefix cache already holds the first block: 3 more tokens from the store
    assert lookup(b, "warm", prompt, num_computed=4) == 3
    b.sched.allocated("warm", [5, 6], 3)
    plan = b.sched.plan(
        [ScheduledRequest("warm", 7, 1, [5, 6], replace_blocks=True, token_ids=prompt)]
    )
    assert plan.loads == [LoadSpec("warm", keys[1:2], [6], [4])]
    run_step(b, plan)
    for layer in range(LAYERS):
        assert block_bytes(b.layout, layer, 6) == block_bytes(a.layout, layer, 2)
        assert not any(block_bytes(b.layout, layer, 5))
    assert b.worker.take_error_blocks() == set()


def test_chunked_prefill_saves_each_chunk_once_it_is_complete(
    start_engine: Callable[..., Engine],
) -> None:
    e = start_engine("chunked")
    keys = e.keys(PROMPT)
    assert lookup(e, "c", PROMPT) == 0
    e.sched.allocated("c", [1, 2], 0)
    first = e.sched.plan(
        [ScheduledRequest("c", 0, 6, [1, 2], replace_blocks=True, token_ids=PROMPT)]
    )
    assert first.saves == [SaveSpec("c", keys[:1], [1], [4])]  # block 2 is half computed
    fill_blocks(e.layout, [1, 2, 3], seed=5)
    run_step(e, first)
    second = e.sched.plan([ScheduledRequest("c", 6, 4, [3])])  # blocks are appended
    assert second.saves == [SaveSpec("c", keys[1:], [2, 3], [4, 2])]
    run_step(e, second)
    e.worker_events.wait_for(TransferDone, "c", count=2)
    assert sorted(d.chunks for d in e.worker_events.of(TransferDone, "c")) == [1, 2]
    assert e.sched.plan([ScheduledRequest("c", 10, 1, [])]).saves == []
    fs = e.worker_transport
    assert isinstance(fs, FsTransport)
    assert all(fs.path(k).exists() for k in keys)


def test_without_partial_blocks_only_full_chunks_are_saved_and_hit(
    start_engine: Callable[..., Engine],
) -> None:
    cfg = KVFlowConfig(save_partial_blocks=False)
    a = start_engine("a", config=cfg)
    plan = prefill_cold(a, "r1", PROMPT, [1, 2, 3])
    assert plan.saves == [SaveSpec("r1", a.keys(PROMPT)[:2], [1, 2], [4, 4])]
    run_step(a, plan)
    a.worker_events.wait_for(TransferDone, "r1")
    b = start_engine("b", config=cfg)
    assert lookup(b, "r2", PROMPT) == 8  # two full blocks; the last 2 tokens are recomputed


def test_async_load_is_reported_as_finished_recving_once(
    start_engine: Callable[..., Engine],
) -> None:
    a = start_engine("a")
    save_prompt(a, "r1", PROMPT, [1, 2, 3])
    b = start_engine("b", config=KVFlowConfig(load_mode="async"))
    assert lookup(b, "r2", PROMPT) == 9
    b.sched.allocated("r2", [5, 6, 7], 9)
    plan = b.sched.plan([])  # the request waits for its KV instead of being scheduled
    assert plan.loads == [LoadSpec("r2", b.keys(PROMPT), [5, 6, 7], COUNTS, asynchronous=True)]
    run_step(b, plan)  # nothing in the step waits for an asynchronous load
    b.worker_events.wait_for(TransferDone, "r2")
    results = b.worker.take_results()
    assert results.finished_recving == {"r2"} and results.failed_recving == set()
    assert b.worker.take_results().finished_recving == set()
    assert b.worker.take_error_blocks() == set()
    for layer in range(LAYERS):
        for src, dst, n in zip([1, 2, 3], [5, 6, 7], COUNTS, strict=True):
            assert block_bytes(b.layout, layer, dst, n) == block_bytes(a.layout, layer, src, n)


def test_lookup_of_unknown_or_tiny_requests_is_zero(start_engine: Callable[..., Engine]) -> None:
    e = start_engine("e")
    assert e.sched.lookup("never-added", 0) == 0
    e.sched.add_request("one-token", [7])
    assert e.sched.lookup("one-token", 0) == 0  # nothing to load: vLLM computes it anyway


class BadLookup(HangingTransport):
    """A store whose lookup hangs (`hang`) or raises."""

    hang = True

    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        if self.hang:
            await trio.sleep_forever()
        raise OSError("store unreachable")


@pytest.mark.parametrize("hang", [True, False], ids=["hangs", "raises"])
def test_a_failed_lookup_is_a_miss(make_runtime: MakeRuntime, hang: bool) -> None:
    rt = make_runtime("lookup", clock=trio.testing.MockClock(autojump_threshold=0))
    bus, rec = EventBus(Origin("lookup", "scheduler")), Recorder()
    bus.subscribe(rec)
    transport = BadLookup(None, transport_context("scheduler", "ns", None))
    transport.hang = hang
    sched = SchedulerEngine(
        config=KVFlowConfig(lookup_timeout_s=5.0),
        transport=transport,
        runtime=rt,
        bus=bus,
        namespace="ns",
        block_size=BS,
    )
    sched.add_request("r", PROMPT)
    answered = rec.wait_for(LookupAnswered, "r")
    assert answered.hit_tokens == 0
    assert ("lookup_timeout_s" if hang else "store unreachable") in answered.error
    assert sched.lookup("r", 0) == 0
    assert rt.task_errors == 0  # handled, not a crashed task


# -- lent blocks -----------------------------------------------------------


def test_lent_blocks_are_reported_once_after_the_lent_plan_is_bound(
    start_engine: Callable[..., Engine],
) -> None:
    e = start_engine("lend")
    save_prompt(e, "r", PROMPT, [1, 2, 3])
    assert e.worker.take_results().finished_sending == set()
    assert e.sched.finished("r", [1, 2, 3])[0] is True  # vLLM lends the blocks to kvflow
    assert e.sched_events.wait_for(RequestFinished, "r").blocks == 3  # kvflow inspect's "lent"
    assert e.worker.take_results().finished_sending == set()  # the worker has not heard yet
    plan = e.sched.plan([])
    assert plan.lent == ["r"]
    run_step(e, plan)
    e.worker_events.wait_for(BlocksReleased, "r")
    assert e.worker.take_results().finished_sending == {"r"}
    assert e.worker.take_results().finished_sending == set()  # exactly once
    assert e.sched.plan([]).is_empty()


def test_lent_blocks_wait_for_an_in_flight_save(start_engine: Callable[..., Engine]) -> None:
    e = start_engine("lend-slow", worker_transport=GatedFs)
    gated = e.worker_transport
    assert isinstance(gated, GatedFs)
    try:
        run_step(e, prefill_cold(e, "r", PROMPT, [1, 2, 3]))
        assert gated.entered.wait(WAIT)
        assert e.sched.finished("r", [1, 2, 3])[0] is True
        plan = e.sched.plan([])
        assert plan.lent == ["r"]
        run_step(e, plan)
        e.worker_events.wait_for(StepBound)  # the lent plan reached the loop ...
        e.worker.runtime.call(trio.testing.wait_all_tasks_blocked, timeout=WAIT)
        assert e.worker.take_results().finished_sending == set()  # ... but the save still reads
        assert not e.worker_events.of(BlocksReleased)
    finally:
        gated.release.set()
    e.worker_events.wait_for(BlocksReleased, "r")
    assert e.worker_events.of(TransferDone, "r")  # released after the save, not instead of it
    assert e.worker.take_results().finished_sending == {"r"}
    assert e.worker.take_results().finished_sending == set()


# -- vLLM's hybrid KV cache groups (one engine per group) --------------------


def test_a_group_never_loads_into_nor_saves_from_the_null_block(
    start_engine: Callable[..., Engine],
) -> None:
    """A sliding window's block table holds vLLM's null block (id 0) before the window:
    nothing is loaded into it, nothing saved from it."""
    a, b = start_engine("swa-a"), start_engine("swa-b")
    b.sched.null_block = 0
    keys = a.keys(PROMPT)
    save_prompt(a, "r1", PROMPT, [1, 2, 3])

    assert lookup(b, "r2", PROMPT) == len(PROMPT) - 1
    b.sched.allocated("r2", [0, 5, 6], len(PROMPT) - 1)
    (load,) = b.sched.plan([]).loads
    assert (load.keys, load.block_ids, load.token_counts) == (keys[1:], [5, 6], COUNTS[1:])

    assert lookup(b, "r3", [7, *PROMPT[1:]]) == 0
    b.sched.allocated("r3", [0, 8, 9], 0)
    (save,) = b.sched.plan(
        [ScheduledRequest("r3", 0, len(PROMPT), [0, 8, 9], replace_blocks=True)]
    ).saves
    assert save.block_ids == [8, 9] and save.token_counts == COUNTS[1:]


def test_a_hit_limited_by_another_group_loads_only_that_far(
    start_engine: Callable[..., Engine],
) -> None:
    a, b = start_engine("lim-a"), start_engine("lim-b")
    save_prompt(a, "r1", PROMPT, [1, 2, 3])
    assert lookup(b, "r2", PROMPT) == len(PROMPT) - 1
    b.sched.limit_hit("r2", BS)  # another group of the request holds only the first chunk
    assert b.sched.lookup("r2", 0) == BS
    b.sched.allocated("r2", [5, 6, 7], BS)
    (load,) = b.sched.plan([]).loads
    assert load.block_ids == [5] and load.keys == a.keys(PROMPT)[:1]


def test_a_reused_block_waits_for_the_save_still_reading_it(
    start_engine: Callable[..., Engine],
) -> None:
    """vLLM hands a sliding window's blocks out again while their request runs: the next
    step's forward must not write one that a save still reads."""
    e = start_engine("fence", worker_transport=GatedFs, worker_runtime_cls=CallSpyRuntime)
    gated, rt = e.worker_transport, e.worker.runtime
    assert isinstance(gated, GatedFs) and isinstance(rt, CallSpyRuntime)
    run_step(e, prefill_cold(e, "f", PROMPT, [1, 2, 3]))
    assert gated.entered.wait(WAIT)  # the save is in flight
    rt.called.clear()
    e.worker.bind(WorkerPlan(step=90, reused=[7, 8]))  # blocks no save reads: no wait
    assert not rt.called.is_set()
    binder = threading.Thread(target=e.worker.bind, args=(WorkerPlan(step=91, reused=[2]),))
    try:
        binder.start()
        assert rt.called.wait(WAIT)  # bind waits for the save ...
        rt.call(trio.testing.wait_all_tasks_blocked, timeout=WAIT)
        assert binder.is_alive()
    finally:
        gated.release.set()  # ... which may now go on
    binder.join(WAIT)
    assert not binder.is_alive()
    assert e.worker_events.wait_for(TransferDone, "f").direction == "save"
    assert all(gated.path(k).exists() for k in e.keys(PROMPT))


def test_a_save_still_reading_a_reused_block_after_preempt_timeout_stores_nothing(
    start_engine: Callable[..., Engine],
) -> None:
    e = start_engine(
        "fence-late", config=KVFlowConfig(preempt_timeout_s=0.3), worker_transport=GatedFs
    )
    gated = e.worker_transport
    assert isinstance(gated, GatedFs)
    run_step(e, prefill_cold(e, "f", PROMPT, [1, 2, 3]))
    assert gated.entered.wait(WAIT)
    try:
        e.worker.bind(WorkerPlan(step=91, reused=[3]))  # gives up after preempt_timeout_s
    finally:
        gated.release.set()
    failed = e.worker_events.wait_for(TransferFailed, "f")
    assert failed.direction == "save" and "reused" in failed.reason
    assert not any(gated.path(k).exists() for k in e.keys(PROMPT)), "the cancelled save stored"


def test_a_preempted_request_is_loaded_afresh_when_it_resumes(
    start_engine: Callable[..., Engine],
) -> None:
    """vLLM frees a preempted request's blocks; on resume it asks again and the hit must
    be loaded into the new blocks, not assumed to be there."""
    a = start_engine("a")
    save_prompt(a, "src", PROMPT, [1, 2, 3])
    b = start_engine("b")
    keys = b.keys(PROMPT)
    assert lookup(b, "r", PROMPT) == len(PROMPT) - 1
    b.sched.allocated("r", [5, 6, 7], len(PROMPT) - 1)
    first = b.sched.plan([ScheduledRequest("r", 9, 1, [5, 6, 7], True, PROMPT)])
    assert first.loads == [LoadSpec("r", keys, [5, 6, 7], COUNTS)]
    assert b.sched.plan([], preempted=["r"]).preempted == ["r"]
    assert b.sched.lookup("r", 0) == len(PROMPT) - 1  # resumed: asked again
    b.sched.allocated("r", [10, 11, 12], len(PROMPT) - 1)
    resumed = b.sched.plan([ScheduledRequest("r", 9, 1, [10, 11, 12], True)])
    assert resumed.loads == [LoadSpec("r", keys, [10, 11, 12], COUNTS)]
