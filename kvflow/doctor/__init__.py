"""`kvflow doctor`'s checks: what would stop an engine with kvflow's connector on this host,
or slow it, each with its fix (`kvflow.findings`). The core's checks read package
metadata, the host and the config; each configured transport adds its own
(`Transport.doctor`). Nothing here imports vLLM."""

from __future__ import annotations

from ..findings import Findings
from .host import check_cuda, check_memory
from .inputs import read_config
from .keys import check_key, check_peer_host, check_store_key
from .transports import check_config, configured_transports, import_transports, run_transport_checks
from .vllm_install import check_vllm

__all__ = ["diagnose"]


def diagnose(config: str | None) -> Findings:
    """Every check, given `config` (a `kv_connector_extra_config` or a whole
    `--kv-transfer-config`: JSON, or `@PATH`; None: kvflow's defaults)."""
    findings = Findings()
    reads, raw = read_config(config, findings)
    cfg = check_config(findings, raw) if reads else None
    names = {cfg.transport, *(t.transport for t in cfg.tiers)} if cfg else set()
    imports = Findings()  # said after the config's line
    loaded = import_transports(imports, names)
    configured = configured_transports(findings, cfg, loaded) if cfg else None
    vllm = check_vllm(findings)
    findings.items += imports.items
    if configured:
        run_transport_checks(findings, configured)
    peer = configured[0].cls.capabilities.peer if configured else False
    channel = check_key(findings, cfg, peer=peer) if cfg else None
    if configured and channel is not None and peer:
        check_peer_host(findings, configured[0].options, channel)
    if cfg:
        caps = configured[0].cls.capabilities if configured else None
        check_store_key(findings, cfg, store=caps is None or (caps.store and not caps.peer))
    cuda = check_cuda(findings, vllm)
    memory = configured[0].cls.capabilities.memory if configured else frozenset({"cpu"})
    cpu_cache_gib = cfg.cpu_cache_gib if cfg else 0.0
    check_memory(findings, cpu_cache_gib, cuda=cuda, staging=cuda and "cuda" not in memory)
    return findings
