"""A store key (`store_key_file`, issue 46 H2) on real stores: `fs` on real files and a
real redis-server, driven as kvflow's worker drives a transport.

Whoever can write a shared store but lacks the key cannot plant KV that loads: bytes put
under the names a keyless writer computes are never looked up, and bytes put under the
keyed names (learned from the store) or copied there from another chunk, shard or layer
fail the keyed checksum (a corrupt chunk: vLLM recomputes). Two tenants with different
keys on one store never load each other's chunks. Without a key, everything is as before
(the first test shows the attack then works, which is what the key is for)."""

from __future__ import annotations

import os
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import trio
import xxhash

from kvflow.chunks import ChunkHeader, layer_hash
from kvflow.config import ConfigError, KVFlowConfig, parse_config, store_key_of
from kvflow.geometry.layout import KVLayout
from kvflow.hidden_states import (
    HiddenStatesError,
    HiddenStatesReader,
    HiddenStatesRef,
    hidden_context,
    hidden_layout,
    host_buffer,
    save_hidden_states,
)
from kvflow.keyfiles import keygen
from kvflow.keys import Fingerprint, StoreKey, chunk_keys, chunk_token_counts
from kvflow.observe.events import EventBus, Origin
from kvflow.testing.conformance import TransportConformance
from kvflow.testing.layouts import fill_blocks, make_layout, token_bytes
from kvflow.tiers import stacked
from kvflow.transport import (
    ChunkCorrupt,
    LoadJob,
    SaveJob,
    Transport,
    TransportContext,
    TransportError,
)
from kvflow_fs import FsOptions, FsTransport
from kvflow_fs._format import HEADER_SIZE, encode_header

from ..support.by_path import load as load_module

BS = 4
LAYERS = 3
SHARD = "tp0of1pp0"
PROMPT = list(range(100, 114))  # 14 tokens: chunks of 4, 4, 4 and 2
COUNTS = chunk_token_counts(len(PROMPT), BS)
FP = Fingerprint(
    model="tiny@main",
    dtype="float32",
    block_size=BS,
    num_layers=LAYERS,
    layout="test",
    bytes_per_token=2 * 2 * 8 * 4,
)
KEY_A = StoreKey(bytes(range(32)))
KEY_B = StoreKey(bytes(range(1, 33)))


def names(store_key: StoreKey | None) -> tuple[str, list[str]]:
    """The namespace and chunk keys of PROMPT, as an engine with `store_key` computes them."""
    ns = FP.namespace(store_key)
    return ns, chunk_keys(ns, PROMPT, BS, store_key=store_key)


# -- the stores -----------------------------------------------------------------------


class Store:
    """One real store; its transports, and what an attacker with write access does to it
    (read and write a chunk's stored bytes: its header and payload)."""

    def __init__(self, make: Callable[..., Transport]) -> None:
        self.make = make
        self.opened: list[Transport] = []

    async def worker(
        self,
        store_key: StoreKey | None,
        *,
        namespace: str | None = None,
        shard: str = SHARD,
        seed: int = 0,
        **options: Any,
    ) -> tuple[Transport, KVLayout]:
        """An open worker transport of an engine with `store_key`, over KV memory of its
        own (blocks 0-3 filled with bytes of `seed`)."""
        ctx = TransportContext(
            engine_id=f"engine-{len(self.opened)}",
            role="worker",
            namespace=FP.namespace(store_key) if namespace is None else namespace,
            shard=shard,
            shards=[shard],
            store_key=store_key,
        )
        t = self.make(ctx, **options)
        layout = make_layout(num_layers=LAYERS, num_blocks=16, block_size=BS)
        fill_blocks(layout, [0, 1, 2, 3], seed)
        await t.open()
        self.opened.append(t)
        await t.register(layout)
        return t, layout

    async def read(self, t: Transport, key: str) -> tuple[ChunkHeader, bytes]:
        raise NotImplementedError

    async def write(self, t: Transport, key: str, h: ChunkHeader, payload: bytes) -> None:
        raise NotImplementedError


class FsStore(Store):
    async def read(self, t: Transport, key: str) -> tuple[ChunkHeader, bytes]:
        assert isinstance(t, FsTransport)
        return self.parse(t.path(key).read_bytes())

    @staticmethod
    def parse(raw: bytes) -> tuple[ChunkHeader, bytes]:
        """A chunk file's header and payload."""
        (n,) = struct.unpack_from("<I", raw, 8)
        return ChunkHeader.decode(raw[12 : 12 + n]), raw[HEADER_SIZE:]

    async def write(self, t: Transport, key: str, h: ChunkHeader, payload: bytes) -> None:
        assert isinstance(t, FsTransport)
        path = t.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_header(h).ljust(HEADER_SIZE, b"\0") + payload)


