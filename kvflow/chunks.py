"""What a store transport writes next to a chunk's bytes, and how it judges a chunk.

A stored chunk is its layers' bytes (layer-major) plus a `ChunkHeader`: the key,
namespace and shard it was written for, its token count, each layer's size and
XXH3-64, and the writer's `KVLayout.describe()`. A reader checks the header against
what it asked for (`ChunkHeader.problem`) before it uses a byte, and each layer's
hash (`layer_hash`) before vLLM may use that layer. Where the header goes (a file's
first page, a value's trailer, an object's metadata) is the transport's.

Under a store key (`TransportContext.store_key`) each layer's hash is instead a keyed
BLAKE3 (its first 8 bytes) of the chunk key, shard, layer index and bytes: bytes written
by whoever lacks the key, or copied from another chunk, shard or layer, fail it
(`ChunkCorrupt`: vLLM recomputes). The header's format is the same.

A load that stops reports the earliest chunk that failed (`first_failure`): every
chunk before it arrived whole, so vLLM keeps those and recomputes from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import msgspec
import xxhash

from .keys import ChunkKey, StoreKey
from .transport import LoadJob, TransportContext, TransportError

__all__ = ["BadHeader", "ChunkFailure", "ChunkHeader", "first_failure", "layer_hash"]


class BadHeader(ValueError):
    """Bytes that are not a chunk header kvflow can read."""


class ChunkHeader(msgspec.Struct, frozen=True, array_like=True):
    key: str
    namespace: str
    shard: str
    num_tokens: int
    layer_nbytes: list[int]
    layer_hash: list[int]
    """XXH3-64 of each layer's bytes, or under a store key their keyed BLAKE3's first 8
    bytes (`layer_hash`)."""
    layout: str = ""
    """`KVLayout.describe()` of the writer ("" in chunks of a kvflow before it was kept)."""

    @classmethod
    def of(
        cls,
        context: TransportContext,
        key: ChunkKey,
        num_tokens: int,
        layers: Sequence[Sequence[memoryview]],
    ) -> ChunkHeader:
        """The header of one chunk whose layer i is the spans `layers[i]` (hashed under
        `context.store_key`, if set)."""
        assert context.layout is not None, "a store writes chunks of registered KV caches"
        sk, shard = context.store_key, context.shard
        return cls(
            key=key,
            namespace=context.namespace,
            shard=shard,
            num_tokens=num_tokens,
            layer_nbytes=[sum(len(s) for s in spans) for spans in layers],
            layer_hash=[layer_hash(spans, sk, key, shard, i) for i, spans in enumerate(layers)],
            layout=context.layout.describe(),
        )

    def layer_intact(
        self, layer: int, spans: Sequence[memoryview], store_key: StoreKey | None = None
    ) -> bool:
        """Whether `spans`, read as layer `layer` of this chunk, hash as the header says
        (under `store_key`: `TransportContext.store_key`)."""
        return layer_hash(spans, store_key, self.key, self.shard, layer) == self.layer_hash[layer]

    def first_bad_layer(
        self,
        layers: range,
        spans: Sequence[Sequence[memoryview]],
        store_key: StoreKey | None = None,
    ) -> int | None:
        """The first of `layers` (`spans[i]`: layer `layers[i]`'s spans) that is not
        `layer_intact`; None when all are. One tight loop, for the reader threads of a
        load: the Python they run between hashes holds the GIL the other readers wait
        for after each read (decision 105)."""
        want = self.layer_hash
        if store_key is None:
            for layer, s in zip(layers, spans, strict=True):
                if (_xxh3(s[0]) if len(s) == 1 else layer_hash(s)) != want[layer]:
                    return layer
            return None
        for layer, s in zip(layers, spans, strict=True):
            if layer_hash(s, store_key, self.key, self.shard, layer) != want[layer]:
                return layer
        return None

    def payload_nbytes(self) -> int:
        return sum(self.layer_nbytes)

    def encode(self) -> bytes:
        return _encoder.encode(self)

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> ChunkHeader:
        try:
            return _decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise BadHeader(f"undecodable header: {exc}") from None

    def problem(
        self,
        context: TransportContext,
        key: ChunkKey,
        num_tokens: int,
        job: LoadJob | None = None,
    ) -> str:
        """Why this chunk is not the one `context` asked for under `key` with `num_tokens`
        tokens ("" when it is): another key, configuration, shard, token count, layer
        sizes or byte order. A `job` that names another shard and layout (a chunk saved
        at another tensor-parallel size: `kvflow.shapes.reshape`) is checked against those."""
        layout = job.layout if job is not None and job.layout is not None else context.layout
        shard = job.shard if job is not None and job.shard else context.shard
        assert layout is not None, "a store reads chunks into registered KV caches"
        expect = layout.layer_nbytes(num_tokens)
        if self.key != key:
            return f"key mismatch (header names {self.key})"
        if self.namespace != context.namespace:
            return (
                f"written by another configuration (namespace {self.namespace}, "
                f"not {context.namespace})"
            )
        if self.shard != shard:
            return f"shard mismatch (written by {self.shard}, this is {shard})"
        if self.num_tokens != num_tokens:
            return f"token count mismatch ({self.num_tokens} tokens stored, {num_tokens} expected)"
        if self.layer_nbytes != expect:
            return "layer sizes do not match this KV layout"
        if len(self.layer_hash) != len(expect):
            return f"{len(self.layer_hash)} layer hashes for {len(expect)} layers"
        ours = layout.describe()
        if self.layout and self.layout != ours:  # the same sizes, another order of the bytes
            return f"written with another KV layout ({self.layout}; this reader has {ours})"
        return ""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ChunkHeader)


KEYED_HASH_THREADS = 1
"""`max_threads` of each keyed layer hash: one. A store transport already hashes in
threads of its own (`fs`: `threads`, 2 by default), a layer at a time; BLAKE3's own
threads (`blake3.blake3.AUTO`) on top of those saved no faster and loaded slower on 2
cores, and take cores from whatever else runs there (`bench/bench_fs_io.py --store-key`,
docs/benchmarks.md)."""


def layer_hash(
    spans: Sequence[memoryview],
    store_key: StoreKey | None = None,
    key: ChunkKey = "",
    shard: str = "",
    layer: int = 0,
) -> int:
    """XXH3-64 of the spans' bytes, in order (at memory speed: ~4x zlib's CRC32).

    With a `store_key`: keyed BLAKE3 of layer `layer` of shard `shard` of chunk `key`,
    then the spans' bytes, its first 8 bytes as an unsigned 64-bit number (as XXH3-64
    is), which only holders of the key can compute, and which differs for any other
    chunk, shard or layer holding the same bytes. It releases the GIL for spans of 2 KiB
    and more, so a transport's threads hash at once."""
    if store_key is not None:
        keyed = blake3.blake3(
            _binding(key, shard, layer), key=store_key.checksums, max_threads=KEYED_HASH_THREADS
        )
        for s in spans:
            keyed.update(s)
        return int.from_bytes(keyed.digest(8), "little")
    if len(spans) == 1:  # the common case (a block-granular or dense chunk): one call
        return _xxh3(spans[0])
    h = xxhash.xxh3_64()
    for s in spans:
        h.update(s)
    return h.intdigest()


_xxh3 = xxhash.xxh3_64_intdigest


def _binding(key: ChunkKey, shard: str, layer: int) -> bytes:
    """What a keyed layer hash is bound to, unambiguously (msgpack: self-delimiting)."""
    return _encoder.encode((key, shard, layer))


@dataclass(frozen=True)
class ChunkFailure:
    """Why a load stops at `chunk`; `kind` is the error it raises (`ChunkMissing`,
    `ChunkCorrupt`, or `TransportError` when the store itself failed)."""

    chunk: int
    kind: type[TransportError]
    reason: str

    def error(self, key: ChunkKey) -> TransportError:
        return self.kind(f"chunk {self.chunk} ({key}): {self.reason}", chunk=self.chunk, key=key)


def first_failure(found: Sequence[ChunkFailure | None]) -> ChunkFailure | None:
    """The failure at the earliest chunk: every chunk before it is intact."""
    return min((f for f in found if f is not None), key=lambda f: f.chunk, default=None)
