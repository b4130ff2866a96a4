"""`redis`: a kvflow store transport over Redis or Valkey, for a KV prefix cache shared by
many machines.

One string value per chunk and shard, `<key_prefix><namespace>:<chunk key>:<shard>`,
holding the layer-major KV bytes and a trailer (key, namespace, shard, token count,
per-layer sizes and XXH3-64s). A save is one `SET` per chunk, sent once every layer is
final (atomic: Redis applies a SET only once its value arrived whole); a lookup is one
pipelined round trip of `EXISTS`; a load streams `GETRANGE` replies layer by layer
straight into vLLM's KV blocks and checks each layer before vLLM may use it. Eviction
is the server's: run it with `maxmemory` and `maxmemory-policy allkeys-lru`.

The client is a small RESP2 implementation on trio sockets (see `_resp.py` and the
README for why, with measurements).
"""

from __future__ import annotations

from ._transport import RedisOptions, RedisTransport

__all__ = ["RedisOptions", "RedisTransport"]
