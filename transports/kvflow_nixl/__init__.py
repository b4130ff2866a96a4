"""`nixl`: prefill/decode disaggregation over NIXL (CPU or CUDA memory, UCX backend).

A producer worker holds a finished request's blocks and answers pulls on a
ZMQ ROUTER side channel (loopback or a configured host, a free port it
advertises) with the offered block ids (and, on a consumer's first pull, its
NIXL agent metadata and where its KV memory is); a consumer worker READs them
with NIXL, one transfer per layer, into its own blocks. One NIXL notification,
sent once every READ of the pull is done, tells the producer it may hand the
blocks back. NIXL is imported lazily: this package imports without it, and `open()`
says how to install it.
"""

from ._transport import NixlOptions, NixlTransport

__all__ = ["NixlOptions", "NixlTransport"]
