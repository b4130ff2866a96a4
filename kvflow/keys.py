"""Deterministic content keys for chunks of token ids.

vLLM's own block hashes are salted per process unless PYTHONHASHSEED is set,
so they cannot name bytes that outlive the process. kvflow keys are a chained
BLAKE2b of the token ids of each chunk (one chunk per KV block), rooted in a
*namespace*: a fingerprint of everything that makes KV bytes incompatible.
The same tokens under the same configuration give the same key in any process;
a different model, dtype, block size or layout gives a different one. kvflow's
vLLM adapter leaves the tensor-parallel size out: a store serves engines of any
size, each rank's heads under its shard (`kvflow.shapes.reshape`).

A trailing partial chunk (fewer tokens than a block) gets its own key, which
differs from any full chunk's because the token count is hashed in.

With a store key (`store_key_file`, a `StoreKey`) the namespace and every link of the
chain are keyed BLAKE2b: whoever lacks the key cannot tell where a prefix's chunks are
(to plant bytes there, or to learn whether a prompt was sent), and deployments with
different keys never share a chunk. Without one, keys are as they always were.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Sequence

import msgspec

__all__ = [
    "ChunkKey",
    "Fingerprint",
    "StoreKey",
    "chunk_keys",
    "chunk_token_counts",
    "is_chunk_key",
    "is_plain_name",
    "shown",
]

ChunkKey = str
"""Hex digest naming one chunk of KV bytes (32 hex characters)."""

_DIGEST = 16
_CHUNK_KEY = re.compile(f"[0-9a-f]{{{2 * _DIGEST}}}")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


class StoreKey:
    """The keys a store key (`store_key_file`'s secret) gives, each 32 bytes derived with
    keyed BLAKE2b under a label of its own: `names` keys the namespace and the chain of
    chunk keys (keyed BLAKE2b, `chunk_keys`), `checksums` each layer's checksum (keyed
    BLAKE3, `kvflow.chunks.layer_hash`). The secret itself is kept nowhere."""

    __slots__ = ("checksums", "names")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("a store key has at least 16 bytes (`kvflow keygen PATH`)")
        self.names = _derive(secret, b"kvflow store: chunk keys")
        self.checksums = _derive(secret, b"kvflow store: layer checksums")

    def __repr__(self) -> str:
        return "StoreKey(...)"  # never the keys, in a log or a traceback


def _derive(secret: bytes, label: bytes) -> bytes:
    return hashlib.blake2b(label, key=secret[:64], digest_size=32).digest()


class Fingerprint(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that makes KV bytes of one configuration unusable in another."""

    model: str
    dtype: str
    block_size: int
    num_layers: int
    layout: str
    bytes_per_token: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    extra: str = ""

    def namespace(self, store_key: StoreKey | None = None) -> str:
        """A short stable id of this fingerprint (hex); with a `store_key`, one that only
        its holders can compute."""
        raw = msgspec.json.encode(self)
        key = store_key.names if store_key is not None else b""
        return hashlib.blake2b(raw, digest_size=_DIGEST, key=key).hexdigest()

    def pd_scope(self) -> str:
        """What P/D params are bound to besides the prompt (`kvflow.pd.security.
        prompt_digest`): the model, its dtype and which KV cache group; not the parallel
        shape, block size or layout, whose mismatch a consumer or producer refuses with
        a message of its own."""
        shapeless = msgspec.structs.replace(
            self, block_size=0, bytes_per_token=0, layout="", tp_rank=0, tp_size=1, pp_rank=0
        )
        return shapeless.namespace()


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def chunk_keys(
    namespace: str,
    token_ids: Sequence[int],
    block_size: int,
    *,
    salt: str = "",
    include_partial: bool = True,
    store_key: StoreKey | None = None,
) -> list[ChunkKey]:
    """Keys of the consecutive `block_size` chunks of `token_ids`.

    `salt` folds per-request inputs that change KV bytes without changing
    token ids (LoRA adapter, cache salt, multimodal content) into the chain.
    With a `store_key`, every link is keyed: a key seen in a store does not give
    the next one's.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    key = store_key.names if store_key is not None else b""
    parent = hashlib.blake2b(f"{namespace}|{salt}".encode(), digest_size=_DIGEST, key=key).digest()
    keys: list[ChunkKey] = []
    n = len(token_ids)
    end = n if include_partial else n - n % block_size
    for start in range(0, end, block_size):
        chunk = token_ids[start : min(start + block_size, end)]
        h = hashlib.blake2b(parent, digest_size=_DIGEST, key=key)
        h.update(len(chunk).to_bytes(4, "little"))
        h.update(_tokens_bytes(chunk))
        parent = h.digest()
        keys.append(parent.hex())
    return keys


def chunk_token_counts(num_tokens: int, block_size: int) -> list[int]:
    """Tokens held by each chunk of a `num_tokens` prefix: full blocks, then a partial tail."""
    full, tail = divmod(num_tokens, block_size)
    return [block_size] * full + ([tail] if tail else [])


def is_chunk_key(key: object) -> bool:
    """Whether `key` has the form `chunk_keys` gives: 32 lowercase hex characters (safe
    in a file name or a store's key)."""
    return isinstance(key, str) and _CHUNK_KEY.fullmatch(key) is not None


def is_plain_name(name: object) -> bool:
    """Whether `name` (a namespace) is safe as one path component: at most 128 letters,
    digits, `_`, `-` and `.`, not starting with `.` (so never `.` or `..`)."""
    return isinstance(name, str) and _PLAIN_NAME.fullmatch(name) is not None


def shown(value: object, limit: int = 80) -> str:
    """`repr(value)` for an error message, cut to about `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
