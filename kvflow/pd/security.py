"""Who may use a P/D side channel, and which P/D params a consumer believes.

A deployment shares one secret (`kvflow keygen` writes it; every instance reads
it from `key_file` or the `KVFLOW_KEY` environment variable, never from a
request). From it `Channel` derives, with HMAC-SHA256 and a label per use:

- the MACs that seal every control frame of the peer transports' side channel
  (`seal` / `open`), one key per direction, an answer's MAC also covering its request's
  nonce and its index: a frame without a valid MAC is dropped unanswered, so a peer
  without the secret learns nothing, not even which requests exist, and a frame sent
  back, into another pull or out of order fails too;
- in `kv-in-clear` mode, each connection's one-time handshake credential (ZMQ PLAIN: a
  nonce and the time, and their MAC; accepted once, within a window);
- in `encrypted` mode, the CURVE key pairs of ZMQ's built-in encryption
  (`secure`): every frame, KV bytes included, is encrypted on the wire;
- the MAC of a producer's P/D params (`sign`), which binds the offer id, the
  producer's engine id, addresses and blocks to a digest of the prompt
  (`prompt_digest`: its tokens and salt, so LoRA and `cache_salt` too); a consumer
  checks it against its own request before it opens any socket (`kvflow.pd.params`).

Without a deployment secret, a P/D engine uses a *host key* (`kvflow.keyfiles.host_key`):
one made on first use in the user's private runtime directory, shared by every instance
this user runs on this host, so params are signed and the side channel authenticated there too; a
channel with a host key binds and pulls on loopback only. A keyless channel (`insecure`,
which also allows other hosts) believes unsigned params. See docs/security.md for the
threat model.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
import secrets
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import zmq
from zmq.utils import z85

from .._moved import old_names
from ..config import ChannelMode, ConfigError, KVFlowConfig
from ..keyfiles import SecurityError, host_key, read_key
from ..zmqio import BadFrame, TrioSocket, shown

__all__ = [
    "REJECT_REASONS",
    "Channel",
    "Rejections",
    "channel_of",
    "prompt_digest",
]

MAC_BYTES = 16
"""A sealed frame starts with this many bytes of HMAC-SHA256 over the rest."""

ZAP_DOMAIN = b"kvflow"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq sends a context's handshake checks (ZeroMQ RFC 27)."""
PLAIN, CURVE = b"PLAIN", b"CURVE"
PLAIN_USER = b"kvflow"

REJECT_REASONS = (
    "malformed",
    "address",
    "signature",
    "prompt",
    "unauthenticated",
    "frame",
    "offers",
)
"""Why kvflow refused an input from outside: P/D params that do not parse (`malformed`),
name an address it may not connect to (`address`), are not this deployment's
(`signature`) or were made for another prompt (`prompt`); a side-channel frame without
this deployment's MAC (`unauthenticated`) or that is malformed or out of bounds
(`frame`); a prefill past what offers may hold (`offers`: `max_offer_fraction`), which
gets no P/D params."""

LOG_EVERY_S = 10.0

log = logging.getLogger("kvflow.pd.security")


def prompt_digest(token_ids: Sequence[int], salt: str = "", scope: str = "") -> str:
    """What a request's KV in one KV cache group depends on: the group (`scope`:
    `Fingerprint.pd_scope`, the model, its dtype and which group), the prompt's tokens and
    its salt (cache salt, LoRA, multimodal inputs), as a short hex digest. Params of one
    group never pass for another's (a hybrid model's groups, or another model pool that
    shares the key)."""
    h = hashlib.blake2b(digest_size=16, person=b"kvflow-prompt")
    for part in (scope, salt):
        encoded = part.encode()
        h.update(len(encoded).to_bytes(8, "little") + encoded)
    h.update(array("q", token_ids).tobytes())
    return h.hexdigest()


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


@functools.lru_cache(maxsize=64)
def _derive(key: bytes, label: str) -> bytes:
    """The key of one use (`label`) of the deployment secret `key` (computed once: a
    frame's MAC needs it each time)."""
    return hmac.digest(key, b"kvflow/1/" + label.encode(), "sha256")


