"""A store serves engines of another block size (`kvflow.shapes.reblock`), on real `fs` files
through kvflow's scheduler and worker engines: what an engine of blocks of 4 tokens
saved, an engine of blocks of 8 finds and loads token for token, and back, from any
first block; device caches (staged token-major) only, each stand-in here a host cache
labelled `cuda` whose staging runs as on a GPU."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kvflow.engine.scheduler import ScheduledRequest
from kvflow.geometry.layout import KVLayout
from kvflow.keys import chunk_token_counts
from kvflow.observe.events import TransferDone, TransferFailed
from kvflow.shapes.reblock import StoredRun, load_window, other_block_sizes
from kvflow.testing.layouts import token_bytes

from ..support.kvflow_engines import Engine, lookup, run_step, save_prompt, stored_files

PROMPT = list(range(300, 321))  # 21 tokens: blocks of 4 (5 and a partial 1), of 8 (2 and 5)

Start = Callable[..., Engine]


def _tokens(layout: KVLayout, blocks: Sequence[int], counts: Sequence[int]) -> list[bytes]:
    """Per layer, the KV of `blocks`' first `counts` tokens, token by token."""
    return [
        b"".join(token_bytes(layout, layer, b, n) for b, n in zip(blocks, counts, strict=False))
        for layer in range(layout.num_layers)
    ]


def _engines(start_engine: Start, saver: int, reader: int) -> tuple[Engine, Engine]:
    a = start_engine("saver", device=True, block_size=saver)
    b = start_engine("reader", device=True, block_size=reader, store_block_sizes=[saver])
    assert a.namespace == b.namespace, "a device cache's namespace has no block size"
    return a, b


def _loaded_and_saved(e: Engine) -> None:
    """The step's load and its save of the prompt under this engine's keys both done."""
    e.worker_events.wait_for(TransferDone, "q", count=2)
    assert sorted(d.direction for d in e.worker_events.of(TransferDone, "q")) == ["load", "save"]
    assert e.worker_events.of(TransferFailed, "q") == []


@pytest.mark.parametrize("sizes", [(4, 8), (8, 4)], ids=["4-into-8", "8-into-4"])
def test_an_engine_loads_what_an_engine_of_another_block_size_saved(
    start_engine: Start, sizes: tuple[int, int]
) -> None:
    a, b = _engines(start_engine, *sizes)
    theirs = chunk_token_counts(len(PROMPT), a.block_size)
    saved = list(range(1, 1 + len(theirs)))
    save_prompt(a, "p", PROMPT, saved)
    assert lookup(b, "q", PROMPT) == len(PROMPT) - 1  # vLLM computes the last token
    ours = chunk_token_counts(len(PROMPT), b.block_size)
    blocks = list(range(8, 8 + len(ours)))
    b.sched.allocated("q", blocks, len(PROMPT) - 1)
    plan = b.sched.plan(
        [ScheduledRequest("q", 0, len(PROMPT), blocks, replace_blocks=True, token_ids=PROMPT)]
    )
    (spec,) = plan.loads
    assert spec.stored is not None and spec.stored.block_size == a.block_size
    assert spec.stored.keys == a.keys(PROMPT) and spec.tp_sizes == []
    run_step(b, plan)
    _loaded_and_saved(b)
    want, got = _tokens(a.layout, saved, theirs), _tokens(b.layout, blocks, ours)
    loaded = sum(spec.token_counts)  # the last token too where it ends a block of 8
    assert [g[: loaded * len(g) // 21] for g in got] == [w[: loaded * len(w) // 21] for w in want]
    saves = [k for s in plan.saves for k in s.keys]  # saved again as this engine keys them
    assert saves == b.keys(PROMPT)


def test_a_load_from_a_later_block_skips_the_tokens_before_it(start_engine: Start) -> None:
    """vLLM's own prefix cache holds the first block of 4: the load reads the stored
    chunk of 8 holding tokens 0..7 and puts only tokens 4..7 (and the rest) in blocks."""
    a, b = _engines(start_engine, 8, 4)
    save_prompt(a, "p", PROMPT, [1, 2, 3])
    assert lookup(b, "q", PROMPT, num_computed=4) == len(PROMPT) - 1 - 4
    blocks = [8, 9, 10, 11, 12, 13]
    b.sched.allocated("q", blocks, len(PROMPT) - 1 - 4)
    plan = b.sched.plan(
        [ScheduledRequest("q", 4, len(PROMPT) - 4, blocks, replace_blocks=True, token_ids=PROMPT)]
    )
    (spec,) = plan.loads
    assert spec.block_ids == blocks[1:5] and spec.stored is not None and spec.stored.skip == 4
    untouched = _tokens(b.layout, [8], [4])
    run_step(b, plan)
    _loaded_and_saved(b)
    assert _tokens(b.layout, [8], [4]) == untouched, "the block vLLM computed is not written"
    want = _tokens(a.layout, [1, 2, 3], [8, 8, 5])
    got = _tokens(b.layout, blocks[:5], [4] * 5)
    assert [g[len(g) // 5 :] for g in got] == [
        w[len(w) // 21 * 4 : len(w) // 21 * 20] for w in want
    ]


def test_windows_and_the_sizes_looked_for() -> None:
    run = StoredRun(8, ["a", "b", "c"], [8, 8, 5])
    assert run.window(4, 12) == StoredRun(8, ["a", "b"], [8, 8], 4)
    assert run.window(16, 5) == StoredRun(8, ["c"], [5], 0)
    with pytest.raises(ValueError, match="not in this run"):
        run.window(16, 6)
    assert load_window(run, [4] * 5 + [1], [1, 2, 3]) == (StoredRun(8, ["a", "b"], [8, 8], 4), "")
    assert "gaps" in load_window(run, [4] * 5 + [1], [1, 3])[1]
    assert other_block_sizes(16) == [32, 64, 128, 256]
    assert other_block_sizes(64) == [16, 32, 128, 256]


def test_a_missing_chunk_fails_the_blocks_from_the_one_holding_it(
    start_engine: Start, store: Path
) -> None:
    """Chunk 2 of 4 tokens (tokens 8..11) is gone after the lookup: the engine of 8 keeps
    its first block and reports the rest failed (vLLM recomputes from there)."""
    a, b = _engines(start_engine, 4, 8)
    save_prompt(a, "p", PROMPT, [1, 2, 3, 4, 5, 6])
    assert lookup(b, "q", PROMPT) == len(PROMPT) - 1
    gone = a.keys(PROMPT)[2]
    next(p for p in stored_files(store) if p.name.startswith(gone)).unlink()
    blocks = [8, 9, 10]
    b.sched.allocated("q", blocks, len(PROMPT) - 1)
    plan = b.sched.plan(
        [ScheduledRequest("q", 0, len(PROMPT), blocks, replace_blocks=True, token_ids=PROMPT)]
    )
    run_step(b, plan)
    failed = b.worker_events.wait_for(TransferFailed, "q")
    assert failed.direction == "load" and failed.block_ids == [9, 10], failed
    assert gone in failed.reason
