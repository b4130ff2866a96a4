"""A model's hidden states per request (vLLM's `extract_hidden_states`), in any store.

A request's hidden states are `num_tokens` rows of `[num_layers, hidden_size]` (the
layers the speculative config names). kvflow stores them like KV: one chunk per
`block_size` tokens (the last one partial), named by content keys in a namespace of
their own, as one layer whose cell is a token's rows (token-major, so a reader needs
nothing of vLLM's cache layout). The same prompt gives the same keys: a prefix stored
once serves every request that shares it.

The writer (kvflow's vLLM adapter) returns a `HiddenStatesRef` in the request's
`kv_transfer_params["kvflow_hidden_states"]`; `HiddenStatesReader.load` waits for its
chunks (the write runs after the request finished) and returns the tensor.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, NamedTuple

import msgspec
import torch
import trio

from .config import ConfigError, KVFlowConfig, parse_options, store_key_of
from .geometry.layout import KVLayout, view_geometry
from .keys import ChunkKey, StoreKey, chunk_token_counts, is_chunk_key, is_plain_name, shown
from .observe.events import EventBus, SaveStarted, TransferDone, TransferFailed
from .runtime import Backoff, Runtime, RuntimeClosed
from .transport import LoadJob, SaveJob, Transport, TransportContext, TransportError, load_transport

__all__ = [
    "PARAM",
    "SHARD",
    "HiddenStates",
    "HiddenStatesError",
    "HiddenStatesReader",
    "HiddenStatesRef",
    "chunk_spans",
    "hidden_context",
    "hidden_layout",
    "host_buffer",
    "save_hidden_states",
]

PARAM = "kvflow_hidden_states"
"""The `kv_transfer_params` key of a request's `HiddenStatesRef`."""
SHARD = "hidden"
"""The one shard hidden states have (every tensor-parallel rank holds all of them;
rank 0 writes)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_Positive = Annotated[int, msgspec.Meta(ge=1)]


class HiddenStatesError(RuntimeError):
    """A request's hidden states cannot be read (not written in time, evicted, corrupt)."""


class HiddenStatesRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one request's hidden states are stored, and their shape."""

    transport: str
    namespace: str
    keys: list[ChunkKey]
    block_size: _Positive
    token_ids: list[int]
    """The tokens whose hidden states these are (the prompt; with the request's
    `include_output_tokens`, also the output tokens but the last)."""
    num_layers: _Positive
    hidden_size: _Positive
    dtype: str

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def token_counts(self) -> list[int]:
        return chunk_token_counts(self.num_tokens, self.block_size)

    def to_params(self) -> dict[str, Any]:
        return {PARAM: msgspec.to_builtins(self)}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | HiddenStatesRef) -> HiddenStatesRef:
        """From a request's `kv_transfer_params` (or the value under `PARAM`), checked:
        a reference comes from a client, and its names reach paths and store keys."""
        if isinstance(params, HiddenStatesRef):
            params = params.to_params()  # checked all the same
        if not isinstance(params, Mapping):
            raise HiddenStatesError(f"not a kvflow hidden-states reference: {shown(params)}")
        raw = params.get(PARAM, params)
        try:
            ref = msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise HiddenStatesError(f"not a kvflow hidden-states reference: {exc}") from None
        if ref.dtype not in DTYPES or len(ref.keys) != len(ref.token_counts):
            raise HiddenStatesError(f"inconsistent kvflow hidden-states reference: {shown(raw)}")
        if not is_plain_name(ref.namespace):
            raise HiddenStatesError(
                f"kvflow hidden-states reference: namespace {shown(ref.namespace)} is not a "
                "plain name (letters, digits, '_', '-', '.', not starting with '.')"
            )
        for key in ref.keys:
            if not is_chunk_key(key):
                raise HiddenStatesError(
                    f"kvflow hidden-states reference: chunk key {shown(key)} is not 32 "
                    "lowercase hex characters"
                )
        return ref


class HiddenStates(NamedTuple):
    hidden_states: torch.Tensor
    """`[num_tokens, num_layers, hidden_size]`."""
    token_ids: torch.Tensor


def host_buffer(ref: HiddenStatesRef, *, pin: bool = False) -> torch.Tensor:
    """Host memory for `ref`'s chunks: `[chunks, block_size, num_layers, hidden_size]`."""
    shape = (len(ref.keys), ref.block_size, ref.num_layers, ref.hidden_size)
    return torch.empty(shape, dtype=DTYPES[ref.dtype], pin_memory=pin)


def hidden_layout(block_size: int, num_layers: int, hidden_size: int, dtype: str) -> KVLayout:
    """The layout a transport registers for hidden states: one layer of token-major cells
    (the chunk geometry only: each job's spans point into its own `host_buffer`, as a
    staged save's point into its staging buffer)."""
    per_token = num_layers * hidden_size
    geo = view_geometry(
        [1, num_layers, block_size, hidden_size],
        [block_size * per_token, hidden_size, per_token, 1],
        DTYPES[dtype].itemsize,
        1,
    )
    return KVLayout(names=["hidden_states"], geometries=[geo], buffers=[], block_size=block_size)