@dataclass(frozen=True)
class Channel:
    """The deployment's side-channel security (see the module text)."""

    key: bytes | None = None
    mode: ChannelMode = "encrypted"
    insecure: bool = False
    """Allow a keyless channel beyond loopback (anyone who reaches it can pull KV)."""
    host: bool = False
    """`key` is this host's key (`host_key`), not a deployment's: loopback only."""

    @property
    def keyed(self) -> bool:
        return self.key is not None

    def _derive(self, label: str) -> bytes:
        assert self.key is not None
        return _derive(self.key, label)

    # -- control frames ----------------------------------------------------------
    def seal(self, payload: bytes, to: Toward, bind: bytes = b"") -> bytes:
        """A control frame as sent toward the `to` side: the payload after its MAC
        (keyless: as it is). Each direction has its own MAC key, so a frame sent back
        to where it came from fails; the MAC also covers `bind` (not sent), what the
        receiver expects the frame to answer (`kvflow.pd.offers.answer_bind`: its
        request's nonce and the answer's index), so an answer of another pull, or out of
        its order, fails too."""
        if self.key is None:
            return payload
        return self._mac(payload, to, bind) + payload

    def open(self, frame: Any, to: Toward, bind: bytes = b"") -> bytes | memoryview:
        """The payload of a frame sealed toward `to` for `bind`; `BadFrame` if its MAC is
        wrong (another key, another direction, another answer, or altered)."""
        data = frame if isinstance(frame, bytes | memoryview) else memoryview(frame)
        if self.key is None:
            return data
        mac, payload = bytes(data[:MAC_BYTES]), data[MAC_BYTES:]
        if len(data) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(payload, to, bind)):
            raise BadFrame("a frame without a valid MAC (a peer without this deployment's key)")
        return payload

    def _mac(self, payload: bytes | memoryview, to: Toward, bind: bytes) -> bytes:
        if len(bind) > 255:
            raise ValueError("a frame's binding is at most 255 bytes")
        mac = hmac.new(self._derive(f"frame-to-{to}"), bytes([len(bind)]) + bind, "sha256")
        mac.update(payload)
        return mac.digest()[:MAC_BYTES]

    # -- sockets -----------------------------------------------------------------
    def secure(self, sock: zmq.Socket[Any], *, server: bool) -> None:
        """Set up `sock` for this channel before it binds or connects: with a key, every
        connection's handshake proves the peer holds it (ZMQ's PLAIN mechanism with a
        password derived from the key, checked by `answer_zap`; CURVE when encrypted),
        so a stranger's connection ends before libzmq takes in any message."""
        if self.key is None:
            return
        if server:
            sock.zap_domain = ZAP_DOMAIN
        if self.mode == "kv-in-clear":
            if server:
                sock.plain_server = True
            else:  # one-time: a nonce and the time, MAC'd (`_password`)
                nonce, now_ms = secrets.token_hex(16).encode(), time.time_ns() // 1_000_000
                user = b"%s:%s:%d" % (PLAIN_USER, nonce, now_ms)
                sock.plain_username, sock.plain_password = user, self._password(user)
            return
        if not zmq.has("curve"):
            raise SecurityError("channel 'encrypted' needs libzmq with CURVE; this one has none")
        server_secret, server_public = self._curve("server")
        if server:
            sock.curve_secretkey = server_secret
            sock.curve_publickey = server_public
            sock.curve_server = True
        else:
            sock.curve_secretkey, sock.curve_publickey = self._curve("client")
            sock.curve_serverkey = server_public

    def zap_socket(self, zctx: zmq.Context[Any]) -> ZapSocket | None:
        """The socket through which libzmq asks `zctx`'s keyed producer sockets' handshakes
        to be checked (ZAP, ZeroMQ RFC 27); `answer_zap` answers it. None keyless. Bind it
        before the producer binds: until it is answered, handshakes wait."""
        if self.key is None:
            return None
        sock = zctx.socket(zmq.REP)
        sock.bind(ZAP_ENDPOINT)
        return ZapSocket(sock)

    async def answer_zap(self, sock: ZapSocket) -> None:
        """Answer every handshake check on `sock` until cancelled: a one-time PLAIN
        credential made with this deployment's key (`secure`) and not seen before, or a
        CURVE client key derived from it, passes; anything else fails (libzmq then ends
        the connection before it takes in any message). Each check is answered in the
        step that received it, a burst in batches (`TrioSocket.answer_all`): a flood of
        handshakes never holds the loop, and a `serve` cancelled and started again finds
        the socket ready for the next check."""
        await sock.answer_all(functools.partial(self._zap_reply, sock))

    def _zap_reply(self, sock: ZapSocket, frames: list[Any]) -> list[bytes]:
        """The ZAP reply to one request (RFC 27: version, request id, status, text, user
        id, metadata)."""
        request_id = bytes(frames[1]) if len(frames) > 1 else b""
        ok = len(frames) >= 6 and frames[0] == b"1.0"
        if ok and self.mode == "kv-in-clear":
            creds = [bytes(f) for f in frames[5:]]
            ok = (
                len(creds) == 3
                and creds[0] == PLAIN
                and hmac.compare_digest(creds[2], self._password(creds[1]))
                and sock.first_use(creds[1])  # only a credential this key made is kept
            )
        elif ok:
            ok = _same(frames[5:], [CURVE, z85.decode(self._curve("client")[1])])
        status = [b"200", b"OK"] if ok else [b"400", b"not this deployment's key"]
        return [b"1.0", request_id, *status, b"", b""]

    def _password(self, user: bytes) -> bytes:
        """The PLAIN password of `kv-in-clear` connections for the one-time user name
        `user` (a nonce and the time, `secure`): its MAC. PLAIN sends both in the clear;
        an on-path attacker who reads them cannot use them again (`ZapSocket.first_use`),
        nor make others without the key."""
        return hmac.digest(self._derive("plain"), user, "sha256").hex().encode()

    def _curve(self, label: str) -> tuple[bytes, bytes]:
        """A CURVE key pair (z85 secret, z85 public) derived from the deployment key."""
        secret = z85.encode(self._derive(f"curve-{label}"))
        return secret, zmq.curve_public(secret)

    def _beyond_loopback(self) -> str:
        """Why this channel may not bind or pull beyond loopback ("" if it may)."""
        if self.host:
            return "this engine's key is its host's (no key_file or $KVFLOW_KEY)"
        if not (self.keyed or self.insecure):
            return "this engine has no key"
        return ""

    def bind_problem(self, host: str) -> str:
        """Why a producer may not listen on `host` ("" if it may)."""
        if is_loopback(host) or not (why := self._beyond_loopback()):
            return ""
        return (
            f"binding the P/D side channel on {host}: {why}, so only this host's instances "
            "can use it: make a key with `kvflow keygen PATH` and give every instance "
            "kv_connector_extra_config['key_file'] = PATH (or $KVFLOW_KEY), or set "
            "'insecure': true (anyone who reaches the port can read KV)"
        )

    def address_problem(self, address: str) -> str:
        """Why a consumer may not connect to `address` ("" if it may): a `tcp://` IP
        literal and port, loopback unless the channel has a deployment key or is
        insecure."""
        try:
            url = urlsplit(address)
            host, port = url.hostname or "", url.port
            ipaddress.ip_address(host)
        except ValueError:
            return "not a tcp://IP:port address"
        extra = url.path or url.query or url.fragment or "@" in url.netloc
        if url.scheme != "tcp" or not port or extra:
            return "not a tcp://IP:port address"
        if not is_loopback(host) and (why := self._beyond_loopback()):
            return f"not a loopback address, and {why}"
        return ""

    # -- P/D params --------------------------------------------------------------
    def sign(self, message: bytes) -> str:
        """The hex MAC of a producer's P/D params ("" keyless)."""
        if self.key is None:
            return ""
        return hmac.digest(self._derive("params"), message, "sha256").hex()

    def signed(self, message: bytes, mac: str) -> bool:
        """Whether `mac` is this deployment's MAC of `message` (keyless: no MAC at all)."""
        return hmac.compare_digest(self.sign(message), mac)


