"""What vLLM's cache spec, settings and requests say about the KV bytes kvflow moves:
the fingerprint that keys them, the layers and KV cache groups it can move, the byte
layout of vLLM's KV views, the per-request inputs that salt their keys, and what
kvflow's configuration gives up under vLLM's settings (checked once, at start)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from kvflow.config import ConfigError, KVFlowConfig
from kvflow.geometry.layout import KVLayout, LayoutError, block_geometry, view_extent, view_geometry
from kvflow.geometry.topology import held_heads
from kvflow.keys import Fingerprint
from kvflow.pd.params import ModelShape

from ..extract_hidden_states import extracts_hidden_states
from ..kv_events import events_enabled

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "check_groups",
    "check_spec",
    "fingerprint",
    "fit_config",
    "kv_events_on",
    "layer_loads_unsafe",
    "layer_specs",
    "layout_from_tensors",
    "model_shape",
    "request_salt",
    "stores_token_major",
]

log = logging.getLogger("kvflow.vllm")


def request_salt(request: Request) -> str:
    """Per-request inputs that change KV bytes without changing token ids, as one string
    no two sets of them share (a JSON list: a client's `cache_salt` cannot pass for a
    LoRA or a multimodal input, whatever characters it holds); "" when there are none."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={lora.lora_name}:{getattr(lora, 'lora_path', '')}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    for f in getattr(request, "mm_features", None) or ():
        parts.append(f"mm={f.identifier}@{f.mm_position.offset}")
    return msgspec.json.encode(parts).decode() if parts else ""


def fingerprint(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, group: int = 0
) -> Fingerprint:
    """What makes the KV bytes of this engine's KV cache group `group` (in)compatible
    with another's."""
    mc = vllm_config.model_config
    groups = kv_cache_config.kv_cache_groups
    spec = _group_spec(kv_cache_config, group)  # the layer count says the rest
    extra = type(spec).__name__
    if len(groups) > 1:  # which layers, which window (one group: as before groups)
        window = getattr(spec, "sliding_window", None)
        extra += f";group={group}/{len(groups)};window={window}"
    # Not the tensor-parallel size: a store serves engines of any (`kvflow.shapes.reshape`). A
    # token's bytes over all heads, though a rank holds a share (or a replica) of them.
    shape = model_shape(vllm_config, kv_cache_config, group)
    per_rank = len(held_heads(shape.kv_heads, vllm_config.parallel_config.tensor_parallel_size, 0))
    tp_ratio = shape.kv_heads // per_rank if per_rank else 1
    load_format = str(getattr(vllm_config.load_config, "load_format", ""))
    if load_format == "dummy":
        extra += f";load_format={load_format}"
    # Nor the block size where chunks are token-major: a store serves engines of any
    # (`kvflow.shapes.reblock`); vLLM's CPU blocks do not split into tokens.
    layout = _stored_layout(kv_cache_config)
    return Fingerprint(
        model=f"{mc.model}@{mc.revision or ''}",
        dtype=f"{mc.dtype}/{vllm_config.cache_config.cache_dtype}/{mc.quantization or ''}",
        block_size=0 if layout == TOKEN_MAJOR else spec.block_size,
        num_layers=len(groups[group].layer_names),
        layout=layout,
        bytes_per_token=spec.page_size_bytes // spec.block_size * tp_ratio,
        extra=extra,
    )


def model_shape(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, group: int = 0
) -> ModelShape:
    """What a P/D peer's KV cache group `group` must agree on with this engine's."""
    mc = vllm_config.model_config
    spec = _group_spec(kv_cache_config, group)
    return ModelShape(
        model=f"{mc.model}@{mc.revision or ''}",
        layers=len(kv_cache_config.kv_cache_groups[group].layer_names),
        kv_heads=1 if mc.use_mla else mc.get_total_num_kv_heads(),
        head_size=spec.head_size,
        dtype=str(mc.dtype),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
    )


