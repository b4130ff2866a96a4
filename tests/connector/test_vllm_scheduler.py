"""kvflow's scheduler side inside vLLM's real `Scheduler` (no engine, no model forward).

Each test builds vLLM's v1 `Scheduler` with `KVFlowConnector` as its KV connector
(see `tests/support/vllm_scheduler.py`), steps it by hand and plays the worker: it reads the
`WorkerPlan` kvflow ships in `scheduler_output.kv_connector_metadata` and answers with
the `KVConnectorOutput` a worker would send. Checked against vLLM's own state: block
tables (`kv_cache_manager.get_block_ids`), the block pool's free count, request
lifetimes.

Every scenario runs in both of the engine core's loops (the `loop` fixture): `sync`
(vLLM's `Scheduler`, each step's output processed before the next step is scheduled)
and `async` (`--async-scheduling`: `AsyncScheduler`, step N+1 scheduled before step N's
output is processed). The harness checks at every step that kvflow's saves, loads and
offers name the request's blocks in vLLM, and never a block vLLM has taken back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="needs vLLM installed")

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvflow.hidden_states import HiddenStatesRef
from kvflow.keys import chunk_keys

from ..support.vllm_scheduler import (
    BLOCK_SIZE,
    SHARD,
    Harness,
    Loop,
    MakeHarness,
    fs_config,
    make_request,
    prompt_of,
    run_real_worker,
    run_to_completion,
)


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def check_saves(h: Harness, prompts: dict[str, list[int]]) -> dict[str, set[int]]:
    """Every save kvflow planned names the chunks' keys and, for each, the block vLLM
    holds that chunk in at that step. Returns the chunk indices saved per request."""
    ns = h.connector.context.namespaces[0]
    keys = {r: chunk_keys(ns, p, BLOCK_SIZE) for r, p in prompts.items()}
    saved: dict[str, set[int]] = {r: set() for r in prompts}
    for n, step in enumerate(h.steps):
        for spec in step.plan.saves:
            all_keys = keys[spec.req]
            first = all_keys.index(spec.keys[0])
            chunks = range(first, first + len(spec.keys))
            assert spec.keys == all_keys[chunks.start : chunks.stop], f"step {n}: {spec}"
            table = step.block_ids[spec.req]
            assert spec.block_ids == table[chunks.start : chunks.stop], (
                f"step {n}: kvflow saves {spec.req} chunks {list(chunks)} from blocks "
                f"{spec.block_ids}; vLLM holds them in {table[chunks.start : chunks.stop]}"
            )
            prompt_len = len(prompts[spec.req])
            expected_counts = [min(BLOCK_SIZE, prompt_len - c * BLOCK_SIZE) for c in chunks]
            assert spec.token_counts == expected_counts
            saved[spec.req].update(chunks)
    return saved


def check_tables(h: Harness) -> None:
    """At every step, kvflow's block table of each scheduled request is vLLM's."""
    for n, step in enumerate(h.steps):
        for req, table in step.block_ids.items():
            if req in step.kvflow_tables:
                assert step.kvflow_tables[req] == table, (
                    f"step {n}: kvflow plans {req} over blocks {step.kvflow_tables[req]}, "
                    f"vLLM's block table is {table}"
                )


# --------------------------------------------------------------------------- 1. saves


def test_requests_run_to_completion_saving_their_own_blocks(
    harness: MakeHarness, tmp_path: Path
) -> None:
    # 64 tokens a step: prompts are prefilled (and saved) over several steps
    h = harness(fs_config(tmp_path, max_num_batched_tokens=64), 32)
    start = h.free_blocks
    assert start == 31  # block 0 is vLLM's null block
    prompts = {"a": prompt_of(1, 40), "b": prompt_of(2, 48), "c": prompt_of(3, 100)}
    h.add(*(make_request(r, p, max_tokens=3) for r, p in prompts.items()))

    for _ in range(20):  # the worker reports nothing yet: saves still "in flight"
        h.step()
        if all(r.is_finished() for r in h.scheduler.requests.values()):
            break
    finished = {o.request_id: o.finish_reason for s in h.steps for o in s.finished}
    assert set(finished) == set(prompts)
    lent_step = h.step()  # the plan after the last finish tells the worker what was lent
    lent = {r for plan in h.plans() for r in plan.lent}
    assert lent == set(prompts), "every request that saved is lent to kvflow"
    assert set(h.scheduler.requests) == set(prompts), "vLLM waits for finished_sending"
    held = start - h.free_blocks
    assert held == blocks_for(40 + 2) + blocks_for(48 + 2) + blocks_for(100 + 2)
    assert lent_step.plan.saves == []

    check_tables(h)
    saved = check_saves(h, prompts)
    for r, p in prompts.items():
        assert saved[r] == set(range(blocks_for(len(p)))), f"{r}: every prompt chunk saved"
    c_saves = [len(s.keys) for step in h.steps for s in step.plan.saves if s.req == "c"]
    assert len(c_saves) > 1 and sum(c_saves) == 7, "c saved chunk by chunk as it prefilled"

    h.step(finished_sending=lent)
    assert h.free_blocks == start, "every block is back in the pool"
    assert not h.scheduler.requests
    assert not h.kvflow_requests, "kvflow dropped every finished request's state"


def test_request_stops_while_its_next_step_is_scheduled(
    harness: MakeHarness, tmp_path: Path, loop: Loop
) -> None:
    """The model samples a stop token. Async, the engine core has scheduled the
    request's next decode step before that token reaches vLLM, so the request finishes
    with a step of it in flight: its blocks are lent for its saves all the same, kept
    until the worker reports them done, and the in-flight step's token is dropped."""
    h = harness(fs_config(tmp_path), 16)
    start = h.free_blocks
    prompt = prompt_of(1, 40)
    h.add(make_request("r", prompt, max_tokens=20, stop_token_ids=[7]))
    h.tokens["r"] = [8, 8, 7]  # prefill, first decode, second decode: stop
    stop = None
    for _ in range(6):
        h.step()
        stop = next((s for s in h.steps if s.finished), None)
        if stop is not None:
            break
    assert stop is not None, "r never stopped"
    assert [(o.request_id, o.finish_reason) for o in stop.finished] == [("r", FinishReason.STOP)]
    later = [s.index for s in h.steps[stop.index + 1 :] if "r" in s.output.num_scheduled_tokens]
    assert later == ([stop.index + 1] if loop == "async" else []), later
    assert h.free_blocks == start - 3, "lent: r saved its prompt"
    lent = h.step()
    assert lent.plan.lent == ["r"] and not lent.output.num_scheduled_tokens
    h.step()
    assert h.free_blocks == start - 3, "held until finished_sending"
    h.step(finished_sending={"r"})
    assert h.free_blocks == start
    run_to_completion(h)
    tokens = [t for s in h.steps for o in s.outputs if o.request_id == "r" for t in o.new_token_ids]
    assert tokens == [8, 8, 7], "nothing after the stop token"
    assert h.num_sampled["r"] == (4 if loop == "async" else 3), "the runner sampled once more"
    assert check_saves(h, {"r": prompt}) == {"r": {0, 1, 2}}
    check_tables(h)
    assert not h.kvflow_requests


