"""`kvflow doctor`'s config and transport checks: the config parsed as the engine parses
it, every installed transport imported (and why not), and each configured transport's
own checks (`Transport.doctor`)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import EntryPoint
from typing import Any

from ..config import ConfigError, KVFlowConfig, parse_config, parse_options
from ..findings import Findings
from ..transport import Transport, TransportNotFound, available_transports, load_transport

__all__ = [
    "Configured",
    "check_config",
    "configured_transports",
    "import_transports",
    "run_transport_checks",
]

DOCS = "see docs/configuration.md for every key"


@dataclass
class Configured:
    """A transport the config uses, with its parsed options."""

    name: str
    cls: type[Transport]
    options: Any
    where: str
    """The key of its options, as errors name it."""


def check_config(findings: Findings, raw: dict[str, Any] | None) -> KVFlowConfig | None:
    """`raw` parsed by kvflow's own parser (errors name the key and the valid choices)."""
    try:
        cfg = parse_config(raw, transports=sorted(available_transports()))
    except ConfigError as exc:
        findings.fail("config", str(exc), DOCS)
        return None
    return cfg


def import_transports(findings: Findings, configured: set[str]) -> dict[str, type[Transport]]:
    """Import every installed transport; a broken one is a FAIL where it is configured."""
    loaded = {}
    for name, ep in sorted(available_transports().items()):
        dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "?"
        try:
            cls = load_transport(name)
        except TransportNotFound as exc:  # its import raised (the cause), or not a Transport
            say = findings.fail if name in configured else findings.warn
            say(f"transport {name}", f"{ep.value} ({dist}): {exc}", _fix(ep, exc.__cause__))
            continue
        findings.ok(f"transport {name}", f"{ep.value} ({dist}): {cls.capabilities.describe()}")
        loaded[name] = cls
    return loaded


def _fix(ep: EntryPoint, exc: BaseException | None) -> str:
    """How to mend a transport that does not import."""
    dist = ep.dist.name if ep.dist is not None else "its package"
    if isinstance(exc, ModuleNotFoundError) and exc.name and ep.dist is not None:
        wanted = exc.name.split(".")[0].replace("_", "-").lower()
        for req in ep.dist.requires or []:
            name, _, marker = req.partition(";")
            if name.strip().lower().startswith(wanted) and "extra ==" in marker:
                extra = marker.split("extra ==")[1].strip().strip("'\"")
                return f"pip install '{dist}[{extra}]'"
        return f"pip install what provides {exc.name!r}, or reinstall {dist} with its dependencies"
    if exc is None:
        return f"reinstall {dist}, or ask its authors"
    return f"mend what the error names (a library, a driver), or reinstall {dist}"


def configured_transports(
    findings: Findings, cfg: KVFlowConfig, loaded: dict[str, type[Transport]]
) -> list[Configured] | None:
    """`cfg`'s transport and tiers with their options parsed (None where one does not
    parse, or does not import: said already)."""
    out = []
    wanted = [(cfg.transport, cfg.options, "")] + [
        (t.transport, t.options, f"kv_connector_extra_config['tiers'][{i}]['options']")
        for i, t in enumerate(cfg.tiers)
    ]
    for name, raw, where in wanted:
        if name not in loaded:
            findings.ok("config", f"kvflow's keys parse; {name}'s options unchecked (not imported)")
            return None
        try:
            options = parse_options(raw, loaded[name].Options, name, where)
        except ConfigError as exc:
            findings.fail("config", str(exc), DOCS)
            return None
        out.append(Configured(name, loaded[name], options, where))
    caps = out[0].cls.capabilities
    if cfg.cpu_cache_gib and (not caps.store or caps.peer):
        findings.fail(
            "config",
            f"kv_connector_extra_config['cpu_cache_gib']: transport {cfg.transport!r} is a "
            "peer transport; a host tier goes in front of a store transport",
            "set cpu_cache_gib 0, or choose a store transport",
        )
        return None
    tiers = f", tiers {', '.join(t.transport for t in cfg.tiers)}" if cfg.tiers else ""
    host = f", cpu_cache_gib {cfg.cpu_cache_gib:g}" if cfg.cpu_cache_gib else ""
    findings.ok("config", f"parses: transport {cfg.transport}{tiers}{host}")
    return out


def run_transport_checks(findings: Findings, configured: list[Configured]) -> None:
    """Each configured transport's own `doctor` checks."""
    for c in configured:
        try:
            c.cls.doctor(c.options, findings)
        except Exception as exc:  # a check that breaks is a finding, not the end of the rest
            findings.warn(
                f"transport {c.name} checks",
                f"its doctor check raised {type(exc).__name__}: {exc}",
                "report it to the transport's authors",
            )
