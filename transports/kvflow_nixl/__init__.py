"""`nixl`: prefill/decode disaggregation over NIXL (CPU memory, UCX backend).

A producer worker holds a finished request's blocks and answers pulls on a
ZMQ ROUTER side channel (loopback or a configured host, a free port it
advertises) with its NIXL agent metadata and the blocks' descriptors; a
consumer worker READs them with NIXL, one transfer per layer, into its own
blocks. Each READ's NIXL notification tells the producer it may hand blocks
back. NIXL is imported lazily: this package imports without it, and `open()`
says how to install it.
"""

from ._transport import NixlOptions, NixlTransport

__all__ = ["NixlOptions", "NixlTransport"]