# ---------------------------------------------------------------------- 2. preemption


def test_preempted_request_resumes_with_matching_block_tables(
    harness: MakeHarness, tmp_path: Path
) -> None:
    # 7 usable blocks: two 40-token prompts take 3 each; the 4th block one needs to
    # decode past 48 tokens preempts the other (vLLM preempts the last running one)
    h = harness(fs_config(tmp_path), 8)
    start = h.free_blocks
    prompts = {"r1": prompt_of(1, 40), "r2": prompt_of(2, 40)}
    h.add(*(make_request(r, p, max_tokens=20) for r, p in prompts.items()))
    run_to_completion(h)

    preempted = [(n, s.plan.preempted) for n, s in enumerate(h.steps) if s.plan.preempted]
    assert len(preempted) >= 1 and preempted[0][1] == ["r2"], preempted
    first = preempted[0][0]
    resumed = next(n for n, s in enumerate(h.steps) if n > first and "r2" in s.block_ids)
    assert resumed > first + 1, "preemption and resume in different steps"
    check_tables(h)
    saved = check_saves(h, prompts)  # includes the saves planned again after resume
    assert any(s.req == "r2" for s in h.steps[resumed].plan.saves), (
        "saves cancelled by the preemption are planned again, over r2's new blocks"
    )
    assert saved["r2"] == {0, 1, 2}
    assert h.free_blocks == start
    assert not h.kvflow_requests