class RedisStore(Store):
    async def read(self, t: Transport, key: str) -> tuple[ChunkHeader, bytes]:
        value = await t.client.get(t.key(key))  # type: ignore[attr-defined]
        (n,) = struct.unpack_from("<I", value, len(value) - 12)
        return ChunkHeader.decode(value[-12 - n : -12]), value[: -12 - n]

    async def write(self, t: Transport, key: str, h: ChunkHeader, payload: bytes) -> None:
        from kvflow_redis._format import encode_trailer

        await t.client.set(t.key(key), payload + encode_trailer(h))  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    servers = load_module("plugins/kvflow_redis/tests/servers.py", "kvflow_redis_test_servers")
    if servers.binary() is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install -y redis-server)")
    with servers.standalone(tmp_path_factory.mktemp("redis")) as d:
        yield d.url


@pytest.fixture(params=["fs", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    if request.param == "fs":
        root = str(tmp_path / "store")
        s: Store = FsStore(lambda ctx, **o: FsTransport(FsOptions(path=root, **o), ctx))
    else:
        kvflow_redis = pytest.importorskip("kvflow_redis")
        url = request.getfixturevalue("redis_url")
        prefix = f"kvflow-store-key-{os.getpid()}-{tmp_path.name}:"

        def make(ctx: TransportContext, **o: Any) -> Transport:
            options = kvflow_redis.RedisOptions(url=url, key_prefix=prefix, **o)
            t: Transport = kvflow_redis.RedisTransport(options, ctx)
            return t

        s = RedisStore(make)
    yield s
    for t in s.opened:
        await t.aclose()


# -- a worker's saves and loads -------------------------------------------------------


async def save(t: Transport, layout: KVLayout, keys: list[str], blocks: list[int]) -> None:
    counts = COUNTS[: len(keys)]

    async def spans(layer: int) -> list[list[memoryview]]:
        return layout.chunk_spans(layer, blocks, counts)

    await t.save(SaveJob("save", keys, counts, LAYERS, spans))


async def load(t: Transport, layout: KVLayout, keys: list[str], blocks: list[int]) -> None:
    counts = COUNTS[: len(keys)]
    signalled: list[int] = []
    await t.load(
        LoadJob(
            "load",
            keys,
            counts,
            LAYERS,
            spans=lambda layer: layout.chunk_spans(layer, blocks, counts),
            layer_loaded=signalled.append,
        )
    )
    assert signalled == list(range(LAYERS))


def kv(layout: KVLayout, blocks: list[int]) -> list[bytes]:
    """Each chunk's KV (every layer) in `blocks`."""
    return [
        b"".join(token_bytes(layout, i, b, n) for i in range(LAYERS))
        for b, n in zip(blocks, COUNTS, strict=False)
    ]


SRC, DST = [0, 1, 2, 3], [8, 9, 10, 11]


# -- without a key: the attack (issue 46 H2) -------------------------------------------


async def test_without_a_store_key_a_keyless_writers_chunks_load(store: Store) -> None:
    """What the key is for: anyone who can write the store computes a prompt's names
    and plants KV that every keyless engine loads."""
    _, keys = names(None)
    attacker, theirs = await store.worker(None, seed=666)
    await save(attacker, theirs, keys, SRC)
    victim, mine = await store.worker(None, seed=1)
    assert await victim.lookup(keys) == len(keys)
    await load(victim, mine, keys, DST)
    assert kv(mine, DST) == kv(theirs, SRC), "the planted KV was loaded"
    # ... and the format is what it always was: XXH3-64 of each layer's bytes
    h, payload = await store.read(victim, keys[0])
    size = h.layer_nbytes[0]
    assert h.layer_hash[0] == xxhash.xxh3_64_intdigest(payload[:size])


# -- with a key --------------------------------------------------------------------------


async def test_a_keyed_engine_round_trips_and_names_nothing_a_keyless_writer_can(
    store: Store,
) -> None:
    ns, keys = names(KEY_A)
    plain_ns, plain_keys = names(None)
    assert ns != plain_ns and not set(keys) & set(plain_keys)
    writer, src = await store.worker(KEY_A, seed=1)
    await save(writer, src, keys, SRC)
    reader, dst = await store.worker(KEY_A, seed=2)
    assert await reader.lookup(keys) == len(keys)
    await load(reader, dst, keys, DST)
    assert kv(dst, DST) == kv(src, SRC)
    h, payload = await store.read(reader, keys[1])
    assert h.namespace == ns and h.key == keys[1]
    assert h.layer_hash[0] != xxhash.xxh3_64_intdigest(payload[: h.layer_nbytes[0]])
    first = [memoryview(payload)[: h.layer_nbytes[0]]]
    assert h.layer_hash[0] == layer_hash(first, KEY_A, keys[1], SHARD, 0)


async def test_chunks_planted_under_the_names_a_keyless_writer_computes_are_never_looked_up(
    store: Store,
) -> None:
    _, plain_keys = names(None)
    attacker, theirs = await store.worker(None, seed=666)
    await save(attacker, theirs, plain_keys, SRC)
    _, keys = names(KEY_A)
    victim, _ = await store.worker(KEY_A, seed=1)
    assert await victim.lookup(keys) == 0, "a keyed engine looks elsewhere"


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "verify-off"])
async def test_a_keyless_writers_bytes_under_the_keyed_names_fail_their_checksum(
    store: Store, verify: bool
) -> None:
    """The attacker learned the keyed names (a listing of the store) and writes its own
    KV there, through a keyless kvflow: refused at chunk 0, deleted (so an honest save
    writes it again), whatever the store's `verify` says."""
    ns, keys = names(KEY_A)
    attacker, theirs = await store.worker(None, namespace=ns, seed=666)
    await save(attacker, theirs, keys, SRC)
    victim, mine = await store.worker(KEY_A, seed=1, verify=verify)
    assert await victim.lookup(keys) == len(keys)
    with pytest.raises(ChunkCorrupt, match="checksum mismatch in layer") as err:
        await load(victim, mine, keys, DST)
    assert err.value.chunk == 0
    assert await victim.lookup(keys) == 0, "the planted chunk was deleted"
    await save(victim, mine, keys[:1], SRC[:1])  # the next save writes it again: it loads
    await load(victim, mine, keys[:1], DST[:1])
    assert kv(mine, DST[:1]) == kv(mine, SRC[:1])


