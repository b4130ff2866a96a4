"""The transport conformance suite: run against `fs` on real files, and checked itself.

`TestFsConformance` is what every transport author writes. The rest checks the
suite: a minimal in-memory store passes it too (the seam is not fs-shaped),
and each deliberately broken variant of that store fails the test that guards
the promise it breaks, with that promise in the message.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio

from kvflow.keys import ChunkKey
from kvflow.testing.conformance import ContractViolation, Promise, TransportConformance
from kvflow.transport import (
    ChunkMissing,
    LoadJob,
    NoOptions,
    SaveJob,
    Transport,
    TransportContext,
)
from kvflow_fs import FsOptions, FsTransport


class TestFsConformance(TransportConformance):
    @pytest.fixture
    def make_transport(self, tmp_path: Path) -> Callable[[TransportContext], FsTransport]:
        def make(context: TransportContext) -> FsTransport:
            return FsTransport(FsOptions(path=str(tmp_path / "store")), context)

        return make


# -- a minimal store, to check the suite itself ------------------------------------

Store = dict[tuple[str, str, ChunkKey], list[Any]]
"""(namespace, shard, key) -> the chunk's bytes, one entry per layer."""


class DictTransport(Transport):
    """A correct store in a dict that every instance of one test shares."""

    name = "dict"

    def __init__(self, context: TransportContext, store: Store) -> None:
        super().__init__(NoOptions(), context)
        self.store = store

    def slot(self, key: ChunkKey, shard: str | None = None) -> tuple[str, str, ChunkKey]:
        return (self.context.namespace, shard or self.context.shard, key)

    def copy(self, spans: list[memoryview]) -> Any:
        return b"".join(spans)

    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        await trio.lowlevel.checkpoint()
        for i, key in enumerate(keys):
            if not all(self.slot(key, s) in self.store for s in self.context.shards):
                return i
        return len(keys)

    async def save(self, job: SaveJob) -> None:
        layers: list[list[Any]] = [[] for _ in job.keys]
        for layer in range(job.num_layers):
            for c, spans in enumerate(await job.layer(layer)):
                layers[c].append(self.copy(spans))
        for key, data in zip(job.keys, layers, strict=True):
            self.store[self.slot(key)] = data

    def present(self, job: LoadJob) -> list[list[Any]]:
        found = []
        for key in job.keys:
            data = self.store.get(self.slot(key))
            if data is None:
                break
            found.append(data)
        return found

    async def load(self, job: LoadJob) -> None:
        found = self.present(job)
        for layer in range(job.num_layers):
            await trio.lowlevel.checkpoint()
            for spans, data in zip(job.spans(layer)[: len(found)], found, strict=True):
                fill(spans, data[layer])
            job.layer_loaded(layer)
        self.check_complete(job, found)

    def check_complete(self, job: LoadJob, found: list[list[Any]]) -> None:
        if len(found) < len(job.keys):
            c = len(found)
            raise ChunkMissing(f"chunk {c} not stored", chunk=c, key=job.keys[c])


def fill(spans: list[memoryview], data: bytes) -> None:
    off = 0
    for span in spans:
        span[:] = data[off : off + len(span)]
        off += len(span)


def dict_factory(cls: type[DictTransport]) -> Callable[[TransportContext], DictTransport]:
    store: Store = {}
    return lambda context: cls(context, store)


class TestDictConformance(TransportConformance):
    @pytest.fixture
    def make_transport(self) -> Callable[[TransportContext], DictTransport]:
        return dict_factory(DictTransport)


# -- broken stores: each must fail the test guarding the promise it breaks ------------


class LookupCountsAnyPresent(DictTransport):
    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        await trio.lowlevel.checkpoint()
        return sum(self.slot(k) in self.store for k in keys)


class KeepsViews(DictTransport):
    """Keeps the source memory instead of copying it: vLLM reuses those blocks."""

    class _Later:
        def __init__(self, spans: list[memoryview]) -> None:
            self.spans = spans

        def __getitem__(self, sl: slice) -> bytes:
            return b"".join(self.spans)[sl]

    def copy(self, spans: list[memoryview]) -> Any:
        return self._Later(spans)


class SignalsBeforeLanding(DictTransport):
    async def load(self, job: LoadJob) -> None:
        for layer in range(job.num_layers):
            job.layer_loaded(layer)
        await super().load(
            LoadJob(job.req, job.keys, job.token_counts, job.num_layers, job.spans, lambda i: None)
        )


class SignalsOutOfOrder(DictTransport):
    async def load(self, job: LoadJob) -> None:
        await super().load(
            LoadJob(job.req, job.keys, job.token_counts, job.num_layers, job.spans, lambda i: None)
        )
        for layer in reversed(range(job.num_layers)):
            job.layer_loaded(layer)


class PublishesEachLayer(DictTransport):
    """Makes a chunk visible as soon as its first layer is in."""

    async def save(self, job: SaveJob) -> None:
        for layer in range(job.num_layers):
            for c, spans in enumerate(await job.layer(layer)):
                self.store.setdefault(self.slot(job.keys[c]), []).append(self.copy(spans))


