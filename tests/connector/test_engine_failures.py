"""SchedulerEngine + WorkerEngine when things go wrong: loads that fail, hang or cannot be
stopped, kvflow's loop dying, preemption and shutdown with transfers in flight.

Driven the way the vLLM connector drives them, with the harness of tests/support/kvflow_engines.py.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing

from kvflow.config import KVFlowConfig
from kvflow.engine.metadata import LoadSpec, SaveSpec, WorkerPlan, decode_plan, encode_plan
from kvflow.engine.scheduler import ScheduledRequest
from kvflow.engine.worker import KVFlowFatal
from kvflow.observe.events import SaveStarted, TransferDone, TransferFailed
from kvflow.testing.layouts import fill_blocks
from kvflow_fs import FsTransport

from ..support.kvflow_engines import (
    COUNTS,
    LAYERS,
    PROMPT,
    WAIT,
    CallSpyRuntime,
    Engine,
    GatedFs,
    HangingTransport,
    SlowEndFs,
    StuckPeer,
    StuckReadFs,
    TransportFactory,
    block_bytes,
    kill_loop,
    lookup,
    prefill_cold,
    run_step,
    save_prompt,
    stored_files,
)

# -- failing loads ---------------------------------------------------------


def _warm_engine_missing_chunk(
    start_engine: Callable[..., Engine], worker_transport: TransportFactory = FsTransport
) -> tuple[Engine, Engine, WorkerPlan]:
    """Engine a stored PROMPT; engine b looked it up, then chunk 1 vanished; b's load plan."""
    a = start_engine("a")
    save_prompt(a, "r1", PROMPT, [1, 2, 3])
    b = start_engine("b", worker_transport=worker_transport)
    keys = b.keys(PROMPT)
    assert lookup(b, "r2", PROMPT) == 9
    fs = b.worker_transport
    assert isinstance(fs, FsTransport)
    os.unlink(fs.path(keys[1]))  # evicted between the lookup and the load
    b.sched.allocated("r2", [5, 6, 7], 9)
    plan = b.sched.plan(
        [ScheduledRequest("r2", 9, 1, [5, 6, 7], replace_blocks=True, token_ids=PROMPT)]
    )
    return a, b, plan


def test_a_save_computed_over_a_failed_load_stores_nothing(
    start_engine: Callable[..., Engine], store: Path
) -> None:
    """r2 loads PROMPT's chunks and computes a longer prompt's next chunk over them in
    the same step; the load fails at chunk 1, so that chunk was computed over bad KV: its
    save is dropped before the forward goes on, and the scheduler saves it again once
    vLLM has recomputed it."""
    a = start_engine("a")
    save_prompt(a, "r1", PROMPT[:8], [1, 2])  # two whole chunks
    b = start_engine("b")
    longer = [*PROMPT[:8], 7, 7, 7, 7]
    keys = b.keys(longer)
    assert lookup(b, "r2", longer) == 8
    fs = b.worker_transport
    assert isinstance(fs, FsTransport)
    os.unlink(fs.path(keys[1]))  # gone between the lookup and the load
    b.sched.allocated("r2", [5, 6, 7], 8)
    plan = b.sched.plan([ScheduledRequest("r2", 8, 4, [5, 6, 7], True, longer)])
    assert plan.loads == [LoadSpec("r2", keys[:2], [5, 6], [4, 4])]
    (save,) = plan.saves
    assert save.keys == keys[2:] and save.computed_over == [5, 6]
    run_step(b, plan)
    failed = b.worker_events.wait_for(TransferFailed, "r2", count=2)
    reasons = {e.direction: e.reason for e in b.worker_events.of(TransferFailed, "r2")}
    assert "missing" in reasons["load"], failed
    assert reasons["save"] == "cancelled: computed over blocks whose load failed (r2)"
    assert not fs.path(keys[2]).exists(), "nothing computed over the bad blocks is stored"
    assert b.worker.take_error_blocks() == {6}
    # vLLM recomputes from block 6 (chunk 1): kvflow saves chunks 1 and 2 again
    b.sched.blocks_invalid({6})
    again = b.sched.plan([ScheduledRequest("r2", 4, 8, [], token_ids=longer)])
    assert [s.keys for s in again.saves] == [keys[1:]]


