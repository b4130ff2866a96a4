"""HTTP/1.1 on trio with h11, for `kvflow proxy` (decision 103).

- `server`: `serve`, the server that answers the proxy's clients under the limits a
  server facing untrusted clients needs (`Limits`), with strict framing.
- `client`: `Client`, the calls to the servers behind the proxy, connections kept alive.
"""

from .client import Answer, Client, UpstreamError
from .server import Limits, Reply, Request, serve

__all__ = ["Answer", "Client", "Limits", "Reply", "Request", "UpstreamError", "serve"]
