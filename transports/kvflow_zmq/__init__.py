"""`zmq`: prefill/decode disaggregation over ZMQ, and over CUDA IPC on one host.

A producer worker holds a finished request's blocks and serves them from a
ROUTER socket bound to loopback (or a configured host) on a free port it
advertises; a consumer worker pulls them with a DEALER, layer by layer, into its
own blocks. Control frames are msgspec; block data rides as zero-copy frames
whose send completion is tracked before blocks are handed back.
"""

from ._transport import ZmqOptions, ZmqTransport

__all__ = ["ZmqOptions", "ZmqTransport"]
