"""Prefill/decode disaggregation (P/D): what every peer transport and both engines share.

- `params`: kvflow's part of vLLM's `kv_transfer_params`, and the checks a consumer
  makes before it believes them.
- `security`: which channel a configuration asks for (`channel_of`), the side channel's
  MACs and handshakes, the sealed params (the key files are `kvflow.keyfiles`').
- `claims`: a consumer's claims on its producers' blocks, renewed while a request waits.
- `offers`: a producer's held blocks (`HeldOffers`) and the renew protocol.
- `context`: `PeerContext`, a peer transport's `TransportContext` with what P/D needs
  (the side channel's security, refusals counted, the producer ranks each consumer
  rank reads).
- `peer_transport`: `PeerTransport`, the base every peer transport's producer and
  consumer build on (the side channel's serve loop, pulls, releases).
- `proxy`: `kvflow proxy`, a P/D proxy between OpenAI servers following vLLM's
  convention (standard library only: it runs without vLLM).

A peer transport author's names are here: the base, its options and context (also
exported by `kvflow`) and the helpers a producer holds offers with.
"""

from .._moved import old_submodule
from .context import PeerContext, PeerRead
from .offers import HeldOffers, NotHeld, Renew, answer_renew, renew_at, select_blocks
from .peer_transport import PeerOptions, PeerTransport

__all__ = [
    "HeldOffers",
    "NotHeld",
    "PeerContext",
    "PeerOptions",
    "PeerRead",
    "PeerTransport",
    "Renew",
    "answer_renew",
    "renew_at",
    "select_blocks",
]


def __getattr__(name: str) -> object:
    """`kvflow.pd.topology`, which 0.4 moved to `kvflow.geometry.topology` (it warns)."""
    return old_submodule(__name__, name)
