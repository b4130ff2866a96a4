"""An event subscriber that appends each event as one JSON line to a file.

The simplest durable view of what every runtime did: scheduler and workers of
several engines may append to one file (each line is written with one
`write` on an O_APPEND descriptor, so lines do not interleave).
"""

from __future__ import annotations

import os

import msgspec

from .events import Event

__all__ = ["JsonlEventLog", "read_event_log"]


class JsonlEventLog:
    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._encoder = msgspec.json.Encoder()

    def __call__(self, event: Event) -> None:
        os.write(self._fd, self._encoder.encode(event) + b"\n")


def read_event_log(path: str) -> list[Event]:
    """Decode a file written by `JsonlEventLog`."""
    decoder = msgspec.json.Decoder(Event)
    with open(path, "rb") as f:
        return [decoder.decode(line) for line in f if line.strip()]
