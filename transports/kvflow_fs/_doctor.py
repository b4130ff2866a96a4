"""`kvflow doctor`'s checks of an `fs` store: its directory writable (or creatable), the
disk's free space against what `max_gb` lets the store grow to, `file_mode`, and the
store's directories against the rules its open applies (`_perms`: owned by this user,
writable by no one `file_mode` does not let write)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.transport import TransportError

from ._perms import dir_mode, unsafe
from ._usage import USAGE_FILE

if TYPE_CHECKING:
    from ._transport import FsOptions

__all__ = ["check"]

GiB = 1 << 30
PATH = "kv_connector_extra_config['options']['path']"


def check(options: FsOptions, findings: Any) -> None:
    from ._transport import _file_mode, store_root

    root = store_root(options)
    if (existing := _writable(root, findings)) is not None:
        _space(root, existing, options.max_gb, findings)
    try:
        mode = _file_mode(options.file_mode)
    except TransportError as exc:
        findings.fail("fs file_mode", str(exc), 'e.g. "0600" (owner-only) or "0640" (a group)')
        return
    if mode & 0o004:
        findings.warn(
            "fs file_mode",
            f"{options.file_mode}: every user of this host can read the chunk files (KV bytes "
            "reveal the prompts)",
            '"0600", or "0640" and a group for the users that share the store',
        )
    else:
        who = "owner and group" if mode & 0o040 else "owner only"
        findings.ok("fs file_mode", f"{mode:04o} ({who}), less the umask")
    _owners(root, mode, findings)


def _owners(root: Path, file_mode: int, findings: Any) -> None:
    """The root (the engine refuses to open it: FAIL) and each namespace directory in it
    (an engine of that namespace refuses to open it: warn), as the engine checks them."""
    check = "fs permissions"
    if not root.is_dir():
        findings.ok(
            check, f"{root}: the engine creates it {dir_mode(file_mode):04o}, less the umask"
        )
        return
    try:
        if problem := unsafe(root, file_mode):
            findings.fail(check, problem[0], problem[1])
            return
        namespaces = [e for e in os.scandir(root) if not e.name.startswith(".") and not e.is_file()]
        problems = [p for e in namespaces if (p := unsafe(Path(e.path), file_mode, follow=False))]
    except OSError as exc:
        findings.fail(check, f"{root}: {exc.strerror or exc}", f"make {PATH} a directory of yours")
        return
    if problems:
        more = f" (and {len(problems) - 1} more namespace directories)" if len(problems) > 1 else ""
        findings.warn(
            check,
            f"{problems[0][0]}{more}: an engine of that namespace refuses to open the store",
            problems[0][1],
        )
    else:
        findings.ok(
            check,
            f"{root} and its {len(namespaces)} namespace directories: owned and writable as "
            f"file_mode {file_mode:04o} allows",
        )


def _writable(root: Path, findings: Any) -> Path | None:
    """The nearest existing directory of `root` if kvflow can write `root` (creating it
    as the engine would), else None (said)."""
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    fix = f"point {PATH} at a writable directory (or make this one writable)"
    if not existing.is_dir():
        findings.fail("fs path", f"{root}: {existing} is not a directory", fix)
        return None
    try:  # what the engine does: write there (a temporary file, or directory, then gone)
        if existing == root:
            fd, probe = tempfile.mkstemp(prefix=".doctor.", dir=root)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".doctor.", dir=existing))
    except OSError as exc:
        findings.fail("fs path", f"{root} is not writable: {exc.strerror or exc}", fix)
        return None
    made = "" if existing == root else f" (not there yet; the engine creates it in {existing})"
    findings.ok("fs path", f"{root} is writable{made}")
    return existing


def _space(root: Path, existing: Path, max_gb: float, findings: Any) -> None:
    st = os.statvfs(existing)
    free = st.f_bavail * st.f_frsize
    if not max_gb > 0:
        findings.ok("fs space", f"{free / GiB:.1f} GiB free; no max_gb cap (the disk's size)")
        return
    used = 0
    with contextlib.suppress(OSError, ValueError):
        used = int((root / USAGE_FILE).read_text() or 0)
    room = int(max_gb * GiB) - used
    if room > free:
        findings.warn(
            "fs space",
            f"max_gb {max_gb:g} lets the store grow {room / GiB:.1f} GiB more, but the disk "
            f"has {free / GiB:.1f} GiB free: saves fail once it is full (no eviction yet)",
            f"lower kv_connector_extra_config['options']['max_gb'] to at most "
            f"{(free + used) / GiB * 0.9:.0f}, or free space",
        )
    else:
        findings.ok(
            "fs space",
            f"{free / GiB:.1f} GiB free; max_gb lets the store grow {room / GiB:.1f} GiB more",
        )
