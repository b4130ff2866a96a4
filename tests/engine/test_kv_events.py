"""kvflow's saves and evictions on a real engine's KV event stream (`--kv-events-config`).

One engine, vLLM's prefix cache on, `fs` with a 2 MiB cap (a 300-token prompt of
`tiny-llama` is 10 chunks of 128 KiB): the test subscribes to the engine's own ZMQ
publisher, as a router does, and checks kvflow's `BlockStored` / `BlockRemoved`
against vLLM's own events for the same blocks and the chunk files in the store.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvflow.config import KVFlowConfig, TierConfig
from kvflow.engine.worker import ChunkOutcomes
from kvflow.keys import chunk_keys
from kvflow_vllm import kv_events
from kvflow_vllm.apiserver import free_port
from kvflow_vllm.kv_events import ChunkReport, KVEventTracker, KVFlowWorkerMeta, media

from ..support import vllm_scheduler as vh
from ..support.vllm_engines import ServingEngine

BLOCK = 32
MEDIUM = "kvflow:fs"
_rng = random.Random(17)


def _vllm_hashes(prompt: list[int]) -> list[int]:
    """The engine's block hashes of `prompt` (vLLM's default sha256, as events carry them)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    request = Request(
        request_id="h",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    return [int.from_bytes(h, "big") & (2**64 - 1) for h in request.block_hashes]


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(3, 1000) for _ in range(n)]


TIER_MEDIA = [MEDIUM, "kvflow:redis"]
TIERS: list[Any] = [object(), object()]
"""A worker's tiers (transports, told apart by `id`), and their media."""


