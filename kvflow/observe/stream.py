"""The live event stream: every runtime publishes its events for `kvflow inspect`.

Each runtime binds a ZMQ XPUB socket on `ipc://<runtime dir>/<engine>-<role>-<rank>-<pid>.sock`
and writes a discovery record (`.json`) next to it; both go on clean shutdown, and
`discover` ignores (and removes) records whose process is gone.

Why it never slows a transfer: while nobody subscribes, an event costs one check of
a flag (the socket is an XPUB, so a task learns of subscribers as they come and go).
With a reader, a message is one msgspec (msgpack) encode and one `send(NOBLOCK)` on
the runtime's trio thread, and it never blocks: when a subscriber's queue (SNDHWM +
its RCVHWM) is full, libzmq drops the message for that subscriber alone, silently,
so one stalled reader costs the others nothing. Every message carries a
per-publisher sequence number; a reader counts the gaps, which is the exact number
of events *it* missed. Events the publisher itself could not hand to zmq
(`zmq.Again`, a closed socket) are counted too and carried in the next message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import trio
import zmq

from ..runtime import Runtime
from .events import Event, EventBus, Origin

__all__ = [
    "RUNTIME_DIR_ENV",
    "Envelope",
    "EventPublisher",
    "Registration",
    "SeqTracker",
    "decode_envelope",
    "discover",
    "open_subscriber",
    "pid_alive",
    "runtime_dir",
    "start_publisher",
]

log = logging.getLogger("kvflow.event_stream")

RUNTIME_DIR_ENV = "KVFLOW_RUNTIME_DIR"
SNDHWM = 10_000
"""Messages queued per subscriber before libzmq drops for it (~150 B each)."""


class Envelope(msgspec.Struct, array_like=True):
    """One message on the wire: `[seq, dropped, event]` in msgpack."""

    seq: int
    """1, 2, ... per publisher; a gap is events this reader missed."""
    dropped: int
    """Events the publisher itself could not send so far (counted, never retried)."""
    event: Event


class Registration(msgspec.Struct, kw_only=True):
    """A discovery record: which runtime publishes where."""

    engine: str
    role: str
    rank: int
    pid: int
    endpoint: str
    started: float
    """Wall-clock time (`time.time()`) the publisher started."""
    proc_start: int = 0
    """The process's start time in clock ticks (Linux), so a reused pid is not mistaken."""


_envelope_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_reg_decoder = msgspec.json.Decoder(Registration)


def decode_envelope(data: bytes | memoryview) -> Envelope:
    return _envelope_decoder.decode(data)


