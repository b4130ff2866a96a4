"""Scheduler-side state machine: lookups, load plans, save plans, lent blocks.

Called from vLLM's scheduler thread through the connector adapter, in kvflow
types only. Lookups never block that thread: the first call starts a lookup
task on the runtime and answers `None` ("ask again"); a later call returns
the answer the task left behind.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import trio

from ..config import KVFlowConfig
from ..geometry.topology import readers
from ..keys import ChunkKey, chunk_keys, chunk_token_counts
from ..observe.events import (
    BlocksAllocated,
    EventBus,
    FirstToken,
    LoadReported,
    LookupAnswered,
    LookupRequested,
    OfferStreamed,
    Rejected,
    RequestArrived,
    RequestFinished,
    RequestScheduled,
    StepPlanned,
    TaskFailed,
)
from ..pd.claims import Claim, Claims
from ..pd.context import channel_of_transport
from ..pd.params import (
    PD_VERSION,
    UNSET_SHAPE,
    ModelShape,
    PdParams,
    StreamRef,
    check_pd_params,
    consumer_params,
    encode_streamed,
    pull_refusal,
)
from ..pd.security import Rejections, prompt_digest
from ..runtime import GAVE_UP_THEN, KVFlowFatal, Runtime, given_up
from ..shapes.reblock import StoredRun, load_window, lookup_blocks
from ..shapes.reshape import lookup_sources, other_shapes
from ..transport import PeerSource, Transport
from ..zmqio import shown
from .lending import lent_at_finish
from .metadata import LoadSpec, OfferSpec, SaveSpec, WorkerPlan

__all__ = ["ScheduledRequest", "SchedulerEngine"]

log = logging.getLogger("kvflow.scheduler")


@dataclass
class ScheduledRequest:
    """One request in a scheduler step, in kvflow terms."""

    req: str
    num_computed: int
    """Tokens already computed (or loaded) before this step."""
    num_scheduled: int
    new_block_ids: list[int]
    replace_blocks: bool = False
    """True for new and resumed requests: `new_block_ids` is the whole block list."""
    token_ids: Sequence[int] | None = None
    """Prompt token ids, for a request kvflow has not seen yet."""


@dataclass
class _Request:
    keys: list[ChunkKey]
    counts: list[int]
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    lookup_started: bool = False
    hit_chunks: int | None = None
    """Leading chunks the store holds; written by the lookup task."""
    sources: list[int] = field(default_factory=list)
    """Per hit chunk, the tensor-parallel size whose shards hold it (0: this engine's)."""
    reblock: StoredRun | None = None
    """The chunks of another block size holding every hit chunk (`kvflow.shapes.reblock`)."""
    own_hits: int = 0
    """With `reblock`: the leading chunks the store holds as this engine keys them."""
    stored_upto: int = 0
    """Chunks known to be in the store already; never saved again."""
    saved_upto: int = 0
    load_planned: bool = False
    pulled: bool = False
    """A pull of the producer's blocks was sent to the workers (P/D): it ends the
    producer's hold (else the request's end releases it)."""
    saves_issued: bool = False
    scheduled: bool = False
    """P/D: vLLM scheduled it to compute (after its pull); `RequestScheduled` was said."""
    pd: PdParams | None = None
    """Set when a producer prefilled this request: pull its prompt KV from there."""
    claim: Claim | None = None
    """The claim on the producer's blocks (with `pd`)."""
    tokens: Sequence[int] = ()
    """P/D producers: the prompt, whose digest its offer's params carry."""
    salt: str = ""
    stream: StreamRef | None = None
    """P/D consumer, streamed: the claim is out, the producer's params not in yet."""
    stream_offer: str = ""
    """P/D producer, streamed: the offer id to offer the blocks under as the prompt's
    last tokens are scheduled ("": not streamed)."""
    offered: dict[str, object] | None = None
    """P/D producer, streamed: the params of the offer made (returned at its finish; {}
    once a preemption withdrew it)."""

    def hit_tokens(self) -> int:
        return sum(self.counts[: self.hit_chunks or 0])


class SchedulerEngine:
    """Owns per-request connector state in the scheduler process."""

    first_token_lag = 1
    """Steps after its own that a step's sampled tokens are in: 1, or 2 under vLLM's
    async scheduling (it plans the next step before the last one's output is in)."""
    marks_requests = True
    """Emit the request-level events (`RequestArrived`, `RequestScheduled`, `FirstToken`,
    `LoadReported`): one engine of a request (its first KV cache group's) says them."""

    def __init__(
        self,
        *,
        config: KVFlowConfig,
        transport: Transport,
        runtime: Runtime,
        bus: EventBus,
        namespace: str,
        block_size: int,
        can_load: bool = True,
        can_save: bool = True,
        can_pull: bool = False,
        can_offer: bool = False,
        engine_id: str = "",
        tp_size: int = 1,
        pp_size: int = 1,
        shape: ModelShape | None = None,
        null_block: int | None = None,
        pd_scope: str | None = None,
        store_block_sizes: Sequence[int] = (),
    ) -> None:
        self.config = config
        self.transport = transport
        self.runtime = runtime
        self.bus = bus
        self.namespace = namespace
        self.pd_scope = namespace if pd_scope is None else pd_scope
        """What this engine's P/D params are bound to besides the prompt
        (`Fingerprint.pd_scope`; the namespace if not given)."""
        self.block_size = block_size
        self.can_load = can_load
        self.can_save = can_save
        self.can_pull = can_pull
        self.can_offer = can_offer
        self.engine_id = engine_id
        self.tp_size, self.pp_size = tp_size, pp_size
        """This engine's tensor and pipeline parallel sizes (a worker shard per rank)."""
        self.shape = shape or UNSET_SHAPE
        """This engine's model and KV cache, as P/D params carry it (`ModelShape`)."""
        reshapes = transport.capabilities.store and transport.capabilities.reshape
        self._store_shapes = other_shapes(self.shape.kv_heads, tp_size, pp_size) if reshapes else []
        """The other tensor-parallel sizes whose chunks a lookup looks for
        (`kvflow.shapes.reshape`)."""
        self._store_blocks = list(store_block_sizes) if reshapes else []
        """The other block sizes whose chunks a lookup looks for (`kvflow.shapes.reblock`)."""
        self.peer_addresses: list[str] = []
        """This engine's worker endpoints by shard, learned from the workers' handshake."""
        self.null_block = null_block
        """The id vLLM puts where a group holds no block (a sliding window's blocks before
        its window): never loaded into nor saved from."""
        self._offers: list[OfferSpec] = []
        self._reqs: dict[str, _Request] = {}
        self._pending_loads: list[LoadSpec] = []
        self._lent: list[str] = []
        self._preempted: list[str] = []
        self._step = 0
        self._computing: dict[str, int] = {}
        """P/D requests scheduled after their pull, by the step: their first token is due."""
        self._fatal = ""
        """Why the engine must stop (a long-lived task that cannot be restarted)."""
        self.reject = Rejections(
            "P/D params",
            lambda reason, detail: runtime.submit(bus.emit, Rejected(reason=reason, detail=detail)),
        )
        """Count and log P/D params refused (`kvflow.pd.security.REJECT_REASONS`)."""
        self._claims = (  # for peer transports that hold on a lease
            Claims(
                transport,
                runtime,
                bus,
                lease_s=config.lease_s,
                timeout_s=config.lookup_timeout_s,
                answer_s=config.progress_timeout_s,
                stream_timeout_s=config.hold_timeout_s,
                gave_up=self._task_gave_up,
            )
            if type(transport).renew is not Transport.renew
            else None
        )

    def _task_gave_up(self, task: str, error: str) -> None:
        """The loop thread: `task` failed for good; vLLM's thread stops at its next step."""
        self.bus.emit(TaskFailed(task=task, error=error, given_up=True))
        self._fatal = f"kvflow: {given_up(task, error)}. {GAVE_UP_THEN}"

    # -- vLLM thread -------------------------------------------------------
    def add_request(
        self,
        req: str,
        token_ids: Sequence[int],
        salt: str = "",
        pd: PdParams | None = None,
        refused: bool = False,
        stream: StreamRef | None = None,
        offer_as: str = "",
    ) -> None:
        """Key a new request's prompt (once; keys are reused by lookups and saves).

        `stream`: a consumer's streamed request (its producer's params come with the
        answer to its claim); `offer_as`: a producer's streamed request, offered under
        this id in the step that schedules its prompt's last tokens (decision 93).

        `refused`: not a request but vLLM's notice that its serving layer refused one
        before it reached the engine (`notify_kv_transfer_request_rejected`: a stand-in
        prompt, aborted at once). Nothing is keyed or pulled; the producer of its params,
        if they are this deployment's, gets the offer back now instead of at its hold
        timeout."""
        if refused:
            self._give_back(req, pd)
            return
        if req in self._reqs:
            return
        arrived = time.monotonic()  # the event's time: before its claim goes out
        pd = self._believed(req, pd, token_ids, salt) if pd is not None and self.can_pull else None
        stream = self._streamable(req, stream) if pd is None else None
        if stream is not None and self._claims:
            st = self._reqs[req] = _Request(
                keys=[],
                counts=[],
                prompt_len=len(token_ids),
                stream=stream,
                claim=self._claims.add(req, stream.offer, 0, stream.addresses, streamed=True),
                tokens=token_ids,
                salt=salt,
            )
        elif pd is not None and self.can_pull:
            n = min(pd.num_tokens, len(token_ids), len(pd.block_ids) * pd.block_size)
            counts = chunk_token_counts(n, self.block_size)
            claims = self._claims
            read, unread = self._read_addresses(pd)
            if claims and unread:  # replicas no rank of ours reads: let them go now
                claims.release(pd.offer, unread)
            st = self._reqs[req] = _Request(
                keys=[""] * len(counts),
                counts=counts,
                prompt_len=len(token_ids),
                hit_chunks=len(counts),
                pd=pd,
                claim=claims.add(req, pd.offer, sum(counts), read) if claims else None,
            )
        else:
            keys = chunk_keys(
                self.namespace,
                token_ids,
                self.block_size,
                salt=salt,
                include_partial=self.config.save_partial_blocks,
                store_key=self.transport.context.store_key,
            )
            counts = chunk_token_counts(len(token_ids), self.block_size)[: len(keys)]
            st = self._reqs[req] = _Request(keys=keys, counts=counts, prompt_len=len(token_ids))
            if self._store_blocks:  # other block sizes' keys: before the lookup reads them
                st.tokens, st.salt = token_ids, salt
            self._start_lookup(req, st)  # overlap the lookup with the wait in the queue
        if self.can_offer:  # a request pulled here may be offered on too (its digest)
            st.tokens, st.salt = token_ids, salt
            st.stream_offer = offer_as
        if self.marks_requests:
            offer = pd.offer if pd is not None else stream.offer if stream is not None else ""
            self.runtime.submit(
                self.bus.emit,
                RequestArrived(req=req, tokens=len(token_ids), offer=offer, ts=arrived),
            )

    def _believed(
        self, req: str, pd: PdParams, token_ids: Sequence[int], salt: str
    ) -> PdParams | None:
        """`pd` if this consumer may pull it for `req`'s prompt, else None (said why)."""
        reason, why = check_pd_params(
            pd, channel_of_transport(self.transport), token_ids, salt, self.pd_scope
        )
        # params this deployment signed say truly what differs (another model's
        # params also fail the prompt's digest: name the field instead)
        refusal = self._refuse_pull(pd) if reason in ("", "prompt") else ""
        if refusal:
            log.error("kvflow: request %s: %s: computing its prompt here", shown(req, 100), refusal)
            if self._claims:  # signed for this consumer: its producer hands them back
                self._claims.release(pd.offer, pd.addresses)
            return None
        if reason:
            self.reject(reason, f"request {req[:100]}: {why}; computing its prompt here")
            return None
        return pd

    def _streamable(self, req: str, stream: StreamRef | None) -> StreamRef | None:
        """`stream` if this consumer may claim it (addresses it may dial), else None."""
        if stream is None or not self.can_pull or not self._claims:
            return None
        channel = channel_of_transport(self.transport)
        for address in stream.addresses:
            if why := channel.address_problem(address):
                where = f"producer address {address[:100]!r}: {why}"
                self.reject("address", f"request {req[:100]}: {where}; computing its prompt here")
                return None
        return stream

    def _give_back(self, req: str, pd: PdParams | None) -> None:
        """vLLM refused `req` before its engine: its producer may let the offer go."""
        if pd is None or self._claims is None or not self.can_pull:
            return
        if reason := check_pd_params(pd, channel_of_transport(self.transport), None, "")[0]:
            self.reject(reason, f"request {req[:100]} (refused by vLLM): its params")
        else:
            self._claims.release(pd.offer, pd.addresses)

    def knows(self, req: str) -> bool:
        """Whether `req` was added (and has not finished)."""
        return req in self._reqs

    def chunk_keys(self, req: str) -> list[ChunkKey]:
        """The keys of a known request's prompt chunks ([] for one not known)."""
        st = self._reqs.get(req)
        return st.keys if st is not None else []

    def _start_lookup(self, req: str, st: _Request) -> None:
        if self.can_load and st.prompt_len >= 2 and not st.lookup_started:
            st.lookup_started = True
            self.runtime.spawn(self._lookup_task, req, st, name=f"lookup:{req}")

    def is_remote(self, req: str) -> bool:
        """Whether `req`'s prompt KV comes from a P/D producer (streamed: may come, until
        its claim is answered)."""
        st = self._reqs.get(req)
        return st is not None and (st.pd is not None or st.stream is not None)

    def lookup(self, req: str, num_computed: int) -> int | None:
        """Tokens beyond `num_computed` the store can supply; None while the answer is pending."""
        st = self._reqs.get(req)
        if st is not None and (st.pd is not None or st.stream is not None):
            claim = st.claim  # loaded asynchronously; vLLM recomputes the last token itself
            if claim is not None and not claim.answered:
                if self.runtime.running:
                    return None  # the producer has not answered the claim yet
                claim.error = "the scheduler's loop is gone"
            if st.stream is not None:  # its producer's params came with that answer
                self._streamed(req, st)
            if st.pd is not None:
                return max(0, st.hit_tokens() - num_computed)
        if st is None or not self.can_load or st.prompt_len < 2 or not st.keys:
            return 0
        if st.hit_chunks is None:
            if not self.runtime.running:  # the loop died: no answer will ever come
                log.error("kvflow: the scheduler's loop is gone; %s is a miss", req)
                st.hit_chunks = 0
                return 0
            self._start_lookup(req, st)
            return None
        # vLLM must compute at least one token itself to produce logits.
        usable = min(st.hit_tokens(), st.prompt_len - 1)
        return max(0, usable - num_computed)

    def _streamed(self, req: str, st: _Request) -> None:
        """A streamed request's claim was answered: pull with the producer's params it
        carried, checked as if they had come with the request, or compute it here."""
        ref, claim, st.stream = st.stream, st.claim, None
        assert ref is not None and claim is not None and self._claims is not None
        pd = None if claim.error else claim.params  # refused or gone: its claim said why
        if pd is None and not claim.error:
            log.error(
                "kvflow: request %s: producer %s held %s without its params: computing its "
                "prompt here", shown(req, 100), ref.addresses[0][:100], ref.offer,
            )  # fmt: skip
        elif pd is not None and sorted(pd.addresses) != sorted(ref.addresses):
            why = "its producer's params name other workers than it was claimed at"
            self.reject("address", f"request {req[:100]}: {why}; computing its prompt here")
            pd = None
        elif pd is not None:
            pd = self._believed(req, pd, st.tokens, st.salt)
        if pd is None:
            if not claim.error:  # held for this consumer, which will not pull it
                self._claims.release(ref.offer, ref.addresses)
            self._claims.drop(req)
            st.claim, st.hit_chunks = None, 0
            return
        n = min(pd.num_tokens, len(st.tokens), len(pd.block_ids) * pd.block_size)
        st.counts = chunk_token_counts(n, self.block_size)
        st.keys, st.hit_chunks, st.pd = [""] * len(st.counts), len(st.counts), pd

    def limit_hit(self, req: str, num_tokens: int) -> None:
        """Load no more than the chunks covering the first `num_tokens` (the hit another
        KV cache group of the same request can supply)."""
        st = self._reqs.get(req)
        if st is not None and st.hit_chunks is not None:
            st.hit_chunks = min(st.hit_chunks, -(-num_tokens // self.block_size))

    def allocated(self, req: str, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM allocated blocks; plan the load of `num_external` tokens into them."""
        st = self._reqs.get(req)
        if st is None:
            return
        st.block_ids = list(block_ids)
        # chunks the store holds for another tensor-parallel size or block size are saved
        # again as this engine keys them (then they load without conversion; decisions 56
        # and 58): only the leading chunks held as its own count as stored
        if st.reblock is not None:
            own = st.own_hits
        else:
            own = next((i for i, size in enumerate(st.sources) if size), st.hit_chunks or 0)
        st.stored_upto = max(st.stored_upto, own)
        if num_external <= 0 or st.load_planned:
            return
        st.load_planned = True
        end_tok = st.hit_tokens() if st.pd else min(st.hit_tokens(), st.prompt_len - 1)
        first = (end_tok - num_external) // self.block_size
        last = -(-end_tok // self.block_size)
        chunks = self._real_blocks(st, first, last)
        source, error = None, st.claim.error if st.claim is not None else ""
        if st.pd is not None:
            pd = st.pd
            source = peer_source(pd, self.block_size, chunks, [st.counts[i] for i in chunks])
            if source.block_size and chunks and chunks != list(range(chunks[0], chunks[-1] + 1)):
                error = error or (  # a sliding window's null blocks
                    f"producer {pd.engine_id} has blocks of {pd.block_size} tokens, this "
                    f"consumer {self.block_size}: a window with gaps is not pulled across them"
                )
            if any(b == self.null_block for b in source.block_ids):
                error = error or (  # the same window on both sides: not expected
                    f"producer {pd.engine_id} no longer holds blocks this consumer needs "
                    "(its sliding window moved on)"
                )
            st.pulled = st.pulled or not error  # a load failed here never reached it
        stored, why = load_window(st.reblock, st.counts, chunks)
        spec = LoadSpec(
            req=req,
            keys=[st.keys[i] for i in chunks],
            block_ids=[st.block_ids[i] for i in chunks],
            token_counts=[st.counts[i] for i in chunks],
            asynchronous=self.config.load_mode == "async" or source is not None,
            source=source,
            error=error or why,
            tp_sizes=[st.sources[i] if i < len(st.sources) else 0 for i in chunks]
            if any(st.sources) and stored is None
            else [],
            stored=stored,
        )
        self._pending_loads.append(spec)
        self.runtime.submit(
            self.bus.emit,
            BlocksAllocated(req=req, num_blocks=last - first, external_tokens=num_external),
        )

    def plan(
        self,
        scheduled: Iterable[ScheduledRequest],
        preempted: Iterable[str] = (),
    ) -> WorkerPlan:
        """Build this step's WorkerPlan (resets the per-step lists); `KVFlowFatal` once a
        long-lived task cannot be restarted (vLLM's engine stops: its health check fails)."""
        if self._fatal:
            raise KVFlowFatal(self._fatal)
        self._step += 1
        for req, step in list(self._computing.items()):  # their step's output is in
            if self._step - step >= self.first_token_lag:
                self._first_token(req, self._computing.pop(req))
        saves: list[SaveSpec] = []
        # Preemptions first: vLLM may preempt and resume a request in one step
        # (reset_prefix_cache with running requests); its scheduled entry then carries
        # the whole new block table.
        for req in preempted:
            st = self._reqs.get(req)
            if st is not None:
                # vLLM freed its blocks and the workers stop its saves: a resumed request
                # is looked up, loaded and saved afresh, and lends nothing for old saves
                st.saved_upto = st.stored_upto
                st.load_planned = False
                st.saves_issued = False
                st.block_ids = []
                if st.offered:  # the workers withdraw the streamed offer made (its
                    st.offered = {}  # blocks are vLLM's again); it is not made again
                if st.pd is not None and st.pulled:
                    # its producer let the blocks go once pulled: resumed, the request is
                    # computed here (one pull per request, as vLLM's NixlConnector)
                    if st.claim is not None and self._claims:
                        self._claims.drop(req)
                    st.pd, st.claim, st.hit_chunks = None, None, 0
                self._preempted.append(req)
        loading = {b for ld in self._pending_loads if not ld.asynchronous for b in ld.block_ids}
        for s in scheduled:
            st = self._reqs.get(s.req)
            if st is None and s.token_ids is not None:
                self.add_request(s.req, s.token_ids)
                st = self._reqs[s.req]
            if st is None:
                continue
            if s.replace_blocks:
                st.block_ids = list(s.new_block_ids)
            else:
                st.block_ids.extend(s.new_block_ids)
            if (
                st.stream_offer
                and st.offered is None
                and s.num_scheduled
                and (s.num_computed + s.num_scheduled >= st.prompt_len)
            ):
                self._offer_streamed(s.req, st)
            if st.pd is not None and not st.scheduled and s.num_scheduled and self.marks_requests:
                st.scheduled = True  # computes after its pull (P/D loads are asynchronous)
                self._computing[s.req] = self._step
                self.runtime.submit(self.bus.emit, RequestScheduled(req=s.req, step=self._step))
            if self.can_save:
                spec = self._plan_save(s.req, st, s.num_computed + s.num_scheduled, loading)
                if spec is not None:
                    saves.append(spec)
        plan = WorkerPlan(
            step=self._step,
            loads=self._pending_loads,
            saves=saves,
            lent=self._lent,
            preempted=self._preempted,
            offers=self._offers,
        )
        self._pending_loads, self._lent, self._preempted, self._offers = [], [], [], []
        if not plan.is_empty():
            self.runtime.submit(
                self.bus.emit,
                StepPlanned(step=plan.step, loads=len(plan.loads), saves=len(plan.saves)),
            )
        return plan

    def finished(
        self, req: str, block_ids: Sequence[int] = (), remote_decode: bool = False
    ) -> tuple[bool, dict[str, object] | None]:
        """The request ended. True: vLLM lends its blocks until workers report them done.

        With `remote_decode` (a P/D producer's request) the blocks are offered to a
        consumer, and the returned params tell the proxy where to pull them from.
        """
        st = self._reqs.pop(req, None)
        if st is not None and st.claim is not None and self._claims:
            self._claims.drop(req)
            if not st.pulled:  # its producer holds the blocks for nobody: let them go
                self._claims.release(st.claim.req, st.claim.addresses)
        if st is not None and st.saves_issued and not block_ids:
            # vLLM took the blocks back before this finish (preempted outside schedule(),
            # as reset_prefix_cache(reset_running_requests=True) does, then aborted): it
            # lends nothing and may hand them out in the next step, so the workers stop
            # the request's saves before that step's forward, as at a preemption
            st.saves_issued = False
            self._preempted.append(req)
        params: dict[str, object] | None = None
        offered = ""
        if st is not None and st.offered is not None:  # streamed: offered as scheduled
            params = st.offered or None  # ({}: withdrawn at a preemption)
            offered = st.stream_offer if params else ""
        elif remote_decode and self.can_offer and st is not None and block_ids:
            counts = chunk_token_counts(st.prompt_len, self.block_size)[: len(block_ids)]
            offer = secrets.token_hex(16)  # consumers pull by it: a client cannot guess it
            pd = self._offer(st, block_ids, counts, offer)
            params = consumer_params(pd)
            self._offers.append(OfferSpec(req, pd.block_ids, counts, offer))
            offered = offer
        lend = st is not None and lent_at_finish(
            saving=st.saves_issued, offering=params is not None
        )
        if lend:
            self._lent.append(req)
        blocks = len(block_ids) if lend else 0
        self.runtime.submit(
            self.bus.emit, RequestFinished(req=req, lent=lend, blocks=blocks, offer=offered)
        )
        if req in self._computing:  # it ended in the step that computed its first token
            self._first_token(req, self._computing.pop(req))
        return lend, params

    def _offer(
        self, st: _Request, block_ids: Sequence[int], counts: list[int], offer: str
    ) -> PdParams:
        """The signed params of an offer of `st`'s first `len(counts)` blocks as `offer`."""
        pd = PdParams(
            version=PD_VERSION,
            engine_id=self.engine_id,
            addresses=self.peer_addresses,
            offer=offer,
            block_ids=list(block_ids[: len(counts)]),
            num_tokens=sum(counts),
            block_size=self.block_size,
            shape=self.shape,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            prompt=prompt_digest(st.tokens[: sum(counts)], st.salt, self.pd_scope),
        )
        return pd.signed(channel_of_transport(self.transport))

    def _offer_streamed(self, req: str, st: _Request) -> None:
        """Offer a streamed request's blocks now, in the step that computes its prompt's
        last tokens: the workers read each layer once that step's forward wrote it."""
        counts = chunk_token_counts(st.prompt_len, self.block_size)
        if len(st.block_ids) < len(counts):  # not expected: vLLM allocates the prompt's
            return  # blocks as it schedules its tokens
        pd = self._offer(st, st.block_ids, counts, st.stream_offer)
        self._offers.append(
            OfferSpec(req, pd.block_ids, counts, pd.offer, params=encode_streamed(pd))
        )
        st.offered = consumer_params(pd)
        streamed = OfferStreamed(req=req, offer=pd.offer, step=self._step, blocks=len(counts))
        self.runtime.submit(self.bus.emit, streamed)

    def _refuse_pull(self, pd: PdParams) -> str:
        """Why this consumer cannot load `pd`'s blocks ("" if it can)."""
        can = self.transport.capabilities
        return pull_refusal(
            pd, self.shape, self.tp_size, self.pp_size, self.block_size, can.hetero_tp,
            can.hetero_blocks,
        )  # fmt: skip

    def _read_addresses(self, pd: PdParams) -> tuple[list[str], list[str]]:
        """The producer endpoints some rank of this consumer pulls from, and the others
        (replicated heads no rank needs; every endpoint when the sizes are equal)."""
        if pd.tp_size == self.tp_size:
            return pd.addresses, []
        count = readers(pd.shape.kv_heads, pd.tp_size, self.tp_size) * pd.pp_size
        read = [a for a, n in zip(pd.addresses, count, strict=True) if n]
        return read, [a for a, n in zip(pd.addresses, count, strict=True) if not n]

    def loads_reported(self, done: Iterable[str], failed: Iterable[str]) -> None:
        """vLLM's scheduler heard that these requests' asynchronous loads ended (their
        `LoadReported` events; `loads_failed` does what a failure calls for)."""
        for req in done:
            self.runtime.submit(self.bus.emit, LoadReported(req=req))
        for req in failed:
            self.runtime.submit(self.bus.emit, LoadReported(req=req, ok=False))

    def _first_token(self, req: str, step: int) -> None:
        self.runtime.submit(self.bus.emit, FirstToken(req=req, step=step))

    def loads_failed(self, reqs: Iterable[str]) -> None:
        """Asynchronous loads of `reqs` failed: never offer the same hit again."""
        for req in reqs:
            st = self._reqs.get(req)
            if st is not None:
                st.hit_chunks = 0
                st.stored_upto = 0
                if st.claim is not None and self._claims:
                    self._claims.drop(req)  # the producer may not know (it hung, or our
                    self._claims.release(st.claim.req, st.claim.addresses)  # Failed was lost)

    def blocks_invalid(self, block_ids: Iterable[int]) -> None:
        """Loads into `block_ids` failed: vLLM recomputes every request's tokens from its
        first such block, and those chunks are saved again (the saves of the failed step
        stored nothing: the workers dropped them)."""
        bad = set(block_ids)
        for st in self._reqs.values():
            first = next((i for i, b in enumerate(st.block_ids) if b in bad), None)
            if first is not None:
                st.saved_upto = min(st.saved_upto, first)
                st.stored_upto = min(st.stored_upto, first)

    # -- internals ---------------------------------------------------------
    def _plan_save(
        self, req: str, st: _Request, computed_after: int, loading: set[int]
    ) -> SaveSpec | None:
        done = min(computed_after, st.prompt_len)
        ready = done // self.block_size
        if done == st.prompt_len and len(st.keys) > ready:
            ready = len(st.keys)  # the prompt is complete: its partial tail is final too
        start = max(st.saved_upto, st.stored_upto)
        if ready <= start or len(st.block_ids) < ready:
            return None
        st.saved_upto = ready
        chunks = self._real_blocks(st, start, ready)
        if not chunks:
            return None
        st.saves_issued = True
        return SaveSpec(
            req=req,
            keys=[st.keys[i] for i in chunks],
            block_ids=[st.block_ids[i] for i in chunks],
            token_counts=[st.counts[i] for i in chunks],
            computed_over=[b for b in st.block_ids[:start] if b in loading],
        )

    def _real_blocks(self, st: _Request, start: int, end: int) -> list[int]:
        """The chunks in [start, end) that have a block (not vLLM's null block)."""
        end = min(end, len(st.block_ids))
        return [i for i in range(start, end) if st.block_ids[i] != self.null_block]

    async def _lookup_task(self, req: str, st: _Request) -> None:
        self.bus.emit(LookupRequested(req=req, num_tokens=st.prompt_len, num_chunks=len(st.keys)))
        t0 = time.perf_counter()
        error = ""
        hits = 0
        with trio.move_on_after(self.config.lookup_timeout_s) as scope:
            try:
                if self._store_shapes:  # chunks saved at another tensor-parallel size too
                    st.sources = await lookup_sources(self.transport, st.keys, self._store_shapes)
                    hits = len(st.sources)
                else:
                    hits = await self.transport.lookup(st.keys)
                if self._store_blocks and hits < len(st.keys):  # saved at other block sizes
                    more, run = await lookup_blocks(
                        self.transport, self.namespace, st.tokens, st.salt,
                        self.config.save_partial_blocks, st.counts, self._store_blocks,
                    )  # fmt: skip
                    if more > hits:
                        own = next((i for i, size in enumerate(st.sources) if size), hits)
                        st.reblock, st.own_hits, hits = run, own, more
            except Exception as exc:  # a failed lookup is a miss, never a crash
                error = f"{type(exc).__name__}: {exc}"
                log.warning("kvflow lookup for %s failed: %s", req, error)
        if scope.cancelled_caught:
            error = f"no answer within lookup_timeout_s={self.config.lookup_timeout_s}"
        st.hit_chunks = max(0, min(hits, len(st.keys)))
        self.bus.emit(
            LookupAnswered(
                req=req,
                hit_tokens=st.hit_tokens(),
                elapsed_s=time.perf_counter() - t0,
                error=error,
            )
        )


def peer_source(pd: PdParams, block_size: int, chunks: list[int], counts: list[int]) -> PeerSource:
    """Where a consumer of blocks of `block_size` tokens pulls its `chunks` (of `counts`
    tokens) from: the producer's blocks of the same chunks, or, of another block size,
    those holding the same tokens (`chunks` consecutive: full attention)."""
    if pd.block_size == block_size or not chunks:
        ids, skip = [pd.block_ids[i] for i in chunks], 0
    else:
        start = chunks[0] * block_size
        first, end = start // pd.block_size, -(-(start + sum(counts)) // pd.block_size)
        ids, skip = pd.block_ids[first:end], start - first * pd.block_size
    return PeerSource(
        pd.engine_id,
        pd.addresses,
        pd.offer,
        ids,
        tp_size=pd.tp_size,
        kv_heads=pd.shape.kv_heads,
        block_size=0 if pd.block_size == block_size else pd.block_size,
        skip=skip,
    )
