"""What `kvflow doctor`'s checks found: one `Finding` per check, each a status, what was
found and the fix.

A check says what it found through a `Findings` it is handed (a transport's
`Transport.doctor` too, so a transport author imports nothing for it): `ok`, `warn`
(the engine starts, but something is off) or `fail` (the engine would not start).
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["Finding", "Findings", "Status"]

Status = Literal["ok", "warn", "FAIL"]


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One check's result."""

    check: str
    """What was checked, e.g. `vllm`, `fs path`, `key file`."""
    status: Status
    found: str
    fix: str = ""
    """What to do about it ("" when all is well)."""


class Findings:
    """The findings of `kvflow doctor`'s checks, in the order they were made."""

    def __init__(self) -> None:
        self.items: list[Finding] = []

    def ok(self, check: str, found: str) -> None:
        self.items.append(Finding(check=check, status="ok", found=found))

    def warn(self, check: str, found: str, fix: str) -> None:
        """Something is off, but the engine starts."""
        self.items.append(Finding(check=check, status="warn", found=found, fix=fix))

    def fail(self, check: str, found: str, fix: str) -> None:
        """The engine would not start (or not work) like this."""
        self.items.append(Finding(check=check, status="FAIL", found=found, fix=fix))

    @property
    def failed(self) -> bool:
        return any(f.status == "FAIL" for f in self.items)
