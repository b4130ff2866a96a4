"""Benchmark: pull throughput of the kvflow `nixl` peer transport vs raw NIXL moving the
same descriptors vs the kvflow `zmq` peer transport moving the same blocks, in one run and
one process.

    python bench/bench_nixl.py [--repeats 15] [--blocks 64,512] [--layers 32] [--quick]

Workload. Block-granular KV memory shaped like vLLM's CPU cache
(`[blocks, kv_heads, block_size, 2*head_dim]` per layer, fp16 standing in for bf16, both
2 bytes), `--layers` layers, `--block-size` tokens per block:

- `llama3-8b`: 8 KV heads x 128 head dim x 2 (K,V) x 2 B x 16 tokens = 64 KiB per block
  per layer (1 GiB for 8k tokens over 32 layers);
- `small`: 2 KV heads x 64 head dim -> 8 KiB per block per layer.

A request moves `--blocks` blocks (64, 512: 1k and 8k tokens at block size 16) from a
random choice of producer blocks into a random choice of consumer blocks (vLLM's block
ids are scattered, so NIXL can rarely merge neighbouring spans). The producer's blocks hold random
bytes; before every transfer the consumer's blocks are zeroed, after it they are compared
with the producer's (an AssertionError if a single byte differs), outside the timed
window. The producer side of every method runs in its own thread (a stand-in for the
prefill process; NIXL's calls release the GIL), the consumer side in the main thread.

What each method does per transfer (timed: the consumer's side, from asking for the
blocks until the last byte landed):

- kvflow nixl: a producer `NixlTransport` (worker role, own NIXL agent, UCX, progress
  thread off, every layer buffer registered as DRAM) runs `serve()` and `offer()` under
  its own `trio.run`. The timed call is the consumer `NixlTransport`'s
  `await load(LoadJob(...))`: DEALER connect, `Pull` over the side channel, the
  producer answers with `Blocks` (the offered block ids; its agent metadata and memory
  regions only on the first pull, when the consumer prepares one descriptor list over
  the producer's whole KV memory; its own list was prepared at registration), the
  consumer picks the request's indices (numpy) and READs all layers in one transfer, as
  for an asynchronous P/D pull (`--layerwise`: one transfer per layer, two in flight, as
  for a load the forward waits on), polling `check_xfer_state` with a 0.1-2 ms trio backoff
  (a trio sleep under 1 ms lasts ~1.1 ms: epoll's timeout is in ms), releases the
  handles and sends one `Read` notification. Untimed, the consumer then waits until the
  producer's offer ended with "done" (the notification arrived).
- raw NIXL: two more agents (same config: UCX, progress thread off), each registering
  the same layer buffers as DRAM. Once, untimed: the consumer adds the producer agent's
  metadata, and prepares two descriptor lists over the whole KV cache, one descriptor
  per (layer, block): its own and the producer's (as vLLM's NixlConnector does, block
  addresses being known from the handshake). Per transfer, timed: index arrays (numpy
  int32) of the request's blocks in layer-major order, ONE `make_prepped_xfer("READ")`
  for all layers and blocks (the same spans as kvflow, in the same order) with a
  notification, `transfer()`, a busy poll of `check_xfer_state` until DONE, `release()`.
  The producer thread, while that READ is out, polls `get_new_notifs` with 0.1 ms sleeps
  (`time.sleep`); untimed, the consumer waits until it got the notification. This
  matters: with NIXL 1.5.1 / UCX on one host the bytes move by CMA inside the
  consumer's `transfer()`, but a READ that carries a notification (or follows one that
  did) stays PROC on the consumer until the producer's agent makes progress (calls
  `get_new_notifs`); the READ waits on the producer's poll, whatever the consumer does.
- kvflow zmq: a producer `ZmqTransport` in its own thread (`serve()`, `offer()`), the
  consumer's `await load(LoadJob(...))`: per layer one multipart message of zero-copy
  frames, copied into the consumer's blocks, then `Done`.

The first pull of each fresh kvflow nixl pair is the warm-up: it pays the agent metadata
handshake (`add_remote_agent`) and UCX's endpoint wireup; it is reported separately
("first pull"), as is raw NIXL's (add_remote_agent + first transfer); zmq's first
transfer is a warm-up too. Times are the
median of `--repeats` transfers after that warm-up; the three methods take turns within
each repeat (rotating order) so that drift of a shared machine hits them alike. Prints a
table and writes bench/results/nixl.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import record
import trio
import zmq

from kvflow.geometry.layout import KVLayout
from kvflow.testing.layouts import make_layout
from kvflow.transport import LoadJob, Offer, PeerSource, Transport, TransportContext
from kvflow_nixl import NixlOptions, NixlTransport
from kvflow_nixl._transport import import_nixl
from kvflow_zmq import ZmqOptions, ZmqTransport

MODELS: dict[str, dict[str, int]] = {
    "llama3-8b": {"heads": 8, "head_dim": 128},  # 64 KiB per block per layer
    "small": {"heads": 2, "head_dim": 64},  # 8 KiB per block per layer
}
METHODS = ("raw", "nixl", "zmq")
TIMEOUT_S = 60.0
"""Per transfer, and per wait for a thread."""
PRODUCER_POLL_S = 1e-4
"""Raw NIXL producer: sleep between notification polls while its READ is out (kvflow's
POLL_MIN_S, which `time.sleep` honours; a trio sleep lasts at least ~1.1 ms)."""


@dataclass
class Case:
    """One request: `src_ids` of the producer into `dst_ids` of the consumer."""

    prod: KVLayout
    cons: KVLayout
    src_ids: list[int]
    dst_ids: list[int]
    block_size: int

    @property
    def counts(self) -> list[int]:
        return [self.block_size] * len(self.src_ids)

    @property
    def nbytes(self) -> int:
        return self.prod.nbytes(self.counts)

    @property
    def num_layers(self) -> int:
        return self.prod.num_layers

    def src_spans(self, layer: int) -> list[list[memoryview]]:
        return self.prod.chunk_spans(layer, self.src_ids, self.counts)

    def dst_spans(self, layer: int) -> list[list[memoryview]]:
        return self.cons.chunk_spans(layer, self.dst_ids, self.counts)


def _blocks(layout: KVLayout, layer: int) -> np.ndarray[Any, Any]:
    g = layout.geometries[layer]
    return np.frombuffer(layout.buffers[layer], dtype=np.uint8).reshape(g.num_blocks, -1)


def _address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _zero_dest(case: Case) -> None:
    for layer in range(case.num_layers):
        _blocks(case.cons, layer)[case.dst_ids] = 0


def _verify(case: Case, what: str) -> None:
    for layer in range(case.num_layers):
        src = _blocks(case.prod, layer)[case.src_ids]
        dst = _blocks(case.cons, layer)[case.dst_ids]
        if not np.array_equal(src, dst):
            bad = int(np.argmax((src != dst).any(axis=1)))
            raise AssertionError(f"{what}: layer {layer} block #{bad} differs after transfer")


def _layouts(model: str, layers: int, num_blocks: int, block_size: int) -> tuple[KVLayout, ...]:
    out = [
        make_layout(
            num_layers=layers,
            num_blocks=num_blocks,
            block_size=block_size,
            block_granular=True,
            dtype="float16",
            **MODELS[model],
        )
        for _ in range(2)
    ]
    rng = np.random.default_rng(7)
    for layer in range(layers):  # random producer bytes; consumer pages touched as vLLM's are
        src = _blocks(out[0], layer)
        src[:] = np.frombuffer(rng.bytes(src.size), dtype=np.uint8).reshape(src.shape)
        _blocks(out[1], layer)[:] = 1
    return out[0], out[1]


def _case(prod: KVLayout, cons: KVLayout, n: int, block_size: int, seed: int) -> Case:
    rng = np.random.default_rng(seed)
    nb = prod.geometries[0].num_blocks
    src = [int(b) for b in rng.permutation(nb)[:n]]
    dst = [int(b) for b in rng.permutation(nb)[:n]]
    return Case(prod, cons, src, dst, block_size)


def _ctx(layout: KVLayout) -> TransportContext:
    return TransportContext("bench", "worker", "ns", "tp0of1pp0", ["tp0of1pp0"], layout)


# -- kvflow producers ------------------------------------------------------------------


class Producer:
    """A kvflow producer transport in its own thread under its own `trio.run`: it serves,
    and holds an offer of the case's blocks for each request the consumer announces."""

    def __init__(self, make: Callable[[], NixlTransport | ZmqTransport], case: Case) -> None:
        self._make = make
        self._case = case
        self.address = ""
        self.outcomes: dict[str, str] = {}
        self._ended: dict[str, threading.Event] = {}
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._transport: NixlTransport | ZmqTransport | None = None
        self._nursery: trio.Nursery | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Producer:
        self._thread.start()
        if not self._ready.wait(TIMEOUT_S):
            raise TimeoutError("the producer thread did not start")
        self._raise()
        return self

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()
            for ev in self._ended.values():
                ev.set()

    async def _main(self) -> None:
        transport = self._make()
        layout = self._case.prod
        await transport.open()
        try:
            await transport.register(layout)
            self._transport = transport
            self._stop = trio.Event()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(transport.serve)
                self.address = transport.address
                self._token = trio.lowlevel.current_trio_token()
                self._ready.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()
        finally:
            await transport.aclose()

    async def _offer(self, req: str) -> None:
        transport, nursery, case = self._transport, self._nursery, self._case
        assert transport is not None and nursery is not None
        offer = Offer(req, case.src_ids, case.counts, case.num_layers, case.src_spans)

        async def hold() -> None:
            try:
                self.outcomes[req] = await transport.offer(offer)
            finally:
                self._ended[req].set()

        self._ended[req] = threading.Event()
        nursery.start_soon(hold)
        while req not in transport.held:  # held before the consumer can ask for it
            await trio.sleep(0)

    async def offer(self, req: str) -> None:
        """From the consumer's trio loop: hold `req` (returns once it is held)."""
        run = functools.partial(trio.from_thread.run, self._offer, req, trio_token=self._token)
        await trio.to_thread.run_sync(run)
        self._raise()

    async def ended(self, req: str) -> str:
        """From the consumer's trio loop: wait until the producer let go of `req`."""
        if not await trio.to_thread.run_sync(self._ended[req].wait, TIMEOUT_S):
            raise TimeoutError(f"the producer still holds {req}")
        self._raise()
        return self.outcomes[req]

    def stop(self) -> None:
        if self._token is not None and self._stop is not None and self._thread.is_alive():
            self._token.run_sync_soon(self._stop.set)
        self._thread.join(TIMEOUT_S)
        self._raise()