def _same(got: Sequence[bytes], want: Sequence[bytes]) -> bool:
    """Whether a handshake's mechanism and credentials are `want`'s (constant time)."""
    return len(got) == len(want) and all(
        hmac.compare_digest(bytes(g), w) for g, w in zip(got, want, strict=True)
    )


Toward = Literal["producer", "consumer"]
"""The side a control frame is sent toward (each direction has its own MAC key)."""
PLAIN_WINDOW_S = 60.0
"""A one-time PLAIN credential is accepted this long around the time it names (the
clocks of a consumer and its producer must agree this well)."""
MAX_PLAIN_SEEN = 1 << 17
"""The most one-time credentials a producer remembers (those of `PLAIN_WINDOW_S` on
either side of now); past it, new connections are refused until some expire."""


class ZapSocket(TrioSocket):
    """The REP socket answering handshake checks (`Channel.zap_socket`), and the one-time
    PLAIN credentials it accepted whose window has not passed: one seen again is a
    replay (a sniffed handshake) and fails."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        super().__init__(sock)
        self.seen: dict[bytes, float] = {}
        """Accepted user names -> when they expire (wall clock), in about that order."""

    def first_use(self, user: bytes, now: float | None = None) -> bool:
        """Whether `user` (`kvflow:NONCE:MS`, already known to be this key's) is fresh
        and never seen; if so, remember it until its window passes."""
        now = time.time() if now is None else now
        parts = user.split(b":")
        if len(parts) != 3 or len(parts[1]) != 32 or not parts[2].isdigit():
            return False
        made = int(parts[2]) / 1000
        if abs(now - made) > PLAIN_WINDOW_S or user in self.seen:
            return False
        seen = self.seen
        while seen:  # in arrival order: one that expires later holds the rest back
            oldest = next(iter(seen))
            if seen[oldest] > now:
                break
            del seen[oldest]
        if len(seen) >= MAX_PLAIN_SEEN:  # never forget one before its window passes
            return False
        seen[user] = made + PLAIN_WINDOW_S
        return True


class Rejections:
    """Report refused inputs: each to `sink` (a counter), and to the log at most once per
    reason every `LOG_EVERY_S`, with how many were not logged (a flood of bad input must
    not flood the log)."""

    def __init__(self, where: str, sink: Callable[[str, str], None] | None = None) -> None:
        self.where = where
        self.sink = sink
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (last logged, since)

    def __call__(self, reason: str, detail: str) -> None:
        detail = shown(detail, 300)  # it may quote a peer or a client: one line, bounded
        if self.sink is not None:
            self.sink(reason, detail)
        now = time.monotonic()
        last, quiet = self._logged.get(reason, (-LOG_EVERY_S, 0))
        if now - last < LOG_EVERY_S:
            self._logged[reason] = (last, quiet + 1)
            return
        self._logged[reason] = (now, 0)
        more = f" ({quiet} more since the last such line)" if quiet else ""
        log.warning("kvflow %s: refused (%s): %s%s", self.where, reason, detail, more)


def channel_of(cfg: KVFlowConfig, *, peer: bool = True) -> Channel:
    """The side-channel security `cfg` asks for: its key read from `key_file` or
    `$KVFLOW_KEY`, else, for a `peer` transport not told `insecure`, this host's key."""
    try:
        key = read_key(cfg.key_file)
    except SecurityError as exc:
        raise ConfigError(f"kv_connector_extra_config['key_file']: {exc}") from None
    if key is not None:
        return Channel(key, cfg.channel or "encrypted", cfg.insecure)
    if cfg.insecure or not peer:
        if cfg.channel is not None and peer:
            raise ConfigError(
                f"kv_connector_extra_config['channel'] is {cfg.channel!r} but 'insecure' "
                "leaves the side channel keyless: drop one of them"
            )
        return Channel(None, "encrypted", cfg.insecure)
    try:
        key = host_key()
    except SecurityError as exc:
        raise ConfigError(f"kv_connector_extra_config: no key_file, and {exc}") from None
    return Channel(key, cfg.channel or "kv-in-clear", host=True)


# The key files 0.4 moved to kvflow.keyfiles, by their old names until 0.5.
__getattr__ = old_names(
    __name__,
    {
        n: f"kvflow.keyfiles:{n}"
        for n in ("keygen", "runtime_dir", "KEY_ENV", "RUNTIME_ENV", "HOST_KEY")
    },
)
