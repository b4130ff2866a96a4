"""The Transport ABC, the jobs it is handed, and the entry-point registry.

A transport moves chunks of KV bytes, named by content keys, between paged KV
memory and somewhere else. It never sees vLLM types: a save is a `SaveJob`
that yields, layer by layer, the memory spans of each chunk as soon as vLLM
has computed that layer; a load is a `LoadJob` that gives destination spans and
takes a `layer_loaded(i)` signal, so attention on layer i can start while
later layers still stream in.

Transports are found through the `kvflow.transports` entry-point group, the
same way for built-ins and third parties.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgspec
import trio

from ._moved import old_names
from .findings import Findings
from .geometry.layout import KVLayout
from .keys import ChunkKey, StoreKey

__all__ = [
    "Capabilities",
    "ChunkCorrupt",
    "ChunkMissing",
    "LoadJob",
    "NoOptions",
    "Offer",
    "PeerSource",
    "Renewed",
    "SaveJob",
    "TransferStuck",
    "Transport",
    "TransportContext",
    "TransportError",
    "TransportNotFound",
    "available_transports",
    "load_transport",
    "one_error",
]

ENTRY_POINT_GROUP = "kvflow.transports"


class TransportError(Exception):
    """A transfer failed. `chunk` is the index of the first chunk it could not move."""

    def __init__(self, message: str, *, chunk: int = 0, key: ChunkKey = "") -> None:
        super().__init__(message)
        self.chunk = chunk
        self.key = key


class ChunkMissing(TransportError):
    """The store does not hold a chunk (never saved, or evicted since the lookup)."""


class ChunkCorrupt(TransportError):
    """A chunk's bytes failed validation: wrong key, layout, size or checksum."""


class TransferStuck(TransportError):
    """A transfer could not be stopped and may still write into its blocks (a READ still
    in flight after its cancellation). The worker stops the engine rather than hand the
    blocks back to vLLM: a late write into a block vLLM reuses is wrong KV."""


class TransportNotFound(LookupError):
    """No installed transport has that name; the message lists the ones that do."""


class NoOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Options of a transport that takes none."""


class Capabilities(msgspec.Struct, frozen=True):
    """What a transport can do: store-style lookup/save/load, and which memory."""

    store: bool = True
    peer: bool = False
    memory: frozenset[str] = frozenset({"cpu"})
    hetero_tp: bool = False
    """A peer transport whose consumers pull from producers of another tensor-parallel
    size, each rank its own heads (`PeerSource.tp_size`, `kvflow.geometry.topology`)."""
    hetero_blocks: bool = False
    """A peer transport whose consumers pull from producers of another block size
    (`PeerSource.block_size`, `.skip`), converting cell by cell."""
    reshape: bool = False
    """A store that also serves engines of another tensor-parallel size than the one that
    saved a chunk (`kvflow.shapes.reshape`): its `lookup` takes the shards to look for, its
    `load` reads the shard a `LoadJob` names and checks the bytes against the job's
    `layout`."""

    def describe(self) -> str:
        """What it is and moves, as `kvflow transports` and `kvflow doctor` show it:
        `store; memory: cpu`."""
        kinds = ",".join(k for k, on in (("store", self.store), ("peer", self.peer)) if on)
        return f"{kinds}; memory: {','.join(sorted(self.memory))}"


@dataclass
class TransportContext:
    """Where a transport instance runs and what it serves. A peer transport's is a
    `kvflow.pd.PeerContext`: this and what P/D needs (the side channel's security,
    where each consumer rank reads)."""

    engine_id: str
    role: str
    """`scheduler` or `worker`."""
    namespace: str
    """Fingerprint of the KV configuration; written into and checked against stored bytes."""
    shard: str
    """This worker's slice of each chunk (its TP/PP rank), e.g. `tp0of1pp0`."""
    shards: list[str]
    """Every slice a chunk has; a lookup hit needs all of them."""
    layout: KVLayout | None = None
    """The registered KV memory (workers only)."""
    extra: dict[str, Any] = field(default_factory=dict)
    evicted: Callable[[str, list[ChunkKey]], None] | None = None
    """Set by kvflow's vLLM adapter when vLLM publishes KV events: a store transport that
    deletes chunks to make room calls it with their namespace and keys (any thread)."""

    tier_event: Callable[[Any], None] | None = None
    """Set by kvflow's worker: a host tier calls it (loop thread) with a
    `kvflow.observe.events.TierRead` after each load and a `TierWrite` after each save."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    """This worker's place in the engine's parallel shape (`shard` names it too)."""
    kv_heads: int = 0
    """The model's KV heads over all ranks (1 for MLA; 0: not known), which tell the heads
    each rank holds (`kvflow.geometry.topology.held_heads`)."""
    store_key: StoreKey | None = None
    """The deployment's store key (`store_key_file`), if set: `namespace` and the chunk
    keys were computed with it, and store transports hash and check each layer with it
    (`kvflow.chunks.layer_hash`), always, whatever their `verify` says."""

    def emit_tier_event(self, event: Any) -> None:
        """`tier_event(event)`, if set."""
        if self.tier_event is not None:
            self.tier_event(event)


@dataclass
class SaveJob:
    """Chunks of one request to save; `layer(i)` waits until vLLM has computed layer i."""

    req: str
    keys: list[ChunkKey]
    token_counts: list[int]
    num_layers: int
    layer_spans: Callable[[int], Awaitable[list[list[memoryview]]]]
    release: Callable[[], None] = lambda: None
    """A transport that has copied every layer's bytes elsewhere (a host-memory tier)
    may call this once: it reads the spans no more, and vLLM may have the blocks back
    while the save goes on."""
    stored_in: list[Transport] = field(default_factory=list)
    """Filled by stores built of stores (`kvflow.tiers`: a stack, the host tier): the
    tiers that hold every chunk once `save` returned, top first; empty: the store saved
    to (for vLLM's KV events, a medium per tier)."""

    async def layer(self, layer: int) -> list[list[memoryview]]:
        """Spans of every chunk in `layer`, once that layer's KV is final."""
        return await self.layer_spans(layer)


class PeerSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a peer transport pulls one request's KV from (prefill/decode disaggregation)."""

    engine_id: str
    addresses: list[str]
    """The producer's worker endpoints, one per shard in `TransportContext.shards` order."""
    req: str
    """The request id on the producer."""
    block_ids: list[int]
    """The producer's blocks, one per chunk."""
    tp_size: int = 1
    """The producer's tensor parallel size: `addresses` holds as many per pipeline stage."""
    kv_heads: int = 1
    """The model's KV heads over all ranks (which of them each rank holds)."""
    block_size: int = 0
    """Tokens in a producer block; 0: as many as in the consumer's (`block_ids` then hold
    the consumer's chunks one for one)."""
    skip: int = 0
    """Tokens of the first of `block_ids` before the first token loaded (a producer of
    larger blocks than the consumer's)."""


@dataclass
class LoadJob:
    """Chunks of one request to load into `spans(i)`; call `layer_loaded(i)` as each lands."""

    req: str
    keys: list[ChunkKey]
    token_counts: list[int]
    num_layers: int
    spans: Callable[[int], list[list[memoryview]]]
    layer_loaded: Callable[[int], None]
    source: PeerSource | None = None
    """For peer transports: the producer to pull from (store transports ignore it)."""
    block_ids: list[int] = field(default_factory=list)
    """The destination block of each chunk (device-memory transports address blocks,
    not `spans`)."""
    layerwise: bool = True
    """Whether the forward waits on each layer (a load within the step: signal layer i
    as soon as it lands). False for asynchronous loads (a P/D pull before the request
    is scheduled): only the end matters, so a transport may move all layers at once
    (`layer_loaded` is still called for every layer, in order)."""
    shard: str = ""
    """Stores with `Capabilities.reshape`: the shard to read ("": the context's own)."""
    layout: KVLayout | None = None
    """Stores with `Capabilities.reshape`: what the stored bytes must be (`spans` are
    shaped so); None: the context's layout."""


class Renewed(msgspec.Struct, tag=True, frozen=True):
    """Producer -> consumer: the answer to a `kvflow.pd.offers.Renew` (what `Transport.renew`
    returns)."""

    refused: dict[str, str]
    """Why, for each request the producer offered and no longer holds (pulled, released
    by its consumer, expired)."""
    pending: list[str] = []
    """Requests the producer has not offered: not yet (its worker learns of an offer a
    step after the request finished) or never. The consumer asks again."""
    params: dict[str, bytes] = {}
    """Streamed offers (`Offer.params`) among those held: their producer's signed
    `PdParams` (msgpack), which the consumer had no other way to get."""


async def _computed(layer: int) -> None:
    """An offer made after its request finished: every layer is computed."""


@dataclass
class Offer:
    """Blocks a producer holds for one request until a peer has pulled them."""

    req: str
    block_ids: list[int]
    token_counts: list[int]
    num_layers: int
    spans: Callable[[int], list[list[memoryview]]]
    renew: Callable[[float], None] = lambda lease_s: None
    """A consumer claimed the request and means to pull it: hold the blocks `lease_s`
    from now (instead of until the hold timeout). Set by the worker."""
    params: bytes = b""
    """A streamed offer (made as its prefill is scheduled, before it is computed): its
    signed `PdParams` (msgpack), given with each answer to a claim of it (`Renewed`)."""
    computed: Callable[[int], Awaitable[None]] = _computed
    """Wait until vLLM has computed layer i of the blocks (returns at once but for a
    streamed offer whose forward has not reached layer i yet): a transport reads a layer
    only after it."""

    async def all_computed(self) -> None:
        """Wait until every layer is computed."""
        for layer in range(self.num_layers):
            await self.computed(layer)


class Transport(ABC):
    """Base class of every transport. Subclass, declare an entry point, pass `kvflow.testing`.

    Contract, checked by the conformance suite:
    - `lookup(keys)` returns how many *leading* keys are fully stored (all shards;
      with `Capabilities.reshape`, `lookup(keys, shards)`: all of `shards`).
    - `save(job)` stores every chunk or raises; a chunk is never visible half-written.
    - `load(job)` fills every span of every chunk, calling `job.layer_loaded(i)` in
      layer order, or raises `ChunkMissing` / `ChunkCorrupt` / `TransportError`
      with `chunk` set to the first chunk that did not arrive intact.
    - All methods are cancellable; a cancelled save leaves nothing visible.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type[msgspec.Struct]] = NoOptions
    capabilities: ClassVar[Capabilities] = Capabilities()
    address: str = ""
    """Peer transports: where consumers reach this worker, set by `open()` (advertised to
    the scheduler in vLLM's handshake, then to consumers in `PeerSource.addresses`)."""

    def __init__(self, options: Any, context: TransportContext) -> None:
        self.options = options
        self.context = context

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Acquire resources; raise `TransportError` with a clear message on bad options."""

    async def register(self, layout: KVLayout) -> None:
        """Workers: vLLM's KV memory is allocated. Override to register it (NIXL, CUDA IPC)."""
        self.context.layout = layout

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Called once, also after cancelled transfers."""

    @classmethod  # noqa: B027 - optional hook
    def doctor(cls, options: Any, findings: Findings) -> None:
        """`kvflow doctor`: check what this transport needs, given its parsed `options`, and
        say what was found: `findings.ok(check, found)`, `.warn(check, found, fix)`, or
        `.fail(check, found, fix)` where the engine would not start. Blocking and quick
        (a short timeout on anything remote); nothing left behind. Default: nothing."""

    async def serve(self) -> None:
        """Peer transports: answer peers until cancelled (the worker runs it as a task)."""
        await trio.sleep_forever()

    async def offer(self, offer: Offer) -> str:
        """Peer transports: serve `offer` to one consumer; return once it is done with the
        blocks ("done" or the consumer's failure reason). When cancelled (the hold
        deadline), return only after no pull of the blocks is in flight."""
        raise NotImplementedError(f"transport {self.name!r} is not a peer transport")

    async def renew(
        self, address: str, reqs: Sequence[str], lease_s: float, release: Sequence[str] = ()
    ) -> Renewed:
        """Peer transports, on a consumer's scheduler: ask the producer worker at
        `address` to hold `reqs` (its offer ids) `lease_s` longer, and to hand back at once
        the blocks of `release` (offers this consumer will never pull; see `kvflow.pd.offers`).
        Returns the producer's answer: why, for each request it offered and no longer
        holds (`refused`), and the requests it has not offered yet (`pending`: the
        caller asks again). The caller bounds the wait: a producer that is gone never
        answers. The default claims nothing: the producer then holds a request until its
        hold timeout."""
        return Renewed({})

    async def touch(self, keys: Sequence[ChunkKey]) -> None:  # noqa: B027 - optional hook
        """A tier above this store served `keys` (this worker's chunks): count them as
        used now, as a load of them would, so that a store evicting what was used least
        recently keeps what is hot above it (decision 92). Best effort; the default does
        nothing (a store that keeps no recency)."""

    @abstractmethod
    async def lookup(self, keys: Sequence[ChunkKey]) -> int: ...

    @abstractmethod
    async def save(self, job: SaveJob) -> None: ...

    @abstractmethod
    async def load(self, job: LoadJob) -> None: ...


def available_transports() -> dict[str, importlib.metadata.EntryPoint]:
    """Installed transports by name."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def load_transport(name: str) -> type[Transport]:
    """Import the transport registered as `name`."""
    eps = available_transports()
    if name not in eps:
        raise TransportNotFound(
            f"no kvflow transport named {name!r}; installed: {', '.join(sorted(eps)) or 'none'}"
        )
    try:
        cls = eps[name].load()
    except Exception as exc:  # ImportError, or what its import raised (a CUDA library's OSError)
        d = eps[name].dist
        dist = d.name if d is not None else "its package"
        raise TransportNotFound(
            f"kvflow transport {name!r} is installed but cannot be imported "
            f"({type(exc).__name__}: {exc}); reinstall {dist} with its dependencies"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TransportNotFound(f"entry point {name!r} does not name a kvflow Transport subclass")
    return cls


@contextlib.contextmanager
def one_error() -> Iterator[None]:
    """A nursery's failure as one exception, not a group of its tasks': the first
    `TransportError` by chunk where its tasks raised only those and cancellations, or
    one `trio.Cancelled` where they were all cancelled (what a transfer must raise)."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        errors = [e for e in leaves if isinstance(e, TransportError)]
        if not all(isinstance(e, TransportError | trio.Cancelled) for e in leaves):
            raise
        raise (min(errors, key=lambda e: e.chunk) if errors else leaves[0]) from None


def _leaves(group: BaseExceptionGroup[Any]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


W = TypeVar("W", bound="Transport")


def wrapper_class(
    base: type[W], inner: type[Transport], capabilities: Capabilities | None = None
) -> type[W]:
    """A subclass of `base` (a transport wrapping others: the host tier, a stack, a
    replica's store) named and optioned as `inner`, and capable as it (or as given)."""
    caps = inner.capabilities if capabilities is None else capabilities
    attrs = {"name": inner.name, "Options": inner.Options, "capabilities": caps}
    return type(f"{base.__name__}_{inner.__name__}", (base,), attrs)


# What 0.4 moved to kvflow.pd, by name (imported on use, until 0.5): the contract itself
# imports nothing of P/D.
__getattr__ = old_names(__name__, {"PeerRead": "kvflow.pd.context:PeerRead"})