@pytest.mark.parametrize("copy", ["another chunk", "another shard", "layers swapped"])
async def test_a_chunk_copied_under_another_name_fails_its_checksum(
    store: Store, copy: str
) -> None:
    """Bytes the key holder wrote, moved by someone without the key: a chunk's file or
    value copied under another chunk's or shard's name with its header rewritten to
    match, or two layers of one chunk swapped with their hashes."""
    _, keys = names(KEY_A)
    writer, src = await store.worker(KEY_A, seed=1)
    await save(writer, src, keys[:3], SRC[:3])  # full chunks, of one size
    h, payload = await store.read(writer, keys[0])
    shard, bad = SHARD, 0
    if copy == "another chunk":
        bad = 1
        await store.write(writer, keys[1], edited(h, key=keys[1]), payload)
    elif copy == "another shard":
        shard = "tp1of2pp0"
        other, _ = await store.worker(KEY_A, shard=shard)
        await store.write(other, keys[0], edited(h, shard=shard), payload)
    else:
        n = h.layer_nbytes[0]
        swapped = payload[n : 2 * n] + payload[:n] + payload[2 * n :]
        hashes = [h.layer_hash[1], h.layer_hash[0], *h.layer_hash[2:]]
        await store.write(writer, keys[0], edited(h, layer_hash=hashes), swapped)
    reader, dst = await store.worker(KEY_A, shard=shard, seed=3)
    with pytest.raises(ChunkCorrupt, match="checksum mismatch") as err:
        await load(reader, dst, keys[: bad + 1], DST[: bad + 1])
    assert err.value.chunk == bad


def edited(h: ChunkHeader, **changes: Any) -> ChunkHeader:
    return msgspec.structs.replace(h, **changes)