def runtime_dir() -> Path:
    """`$KVFLOW_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/kvflow`, else `<tmp>/kvflow-<uid>`."""
    env = os.environ.get(RUNTIME_DIR_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvflow"
    return Path(tempfile.gettempdir()) / f"kvflow-{os.getuid()}"


def _ensure_private_dir(path: Path) -> Path:
    """Create `path` 0700; refuse one another user owns (a shared /tmp can be pre-seeded)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _proc_start(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (0 where there is no /proc); -1: a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    fields = stat.rpartition(b")")[2].split()  # the command name may hold spaces
    return -1 if fields[0] == b"Z" else int(fields[19])


def pid_alive(pid: int, proc_start: int = 0) -> bool:
    """True if `pid` runs (and, when `proc_start` is known, is the same process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    start = _proc_start(pid)
    return start != -1 and (not proc_start or not start or start == proc_start)


def discover(directory: Path | None = None, *, clean: bool = True) -> list[Registration]:
    """The live publishers registered in `directory`; stale records are removed if `clean`."""
    d = directory or runtime_dir()
    found = []
    try:
        paths = sorted(d.glob("*.json"))
    except OSError:
        return []
    for path in paths:
        try:
            reg = _reg_decoder.decode(path.read_bytes())
        except (OSError, msgspec.DecodeError):
            continue  # vanished meanwhile, or not ours
        if pid_alive(reg.pid, reg.proc_start):
            found.append(reg)
        elif clean:
            with contextlib.suppress(OSError):
                path.unlink()
            with contextlib.suppress(OSError):
                path.with_suffix(".sock").unlink()
    return found


def _safe(s: str, n: int) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", s)[:n] or "_"


class EventPublisher:
    """An `EventBus` subscriber that publishes each event on an XPUB socket.

    Call it, run `watch`, and close it (`aclose`) on the runtime's trio thread only:
    the socket is not thread-safe. `start_publisher` arranges all three.
    """

    def __init__(
        self,
        origin: Origin,
        *,
        directory: Path | None = None,
        hwm: int = SNDHWM,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        d = _ensure_private_dir(directory or runtime_dir())
        name = f"{_safe(origin.engine, 40)}-{origin.role}-{origin.rank}-{os.getpid()}"
        n = 1
        while (d / f"{name}.json").exists():  # another runtime of this process, same origin:
            n += 1  # binding its path would silently take its socket over
            name = f"{name.rsplit('~', 1)[0]}~{n}"
        self.sock_path = d / f"{name}.sock"
        self.reg_path = d / f"{name}.json"
        self.endpoint = f"ipc://{self.sock_path}"
        self.dropped = 0
        self._seq = 0
        self._topics: set[bytes] = set()
        sock = (context or zmq.Context.instance()).socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"cannot bind {self.endpoint}: {exc}") from None
        self._sock: zmq.Socket[Any] | None = sock
        self.registration = Registration(
            engine=origin.engine,
            role=origin.role,
            rank=origin.rank,
            pid=os.getpid(),
            endpoint=self.endpoint,
            started=time.time(),
            proc_start=max(0, _proc_start(os.getpid())),
        )
        tmp = self.reg_path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self.registration))
        os.replace(tmp, self.reg_path)  # a reader never sees half a record

    @property
    def watched(self) -> bool:
        """Someone subscribes (as far as `watch` has learnt)."""
        return bool(self._topics)

    def __call__(self, event: Event) -> None:
        if not self._topics:
            return  # nobody watches: nothing to send, nobody misses it
        sock = self._sock
        if sock is None:
            self.dropped += 1
            return
        self._seq += 1
        try:
            sock.send(
                _envelope_encoder.encode(Envelope(self._seq, self.dropped, event)), zmq.NOBLOCK
            )
        except zmq.ZMQError:  # Again, or a socket torn down under us: count, never raise
            self.dropped += 1

    async def watch(self) -> None:
        """Track subscriptions until cancelled.

        XPUB passes up a topic's first subscribe (byte 1 + topic) and its last
        unsubscribe (byte 0 + topic), including those of readers that vanished.
        The socket's FD is edge-triggered and a `send` on this thread can consume
        the edge, so besides waking on it, look again every second.
        """
        sock = self._sock
        while sock is not None:
            while True:
                try:
                    msg = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if msg[:1] == b"\x01":
                    self._topics.add(msg[1:])
                elif msg[:1] == b"\x00":
                    self._topics.discard(msg[1:])
            with trio.move_on_after(1.0):
                await trio.lowlevel.wait_readable(sock.FD)
            sock = self._sock

    def close(self) -> None:
        """Unregister and close (idempotent)."""
        sock, self._sock = self._sock, None
        for path in (self.reg_path, self.sock_path):
            with contextlib.suppress(OSError):
                path.unlink()
        if sock is not None:
            sock.close(linger=0)

    async def aclose(self) -> None:
        self.close()


def start_publisher(
    runtime: Runtime, bus: EventBus, *, directory: Path | None = None
) -> EventPublisher | None:
    """Publish `bus`'s events until `runtime` shuts down; None (logged) if that cannot be.

    Observability must never stop an engine: a failure here is a warning.
    """
    try:
        pub = EventPublisher(bus.origin, directory=directory)
    except (OSError, zmq.ZMQError) as exc:
        log.warning("kvflow: live events (inspect) disabled: %s", exc)
        return None
    bus.subscribe(pub)
    runtime.add_closer(pub.aclose)  # after tasks (the watcher) are cancelled
    runtime.spawn(pub.watch, name="kvflow-publish-watch")
    return pub


def open_subscriber(
    endpoint: str, context: zmq.Context[Any] | None = None, *, rcvhwm: int = 100_000
) -> zmq.Socket[Any]:
    """A SUB socket connected to a publisher, subscribed to everything."""
    sock = (context or zmq.Context.instance()).socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


class SeqTracker:
    """Counts the events one reader missed from one publisher (gaps in `seq`)."""

    def __init__(self) -> None:
        self.last = 0
        self.missed = 0
        self.publisher_dropped = 0

    def see(self, env: Envelope) -> int:
        """Account for `env`; return how many events were missed just before it."""
        gap = env.seq - self.last - 1 if self.last and env.seq > self.last else 0
        if env.seq <= self.last:  # the publisher restarted under the same endpoint
            gap = 0
        self.missed += gap
        self.last = env.seq
        self.publisher_dropped = env.dropped
        return gap

    @property
    def dropped(self) -> int:
        return self.missed + self.publisher_dropped