def chunk_spans(buf: torch.Tensor, token_counts: list[int]) -> list[list[memoryview]]:
    """Each chunk's bytes in `buf` (a `host_buffer`): its first `token_counts[i]` rows."""
    raw = memoryview(buf.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
    chunk = len(raw) // max(1, buf.shape[0])
    row = chunk // buf.shape[1]
    return [[raw[i * chunk : i * chunk + n * row]] for i, n in enumerate(token_counts)]


def hidden_context(
    engine_id: str, role: str, namespace: str, store_key: StoreKey | None = None
) -> TransportContext:
    """A transport's context for hidden states: their namespace, their one shard, the
    engine's store key (`store_key_file`), if set."""
    return TransportContext(
        engine_id=engine_id,
        role=role,
        namespace=namespace,
        shard=SHARD,
        shards=[SHARD],
        store_key=store_key,
    )


async def save_hidden_states(
    transport: Transport,
    bus: EventBus,
    req: str,
    ref: HiddenStatesRef,
    buf: torch.Tensor,
    timeout_s: float,
) -> str:
    """Store `buf` (a `host_buffer` holding `ref`'s rows) as `ref`'s chunks; the error
    ("" when stored). Reported on `bus` like a KV save, as `what="hidden_states"`."""
    counts = ref.token_counts
    spans = chunk_spans(buf, counts)

    async def layer_spans(layer: int) -> list[list[memoryview]]:
        return spans

    nbytes = sum(len(s) for chunk in spans for s in chunk)
    bus.emit(
        SaveStarted(
            req=req,
            chunks=len(counts),
            tokens=ref.num_tokens,
            nbytes=nbytes,
            transport=transport.name,
            what="hidden_states",
        )
    )
    t0 = time.perf_counter()
    error = ""
    try:
        with trio.move_on_after(timeout_s) as deadline:
            await transport.save(SaveJob(req, ref.keys, counts, 1, layer_spans))
        if deadline.cancelled_caught:
            error = f"not saved within save_timeout_s={timeout_s}"
    except Exception as exc:  # a store error: the hidden states are lost, nothing else
        error = f"{type(exc).__name__}: {exc}"
    if error:
        bus.emit(
            TransferFailed(
                req=req,
                direction="save",
                reason=error,
                timed_out=error.startswith("not saved"),
                what="hidden_states",
            )
        )
    else:
        bus.emit(
            TransferDone(
                req=req,
                direction="save",
                chunks=len(counts),
                nbytes=nbytes,
                elapsed_s=time.perf_counter() - t0,
                what="hidden_states",
            )
        )
    return error


class HiddenStatesReader:
    """Loads requests' hidden states from the store kvflow wrote them to.

    `transport`, `options` and `store_key_file` are those of the engine's
    `kv_connector_extra_config` (with a store key, each chunk's checksum is checked with
    it). A reader runs its own loop thread; close it (or use it as a context manager)."""

    def __init__(
        self,
        transport: str = "fs",
        options: Mapping[str, Any] | None = None,
        *,
        timeout_s: float = 30.0,
        store_key_file: str = "",
    ) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        cls = load_transport(transport)
        try:
            self._options = parse_options(dict(options or {}), cls.Options, transport)
            self._store_key = store_key_of(KVFlowConfig(store_key_file=store_key_file))
        except ConfigError as exc:
            raise HiddenStatesError(str(exc)) from None
        self._cls = cls
        self._runtime = Runtime(f"hidden-states-{transport}")
        self._open: dict[tuple[str, str], Transport] = {}

    def __enter__(self) -> HiddenStatesReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._runtime.shutdown()
        self._open.clear()

    def load(
        self, params: Mapping[str, Any] | HiddenStatesRef, *, timeout_s: float | None = None
    ) -> HiddenStates:
        """A request's hidden states, from its `kv_transfer_params`. Waits until every
        chunk is stored, at most `timeout_s` (default: the reader's); raises
        `HiddenStatesError` when they are not, or cannot be read."""
        ref = HiddenStatesRef.from_params(params)
        if ref.transport != self.transport:
            raise HiddenStatesError(
                f"these hidden states were written through transport {ref.transport!r}; "
                f"this reader reads {self.transport!r}"
            )
        wait = self.timeout_s if timeout_s is None else timeout_s
        buf = host_buffer(ref)
        try:
            self._runtime.call(self._load, ref, buf, wait, timeout=wait + 30.0)
        except TransportError as exc:
            raise HiddenStatesError(f"reading hidden states ({self.transport}): {exc}") from exc
        except TimeoutError:
            raise HiddenStatesError(
                f"the {self.transport} store did not answer within {wait + 30.0}s"
            ) from None
        except RuntimeClosed:
            raise HiddenStatesError("this reader is closed") from None
        rows = buf.view(-1, ref.num_layers, ref.hidden_size)[: ref.num_tokens]
        return HiddenStates(rows, torch.tensor(ref.token_ids, dtype=torch.long))

    async def _transport(self, ref: HiddenStatesRef) -> Transport:
        layout = hidden_layout(ref.block_size, ref.num_layers, ref.hidden_size, ref.dtype)
        key = (ref.namespace, layout.describe())
        if (t := self._open.get(key)) is None:
            context = hidden_context("reader", "reader", ref.namespace, self._store_key)
            t = self._cls(self._options, context)
            await t.open()
            self._runtime.add_closer(t.aclose)
            await t.register(layout)
            self._open[key] = t
        return t

    async def _load(self, ref: HiddenStatesRef, buf: torch.Tensor, wait: float) -> None:
        transport = await self._transport(ref)
        found = 0
        with trio.move_on_after(wait):
            backoff = Backoff(1e-3, 0.05)  # the write follows the request's end
            while (found := await transport.lookup(ref.keys)) < len(ref.keys):
                await backoff.wait()
        if found < len(ref.keys):
            raise HiddenStatesError(
                f"{found} of {len(ref.keys)} chunks of these hidden states are stored after "
                f"{wait}s: still being written, failed to save (see the engine's log), or "
                "evicted from the store"
            )
        spans = chunk_spans(buf, ref.token_counts)
        job = LoadJob(
            "hidden-states",
            ref.keys,
            ref.token_counts,
            1,
            spans=lambda layer: spans,
            layer_loaded=lambda layer: None,
            layerwise=False,
        )
        await transport.load(job)