async def test_tenants_with_different_keys_never_load_each_others_chunks(store: Store) -> None:
    """Two deployments of the same model on one store, each with its own key: the same
    prompt has other names in each; a tenant that writes under the other's names (it
    holds a key, not that one) plants nothing the other loads, nor loads the other's."""
    ns_a, keys_a = names(KEY_A)
    ns_b, keys_b = names(KEY_B)
    assert ns_a != ns_b and not set(keys_a) & set(keys_b)
    a, kv_a = await store.worker(KEY_A, seed=1)
    b, kv_b = await store.worker(KEY_B, seed=2)
    await save(a, kv_a, keys_a, SRC)
    assert await b.lookup(keys_b) == 0
    await save(b, kv_b, keys_b, SRC)
    for t, layout in ((a, kv_a), (b, kv_b)):
        await load(t, layout, keys_a if t is a else keys_b, DST)
        assert kv(layout, DST) == kv(layout, SRC)
    # B reads A's names (learned from the store) with its own key: refused, not loaded
    b_in_a, kv_b2 = await store.worker(KEY_B, namespace=ns_a, seed=3)
    with pytest.raises(ChunkCorrupt, match="checksum mismatch") as err:
        await load(b_in_a, kv_b2, keys_a, DST)
    assert err.value.chunk == 0
    # ... and what B writes under A's names (A's chunk 0 gone) is refused by A
    assert await a.lookup(keys_a) == 0, "refused, so deleted: the next save writes it"
    await save(b_in_a, kv_b2, keys_a[:1], SRC[:1])
    with pytest.raises(ChunkCorrupt, match="checksum mismatch") as err:
        await load(a, kv_a, keys_a, DST)
    assert err.value.chunk == 0


async def test_a_stack_copies_up_under_the_key_and_refuses_a_planted_lower_chunk(
    store: Store, tmp_path: Path
) -> None:
    """`tiers`: fs over the store, one key. A load from below is copied into the tier
    above with keyed hashes (the next load reads it there); bytes planted below without
    the key are refused."""
    ns, keys = names(KEY_A)
    lower, src = await store.worker(KEY_A, seed=1)
    await save(lower, src, keys, SRC)
    near = tmp_path / "near"
    ctx = replace(lower.context, engine_id="stacked")
    stack = stacked([FsTransport(FsOptions(path=str(near)), ctx), store.make(replace(ctx))])
    await stack.open()
    store.opened.append(stack)
    dst = make_layout(num_layers=LAYERS, num_blocks=16, block_size=BS)
    await stack.register(dst)
    await load(stack, dst, keys, DST)  # from below, copied up
    assert kv(dst, DST) == kv(src, SRC)
    upper = FsStore(lambda c, **o: FsTransport(FsOptions(path=str(near)), c))
    alone, dst2 = await upper.worker(KEY_A, seed=5)
    await load(alone, dst2, keys, DST)  # the upper tier's copy, on its own
    assert kv(dst2, DST) == kv(src, SRC)
    await alone.aclose()
    # a keyless writer's bytes below, for a prompt the stack never saw
    more = chunk_keys(ns, [7, 7, 7, 7], BS, store_key=KEY_A)
    attacker, theirs = await store.worker(None, namespace=ns, seed=666)
    await save(attacker, theirs, more, SRC[:1])
    with pytest.raises(TransportError, match="checksum mismatch"):
        await load(stack, dst, more, DST[:1])


class TestFsConformanceUnderAStoreKey(TransportConformance):
    """Every promise of a store holds with keyed checksums (saves, loads, concurrency,
    cancellation, namespaces, shards, other tensor-parallel sizes)."""

    @pytest.fixture
    def make_transport(self, tmp_path: Path) -> Callable[[TransportContext], Transport]:
        def make(context: TransportContext) -> Transport:
            keyed = replace(context, store_key=KEY_A)
            return FsTransport(FsOptions(path=str(tmp_path / "store")), keyed)

        return make


class TestRedisConformanceUnderAStoreKey(TransportConformance):
    @pytest.fixture
    def make_transport(
        self, redis_url: str, tmp_path: Path
    ) -> Callable[[TransportContext], Transport]:
        kvflow_redis = pytest.importorskip("kvflow_redis")
        prefix = f"kvflow-store-key-{os.getpid()}-{tmp_path.name}:"
        options = kvflow_redis.RedisOptions(url=redis_url, key_prefix=prefix)

        def make(context: TransportContext) -> Transport:
            t: Transport = kvflow_redis.RedisTransport(options, replace(context, store_key=KEY_A))
            return t

        return make


# -- the key file ------------------------------------------------------------------------