class SwallowsCancel(DictTransport):
    async def save(self, job: SaveJob) -> None:
        try:
            await super().save(job)
        except trio.Cancelled:
            return


class IgnoresLayerErrors(DictTransport):
    async def save(self, job: SaveJob) -> None:
        try:
            await super().save(job)
        except Exception:
            return


class BlamesChunk0(DictTransport):
    def check_complete(self, job: LoadJob, found: list[list[Any]]) -> None:
        if len(found) < len(job.keys):
            raise ChunkMissing("something is missing", chunk=0)


class AllOrNothing(DictTransport):
    """Reports the right chunk but leaves the chunks before it unloaded."""

    async def load(self, job: LoadJob) -> None:
        self.check_complete(job, self.present(job))
        await super().load(job)


class RaisesKeyError(DictTransport):
    def check_complete(self, job: LoadJob, found: list[list[Any]]) -> None:
        if len(found) < len(job.keys):
            raise KeyError(job.keys[len(found)])


class FlipsAByte(DictTransport):
    async def load(self, job: LoadJob) -> None:
        await super().load(job)
        span = job.spans(job.num_layers - 1)[-1][0]
        span[0] ^= 0xFF


class IgnoresNamespace(DictTransport):
    def slot(self, key: ChunkKey, shard: str | None = None) -> tuple[str, str, ChunkKey]:
        return ("", shard or self.context.shard, key)


class IgnoresShards(DictTransport):
    def slot(self, key: ChunkKey, shard: str | None = None) -> tuple[str, str, ChunkKey]:
        return (self.context.namespace, "", key)


P = Promise
BROKEN = [  # (broken store, suite test without `test_`, its parameters, promise it breaks)
    (LookupCountsAnyPresent, "lookup_counts_only_leading_present_keys", {}, P.LOOKUP),
    (KeepsViews, "round_trip_full_chunks", {}, P.LOAD),
    (KeepsViews, "save_reads_each_layer_only_after_it_is_given", {}, P.SAVE_READS),
    (SignalsBeforeLanding, "load_signals_each_layer_in_order_once_landed", {}, P.LOAD_ORDER),
    (SignalsOutOfOrder, "load_signals_each_layer_in_order_once_landed", {}, P.LOAD_ORDER),
    (PublishesEachLayer, "save_reads_each_layer_only_after_it_is_given", {}, P.SAVE_ATOMIC),
    (PublishesEachLayer, "cancelled_save_leaves_nothing_visible", {"at": "last"}, P.CANCEL),
    (SwallowsCancel, "cancelled_save_leaves_nothing_visible", {"at": "first"}, P.CANCEL),
    (IgnoresLayerErrors, "save_whose_layer_fails_raises_and_stores_nothing", {}, P.SAVE),
    (BlamesChunk0, "load_of_missing_key_names_first_missing_chunk", {"missing": 2}, P.LOAD_ERROR),
    (AllOrNothing, "load_of_missing_key_names_first_missing_chunk", {"missing": 2}, P.LOAD_ERROR),
    (RaisesKeyError, "load_of_missing_key_names_first_missing_chunk", {"missing": 0}, P.LOAD_ERROR),
    (FlipsAByte, "round_trip_partial_chunk", {"tokens": 1}, P.LOAD),
    (FlipsAByte, "concurrent_saves_and_loads_of_distinct_keys", {}, P.LOAD),
    (IgnoresNamespace, "other_namespace_sees_nothing", {}, P.NAMESPACE),
    (IgnoresShards, "lookup_needs_every_shard", {}, P.SHARDS),
]  # fmt: skip


@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize(
    ("broken", "test", "params", "promise"),
    BROKEN,
    ids=[f"{b.__name__}-{t}" for b, t, _, _ in BROKEN],
)
async def test_suite_catches_broken_transport(
    broken: type[DictTransport],
    test: str,
    params: dict[str, Any],
    promise: str,
    granularity: str,
) -> None:
    suite = TransportConformance()
    layout = suite.build_layout(granularity == "block")
    async with suite.harness(dict_factory(broken), layout) as kv:
        with pytest.raises(ContractViolation) as caught:
            await getattr(suite, f"test_{test}")(kv, **params)
    message = str(caught.value)
    assert message.startswith(f"Transport contract broken: {promise}"), message
    assert re.search(r"key\(s\): [0-9a-f]{32}|block id\(s\): \[\d", message), message


async def test_violation_names_promise_chunks_keys_and_blocks() -> None:
    from kvflow.testing.conformance import violated

    with pytest.raises(ContractViolation) as caught:
        violated(Promise.LOAD, "bytes differ", chunks=[1], keys=["ab" * 16], block_ids=[7, 8])
    assert str(caught.value).splitlines() == [
        f"Transport contract broken: {Promise.LOAD}",
        "  what happened: bytes differ",
        "  chunk index(es): [1]",
        f"  key(s): {'ab' * 16}",
        "  block id(s): [7, 8]",
    ]