def test_reset_prefix_cache_preempt_and_resume_keeps_block_tables(
    harness: MakeHarness, tmp_path: Path
) -> None:
    """Preempted and resumed in one `schedule()` (a pause with clear_cache does this): the
    resumed request's new block table holds, and its prompt is saved from its own blocks
    (kvflow applied the preemption after the resume and saved decode blocks' KV under the
    prompt's keys)."""
    h = harness(fs_config(tmp_path), 16)
    prompts = {"r": prompt_of(1, 40)}
    h.add(make_request("r", prompts["r"], max_tokens=50))
    h.step()
    h.step()
    # as the engine core's pause_generation(mode="keep", clear_cache=True): the caches are
    # cleared once no step is in flight (async, vLLM defers freeing r's blocks until the
    # step in flight is processed, and a reset before that raises RuntimeError)
    h.scheduler.set_pause_state(PauseState.PAUSED_ALL)
    h.drain()
    if not h.scheduler.reset_prefix_cache(reset_running_requests=True):
        pytest.fail("reset_prefix_cache failed")
    h.scheduler.set_pause_state(PauseState.UNPAUSED)
    resumed = h.step()
    if resumed.plan.preempted != ["r"] or "r" not in resumed.block_ids:
        pytest.fail("r was not preempted and resumed in the same step")
    run_to_completion(h)
    check_saves(h, prompts)
    check_tables(h)


def test_preempted_outside_schedule_then_aborted_stops_its_saves(
    harness: MakeHarness, tmp_path: Path
) -> None:
    """Issue 28, finding 1: a request with a prompt save in flight is preempted outside
    `schedule()` (`reset_prefix_cache(reset_running_requests=True)`, as a pause with
    clear_cache does), then aborted before the next step, and a new request takes its
    blocks. vLLM gave the blocks back at the preemption and lends none at the finish:
    the worker must stop the save before the step that reuses them (the next plan
    names it preempted), or it stores the new request's KV under the aborted one's keys
    (the harness checks at every step that no save runs over blocks vLLM took back)."""
    h = harness(fs_config(tmp_path, max_num_batched_tokens=32), 16)
    start = h.free_blocks
    r = prompt_of(1, 100)
    h.add(make_request("r", r, max_tokens=4))
    first = h.step()  # r: 32 of 100 prompt tokens, its first chunk's save starts
    assert [s.req for s in first.plan.saves] == ["r"]
    h.scheduler.set_pause_state(PauseState.PAUSED_ALL)
    h.drain()
    if not h.scheduler.reset_prefix_cache(reset_running_requests=True):
        pytest.fail("reset_prefix_cache failed")
    h.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    h.scheduler.set_pause_state(PauseState.UNPAUSED)
    w = prompt_of(2, 220)  # 14 of the 15 blocks: vLLM hands it r's blocks too
    h.add(make_request("w", w, max_tokens=4))
    assert "r" in h.step().plan.preempted, "the worker is not told to stop r's save"
    run_to_completion(h)
    w_blocks = {b for step in h.steps for b in step.block_ids.get("w", [])}
    assert w_blocks & set(first.block_ids["r"]), "vLLM never gave w r's blocks"
    assert h.free_blocks == start
    check_saves(h, {"r": r, "w": w})


# --------------------------------------------------------------------------- 3. abort


