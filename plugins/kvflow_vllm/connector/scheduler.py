"""The scheduler's side of kvflow's connector: a `SchedulerEngine` per KV cache group
kvflow moves, fed vLLM's scheduler calls (lookups, allocations, each step's plan,
finished requests, the workers' reports), vLLM's KV events for what kvflow stored, and
the hidden-state exports to plan."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from kvflow.config import KVFlowConfig
from kvflow.engine.lending import lent_at_finish
from kvflow.engine.metadata import WorkerPlan
from kvflow.engine.scheduler import ScheduledRequest, SchedulerEngine
from kvflow.pd.params import (
    PdParams,
    PdParamsError,
    join_groups,
    parse_pd_params,
    parse_stream,
    stream_offer,
)
from kvflow.shapes.reblock import other_block_sizes

from ..extract_hidden_states import HiddenStatesPlanner, extracts_hidden_states
from ..kv_events import KVEventTracker, KVFlowWorkerMeta, media
from .cache_spec import model_shape, request_salt, stores_token_major
from .context import ConnectorContext, Placement, Role
from .metadata import KVFlowHandshake, KVFlowMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVFlowScheduler"]

log = logging.getLogger("kvflow.vllm")

_NULL_BLOCK = 0
"""vLLM's null block (the first its pool hands out): what a sliding window's block table
holds before the window."""


def _timeline_marks(scheds: list[SchedulerEngine], vllm_config: VllmConfig) -> None:
    """One engine (the first group's) marks each request's timeline; under vLLM's async
    scheduling a step's tokens are in two plans later, not one."""
    lag = 2 if getattr(vllm_config.scheduler_config, "async_scheduling", False) else 1
    for n, sched in enumerate(scheds):
        sched.first_token_lag = lag
        sched.marks_requests = n == 0


class KVFlowScheduler:
    """The scheduler's connector calls, on kvflow's scheduler engines."""

    role: ClassVar[Role] = "scheduler"

    @staticmethod
    def placement(config: KVFlowConfig) -> Placement:
        """Tensor and pipeline parallel ranks, the cores for kvflow's threads (None: any)
        and the runtime's name."""
        return 0, 0, None, "scheduler"

    def __init__(
        self, context: ConnectorContext, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        self.context = context
        """What this side shares with its connector (built once, frozen)."""
        self.config = context.config
        self.groups = context.groups
        self._hash_block = context.hash_block
        """Tokens of each of vLLM's `request.block_hashes` (a divisor of the block size)."""
        caps = context.transport_cls.capabilities
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None  # vLLM's connector base refuses to start without one
        kv_role = ktc.kv_role or "kv_both"
        consumes = kv_role in ("kv_both", "kv_consumer")
        pc = vllm_config.parallel_config
        produces = kv_role in ("kv_both", "kv_producer")
        self.scheds = [
            SchedulerEngine(
                config=self.config,
                transport=transport,
                runtime=context.runtime,
                bus=context.bus,
                namespace=namespace,
                block_size=context.block_size,
                can_load=consumes and caps.store,
                can_save=produces and caps.store,
                can_pull=consumes and caps.peer,
                can_offer=produces and caps.peer,
                engine_id=context.engine_id,
                tp_size=pc.tensor_parallel_size,
                pp_size=pc.pipeline_parallel_size,
                shape=model_shape(vllm_config, kv_cache_config, group),
                null_block=_NULL_BLOCK if len(self.groups) > 1 else None,
                pd_scope=scope,
                store_block_sizes=other_block_sizes(context.block_size)
                if stores_token_major(kv_cache_config)
                else (),
            )
            for transport, namespace, scope, group in zip(
                context.transports, context.namespaces, context.scopes, self.groups, strict=True
            )
        ]
        """The scheduler engines, one per KV cache group kvflow moves."""
        _timeline_marks(self.scheds, vllm_config)
        kv_cache_groups = kv_cache_config.kv_cache_groups
        self._sliding = len(self.groups) > 1 and any(
            getattr(kv_cache_groups[g].kv_cache_spec, "sliding_window", None) for g in self.groups
        )
        self._trackers = (
            [
                KVEventTracker(
                    media=media(self.config),
                    block_size=context.block_size,
                    workers=len(transport.context.shards),  # the store's: replicas save none
                    group=g,
                )
                for g, transport in zip(self.groups, context.transports, strict=True)
            ]
            if context.events
            else []
        )
        """vLLM's KV events for what kvflow stored and its store evicted."""
        self._requests: dict[str, Request] = {}
        """Running requests, while their saves are planned (with KV events only)."""
        self._planner = (
            HiddenStatesPlanner(
                vllm_config, kv_cache_config, self.config.transport, context.store_key
            )
            if extracts_hidden_states(vllm_config)
            else None
        )
        """Under extract_hidden_states: the requests whose hidden states to store."""
        self._loading: set[str] = set()
        """Under extract_hidden_states: requests whose asynchronous load has not landed
        (their hidden states are not in their blocks yet)."""
        self._offered: dict[str, int] = {}
        """P/D producer: the requests whose blocks offers hold, and how many (every group)."""
        self._max_offered = int(self.config.max_offer_fraction * kv_cache_config.num_blocks)
        """The most blocks offers may hold at once (`max_offer_fraction` of the KV cache):
        any client may ask for a prefill and never decode it."""

    @property
    def sched(self) -> SchedulerEngine:
        return self.scheds[0]

    def on_new_request(self, request: Request) -> None:
        if self.sched.knows(request.request_id):
            return
        pds: list[PdParams | None] = [None] * len(self.scheds)
        stream, offer_as = None, ""
        raw = request.kv_transfer_params
        try:
            if len(self.scheds) == 1:  # streamed P/D: one KV cache group (decision 93)
                stream = parse_stream(raw)
                offer_as = self._stream_offer(request) or ""
            if (parsed := parse_pd_params(raw)) is not None:
                if len(parsed) != len(self.scheds):
                    raise PdParamsError(
                        f"the producer sent {len(parsed)} KV cache group(s), this engine has "
                        f"{len(self.scheds)}: start both with the same model and "
                        "--disable-hybrid-kv-cache-manager setting"
                    )
                pds = list(parsed)
        except PdParamsError as exc:  # computed locally instead: slower, never wrong
            rid = request.request_id[:100]
            self.sched.reject("malformed", f"request {rid}: {exc}; computing its prompt here")
        refused = bool(getattr(request, "abort_immediately", False))  # vLLM >= 0.32
        for sched, pd in zip(self.scheds, pds, strict=True):
            sched.add_request(
                request.request_id,
                request.prompt_token_ids or [],
                request_salt(request),
                pd,
                refused=refused,
                stream=stream,
                offer_as=offer_as,
            )

    def _stream_offer(self, request: Request) -> str | None:
        """The id a prefill request asks its blocks to be offered under as they are
        computed; None if it asks none, or offers hold all the blocks they may (it is
        then offered at its end, if there is room: `max_offer_fraction`)."""
        offer = stream_offer(request.kv_transfer_params)
        if offer is not None and sum(self._offered.values()) >= self._max_offered:
            return None
        return offer

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.on_new_request(request)  # no-op when already known
        req = request.request_id
        if self._trackers:
            self._requests[req] = request
        answers = [sched.lookup(req, num_computed_tokens) for sched in self.scheds]
        if any(n is None for n in answers):
            return None, False
        n = min(n for n in answers if n is not None)  # what every group can supply
        if len(answers) > 1:
            for sched in self.scheds:
                sched.limit_hit(req, num_computed_tokens + n)
        remote = self.sched.is_remote(req)
        asynchronous = n > 0 and (remote or self.config.load_mode == "async")
        if asynchronous and self._planner is not None:
            self._loading.add(req)
        return n, asynchronous

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = blocks.get_block_ids()
        for g, sched in zip(self.groups, self.scheds, strict=True):
            sched.allocated(request.request_id, block_ids[g], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        so = scheduler_output
        cached = so.scheduled_cached_reqs
        reused: list[int] = []
        if self._sliding:  # blocks a sliding window gave back may be handed out again now
            reused = [b for r in so.scheduled_new_reqs for ids in r.block_ids for b in ids]
            reused += [b for new in cached.new_block_ids if new for ids in new for b in ids]
        plans: list[WorkerPlan] = []
        for n, (g, sched) in enumerate(zip(self.groups, self.scheds, strict=True)):
            scheduled = [
                ScheduledRequest(
                    req=r.req_id,
                    num_computed=r.num_computed_tokens,
                    num_scheduled=so.num_scheduled_tokens.get(r.req_id, 0),
                    new_block_ids=list(r.block_ids[g]),
                    replace_blocks=True,
                    token_ids=r.prompt_token_ids,
                )
                for r in so.scheduled_new_reqs
            ]
            for i, req in enumerate(cached.req_ids):
                new_blocks = cached.new_block_ids[i]
                scheduled.append(
                    ScheduledRequest(
                        req=req,
                        num_computed=cached.num_computed_tokens[i],
                        num_scheduled=so.num_scheduled_tokens.get(req, 0),
                        new_block_ids=list(new_blocks[g]) if new_blocks else [],
                        replace_blocks=req in cached.resumed_req_ids,
                    )
                )
            plan = sched.plan(scheduled, preempted=so.preempted_req_ids or ())
            if self._trackers:
                self._saves_planned(self._trackers[n], sched, plan)
            if reused:
                plan = msgspec.structs.replace(plan, reused=reused)
            plans.append(plan)
        return KVFlowMetadata(plans, self._planner.take() if self._planner else None)

    def _saves_planned(
        self, tracker: KVEventTracker, sched: SchedulerEngine, plan: WorkerPlan
    ) -> None:
        for spec in plan.saves:
            if (request := self._requests.get(spec.req)) is not None:
                chunks = sched.chunk_keys(spec.req)
                tracker.planned(request, spec.keys, spec.token_counts, chunks, self._hash_block)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        remote_decode = bool((request.kv_transfer_params or {}).get("do_remote_decode"))
        blocks = sum(len(ids) for ids in block_ids)
        if remote_decode and sum(self._offered.values()) + blocks > self._max_offered:
            remote_decode = False  # its blocks go back now; its decode computes the prompt
            self.sched.reject(
                "offers",
                f"offers hold {sum(self._offered.values())} of this engine's "
                f"{self._max_offered} blocks they may (max_offer_fraction): request "
                f"{request.request_id[:100]!r} gets no P/D params",
            )
        lend, params = False, []
        for i, sched in enumerate(self.scheds):
            ids = block_ids[self.groups[i]] if len(block_ids) > 1 else block_ids[0]
            lent, p = sched.finished(request.request_id, ids, remote_decode=remote_decode)
            lend = lend or lent
            if p is not None:
                params.append(p)
        if not lend:  # no save of it is in flight
            for tracker in self._trackers:
                tracker.forget(request.request_id)
        if params and len(params) != len(self.scheds):  # some group has nothing to offer
            log.error(
                "kvflow: request %s: not every KV cache group offered its blocks; "
                "the consumer computes its prompt",
                request.request_id,
            )
            params = []
        out = join_groups(params) if params else {}
        if out:
            self._offered[request.request_id] = blocks
        # its blocks stay lent until the rows are copied out; not a request whose load is
        # still landing (aborted meanwhile): its rows are not there, its blocks not free
        if not any(block_ids):  # never allocated: no load of it will land
            self._loading.discard(request.request_id)
        if self._planner is not None and request.request_id not in self._loading:
            ids = block_ids[self._planner.group] if len(block_ids) > 1 else block_ids[0]
            if ref := self._planner.finished(request, ids, request_salt(request)):
                lend = lent_at_finish(saving=lend, exporting=True)
                out = {**out, **ref.to_params()}
        return lend, out or None

    def set_handshakes(self, ordered: list[KVConnectorHandshakeMetadata]) -> None:
        """The workers' handshakes in shard order (stage by stage, rank by rank): each
        one's endpoint per KV cache group becomes that group's peer address."""
        shards = [m for m in ordered if isinstance(m, KVFlowHandshake)]
        for g, sched in enumerate(self.scheds):
            sched.peer_addresses = [m.addresses[g] for m in shards]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._loading -= connector_output.finished_recving or set()
        self._loading -= connector_output.failed_recving or set()
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVFlowWorkerMeta):
            for tracker, report in zip(self._trackers, meta.reports, strict=False):
                tracker.report(report)
        for req in connector_output.finished_sending or ():
            self._offered.pop(req, None)  # pulled, released or expired: the blocks are back
            for tracker in self._trackers:  # every worker reported its saves before these
                tracker.forget(req)
        self.sched.loads_reported(
            connector_output.finished_recving or (), connector_output.failed_recving or ()
        )
        for sched in self.scheds:
            if connector_output.failed_recving:
                sched.loads_failed(connector_output.failed_recving)
            if connector_output.invalid_block_ids:
                sched.blocks_invalid(connector_output.invalid_block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return [event for tracker in self._trackers for event in tracker.take()]
