"""vLLM's `extract_hidden_states` method, with kvflow storing the hidden states.

The method caches each token's hidden states (of the layers its speculative config
names) in a cache-only attention layer, `[blocks, layers, tokens, hidden]`. When a
request finishes, the scheduler keeps its blocks (vLLM lends them), names the
chunks (`kvflow.hidden_states`) and returns where they will be in the request's
`kv_transfer_params`; tensor-parallel rank 0's worker copies the rows out of vLLM's
cache on kvflow's loop (off vLLM's thread), hands the blocks back, and saves them
through the engine's store transport. `HiddenStatesReader` reads them.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import trio

from kvflow.config import ConfigError
from kvflow.engine.lending import Lending
from kvflow.hidden_states import HiddenStatesRef, host_buffer, save_hidden_states
from kvflow.keys import Fingerprint, StoreKey, chunk_keys, chunk_token_counts
from kvflow.observe.events import EventBus
from kvflow.runtime import Runtime, poll_until
from kvflow.transport import Transport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "HiddenExport",
    "HiddenStatesExporter",
    "HiddenStatesPlanner",
    "extracts_hidden_states",
    "gather_rows",
    "hidden_layer",
]

log = logging.getLogger("kvflow.vllm")


class HiddenExport(msgspec.Struct, frozen=True, array_like=True):
    """Scheduler to worker: copy `ref`'s rows out of `block_ids` and store them."""

    req: str
    block_ids: list[int]
    ref: HiddenStatesRef


def extracts_hidden_states(vllm_config: VllmConfig) -> bool:
    spec = vllm_config.speculative_config
    return spec is not None and spec.method == "extract_hidden_states"


def hidden_group(kv_cache_config: KVCacheConfig) -> int:
    """The KV cache group holding the cache-only layer: its own group, or the only one
    (vLLM's rule, `ExampleHiddenStatesConnector`)."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    own = [g for g, x in enumerate(groups) if isinstance(x.kv_cache_spec, HiddenStateCacheSpec)]
    if len(own) == 1:
        return own[0]
    if not own and len(groups) == 1:
        return 0
    raise ConfigError(
        f"KVFlowConnector: extract_hidden_states: cannot tell which of {len(groups)} KV cache "
        "groups holds the hidden states (vLLM isolates them in a group of their own)"
    )


def hidden_layer(kv_cache_config: KVCacheConfig) -> str | None:
    """The cache-only layer's name (workers see each layer's spec)."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    for group in kv_cache_config.kv_cache_groups:
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None)
        for name in group.layer_names:
            spec = per_layer[name] if per_layer else group.kv_cache_spec
            if isinstance(spec, HiddenStateCacheSpec):
                return str(name)
    return None