def test_abort_mid_prefill_holds_blocks_until_saves_finish(
    harness: MakeHarness, tmp_path: Path
) -> None:
    h = harness(fs_config(tmp_path, max_num_batched_tokens=32), 16)
    start = h.free_blocks
    prompt = prompt_of(1, 100)
    h.add(make_request("r", prompt, max_tokens=4), make_request("w", prompt_of(2, 60)))
    first = h.step()  # r: 32 of 100 prompt tokens; w waits (no budget left)
    assert first.output.num_scheduled_tokens == {"r": 32}
    assert [(s.req, s.block_ids) for s in first.plan.saves] == [("r", first.block_ids["r"])]

    h.scheduler.finish_requests(["r", "w"], RequestStatus.FINISHED_ABORTED)
    assert "w" not in h.scheduler.requests, "a request that saved nothing is not lent"
    assert "r" in h.scheduler.requests, "r's blocks are lent while its saves run"
    assert h.free_blocks == start - 2
    lent = h.step()
    assert lent.plan.lent == ["r"] and not lent.output.num_scheduled_tokens
    h.step()  # the saves are still running: the worker reports nothing
    assert h.free_blocks == start - 2, "blocks stay lent until finished_sending"
    h.step(finished_sending={"r"})
    assert h.free_blocks == start
    assert not h.scheduler.requests
    assert not h.kvflow_requests
    check_saves(h, {"r": prompt})


def test_abort_while_its_step_executes(harness: MakeHarness, tmp_path: Path) -> None:
    """Aborted between schedule() and update_from_output (an async engine's abort):
    the step's own saves are still to run, so the blocks must stay lent."""
    h = harness(fs_config(tmp_path), 16)
    start = h.free_blocks
    h.add(make_request("r", prompt_of(1, 40), max_tokens=4))
    step = h.step(
        before_update=lambda: h.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    )
    assert [s.block_ids for s in step.plan.saves] == [step.block_ids["r"]]
    assert h.free_blocks == start - 3
    assert h.step().plan.lent == ["r"]
    assert step.processed and step.finished == [], "vLLM ignores the output of r now"
    assert h.free_blocks == start - 3
    h.step(finished_sending={"r"})
    assert h.free_blocks == start
    assert not h.scheduler.requests and not h.kvflow_requests
    run_to_completion(h)


def test_abort_while_its_next_step_is_scheduled(
    harness: MakeHarness, tmp_path: Path, loop: Loop
) -> None:
    """Aborted after its second prefill step was scheduled, before that step's output:
    async, the engine core aborts (`_process_aborts_queue`) with both steps unprocessed,
    each saving two of r's chunks; sync, the first step's output is in. The blocks of
    both steps' saves stay lent until the worker reports them done."""
    h = harness(fs_config(tmp_path, max_num_batched_tokens=32), 16)
    start = h.free_blocks
    prompt = prompt_of(1, 100)
    h.add(make_request("r", prompt, max_tokens=4))
    unprocessed: list[int] = []

    def abort() -> None:
        unprocessed.extend(s.index for s in h.steps if not s.processed)
        h.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)

    first = h.step()
    second = h.step(before_update=abort)
    assert unprocessed == ([0, 1] if loop == "async" else [1])
    assert first.output.num_scheduled_tokens == second.output.num_scheduled_tokens == {"r": 32}
    table = second.block_ids["r"]
    assert [(s.req, s.block_ids) for s in first.plan.saves] == [("r", table[:2])]
    assert [(s.req, s.block_ids) for s in second.plan.saves] == [("r", table[2:4])]
    assert h.free_blocks == start - 4, "lent while both steps' saves run"
    lent = h.step()
    assert lent.plan.lent == ["r"] and not lent.output.num_scheduled_tokens
    assert first.processed and second.processed
    h.step()  # the saves are still running: the worker reports nothing
    assert h.free_blocks == start - 4
    h.step(finished_sending={"r"})
    assert h.free_blocks == start
    assert not h.scheduler.requests and not h.kvflow_requests
    run_to_completion(h)
    assert check_saves(h, {"r": prompt}) == {"r": {0, 1, 2, 3}}


# ---------------------------------------------------------------------- 4. async load