# -- raw NIXL --------------------------------------------------------------------------


class RawNixl:
    """Two bare NIXL agents over the case's buffers: the consumer READs the producer."""

    BACKENDS = ["UCX"]

    def __init__(self, case: Case) -> None:
        self.case = case
        api = import_nixl()
        tag = f"{os.getpid()}-{id(self):x}"
        cfg = api.nixl_agent_config(enable_prog_thread=False, backends=self.BACKENDS)
        self.prod = api.nixl_agent(f"raw-prod-{tag}", cfg)
        self.cons = api.nixl_agent(f"raw-cons-{tag}", cfg)
        self.regs = []
        for agent, layout in ((self.prod, case.prod), (self.cons, case.cons)):
            regions = [(_address(b), len(b), 0, "") for b in layout.buffers]
            self.regs.append((agent, agent.register_memory(regions, "DRAM", self.BACKENDS)))
        self.dlists: list[Any] = []
        self.remote = ""
        self.notifs: list[bytes] = []
        self._got = threading.Condition()
        self._stop = threading.Event()
        self._active = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        """The producer: while a READ is out, collects notifications (and so makes UCX
        progress); idle otherwise, so that it does not slow the other methods down."""
        while not self._stop.is_set():
            if not self._active.wait(0.05):
                continue
            notifs: dict[str, list[bytes]] = self.prod.get_new_notifs()
            if notifs:
                with self._got:
                    for messages in notifs.values():
                        self.notifs.extend(messages)
                    self._got.notify_all()
            time.sleep(PRODUCER_POLL_S)

    def connect(self) -> float:
        """Untimed setup (its seconds are returned): the metadata handshake, and both
        descriptor lists over the whole cache, one descriptor per (layer, block)."""
        t0 = time.perf_counter()
        added = self.cons.add_remote_agent(self.prod.get_agent_metadata())
        self.remote = added.decode() if isinstance(added, bytes) else str(added)
        handshake = time.perf_counter() - t0
        for who, layout in (("", self.case.cons), (self.remote, self.case.prod)):
            descs = np.array(
                [
                    (_address(buf) + b * g.block_stride, g.block_bytes, 0)
                    for buf, g in zip(layout.buffers, layout.geometries, strict=True)
                    for b in range(g.num_blocks)
                ],
                dtype=np.uint64,
            )
            self.dlists.append(self.cons.prep_xfer_dlist(who, descs, "DRAM", self.BACKENDS))
        return handshake

    def pull(self, note: bytes) -> float:
        """One READ of every layer's blocks; returns its seconds."""
        case = self.case
        nb = case.prod.geometries[0].num_blocks
        src = np.asarray(case.src_ids, dtype=np.int32)
        dst = np.asarray(case.dst_ids, dtype=np.int32)
        self._active.set()  # the producer polls from now until it got the notification
        t0 = time.perf_counter()
        base = (np.arange(case.num_layers, dtype=np.int32) * nb)[:, None]
        local, remote = (base + dst).ravel(), (base + src).ravel()
        h = self.cons.make_prepped_xfer(
            "READ", self.dlists[0], local, self.dlists[1], remote, note, self.BACKENDS
        )
        state = self.cons.transfer(h)
        while state == "PROC":
            state = self.cons.check_xfer_state(h)
        h.release()
        elapsed = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended {state}")
        return elapsed

    def wait_notif(self, note: bytes) -> None:
        with self._got:
            if not self._got.wait_for(lambda: note in self.notifs, TIMEOUT_S):
                raise TimeoutError(f"raw NIXL: the producer never got {note!r}")
        self._active.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT_S)
        for h in self.dlists:
            h.release()
        if self.remote:
            self.cons.remove_remote_agent(self.remote)
        for agent, reg in self.regs:
            agent.deregister_memory(reg, self.BACKENDS)
        self.regs.clear()


