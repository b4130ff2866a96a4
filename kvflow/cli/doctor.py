"""`kvflow doctor [CONFIG] [--json]`: check this host and a kvflow config for what would
stop an engine or slow it; one line per check with its fix. Exit status 1 where a check
FAILs (the engine would not start), else 0."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from ..doctor import diagnose
from ..findings import Finding

__all__ = ["add_parser", "render", "run_doctor"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this host and a kvflow config; each problem with its fix",
        description=__doc__,
    )
    p.add_argument(
        "config",
        nargs="?",
        default=None,
        help="kv_connector_extra_config or a whole --kv-transfer-config, as JSON or @FILE "
        "(default: kvflow's defaults)",
    )
    p.add_argument(
        "--kv-transfer-config",
        dest="transfer_config",
        default=None,
        metavar="JSON",
        help="the same, as given to vllm serve",
    )
    p.add_argument("--json", action="store_true", help="print the findings as one JSON object")
    p.set_defaults(fn=run_doctor)


def render(findings: list[Finding]) -> str:
    """One line per finding: status, check, what was found, and the fix."""
    lines = []
    for f in findings:
        fix = f"; fix: {f.fix}" if f.fix else ""
        lines.append(f"{f.status:<4}  {f.check}: {f.found}{fix}")
    return "\n".join(lines)


def run_doctor(args: argparse.Namespace) -> int:
    if args.config is not None and args.transfer_config is not None:
        print(
            "kvflow doctor: give the config once (CONFIG or --kv-transfer-config)", file=sys.stderr
        )
        return 2
    findings = diagnose(args.config if args.config is not None else args.transfer_config)
    if args.json:
        body = {"failed": findings.failed, "findings": msgspec.to_builtins(findings.items)}
        print(json.dumps(body, indent=2))
    else:
        print(render(findings.items))
        counts = {s: sum(f.status == s for f in findings.items) for s in ("FAIL", "warn", "ok")}
        print("kvflow doctor: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 1 if findings.failed else 0
