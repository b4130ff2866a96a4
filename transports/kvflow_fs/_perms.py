"""Who may write an `fs` store: the rules its open and `kvflow doctor` both apply.

Whoever can write the store's root or a namespace directory can plant chunk files
that every engine reading it loads (issue 46). So a directory kvflow uses must be the
user's own, or, in a store `file_mode` shares with a group's writers ("0660"), of a
group the user is in; and it may be writable by no one `file_mode` does not let write
(its directory mode: `dir_mode`).
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

__all__ = ["dir_mode", "unsafe"]


def dir_mode(file_mode: int) -> int:
    """The directories' mode for `file_mode`: the same, plus search where read is granted
    (0600 -> 0700, 0640 -> 0750, 0660 -> 0770)."""
    return file_mode | (file_mode & 0o444) >> 2


def unsafe(path: Path, file_mode: int, *, follow: bool = True) -> tuple[str, str] | None:
    """Why a store with `file_mode` must not use directory `path` (its owner, its mode,
    or, without `follow`, a symbolic link), and the fix; None if it may."""
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return (
            f"{path} is a symbolic link: the store's walks (its count, eviction) never follow "
            "one, so what it holds would be neither counted nor evicted",
            "name the real directory",
        )
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory", "name a directory"
    uid = os.geteuid()
    shared = bool(file_mode & 0o020) and (st.st_gid == os.getegid() or st.st_gid in os.getgroups())
    if st.st_uid != uid and not shared:
        return (
            f"{path} is owned by uid {st.st_uid}{_name(st.st_uid)}, not by this user (uid "
            f"{uid}{_name(uid)}): its owner can plant chunk files that this engine would load",
            "use a directory of your own (remove this one if nobody you trust made it); a "
            'store several users write needs file_mode "0660" and directories of their group',
        )
    mode = stat.S_IMODE(st.st_mode)
    extra = mode & 0o022 & ~dir_mode(file_mode)
    if extra:
        who = " and ".join(
            w for bit, w in ((0o020, "its group"), (0o002, "every user")) if extra & bit
        )
        flags = ("g" if extra & 0o020 else "") + ("o" if extra & 0o002 else "")
        return (
            f"{path} has mode {mode:04o}: writable by {who}, beyond file_mode {file_mode:04o}, "
            "so others can plant chunk files that this engine would load",
            f"`chmod {flags}-w {path}` if you trust what it holds (else remove it), or set "
            'file_mode to what the store\'s users share (e.g. "0660" for a group)',
        )
    return None


def _name(uid: int) -> str:
    try:
        return f" ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return ""
