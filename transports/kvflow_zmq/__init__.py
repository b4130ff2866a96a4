"""`zmq`: prefill/decode disaggregation over ZMQ, and over CUDA IPC on one host.

A producer worker holds a finished request's blocks and serves them from a
ROUTER socket bound to loopback (or a configured host) on a free port it
advertises; a consumer worker pulls them with a DEALER, layer by layer, into its
own blocks. Control frames are msgspec; host block data rides as copies, so the
blocks go back to vLLM once they are queued (CUDA blocks on one host are copied
device to device over CUDA IPC).
"""

from ._transport import ZmqOptions, ZmqTransport

__all__ = ["ZmqOptions", "ZmqTransport"]