# -- one case --------------------------------------------------------------------------


def _job(case: Case, address: str, req: str, loaded: list[int], layerwise: bool) -> LoadJob:
    return LoadJob(
        f"c-{req}",
        ["k"] * len(case.dst_ids),
        case.counts,
        case.num_layers,
        case.dst_spans,
        loaded.append,
        PeerSource("bench", [address], req, case.src_ids),
        list(case.dst_ids),
        layerwise=layerwise,
    )


async def bench_case(case: Case, repeats: int, layerwise: bool) -> dict[str, Any]:
    """Seconds per transfer of each method (warm-up dropped), and the first pulls."""
    nixl_prod = Producer(lambda: NixlTransport(NixlOptions(), _ctx(case.prod)), case).start()
    zmq_prod = Producer(lambda: ZmqTransport(ZmqOptions(), _ctx(case.prod)), case).start()
    raw = RawNixl(case)
    nixl = NixlTransport(NixlOptions(), _ctx(case.cons))
    zmq_t = ZmqTransport(ZmqOptions(), _ctx(case.cons))
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    first: dict[str, float] = {}
    try:
        for t in (nixl, zmq_t):
            await t.open()
            await t.register(case.cons)

        async def kvflow(name: str, consumer: Transport, producer: Producer, req: str) -> float:
            await producer.offer(req)
            loaded: list[int] = []
            job = _job(case, producer.address, req, loaded, layerwise)
            with trio.fail_after(TIMEOUT_S):
                t0 = time.perf_counter()
                await consumer.load(job)
                elapsed = time.perf_counter() - t0
            outcome = await producer.ended(req)
            assert outcome == "done", f"kvflow {name}: the producer's offer ended {outcome!r}"
            assert loaded == list(range(case.num_layers)), f"kvflow {name}: signalled {loaded}"
            return elapsed

        async def one(method: str, i: int) -> float:
            _zero_dest(case)
            req = f"{method}-{i}"
            if method == "raw":
                elapsed = raw.pull(req.encode())
                raw.wait_notif(req.encode())
            elif method == "nixl":
                elapsed = await kvflow("nixl", nixl, nixl_prod, req)
            else:
                elapsed = await kvflow("zmq", zmq_t, zmq_prod, req)
            _verify(case, "raw NIXL" if method == "raw" else f"kvflow {method}")
            return elapsed

        # warm-up: each method's first transfer, the nixl ones paying the handshake
        first["raw_add_remote_agent"] = raw.connect()
        for method in METHODS:
            first[method] = await one(method, 0)
        first["raw"] += first["raw_add_remote_agent"]
        for i in range(1, repeats + 1):
            k = i % len(METHODS)
            for method in METHODS[k:] + METHODS[:k]:
                times[method].append(await one(method, i))
    finally:
        raw.close()
        for t in (nixl, zmq_t):
            await t.aclose()
        nixl_prod.stop()
        zmq_prod.stop()
    return {"times": times, "first": first}


