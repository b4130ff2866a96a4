"""`kvflow.engine.lending.Lending` on its own: every state of a request's blocks and every way
out of it (the module text draws them)."""

from __future__ import annotations

import trio
import trio.testing

from kvflow.engine.lending import Lending, lent_at_finish


def make() -> tuple[Lending, list[str]]:
    released: list[str] = []
    return Lending(released.append), released


async def test_lent_without_a_use_is_released_at_once_and_reported_once() -> None:
    lending, released = make()
    lending.bound(["r"], [])
    lending.lend("r")
    assert released == ["r"]
    assert lending.take_released() == {"r"}
    assert lending.take_released() == set()


async def test_lent_blocks_wait_for_the_last_use() -> None:
    lending, released = make()
    a, b = trio.CancelScope(), trio.CancelScope()
    lending.bound(["r"], [[1, 2], [3]])
    lending.start("r", a, [1, 2])
    lending.start("r", b, [3])
    lending.start("r")  # an offer of the same request
    lending.lend("r")
    assert lending.busy([1, 3, 9]) == {1, 3}
    lending.end("r", a)
    lending.end("r", b)
    assert (released, lending.take_released(), lending.busy([1, 2, 3])) == ([], set(), set())
    lending.end("r")
    assert released == ["r"] and lending.take_released() == {"r"}


async def test_uses_of_a_request_vllm_did_not_lend_release_nothing() -> None:
    lending, released = make()
    s = trio.CancelScope()
    lending.bound([], [[4]])
    lending.start("r", s, [4])
    lending.end("r", s)
    assert (released, lending.take_released(), lending.busy([4])) == ([], set(), set())


async def test_preemption_cancels_the_requests_saves_and_waits_for_their_end() -> None:
    lending, _ = make()
    scopes = {"p": trio.CancelScope(), "q": trio.CancelScope()}
    ended: list[str] = []
    async with trio.open_nursery() as nursery:
        for req, scope in scopes.items():
            lending.bound([], [[ord(req)]])
            lending.start(req, scope, [ord(req)])

            async def save(req: str = req, scope: trio.CancelScope = scope) -> None:
                with scope:
                    await trio.sleep_forever()
                ended.append(f"{req}: {lending.why(scope)}")
                lending.end(req, scope)

            nursery.start_soon(save)
        await trio.testing.wait_all_tasks_blocked()
        lending.cancel(["p"])
        await lending.ended(["p"])
        assert ended == ["p: request preempted"] and not scopes["q"].cancel_called
        lending.cancel_over({ord("q"), 999}, "vLLM reused its blocks")
        await lending.idle({ord("q")})
        assert ended[1] == "q: vLLM reused its blocks"
        await lending.drained()


async def test_when_the_loop_is_gone_every_lent_request_not_reported_is_released() -> None:
    lending, _ = make()
    s = trio.CancelScope()
    lending.bound(["a", "b", "c"], [[1]])
    lending.start("a", s, [1])
    lending.lend("a")  # still read
    lending.lend("b")  # released, not reported yet
    assert lending.take_released() == {"b"}
    lending.lend("c")
    assert lending.release_all() == {"a", "c"}
    assert lending.release_all() == set() and lending.take_released() == set()


def test_vllm_lends_a_finished_requests_blocks_only_while_kvflow_may_read_them() -> None:
    assert not lent_at_finish(saving=False)
    for why in ({"saving": True}, {"offering": True}, {"exporting": True}):
        assert lent_at_finish(**{"saving": False, **why})