def _group_spec(kv_cache_config: KVCacheConfig, group: int) -> Any:
    """Group `group`'s spec: for a group of layers with different specs
    (extract_hidden_states' cache-only layer next to attention) workers see each layer's
    spec, the scheduler one merged spec; the first layer's is what both agree on."""
    groups = kv_cache_config.kv_cache_groups
    spec = groups[group].kv_cache_spec
    if per_layer := getattr(spec, "kv_cache_specs", None):
        spec = per_layer[groups[group].layer_names[0]]
    return spec


def layer_specs(kv_cache_config: KVCacheConfig) -> dict[str, Any]:
    """Each layer's KV cache spec, by layer name."""
    specs: dict[str, Any] = {}
    for group in kv_cache_config.kv_cache_groups:
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None)  # mixed groups
        for name in group.layer_names:
            specs[name] = per_layer[name] if per_layer else group.kv_cache_spec
    return specs


def check_spec(name: str, spec: Any) -> None:
    """Refuse, naming the spec, a layer whose cache is not one state per token of
    attention KV (Mamba state, compressed sparse MLA)."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    kind = type(spec).__name__
    if not isinstance(spec, AttentionSpec):
        raise LayoutError(
            f"kvflow: layer {name} has a {kind} cache; kvflow moves attention KV "
            "(FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec and their kin) only"
        )
    if spec.tokens_per_state != 1:
        raise LayoutError(
            f"kvflow: layer {name}'s {kind} stores a state per {spec.tokens_per_state} "
            "tokens; kvflow moves caches of one state per token"
        )


def fit_config(
    config: KVFlowConfig,
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    groups: Sequence[int],
    store: bool,
) -> KVFlowConfig:
    """`config` as this vLLM allows it, for the KV cache `groups` kvflow moves through a
    transport (a `store` one or not): refused where kvflow cannot serve vLLM's setup,
    loading between steps where loads within the step would be unsafe."""
    if why := layer_loads_unsafe(vllm_config, config):
        log.warning("kvflow: load_mode 'layer' -> 'async': %s", why)
        config = msgspec.structs.replace(config, load_mode="async")
    if extracts_hidden_states(vllm_config) and not store:
        raise ConfigError(
            "KVFlowConnector: extract_hidden_states: kvflow stores hidden states through a "
            f"store transport (fs, redis, ...); {config.transport!r} is not one"
        )
    if len(kv_cache_config.kv_cache_groups) > 1:  # vLLM's check, not kvflow's groups
        config = check_groups(kv_cache_config, groups, config)
    return config


def check_groups(
    kv_cache_config: KVCacheConfig, groups: Sequence[int], config: KVFlowConfig
) -> KVFlowConfig:
    """Several KV cache groups (vLLM's hybrid manager): refuse what kvflow cannot move
    per group, and load between steps (vLLM recovers from a failed load of a model of
    several groups only when it is asynchronous, reported by request in
    `failed_recving`: it takes no block ids); returns `config`, so changed."""
    kv_groups = kv_cache_config.kv_cache_groups
    specs = ", ".join(f"{type(kv_groups[g].kv_cache_spec).__name__}" for g in groups)
    sizes = {kv_groups[g].kv_cache_spec.block_size for g in groups}
    if len(sizes) > 1:
        raise ConfigError(
            f"KVFlowConnector: this model's KV cache groups ({specs}) have blocks of "
            f"{sorted(sizes)} tokens; kvflow moves groups of one block size. Start vLLM "
            "with --disable-hybrid-kv-cache-manager."
        )
    if config.load_mode == "layer":
        log.warning(
            "kvflow: load_mode 'layer' -> 'async': vLLM recovers from a failed load of "
            "several KV cache groups only between steps"
        )
        config = msgspec.structs.replace(config, load_mode="async")
    return config


def kv_events_on(vllm_config: VllmConfig, block_size: int, hash_block: int) -> bool:
    """Whether kvflow reports its blocks in vLLM's KV events: they are on, and vLLM hashes
    blocks of `hash_block` tokens, a divisor of kvflow's `block_size`."""
    events = events_enabled(vllm_config)
    if events and block_size % hash_block:  # decode context parallelism
        log.warning(
            "kvflow: no KV events: vLLM hashes blocks of %d tokens, kvflow stores blocks of %d",
            hash_block,
            block_size,
        )
        events = False
    return events


TOKEN_MAJOR = "token-major"


def stores_token_major(kv_cache_config: KVCacheConfig) -> bool:
    """Whether a store holds this engine's chunks token-major (a device cache): then it
    loads chunks saved at other block sizes (`kvflow.shapes.reblock`)."""
    return _stored_layout(kv_cache_config) == TOKEN_MAJOR


def _stored_layout(kv_cache_config: KVCacheConfig) -> str:
    """The layout of the bytes a store holds: vLLM's CPU cache as it lies (blocks packed per
    instruction set); a device cache token-major, whatever vLLM's layout (staged: any
    layout reads what any other wrote)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return str(kv_cache_config.kv_cache_layout or "default")
    return TOKEN_MAJOR


def layout_from_tensors(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    block_size: int,
    *,
    opaque_blocks: bool | None = None,
) -> KVLayout:
    """Describe vLLM's per-layer KV views as byte spans (see kvflow.geometry.layout).

    vLLM (0.32 and later) hands every layer over as its `create_kv_cache_views`
    view: logical `[blocks, heads, tokens, content]` whatever the memory order
    (`KVCacheLayout`), with `blocks` counting kernel blocks when a block is split
    into several. On CPU (vLLM's CPU attention packs K per instruction set inside a
    block) blocks are opaque, so the geometry is block-granular, over memoryviews;
    on CUDA it is cell by cell, and the layers are flat uint8 tensors.
    `opaque_blocks` overrides the choice (False: host memory laid out as on a GPU).
    """
    names, geos, bufs, tensors = [], [], [], []
    memory = "cpu"
    for name, t in kv_caches.items():
        shape, strides = list(t.shape), list(t.stride())
        if len(shape) != 4:
            raise LayoutError(
                f"kvflow: layer {name} has a KV cache of shape {tuple(shape)}; expected "
                "vLLM's [blocks, heads, tokens, content] view"
            )
        memory = t.device.type
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        start = t.storage_offset() * t.element_size()
        extent = view_extent(shape, strides, t.element_size())
        opaque = memory == "cpu" if opaque_blocks is None else opaque_blocks
        try:
            if opaque:
                geo = block_geometry(shape, strides, t.element_size(), num_blocks)
            else:
                geo = view_geometry(shape, strides, t.element_size(), num_blocks)
                if geo.block_size != block_size:
                    raise LayoutError(f"{geo.block_size} tokens a block, not {block_size}")
        except LayoutError as exc:
            raise LayoutError(f"kvflow: layer {name}: {exc}") from None
        geos.append(geo)
        if memory == "cpu":
            bufs.append(memoryview(whole.numpy()).cast("B")[start : start + extent])  # type: ignore[arg-type]
        else:
            tensors.append(whole[start : start + extent])
        names.append(name)
    return KVLayout(
        names=names,
        geometries=geos,
        buffers=bufs,
        memory=memory,
        block_size=block_size,
        tensors=tensors,
    )


def layer_loads_unsafe(vllm_config: VllmConfig, config: KVFlowConfig) -> str:
    """Why loads within the step (`load_mode: layer`) would risk wrong tokens here ("" if
    they do not). vLLM (0.32, 0.33) puts blocks loaded within the step in its prefix
    cache as they are allocated, before they arrive: a second request shares them and
    computes its own blocks over them. When the load fails, vLLM's recovery assumes the
    first request recomputes the shared blocks before anyone uses them again, which a
    preemption, an abort or policy `fail` breaks, and blocks computed over bad KV stay
    in its prefix cache (decision 33; the soak finds them). Loads between steps are
    cached only once they arrived."""
    if config.load_mode != "layer" or not vllm_config.cache_config.enable_prefix_caching:
        return ""
    return (
        "with vLLM's prefix caching on, blocks loaded within the step are shared before "
        "they arrive, and a failed load would leave blocks computed over bad KV in it"
    )