def _tracker(
    workers: int = 2, media: list[str] = TIER_MEDIA[:1]
) -> tuple[KVEventTracker, Any, list[str]]:
    """A tracker of a real vLLM request of 2.5 blocks whose save of every chunk (the
    last one partial) is planned, and its chunk keys."""
    bs = vh.BLOCK_SIZE
    request = vh.make_request("r", vh.prompt_of(1, bs * 5 // 2))
    keys = chunk_keys("ns", request.prompt_token_ids, bs)
    tracker = KVEventTracker(media=media, block_size=bs, workers=workers, group=0)
    tracker.planned(request, keys, [bs, bs, bs // 2], keys, bs)
    return tracker, request, keys


def _stored(keys: list[str], rank: int, tiers: int = 1, **kw: Any) -> ChunkReport:
    """A worker's report of a save of `keys` into its first `tiers` tiers."""
    stored_in = TIERS[:tiers]
    outcomes = ChunkOutcomes(saved=[(keys, stored_in)], **kw)
    return ChunkReport.of(outcomes, rank, dict(zip(map(id, TIERS), TIER_MEDIA, strict=True)))


def _hash(h: bytes) -> int:
    return int.from_bytes(h, "big") & (2**64 - 1)


def test_a_block_is_announced_once_every_worker_stored_it() -> None:
    tracker, request, keys = _tracker()
    tracker.report(_stored(keys, rank=0))
    tracker.report(_stored(keys, rank=0))  # a second save on the same worker
    assert tracker.take() == []  # one of two workers
    tracker.report(_stored(keys, rank=1))
    events = tracker.take()
    bs = vh.BLOCK_SIZE
    hashes = [_hash(h) for h in request.block_hashes]
    assert [e.block_hashes for e in events] == [[hashes[0]], [hashes[1]]]  # not the partial
    assert [e.parent_block_hash for e in events] == [None, hashes[0]]
    assert [e.token_ids for e in events] == [
        request.prompt_token_ids[:bs],
        request.prompt_token_ids[bs : 2 * bs],
    ]
    assert {(e.medium, e.block_size, e.group_idx) for e in events} == {(MEDIUM, bs, 0)}


def test_a_partial_block_is_never_announced_even_once_vllm_hashed_its_block() -> None:
    bs = vh.BLOCK_SIZE
    request = vh.make_request("r", vh.prompt_of(2, bs * 2))  # vLLM hashes both blocks
    keys = chunk_keys("ns", request.prompt_token_ids, bs)
    tracker = KVEventTracker(media=[MEDIUM], block_size=bs, workers=1, group=0)
    tracker.planned(request, keys, [bs, bs - 1], keys, bs)  # kvflow stores 2k-1 tokens
    tracker.report(_stored(keys, rank=0))
    assert [e.block_hashes for e in tracker.take()] == [[_hash(request.block_hashes[0])]]


def test_a_chunk_a_worker_failed_to_store_is_never_announced() -> None:
    tracker, _, keys = _tracker()
    tracker.report(_stored(keys[:1], rank=0, unsaved=keys[1:]))
    tracker.report(_stored(keys, rank=1))
    assert [len(e.block_hashes) for e in tracker.take()] == [1]  # the first block only


def test_a_report_after_the_blocks_went_back_still_counts_until_too_many_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host tier hands vLLM the blocks back before its write-back ends: the store's
    report comes after `forget`. The oldest chunks past `RELEASED` are dropped."""
    tracker, _, keys = _tracker()
    tracker.report(_stored(keys, rank=0))
    tracker.forget("r")
    tracker.report(_stored(keys, rank=1))
    assert len(tracker.take()) == 2
    monkeypatch.setattr(kv_events, "RELEASED", 0)
    tracker, _, keys = _tracker()
    tracker.report(_stored(keys, rank=0))
    tracker.forget("r")  # none may wait: rank 1's report finds nothing planned
    tracker.report(_stored(keys, rank=1))
    assert tracker.take() == []


def test_a_chunk_evicted_before_every_worker_stored_it_is_never_announced_there() -> None:
    """Rank 0's tier evicted a chunk before rank 1 stored it: it is not whole there."""
    tracker, _, keys = _tracker(workers=2, media=TIER_MEDIA)
    tracker.report(_stored(keys, rank=0, tiers=2))
    tracker.report(ChunkReport.of(ChunkOutcomes(evicted=[(MEDIUM, keys[:1])]), 0, {}))
    tracker.report(_stored(keys, rank=1, tiers=2))
    events = tracker.take()
    assert sorted(e.medium for e in events) == [MEDIUM, "kvflow:redis", "kvflow:redis"]


def test_evictions_remove_announced_blocks_only() -> None:
    tracker, request, keys = _tracker(workers=1)
    tracker.report(_stored(keys[:1], rank=0))
    tracker.take()
    evicted = [(MEDIUM, ["x", keys[1], keys[0], keys[0]])]
    tracker.report(ChunkReport.of(ChunkOutcomes(evicted=evicted), 0, {}))
    (removed,) = tracker.take()
    assert type(removed).__name__ == "BlockRemoved" and removed.medium == MEDIUM
    assert removed.block_hashes == [_hash(request.block_hashes[0])]


def test_each_tier_announces_what_it_stored_and_evicted_under_its_medium() -> None:
    """A save into a stack of two stores: a `BlockStored` per tier once every worker's
    shard is in it (a lower tier that failed on one worker announces nothing); an
    eviction removes the block from that tier's medium only."""
    tracker, request, keys = _tracker(workers=2, media=TIER_MEDIA)
    tracker.report(_stored(keys, rank=0, tiers=2).merge(_stored(keys, rank=1, tiers=1)))
    events = tracker.take()
    assert {e.medium for e in events} == {MEDIUM} and len(events) == 2  # two full blocks
    tracker.report(_stored(keys, rank=1, tiers=2))  # rank 1's lower tier, later
    assert [e.medium for e in tracker.take()] == ["kvflow:redis"] * 2
    tracker.report(ChunkReport.of(ChunkOutcomes(evicted=[("kvflow:redis", keys[:1])]), 0, {}))
    (removed,) = tracker.take()
    assert (removed.medium, removed.block_hashes) == (
        "kvflow:redis",
        [_hash(request.block_hashes[0])],
    )
    tracker.report(_stored(keys, rank=0, tiers=0))  # a replica rank's save: no tier
    assert tracker.take() == []


def test_media_name_each_tier_top_first() -> None:
    config = KVFlowConfig(
        transport="fs",
        cpu_cache_gib=1,
        tiers=[TierConfig(transport="fs"), TierConfig(transport="redis")],
    )
    assert media(config) == ["kvflow:cpu", "kvflow:fs", "kvflow:fs.1", "kvflow:redis"]
    assert media(KVFlowConfig(transport="fs")) == ["kvflow:fs"]


def test_worker_reports_merge_over_workers_and_pickle_as_msgspec_bytes() -> None:
    m = MEDIUM
    a = KVFlowWorkerMeta([ChunkReport({m: {"k": [0]}}, ["u"], {}), ChunkReport()])
    b = KVFlowWorkerMeta(
        [ChunkReport({m: {"k": [1], "j": [1]}}, [], {m: ["e"]}), ChunkReport({m: {"x": [1]}})]
    )
    both = pickle.loads(pickle.dumps(a.aggregate(b)))
    assert isinstance(both, KVFlowWorkerMeta)
    assert both.reports == [
        ChunkReport({m: {"k": [0, 1], "j": [1]}}, ["u"], {m: ["e"]}),
        ChunkReport({m: {"x": [1]}}),
    ]
    raw = pickle.dumps(a)  # a function and bytes: no kvflow class rides in pickle
    assert b"KVFlowWorkerMeta" not in raw and b"ChunkReport" not in raw


class Stream:
    """The engine's KV event stream, as a router reads it (bound before the engine starts,
    so that it misses nothing once vLLM's publisher connected)."""

    def __init__(self, endpoint: str) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sock.bind(endpoint)  # vLLM's publisher connects to a host:port endpoint
        self.events: list[Any] = []

    def read(self, timeout_s: float) -> bool:
        """Take the batches that arrive within `timeout_s`; False if none did."""
        got = False
        while self.sock.poll(int(timeout_s * 1000)):
            _topic, _seq, payload = self.sock.recv_multipart()
            self.events.extend(self._decoder.decode(payload).events)
            got, timeout_s = True, 0.5  # drain what is queued
        return got

    def stored(self, medium: str) -> list[Any]:
        return [e for e in self.events if type(e).__name__ == "BlockStored" and e.medium == medium]

    def removed(self, medium: str) -> set[Any]:
        return {
            h
            for e in self.events
            if type(e).__name__ == "BlockRemoved" and e.medium == medium
            for h in e.block_hashes
        }


class Run:
    engine: ServingEngine
    stream: Stream
    store: Path
    prompts: list[list[int]]

    def ask(self, prompt: list[int]) -> None:
        self.prompts.append(prompt)
        assert not self.engine.ask(prompt, 4).error

    def chunk_file(self, prompt: list[int], i: int) -> Path:
        (ns,) = [d for d in self.store.iterdir() if d.is_dir()]
        key = chunk_keys(ns.name, prompt, BLOCK)[i]
        return ns / key[:2] / f"{key}.tp0of1pp0.kv"


def _start(tmp: Path, name: str, store: Path, max_gb: float, **extra: Any) -> Run:
    """A live engine with KV events on, and a subscriber that has seen its first event."""
    port = free_port()
    r = Run()
    r.store, r.prompts = store, []
    r.stream = Stream(f"tcp://127.0.0.1:{port}")
    options = {"path": str(store), "max_gb": max_gb}
    r.engine = ServingEngine(
        tmp,
        name,
        extra_config={"transport": "fs", "options": options, **extra},
        llm_args={
            "enable_prefix_caching": True,
            "kv_events_config": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{port}",
                "topic": "kv",
            },
        },
    )
    try:
        r.engine.wait_ready()
        # a subscriber misses what was published before it joined: ask until one arrives
        for _ in range(10):
            r.ask(_prompt(2 * BLOCK))
            if r.stream.read(10):
                return r
        pytest.fail(f"no KV event within 10 requests; engine log: {r.engine.log}")
    except BaseException:
        r.engine.close()
        raise


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("kv-events")
    r = _start(tmp, "events", tmp / "store", 2 / 1024)
    try:
        yield r
    finally:
        r.engine.close()


def _wait(run: Run, done: Any, what: str) -> None:
    """Read events (asking a one-block prompt to make the engine step) until `done()`."""
    for _ in range(20):
        if done():
            return
        if not run.stream.read(5):
            run.ask(_prompt(BLOCK // 2))  # no full block: no BlockStored of its own
    assert done(), f"{what}; events: {run.stream.events}"


@pytest.mark.engine
@pytest.mark.slow
def test_saved_blocks_are_announced_with_vllms_own_hashes(run: Run) -> None:
    prompt = _prompt(300)  # 9 full blocks and a partial one
    run.ask(prompt)
    blocks = [prompt[i : i + BLOCK] for i in range(0, 9 * BLOCK, BLOCK)]
    mine = lambda: [e for e in run.stream.stored(MEDIUM) if e.token_ids in blocks]  # noqa: E731
    _wait(run, lambda: len(mine()) >= 9, "kvflow announced fewer than the 9 full blocks")
    events = sorted(mine(), key=lambda e: blocks.index(e.token_ids))
    assert [e.token_ids for e in events] == blocks  # each once, the partial block never
    assert all(e.block_size == BLOCK and e.lora_id is None for e in events)
    # the engine's own hashes: those vLLM announced for the same blocks of its cache
    vllm_hash = {  # vLLM announces runs of blocks: block_hashes[i] is tokens[i*B:(i+1)*B]
        tuple(e.token_ids[i * BLOCK : (i + 1) * BLOCK]): h
        for e in run.stream.events
        if type(e).__name__ == "BlockStored" and e.medium != MEDIUM
        for i, h in enumerate(e.block_hashes)
    }
    assert [e.block_hashes[0] for e in events] == [vllm_hash[tuple(b)] for b in blocks]
    assert [e.block_hashes[0] for e in events] == _vllm_hashes(prompt)[:9]
    assert [e.parent_block_hash for e in events] == [None] + [
        e.block_hashes[0] for e in events[:-1]
    ]
    # announced once the chunk is in the store (the partial last chunk too, unannounced)
    assert all(run.chunk_file(prompt, i).exists() for i in range(10))


@pytest.mark.engine
@pytest.mark.slow
def test_evicted_chunks_are_announced_removed(run: Run) -> None:
    run.ask(_prompt(300))  # over the 2 MiB cap: the oldest chunk files go

    def gone() -> set[int]:
        """The hashes of full blocks kvflow stored whose chunk file is gone."""
        return {
            h
            for prompt in run.prompts
            for i, h in enumerate(_vllm_hashes(prompt))
            if not run.chunk_file(prompt, i).exists()
        }

    _wait(run, lambda: gone() and run.stream.removed(MEDIUM) >= gone(), "evictions not announced")
    assert run.stream.removed(MEDIUM) == gone(), "a BlockRemoved for a chunk still stored"


@pytest.mark.engine
@pytest.mark.slow
def test_engines_sharing_a_store_each_announce_what_they_wrote(run: Run) -> None:
    """Engine A stores P; B, on the same store, loads P and stores Q: P is on A's stream
    only, Q on B's only. B's store is a stack (a host tier of 12 chunks, its own `fs`,
    A's store below): it announces Q in each tier's medium; R's save evicts from the host
    tier, announced in its medium only."""
    p, q, r = _prompt(300), _prompt(300), _prompt(300)
    p_hashes, q_hashes = set(_vllm_hashes(p)), set(_vllm_hashes(q))
    announced = lambda r, m=MEDIUM: {e.block_hashes[0] for e in r.stream.stored(m)}  # noqa: E731
    run.ask(p)
    _wait(run, lambda: announced(run) >= p_hashes, "A did not announce P")
    run.engine.close()  # two engines on two cores would starve each other
    below = [{"transport": "fs", "options": {"path": str(run.store)}}]
    b = _start(run.store.parent, "b", run.store.parent / "b", 1.0, tiers=below,
               cpu_cache_gib=12 * 128 / 2**20)  # fmt: skip
    try:
        got = b.engine.ask(p, 4)
        assert got.cached_tokens == len(p) - 1, "B did not load A's chunks"
        b.ask(q)
        media = ["kvflow:cpu", MEDIUM, "kvflow:fs.1"]
        _wait(b, lambda: all(announced(b, m) >= q_hashes for m in media), "B did not announce Q")
        b.ask(r)  # 10 chunks into 12 slots holding Q's 10: Q's go
        gone = lambda: b.stream.removed("kvflow:cpu") & q_hashes  # noqa: E731
        _wait(b, gone, "B's host tier announced no eviction of Q")
    finally:
        b.engine.close()
    # (a stream misses what was published before it connected: P, Q and R came after)
    removed = b.stream.removed("kvflow:cpu") & (p_hashes | q_hashes | set(_vllm_hashes(r)))
    assert removed <= announced(b, "kvflow:cpu"), "removed what the tier never announced"
    assert not b.stream.removed(MEDIUM) and not b.stream.removed("kvflow:fs.1")
    assert not announced(b) & p_hashes, "B announced blocks A wrote"
    assert not announced(run) & q_hashes, "A announced blocks B wrote"
