"""Prefill/decode disaggregation (P/D): what every peer transport and both engines share.

- `params`: kvflow's part of vLLM's `kv_transfer_params`, and the checks a consumer
  makes before it believes them.
- `security`: the deployment key, the side channel's MACs and the sealed params.
- `claims`: a consumer's claims on its producers' blocks, renewed while a request waits.
- `offers`: a producer's held blocks (`HeldOffers`) and the renew protocol.
- `peer_transport`: `PeerTransport`, the base every peer transport's producer and
  consumer build on (the side channel's serve loop, pulls, releases).
- `proxy`: `kvflow proxy`, a P/D proxy between OpenAI servers following vLLM's
  convention (standard library only: it runs without vLLM).

The names a transport author needs are re-exported by `kvflow`.
"""

__all__: list[str] = []