# -- driver ----------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "pyzmq": zmq.__version__}
    for dist in ("nixl-cu12", "nixl"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


def main() -> int:
    meta = record.start()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    ap.add_argument("--blocks", default="64,512", help="blocks per request, comma-separated")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--repeats", type=int, default=15, help="timed transfers after 1 warm-up")
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 blocks, 2 repeats")
    ap.add_argument(
        "--layerwise",
        action="store_true",
        help="kvflow nixl READs layer by layer, as for a load the forward waits on "
        "(default: all layers at once, as the worker runs a P/D pull)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "nixl.json"))
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.repeats = "64", 2
    blocks = [int(b) for b in args.blocks.split(",")]
    models = args.models.split(",")
    versions = _versions()
    print(
        f"{', '.join(f'{k} {v}' for k, v in versions.items())}, {os.cpu_count()} CPUs, "
        f"{args.layers} layers, block size {args.block_size}, median of {args.repeats} "
        f"after 1 warm-up",
        flush=True,
    )
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for model in models:
        prod, cons = _layouts(model, args.layers, max(blocks), args.block_size)
        per_block = prod.geometries[0].block_bytes
        for n in blocks:
            case = _case(prod, cons, n, args.block_size, seed=n)
            name = f"{model} {n} blocks"
            print(f"  {name} ({per_block // 1024} KiB/block/layer) ...", flush=True)
            res = trio.run(bench_case, case, args.repeats, args.layerwise)
            med = {m: statistics.median(res["times"][m]) for m in METHODS}
            gbs = {m: case.nbytes / med[m] / 1e9 for m in METHODS}
            rows.append(
                {
                    "config": name,
                    "model": model,
                    "blocks": n,
                    "tokens": n * args.block_size,
                    "block_bytes_per_layer": per_block,
                    "descriptors": n * args.layers,
                    "total_bytes": case.nbytes,
                    **{f"{m}_ms": med[m] * 1e3 for m in METHODS},
                    **{f"{m}_gbs": gbs[m] for m in METHODS},
                    **{f"{m}_best_gbs": case.nbytes / min(res["times"][m]) / 1e9 for m in METHODS},
                    "nixl_over_raw": gbs["nixl"] / gbs["raw"],
                    "nixl_over_zmq": gbs["nixl"] / gbs["zmq"],
                    "first_pull_ms": {k: v * 1e3 for k, v in res["first"].items()},
                    "times_s": res["times"],
                }
            )
        del prod, cons

    heads = (
        "MB/req",
        "raw GB/s",
        "nixl GB/s",
        "nixl/raw",
        "zmq GB/s",
        "nixl/zmq",
        "1st nixl ms",
        "nixl ms",
        "1st raw ms",
    )
    print(f"\n{'config':<20}" + "".join(f"{h:>12}" for h in heads))
    for r in rows:
        cells = (
            f"{r['total_bytes'] / 1e6:.1f}",
            f"{r['raw_gbs']:.2f}",
            f"{r['nixl_gbs']:.2f}",
            f"{r['nixl_over_raw']:.2f}",
            f"{r['zmq_gbs']:.2f}",
            f"{r['nixl_over_zmq']:.2f}",
            f"{r['first_pull_ms']['nixl']:.1f}",
            f"{r['nixl_ms']:.1f}",
            f"{r['first_pull_ms']['raw']:.1f}",
        )
        print(f"{r['config']:<20}" + "".join(f"{c:>12}" for c in cells))
    print(
        "(GB/s = 1e9 B/s, median; nixl/raw and nixl/zmq: throughput ratios; '1st nixl ms': "
        "kvflow nixl's first pull of a fresh pair (metadata handshake + UCX wireup + "
        "transfer) vs its warm median; '1st raw ms': add_remote_agent + first raw READ)"
    )
    wall = time.perf_counter() - t_start
    load = os.getloadavg()
    print(
        f"total {wall:.0f} s; 1-minute load average at the end: {load[0]:.1f} "
        f"on {os.cpu_count()} CPUs"
    )

    results = {
        "args": vars(args),
        "env": {**versions, "cpus": os.cpu_count()},
        "wall_s": wall,
        "loadavg_end": load,
        "table": rows,
    }
    record.save(args.out, results, meta)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # read when NIXL is first imported
    sys.exit(main())
