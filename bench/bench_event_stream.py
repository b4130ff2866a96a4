"""Benchmark: what kvflow's event path costs the thread that emits.

    python bench/bench_event_stream.py [--events 20000] [--rounds 5]

About 10 s on a 2-core machine. Prints, per setup, the median over `--rounds` bursts of
`--events` back-to-back `EventBus.emit(TransferDone)` calls timed on a runtime's trio
thread (the thread that emits in an engine), and the ratio to the bus alone measured in
the same process. The setups run in the order below, alternating rounds, so a noisy
neighbour moves them all:

- the bus alone (no publisher);
- a publisher nobody subscribes to (one flag check per event);
- one reader keeping up (a thread draining its own SUB socket);
- the same plus a stalled reader that never reads (its queue overflows; PUB drops
  for it alone).

Also `Runtime.submit` (what vLLM's thread pays per call into kvflow): median and p99
of 5000 calls.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from kvflow.observe.events import EventBus, LookupRequested, Origin, TransferDone
from kvflow.observe.stream import open_subscriber, start_publisher
from kvflow.runtime import Runtime

EVENT = TransferDone(
    req="cmpl-3f2a9c-0", direction="save", chunks=8, nbytes=1 << 22, elapsed_s=0.01
)


def burst(rt: Runtime, bus: EventBus, n: int) -> float:
    """Seconds per emit over `n` emits on the runtime's thread."""

    async def run() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            bus.emit(EVENT)
        return (time.perf_counter() - t0) / n

    return rt.call(run, timeout=120)


class Drain(threading.Thread):
    """A reader that keeps up."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        super().__init__(daemon=True)
        self.sock, self.stop, self.received = sock, threading.Event(), 0

    def run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(20):
                while True:
                    try:
                        self.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.received += 1


def joined(rt: Runtime, bus: EventBus, until: Any) -> None:
    """Emit probes until `until()` holds: a SUB misses what is sent before it joined."""
    deadline = time.monotonic() + 10
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError("subscriber never joined")
        rt.submit(bus.emit, LookupRequested(req="probe", num_tokens=0, num_chunks=0))
        time.sleep(0.02)


def submit_cost(rt: Runtime, n: int = 5000) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        rt.submit(lambda: None)
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000, statistics.quantiles(samples, n=100)[98] / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    ctx: zmq.Context[Any] = zmq.Context()
    rdir = Path(tempfile.mkdtemp(prefix="kvb"))  # ipc paths are limited to ~107 bytes
    rt_plain, rt_pub = Runtime("bench-plain"), Runtime("bench-pub")
    plain = EventBus(Origin("e", "worker"))
    bus = EventBus(Origin("e", "worker"))
    pub = start_publisher(rt_pub, bus, directory=rdir)
    assert pub is not None
    names = ["no publisher", "publisher, nobody subscribed", "one reader keeping up"]
    names.append("the same plus a stalled reader")
    costs: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(a.rounds):
        costs[names[0]].append(burst(rt_plain, plain, a.events))
        joined(rt_pub, bus, lambda: not pub.watched)
        costs[names[1]].append(burst(rt_pub, bus, a.events))
        drain = Drain(open_subscriber(pub.endpoint, ctx))
        drain.start()
        joined(rt_pub, bus, lambda d=drain: d.received > 0)  # type: ignore[misc]
        costs[names[2]].append(burst(rt_pub, bus, a.events))
        stalled = open_subscriber(pub.endpoint, ctx, rcvhwm=1000)
        joined(rt_pub, bus, lambda s=stalled: s.poll(0))  # type: ignore[misc]
        costs[names[3]].append(burst(rt_pub, bus, a.events))
        drain.stop.set()
        drain.join()
        drain.sock.close(linger=0)
        stalled.close(linger=0)
    base = statistics.median(costs[names[0]])
    print(f"EventBus.emit, median of {a.rounds} bursts of {a.events} (us per event, x bus alone)")
    for k in names:
        m = statistics.median(costs[k])
        print(f"  {k:<34} {m * 1e6:7.2f} us  {m / base:6.1f}x")
    med, p99 = submit_cost(rt_plain)
    print(f"Runtime.submit: median {med:.2f} us, p99 {p99:.2f} us over 5000 calls")
    rt_plain.shutdown()
    rt_pub.shutdown()
    ctx.term()


if __name__ == "__main__":
    main()