def test_missing_chunk_reports_its_blocks_and_never_hangs(
    start_engine: Callable[..., Engine],
) -> None:
    a, b, plan = _warm_engine_missing_chunk(start_engine)
    run_step(b, plan)
    failed = b.worker_events.wait_for(TransferFailed, "r2")
    assert failed.direction == "load" and failed.block_ids == [6, 7] and not failed.timed_out
    assert "missing" in failed.reason
    assert b.worker.take_error_blocks() == {6, 7}  # the missing chunk and everything after it
    assert b.worker.take_error_blocks() == set()
    for layer in range(LAYERS):  # the intact chunk before the gap did land
        assert block_bytes(b.layout, layer, 5) == block_bytes(a.layout, layer, 1)


def test_load_errors_are_known_when_the_step_ends(start_engine: Callable[..., Engine]) -> None:
    """vLLM reads get_block_ids_with_load_errors right after wait_for_save (end_step)."""
    _, b, plan = _warm_engine_missing_chunk(start_engine, worker_transport=SlowEndFs)
    fs = b.worker_transport
    assert isinstance(fs, SlowEndFs)
    stepper = threading.Thread(target=run_step, args=(b, plan))
    try:
        stepper.start()
        assert fs.ending.wait(WAIT)  # every layer is signalled; the load has not failed yet
        stepper.join(0.5)  # an absence check: end_step must still be waiting
        ended_before_the_load = not stepper.is_alive()
        errors_then = b.worker.take_error_blocks() if ended_before_the_load else None
    finally:
        fs.may_end.set()
    stepper.join(WAIT)
    assert not stepper.is_alive()
    assert not ended_before_the_load, f"step ended with error blocks {errors_then}"
    assert b.worker.take_error_blocks() == {6, 7}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["layer", "async"])
def test_hung_load_times_out_reports_blocks_and_opens_gates(
    start_engine: Callable[..., Engine], asynchronous: bool
) -> None:
    e = start_engine(
        "hang",
        config=KVFlowConfig(load_timeout_s=30.0),
        worker_transport=HangingTransport,
        worker_clock=trio.testing.MockClock(autojump_threshold=0),
    )
    hanging = e.worker_transport
    assert isinstance(hanging, HangingTransport)
    keys = e.keys(PROMPT)
    plan = WorkerPlan(step=1, loads=[LoadSpec("h", keys, [2, 3, 4], COUNTS, asynchronous)])
    run_step(e, plan)
    if asynchronous:  # nothing waits inside the step; the request waits for its results
        e.worker_events.wait_for(TransferFailed, "h")
    failed = e.worker_events.wait_for(TransferFailed, "h")
    assert failed.timed_out and failed.block_ids == [2, 3, 4]
    assert hanging.cancelled.is_set()  # the transport's load was cancelled, not abandoned
    assert e.worker.take_error_blocks() == {2, 3, 4}
    results = e.worker.take_results()
    if asynchronous:
        assert results.finished_recving == {"h"} and results.failed_recving == {"h"}
    else:
        assert not (results.finished_recving or results.failed_recving)


