"""Secret keys in files on this host: the deployment key, the store key, the host key.

A deployment's secret (`kvflow keygen` writes one) is read from a file named in the
configuration (`key_file`, `store_key_file`) or from `$KVFLOW_KEY`, never from a request;
a file others may read or write is refused, as ssh refuses such a private key. Without
a deployment secret, P/D instances of one user on one host share a *host key*
(`host_key`), made on first use in the user's private runtime directory. What the keys
protect is elsewhere: the side channel and P/D params (`kvflow.pd.security`), stored
chunks (`kvflow.keys.StoreKey`).
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

__all__ = [
    "HOST_KEY",
    "KEY_BYTES",
    "KEY_ENV",
    "RUNTIME_ENV",
    "SecurityError",
    "host_key",
    "keygen",
    "private_problem",
    "read_key",
    "runtime_dir",
]

KEY_ENV = "KVFLOW_KEY"
"""An environment variable holding the deployment secret (hex), if `key_file` is unset."""
RUNTIME_ENV = "KVFLOW_RUNTIME_DIR"
"""Where the host key lives, if set (else `$XDG_RUNTIME_DIR/kvflow`, else
`$TMPDIR/kvflow-UID`): instances share a host key only if they see one directory."""
HOST_KEY = "host.key"
KEY_BYTES = 32


class SecurityError(ValueError):
    """A key that cannot be read, or a setting that would expose the side channel."""


def keygen(path: str | os.PathLike[str]) -> Path:
    """Write a new deployment secret to `path` (owner-only, never over an existing file)."""
    out = Path(path)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")
    return out


def read_key(key_file: str = "") -> bytes | None:
    """The deployment secret from `key_file`, else from `$KVFLOW_KEY`; None if neither.
    A key file others may read (or write) is refused, as ssh refuses such a private key."""
    if key_file:
        where = f"key_file {key_file!r}"
        try:
            fd = os.open(key_file, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise SecurityError(f"cannot read {where}: {exc.strerror}") from None
        with os.fdopen(fd) as f:
            if problem := private_problem(os.fstat(fd), want_dir=False):
                raise SecurityError(f"{where} {problem}")
            text = f.read()
    elif os.environ.get(KEY_ENV):
        where, text = f"${KEY_ENV}", os.environ[KEY_ENV]
    else:
        return None
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) < 16:
        raise SecurityError(
            f"{where} does not hold a kvflow key (at least 16 bytes, in hex); "
            "make one with `kvflow keygen PATH`"
        )
    return key


def private_problem(st: os.stat_result, *, want_dir: bool) -> str:
    """Why a file or directory of this `stat` is not this user's alone ("" if it is)."""
    kind = "a directory" if want_dir else "a regular file"
    if (stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)) is False:
        return f"is not {kind}"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & 0o077:
        fix = "700" if want_dir else "600"
        return (
            f"may be read or written by others (mode {stat.S_IMODE(st.st_mode):o}): "
            f"`chmod {fix}` it"
        )
    return ""


def runtime_dir() -> Path:
    """This user's private directory for the host key: `$KVFLOW_RUNTIME_DIR`, else
    `$XDG_RUNTIME_DIR/kvflow`, else `kvflow-UID` in the temporary directory."""
    if os.environ.get(RUNTIME_ENV):
        return Path(os.environ[RUNTIME_ENV])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "kvflow"
    return Path(tempfile.gettempdir()) / f"kvflow-{os.getuid()}"


def host_key() -> bytes:
    """The key every P/D instance of this user on this host shares when no deployment
    secret is set: read from `runtime_dir()`, made there on first use (two instances
    starting at once agree on one). The directory and the file must be this user's and
    no one else's (a directory another user made first in a shared /tmp is refused,
    never used)."""
    where = runtime_dir()
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(where)
    except OSError as exc:
        raise SecurityError(f"cannot make the host key's directory {str(where)!r}: {exc}") from None
    if problem := private_problem(st, want_dir=True):
        raise SecurityError(
            f"the host key's directory {str(where)!r} {problem}; set ${RUNTIME_ENV} to a "
            "directory only you can use, or give every instance a key_file"
        )
    path = where / HOST_KEY
    if not os.path.lexists(path):
        tmp = where / f".{HOST_KEY}.{os.getpid()}.{secrets.token_hex(4)}"
        keygen(tmp)
        try:
            os.link(tmp, path)  # never over another instance's key: the first one wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    try:
        key = read_key(str(path))
    except SecurityError as exc:
        raise SecurityError(f"the host key: {exc}") from None
    assert key is not None
    return key