def test_store_key_file_is_read_at_start_and_refused_with_its_name(tmp_path: Path) -> None:
    assert store_key_of(KVFlowConfig()) is None
    key = tmp_path / "store.key"
    keygen(str(key))
    cfg = parse_config({"store_key_file": str(key)}, transports=["fs"])
    got = store_key_of(cfg)
    assert isinstance(got, StoreKey) and repr(got) == "StoreKey(...)"
    again = store_key_of(cfg)
    assert again is not None and (again.names, again.checksums) == (got.names, got.checksums)
    assert got.names != got.checksums
    name = r"kv_connector_extra_config\['store_key_file'\]"
    with pytest.raises(ConfigError, match=name + ": cannot read"):
        store_key_of(KVFlowConfig(store_key_file=str(tmp_path / "none")))
    key.chmod(0o644)
    with pytest.raises(ConfigError, match=name + r": '.*' may be read or written by others"):
        store_key_of(cfg)
    key.chmod(0o600)
    with pytest.raises(ConfigError, match=name + ": transport 'zmq' is a peer transport"):
        store_key_of(KVFlowConfig(transport="zmq", store_key_file=str(key)), store=False)
    bad = tmp_path / "bad.key"
    bad.write_text("not hex")
    bad.chmod(0o600)
    with pytest.raises(ConfigError, match=name + ": .* does not hold a kvflow key"):
        store_key_of(KVFlowConfig(store_key_file=str(bad)))


# -- hidden states -------------------------------------------------------------------------


async def test_hidden_states_under_a_store_key_are_read_with_it_only(tmp_path: Path) -> None:
    key_file = tmp_path / "store.key"
    keygen(str(key_file))
    store_key = store_key_of(KVFlowConfig(store_key_file=str(key_file)))
    tokens = list(range(300, 337))
    ns = FP.namespace(store_key)
    ref = HiddenStatesRef(
        transport="fs",
        namespace=ns,
        keys=chunk_keys(ns, tokens, 16, store_key=store_key),
        block_size=16,
        token_ids=tokens,
        num_layers=2,
        hidden_size=8,
        dtype="float32",
    )
    buf = host_buffer(ref)
    buf.copy_(torch.randn(buf.shape))
    store = tmp_path / "store"
    writer = FsTransport(FsOptions(path=str(store)), hidden_context("e", "worker", ns, store_key))
    await writer.open()
    await writer.register(hidden_layout(16, 2, 8, "float32"))
    bus = EventBus(Origin("e", "worker"))
    assert await save_hidden_states(writer, bus, "r", ref, buf, 10) == ""
    await writer.aclose()
    rows = buf.view(-1, 2, 8)[: len(tokens)]
    with HiddenStatesReader("fs", {"path": str(store)}, store_key_file=str(key_file)) as reader:
        got = await trio.to_thread.run_sync(reader.load, ref)
    assert torch.equal(got.hidden_states, rows)
    keyless = HiddenStatesReader("fs", {"path": str(store)}, timeout_s=1)
    with keyless, pytest.raises(HiddenStatesError, match="checksum mismatch"):
        await trio.to_thread.run_sync(keyless.load, ref)


# -- a real engine -------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.slow  # an engine process of its own
def test_a_real_engine_under_a_store_key_loads_what_it_saved(tmp_path: Path) -> None:
    """vLLM (CPU) with `store_key_file`: a prompt computed and saved, then the same prompt
    (vLLM's prefix cache off) loaded from the store, with identical tokens; the store's
    names are the keyed ones, its checksums keyed."""
    from ..support.vllm_engines import assert_same_generation, run_engine

    key_file = tmp_path / "store.key"
    keygen(str(key_file))
    store_key = store_key_of(KVFlowConfig(store_key_file=str(key_file)))
    prompt = [(i * 37) % 997 + 3 for i in range(200)]  # 6 full blocks of 32 and 8 tokens
    cache = tmp_path / "cache"
    extra = {"options": {"path": str(cache)}, "store_key_file": str(key_file)}
    res = run_engine(tmp_path, "keyed", batches=[[prompt], [prompt]], extra_config=extra)
    (cold,), (warm,) = res.batches
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == len(prompt) - 1, "the warm request did not load"
    assert_same_generation(warm, cold, "loaded under a store key")
    (ns,) = [d for d in cache.iterdir() if d.is_dir()]
    stored = {f.name.split(".")[0] for f in ns.rglob("*.kv")}
    keyed = chunk_keys(ns.name, prompt, 32, store_key=store_key)
    assert set(keyed) <= stored and not set(chunk_keys(ns.name, prompt, 32)) & stored
    first = next(ns.rglob(f"{keyed[0]}.*.kv"))
    h, payload = FsStore.parse(first.read_bytes())
    n = h.layer_nbytes[0]
    assert h.layer_hash[0] == layer_hash([memoryview(payload)[:n]], store_key, h.key, h.shard, 0)