def store_prefix(harness: MakeHarness, store: Path, prompt: list[int]) -> list[str]:
    """Save `prompt`'s chunks to `store` the real way: an engine's scheduler plans the
    saves, kvflow's `WorkerEngine` runs them through the fs transport. Returns the keys."""
    a = harness(fs_config(store), 16)
    a.add(make_request("seed", prompt, max_tokens=1))
    while not any("seed" in plan.lent for plan in a.plans()):  # the plan that lends it
        assert len(a.steps) < 4, "seed was never lent"
        a.step()
    results = run_real_worker(a, a.plans())
    assert results.finished_sending == {"seed"}, "the worker released the lent request"
    keys = [k for plan in a.plans() for s in plan.saves for k in s.keys]
    assert keys == chunk_keys(a.connector.context.namespaces[0], prompt, BLOCK_SIZE)
    ns_dir = store / a.connector.context.namespaces[0]
    assert {p.name for p in ns_dir.rglob("*.kv")} == {f"{k}.{SHARD}.kv" for k in keys}
    return keys


def test_async_load_of_a_stored_prefix(harness: MakeHarness, tmp_path: Path) -> None:
    prompt = prompt_of(1, 40)
    keys = store_prefix(harness, tmp_path, prompt)

    h = harness(fs_config(tmp_path, load_mode="async"), 16)  # a fresh engine, same store
    start = h.free_blocks
    longer = prompt[:32] + prompt_of(9, 20)  # shares the first two chunks
    h.add(make_request("same", prompt, max_tokens=2), make_request("longer", longer))
    loading = h.step()
    assert not loading.output.num_scheduled_tokens, "both wait for their KV"
    for r in ("same", "longer"):
        assert h.scheduler.requests[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    loads = {s.req: s for s in loading.plan.loads}
    assert set(loads) == {"same", "longer"}
    same, longer_load = loads["same"], loads["longer"]
    assert same.asynchronous and longer_load.asynchronous
    # the whole prompt but its last token: 39 tokens, in all three chunks (partial tail too)
    assert same.keys == keys and same.token_counts == [16, 16, 8]
    assert same.block_ids == h.block_table("same")
    assert longer_load.keys == keys[:2] and longer_load.token_counts == [16, 16]
    assert longer_load.block_ids == h.block_table("longer")

    assert not h.step().output.num_scheduled_tokens, "no step before finished_recving"
    h.step(finished_recving={"same", "longer"})
    resumed = h.step()
    assert resumed.output.num_scheduled_tokens == {"same": 1, "longer": 52 - 32}
    assert resumed.block_ids["longer"][:2] == longer_load.block_ids
    # only the chunks the store lacks are saved
    assert [(s.req, len(s.keys)) for s in resumed.plan.saves] == [("longer", 2)]
    check_saves(h, {"same": prompt, "longer": longer})
    run_to_completion(h)
    assert h.free_blocks == start
    assert not h.kvflow_requests


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_async_load(harness: MakeHarness, tmp_path: Path, policy: str) -> None:
    prompt = prompt_of(1, 40)
    store_prefix(harness, tmp_path, prompt)
    config = fs_config(tmp_path, load_mode="async", kv_load_failure_policy=policy)
    h = harness(config, 16)
    start = h.free_blocks
    h.add(make_request("r", prompt, max_tokens=2))
    assert [s.req for s in h.step().plan.loads] == ["r"]
    # kvflow's worker reports a failed asynchronous load as both failed and finished
    h.step(failed_recving={"r"}, finished_recving={"r"})
    if policy == "fail":
        assert "r" not in h.scheduler.requests, "the request ended with an error"
    else:
        again = h.step()
        assert again.output.num_scheduled_tokens == {"r": 40}, "recomputed, not reloaded"
        assert again.plan.loads == []
        assert [len(s.keys) for s in again.plan.saves] == [3], "the bad hit is saved anew"
    run_to_completion(h)
    assert h.free_blocks == start
    assert not h.kvflow_requests


def test_abort_during_async_load(harness: MakeHarness, tmp_path: Path) -> None:
    prompt = prompt_of(1, 40)
    store_prefix(harness, tmp_path, prompt)
    h = harness(fs_config(tmp_path, load_mode="async"), 16)
    start = h.free_blocks
    h.add(make_request("r", prompt, max_tokens=2))
    assert [s.req for s in h.step().plan.loads] == ["r"]
    h.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert h.free_blocks == start - 3, "vLLM keeps the blocks the load writes into"
    after = h.step()
    assert after.plan.lent == [], "nothing saved: kvflow does not hold the blocks"
    h.step(finished_recving={"r"})
    assert h.free_blocks == start
    assert not h.scheduler.requests and not h.kvflow_requests


def test_hidden_states_keep_a_finished_requests_blocks_until_copied_out(
    harness: MakeHarness, tmp_path: Path
) -> None:
    """Under extract_hidden_states vLLM's scheduler lends a finished request's blocks to
    kvflow, which names its rows in kv_transfer_params and plans their export from the
    request's own blocks; the blocks go back when the worker says they were copied."""
    prompt = prompt_of(3, 40)
    # a consumer saves nothing: only the export keeps blocks
    config = fs_config(tmp_path, aux_layers=[1, 2], kv_role="kv_consumer")
    h = harness(config, 16)
    start = h.free_blocks
    h.add(make_request("r", prompt, max_tokens=1))
    first = h.collect(h.step())
    (out,) = first.finished
    ref = HiddenStatesRef.from_params(out.kv_transfer_params or {})
    assert ref.token_ids == prompt and ref.token_counts == [16, 16, 8]
    assert (ref.num_layers, ref.dtype) == (2, "float32")
    table = first.block_ids["r"]
    h.add(make_request("next", prompt_of(4, 8), max_tokens=1))  # vLLM steps on
    nxt = h.collect(h.step())
    exports = nxt.output.kv_connector_metadata.exports  # type: ignore[union-attr]
    assert [(e.req, e.block_ids, e.ref) for e in exports] == [("r", table, ref)]
    # both finished, both exporting: vLLM holds their blocks until kvflow copied them
    assert set(h.scheduler.requests) == {"r", "next"}
    assert h.free_blocks == start - 3 - 1
    h.add(make_request("last", prompt_of(5, 8), max_tokens=1))
    h.collect(h.step(finished_sending={"r", "next"}))
    assert set(h.scheduler.requests) <= {"last"}
    while h.scheduler.has_requests():  # `last`, exported too
        h.step(finished_sending={"last"})
    h.drain()
    assert h.free_blocks == start and not h.scheduler.requests


def test_no_hidden_states_of_a_request_aborted_while_its_load_lands(
    harness: MakeHarness, tmp_path: Path
) -> None:
    """Its rows are not in its blocks, and vLLM frees them when the load lands: exporting
    it would copy garbage and report blocks vLLM no longer holds (its scheduler asserts)."""
    prompt = prompt_of(1, 40)
    store_prefix(harness, tmp_path, prompt)
    config = fs_config(tmp_path, load_mode="async", aux_layers=[1, 2])
    h = harness(config, 16)
    start = h.free_blocks
    h.add(
        make_request("r", prompt, max_tokens=2, kv_transfer_params={"include_output_tokens": True})
    )
    assert [s.req for s in h.step().plan.loads] == ["r"]
    h.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    h.add(make_request("other", prompt_of(2, 20), max_tokens=2))
    after = h.step(finished_recving={"r"})
    assert after.output.kv_connector_metadata.exports == []  # type: ignore[union-attr]
    run_to_completion(h)
    assert h.free_blocks == start
    assert not h.scheduler.requests and not h.kvflow_requests


def test_abort_during_async_load_after_preemption(harness: MakeHarness, tmp_path: Path) -> None:
    """Saved, preempted (its saves stopped), resumed with an async load, aborted during
    it: nothing is lent for the stopped saves (kvflow lent the blocks vLLM held for the
    load, and vLLM freed them twice)."""
    prompt = prompt_of(1, 64)
    store_prefix(harness, tmp_path, prompt[:32])
    # no local prefix cache, so the resumed request looks its prompt up in the store again
    config = fs_config(tmp_path, load_mode="async", enable_prefix_caching=False)
    h = harness(config, 9)  # 8 usable blocks: q and r cannot both grow
    h.add(make_request("q", prompt_of(2, 48), max_tokens=40), make_request("r", prompt))
    r = h.scheduler.requests["r"]
    loads: set[str] = set()
    for _ in range(100):  # the worker's loads land one step after they start
        step = h.step(finished_recving=loads, send_lent=True)
        loads = {s.req for s in step.plan.loads}
        if r.num_preemptions and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            break
    else:
        pytest.fail("r was never preempted and reloaded")
    if not any(s.req == "r" for st in h.steps for s in st.plan.saves) or loads != {"r"}:
        pytest.fail("r did not save before its preemption, or does not reload on resume")

    h.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    # the load lands; kvflow's worker releases what the plan lends at once
    last = h.step(finished_recving={"r"}, send_lent=True)
    assert last.plan.lent == []
    run_to_completion(h)
    assert h.free_blocks == 8


def test_with_vllms_prefix_cache_loads_are_between_steps(
    harness: MakeHarness, tmp_path: Path
) -> None:
    """With vLLM's prefix cache on, kvflow loads between steps (decision 33), so no
    request computes over blocks still being loaded; without it, within the step."""
    prompt = prompt_of(1, 40)
    store_prefix(harness, tmp_path, prompt)
    plain = harness(fs_config(tmp_path, enable_prefix_caching=False), 16)
    assert plain.connector.context.config.load_mode == "layer"
    h = harness(fs_config(tmp_path, kv_load_failure_policy="fail"), 16)
    assert h.connector.context.config.load_mode == "async"
    h.add(make_request("r", prompt, max_tokens=2))
    (load,) = h.step().plan.loads
    assert load.asynchronous
    h.step(failed_recving={"r"}, finished_recving={"r"})
    assert "r" not in h.scheduler.requests, "the request ended with an error"
    run_to_completion(h)
    assert not h.kvflow_requests


def test_vllm_keeps_blocks_computed_over_a_failed_load_in_the_same_step(
    harness: MakeHarness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why decision 33 holds (vLLM 0.32-0.33, policy 'fail', loads within the step): "b"
    shares the blocks "r" loads (vLLM caches them as they are allocated), computes its
    own chunk over them, and "r"'s load fails. vLLM fails both, evicts "r"'s blocks from
    its prefix cache, and keeps "b"'s chunk, computed over bad KV, cached: a later
    request with "b"'s prompt reaches it as soon as the shared blocks are cached again.
    kvflow stores none of it (the worker drops saves computed over a failed load). If
    this test fails, vLLM evicts such blocks now and decision 33 can be revisited."""
    from kvflow_vllm.connector import cache_spec as connector_module

    monkeypatch.setattr(connector_module, "layer_loads_unsafe", lambda *_: "")
    prompt = prompt_of(1, 40)
    store_prefix(harness, tmp_path, prompt)
    h = harness(fs_config(tmp_path, kv_load_failure_policy="fail"), 16)
    if h.loop == "async":
        pytest.skip(
            "vLLM's prefix cache is the same in both loops; the async one would "
            "report the failed load a step later, past this test's one step"
        )
    assert h.connector.context.config.load_mode == "layer"
    other = prompt[:32] + prompt_of(9, 20)  # shares "r"'s first two chunks
    h.add(make_request("r", prompt, max_tokens=2), make_request("b", other, max_tokens=2))
    tables: dict[str, list[int]] = {}

    def fail_rs_second_block() -> None:
        tables.update(r=h.block_table("r"), b=h.block_table("b"))
        h.report.invalid_block_ids.add(tables["r"][1])

    step = h.step(before_update=fail_rs_second_block)
    (load,) = step.plan.loads
    assert load.req == "r" and not load.asynchronous
    assert tables["b"][:2] == tables["r"][:2], "b shares the blocks r loads"
    (save,) = [s for s in step.plan.saves if s.req == "b"]
    assert save.computed_over == tables["r"][:2], "kvflow knows b's chunk needs them"
    assert "r" not in h.scheduler.requests, "policy fail: r ended"
    assert h.scheduler.requests["b"].status == RequestStatus.FINISHED_ERROR  # lent to a save
    pool = h.scheduler.kv_cache_manager.block_pool
    assert pool.blocks[tables["r"][1]].block_hash is None, "r's bad block evicted"
    assert pool.blocks[tables["b"][2]].block_hash is not None, "b's chunk still cached"