def test_a_read_stuck_in_the_kernel_stops_the_engine_instead_of_a_late_write(
    start_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load's deadline passes while its read hangs in a thread: handing the blocks
    back (as failed, to recompute) would let the read land in them later. vLLM's thread
    gets `KVFlowFatal` instead, and no block is ever reported back."""
    monkeypatch.setattr("kvflow.engine.transfers.STOP_GRACE_S", 0.5)
    a = start_engine("a")
    save_prompt(a, "src", PROMPT, [1, 2, 3])
    b = start_engine("b", config=KVFlowConfig(load_timeout_s=0.5), worker_transport=StuckReadFs)
    stuck = b.worker_transport
    assert isinstance(stuck, StuckReadFs)
    dst = [5, 6, 7]
    plan = WorkerPlan(step=1, loads=[LoadSpec("r", b.keys(PROMPT), dst, COUNTS)])
    try:
        with pytest.raises(KVFlowFatal, match=r"layer 0's load did not stop within load_time"):
            run_step(b, plan)
        assert stuck.reading.is_set()
        with pytest.raises(KVFlowFatal):  # and at every later call: vLLM gets nothing back
            b.worker.take_error_blocks()
        with pytest.raises(KVFlowFatal):
            b.worker.take_results()
        assert not b.worker_events.of(TransferFailed, "r")
    finally:
        stuck.unstick.set()  # the read returns and lands: in blocks vLLM never got back
    assert b.worker_events.wait_for(TransferFailed, "r").timed_out
    assert block_bytes(b.layout, 0, 5) == block_bytes(a.layout, 0, 1), "the late write"


def test_an_asynchronous_load_that_outlives_its_deadline_stops_the_engine(
    start_engine: Callable[..., Engine],
) -> None:
    """Nothing in vLLM waits on an asynchronous load: its request would wait forever. Past
    load_timeout_s + grace, the next `take_results` (every step) stops the engine."""
    a = start_engine("a")
    save_prompt(a, "src", PROMPT, [1, 2, 3])
    b = start_engine("b", config=KVFlowConfig(load_timeout_s=0.5), worker_transport=StuckReadFs)
    stuck = b.worker_transport
    assert isinstance(stuck, StuckReadFs)
    plan = WorkerPlan(step=1, loads=[LoadSpec("r", b.keys(PROMPT), [5, 6, 7], COUNTS, True)])
    try:
        run_step(b, plan)
        assert stuck.reading.wait(WAIT)
        assert not b.worker.take_results().finished_recving  # within its deadline: waits
        b.worker._now = lambda: time.monotonic() + 3600.0  # an hour later
        with pytest.raises(KVFlowFatal, match="the asynchronous load of r did not stop within"):
            b.worker.take_results()
    finally:
        stuck.unstick.set()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["layer", "async"])
def test_a_transfer_that_cannot_be_stopped_stops_the_engine(
    start_engine: Callable[..., Engine], asynchronous: bool
) -> None:
    e = start_engine("stuck-read", worker_transport=StuckPeer)
    plan = WorkerPlan(
        step=1, loads=[LoadSpec("r", e.keys(PROMPT), [5, 6, 7], COUNTS, asynchronous)]
    )
    with pytest.raises(KVFlowFatal, match=r"the load of r into blocks \[5, 6, 7\] could not be st"):
        run_step(e, plan)
        failed = e.worker_events.wait_for(TransferFailed, "r")  # an asynchronous load's
        e.worker.take_results()  # end is learnt of here
    failed = e.worker_events.wait_for(TransferFailed, "r")
    assert failed.block_ids == [] and "could not be stopped" in failed.reason, "none handed back"


def test_a_dead_loop_hands_every_lent_block_back_and_fails_its_loads(
    start_engine: Callable[..., Engine],
) -> None:
    """kvflow's loop dies (a BaseException escapes it) with a lent request's save in flight:
    vLLM gets the lent blocks back, loads bound afterwards fail at once (sync: this step's
    error blocks; async: failed_recving), and nothing waits for the dead loop."""
    e = start_engine("dead", worker_transport=GatedFs)
    gated, rt = e.worker_transport, e.worker.runtime
    assert isinstance(gated, GatedFs)
    run_step(e, prefill_cold(e, "d", PROMPT, [1, 2, 3]))
    assert gated.entered.wait(WAIT)  # its save is in flight
    assert e.sched.finished("d", [1, 2, 3]) == (True, None)  # vLLM lends the blocks
    run_step(e, e.sched.plan([]))
    assert not e.worker.take_results().finished_sending, "held while its save runs"

    kill_loop(rt, gated.release.set)  # trio ends the save (it waits for its thread)

    keys = e.keys(PROMPT)
    after = WorkerPlan(
        step=9,
        loads=[
            LoadSpec("s", keys, [5, 6, 7], COUNTS),
            LoadSpec("a", keys, [8, 9, 10], COUNTS, True),
        ],
    )
    e.worker.bind(after)
    assert e.worker._gate.settled.is_set(), "the forward does not wait for a dead loop"
    run_step(e, after)
    results = e.worker.take_results()
    assert results.finished_sending == {"d"}
    assert results.finished_recving == results.failed_recving == {"a"}
    assert e.worker.take_error_blocks() == {5, 6, 7, 8, 9, 10}
    later = e.worker.take_results()  # each reported once
    assert not (later.finished_sending or later.finished_recving or later.failed_recving)
    assert e.worker.take_error_blocks() == set()


def test_a_dead_scheduler_loop_makes_lookups_misses_not_a_wait(
    start_engine: Callable[..., Engine],
) -> None:
    """vLLM asks again while a lookup is pending: were the loop gone, forever."""
    e = start_engine("dead-sched")
    kill_loop(e.sched.runtime)
    e.sched.add_request("r", PROMPT)  # its lookup is dropped: no loop runs it
    assert e.sched.lookup("r", 0) == 0


# -- preemption and shutdown -----------------------------------------------


def test_preempt_cancels_an_in_flight_save(
    start_engine: Callable[..., Engine], store: Path
) -> None:
    e = start_engine("pre", config=KVFlowConfig(save_timeout_s=60.0))
    keys = e.keys(PROMPT)
    plan = prefill_cold(e, "p", PROMPT, [1, 2, 3])
    e.worker.bind(decode_plan(encode_plan(plan)))  # the forward never reports a layer computed
    e.worker_events.wait_for(SaveStarted, "p")

    preempt = e.sched.plan([], preempted=["p"])
    assert preempt.preempted == ["p"]
    e.worker.preempt(preempt.preempted)  # vLLM's handle_preemptions, before reusing blocks
    failed = e.worker_events.wait_for(TransferFailed, "p")
    assert failed.direction == "save" and "preempted" in failed.reason and not failed.timed_out
    assert not [p for p in stored_files(store) if p.name.startswith(keys[0])]
    run_step(e, preempt)

    # resumed later into new blocks: its save is planned again, and it lands
    resumed = e.sched.plan([ScheduledRequest("p", 0, len(PROMPT), [7, 8, 9], replace_blocks=True)])
    assert resumed.saves == [SaveSpec("p", keys, [7, 8, 9], COUNTS)]
    fill_blocks(e.layout, [7, 8, 9], seed=3)
    run_step(e, resumed)
    e.worker_events.wait_for(TransferDone, "p")
    fs = e.worker_transport
    assert isinstance(fs, FsTransport)
    assert all(fs.path(k).exists() for k in keys)


def test_close_drains_in_flight_saves(start_engine: Callable[..., Engine]) -> None:
    e = start_engine("drain", worker_transport=GatedFs, worker_runtime_cls=CallSpyRuntime)
    gated, rt = e.worker_transport, e.worker.runtime
    assert isinstance(gated, GatedFs) and isinstance(rt, CallSpyRuntime)
    keys = e.keys(PROMPT)
    try:
        run_step(e, prefill_cold(e, "d", PROMPT, [1, 2, 3]))
        assert gated.entered.wait(WAIT)  # the save is in flight
        rt.called.clear()
        closer = threading.Thread(target=e.worker.close, args=(30.0,))
        closer.start()
        assert rt.called.wait(WAIT)  # close() is waiting for the drain ...
    finally:
        gated.release.set()  # ... and only now may the save go on
    closer.join(WAIT)
    assert not closer.is_alive()
    assert not rt.running
    assert e.worker_events.of(TransferDone, "d")
    assert all(gated.path(k).exists() for k in keys)


def test_close_after_a_timed_out_preempt_still_drains(start_engine: Callable[..., Engine]) -> None:
    e = start_engine(
        "stuck-io",
        config=KVFlowConfig(preempt_timeout_s=0.3),
        worker_transport=GatedFs,
        worker_runtime_cls=CallSpyRuntime,
    )
    gated, rt = e.worker_transport, e.worker.runtime
    assert isinstance(gated, GatedFs) and isinstance(rt, CallSpyRuntime)
    errors: list[BaseException] = []

    def close() -> None:
        try:
            e.worker.close(WAIT)
        except BaseException as exc:
            errors.append(exc)

    closer = threading.Thread(target=close)
    try:
        run_step(e, prefill_cold(e, "d", PROMPT, [1, 2, 3]))
        assert gated.entered.wait(WAIT)  # the save is blocked in a thread: not cancellable
        e.worker.preempt(["d"])  # gives up after preempt_timeout_s, as designed
        rt.called.clear()
        closer.start()
        assert rt.called.wait(WAIT)
        rt.call(trio.testing.wait_all_tasks_blocked, timeout=WAIT)  # the drain is waiting
    finally:
        gated.release.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert errors == []
    assert not rt.running
    assert not any(gated.path(k).exists() for k in e.keys(PROMPT)), "the cancelled save stored"


def test_close_gives_up_on_a_stuck_save_after_drain_s(
    start_engine: Callable[..., Engine], store: Path
) -> None:
    e = start_engine("stuck", worker_transport=HangingTransport)
    hanging = e.worker_transport
    assert isinstance(hanging, HangingTransport)
    run_step(e, prefill_cold(e, "s", PROMPT, [1, 2, 3]))
    e.worker_events.wait_for(SaveStarted, "s")
    e.worker.close(0.2)  # returns: the stuck save was cancelled, not waited for
    assert hanging.cancelled.is_set()
    assert not e.worker.runtime.running
    assert stored_files(store) == []