class HiddenStatesPlanner:
    """Scheduler side: which finished requests export, where their hidden states go."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        transport: str,
        store_key: StoreKey | None = None,
    ) -> None:
        from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

        mc = vllm_config.model_config
        spec_config = vllm_config.speculative_config
        assert spec_config is not None and spec_config.draft_model_config is not None
        hf = spec_config.draft_model_config.hf_config
        self.layer_ids = list(getattr(hf, "eagle_aux_hidden_state_layer_ids", []))
        self.group = hidden_group(kv_cache_config)
        self.block_size = kv_cache_config.kv_cache_groups[self.group].kv_cache_spec.block_size
        self.hidden_size = mc.get_hidden_size()
        # as the cache-only layer reads it: a quantized KV cache dtype is the model's
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("bfloat16", "float16"):
            cache_dtype = "auto"
        self.dtype = str(kv_cache_dtype_str_to_dtype(cache_dtype, mc)).removeprefix("torch.")
        self.transport = transport
        load_format = str(getattr(vllm_config.load_config, "load_format", ""))
        self.namespace = Fingerprint(
            model=f"{mc.model}@{mc.revision or ''}",
            dtype=self.dtype,
            block_size=self.block_size,
            num_layers=len(self.layer_ids),
            layout="hidden-states;token-major",
            bytes_per_token=len(self.layer_ids) * self.hidden_size,
            extra=f"layers={self.layer_ids}" + (";dummy" if load_format == "dummy" else ""),
        ).namespace(store_key)
        self.store_key = store_key
        """The engine's store key (`store_key_file`): it keys these chunks' keys too."""
        self._pending: list[HiddenExport] = []

    def finished(self, request: Request, block_ids: list[int], salt: str) -> HiddenStatesRef | None:
        """A request finished: plan its export (its blocks must stay lent until the
        worker copied them), or None when it has nothing complete to export."""
        if getattr(request, "prompt_embeds", None) is not None:
            return None  # no token ids name its rows (they would share keys with others')
        params = request.kv_transfer_params or {}
        if params.get("include_output_tokens"):  # the last token was never a forward's input
            tokens = list(request.all_token_ids)[:-1]
        else:
            tokens = list(request.prompt_token_ids or [])
        chunks = len(chunk_token_counts(len(tokens), self.block_size))
        if not tokens or request.num_computed_tokens < len(tokens) or len(block_ids) < chunks:
            return None  # aborted before its tokens were computed
        ref = HiddenStatesRef(
            transport=self.transport,
            namespace=self.namespace,
            keys=chunk_keys(
                self.namespace, tokens, self.block_size, salt=salt, store_key=self.store_key
            ),
            block_size=self.block_size,
            token_ids=tokens,
            num_layers=len(self.layer_ids),
            hidden_size=self.hidden_size,
            dtype=self.dtype,
        )
        self._pending.append(HiddenExport(request.request_id, list(block_ids[:chunks]), ref))
        return ref

    def take(self) -> list[HiddenExport]:
        out, self._pending = self._pending, []
        return out


def gather_rows(
    view: torch.Tensor, num_blocks: int, block_ids: list[int], num_tokens: int, out: torch.Tensor
) -> None:
    """Copy the first `num_tokens` tokens' rows of `block_ids` out of the cache-only
    layer's view (vLLM's logical `[blocks, layers, tokens, hidden]`, whatever its memory
    order; `num_blocks` manager blocks, each maybe several kernel blocks) into `out`
    (a `host_buffer`). Asynchronous (on the current stream) for a device view."""
    ratio, tokens = view.shape[0] // num_blocks, view.shape[2]
    dst = out.view(-1, view.shape[1], view.shape[3])  # [tokens, layers, hidden]
    kernel_blocks = [b * ratio + k for b in block_ids for k in range(ratio)]
    for i, kb in enumerate(kernel_blocks):  # a block at a time: no request-sized temporary
        n = min(tokens, num_tokens - i * tokens)
        if n <= 0:
            break
        rows = view[kb].permute(1, 0, 2)[:n]  # [tokens, layers, hidden]
        dst[i * tokens : i * tokens + n].copy_(rows, non_blocking=view.is_cuda)


class HiddenStatesExporter:
    """Worker side: copies finished requests' rows out of vLLM's cache, then saves them.

    A request's blocks go back to vLLM (`take_done`) as soon as its rows are in host
    memory, or the copy failed; the save runs on, bounded by `save_timeout_s`. Only the
    worker that holds the cache-only layer on tensor-parallel rank 0 writes; the others
    report every request done at once."""

    def __init__(self, runtime: Runtime, bus: EventBus, save_timeout_s: float) -> None:
        self.runtime = runtime
        self.bus = bus
        self.save_timeout_s = save_timeout_s
        self.transport: Transport | None = None
        self._view: torch.Tensor | None = None
        self._num_blocks = 0
        self._stream: Any = None
        self._lock = threading.Lock()
        self._done: set[str] = set()
        """Requests this worker does not copy out of: done at once."""
        self._lending = Lending()
        """The blocks of requests whose rows are being copied out."""
        self._running = 0
        self._idle: trio.Event | None = None

    def register(self, transport: Transport, view: torch.Tensor, num_blocks: int) -> None:
        """This worker writes: `view` is the cache-only layer's, `transport` is open."""
        self.transport, self._view, self._num_blocks = transport, view, num_blocks
        if view.is_cuda:  # one stream, made here: copies in several threads share it
            self._stream = torch.cuda.Stream(device=view.device)

    def export(self, exports: list[HiddenExport]) -> None:
        """vLLM's thread, at bind: start each export; returns at once."""
        if not exports:
            return
        if self._view is None or not self.runtime.running:
            with self._lock:
                self._done.update(e.req for e in exports)
            return
        self._lending.bound((e.req for e in exports), [])
        ready = None
        if self._view.is_cuda:  # what vLLM's stream queued so far wrote the rows
            ready = torch.cuda.Event()
            ready.record()
        with self._lock:
            self._running += len(exports)
        for e in exports:
            self.runtime.spawn(self._flow, e, ready, name=f"hidden:{e.req}")

    def take_done(self) -> set[str]:
        """Requests whose blocks vLLM may have back since the last call. Should kvflow's
        loop be gone, every export still open: nothing copies out of the blocks any more."""
        with self._lock:
            out, self._done = self._done, set()
        out |= self._lending.take_released()
        if not self.runtime.running:
            out |= self._lending.release_all()
        return out

    def drain(self, timeout_s: float) -> None:
        """Let the exports in flight finish (at most `timeout_s`)."""
        if self._running and self.runtime.running:
            try:
                self.runtime.call(self._drain, timeout=timeout_s)
            except TimeoutError:
                log.warning("kvflow: hidden-state exports still running after %.1fs", timeout_s)

    async def _drain(self) -> None:
        while self._running:
            self._idle = self._idle or trio.Event()
            await self._idle.wait()

    async def _flow(self, e: HiddenExport, ready: Any) -> None:
        buf = None
        self._lending.start(e.req)
        self._lending.lend(e.req)
        try:
            buf = await self._copy_out(e, ready)
        except Exception as exc:
            log.error("kvflow: hidden states of %s not copied out: %s", e.req, exc)
        finally:  # the rows are in host memory (or lost): vLLM may have its blocks back
            self._lending.end(e.req)
        try:
            if buf is not None:
                assert self.transport is not None
                error = await save_hidden_states(
                    self.transport, self.bus, e.req, e.ref, buf, self.save_timeout_s
                )
                if error:
                    log.error("kvflow: hidden states of %s not stored: %s", e.req, error)
        finally:
            with self._lock:
                self._running -= 1
            if not self._running and self._idle is not None:
                self._idle.set()
                self._idle = None

    async def _copy_out(self, e: HiddenExport, ready: Any) -> torch.Tensor:
        view = self._view
        assert view is not None
        if view.shape[1] != e.ref.num_layers or view.shape[3] != e.ref.hidden_size:
            raise ValueError(
                f"the cache-only layer holds {view.shape[1]}x{view.shape[3]} a token, the "
                f"scheduler planned {e.ref.num_layers}x{e.ref.hidden_size}"
            )
        buf = host_buffer(e.ref, pin=view.is_cuda)
        if not view.is_cuda:
            await trio.to_thread.run_sync(
                gather_rows, view, self._num_blocks, e.block_ids, e.ref.num_tokens, buf
            )
            return buf
        done = await trio.to_thread.run_sync(self._copy_on_stream, e, ready, buf)
        try:
            await poll_until(done.query)
        except BaseException:  # cancelled: the blocks go back only once nothing reads them
            done.synchronize()
            raise
        return buf

    def _copy_on_stream(self, e: HiddenExport, ready: Any, buf: torch.Tensor) -> Any:
        """A device cache: gather on a stream of kvflow's own, after `ready`; returns the
        event that says the rows are in `buf`."""
        view, stream = self._view, self._stream
        assert view is not None and stream is not None
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            try:
                gather_rows(view, self._num_blocks, e.block_ids, e.ref.num_tokens, buf)
            except BaseException:  # what it queued reads vLLM's blocks: let it end first
                stream.synchronize()
                raise
            done = torch.cuda.Event()
            done.record(stream)
        return done
