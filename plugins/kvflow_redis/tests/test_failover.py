"""A Redis Cluster master killed (SIGKILL) while loads and saves run: its replica takes
over; every load either delivers exact bytes or fails naming the first chunk it did not
deliver (vLLM recomputes from there); afterwards the same chunks are saved again and hit.
Each test forms its own cluster (it is broken on purpose)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import servers
import trio

from kvflow import KVLayout, LoadJob, SaveJob, Transport, TransportContext, TransportError
from kvflow.testing import fill_blocks, make_layout
from kvflow_redis import RedisOptions, RedisTransport

pytestmark = pytest.mark.trio

FAILOVER_S = 60.0
"""A bound on the whole failover (node timeout 1 s, then an election), as a hang guard."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[servers.Deployment]:
    if servers.binary() is None:
        pytest.skip("redis-server is not installed")
    with servers.cluster(tmp_path) as d:
        yield d


LAYERS, CHUNKS, BS = 4, 24, 4


def _context(role: str) -> TransportContext:
    return TransportContext("e", role, "ns", "tp0of1pp0", ["tp0of1pp0"])


def _chunk_bytes(layout: KVLayout, block: int, count: int) -> list[bytes]:
    """A chunk's bytes, per layer."""
    return [b"".join(bytes(s) for s in layout.spans(i, block, count)) for i in range(LAYERS)]


class Stored:
    """Chunks in blocks `src` of `layout`, loaded into blocks `dst` and checked."""

    def __init__(self, layout: KVLayout, first: int, n: int, tag: str) -> None:
        self.layout = layout
        self.keys = [f"{tag}{i:030x}" for i in range(n)]
        self.counts = [BS] * (n - 1) + [2]
        self.src = list(range(first, first + n))
        self.dst = list(range(first + n, first + 2 * n))
        fill_blocks(layout, self.src, seed=first)

    def save_job(self) -> SaveJob:
        async def spans(i: int) -> list[list[memoryview]]:
            return self.layout.chunk_spans(i, self.src, self.counts)

        return SaveJob("r", self.keys, self.counts, LAYERS, spans)

    async def check_load(self, worker: Transport) -> str:
        """ "ok" (every byte equal) or "failed at <chunk>" (the chunks before it equal);
        anything else than a TransportError fails the test."""
        for b in self.dst:
            for i in range(LAYERS):
                for span in self.layout.spans(i, b, BS):
                    span[:] = b"\xee" * len(span)
        job = LoadJob(
            "r", self.keys, self.counts, LAYERS,
            lambda i: self.layout.chunk_spans(i, self.dst, self.counts), lambda i: None,
        )  # fmt: skip
        outcome, intact = "ok", len(self.keys)
        try:
            await worker.load(job)
        except TransportError as exc:
            outcome, intact = f"failed at {exc.chunk}", exc.chunk
        for c in range(intact):
            got = _chunk_bytes(self.layout, self.dst[c], self.counts[c])
            assert got == _chunk_bytes(self.layout, self.src[c], self.counts[c]), (outcome, c)
        return outcome


def replicas_of(port: int, via: int) -> list[int]:
    """Ports of the replicas of the master at `port`, from CLUSTER NODES at `via`."""
    lines = [f.split() for f in servers.command(via, "CLUSTER", "NODES").decode().splitlines()[1:]]
    ids = {f[1].split("@")[0]: f[0] for f in lines if f}
    master = ids[f"127.0.0.1:{port}"]
    return [int(f[1].split("@")[0].rsplit(":", 1)[1]) for f in lines if f and f[3] == master]


async def test_a_master_killed_during_loads_and_saves(cluster: servers.Deployment) -> None:
    layout = make_layout(num_layers=LAYERS, num_blocks=256, block_size=BS, block_granular=False)
    options = RedisOptions(url=cluster.url, mode="cluster", timeout_s=5.0)
    worker = RedisTransport(options, _context("worker"))
    sched = RedisTransport(options, _context("scheduler"))
    await worker.open()
    await sched.open()
    await worker.register(layout)
    try:
        stored = Stored(layout, 0, CHUNKS, "s")
        batches = [Stored(layout, 48 + 12 * k, 6, f"b{k}") for k in range(8)]
        await worker.save(stored.save_job())
        assert await sched.lookup(stored.keys) == CHUNKS
        masters = [s for s in cluster.servers if servers.role(s.port) == b"master"]
        victim = masters[0]
        survivor = masters[1].port
        (replica,) = replicas_of(victim.port, via=survivor)

        loads: list[str] = []
        saves: list[str] = []
        first_load, failed_over = trio.Event(), trio.Event()

        async def load_loop() -> None:
            while not failed_over.is_set() or len(loads) < 3:
                loads.append(await stored.check_load(worker))
                first_load.set()

        async def save_loop() -> None:
            while not failed_over.is_set():
                try:
                    await worker.save(batches[len(saves) % len(batches)].save_job())
                    saves.append("ok")
                except TransportError as exc:
                    saves.append(f"failed at {exc.chunk}")

        with trio.fail_after(FAILOVER_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(load_loop)
                nursery.start_soon(save_loop)
                await first_load.wait()
                victim.kill()
                await trio.to_thread.run_sync(
                    servers.wait_for,
                    "the failover",
                    lambda: servers.role(replica) == b"master" and servers.cluster_ok(survivor),
                    [],
                )
                failed_over.set()
        assert "ok" in loads and any(r != "ok" for r in loads + saves), (loads, saves)

        # after the failover: what the replica had hits, the rest is saved again (vLLM
        # recomputes it), then every chunk loads whole
        with trio.fail_after(FAILOVER_S):
            await worker.save(stored.save_job())
            assert await sched.lookup(stored.keys) == CHUNKS
            assert await stored.check_load(worker) == "ok"
    finally:
        await worker.aclose()
        await sched.aclose()
