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


class CountingSocket:
    """A zmq socket that counts send attempts and gives up after `limit` (so a send
    loop that never yields fails the test instead of freezing it)."""

    def __init__(self, sock: zmq.Socket, limit: int = 1000) -> None:  # type: ignore[type-arg]
        self._sock, self.attempts, self._limit = sock, 0, limit

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)

    def send_multipart(self, *args: object, **kw: object) -> object:
        self.attempts += 1
        if self.attempts > self._limit:
            raise RuntimeError(f"{self.attempts} send attempts without waiting")
        return self._sock.send_multipart(*args, **kw)


async def test_a_router_send_to_a_full_peer_waits_without_spinning(
    ctx: zmq.Context,  # type: ignore[type-arg]
) -> None:
    """ROUTER_MANDATORY: a send to a peer whose pipe is full raises EAGAIN while the
    socket still reports POLLOUT (another peer has room); the send must back off, not
    retry in a loop that never yields to trio."""
    raw = ctx.socket(zmq.ROUTER)
    raw.setsockopt(zmq.ROUTER_MANDATORY, 1)
    raw.setsockopt(zmq.SNDHWM, 1)
    raw.setsockopt(zmq.SNDBUF, 4096)
    endpoint = bind_loopback(raw)
    peers = {}
    for name in (b"stalled", b"live"):
        peers[name] = ctx.socket(zmq.DEALER)
        peers[name].setsockopt(zmq.IDENTITY, name)
        peers[name].setsockopt(zmq.RCVHWM, 1)
        peers[name].setsockopt(zmq.RCVBUF, 4096)
        peers[name].connect(endpoint)
        peers[name].send(b"hello")
    counting = CountingSocket(raw)
    router = TrioSocket(counting)  # type: ignore[arg-type]
    with trio.fail_after(10):
        for _ in peers:
            await router.recv_multipart()
        big = bytes(256 << 10)
        sent = 0
        with trio.move_on_after(0.5) as window:  # the stalled peer never reads
            while True:
                await router.send_multipart([b"stalled", big])
                sent += 1
    assert window.cancelled_caught and sent >= 1
    assert int(raw.getsockopt(zmq.EVENTS)) & zmq.POLLOUT, "the live peer still has room"
    assert counting.attempts < 300, f"{counting.attempts} attempts in 0.5 s: a busy loop"
    raw.close(0)
    for sock in peers.values():
        sock.close(0)
