"""`fs` answers lookups that come together in one worker thread call (`Batched`), and no
caller waits on a batch that nobody runs."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from kvflow_fs._batch import Batched


class Doubled:
    """`Batched` doubling its items, each batch recorded, each answer in `got`; a
    batch waits for `gate` to be set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.batches: list[list[int]] = []
        self.got: dict[int, int] = {}
        self.batched = Batched(self._double)

    def _double(self, items: list[int]) -> list[int]:
        self.gate.wait(timeout=30)
        self.batches.append(items)
        return [2 * x for x in items]

    async def ask(self, x: int) -> None:
        self.got[x] = await self.batched(x)


async def test_a_burst_of_calls_is_one_thread_call_after_the_first() -> None:
    d = Doubled()
    async with trio.open_nursery() as nursery:
        for x in range(100):
            nursery.start_soon(d.ask, x)
    assert d.got == {x: 2 * x for x in range(100)}
    assert len(d.batches) <= 2, f"{len(d.batches)} thread calls for 100 lookups"  # 1, then 99


async def test_callers_waiting_on_a_cancelled_runner_still_get_their_answers() -> None:
    d = Doubled()
    d.gate.clear()  # the first batch holds until the runner is cancelled
    batched, ask, gate = d.batched, d.ask, d.gate

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            runner = trio.CancelScope()

            async def first() -> None:
                with runner:
                    await batched(1)  # runs the batches: its own, in a thread held at the gate

            nursery.start_soon(first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, 2)
            nursery.start_soon(ask, 3)
            await trio.testing.wait_all_tasks_blocked()
            runner.cancel()  # while its thread runs: the next batch is left to a waiter
            gate.set()
    assert d.got == {2: 4, 3: 6}
    assert [sorted(b) for b in d.batches] == [[1], [2, 3]]


async def test_an_error_reaches_every_call_of_its_batch() -> None:
    def fail(items: list[int]) -> list[int]:
        raise OSError(f"stat failed for {items}")

    batched = Batched(fail)
    errors: dict[int, str] = {}

    async def ask(x: int) -> None:
        with pytest.raises(OSError) as info:
            await batched(x)
        errors[x] = str(info.value)

    async with trio.open_nursery() as nursery:
        for x in range(3):
            nursery.start_soon(ask, x)
    assert sorted(errors) == [0, 1, 2]
    assert all(str(x) in why for x, why in errors.items()), errors  # its own batch's error
    assert len(set(errors.values())) == 2, errors  # the first call's batch, the others'
