"""TrioSocket on real zmq sockets: many messages both ways, cancellation, endpoints."""

from __future__ import annotations

import pytest
import trio
import zmq

from kvflow.zmqio import TrioSocket, bind_loopback


@pytest.fixture
def ctx() -> zmq.Context:  # type: ignore[type-arg]
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


async def test_router_dealer_round_trips_many_messages(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    router, dealer = TrioSocket(ctx.socket(zmq.ROUTER)), TrioSocket(ctx.socket(zmq.DEALER))
    endpoint = bind_loopback(router.sock)
    assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
    dealer.sock.connect(endpoint)
    n = 2000
    payload = bytes(range(256)) * 64

    async def echo() -> None:
        for _ in range(n):
            ident, body = await router.recv_multipart()
            await router.send_multipart([ident, body[::-1]])

    async def client(got: list[bytes]) -> None:  # one task owns the dealer: bursts
        for start in range(0, n, 100):
            for i in range(start, start + 100):
                await dealer.send_multipart([i.to_bytes(4, "little") + payload])
            for _ in range(100):
                (body,) = await dealer.recv_multipart()
                got.append(body)

    got: list[bytes] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(echo)
            nursery.start_soon(client, got)
    assert len(got) == n
    assert [int.from_bytes(b[::-1][:4], "little") for b in got] == list(range(n))
    assert all(b[::-1][4:] == payload for b in got)
    router.close()
    dealer.close()


async def test_a_blocked_receive_is_cancellable(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    sock = TrioSocket(ctx.socket(zmq.DEALER))
    bind_loopback(sock.sock)
    with trio.move_on_after(0.05) as scope:
        await sock.recv_multipart()
    assert scope.cancelled_caught
    sock.close()


def test_a_taken_port_is_a_clear_error(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    a, b = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    port = int(bind_loopback(a).rsplit(":", 1)[1])
    with pytest.raises(OSError, match=f"cannot bind tcp://127.0.0.1:{port}"):
        bind_loopback(b, port=port)
    a.close(0)
    b.close(0)


async def test_two_tasks_on_one_socket_is_a_loud_error(ctx: zmq.Context) -> None:  # type: ignore[type-arg]
    sock = TrioSocket(ctx.socket(zmq.DEALER))
    bind_loopback(sock.sock)
    with pytest.raises(ExceptionGroup) as err:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sock.recv_multipart)
            nursery.start_soon(sock.recv_multipart)
    assert err.group_contains(trio.BusyResourceError)
    sock.close()
